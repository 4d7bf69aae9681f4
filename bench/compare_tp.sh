#!/usr/bin/env bash
# Tensor and sequence parallelism on CPU: lattice at tp=2 (SP off/on) against the
# same model on one process, and beside data parallelism on the same two cores.
#
#   bench/compare_tp.sh [--quick] [--repeat R] [--steps S] [--warmup W] [--rows FILTER]
#                       [--out results.jsonl] [--bind-to MODE] [--timeout SECONDS]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), T=256, micro-batch 4 sequences, fp32,
# one thread per rank; one step = forward + backward (+ reductions) + AdamW.
# --quick: L=2 C=128 H=4 V=1000, T=64, micro-batch 2, 2 timed steps after 1 warm-up
# (a smoke test of the script, not a measurement; default 5 timed after 2).
#
# Rows (RxT = ranks x threads per rank):
#   lattice-tp1         1x1  one process, 1 thread: the 1.00 of every ratio
#   lattice-tp1-t2      1x2  one process, 2 threads (the other way to use two cores)
#   lattice-tp2         2x1  parallel.tp=2: the same batch of 4 sequences on two ranks
#   lattice-tp2-sp      2x1  parallel.tp=2 parallel.sequence_parallel=true
#   lattice-dp2         2x1  parallel.dp=2: 4 sequences per rank (twice the tokens per step)
#   lattice-tp4, -tp4-sp 4x1 memory only: more ranks than cores (speed n/m), 1 timed step
# --rows keeps the rows whose name contains any of the comma-separated FILTERs;
# --repeat R runs every row R times, interleaved, and reports the fastest run
# (other load only slows a run down) with the range.
#
# Columns: tokens/s of the whole job and x tp1; per-rank parameter bytes
# (MemoryTracker's params peak, embeddings included) and activation bytes
# (its activations peak: stored activations plus the backward's gradient
# buffers) with their ratio to tp1; "stored" = what the forward keeps for the
# backward (GPT::stored_activation_bytes); TP comm = time in the TP group's
# collectives per step and its share of the step, and MiB sent per rank per step
# beside the formula for it: Megatron's counts plus what lattice adds (SP's 2L
# re-gathers and LayerNorm all-reduces, the loss statistics), the formula
# tests/parallel/tp_test.cpp asserts per micro-batch.
#
# Targets (PASS/MISS lines): tp=2 >= 1.7x the tokens/s of tp=1; per-rank
# parameter bytes at tp=2 <= 0.55x tp=1; with SP per-rank activation bytes
# <= 0.55x tp=1.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
common_defaults

while [[ $# -gt 0 ]]; do
  case "$1" in
    *) common_option "$@" || { echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2; }
       shift "$COMMON_SHIFT" ;;
  esac
done
posint --repeat "$REPEAT"
posint --timeout "$TIMEOUT"
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 5); fi
if [[ -z "$WARMUP" ]]; then WARMUP=$([[ $QUICK == 1 ]] && echo 1 || echo 2); fi
posint --steps "$STEPS"
[[ "$WARMUP" =~ ^[0-9]+$ ]] || { echo "compare_tp.sh: --warmup needs an integer >= 0, got '$WARMUP'" >&2; exit 2; }
if [[ ! -x "$LATTICE_BIN" ]]; then
  echo "compare_tp.sh: $LATTICE_BIN not found or not executable (build it, or set LATTICE_BIN)" >&2
  exit 2
