#!/usr/bin/env bash
# Benchmarks across a link: lattice on an emulated two-node cluster (scripts/cluster.sh),
# beside its references, at a sweep of link rates.
#
#   bench/cluster_bench.sh [--quick] [--rates "1gbit 2gbit 5gbit 10gbit"] [--rows FILTER]
#                          [--steps S] [--warmup W] [--out results.jsonl] [--bind core|none]
#                          [--timeout SECONDS] [--subnet A.B.C.0/24] [--skip-pytorch]
#   bench/cluster_bench.sh --table results.jsonl
#
# Needs root (network namespaces). Brings up its own cluster, `scripts/cluster.sh up --name
# lattice-bench --slots 2` (2 nodes x 2 slots, its state under the work directory), and takes
# it down on any exit; refuses to start when a cluster of that name exists already (another
# run, or one left over: scripts/cluster.sh down --name lattice-bench). Timings mean something
# only with one rank per core: the rows below run 2 nodes x 1 rank, rank i pinned to core i
# (an Open MPI rankfile; --bind none: --map-by node --bind-to none instead), except the
# 2 x 2 rows (4 ranks on 2 cores: bytes and memory only). Every row prints its command.
#
# Rows (R = each rate of --rates, default "1gbit 2gbit 5gbit 10gbit"; the links are reshaped
# with `scripts/cluster.sh shape --rate R` before each rate's rows):
#   comm-node, comm-link   lattice bench comm, 2 ranks inside node0 (shared memory) and
#                          2 nodes x 1 rank across the link at 1gbit: busbw per size of
#                          all_reduce, reduce_scatter, all_gather, all_to_all, send_recv and
#                          broadcast, lattice's and raw MPI's (64 KiB to 16 MiB)
#   probe@R                lattice bench comm all_reduce across the link at 4 and 16 MiB (the
#                          link's real rate for lattice's 4 MiB gradient buckets); runs whenever
#                          another row at that rate does
#   dp2-thread@R, dp2-inline@R   GPT-2 124M (L=12 C=768 H=12 V=50257, T=256, micro-batch 4 per
#                          rank), dp=2 across the link, lattice train with the communication
#                          thread (LATTICE_DP_PROGRESS=thread, overlap on) and inline (off)
#   ddp@R                  the same model and batch in PyTorch DDP (gloo, bucket_cap_mb 25),
#                          bench/torch_ddp_bench.py --rank 0 on node0 and --rank 1 on node1
#   codec-C@R              a smaller GPT-2 (L=6 C=512 H=8 V=50257, T=256, micro-batch 4 per rank;
#                          44.6M parameters) at dp=2 with compression.grad=C, C = none bf16 int8
#                          onebit topk powersgd (error feedback on, lattice's defaults otherwise)
#   layout-tp2@R, layout-pp2@R   the smaller model, global batch 8, tp=2 (micro-batch 8) and
#                          pp=2 (1f1b, 4 micro-batches of 2) across the link, beside codec-none@R,
#                          its dp=2 (run when either is asked for)
#   2x2-tp-inside, 2x2-tp-across   the smaller model, dp=2 x tp=2 on 2 nodes x 2 ranks, TP
#                          groups inside each node (--map-by slot) and across (--map-by node):
#                          bytes on the links and memory only, at the last rate
# --quick: L=2 C=128 H=2 V=1000 T=64 micro-batch 2 for both models, 1 warm-up and 2 timed
# steps, rates "1gbit 10gbit", comm sizes 64 KiB to 1 MiB: a smoke test of the script, not a
# measurement. Default: 1 warm-up step, 3 timed (--warmup, --steps).
# The full run takes about 25 minutes on an idle 2-core machine (estimated from its steps; the
# rows at 1gbit are the longest), much longer when other jobs share the cores.
# --rows keeps the rows whose name contains one of the comma-separated filters (e.g.
# "dp2-,ddp", "@1gbit", "codec-topk"; a filter that matches layout-dp2@R, such as "dp2", also
# runs codec-none@R). --out appends every row's JSON line (and a "_machine"
# line) to a file; --table FILE runs nothing and prints the tables of such a file.
#
# What each figure is:
#   tok/s       the job's tokens per second over the timed steps (lattice: rank 0's metrics
#               file, whose step_ms is the slowest rank's; DDP: its own JSON, same definition)
#   comm s      the gradient collectives' run time per step on rank 0 (comm_ms); exposed s: the
#               part the compute thread waited for (comm_exposed_ms); hidden: lattice's own
#               1 - exposed / comm; hidden (wall): (inline step - thread step) / inline exposed,
#               the wall time overlap saved as a share of what the communication costs without it
#   link MB/step the bytes both nodes sent into their links per timed step, read from the
#               switch's port counters when each step's metrics line appears (TCP/IP and every
#               message of the job included); lattice's own counters beside it where it has them
#   codec bytes  grad_bytes / grad_bytes_uncompressed from lattice's metrics
# Logs, metrics files and results stay in the work directory printed at the start.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
PYTHON=${PYTHON:-/usr/bin/python3}
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
QUICK=0 RATES="" ROWS_FILTER="" STEPS="" WARMUP="" OUT="" BIND=core TIMEOUT=1200 TABLE="" RUN_PYTORCH=1
SUBNET=10.77.200.0/24
NAME=lattice-bench
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --rates) need "$@"; RATES="$2"; shift 2 ;;
    --rows) need "$@"; ROWS_FILTER="$2"; shift 2 ;;
    --steps) need "$@"; posint --steps "$2"; STEPS="$2"; shift 2 ;;
    --warmup) need "$@"; [[ "$2" =~ ^[0-9]+$ ]] || { echo "$BENCH_NAME: --warmup needs an integer >= 0, got '$2'" >&2; exit 2; }
              WARMUP="$2"; shift 2 ;;
    --out) need "$@"; OUT="$2"; shift 2 ;;
    --bind) need "$@"; BIND="$2"; shift 2 ;;
    --timeout) need "$@"; posint --timeout "$2"; TIMEOUT="$2"; shift 2 ;;
    --subnet) need "$@"; SUBNET="$2"; shift 2 ;;
    --skip-pytorch) RUN_PYTORCH=0; shift ;;
    --table) need "$@"; TABLE="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$BENCH_NAME: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -n "$TABLE" ]]; then
  [[ -s "$TABLE" ]] || { echo "$BENCH_NAME: --table $TABLE: no such file, or empty" >&2; exit 2; }
  exec "$PYTHON" bench/cluster_table.py "$TABLE"
