#!/usr/bin/env bash
# Pipeline parallelism on CPU: every schedule at pp=2 against one process (one
# thread, and two: the other way to use the two cores), the measured bubble beside
# the simulator's for the measured action costs.
#
#   bench/compare_pp.sh [--quick] [--repeat R] [--steps S] [--warmup W] [--rows FILTER]
#                       [--micro "4 8 16"] [--out results.jsonl] [--bind-to MODE] [--timeout SECONDS]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), T=256, micro-batches of 1 sequence, m
# of them per step (--micro, default "4 8 16"), fp32, one thread per rank (but pp1-m8-t2). --quick:
# L=4 C=128 H=4 V=1000, T=64, m=4 only, 2 timed steps after 1 warm-up (a smoke test
# of the script; default 3 timed after 1).
#
# Rows (RxT = ranks x threads per rank):
#   pp1-m8                  1x1  one process, m=8: the 1.00 of the ratio column
#   pp1-m8-t2               1x2  one process, m=8, 2 threads (the other way to use two cores)
#   pp2-SCHEDULE-mM         2x1  parallel.pp=2 with gpipe, 1f1b, zb-h1, interleaved and zb-v (those
#                                two with 2 chunks per rank) at each m
#   pp4-SCHEDULE-m8         4x1  memory only (more ranks than cores): every schedule
# --rows keeps the rows whose name contains any of the comma-separated FILTERs;
# --repeat R runs every row R times, interleaved, and reports the fastest.
#
# Columns: tokens/s of the whole job and x pp1-m8; the measured bubble (idle share
# of ranks x span, from the executor's timeline) and the simulator's for that
# step's mean action costs, and their difference; rank 0's activation peak
# (MemoryTracker) and parameter bytes (both end stages hold the tied embedding).
#
# Targets (PASS/MISS lines): pp=2 >= 1.7x the tokens/s of pp=1 at m=8 (best
# schedule, and 1F1B's; printed beside it: against pp1-m8-t2); the measured bubble within 0.10 (absolute) of the
# simulated in every pp=2 row; 1F1B's activation peak below GPipe's at m >= 2p; ZB-V's
# measured bubble <= 0.25x 1F1B's at m = 2p = 4.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
common_defaults
MICRO=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --micro) need "$@"; MICRO="$2"; shift 2; continue ;;
    *) common_option "$@" || { echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2; }
       shift "$COMMON_SHIFT" ;;
  esac
done
posint --repeat "$REPEAT"
posint --timeout "$TIMEOUT"
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 3); fi
if [[ -z "$WARMUP" ]]; then WARMUP=1; fi
if [[ -z "$MICRO" ]]; then MICRO=$([[ $QUICK == 1 ]] && echo 4 || echo "4 8 16"); fi
posint --steps "$STEPS"
for m in $MICRO; do posint --micro "$m"; done
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
command -v mpiexec >/dev/null || { echo "$BENCH_NAME: mpiexec not found (Debian: openmpi-bin)" >&2; exit 2; }
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# L H C V T
if [[ $QUICK == 1 ]]; then MODEL="4 4 128 1000 64"; else MODEL="12 12 768 50257 256"; fi
read -r L H C V T <<< "$MODEL"
MODEL_SETS=(--set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.vocab_size="$V"
            --set model.seq_len="$T" --set train.micro_batch_size=1)
CORES=$(nproc)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$work/results"
: > "$results"

# name ranks threads schedule v m
ROWS=("pp1-m8 1 1 1f1b 1 8" "pp1-m8-t2 1 2 1f1b 1 8")
for m in $MICRO; do
  for s in gpipe 1f1b zb-h1 interleaved zb-v; do
    v=1; [[ $s == interleaved || $s == zb-v ]] && v=2
    ROWS+=("pp2-$s-m$m 2 1 $s $v $m")
  done
done
for s in gpipe 1f1b zb-h1 interleaved zb-v; do
  v=1; [[ $s == interleaved || $s == zb-v ]] && v=2
  ROWS+=("pp4-$s-m8 4 1 $s $v 8")
done

echo "== peak: $LATTICE_BIN bench peak --json" >&2
PEAK_JSON=$("$LATTICE_BIN" bench peak --json 2>/dev/null | json_line) || true
[[ -z "$PEAK_JSON" ]] || printf '_peak\t0\t%s\n' "$PEAK_JSON" >> "$results"
for run in $(seq 1 "$REPEAT"); do
  for row in "${ROWS[@]}"; do
    read -r name ranks threads sched v m <<< "$row"
    keep_row "$name" || continue
    steps=$STEPS warmup=$WARMUP
    if (( ranks * threads > CORES )); then [[ $run == 1 ]] || continue; steps=1; fi  # memory only: once
    sets=("${MODEL_SETS[@]}" --set train.threads="$threads" --set train.grad_accum_steps="$m" --set parallel.pp="$ranks")
    (( ranks > 1 )) && sets+=(--set parallel.schedule="$sched" --set parallel.virtual_stages="$v")
    cmd=("$LATTICE_BIN" bench train "${sets[@]}" --steps "$steps" --warmup "$warmup" --json)
    if (( ranks > 1 && ranks * threads > CORES )); then cmd=(mpiexec -n "$ranks" --oversubscribe --bind-to none "${cmd[@]}")
    elif (( ranks > 1 )); then cmd=(mpiexec -n "$ranks" --bind-to "$BIND_TO" "${cmd[@]}"); fi
    echo "== $name (${ranks}x$threads)$([[ $REPEAT -gt 1 ]] && echo " run $run/$REPEAT" || true)" >&2
    time_row "$name" "$run" "$results" "${cmd[@]}"
  done
