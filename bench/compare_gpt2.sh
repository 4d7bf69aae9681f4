#!/usr/bin/env bash
# GPT-2 CPU training throughput: lattice against PyTorch, same configs, same run.
#
#   bench/compare_gpt2.sh [--quick] [--threads "1 2"] [--rows FILTER] [--steps S] [--warmup W]
#                         [--repeat R] [--skip-lattice] [--skip-pytorch] [--out results.jsonl]
#
# Rows (V = 50257):
#   gpt2-124M-B4-T64     L=12 C=768 H=12  B=4 T=64
#   gpt2-124M-B4-T256    L=12 C=768 H=12  B=4 T=256
#   L6-C384-B8-T256      L=6  C=384 H=6   B=8 T=256
# each with every thread count of --threads (default "1 2").
# --rows keeps the rows whose name contains any of the comma-separated FILTERs.
# --repeat R (default 1) runs PyTorch and lattice R times each, alternating, and
# reports each side's best run with the range of all of them: on a shared
# machine other tenants only ever slow a run down, so the best of several
# interleaved runs is the fairest estimate of each side's speed, and the range
# shows how noisy the machine was.
#
# One step = forward + backward + AdamW, fp32, no gradient accumulation.
# PyTorch side: bench/torch_gpt2_bench.py (re-execs itself with
# OPENBLAS_CORETYPE=SkylakeX etc.; see its docstring).
# lattice side: $LATTICE_BIN (default build/lattice) bench train --set ... --json,
# which prints one JSON line {"impl":"lattice","tokens_per_sec","step_ms","model_flops_per_sec",...}.
# Both count model FLOPs per token as 6*N + 12*L*C*T (N = all parameters but
# the position embedding, tied embedding once); % of peak uses 175 GFLOP/s per core (measured fp32 GEMM peak
# of this machine) times the thread count.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
PEAK_PER_CORE=175e9
THREADS="1 2"
ROWS_FILTER=""
STEPS=""
WARMUP=""
QUICK=0
REPEAT=1
RUN_LATTICE=1
RUN_PYTORCH=1
OUT=""

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --threads) THREADS="$2"; shift ;;
    --rows) ROWS_FILTER="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --warmup) WARMUP="$2"; shift ;;
    --repeat) REPEAT="$2"; shift ;;
    --skip-lattice) RUN_LATTICE=0 ;;
    --skip-pytorch) RUN_PYTORCH=0 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_gpt2.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if ! [[ "$REPEAT" =~ ^[1-9][0-9]*$ ]]; then
  echo "compare_gpt2.sh: --repeat needs a positive integer, got '$REPEAT'" >&2
  exit 2
fi
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 5); fi
if [[ -z "$WARMUP" ]]; then WARMUP=$([[ $QUICK == 1 ]] && echo 1 || echo 2); fi

# name L H C V B T
ROWS=(
  "gpt2-124M-B4-T64 12 12 768 50257 4 64"
  "gpt2-124M-B4-T256 12 12 768 50257 4 256"
  "L6-C384-B8-T256 6 6 384 50257 8 256"
)

keep_row() {
  [[ -z "$ROWS_FILTER" ]] && return 0
  local f
  IFS=',' read -ra filters <<< "$ROWS_FILTER"
  for f in "${filters[@]}"; do [[ -n "$f" && "$1" == *"$f"* ]] && return 0; done
  return 1
}

if [[ $RUN_LATTICE == 1 && ! -x "$LATTICE_BIN" ]]; then
  echo "compare_gpt2.sh: $LATTICE_BIN not found or not executable (build it, set LATTICE_BIN, or pass --skip-lattice)" >&2
  exit 2
fi

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# Last line of stdout that is a JSON object with an "impl" key, or nothing.
json_line() { grep -E '^\{.*"impl"' | tail -n 1 || true; }

record() {  # row threads impl json-or-empty
  local row=$1 threads=$2 impl=$3 json=$4
  if [[ -z "$json" ]]; then json='{"impl":"'"$impl"'","failed":true}'; fi
  printf '%s\t%s\t%s\n' "$row" "$threads" "$json" >> "$results"
}