fi

[[ "$BIND" == core || "$BIND" == none ]] || { echo "$BENCH_NAME: --bind '$BIND' is invalid: core or none" >&2; exit 2; }
if [[ -z "$RATES" ]]; then RATES=$([[ $QUICK == 1 ]] && echo "1gbit 10gbit" || echo "1gbit 2gbit 5gbit 10gbit"); fi
for r in $RATES; do
  [[ "$r" =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]] ||
    { echo "$BENCH_NAME: --rates: '$r' is not a rate such as 100mbit, 1gbit or 10gbit" >&2; exit 2; }
done
[[ -z "$STEPS" ]] && STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 3)
[[ -z "$WARMUP" ]] && WARMUP=1
if [[ -n "$OUT" ]]; then
  touch "$OUT" 2>/dev/null || { echo "$BENCH_NAME: --out $OUT: cannot write there" >&2; exit 2; }
  OUT=$(realpath "$OUT")
fi

# ---- what the machine needs ----------------------------------------------------------------
[[ $(id -u) == 0 ]] ||
  { echo "$BENCH_NAME: needs root: the emulated cluster is made of network namespaces (scripts/cluster.sh)" >&2; exit 77; }
[[ -x "$LATTICE_BIN" ]] || { echo "$BENCH_NAME: $LATTICE_BIN not found (build it, or set LATTICE_BIN)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "$BENCH_NAME: mpirun not found (Debian: openmpi-bin)" >&2; exit 2; }
[[ -x "$PYTHON" ]] || { echo "$BENCH_NAME: $PYTHON not found (set PYTHON)" >&2; exit 2; }
if ip netns list 2>/dev/null | awk '{print $1}' | grep -qE "^$NAME-(switch|node[0-9]+)\$"; then
  echo "$BENCH_NAME: a cluster named '$NAME' exists already (another cluster_bench.sh running, or one" \
       "left over); this script only ever removes the cluster it made. If none is running:" \
       "scripts/cluster.sh down --name $NAME --dir <its directory, or default>" >&2
  exit 1
fi
if [[ $RUN_PYTORCH == 1 ]]; then
  echo "== OpenBLAS for pytorch, threads=1: $PYTHON bench/torch_blas.py --threads 1" >&2
  "$PYTHON" bench/torch_blas.py --threads 1 > /dev/null ||
    { echo "$BENCH_NAME: PyTorch cannot run on OpenBLAS here (see above); fix it or pass --skip-pytorch" >&2; exit 1; }
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/lattice_cluster_bench.XXXXXX")
mkdir -p "$work/logs" "$work/metrics"
results="$work/results.jsonl"
: > "$results"
CLUSTER_DIR="$work/cluster"
# Every row runs the same binary, even if build/ is rebuilt meanwhile.
cp "$LATTICE_BIN" "$work/lattice"
LATTICE="$work/lattice"
echo "$BENCH_NAME: logs, metrics and results in $work" >&2
STARTED=$SECONDS

CLUSTER_UP=0
ROW_PID=""  # the row running now (bench/cluster_row.py), stopped by a signal to this script
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$ROW_PID" ]]; then kill -TERM "$ROW_PID" 2>/dev/null || true; wait "$ROW_PID" 2>/dev/null || true; fi
  if [[ $CLUSTER_UP == 1 ]]; then
    scripts/cluster.sh down --name "$NAME" --dir "$CLUSTER_DIR" >/dev/null 2>&1 ||
      echo "$BENCH_NAME: could not take the cluster down: scripts/cluster.sh down --name $NAME --dir $CLUSTER_DIR" >&2
  fi
  rm -f "$work/lattice"
  if [[ -n "$OUT" && -s "$results" ]]; then cat "$results" >> "$OUT"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "$BENCH_NAME: interrupted; taking the cluster down" >&2; exit 130' INT
trap 'echo "$BENCH_NAME: terminated; taking the cluster down" >&2; exit 143' TERM

CLUSTER_UP=1  # from here on, whatever up made is taken down
rc=0
scripts/cluster.sh up --name "$NAME" --dir "$CLUSTER_DIR" --slots 2 --rate 1gbit --subnet "$SUBNET" \
  > "$work/logs/cluster_up.log" 2>&1 || rc=$?
if [[ $rc != 0 ]]; then
  echo "$BENCH_NAME: scripts/cluster.sh up failed (exit $rc): $(tail -n 1 "$work/logs/cluster_up.log")" >&2
  exit "$rc"
fi
head -n 3 "$work/logs/cluster_up.log" >&2
MPIRUN="$CLUSTER_DIR/mpirun"
ON="$CLUSTER_DIR/on"
MASTER_ADDR=$(awk '$2 == "node0" {print $1}' "$CLUSTER_DIR/hosts")
CURRENT_RATE=""

shape() {  # RATE
  [[ "$CURRENT_RATE" == "$1" ]] && return 0
  echo "== links: scripts/cluster.sh shape --rate $1 --name $NAME" >&2
  scripts/cluster.sh shape --rate "$1" --name "$NAME" --dir "$CLUSTER_DIR" > /dev/null
  CURRENT_RATE=$1
}

# Where the ranks go. 2 nodes x 1 rank: rank i on node i, pinned to core i (the nodes share
# this machine's cores; Open MPI's own binding would put each node's first rank on core 0).
printf 'rank 0=node0 slot=0\nrank 1=node1 slot=1\n' > "$work/rankfile-link"
printf 'rank 0=node0 slot=0\nrank 1=node0 slot=1\n' > "$work/rankfile-node"
if [[ $BIND == core ]]; then
  PLACE_LINK=(--rankfile "$work/rankfile-link")
  PLACE_NODE=(--rankfile "$work/rankfile-node")
  PIN=(taskset -c)   # + the core, for the PyTorch ranks
else
  PLACE_LINK=(--map-by node --bind-to none)
  PLACE_NODE=(--host node0:2 --bind-to none)
  PIN=()
fi

# ---- models ----------------------------------------------------------------------------------
if [[ $QUICK == 1 ]]; then
  BIG="2 2 128 1000 64 2" SMALL="2 2 128 1000 64 2"
  COMM_SIZES=(--min-bytes 64K --max-bytes 1M --factor 4 --rounds 2)
else
  BIG="12 12 768 50257 256 4" SMALL="6 8 512 50257 256 4"
  COMM_SIZES=(--min-bytes 64K --max-bytes 16M --factor 4 --rounds 3 --iters 1)
fi
model_sets() {  # "L H C V T B" -> lattice --set's of the model (the micro-batch is each row's)
  local L H C V T B
  read -r L H C V T B <<< "$1"
  echo "--set model.n_layer=$L --set model.n_head=$H --set model.n_embd=$C --set model.vocab_size=$V" \
       "--set model.seq_len=$T"
}
read -r -a BIG_SETS <<< "$(model_sets "$BIG")"
read -r -a SMALL_SETS <<< "$(model_sets "$SMALL")"
read -r BL BH BC BV BT BB <<< "$BIG"
read -r SL SH SC SV ST SB <<< "$SMALL"
TRAIN_STEPS=$((WARMUP + STEPS))

# The machine, once.
"$PYTHON" - "$results" "$QUICK" "$RATES" "$STEPS" "$WARMUP" "$BIND" "$BIG" "$SMALL" <<'PY'
import json, os, platform, sys, time
path, quick, rates, steps, warmup, bind, big, small = sys.argv[1:]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
with open(path, "a") as f:
    f.write(json.dumps({"row": "_machine", "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
                        "date_start": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "load1_start": os.getloadavg()[0], "quick": quick == "1", "rates": rates.split(),
                        "steps": int(steps), "warmup": int(warmup), "bind": bind,
                        "big_model": big, "small_model": small}) + "\n")
PY

# run_row NAME META-JSON ROW-OPTIONS... -- CMD... [-- CMD...]: prints the command, runs it
# through bench/cluster_row.py (link counters, timeout, log) and appends its JSON line.
FAILED=0
run_row() {
  local name=$1 meta=$2 line
  shift 2
  local opts=() cmds=()
  while [[ $# -gt 0 && "$1" != -- ]]; do opts+=("$1"); shift; done
  cmds=("$@")
  echo "== $name" >&2
  local c shown="" sep=""
  for c in "${cmds[@]:1}"; do
    if [[ "$c" == -- ]]; then shown+=$'\n     & '; sep=""; continue; fi
    [[ "$c" =~ ^[A-Za-z0-9_./=,:@%+-]+$ ]] || c=$(printf '%q' "$c")   # quoted only where the shell needs it
    shown+="$sep$c"; sep=" "
  done
  echo "   $shown" >&2
  # In the background, so that a signal to this script is handled at once (the trap stops the row).
  "$PYTHON" bench/cluster_row.py --row "$name" --meta "$meta" --log "$work/logs/$name.log" \
    --switch "$NAME-switch" --nodes 2 --timeout "$TIMEOUT" "${opts[@]}" "${cmds[@]}" > "$work/row.json" &
  ROW_PID=$!
  wait "$ROW_PID" || true
  ROW_PID=""
  line=$(cat "$work/row.json")
  if [[ -z "$line" ]]; then
    line=$("$PYTHON" -c 'import json,sys; print(json.dumps({"row": sys.argv[1], "ok": False, "error": "cluster_row.py printed nothing"}))' "$name")
  fi
  echo "$line" >> "$results"
  "$PYTHON" - "$line" <<'PY' >&2 || true
import json, sys
d = json.loads(sys.argv[1])
if not d.get("ok"):
    print(f"   FAILED: {d.get('error')} (log: {d.get('log')})")
else:
    parts = [f"{d['wall_s']:.0f} s"]
    if d.get("tokens_per_sec"): parts.append(f"{d['tokens_per_sec']:.1f} tok/s")
    if d.get("comm_ms") is not None: parts.append(f"comm {d['comm_ms']:.0f} ms, exposed {d.get('comm_exposed_ms', 0):.0f} ms")
    if d.get("link_bytes_per_step"): parts.append(f"link {d['link_bytes_per_step'] / 1e6:.1f} MB/step")
    print("   " + ", ".join(parts))
PY
  grep -q '"ok": true' <<< "$line" || FAILED=$((FAILED + 1))
}

lattice_train() {  # NAME META-JSON ENV-PROGRESS NRANKS PLACEMENT-WORDS... ::: LATTICE-SETS...
  local name=$1 meta=$2 progress=$3 n=$4
  shift 4
  local place=()
  while [[ "$1" != ::: ]]; do place+=("$1"); shift; done
  shift
  local metrics="$work/metrics/$name.jsonl"
  run_row "$name" "$meta" --steps-file "$metrics" --warmup "$WARMUP" -- \
    "$MPIRUN" -n "$n" "${place[@]}" -x LATTICE_DP_PROGRESS="$progress" \
    "$LATTICE" train "$@" --set train.threads=1 --set train.steps="$TRAIN_STEPS" --set log.every=1 \
    --set log.metrics_file="$metrics"
}

# ---- 1. comm: inside a node and across the link, at 1gbit -----------------------------------
COMM_OPS=all_reduce,reduce_scatter,all_gather,all_to_all,send_recv,broadcast
if keep_row comm-node; then
  run_row comm-node '{"section":"comm","where":"node"}' --parse comm -- \
    "$MPIRUN" -n 2 "${PLACE_NODE[@]}" "$LATTICE" bench comm --ops "$COMM_OPS" "${COMM_SIZES[@]}"
fi
if keep_row comm-link; then
  shape 1gbit
  run_row comm-link '{"section":"comm","where":"link","rate":"1gbit"}' --parse comm -- \
    "$MPIRUN" -n 2 "${PLACE_LINK[@]}" "$LATTICE" bench comm --ops "$COMM_OPS" "${COMM_SIZES[@]}"
fi

# ---- 2-4. per rate ---------------------------------------------------------------------------
CODECS="none bf16 int8 onebit topk powersgd"
DDP_PORT=29500
for rate in $RATES; do
  any=0
  for r in probe dp2-thread dp2-inline ddp layout-tp2 layout-pp2 layout-dp2; do keep_row "$r@$rate" && any=1; done
  for c in $CODECS; do keep_row "codec-$c@$rate" && any=1; done
  [[ $any == 1 ]] || continue
  shape "$rate"
  run_row "probe@$rate" "{\"section\":\"probe\",\"rate\":\"$rate\"}" --parse comm -- \
    "$MPIRUN" -n 2 "${PLACE_LINK[@]}" "$LATTICE" bench comm --ops all_reduce --min-bytes 4M --max-bytes 16M \
    --factor 4 --rounds 3 --iters 1

  # 2. dp=2 with overlap on and off, GPT-2 124M, beside PyTorch DDP.
  for mode in thread inline; do
    keep_row "dp2-$mode@$rate" || continue
    lattice_train "dp2-$mode@$rate" "{\"section\":\"dp2\",\"rate\":\"$rate\",\"progress\":\"$mode\"}" "$mode" 2 \
      "${PLACE_LINK[@]}" ::: "${BIG_SETS[@]}" --set train.micro_batch_size="$BB" --set parallel.dp=2
  done
  if [[ $RUN_PYTORCH == 1 ]] && keep_row "ddp@$rate"; then
    DDP_PORT=$((DDP_PORT + 1))
    ddp_args=(--ranks 2 --threads 1 --n-layer "$BL" --n-head "$BH" --n-embd "$BC" --vocab "$BV" --seq "$BT"
              --batch "$BB" --steps "$STEPS" --warmup "$WARMUP" --master-addr "$MASTER_ADDR"
              --master-port "$DDP_PORT" --timeout "$TIMEOUT")
    steps_file="$work/metrics/ddp@$rate.jsonl"
    pin0=() pin1=()
    [[ $BIND == core ]] && pin0=("${PIN[@]}" 0) pin1=("${PIN[@]}" 1)
    run_row "ddp@$rate" "{\"section\":\"dp2\",\"rate\":\"$rate\",\"impl\":\"pytorch-ddp\"}" \
      --steps-file "$steps_file" --warmup "$WARMUP" --parse json -- \
      "$ON" node0 env GLOO_SOCKET_IFNAME=eth0 "${pin0[@]}" "$PYTHON" bench/torch_ddp_bench.py "${ddp_args[@]}" \
        --rank 0 --steps-file "$steps_file" -- \
      "$ON" node1 env GLOO_SOCKET_IFNAME=eth0 "${pin1[@]}" "$PYTHON" bench/torch_ddp_bench.py "${ddp_args[@]}" \
        --rank 1
  fi

  # 3. codecs at dp=2, the smaller model (codec-none is also the layout table's dp=2).
  for c in $CODECS; do
    if keep_row "codec-$c@$rate" || { [[ $c == none ]] && keep_row "layout-dp2@$rate"; }; then
      sets=(--set train.micro_batch_size="$SB" --set parallel.dp=2)
      [[ $c == none ]] || sets+=(--set compression.grad="$c")
      lattice_train "codec-$c@$rate" "{\"section\":\"codec\",\"rate\":\"$rate\",\"codec\":\"$c\"}" thread 2 \
        "${PLACE_LINK[@]}" ::: "${SMALL_SETS[@]}" "${sets[@]}"
    fi
  done

  # 4. tp=2 and pp=2 across the link, the same global batch as dp=2 (2 x SB sequences).
  if keep_row "layout-tp2@$rate"; then
    lattice_train "layout-tp2@$rate" "{\"section\":\"layout\",\"rate\":\"$rate\",\"layout\":\"tp2\"}" thread 2 \
      "${PLACE_LINK[@]}" ::: "${SMALL_SETS[@]}" --set parallel.tp=2 --set train.micro_batch_size=$((2 * SB))
  fi
  if keep_row "layout-pp2@$rate"; then
    lattice_train "layout-pp2@$rate" "{\"section\":\"layout\",\"rate\":\"$rate\",\"layout\":\"pp2\"}" thread 2 \
      "${PLACE_LINK[@]}" ::: "${SMALL_SETS[@]}" --set parallel.pp=2 --set parallel.schedule=1f1b \
      --set train.micro_batch_size=$(((SB + 1) / 2)) --set train.grad_accum_steps=$((2 * SB / ((SB + 1) / 2)))
  fi
done

# ---- 5. 2 nodes x 2 ranks: bytes and memory (4 ranks on 2 cores: no timings) ----------------
for variant in tp-inside tp-across; do
  keep_row "2x2-$variant" || continue
  [[ -n "$CURRENT_RATE" ]] || shape "${RATES##* }"
  map=slot
  [[ $variant == tp-across ]] && map=node
  lattice_train "2x2-$variant" "{\"section\":\"2x2\",\"rate\":\"$CURRENT_RATE\",\"map_by\":\"$map\"}" thread 4 \
    --map-by "$map" --bind-to none ::: "${SMALL_SETS[@]}" --set train.micro_batch_size="$SB" \
    --set parallel.dp=2 --set parallel.tp=2
done

"$PYTHON" - "$results" <<'PY'
import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"row": "_end", "date_end": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "load1_end": os.getloadavg()[0]}) + "\n")
PY
echo >&2
"$PYTHON" bench/cluster_table.py "$results"
echo "$BENCH_NAME: $(( (SECONDS - STARTED) / 60 )) min $(( (SECONDS - STARTED) % 60 )) s; results in $results${OUT:+ (and appended to $OUT)}" >&2
[[ $FAILED == 0 ]] || { echo "$BENCH_NAME: $FAILED row(s) failed (their logs: $work/logs)" >&2; exit 1; }