done
if [[ -n "$OUT" ]]; then write_jsonl "$results" "$OUT"; fi

"$PYTHON" - "$results" "$MODEL" "$STEPS" "$WARMUP" "$REPEAT" "$CORES" "$QUICK" <<'PY'
import json, sys
path, model, steps, warmup, repeat, cores, quick = sys.argv[1:8]
L, H, C, V, T = (int(x) for x in model.split())
cores = int(cores)
sys.path.insert(0, "bench")
from rows import Rows
results = Rows(path)
runs, order, peak = results.runs, results.order, results.peak
tps, best = Rows.tps, results.best
mib = lambda x: f"{x / 2**20:9.1f}" if x else "      n/a"
print()
print(f"CPU: {(peak or {}).get('cpu', '?')}, {cores} cores, ISA {(peak or {}).get('isa', '?')}")
print(f"model L={L} C={C} H={H} V={V}, T={T}, micro-batches of 1 sequence, fp32, steps={steps} warmup={warmup} "
      f"repeat={repeat}" + (" (--quick: a smoke test, not a measurement)" if quick == "1" else ""))
base = best("pp1-m8")
hdr = f"{'row':<20} {'RxT':>4} {'tok/s':>8} {'x pp1':>6} {'bubble':>7} {'sim':>6} {'diff':>6} {'activ MiB':>9} {'params MiB':>10}"
print(hdr)
print("-" * len(hdr))
for row in order:
    d = best(row)
    if not d:
        print(f"{row:<20} {'':>4} {'failed':>8}")
        continue
    r, thr = d.get("ranks", 1), d.get("threads", 1)
    over = r * thr > cores
    t = tps(d)
    pp = d.get("pp", 1) > 1
    b, s = d.get("pp_bubble"), d.get("pp_bubble_simulated")
    print(f"{row:<20} {f'{r}x{thr}':>4} {'n/m' if over else f'{t:8.1f}':>8} "
          f"{'' if over or not base else f'{t / tps(base):6.2f}':>6} "
          f"{f'{100*b:6.1f}%' if pp and not over else '':>7} {f'{100*s:5.1f}%' if pp and not over else '':>6} "
          f"{f'{100*abs(b-s):5.1f}%' if pp and not over else '':>6} {mib(d.get('activations_bytes')):>9} "
          f"{mib(d.get('params_bytes')):>10}")
print("  n/m: more ranks x threads than cores, memory only")
print("\ntargets:")
def check(label, ok, detail):
    print(f"  {'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {label}: {detail}")
pp2_m8 = {row: best(row) for row in order if row.startswith("pp2-") and row.endswith("-m8")}
ok8 = {k: v for k, v in pp2_m8.items() if tps(v)}
if ok8 and base:
    bk = max(ok8, key=lambda k: tps(ok8[k]))
    r = tps(ok8[bk]) / tps(base)
    check("pp=2 >= 1.7x pp=1 at m=8 (best schedule)", r >= 1.7, f"{bk}: {tps(ok8[bk]):.1f} / {tps(base):.1f} tok/s = {r:.2f}x")
    f = ok8.get("pp2-1f1b-m8")
    if f:
        print(f"  info  1F1B: {tps(f):.1f} / {tps(base):.1f} tok/s = {tps(f) / tps(base):.2f}x")
    t2 = best("pp1-m8-t2")
    if tps(t2) and t2.get("ranks", 1) * t2.get("threads", 1) <= cores:
        print(f"  info  pp=2 against one process x 2 threads at m=8: {bk}: {tps(ok8[bk]):.1f} / {tps(t2):.1f} tok/s = "
              f"{tps(ok8[bk]) / tps(t2):.2f}x (one process x 2 threads: {tps(t2) / tps(base):.2f}x pp=1)")
else:
    check("pp=2 >= 1.7x pp=1 at m=8", None, "no rows")
diffs = [(abs(best(r)["pp_bubble"] - best(r)["pp_bubble_simulated"]), r) for r in order
         if r.startswith("pp2-") and best(r) and tps(best(r))]
worst = max(diffs) if diffs else None
check("measured bubble within 0.10 of the simulated in every pp=2 row", None if worst is None else worst[0] <= 0.10,
      "largest difference " + (f"{worst[0]:.3f} ({worst[1]})" if worst else "n/a"))
for m in [x for x in (8, 16)]:
    g, f = best(f"pp2-gpipe-m{m}"), best(f"pp2-1f1b-m{m}")
    if g and f and tps(g) and tps(f):
        check(f"1F1B's activation peak below GPipe's at m={m}", f["activations_bytes"] < g["activations_bytes"],
              f"{mib(f['activations_bytes']).strip()} vs {mib(g['activations_bytes']).strip()} MiB")
v, f = best("pp2-zb-v-m4"), best("pp2-1f1b-m4")
if v and f and tps(v) and tps(f):
    ratio = v["pp_bubble"] / f["pp_bubble"] if f["pp_bubble"] > 0 else float("inf")
    check("ZB-V measured bubble <= 0.25x 1F1B's at m = 2p = 4", ratio <= 0.25,
          f"{100 * v['pp_bubble']:.1f}% vs {100 * f['pp_bubble']:.1f}% = {ratio:.2f}x "
          f"(simulated {100 * v['pp_bubble_simulated']:.1f}% vs {100 * f['pp_bubble_simulated']:.1f}%)")
else:
    check("ZB-V measured bubble <= 0.25x 1F1B's at m = 2p = 4", None, "no rows (--micro without 4?)")
PY
