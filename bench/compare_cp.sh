#!/usr/bin/env bash
# Context parallelism on CPU: how long a sequence trains per rank in a fixed
# memory budget at cp = 1, 2, 4, and the speed of ring and all-to-all at cp = 2
# against one process on the same two cores.
#
#   bench/compare_cp.sh [--quick] [--budget-gib G] [--speed-seq T] [--steps S] [--warmup W]
#                       [--rows memory,speed] [--out results.jsonl] [--timeout SECONDS]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), micro-batch 1, fp32, one step =
# forward + backward + reductions + AdamW, synthetic tokens (lattice bench train).
# --quick: L=2 C=128 H=4 V=1000, a 0.25 GiB budget, T=256 for speed (a smoke test
# of the script, not a measurement).
#
# memory  For each cp, the peak memory of a rank (MemoryTracker, every category)
#         after one step at two sequence lengths, T = 512·cp and 1024·cp; the peak
#         is linear in a rank's tokens (attention keeps only the log-sum-exp;
#         the ring's buffers are a rank's K/V), so the two points give the
#         longest T whose peak fits --budget-gib (default 4 GiB) per rank, in
#         multiples of 64·2·cp; one more step at that T checks it (its peak is
#         printed beside the budget). cp = 4 runs 4 ranks on 2 cores: memory only.
# speed   At T = --speed-seq (default 2048): one process with 2 threads, and cp = 2
#         ring and all_to_all (2 ranks x 1 thread), tokens/s and the ratio to the one
#         process. --steps (default 3) timed after --warmup (default 1).
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
common_defaults
BUDGET_GIB="" SPEED_SEQ=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --budget-gib) need "$@"; BUDGET_GIB="$2"; shift 2 ;;
    --speed-seq) need "$@"; SPEED_SEQ="$2"; shift 2 ;;
    *) common_option "$@" || { echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2; }
       shift "$COMMON_SHIFT" ;;
  esac
