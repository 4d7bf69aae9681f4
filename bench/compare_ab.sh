#!/usr/bin/env bash
# Two lattice binaries, A (e.g. the commit before a change) and B (after), on
# the same rows, interleaved: the speed a reshaping of the code must not lose.
#
#   bench/compare_ab.sh A_BIN B_BIN [--repeat R] [--steps S] [--warmup W] [--rows FILTER]
#                       [--quick] [--out results.jsonl]
#
# Rows (GPT-2 124M, L=12 C=768 H=12 V=50257, T=256, fp32, micro-batch 4 per rank;
# bench/compare_gpt2.sh's main row and bench/compare_dp.sh's dp=2 rows):
#   dp1-t1        one process, 1 thread
#   dp1-t2        one process, 2 threads
#   dp2-s0..s3    mpiexec -n 2 --bind-to core, 1 thread per rank, parallel.zero_stage=0..3
# --quick: L=2 C=128 H=2 V=1000 T=64 (a smoke test of the script, not a measurement).
# Each round runs every row on A and on B, the order of the two alternating
# from round to round (A B, then B A), so drift of the machine falls on both;
# each side's figure is its fastest run (other load only ever slows a run
# down), with the range of all its runs. The last columns are B/A and, for the
# dp=2 rows, the share of the communication hidden behind the backward (B's).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
A=$1 B=$2
shift 2
REPEAT=3 STEPS=5 WARMUP=2 FILTER="" QUICK=0 OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repeat) REPEAT=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --warmup) WARMUP=$2; shift ;;
    --rows) FILTER=$2; shift ;;
    --quick) QUICK=1 ;;
    --out) OUT=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_ab.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for bin in "$A" "$B"; do
  [[ -x "$bin" ]] || { echo "compare_ab.sh: '$bin' is not an executable lattice binary" >&2; exit 2; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model=(--set model.n_layer=12 --set model.n_embd=768 --set model.n_head=12 --set model.vocab_size=50257
       --set model.seq_len=256 --set train.micro_batch_size=4)
if [[ $QUICK == 1 ]]; then
  model=(--set model.n_layer=2 --set model.n_embd=128 --set model.n_head=2 --set model.vocab_size=1000
         --set model.seq_len=64 --set train.micro_batch_size=2)
fi
rows=(dp1-t1 dp1-t2 dp2-s0 dp2-s1 dp2-s2 dp2-s3)
if [[ -n $FILTER ]]; then
  kept=()
  for r in "${rows[@]}"; do
    IFS=, read -ra fs <<< "$FILTER"
    for f in "${fs[@]}"; do [[ $r == *"$f"* ]] && { kept+=("$r"); break; }; done
  done
  rows=("${kept[@]}")
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run_row() {  # BIN ROW -> one JSON line
  local bin=$1 row=$2 cmd
  case $row in
    dp1-t*) cmd=("$bin" bench train "${model[@]}" --set train.threads="${row#dp1-t}") ;;
    dp2-s*) cmd=(mpiexec -n 2 --bind-to core "$bin" bench train "${model[@]}" --set train.threads=1
                 --set parallel.dp=2 --set parallel.zero_stage="${row#dp2-s}") ;;
  esac
  "${cmd[@]}" --steps "$STEPS" --warmup "$WARMUP" --json 2>"$work/err" | grep '^{' | tail -1 ||
    { echo "compare_ab.sh: row $row failed on $bin:" >&2; cat "$work/err" >&2; exit 1; }
}

echo "A = $A"
echo "B = $B"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores; $(date -u +%Y-%m-%d)"
for ((round = 1; round <= REPEAT; round++)); do
  for row in "${rows[@]}"; do
    order=(A B)
    ((round % 2 == 0)) && order=(B A)
    for side in "${order[@]}"; do
      bin=$A
      [[ $side == B ]] && bin=$B
      line=$(run_row "$bin" "$row")
      echo "$row $side $line" >> "$work/runs"
      [[ -n $OUT ]] && echo "{\"row\":\"$row\",\"side\":\"$side\",\"round\":$round,\"run\":$line}" >> "$OUT"
      printf '  round %d %-7s %s %s tok/s\n' "$round" "$row" "$side" \
        "$(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["tokens_per_sec"]))' "$line")" >&2
    done
  done
done
python3 - "$work/runs" <<'EOF'
import json, sys
runs = {}
for line in open(sys.argv[1]):
    row, side, js = line.split(" ", 2)
    runs.setdefault(row, {}).setdefault(side, []).append(json.loads(js))
print(f"{'row':8} {'A tok/s (range)':>24} {'B tok/s (range)':>24} {'B/A':>6} {'hidden A':>9} {'hidden B':>9}")
for row, sides in runs.items():
    cells, best = [], {}
    for side in "AB":
        t = [r["tokens_per_sec"] for r in sides[side]]
        best[side] = max(t)
        cells.append(f"{max(t):9.1f} ({min(t):.0f}-{max(t):.0f})")
    hid = []
    for side in "AB":
        r = max(sides[side], key=lambda r: r["tokens_per_sec"])
        h = r.get("comm_hidden")
        hid.append(f"{100 * h:8.0f}%" if h is not None and row.startswith("dp2") else f"{'-':>9}")
    print(f"{row:8} {cells[0]:>24} {cells[1]:>24} {best['B'] / best['A']:6.3f} {hid[0]} {hid[1]}")
EOF
