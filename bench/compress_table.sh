#!/usr/bin/env bash
# Gradient compression at dp=2 and dp=4: every lattice codec and PyTorch DDP's
# communication hooks, same model, initial weights and batches, one table of
# bytes per step, step time and final loss.
#
#   bench/compress_table.sh [--quick] [--steps S] [--ranks "2 4"] [--rows FILTER]
#                           [--out results.jsonl] [--timeout SECONDS]
#   bench/compress_table.sh --table results.jsonl
#
# Model and run: the demo's (configs/demo.toml: L=4 C=128 H=4 V=50257 T=128, AdamW
# lr 3e-3 -> 3e-4 cosine after 30 warm-up steps, weight decay 0.1, clip 1.0),
# 8 sequences per rank per step, 1 thread per rank, --steps steps (default 100;
# --quick: 20), on Moby-Dick (data/moby, scripts/setup.sh), the validation loss
# once after the last step (8 batches per rank). Both sides start from the same
# GPT-2-style initial weights (bench/torch_ddp_hooks.py --write-init, seed 1337;
# lattice reads them through checkpoint.init_from) and read the same batches
# (lattice's sampler, reimplemented in torch_ddp_hooks.py): uncompressed, the
# two implementations' losses agree to float rounding.
#
# Rows, for each dp of --ranks:
#   lattice  none bf16 f16 int8 onebit topk (1%), error feedback on; powersgd
#            (compression.rank=4, 2 uncompressed steps first as PyTorch's hook
#            needs) when `lattice train --help-config` lists it, else "not built"
#   pytorch  bench/torch_ddp_hooks.py, gloo, ranks started by hand (env://):
#            allreduce (no hook), fp16 and bf16 compress hooks, bf16 through a
#            wrapper that skips DDP's CUDA check, powerSGD_hook rank 4 (start
#            iteration 2) as is and with each bucket waited for in the hook
# --rows keeps rows whose "impl-compressor" name (e.g. lattice-topk,
# pytorch-powersgd) contains one of the comma-separated filters. --out appends
# the rows' results (JSON lines) to a file; --table FILE runs nothing and prints
# the table of such a file (a row run again replaces its earlier result: e.g.
# --rows lattice-powersgd --out FILE once lattice has it, then --table FILE).
#
# Columns: bytes each rank sends per step by ring accounting (an all-reduce of b
# bytes over n ranks sends 2(n-1)/n b; lattice's grad_bytes metric, PyTorch's
# from the sizes the hooks all-reduce), their share of the f32 all-reduce, the
# mean step time of the slowest rank after the first 2 steps, the train loss of
# the last step (mean over ranks) and the final validation loss; status is "ok"
# or the run's error line. A failed row's log is kept under the work directory.
# dp=4 runs 4 single-thread ranks: on a 2-core machine that is oversubscribed,
# its step times say little.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
PYTHON=${PYTHON:-/usr/bin/python3}
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
STEPS=100 RANKS_LIST="2 4" QUICK=0 ROWS_FILTER="" OUT="" TIMEOUT=1800 SKIP=2 TABLE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --steps) need "$@"; posint --steps "$2"; STEPS="$2"; shift 2 ;;
    --ranks) need "$@"; RANKS_LIST="$2"; shift 2 ;;
    --rows) need "$@"; ROWS_FILTER="$2"; shift 2 ;;
    --out) need "$@"; OUT="$2"; shift 2 ;;
    --timeout) need "$@"; posint --timeout "$2"; TIMEOUT="$2"; shift 2 ;;
    --table) need "$@"; TABLE="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $QUICK == 1 ]] && STEPS=20
if [[ -n "$TABLE" ]]; then
  [[ -s "$TABLE" ]] || { echo "$BENCH_NAME: --table $TABLE: no such file, or empty" >&2; exit 2; }
  results=$TABLE
  STEPS=$("$PYTHON" -c 'import json,sys; print(max(json.loads(l).get("steps") or 0 for l in open(sys.argv[1])))' "$TABLE")
