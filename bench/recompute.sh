#!/usr/bin/env bash
# Activation recomputation (docs/recompute.md): step time and activation memory
# of recompute none / selective / full, same model, same run.
#
#   bench/recompute.sh [--quick] [--repeat R] [--steps S] [--warmup W] [--threads N] [--out results.jsonl]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), B=4 T=256 and B=1 T=1024 (1024
# tokens a step each), one process, --threads threads (default 2); one step =
# forward + backward + AdamW, each timed (`lattice bench recompute --json`).
# --repeat R runs every mode R times (each case's modes in turn, then again)
# and keeps each mode's fastest step (other load only slows a run down).
# --quick: L=2 C=128 H=4 V=1000, T=64 and 128 (a smoke test of the script).
#
# Columns: the step and its parts; the overhead against none; MemoryTracker's
# activations peak (what the micro-batch stores, the one-layer work arrays,
# the backward's gradient buffers) and the stored bytes (what the forward
# keeps for the backward), with their ratios to none. Below each case, the
# forward's share of none's step and the share of the forward full
# recomputation runs again (the whole forward less a one-layer model's,
# timed in the same run: the L - 1 layers before the last).
#
# Targets (PASS/MISS lines): selective's overhead <= 8%; full's overhead
# within 5 points of the re-run forward's share.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
common_defaults
THREADS=2

while [[ $# -gt 0 ]]; do
  case "$1" in
    --threads) need "$@"; THREADS="$2"; shift 2 ;;
    *) common_option "$@" || { echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2; }
       shift "$COMMON_SHIFT" ;;
  esac
done
posint --repeat "$REPEAT"
posint --threads "$THREADS"
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 3); fi
if [[ -z "$WARMUP" ]]; then WARMUP=1; fi
posint --steps "$STEPS"
[[ "$WARMUP" =~ ^[0-9]+$ ]] || { echo "$BENCH_NAME: --warmup needs an integer >= 0, got '$WARMUP'" >&2; exit 2; }
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }

MODEL=() CASES=(--case 4:256 --case 1:1024)
if [[ $QUICK == 1 ]]; then
  MODEL=(--set model.n_layer=2 --set model.n_embd=128 --set model.n_head=4 --set model.vocab_size=1000)
  CASES=(--case 2:64 --case 1:128)
fi
RESULTS=${OUT:-$(mktemp)}
: > "$RESULTS"
echo "$BENCH_NAME: $(date -u '+%Y-%m-%d %H:%M UTC'), $THREADS threads, $STEPS steps after $WARMUP, repeat $REPEAT" >&2
"$LATTICE_BIN" bench recompute "${MODEL[@]}" "${CASES[@]}" --threads "$THREADS" --steps "$STEPS" \
  --warmup "$WARMUP" --repeat "$REPEAT" --json >> "$RESULTS"

"$PYTHON" - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
cases = []
for r in rows:
    key = (r["batch"], r["seq"])
    if key not in cases:
        cases.append(key)
mib = lambda b: b / 2**20
print(f"CPU: {rows[0]['cpu']}, {rows[0]['threads']} threads; "
      f"model L={rows[0]['n_layer']} C={rows[0]['n_embd']} H={rows[0]['n_head']}\n")
print("| B x T | mode | step ms | forward | backward | AdamW | overhead | activ peak MiB | x none | stored MiB | x none |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
verdicts = []
for b, t in cases:
    rs = [r for r in rows if (r["batch"], r["seq"]) == (b, t)]
    none = next(r for r in rs if r["mode"] == "none")
    for r in rs:
        print(f"| {b} x {t} | {r['mode']} | {r['step_ms']:.0f} | {r['forward_ms']:.0f} | {r['backward_ms']:.0f} | "
              f"{r['optimizer_ms']:.0f} | {100 * r['overhead']:+.1f}% | {mib(r['peak_activation_bytes']):.1f} | "
              f"{r['peak_activation_bytes'] / none['peak_activation_bytes']:.2f} | {mib(r['stored_activation_bytes']):.1f} | "
              f"{r['stored_activation_bytes'] / none['stored_activation_bytes']:.2f} |")
    share, rerun = none["forward_share_none"], none["rerun_forward_share"]
    verdicts.append(f"{b} x {t}: forward {100 * share:.1f}% of none's step; the forward full re-runs "
                    f"({none['n_layer'] - 1} layers) {100 * rerun:.1f}%")
    for r in rs:
        if r["mode"] == "selective":
            verdicts.append(f"  selective overhead {100 * r['overhead']:.1f}% <= 8%: "
                            f"{'PASS' if r['overhead'] <= 0.08 else 'MISS'}")
        if r["mode"] == "full":
            ok = abs(r["overhead"] - rerun) <= 0.05
            verdicts.append(f"  full overhead {100 * r['overhead']:.1f}% against the re-run forward's "
                            f"{100 * rerun:.1f}% (within 5 points): {'PASS' if ok else 'MISS'}")
print()
print("\n".join(verdicts))
EOF