done
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 1 || echo 3); fi
if [[ -z "$WARMUP" ]]; then WARMUP=1; fi
if [[ -z "$BUDGET_GIB" ]]; then BUDGET_GIB=$([[ $QUICK == 1 ]] && echo 0.25 || echo 4); fi
if [[ -z "$SPEED_SEQ" ]]; then SPEED_SEQ=$([[ $QUICK == 1 ]] && echo 256 || echo 2048); fi
posint --steps "$STEPS"
posint --speed-seq "$SPEED_SEQ"
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
command -v mpiexec >/dev/null || { echo "$BENCH_NAME: mpiexec not found (Debian: openmpi-bin)" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

if [[ $QUICK == 1 ]]; then MODEL="2 4 128 1000"; else MODEL="12 12 768 50257"; fi
read -r L H C V <<< "$MODEL"
MODEL_SETS=(--set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.vocab_size="$V"
            --set train.micro_batch_size=1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$work/results"
: > "$results"

# run NAME RANKS THREADS T CP MODE STEPS WARMUP
run() {
  local name=$1 ranks=$2 threads=$3 T=$4 cp=$5 mode=$6 steps=$7 warmup=$8
  local cmd=("$LATTICE_BIN" bench train "${MODEL_SETS[@]}" --set model.seq_len="$T" --set train.threads="$threads"
             --set parallel.cp="$cp" --steps "$steps" --warmup "$warmup" --json)
  if (( cp > 1 )); then cmd+=(--set parallel.cp_mode="$mode"); fi
  if (( ranks > 1 )); then cmd=(mpiexec -n "$ranks" --oversubscribe --bind-to none "${cmd[@]}"); fi
  echo "== $name (${ranks}x$threads, T=$T)" >&2
  time_row "$name" 1 "$results" "${cmd[@]}"
}
peak_of() { "$PYTHON" -c 'import json,sys
for line in open(sys.argv[1]):
    name, run, js = line.rstrip("\n").split("\t", 2)
    if name == sys.argv[2]: print(json.loads(js).get("peak_mem_bytes", 0))' "$results" "$1"; }

if keep_row memory; then
  for cp in 1 2 4; do
    threads=$(( cp == 1 ? 2 : 1 ))
    t1=$(( 512 * cp )) t2=$(( 1024 * cp ))
    if [[ $QUICK == 1 ]]; then t1=$(( 64 * cp )) t2=$(( 128 * cp )); fi
    run "mem-cp$cp-T$t1" "$cp" "$threads" "$t1" "$cp" ring 1 0
    run "mem-cp$cp-T$t2" "$cp" "$threads" "$t2" "$cp" ring 1 0
    p1=$(peak_of "mem-cp$cp-T$t1") p2=$(peak_of "mem-cp$cp-T$t2")
    tmax=$("$PYTHON" -c 'import sys
p1, p2, t1, t2, cp, budget = (float(x) for x in sys.argv[1:7])
b = (p2 - p1) / (t2 - t1); a = p1 - b * t1
unit = 128 * cp
print(int((budget * 2**30 - a) / b // unit * unit))' "$p1" "$p2" "$t1" "$t2" "$cp" "$BUDGET_GIB")
    if (( tmax < t1 )); then echo "   cp=$cp: the budget does not hold T=$t1" >&2; continue; fi
    run "mem-cp$cp-fit" "$cp" "$threads" "$tmax" "$cp" ring 1 0
    printf 'fit-cp%s\t1\t{"impl":"fit","cp":%s,"t1":%s,"p1":%s,"t2":%s,"p2":%s,"tmax":%s}\n' \
      "$cp" "$cp" "$t1" "$p1" "$t2" "$p2" "$tmax" >> "$results"
  done
fi
if keep_row speed; then
  run "speed-one-t2" 1 2 "$SPEED_SEQ" 1 ring "$STEPS" "$WARMUP"
  run "speed-cp2-ring" 2 1 "$SPEED_SEQ" 2 ring "$STEPS" "$WARMUP"
  run "speed-cp2-all_to_all" 2 1 "$SPEED_SEQ" 2 all_to_all "$STEPS" "$WARMUP"
fi
if [[ -n "$OUT" ]]; then write_jsonl "$results" "$OUT"; fi

"$PYTHON" - "$results" "$BUDGET_GIB" "$MODEL" <<'EOF'
import json, sys
path, budget, model = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = {}
fits = {}
for line in open(path):
    name, run, js = line.rstrip("\n").split("\t", 2)
    d = json.loads(js)
    if d.get("impl") == "fit":
        fits[d["cp"]] = d
    else:
        rows[name] = d
cpu = next((d.get("cpu") for d in rows.values() if d.get("cpu")), "?")
GiB = 2**30
print(f"model L/H/C/V = {model}, micro-batch 1, fp32; CPU: {cpu}")
if fits:
    print(f"\nlongest sequence in {budget:g} GiB per rank (peak of every category, MemoryTracker):")
    print(f"{'cp':>3} {'ranks':>5} {'peak @T1':>16} {'peak @T2':>16} {'MiB/1k tokens/rank':>19} {'longest T':>10} {'T/rank':>7} {'peak @longest':>14} {'x cp1':>6}")
    base = fits.get(1, {}).get("tmax")
    for cp, f in sorted(fits.items()):
        slope = (f["p2"] - f["p1"]) / (f["t2"] - f["t1"]) * cp * 1000 / 2**20
        chk = rows.get(f"mem-cp{cp}-fit", {})
        peak = chk.get("peak_mem_bytes")
        ok = "" if peak is None else ("" if peak <= budget * GiB else " OVER")
        print(f"{cp:>3} {cp:>5} {f['p1']/GiB:>7.2f} GiB @{f['t1']:<5} {f['p2']/GiB:>7.2f} GiB @{f['t2']:<5} {slope:>19.1f}"
              f" {f['tmax']:>10} {f['tmax']//cp:>7} {('%.2f GiB' % (peak/GiB)) if peak else 'failed':>14}{ok}"
              f" {f['tmax']/base if base else float('nan'):>6.2f}")
speed = [(n, rows[n]) for n in ("speed-one-t2", "speed-cp2-ring", "speed-cp2-all_to_all") if n in rows]
if speed:
    one = rows.get("speed-one-t2", {}).get("tokens_per_sec")
    print(f"\nspeed at T = {speed[0][1].get('seq')} (2 cores):")
    print(f"{'row':<22} {'ranks x threads':>15} {'tokens/s':>9} {'x one':>6} {'step ms':>9} {'peak GiB/rank':>14}")
    for n, d in speed:
        if d.get("failed"):
            print(f"{n:<22} failed"); continue
        rt = f"{d['ranks']}x{d['threads']}"
        print(f"{n:<22} {rt:>15} {d['tokens_per_sec']:>9.1f} {d['tokens_per_sec']/one if one else float('nan'):>6.2f}"
              f" {d['step_ms_median']:>9.0f} {d['peak_mem_bytes']/GiB:>14.2f}")
EOF