else
for n in $RANKS_LIST; do posint --ranks "$n"; [[ $n -ge 2 ]] || { echo "$BENCH_NAME: --ranks needs counts >= 2, got $n" >&2; exit 2; }; done
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
command -v mpiexec >/dev/null || { echo "$BENCH_NAME: mpiexec not found (Debian: openmpi-bin)" >&2; exit 2; }
compgen -G "data/moby/train_*.bin" >/dev/null || { echo "$BENCH_NAME: no data/moby/train_*.bin (run scripts/setup.sh)" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/lattice_compress_table.XXXXXX")
echo "$BENCH_NAME: logs and metrics in $work" >&2
results="$work/results.jsonl"
# Every row runs the same binary, even if build/ is rebuilt meanwhile.
cp "$LATTICE_BIN" "$work/lattice"
LATTICE_BIN=$work/lattice

MODEL=(--n-layer 4 --n-head 4 --n-embd 128 --vocab 50257 --seq 128)
"$PYTHON" bench/torch_ddp_hooks.py --write-init "$work/init.safetensors" "${MODEL[@]}" --seed 1337 2>/dev/null
POWERSGD=0
"$LATTICE_BIN" train --help-config 2>/dev/null | grep -E '^ *grad = ' | grep -q powersgd && POWERSGD=1

# row DP IMPL COMPRESSOR LABEL STATUS [JSON fields...]: one result line.
row() {
  "$PYTHON" - "$@" >> "$results" <<'PY'
import json, sys
dp, impl, comp, label, status = sys.argv[1:6]
d = {"dp": int(dp), "impl": impl, "compressor": comp, "label": label, "status": status}
for kv in sys.argv[6:]:
    k, v = kv.split("=", 1)
    d[k] = json.loads(v)
print(json.dumps(d))
PY
}
# error_line LOG: the most telling line of a failed run's output: a C++ exception's what(),
# else the first Python exception line that is not a peer's dropped connection, else
# lattice's "rank N: message", else the last line.
error_line() {
  local line inst where=""
  line=$(grep -m1 'what():' "$1" | sed -E 's/^[[:space:]]*what\(\):[[:space:]]*//' || true)
  inst=$(grep -m1 -o "throwing an instance of '[^']*'" "$1" | sed -E "s/.*'(.*)'/\1/" || true)
  [[ -n "$line" && -n "$inst" ]] && line="$inst: $line"
  [[ -n "$line" ]] && where=$(grep -m1 -o 'Exception raised from [^ ]* at [^ ]*' "$1" | sed -E 's/Exception raised from ([^ ]*) at .*\/([^ /]*)/\2 \1/' || true)
  [[ -n "${where:-}" ]] && line="$line (in $where)"
  [[ -n "$line" ]] || line=$(grep -E '^[A-Za-z_.]*(Error|Exception): ' "$1" | grep -v 'Connection reset\|Connection closed' | head -n 1 || true)
  [[ -n "$line" ]] || line=$(grep -E '^rank [0-9]+: ' "$1" | head -n 1 || true)
  [[ -n "$line" ]] || line=$(grep -v '^[[:space:]]*$' "$1" | grep -v '^torch_blas:' | tail -n 1 || true)
  grep -q 'killed by signal SIGABRT' "$1" && line="$line (a rank died of SIGABRT)"
  echo "${line:0:300}"
}

lattice_row() {  # DP CODEC
  local dp=$1 codec=$2 name="lattice-$2" log jsonl rc=0
  keep_row "$name" || return 0
  log="$work/dp$dp-$name.log" jsonl="$work/dp$dp-$name.jsonl"
  local label=$codec
  [[ $codec == topk ]] && label="topk 1%"
  [[ $codec == powersgd ]] && label="powersgd r=4"
  [[ $codec == none ]] && label="none (f32)"
  if [[ $codec == powersgd && $POWERSGD == 0 ]]; then
    row "$dp" lattice "$codec" "$label" "not built"
    return 0
  fi
  local sets=(-c configs/demo.toml --set train.micro_batch_size=8 --set train.steps="$STEPS"
              --set train.eval_every="$STEPS" --set train.eval_steps=8 --set train.threads=1
              --set parallel.dp="$dp" --set checkpoint.init_from="$work/init.safetensors"
              --set checkpoint.dir= --set checkpoint.every=0 --set checkpoint.keep=3
              --set log.every=10 --set log.metrics_file="$jsonl" --set compression.grad="$codec")
  [[ $codec == none ]] || sets+=(--set compression.error_feedback=true)
  [[ $codec == powersgd ]] && sets+=(--set compression.rank=4 --set compression.warmup_steps=2)
  echo "== dp=$dp $name ($STEPS steps)" >&2
  timeout --kill-after=10 "$TIMEOUT" mpiexec -n "$dp" --oversubscribe --bind-to none "$LATTICE_BIN" train "${sets[@]}" \
    > "$log" 2>&1 || rc=$?
  if [[ $rc != 0 || ! -s "$jsonl" ]]; then
    row "$dp" lattice "$codec" "$label" "$(error_line "$log")"
    echo "   failed (exit $rc), see $log" >&2
    return 0
  fi
  "$PYTHON" - "$jsonl" "$dp" "$codec" "$label" "$SKIP" >> "$results" <<'PY'
import json, statistics, sys
path, dp, codec, label, skip = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
lines = [json.loads(l) for l in open(path) if l.strip()]
val = [l["val_loss"] for l in lines if l.get("val_loss") is not None]
# grad_bytes: what this rank sent in the gradient reductions; the uncompressed run's metrics may
# have none (the table then takes the f32 bytes of a compressed row at the same dp).
have = all("grad_bytes" in l for l in lines)
sent = [l["grad_bytes"] for l in lines] if have else None
full = [l.get("grad_bytes_uncompressed", 0) for l in lines]
ms = [l["step_ms"] for l in lines[skip:]] or [l["step_ms"] for l in lines]
print(json.dumps({"dp": dp, "impl": "lattice", "compressor": codec, "label": label, "status": "ok",
                  "bytes_per_step": statistics.mean(sent) if have else None,
                  "bytes_last_step": sent[-1] if have else None,
                  "bytes_uncompressed_per_step": statistics.mean(full) if sum(full) else None,
                  "share": sum(sent) / sum(full) if have and sum(full) else None, "step_ms": statistics.mean(ms),
                  "loss_first": lines[0]["loss"], "loss_last": lines[-1]["loss"],
                  "val_loss": val[-1] if val else None, "steps": len(lines)}))
PY
}

pytorch_row() {  # DP HOOK LABEL
  local dp=$1 hook=$2 label=$3 name="pytorch-$2" log js rc=0
  keep_row "$name" || return 0
  log="$work/dp$dp-$name.log"
  local extra=()
  (( dp > $(nproc) )) && extra+=(--oversubscribe)
  echo "== dp=$dp $name ($STEPS steps)" >&2
  js=$(timeout --kill-after=10 "$TIMEOUT" "$PYTHON" bench/torch_ddp_hooks.py "${MODEL[@]}" --ranks "$dp" --threads 1 \
         --batch 8 --steps "$STEPS" --warmup "$SKIP" --hook "$hook" --powersgd-rank 4 --powersgd-start 2 \
         --init "$work/init.safetensors" --train 'data/moby/train_*.bin' --val 'data/moby/val_*.bin' \
         --eval-steps 8 --lr 3e-3 --min-lr 3e-4 --lr-warmup 30 --weight-decay 0.1 --grad-clip 1.0 \
         --data-seed 1337 --timeout "$TIMEOUT" "${extra[@]}" 2> "$log" | json_line) || rc=$?
  if [[ -z "$js" ]]; then
    row "$dp" pytorch "$hook" "$label" "$(error_line "$log")"
    echo "   failed, see $log" >&2
    return 0
  fi
  "$PYTHON" - "$js" "$dp" "$hook" "$label" >> "$results" <<'PY'
import json, sys
d, dp, hook, label = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
print(json.dumps({"dp": dp, "impl": "pytorch", "compressor": hook, "label": label, "status": "ok",
                  "bytes_per_step": d["grad_bytes_per_step"], "bytes_last_step": d["grad_bytes_last_step"],
                  "bytes_measured": d["bytes_measured"], "share": d["grad_share"], "step_ms": d["step_ms"],
                  "loss_first": d["loss_first"], "loss_last": d["loss_last"], "val_loss": d["val_loss"],
                  "steps": d["steps"], "torch": d["torch"]}))
PY
}

for dp in $RANKS_LIST; do
  for codec in none bf16 f16 int8 onebit topk powersgd; do lattice_row "$dp" "$codec"; done
  pytorch_row "$dp" allreduce "allreduce (no hook, f32)"
  pytorch_row "$dp" fp16 "fp16_compress_hook"
  pytorch_row "$dp" bf16 "bf16_compress_hook"
  pytorch_row "$dp" bf16-unchecked "bf16_compress_hook, DDP's CUDA check bypassed"
  pytorch_row "$dp" powersgd "powerSGD_hook r=4"
  pytorch_row "$dp" powersgd-sync "powerSGD_hook r=4, each bucket waited for"
done
[[ -n "$OUT" ]] && cat "$results" >> "$OUT"
fi

LATTICE_BIN=${LATTICE_BIN:-build/lattice}
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
LCPU=$("$LATTICE_BIN" bench peak --json 2>/dev/null | "$PYTHON" -c 'import json,sys; d=json.loads(sys.stdin.readline()); print("%s family %s model %s, %s" % (d["vendor"], d["family"], d["model"], d["isa"]))' || echo "?")
"$PYTHON" - "$results" "$STEPS" "$CPU" "$LCPU" "$(nproc)" "$SKIP" <<'PY'
import json, sys
path, steps, cpu, lcpu, cores, skip = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
rows = {}
for l in open(path):  # a row run again (same dp, impl, compressor) replaces its earlier result, in place
    d = json.loads(l)
    rows[(d["dp"], d["impl"], d["compressor"])] = d
rows = list(rows.values())
# lattice's f32 row without grad_bytes: the f32 all-reduce of the compressed rows at its dp (same reductions).
for r in rows:
    if r["impl"] == "lattice" and r["status"] == "ok" and r.get("bytes_per_step") is None:
        full = [o["bytes_uncompressed_per_step"] for o in rows if o["impl"] == "lattice" and o["dp"] == r["dp"]
                and o.get("bytes_uncompressed_per_step")]
        if full:
            r.update(bytes_per_step=full[0], share=1.0, bytes_mark="\u2020")

def mb(b):
    return f"{b / 1e6:.2f} MB" if b is not None else ""

def f(x, fmt):
    return format(x, fmt) if x is not None else ""

print(f"\nCPU: {cpu} ({lcpu}), {cores} cores; demo model (L=4 C=128 H=4 V=50257 T=128), 8 sequences per rank, "
      f"{steps} steps, Moby-Dick, 1 thread per rank\n")
print("| dp | implementation | compressor | bytes/step per rank (sent) | share of f32 | step ms | final train loss | val loss | status |")
print("|---:|---|---|---:|---:|---:|---:|---:|---|")
for r in rows:
    ok = r["status"] == "ok"
    star = r.get("bytes_mark", "") or ("" if r.get("bytes_measured", True) else "*")
    cell = mb(r.get("bytes_per_step")) + star if ok else ""
    last = r.get("bytes_last_step")
    if ok and last is not None and abs(last - r["bytes_per_step"]) > 0.01 * r["bytes_per_step"]:
        cell += f" (last step {mb(last)})"  # powersgd: f32 warm-up steps first
    print(f"| {r['dp']} | {r['impl']} | {r['label']} | {cell} | "
          f"{f(r.get('share'), '.3f') if ok else ''} | {f(r.get('step_ms'), '.0f') if ok else ''} | "
          f"{f(r.get('loss_last'), '.4f') if ok else ''} | {f(r.get('val_loss'), '.4f') if ok else ''} | "
          f"{r['status'].replace('|', '/')} |")
print()
print(f"Bytes: per rank per step, averaged over the {steps} steps, ring accounting (2(n-1)/n of each all-reduce's "
      "size); lattice's from its grad_bytes metric, PyTorch's from the sizes its hooks pass to "
      "torch.distributed.all_reduce (* = DDP's built-in all-reduce, counted from the gradient sizes; "
      "\u2020 = lattice's metrics give no grad_bytes uncompressed: the compressed rows' grad_bytes_uncompressed "
      "at that dp, the same f32 reductions). "
      "powersgd rows (both) send f32 for their first 2 steps. "
      f"Step ms: mean after the first {skip} steps of the slowest rank's step (forward, backward with the "
      "reductions, clipping, AdamW).")
for dp in sorted({r["dp"] for r in rows}):
    if dp > cores:
        print(f"dp={dp}: {dp} single-thread ranks on {cores} cores, oversubscribed: its step times mean little, "
              "bytes and losses are as valid as at dp=2.")
by = {(r["dp"], r["impl"], r["compressor"]): r for r in rows if r["status"] == "ok"}
for dp in sorted({r["dp"] for r in rows}):
    pairs = [("none", "allreduce"), ("f16", "fp16"), ("powersgd", "powersgd-sync")]
    parts = []
    for lc, pc in pairs:
        a, b = by.get((dp, "lattice", lc)), by.get((dp, "pytorch", pc))
        if a and b:
            parts.append(f"{lc} {b['step_ms'] / a['step_ms']:.2f}x")
    if parts:
        print(f"dp={dp}: PyTorch step time / lattice's: " + ", ".join(parts) + ".")
    a, b = by.get((dp, "lattice", "none")), by.get((dp, "pytorch", "allreduce"))
    if a and b:
        print(f"dp={dp}: uncompressed, step 1 loss lattice {a['loss_first']:.6f} vs PyTorch {b['loss_first']:.6f}; "
              f"final {a['loss_last']:.4f} vs {b['loss_last']:.4f} (same weights and batches).")
PY