for row in "${ROWS[@]}"; do
  read -r name L H C V B T <<< "$row"
  keep_row "$name" || continue
  for n in $THREADS; do
    for ((rep = 1; rep <= REPEAT; rep++)); do
      run_tag=$([[ $REPEAT -gt 1 ]] && echo " (run $rep/$REPEAT)" || true)
      if [[ $RUN_PYTORCH == 1 ]]; then
        echo "== $name threads=$n: pytorch$run_tag" >&2
        out=$("$PYTHON" bench/torch_gpt2_bench.py --n-layer "$L" --n-head "$H" --n-embd "$C" --vocab "$V" \
                --batch "$B" --seq "$T" --threads "$n" --steps "$STEPS" --warmup "$WARMUP" | json_line) || true
        [[ -n "$out" ]] || echo "   pytorch run failed" >&2
        record "$name" "$n" pytorch "$out"
      fi
      if [[ $RUN_LATTICE == 1 ]]; then
        echo "== $name threads=$n: lattice$run_tag" >&2
        out=$("$LATTICE_BIN" bench train --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" \
                --set model.vocab_size="$V" --set model.seq_len="$T" --set train.micro_batch_size="$B" \
                --set train.threads="$n" --steps "$STEPS" --warmup "$WARMUP" --json | json_line) || true
        [[ -n "$out" ]] || echo "   lattice run failed" >&2
        record "$name" "$n" lattice "$out"
      fi
    done
  done
done

if [[ -n "$OUT" ]]; then
  "$PYTHON" - "$results" "$OUT" <<'EOF'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "a") as out:
    for line in f:
        row, threads, js = line.rstrip("\n").split("\t", 2)
        d = json.loads(js); d.update({"row": row, "threads": int(threads)})
        out.write(json.dumps(d) + "\n")
EOF
fi

"$PYTHON" - "$results" "$PEAK_PER_CORE" "$STEPS" "$WARMUP" "$REPEAT" <<'EOF'
import json, sys
path, peak_per_core, steps, warmup, repeat = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
table = {}
order = []
for line in open(path):
    row, threads, js = line.rstrip("\n").split("\t", 2)
    d = json.loads(js)
    key = (row, int(threads))
    if key not in table:
        table[key] = {}
        order.append(key)
    table[key].setdefault(d.get("impl", "?"), []).append(d)

def tps(d):
    return d.get("tokens_per_sec") if d and not d.get("failed") else None

def best(runs):
    """The fastest successful run, and the (min, max) tokens/s over all of them."""
    ok = [d for d in (runs or []) if tps(d)]
    if not ok:
        return None, None
    speeds = [tps(d) for d in ok]
    return max(ok, key=tps), (min(speeds), max(speeds))

def fmt(x, spec):
    width = int(spec.split(".")[0])
    return format(x, spec) if x is not None else "n/a".rjust(width)

hdr = (f"{'config':<20} {'thr':>3} {'lattice tok/s':>13} {'pytorch tok/s':>13} {'ratio':>6} "
       f"{'lattice GFLOP/s':>15} {'% peak':>6} {'pytorch GFLOP/s':>15} {'% peak':>6}")
print(f"\nsteps={steps} warmup={warmup} repeat={repeat}" + (" (best run of each side; range over runs)" if repeat > 1 else "") +
      f"; peak = {peak_per_core/1e9:.0f} GFLOP/s per core x threads; "
      f"model FLOPs/token = 6N + 12*L*C*T")
print(hdr)
print("-" * len(hdr))
for key in order:
    row, n = key
    (lat, lat_range), (pt, pt_range) = best(table[key].get("lattice")), best(table[key].get("pytorch"))
    lt, ptt = tps(lat), tps(pt)
    ratio = lt / ptt if lt and ptt else None
    peak = peak_per_core * n
    lf = lat.get("model_flops_per_sec") if lt else None
    pf = pt.get("model_flops_per_sec") if ptt else None
    print(f"{row:<20} {n:>3} {fmt(lt, '13.1f')} {fmt(ptt, '13.1f')} {fmt(ratio, '6.2f')} "
          f"{fmt(lf / 1e9 if lf else None, '15.1f')} {fmt(100 * lf / peak if lf else None, '6.1f')} "
          f"{fmt(pf / 1e9 if pf else None, '15.1f')} {fmt(100 * pf / peak if pf else None, '6.1f')}")
    if repeat > 1:
        rng = lambda r: f"{r[0]:.1f}-{r[1]:.1f}" if r else "n/a"
        print(f"{'':<20} {'':>3} tok/s ranges: lattice {rng(lat_range)}, pytorch {rng(pt_range)}")
EOF
