#!/usr/bin/env bash
# Convergence of compressed data-parallel training: every gradient codec, with
# and without error feedback, on the bundled Moby-Dick tokens, one chart.
#
#   bench/compress_convergence.sh [--quick] [--ranks N] [--steps S] [--plot PREFIX]
#                                 [--rows FILTER] [--set KEY=VALUE ...] [--timeout SECONDS]
#                                 [--adam-warmup W]
#
# Model: the demo's (configs/demo.toml: L=4 C=128 H=4, V=50257, T=128) with
# micro-batches of 8 sequences per rank, --ranks data-parallel ranks (default
# 4, oversubscribed on fewer cores: this measures loss, not speed), --steps
# optimizer steps (default 300; AdamW lr 3e-3 -> 3e-4, 30 warm-up), the
# validation loss every 50 steps (8 batches) and at the end. --quick: dp=2,
# 40 steps, evaluation every 20 (a smoke test of the script).
#
# Rows: none (f32 gradients), bf16, f16, int8, onebit, topk (1%), powersgd
# (rank 4) with error feedback, onebit-noef, topk-noef without it, and
# compute-bf16, compute-f16: uncompressed at precision.compute=bf16 / f16
# (mixed precision, docs/precision.md), and 1-bit Adam (compression.momentum,
# docs/parallel.md) after --adam-warmup ordinary steps (default 60): adam-exact
# (the momentum reduced in f32: what freezing v costs alone), onebit-adam,
# topk-adam (error feedback on the momentum); --rows keeps those whose
# name contains one of the comma-separated filters. --set passes a config
# override to every row (e.g. compression.warmup_steps=60, optim.grad_clip=0). Each row's metrics JSONL
# is kept under $TMPDIR; --plot PREFIX (default: none) draws PREFIXloss.svg and
# PREFIXval_loss.svg with every row (lattice inspect RUN.jsonl ... --plot).
#
# Targets (PASS/MISS): the final validation loss of every codec with error
# feedback within 3% of uncompressed; onebit and topk without error feedback
# worse than with it; bf16 compute's loss curve within 2% of f32's at every
# logged step (train loss) and evaluation.
set -euo pipefail

cd "$(dirname "$0")/.."
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
PYTHON=${PYTHON:-/usr/bin/python3}
RANKS=4 STEPS=300 EVAL=50 QUICK=0 PLOT="" ROWS_FILTER="" TIMEOUT=3600 ADAM_WARMUP=60
EXTRA=()

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "compress_convergence: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --ranks) need "$@"; RANKS="$2"; shift 2 ;;
    --steps) need "$@"; STEPS="$2"; shift 2 ;;
    --plot) need "$@"; PLOT="$2"; shift 2 ;;
    --rows) need "$@"; ROWS_FILTER="$2"; shift 2 ;;
    --set) need "$@"; EXTRA+=(--set "$2"); shift 2 ;;
    --timeout) need "$@"; TIMEOUT="$2"; shift 2 ;;
    --adam-warmup) need "$@"; ADAM_WARMUP="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compress_convergence: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ $QUICK == 1 ]]; then RANKS=2 STEPS=40 EVAL=20 ADAM_WARMUP=10; fi
