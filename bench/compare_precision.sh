#!/usr/bin/env bash
# Mixed precision on CPU: lattice's bf16 and f16 compute against its f32, and
# PyTorch's f32 and bf16 autocast beside them, same model, same run.
#
#   bench/compare_precision.sh [--quick] [--repeat R] [--steps S] [--warmup W] [--threads N]
#                              [--rows FILTER] [--out results.jsonl] [--timeout SECONDS]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), B=4, T=256, one process,
# --threads threads (default 2); one step = forward + backward + AdamW.
# --quick: L=2 C=128 H=4 V=1000, T=64, 2 timed steps after 1 warm-up (a smoke
# test of the script, not a measurement; default 5 timed after 2).
#
# Rows:
#   lattice-f32        precision.compute=f32: the 1.00 of lattice's ratios
#   lattice-bf16       precision.compute=bf16 (its GEMMs on the bf16 path this CPU measured faster)
#   lattice-bf16widen  the same on the portable path (LATTICE_DNNL_BF16=0: what a CPU without
#                      oneDNN's bf16 matmul, e.g. any AVX2-only one, runs)
#   lattice-f16        precision.compute=f16 (dynamic loss scale from 2^16)
#   pytorch-f32        bench/torch_gpt2_bench.py (OpenBLAS, see compare_gpt2.sh)
#   pytorch-bf16       the same under torch.autocast("cpu", dtype=torch.bfloat16)
# --rows keeps the rows whose name contains any of the comma-separated FILTERs;
# --repeat R runs every row R times, interleaved, and reports the fastest run
# (other load only slows a run down) with the range.
#
# Columns: tokens/s and its ratio to the same implementation's f32; lattice's
# activation bytes (MemoryTracker's activations peak: stored activations, the
# 16-bit path's f32 work arrays and the backward's gradient buffers) and
# stored bytes (what the forward keeps for the backward) with their ratios to
# f32; the process's peak memory (lattice: every tracked buffer; PyTorch: peak
# RSS, the interpreter and libtorch included); the last step's loss.
#
# Targets (PASS/MISS lines): lattice bf16 peak activation bytes <= 0.55x f32;
# lattice bf16 tokens/s >= 0.8x f32.
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
posint --timeout "$TIMEOUT"
posint --threads "$THREADS"
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 5); fi
if [[ -z "$WARMUP" ]]; then WARMUP=$([[ $QUICK == 1 ]] && echo 1 || echo 2); fi
posint --steps "$STEPS"
[[ "$WARMUP" =~ ^[0-9]+$ ]] || { echo "$BENCH_NAME: --warmup needs an integer >= 0, got '$WARMUP'" >&2; exit 2; }
if [[ ! -x "$LATTICE_BIN" ]]; then
  echo "$BENCH_NAME: $LATTICE_BIN not found or not executable (build it, or set LATTICE_BIN)" >&2
  exit 2
fi
[[ -x "$PYTHON" ]] || { echo "$BENCH_NAME: $PYTHON not found (set PYTHON)" >&2; exit 2; }

# L H C V T B
if [[ $QUICK == 1 ]]; then MODEL="2 4 128 1000 64 4"; else MODEL="12 12 768 50257 256 4"; fi
read -r L H C V T B <<< "$MODEL"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$work/results"
: > "$results"

echo "== peak: $LATTICE_BIN bench peak --json" >&2
PEAK_JSON=$("$LATTICE_BIN" bench peak --json 2>/dev/null | json_line) || true
[[ -z "$PEAK_JSON" ]] || printf '_peak\t0\t%s\n' "$PEAK_JSON" >> "$results"

# name implementation compute
ROWS=(
  "lattice-f32 lattice f32"
  "lattice-bf16 lattice bf16"
  "lattice-bf16widen lattice bf16"
  "lattice-f16 lattice f16"
  "pytorch-f32 pytorch off"
  "pytorch-bf16 pytorch bf16"
)
for run in $(seq 1 "$REPEAT"); do
  for row in "${ROWS[@]}"; do
    read -r name impl compute <<< "$row"
    keep_row "$name" || continue
    if [[ $impl == lattice ]]; then
      cmd=(env "LATTICE_DNNL_BF16=$([[ $name == *widen ]] && echo 0 || echo auto)" "$LATTICE_BIN" bench train --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C"
           --set model.vocab_size="$V" --set model.seq_len="$T" --set train.micro_batch_size="$B"
           --set train.threads="$THREADS" --set precision.compute="$compute" --steps "$STEPS" --warmup "$WARMUP"
           --json)
    else
      cmd=("$PYTHON" bench/torch_gpt2_bench.py --n-layer "$L" --n-head "$H" --n-embd "$C" --vocab "$V"
           --batch "$B" --seq "$T" --threads "$THREADS" --steps "$STEPS" --warmup "$WARMUP" --autocast "$compute")
    fi
    echo "== $name$([[ $REPEAT -gt 1 ]] && echo " run $run/$REPEAT" || true)" >&2
    time_row "$name" "$run" "$results" "${cmd[@]}"
  done