fi
command -v mpiexec >/dev/null || { echo "compare_tp.sh: mpiexec not found (Debian: openmpi-bin)" >&2; exit 2; }
[[ -x "$PYTHON" ]] || { echo "compare_tp.sh: $PYTHON not found (set PYTHON)" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# L H C V T B
if [[ $QUICK == 1 ]]; then MODEL="2 4 128 1000 64 2"; else MODEL="12 12 768 50257 256 4"; fi
read -r L H C V T B <<< "$MODEL"
MODEL_SETS=(--set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.vocab_size="$V"
            --set model.seq_len="$T" --set train.micro_batch_size="$B")
CORES=$(nproc)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$work/results"
: > "$results"

# name ranks threads tp dp sp
ROWS=(
  "lattice-tp1 1 1 1 1 false"
  "lattice-tp1-t2 1 2 1 1 false"
  "lattice-tp2 2 1 2 1 false"
  "lattice-tp2-sp 2 1 2 1 true"
  "lattice-dp2 2 1 1 2 false"
  "lattice-tp4 4 1 4 1 false"
  "lattice-tp4-sp 4 1 4 1 true"
)

echo "== peak: $LATTICE_BIN bench peak --json" >&2
PEAK_JSON=$("$LATTICE_BIN" bench peak --json 2>/dev/null | json_line) || true
[[ -z "$PEAK_JSON" ]] || printf '_peak\t0\t%s\n' "$PEAK_JSON" >> "$results"

for run in $(seq 1 "$REPEAT"); do
  for row in "${ROWS[@]}"; do
    read -r name ranks threads tp dp sp <<< "$row"
    keep_row "$name" || continue
    steps=$STEPS warmup=$WARMUP
    if (( ranks * threads > CORES )); then
      [[ $run == 1 ]] || continue  # memory only: once
      steps=1 warmup=1
    fi
    cmd=("$LATTICE_BIN" bench train "${MODEL_SETS[@]}" --set train.threads="$threads" --set parallel.tp="$tp"
         --set parallel.dp="$dp" --set parallel.sequence_parallel="$sp" --steps "$steps" --warmup "$warmup" --json)
    if (( ranks > 1 )); then
      if (( ranks * threads > CORES )); then
        cmd=(mpiexec -n "$ranks" --oversubscribe --bind-to none "${cmd[@]}")
      else
        cmd=(mpiexec -n "$ranks" --bind-to "$BIND_TO" "${cmd[@]}")
      fi
    fi
    echo "== $name (${ranks}x$threads)$([[ $REPEAT -gt 1 ]] && echo " run $run/$REPEAT" || true)" >&2
    time_row "$name" "$run" "$results" "${cmd[@]}"
  done
done

if [[ -n "$OUT" ]]; then write_jsonl "$results" "$OUT"; fi

"$PYTHON" - "$results" "$STEPS" "$WARMUP" "$REPEAT" "$MODEL" "$BIND_TO" "$CORES" "$QUICK" <<'EOF'
import json, sys
path, steps, warmup, repeat, model, bind_to, cores, quick = sys.argv[1:9]
L, H, C, V, T, B = (int(x) for x in model.split())
cores, repeat = int(cores), int(repeat)
sys.path.insert(0, "bench")
from rows import Rows
results = Rows(path)
runs, order, peak = results.runs, results.order, results.peak
tps, best = Rows.tps, results.best_and_range

def mib(x):
    return f"{x / 2**20:8.1f}" if x else "     n/a"

def ratio(a, b):
    return f"{a / b:5.2f}" if a and b else "  n/a"

def megatron_bytes(d):
    """Bytes one rank sends in the TP group per step: Megatron's count plus lattice's additions (tp_test.cpp)."""
    t, sp = d.get("tp", 1), d.get("sequence_parallel", False)
    if t <= 1:
        return None
    N = d["batch"] * d["seq"]
    S, ar, ag = N * d["n_embd"] * 4.0, 2.0 * (t - 1) / t, (t - 1.0) / t
    loss = (N * 4 + 2 * N * 8) * ar
    micro = d.get("micro_batches", 1)
    if not sp:
        return micro * ((4 * d["n_layer"] + 2) * S * ar + loss)
    L = d["n_layer"]
    return micro * ((4 * L + 2 + 6 * L + 2) * S * ag + (2 * L + 1) * 2 * d["n_embd"] * 4.0 * ar + loss)

cpu = (peak or {}).get("cpu", "?")
print()
print(f"CPU: {cpu}, {cores} cores, ISA {(peak or {}).get('isa', '?')}"
      + (f"; peak {peak['fp32_gflops_per_core']:.1f} GFLOP/s fp32 per core" if peak and peak.get("fp32_gflops_per_core") else ""))
print(f"model L={L} C={C} H={H} V={V}, T={T}, micro-batch {B}, fp32, steps={steps} warmup={warmup} repeat={repeat}; "
      f"mpiexec --bind-to {bind_to}" + (" (--quick: a smoke test, not a measurement)" if quick == "1" else ""))
base, _ = best("lattice-tp1")
hdr = (f"{'row':<16} {'RxT':>4} {'tok/s':>8} {'x tp1':>5} {'params MiB':>10} {'x tp1':>5} {'activ MiB':>9} "
       f"{'x tp1':>5} {'stored MiB':>10} {'TP comm ms':>10} {'of step':>7} {'TP MiB/step':>11} {'formula':>8}")
print(hdr)
print("-" * len(hdr))
for row in order:
    d, rng = best(row)
    if d is None:
        print(f"{row:<16} {'':>4} {'failed':>8}")
        continue
    ranks, threads = d.get("ranks", 1), d.get("threads", 1)
    oversub = ranks * threads > cores
    t = tps(d)
    speed = "n/m".rjust(8) if oversub else f"{t:8.1f}"
    tp_ms = d.get("tp_comm_ms", 0.0)
    share = f"{100 * tp_ms / d['step_ms']:6.1f}%" if d.get("tp", 1) > 1 and d.get("step_ms") and not oversub else "".rjust(7)
    mb = d.get("tp_comm_bytes_per_step", 0)
    meg = megatron_bytes(d)
    print(f"{row:<16} {f'{ranks}x{threads}':>4} {speed} {ratio(t, tps(base)) if not oversub else '':>5} "
          f"{mib(d.get('params_bytes')):>10} {ratio(d.get('params_bytes'), (base or {}).get('params_bytes'))} "
          f"{mib(d.get('activations_bytes')):>9} {ratio(d.get('activations_bytes'), (base or {}).get('activations_bytes'))} "
          f"{mib(d.get('stored_activation_bytes')):>10} "
          f"{(f'{tp_ms:10.1f}' if d.get('tp', 1) > 1 and not oversub else '').rjust(10)} {share} "
          f"{(mib(mb) if mb else '').rjust(11)} {(mib(meg) if meg else '').rjust(8)}")
    if repeat > 1 and rng and not oversub:
        print(f"{'':<16} {'':>4} tok/s {rng[0]:.1f}-{rng[1]:.1f}")
print("  n/m: more ranks than cores, memory only; dp2 processes twice the tokens of one step of the others")

print("\ntargets:")
def check(label, ok, detail):
    print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {label}: {detail}")
tp2, sp2 = best("lattice-tp2")[0], best("lattice-tp2-sp")[0]
r = tps(tp2) / tps(base) if tps(tp2) and tps(base) else None
check("tp=2 >= 1.7x the tokens/s of tp=1", None if r is None else r >= 1.7,
      f"{tps(tp2) or 0:.1f} / {tps(base) or 0:.1f} tok/s = {r or 0:.2f}x")
r = tp2["params_bytes"] / base["params_bytes"] if tp2 and base else None
check("per-rank parameter bytes at tp=2 <= 0.55x tp=1 (embeddings included)", None if r is None else r <= 0.55,
      f"{mib(tp2 and tp2['params_bytes']).strip()} / {mib(base and base['params_bytes']).strip()} MiB = {r or 0:.3f}")
r = sp2["activations_bytes"] / base["activations_bytes"] if sp2 and base else None
check("with SP, per-rank activation bytes at tp=2 <= 0.55x tp=1", None if r is None else r <= 0.55,
      f"{mib(sp2 and sp2['activations_bytes']).strip()} / {mib(base and base['activations_bytes']).strip()} MiB = {r or 0:.3f}")
t2, dp2 = best("lattice-tp1-t2")[0], best("lattice-dp2")[0]
for label, other in (("tp=2 against one process x 2 threads", t2), ("tp=2 against dp=2", dp2),
                     ("tp=2 + SP against tp=2", tp2)):
    mine = sp2 if "SP" in label else tp2
    if tps(mine) and tps(other):
        print(f"  info  {label}: {tps(mine):.1f} / {tps(other):.1f} tok/s = {tps(mine) / tps(other):.2f}x")
EOF