for v in "$RANKS" "$STEPS" "$TIMEOUT" "$ADAM_WARMUP"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "compress_convergence: '$v' is not a positive integer" >&2; exit 2; }
done
[[ -x "$LATTICE_BIN" ]] || { echo "compress_convergence: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
command -v mpiexec >/dev/null || { echo "compress_convergence: mpiexec not found (Debian: openmpi-bin)" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/lattice_compress.XXXXXX")
echo "compress_convergence: metrics in $work" >&2

# name codec error_feedback compute [momentum]
ROWS=("none none true f32" "bf16 bf16 true f32" "f16 f16 true f32" "int8 int8 true f32" "onebit onebit true f32"
      "topk topk true f32" "powersgd powersgd true f32" "onebit-noef onebit false f32" "topk-noef topk false f32"
      "compute-bf16 none true bf16" "compute-f16 none true f16" "adam-exact none true f32 momentum"
      "onebit-adam onebit true f32 momentum" "topk-adam topk true f32 momentum")
kept=()
for row in "${ROWS[@]}"; do
  read -r name codec ef compute momentum <<< "$row"
  if [[ -n "$ROWS_FILTER" ]]; then
    keep=0
    IFS=',' read -ra pieces <<< "$ROWS_FILTER"
    for f in "${pieces[@]}"; do [[ "$name" == *"$f"* ]] && keep=1; done
    [[ $keep == 1 ]] || continue
  fi
  sets=(-c configs/demo.toml --set train.micro_batch_size=8 --set train.steps="$STEPS" --set train.eval_every="$EVAL"
        --set train.threads=1 --set parallel.dp="$RANKS" --set log.every=50
        --set checkpoint.dir= --set checkpoint.every=0 --set checkpoint.keep=3
        --set log.metrics_file="$work/$name.jsonl" --set compression.grad="$codec" --set precision.compute="$compute")
  [[ $codec == none ]] || sets+=(--set compression.error_feedback="$ef")
  [[ -z "$momentum" ]] || sets+=(--set compression.momentum=true --set compression.warmup_steps="$ADAM_WARMUP")
  for ((i = 0; i < ${#EXTRA[@]}; i += 2)); do
    # compression.* overrides apply to the compressed rows only (they are refused without a codec)
    [[ ($codec == none || -n "$momentum") && ${EXTRA[i+1]} == compression.* ]] && continue
    sets+=("${EXTRA[i]}" "${EXTRA[i+1]}")
  done
  echo "== $name (dp=$RANKS, $STEPS steps)" >&2
  timeout "$TIMEOUT" mpiexec -n "$RANKS" --oversubscribe --bind-to none "$LATTICE_BIN" train "${sets[@]}" \
    > "$work/$name.log" 2>&1 || { echo "compress_convergence: $name failed, see $work/$name.log:" >&2; tail -5 "$work/$name.log" >&2; }
  [[ -s "$work/$name.jsonl" ]] && kept+=("$work/$name.jsonl")
done
if [[ -n "$PLOT" && ${#kept[@]} -gt 0 ]]; then "$LATTICE_BIN" inspect "${kept[@]}" --plot "$PLOT" | grep wrote >&2; fi

CPU=$("$LATTICE_BIN" bench peak --json 2>/dev/null | "$PYTHON" -c 'import json,sys; print(json.loads(sys.stdin.readline()).get("cpu","?"))' || echo "?")
"$PYTHON" - "$work" "$RANKS" "$STEPS" "$CPU" "${EXTRA[*]:-}" <<'PY'
import json, math, os, sys
work, ranks, steps, cpu, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = ["none", "bf16", "f16", "int8", "onebit", "topk", "powersgd", "onebit-noef", "topk-noef", "compute-bf16",
        "compute-f16", "adam-exact", "onebit-adam", "topk-adam"]
curves = {}
res = {}
for r in rows:
    path = os.path.join(work, r + ".jsonl")
    if not os.path.exists(path):
        continue
    lines = [json.loads(l) for l in open(path) if l.strip()]
    val = [l["val_loss"] for l in lines if l.get("val_loss") is not None and math.isfinite(l["val_loss"])]
    train = [l["loss"] for l in lines if "loss" in l]
    curves[r] = ({l["step"]: l["loss"] for l in lines if "loss" in l},
                 {l["step"]: l["val_loss"] for l in lines if l.get("val_loss") is not None})
    sent = sum(l.get("grad_bytes", 0) for l in lines)
    full = sum(l.get("grad_bytes_uncompressed", 0) for l in lines)
    # the share over the compressed steps alone (past a warm-up)
    past = [l for l in lines if l.get("grad_bytes", 0) != l.get("grad_bytes_uncompressed", 0)]
    psent, pfull = sum(l["grad_bytes"] for l in past), sum(l["grad_bytes_uncompressed"] for l in past)
    res[r] = dict(val=val[-1] if val else float("nan"), train=sum(train[-10:]) / max(1, len(train[-10:])),
                  share=(sent / full) if full else 1.0, past=(psent / pfull) if pfull else 1.0, ms=sum(l.get("step_ms", 0) for l in lines) / max(1, len(lines)))
print(f"\nCPU: {cpu}; dp={ranks} (oversubscribed: loss only), {steps} steps, demo model, Moby-Dick"
      + (f"; {extra}" if extra else ""))
print(f"{'row':<12} {'final val':>9} {'vs none':>8} {'train (last 10)':>15} {'bytes share':>11} "
      f"{'compressed steps':>16}")
base = res.get("none", {}).get("val")
for r in rows:
    if r not in res:
        print(f"{r:<12} {'not run':>9}")  # filtered out by --rows, or failed (its log says why)
        continue
    d = res[r]
    rel = f"{100 * (d['val'] / base - 1):+7.2f}%" if base else ""
    print(f"{r:<12} {d['val']:9.4f} {rel:>8} {d['train']:15.4f} {d['share']:11.4f} {d['past']:16.4f}")
print("\ntargets:")
def check(label, ok, detail):
    print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {label}: {detail}")
for r in ["bf16", "f16", "int8", "onebit", "topk", "powersgd", "onebit-adam", "topk-adam"]:
    if r in res and base:
        rel = res[r]["val"] / base - 1
        check(f"{r} with error feedback within 3% of uncompressed", abs(rel) <= 0.03, f"{100 * rel:+.2f}%")
for r in ["onebit", "topk"]:
    a, b = res.get(r), res.get(r + "-noef")
    if a and b:
        check(f"{r} without error feedback worse than with it", b["val"] > a["val"],
              f"{b['val']:.4f} vs {a['val']:.4f}")
def curve_gap(a, b):
    """The largest relative difference of two {step: loss} curves over their common steps."""
    common = [s for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    return max((abs(a[s] / b[s] - 1) for s in common), default=None)
for r in ["compute-bf16", "compute-f16"]:
    if r in curves and "none" in curves:
        tr, va = curve_gap(curves[r][0], curves["none"][0]), curve_gap(curves[r][1], curves["none"][1])
        ok = None if tr is None else tr <= 0.02 and (va is None or va <= 0.02)
        label = "bf16" if r.endswith("bf16") else "f16"
        check(f"{label} vs f32 compute loss curves within 2% (every logged step)", ok,
              f"train loss within {100 * (tr or 0):.2f}%, val loss within {100 * (va or 0):.2f}%")
PY