done

if [[ -n "$OUT" ]]; then write_jsonl "$results" "$OUT"; fi

"$PYTHON" - "$results" "$STEPS" "$WARMUP" "$REPEAT" "$MODEL" "$THREADS" "$QUICK" <<'EOF'
import sys
path, steps, warmup, repeat, model, threads, quick = sys.argv[1:8]
L, H, C, V, T, B = (int(x) for x in model.split())
repeat = int(repeat)
sys.path.insert(0, "bench")
from rows import Rows
results = Rows(path)
tps, best = Rows.tps, results.best_and_range

def mib(x):
    return f"{x / 2**20:9.1f}" if x else "      n/a"

def ratio(a, b):
    return f"{a / b:5.2f}" if a and b else "  n/a"

peak = results.peak or {}
print()
print(f"CPU: {peak.get('cpu', '?')}, ISA {peak.get('isa', '?')}"
      + (f"; peak {peak['fp32_gflops_per_core']:.1f} GFLOP/s fp32 per core" if peak.get("fp32_gflops_per_core") else "")
      + (f", {peak['bf16_gflops_per_core']:.1f} bf16" if peak.get("bf16_gflops_per_core") else ""))
print(f"model L={L} C={C} H={H} V={V}, B={B} T={T}, {threads} threads, steps={steps} warmup={warmup} repeat={repeat}"
      + (" (--quick: a smoke test, not a measurement)" if quick == "1" else ""))
hdr = (f"{'row':<18} {'tok/s':>8} {'x f32':>5} {'activ MiB':>9} {'x f32':>5} {'stored MiB':>10} {'x f32':>5} "
       f"{'peak MiB':>9} {'loss':>7}")
print(hdr)
print("-" * len(hdr))
for row in results.order:
    d, rng = best(row)
    if d is None:
        print(f"{row:<18} {'failed':>8}")
        continue
    base = best(row.rsplit("-", 1)[0] + "-f32")[0]
    lat = d.get("impl") == "lattice"
    peak_mem = d.get("peak_mem_bytes") if lat else d.get("peak_rss_bytes")
    print(f"{row:<18} {tps(d):8.1f} {ratio(tps(d), tps(base))} "
          f"{mib(d.get('activations_bytes') if lat else None)} "
          f"{ratio(d.get('activations_bytes'), (base or {}).get('activations_bytes')) if lat else '     '} "
          f"{mib(d.get('stored_activation_bytes') if lat else None):>10} "
          f"{ratio(d.get('stored_activation_bytes'), (base or {}).get('stored_activation_bytes')) if lat else '     '} "
          f"{mib(peak_mem)} {d.get('loss_last', 0):7.4f}")
    if repeat > 1 and rng:
        print(f"{'':<18} tok/s {rng[0]:.1f}-{rng[1]:.1f}")
print("  peak: lattice's tracked buffers (compute copies included); PyTorch's process RSS")

print("\ntargets:")
def check(label, ok, detail):
    print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {label}: {detail}")
f32, bf16 = best("lattice-f32")[0], best("lattice-bf16")[0]
r = bf16["activations_bytes"] / f32["activations_bytes"] if bf16 and f32 else None
check("lattice bf16 peak activation bytes <= 0.55x f32", None if r is None else r <= 0.55,
      f"{mib(bf16 and bf16['activations_bytes']).strip()} / {mib(f32 and f32['activations_bytes']).strip()} MiB = {r or 0:.3f}")
r = tps(bf16) / tps(f32) if tps(bf16) and tps(f32) else None
check("lattice bf16 tokens/s >= 0.8x f32", None if r is None else r >= 0.8,
      f"{tps(bf16) or 0:.1f} / {tps(f32) or 0:.1f} tok/s = {r or 0:.2f}x")
widen = best("lattice-bf16widen")[0]
r = tps(widen) / tps(f32) if tps(widen) and tps(f32) else None
check("lattice bf16 on the portable GEMM path tokens/s >= 0.8x f32", None if r is None else r >= 0.8,
      f"{tps(widen) or 0:.1f} / {tps(f32) or 0:.1f} tok/s = {r or 0:.2f}x")
pt = best("pytorch-bf16")[0]
if tps(bf16) and tps(pt):
    print(f"  info  lattice bf16 against PyTorch bf16 autocast: {tps(bf16):.1f} / {tps(pt):.1f} tok/s = "
          f"{tps(bf16) / tps(pt):.2f}x")
EOF
