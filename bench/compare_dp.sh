#!/usr/bin/env bash
# Data parallelism and ZeRO on CPU: lattice against PyTorch DistributedDataParallel, same run.
#
#   bench/compare_dp.sh [--quick] [--repeat R] [--steps S] [--warmup W] [--rows FILTER]
#                       [--out results.jsonl] [--bind-to MODE] [--buckets "1 4 25 100"]
#                       [--window-mb MB] [--offload-base DIR] [--timeout SECONDS]
#                       [--skip-lattice] [--skip-pytorch] [--coretype NAME] [--recalibrate]
#
# Model: GPT-2 124M (L=12 C=768 H=12 V=50257), T=256, micro-batch 4 sequences per
# rank, fp32; one step = forward + backward (+ the data-parallel reductions) +
# AdamW. --quick: L=2 C=128 H=2 V=1000, T=64, micro-batch 2, 3 timed steps after
# 1 warm-up, offload window 1 MiB (a smoke test of the script, not a measurement;
# default 5 timed steps after 2 warm-up).
#
# Rows (RxT = ranks x threads per rank; every data-parallel row keeps the
# per-rank batch, so dp=2 processes twice the tokens of dp=1 per step):
#   lattice-dp1-t1          1x1  single process, 1 thread (the 1.00 of the ratio column)
#   lattice-dp1-t2          1x2  single process, 2 threads
#   pytorch-t1, pytorch-t2  1x1, 1x2  bench/torch_gpt2_bench.py (plain process, no DDP)
#   lattice-dp2-s0..s3      2x1  parallel.dp=2, parallel.zero_stage=0..3
#   pytorch-ddp2-t1         2x1  bench/torch_ddp_bench.py: DDP, gloo, ranks started by hand (env://)
#   lattice-dp2-s0-offload  2x1  stage 0 with zero.offload=disk, a fresh directory under
#                                --offload-base (default $TMPDIR or /tmp), zero.offload_window_mb=--window-mb
#                                (default 64)
#   lattice-dp4-s0, -s3     4x1  memory only: more ranks than cores, so their speed is not
#                                meaningful (n/m); run once whatever --repeat says, 1 timed step
#   lattice-bucket-N        2x1  stage 0 with parallel.bucket_mb=N for each N of --buckets (default
#                                "1 4 25 100"); the size equal to lattice's default is the
#                                lattice-dp2-s0 row itself and is not run twice
# --rows keeps the rows whose name contains any of the comma-separated FILTERs.
# --repeat R (default 1) runs every row R times, the rows interleaved (lattice and
# PyTorch alternate within each round), and reports each row's fastest run with the
# range of all of them: on a shared machine other load only ever slows a run down.
# --out appends every run's JSON line (with "row" and "run") to a file.
#
# lattice side: $LATTICE_BIN (default build/lattice) bench train --json, under
# "mpiexec -n R --bind-to MODE" for R > 1 (--bind-to, default core, Open MPI's own
# default at 2 ranks: on a quiet 2-core VM, L=4 C=256 T=128 dp=2 ran 10.7-11.3K tok/s
# bound to cores against 10.1-10.8K with none; with other load on the machine none did
# better, as a rank may then move off a busy core; rows with more ranks than cores
# always run --bind-to none --oversubscribe). Its JSON gives tokens/s of the
# whole job, comm_hidden (share of the collectives' run time that overlapped
# compute), comm_bytes_per_step, and rank 0's tracked memory peaks by category
# (model state = params + grads + optimizer). Every rank of both sides also runs
# under a small Python wrapper that reports its peak RSS (getrusage ru_maxrss of
# the child), the figure PyTorch's side reports too; "peak mem" is lattice's own
# tracked peak (all its categories), "RSS" the process's max over ranks.
#
# PyTorch side: bench/torch_blas.py makes torch run on OpenBLAS with the right core
# type first (see bench/compare_gpt2.sh and that file); bench/torch_gpt2_bench.py is
# the plain single process, bench/torch_ddp_bench.py --ranks 2 the DDP job
# (bucket_cap_mb 25, DDP's default; its "hidden" is DDP's own logged
# overlap / backward communication time, from its first iterations).
#
# Bucket sweep: the lattice-bucket-N rows' tokens/s, communication per step and
# share hidden, and beside them "mpiexec -n 2 lattice bench comm" at each size
# (all_reduce, the stage 0-1 reduction, and reduce_scatter, stage 2-3's), fastest
# of 5 rounds, lattice's busbw and raw MPI's.
#
# Targets (PASS/MISS lines after the table): dp=2 stage 0 >= 1.9x the tokens/s of
# dp=1 (1 thread); >= 80% of the communication hidden at stages 0-2; stage 3's
# per-rank model state at dp=4 <= 0.30x stage 0's; stage 3 >= 0.85x stage 0's
# tokens/s at dp=2; offload >= 0.7x no offload with optimizer bytes <= the window.
# Printed beside them: dp=2x1 thread against dp=1x2 threads (the real choice on two
# cores) and lattice dp=2 against DDP.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
PYTHON=${PYTHON:-/usr/bin/python3}
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
ROWS_FILTER=""
STEPS=""
WARMUP=""
QUICK=0
REPEAT=1
RUN_LATTICE=1
RUN_PYTORCH=1
OUT=""
CORETYPE=""
RECALIBRATE=0
BIND_TO=core
BUCKETS="1 4 25 100"
WINDOW_MB=""
OFFLOAD_BASE=${TMPDIR:-/tmp}
TIMEOUT=1800

while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --rows) need "$@"; ROWS_FILTER="$2"; shift ;;
    --steps) need "$@"; STEPS="$2"; shift ;;
    --warmup) need "$@"; WARMUP="$2"; shift ;;
    --repeat) need "$@"; REPEAT="$2"; shift ;;
    --out) need "$@"; OUT="$2"; shift ;;
    --bind-to) need "$@"; BIND_TO="$2"; shift ;;
    --buckets) need "$@"; BUCKETS="$2"; shift ;;
    --window-mb) need "$@"; WINDOW_MB="$2"; shift ;;
    --offload-base) need "$@"; OFFLOAD_BASE="$2"; shift ;;
    --timeout) need "$@"; TIMEOUT="$2"; shift ;;
    --skip-lattice) RUN_LATTICE=0 ;;
    --skip-pytorch) RUN_PYTORCH=0 ;;
    --coretype) need "$@"; CORETYPE="$2"; shift ;;
    --recalibrate) RECALIBRATE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_dp.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
posnum() { [[ "$2" =~ ^[0-9]*[.]?[0-9]+$ && ! "$2" =~ ^[0.]+$ ]] ||
  { echo "compare_dp.sh: $1 needs a positive number, got '$2'" >&2; exit 2; }; }
posint --repeat "$REPEAT"
posint --timeout "$TIMEOUT"
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 3 || echo 5); fi
if [[ -z "$WARMUP" ]]; then WARMUP=$([[ $QUICK == 1 ]] && echo 1 || echo 2); fi
if [[ -z "$WINDOW_MB" ]]; then WINDOW_MB=$([[ $QUICK == 1 ]] && echo 1 || echo 64); fi
posint --steps "$STEPS"
[[ "$WARMUP" =~ ^[0-9]+$ ]] || { echo "compare_dp.sh: --warmup needs an integer >= 0, got '$WARMUP'" >&2; exit 2; }
posnum --window-mb "$WINDOW_MB"
for b in $BUCKETS; do posnum --buckets "$b"; done
[[ -d "$OFFLOAD_BASE" && -w "$OFFLOAD_BASE" ]] ||
  { echo "compare_dp.sh: --offload-base $OFFLOAD_BASE is not a writable directory" >&2; exit 2; }

# L H C V T B
if [[ $QUICK == 1 ]]; then MODEL="2 2 128 1000 64 2"; else MODEL="12 12 768 50257 256 4"; fi
read -r L H C V T B <<< "$MODEL"
MODEL_SETS=(--set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.vocab_size="$V"
            --set model.seq_len="$T" --set train.micro_batch_size="$B")
TORCH_MODEL=(--n-layer "$L" --n-head "$H" --n-embd "$C" --vocab "$V" --seq "$T" --batch "$B")
CORES=$(nproc)

if [[ $RUN_LATTICE == 1 && ! -x "$LATTICE_BIN" ]]; then
  echo "compare_dp.sh: $LATTICE_BIN not found or not executable (build it, set LATTICE_BIN, or pass --skip-lattice)" >&2
  exit 2
fi
if [[ $RUN_LATTICE == 1 ]] && ! command -v mpiexec >/dev/null; then
  echo "compare_dp.sh: mpiexec not found (Debian: openmpi-bin), needed for the dp > 1 rows" >&2
  exit 2
fi
if [[ ! -x "$PYTHON" && "$PYTHON" == /usr/bin/python3 ]]; then  # python3-torch brings Python (and torch)
  sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
  echo "compare_dp.sh: $PYTHON missing, installing python3-torch" >&2
  apt_install=($sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=1200)
  "${apt_install[@]}" python3-torch >/dev/null || { $sudo apt-get update -qq && "${apt_install[@]}" python3-torch >/dev/null; }
fi
if [[ ! -x "$PYTHON" ]]; then
  echo "compare_dp.sh: $PYTHON not found (set PYTHON)" >&2
  exit 2
fi
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

work=$(mktemp -d)
OFFLOAD_DIR=""  # the offload row's directory while it runs
trap 'rm -rf "$work" ${OFFLOAD_DIR:+"$OFFLOAD_DIR"}' EXIT
results="$work/results"
: > "$results"


# Runs a command with each process's peak RSS reported on stderr as "COMPARE_DP_RSS <bytes>"
# (ru_maxrss of the waited-for child, like torch_ddp_bench.py's own figure). A SIGTERM (timeout,
# mpiexec stopping its ranks) is passed on to the child, which is waited for.
RSS_WRAP=("$PYTHON" -c 'import resource, signal, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, f: p.send_signal(n))
r = p.wait()
print("COMPARE_DP_RSS %d" % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024), file=sys.stderr)
sys.exit(r if r >= 0 else 128 - r)')

record() {  # row run impl json-or-empty rss-csv
  local row=$1 run=$2 impl=$3 json=$4 rss=$5
  if [[ -z "$json" ]]; then json='{"impl":"'"$impl"'","failed":true}'; fi
  printf '%s\t%s\t%s\t%s\n' "$row" "$run" "$rss" "$json" >> "$results"
}

# run_capture CMD...: runs under timeout; sets OUT_JSON (its JSON line) and OUT_RSS (comma-separated
# RSS per process); the command's other stderr lines are passed on, indented.
run_capture() {
  local rc=0
  timeout --kill-after=10 "$TIMEOUT" "$@" > "$work/stdout" 2> "$work/stderr" || rc=$?
  OUT_JSON=$(json_line < "$work/stdout")
  # Not anchored: mpiexec forwards the ranks' stderr, and two ranks' last lines can arrive as one.
  OUT_RSS=$(grep -o 'COMPARE_DP_RSS [0-9]*' "$work/stderr" | awk '{print $2}' | paste -sd, - || true)
  grep -v -e '^COMPARE_DP_RSS ' -e '^torch_blas: .*cached in' -e '^[[:space:]]*$' "$work/stderr" |
    sed 's/^/   | /' >&2 || true
  if [[ $rc == 124 || $rc == 137 ]]; then
    echo "   timed out after --timeout $TIMEOUT s" >&2
  elif [[ -z "$OUT_JSON" ]]; then
    echo "   failed (exit $rc), no result" >&2
  fi
}

# The machine: lattice's measured peak (its JSON names the CPU and ISA).
PEAK_JSON=""
if [[ -x "$LATTICE_BIN" ]]; then
  echo "== peak: $LATTICE_BIN bench peak --json" >&2
  PEAK_JSON=$("$LATTICE_BIN" bench peak --json 2>"$work/peak_err" | json_line) || true
  [[ -n "$PEAK_JSON" ]] || echo "   no result: $(head -n 1 "$work/peak_err")" >&2
fi
[[ -z "$PEAK_JSON" ]] || record _peak 0 lattice-peak "$PEAK_JSON" ""
DEFAULT_BUCKET=""
if [[ -x "$LATTICE_BIN" ]]; then
  DEFAULT_BUCKET=$("$LATTICE_BIN" train --help-config 2>/dev/null |
                   awk '$1 == "bucket_mb" && $2 == "=" { print $3; exit }') || true
fi

# OpenBLAS for PyTorch, once per thread count used (later runs read the cached core type).
BLAS_ARGS=()
if [[ -n "$CORETYPE" ]]; then BLAS_ARGS+=(--coretype "$CORETYPE"); fi
if [[ $RUN_PYTORCH == 1 ]]; then
  setup_args=("${BLAS_ARGS[@]}")
  if [[ $RECALIBRATE == 1 ]]; then setup_args+=(--recalibrate); fi
  for n in 1 2; do
    [[ $n -le $CORES ]] || continue
    echo "== OpenBLAS for pytorch, threads=$n" >&2
    if ! setup=$("$PYTHON" bench/torch_blas.py --threads "$n" "${setup_args[@]}" | json_line) || [[ -z "$setup" ]]; then
      echo "compare_dp.sh: PyTorch cannot run on OpenBLAS with $n thread(s) here (see above); no ratio" \
           "against a crippled reference. Fix that, or pass --skip-pytorch." >&2
      exit 1
    fi
    record _setup "$n" torch-blas "$setup" ""
  done
fi

# name side ranks threads stage options (options: comma-separated key=value --set's, or "-")
ROWS=(
  "lattice-dp1-t1 lattice 1 1 0 -"
  "pytorch-t1 pytorch 1 1 0 -"
  "lattice-dp1-t2 lattice 1 2 0 -"
  "pytorch-t2 pytorch 1 2 0 -"
  "lattice-dp2-s0 lattice 2 1 0 -"
  "pytorch-ddp2-t1 pytorch-ddp 2 1 0 -"
  "lattice-dp2-s1 lattice 2 1 1 -"
  "lattice-dp2-s2 lattice 2 1 2 -"
  "lattice-dp2-s3 lattice 2 1 3 -"
  "lattice-dp2-s0-offload lattice 2 1 0 offload"
)
for b in $BUCKETS; do ROWS+=("lattice-bucket-$b lattice 2 1 0 parallel.bucket_mb=$b"); done
ROWS+=("lattice-dp4-s0 lattice 4 1 0 -" "lattice-dp4-s3 lattice 4 1 3 -")

same_number() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 == b + 0) }'; }

run_row() {  # name side ranks threads stage options run
  local name=$1 side=$2 ranks=$3 threads=$4 stage=$5 opts=$6 run=$7
  local steps=$STEPS warmup=$WARMUP oversub=0 cmd=() sets=() offdir=""
  if (( ranks * threads > CORES )); then oversub=1; steps=1; warmup=1; fi
  case "$side" in
    lattice)
      [[ $RUN_LATTICE == 1 ]] || return 0
      sets=("${MODEL_SETS[@]}" --set train.threads="$threads" --set parallel.dp="$ranks" --set parallel.zero_stage="$stage")
      if [[ "$opts" == offload ]]; then
        offdir=$(mktemp -d "$OFFLOAD_BASE/compare_dp_offload.XXXXXX")
        OFFLOAD_DIR=$offdir
        sets+=(--set zero.offload=disk --set zero.offload_dir="$offdir" --set zero.offload_window_mb="$WINDOW_MB")
      elif [[ "$opts" != - ]]; then
        sets+=(--set "$opts")
      fi
      cmd=("${RSS_WRAP[@]}" "$LATTICE_BIN" bench train "${sets[@]}" --steps "$steps" --warmup "$warmup" --json)
      if (( ranks > 1 )); then
        if (( oversub )); then
          cmd=(mpiexec -n "$ranks" --oversubscribe --bind-to none "${cmd[@]}")
        else
          cmd=(mpiexec -n "$ranks" --bind-to "$BIND_TO" "${cmd[@]}")
        fi
      fi ;;
    pytorch)
      [[ $RUN_PYTORCH == 1 ]] || return 0
      cmd=("${RSS_WRAP[@]}" "$PYTHON" bench/torch_gpt2_bench.py "${TORCH_MODEL[@]}" --threads "$threads"
           --steps "$steps" --warmup "$warmup" "${BLAS_ARGS[@]}") ;;
    pytorch-ddp)
      [[ $RUN_PYTORCH == 1 ]] || return 0
      cmd=("$PYTHON" bench/torch_ddp_bench.py --ranks "$ranks" "${TORCH_MODEL[@]}" --threads "$threads"
           --steps "$steps" --warmup "$warmup" --timeout "$TIMEOUT" "${BLAS_ARGS[@]}") ;;
  esac
  echo "== $name (${ranks}x$threads)$([[ $REPEAT -gt 1 ]] && echo " run $run/$REPEAT" || true)" >&2
  run_capture "${cmd[@]}"
  [[ -z "$offdir" ]] || { rm -rf "$offdir"; OFFLOAD_DIR=""; }
  record "$name" "$run" "$side" "$OUT_JSON" "$OUT_RSS"
}

selected=()
SWEEP=0
for row in "${ROWS[@]}"; do
  read -r name side ranks threads stage opts <<< "$row"
  keep_row "$name" || continue
  [[ "$name" != lattice-bucket-* ]] || SWEEP=1
  # The default bucket size is lattice-dp2-s0 itself.
  if [[ "$name" == lattice-bucket-* && -n "$DEFAULT_BUCKET" ]] && same_number "${name#lattice-bucket-}" "$DEFAULT_BUCKET" &&
     keep_row lattice-dp2-s0; then
    continue
  fi
  selected+=("$row")
done
for ((run = 1; run <= REPEAT; run++)); do
  for row in "${selected[@]}"; do
    read -r name side ranks threads stage opts <<< "$row"
    if (( run > 1 && ranks * threads > CORES )); then continue; fi  # memory-only rows: once
    run_row "$name" "$side" "$ranks" "$threads" "$stage" "$opts" "$run"
  done
done

# lattice bench comm at the bucket sizes (raw collective figures beside the sweep).
if [[ $RUN_LATTICE == 1 && $SWEEP == 1 ]] && (( CORES >= 2 )); then
  for b in $BUCKETS; do
    bytes=$(awk -v m="$b" 'BEGIN { printf "%d", m * 1048576 }')
    echo "== lattice bench comm, 2 ranks, $b MiB" >&2
    timeout --kill-after=10 "$TIMEOUT" mpiexec -n 2 --bind-to "$BIND_TO" "$LATTICE_BIN" bench comm \
        --min-bytes "$bytes" --max-bytes "$bytes" --ops all_reduce,reduce_scatter --rounds 5 \
        > "$work/comm_$b" 2> "$work/comm_err" || echo "   failed: $(head -n 1 "$work/comm_err")" >&2
    awk -v mb="$b" '/^# all_reduce|^# reduce_scatter/ { op = $2 }
                    !/^#/ && NF >= 15 && $5 == "|" && op != "" { printf "%s\t%s\t%s\t%s\t%s\t%s\n", mb, op, $6, $8, $10, $12 }' \
        "$work/comm_$b" >> "$work/comm_table" || true
  done
fi
touch "$work/comm_table"

if [[ -n "$OUT" ]]; then
  "$PYTHON" - "$results" "$OUT" <<'EOF'
import json, sys
with open(sys.argv[1]) as f, open(sys.argv[2], "a") as out:
    for line in f:
        row, run, rss, js = line.rstrip("\n").split("\t", 3)
        d = json.loads(js)
        d.update({"row": row, "run": int(run)})
        if rss:
            d["rss_bytes_by_process"] = [int(x) for x in rss.split(",")]
        out.write(json.dumps(d) + "\n")
EOF
fi

offload_fs=$(df --output=fstype "$OFFLOAD_BASE" 2>/dev/null | tail -n 1 || true)
"$PYTHON" - "$results" "$work/comm_table" "$STEPS" "$WARMUP" "$REPEAT" "$MODEL" "$WINDOW_MB" "$BIND_TO" \
    "$CORES" "$DEFAULT_BUCKET" "$OFFLOAD_BASE ($offload_fs)" "$QUICK" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
import torch_blas

(path, comm_path, steps, warmup, repeat, model, window_mb, bind_to, cores, default_bucket, offload_base,
 quick) = sys.argv[1:13]
L, H, C, V, T, B = (int(x) for x in model.split())
repeat, cores, window_mb = int(repeat), int(cores), float(window_mb)
runs, order, setup, peak = {}, [], {}, None
for line in open(path):
    row, run, rss, js = line.rstrip("\n").split("\t", 3)
    d = json.loads(js)
    if row == "_peak":
        peak = d
        continue
    if row == "_setup":
        setup[int(run)] = d
        continue
    if rss and not d.get("failed"):
        r = [int(x) for x in rss.split(",")]
        d.setdefault("peak_rss_bytes_max", max(r))  # torch_ddp_bench.py reports its own
        d["rss_processes"] = len(r)
    runs.setdefault(row, []).append(d)
    if row not in order:
        order.append(row)

def tps(d):
    return d.get("tokens_per_sec") if d and not d.get("failed") else None

def best(row):
    """(fastest successful run, (min, max) tokens/s over the runs) of a row; the default bucket is lattice-dp2-s0."""
    rs = runs.get(row)
    if rs is None and row.startswith("lattice-bucket-") and default_bucket and \
            float(row[len("lattice-bucket-"):]) == float(default_bucket):
        rs = runs.get("lattice-dp2-s0")
    ok = [d for d in rs or [] if tps(d)]
    if not ok:
        return None, None
    return max(ok, key=tps), (min(map(tps, ok)), max(map(tps, ok)))

def fmt(x, spec):
    width = spec.split(".")[0]
    return format(x, spec) if x is not None else "n/a".rjust(int(width) if width else 0)

def times(r):
    return f"{r:.2f}x" if r is not None else "n/a"

def pct(x, width):
    return (f"{100 * x:.0f}%" if x is not None else "n/a").rjust(width)

def mib(x):
    return f"{x / 2**20:9.1f}" if x is not None else "      n/a"

def hidden(d):
    if not d:
        return None
    if d.get("impl") == "pytorch-ddp":
        comm, overlap = d.get("ddp_backward_comm_ms"), d.get("ddp_backward_compute_comm_overlap_ms")
        return min(1.0, overlap / comm) if comm and overlap is not None else None
    return d.get("comm_hidden") if d.get("ranks", 1) > 1 else None

cpu = torch_blas.cpu_identity()
print()
print(f"CPU: {(peak or {}).get('cpu') or cpu['model_name']} ({cpu['vendor']} family {cpu['family']} model "
      f"{cpu['model']}), {cores} cores, ISA {(peak or {}).get('isa') or cpu['isa']}"
      + (f" (oneDNN {peak['dnnl_isa']})" if (peak or {}).get("dnnl_isa") else ""))
if peak and peak.get("fp32_gflops_per_core"):
    print(f"peak: {peak['fp32_gflops_per_core']:.1f} GFLOP/s fp32 per core (lattice bench peak, {peak.get('threads')} "
          "threads)")
else:
    print("peak: n/a (lattice bench peak gave no result)")
for n, d in sorted(setup.items()):
    print(f"pytorch {n} thread(s): OpenBLAS core type {d['openblas_coretype']} ({d['openblas_coretype_source']}), "
          f"{d.get('blas_library')}")
print(f"model L={L} C={C} H={H} V={V}, T={T}, micro-batch {B} per rank, fp32"
      + (" (--quick: a smoke test, not a measurement)" if quick == "1" else ""))
print(f"steps={steps} warmup={warmup} repeat={repeat}" + (" (fastest run of each row; range below it)" if repeat > 1 else "")
      + f"; mpiexec --bind-to {bind_to}; offload dir under {offload_base}, window {window_mb:g} MiB")
print("tok/s: whole job; x dp1: against lattice-dp1-t1; hidden: share of communication overlapped (DDP: its logged "
      "overlap / backward comm); state: params+grads+optimizer bytes per rank (lattice: rank 0's peaks), x s0: against "
      "stage 0 at the same dp; peak mem: lattice's tracked peak (rank 0); RSS: process peak, max over ranks")

base, _ = best("lattice-dp1-t1")
hdr = (f"{'row':<24} {'RxT':>4} {'tok/s':>9} {'x dp1':>6} {'hidden':>6} {'state MiB':>9} {'x s0':>5} "
       f"{'peak mem MiB':>12} {'RSS MiB':>9}")
print(hdr)
print("-" * len(hdr))
sweep_rows = [r for r in order if r.startswith("lattice-bucket-")]
if default_bucket and not any(float(r[len("lattice-bucket-"):]) == float(default_bucket) for r in sweep_rows) \
        and "lattice-dp2-s0" in runs:
    sweep_rows.append(f"lattice-bucket-{default_bucket}")
sweep_rows.sort(key=lambda r: float(r[len("lattice-bucket-"):]))
notes = []
for row in order:
    if row.startswith("lattice-bucket-"):
        continue
    d, rng = best(row)
    if d is None:
        print(f"{row:<24} {'':>4} {'failed':>9}")
        continue
    ranks, threads = d.get("ranks", 1), d.get("threads", 1)
    oversub = ranks * threads > cores
    stage0 = None
    if row.startswith("lattice-dp"):
        s0, _ = best(f"lattice-dp{ranks}-s0") if ranks > 1 else (None, None)
        stage0 = (s0 or {}).get("model_state_bytes") if ranks > 1 else d.get("model_state_bytes")
    state = d.get("model_state_bytes")
    t = tps(d)
    ratio = t / tps(base) if base and not oversub else None
    speed = "n/m".rjust(9) if oversub else fmt(t, "9.1f")
    print(f"{row:<24} {f'{ranks}x{threads}':>4} {speed} {fmt(ratio, '6.2f')} {pct(hidden(d), 6)} "
          f"{mib(state)} {fmt(state / stage0 if state and stage0 else None, '5.2f')} "
          f"{mib(d.get('peak_mem_bytes')):>12} {mib(d.get('peak_rss_bytes_max'))}")
    if repeat > 1 and rng and not oversub:
        print(f"{'':<24} {'':>4} tok/s {rng[0]:.1f}-{rng[1]:.1f} over {len([x for x in runs[row] if tps(x)])} runs")
    if d.get("rss_processes") is not None and d["rss_processes"] != ranks:
        notes.append(f"{row}: RSS reported by {d['rss_processes']} of {ranks} processes (the max is over those)")
    if d.get("ddp_bucket_bytes"):
        notes.append(f"{row}: DDP's gradient buckets hold {mib(d['ddp_bucket_bytes']).strip()} MiB per rank beside "
                     "the .grad tensors (not in state; --grad-as-bucket-view would share them)")
    if oversub:
        notes.append(f"{row}: {ranks} ranks x {threads} thread(s) on {cores} cores, oversubscribed: memory only "
                     "(speed n/m, not meaningful)")
for n in notes:
    print(f"  {n}")

# Bucket sweep, lattice bench comm beside it.
comm = {}
for line in open(comm_path):
    mb, op, lat_us, lat_busbw, raw_us, raw_busbw = line.rstrip("\n").split("\t")
    comm[(float(mb), op)] = (float(lat_us), float(lat_busbw), float(raw_busbw))
if sweep_rows:
    print(f"\nbucket sweep: lattice dp=2 stage 0, parallel.bucket_mb (default {default_bucket or '?'} MiB); "
          "comm ms = collectives' run time per step, exposed = not hidden;")
    print("bench comm: 2 ranks, fastest of 5 rounds, one call of that size: lattice us and busbw GB/s, raw MPI busbw")
    h2 = (f"{'bucket MiB':>10} {'tok/s':>9} {'x dflt':>6} {'comm ms':>8} {'exposed':>8} {'hidden':>6} {'MB/step':>8} "
          f"{'GB/s':>6} | {'all_reduce us':>13} {'busbw':>6} {'raw':>6} | {'red_scat us':>11} {'busbw':>6} {'raw':>6}")
    print(h2)
    print("-" * len(h2))
    dflt, _ = best(f"lattice-bucket-{default_bucket}") if default_bucket else (None, None)
    fastest = None
    for row in sweep_rows:
        mb = float(row[len("lattice-bucket-"):])
        d, _ = best(row)
        t = tps(d)
        if t and (fastest is None or t > fastest[1]):
            fastest = (mb, t)
        cms = d.get("comm_ms") if d else None
        hid = d.get("comm_hidden") if d else None
        by = d.get("comm_bytes_per_step") if d else None
        ar, rs = comm.get((mb, "all_reduce")), comm.get((mb, "reduce_scatter"))
        c3 = lambda c, w: (f"{c[0]:>{w}.1f} {c[1]:6.2f} {c[2]:6.2f}" if c else f"{'n/a':>{w}} {'':6} {'':6}")
        print(f"{mb:>10g} {fmt(t, '9.1f')} {fmt(t / tps(dflt) if t and dflt else None, '6.2f')} {fmt(cms, '8.1f')} "
              f"{fmt(cms * (1 - hid) if cms is not None and hid is not None else None, '8.1f')} "
              f"{pct(hid, 6)} {fmt(by / 1e6 if by else None, '8.1f')} "
              f"{fmt(by / (cms * 1e6) if by and cms else None, '6.2f')} | {c3(ar, 13)} | {c3(rs, 11)}"
              + ("  <- default" if default_bucket and mb == float(default_bucket) else ""))
    if fastest:
        print(f"default parallel.bucket_mb = {default_bucket or '?'} MiB; fastest here: {fastest[0]:g} MiB")

# Targets.
print("\ntargets:")
def check(label, value, ok, detail):
    if value is None:
        print(f"  n/a   {label}: {detail}")
    else:
        print(f"  {'PASS' if ok else 'MISS'}  {label}: {detail}")

def t_of(row):
    return tps(best(row)[0])

dp1, dp1t2, s0, ddp = t_of("lattice-dp1-t1"), t_of("lattice-dp1-t2"), t_of("lattice-dp2-s0"), t_of("pytorch-ddp2-t1")
r = s0 / dp1 if s0 and dp1 else None
check("dp=2 >= 1.9x dp=1 at equal per-rank batch (1 thread per rank)", r, r and r >= 1.9,
      f"{fmt(s0, '.1f')} / {fmt(dp1, '.1f')} tok/s = {times(r)}")
r = s0 / dp1t2 if s0 and dp1t2 else None
print(f"  info  dp=2 x 1 thread against dp=1 x 2 threads (the choice on two cores): {fmt(s0, '.1f')} / "
      f"{fmt(dp1t2, '.1f')} tok/s = {times(r)}")
for s in (0, 1, 2):
    d, _ = best(f"lattice-dp2-s{s}")
    h = d.get("comm_hidden") if d else None
    check(f"stage {s}: >= 80% of DP communication hidden behind backward", h, h is not None and h >= 0.8,
          f"{pct(h, 0)} of {fmt(d.get('comm_ms') if d else None, '.1f')} ms "
          "per step")
# Stage 0 keeps the whole model state on every rank whatever dp is: dp=4's row, else dp=2's or dp=1's.
s0_row = next((r for r in ("lattice-dp4-s0", "lattice-dp2-s0", "lattice-dp1-t1") if best(r)[0]), None)
d0 = best(s0_row)[0] if s0_row else None
d3, _ = best("lattice-dp4-s3")
m0, m3 = (d0 or {}).get("model_state_bytes"), (d3 or {}).get("model_state_bytes")
r = m3 / m0 if m0 and m3 else None
check("stage 3 at dp=4 <= 0.30x stage 0's per-rank model-state bytes", r, r is not None and r <= 0.30,
      f"{mib(m3).strip()} / {mib(m0).strip()} MiB ({s0_row or 'no stage 0 row'}) = {fmt(r, '.3f')}"
      + (f" (params {mib(d3.get('params_bytes')).strip()}, grads {mib(d3.get('grads_bytes')).strip()}, "
         f"optimizer {mib(d3.get('optimizer_bytes')).strip()} MiB)" if d3 else ""))
s3 = t_of("lattice-dp2-s3")
r = s3 / s0 if s3 and s0 else None
check("stage 3 >= 0.85x stage 0 tokens/s at dp=2", r, r and r >= 0.85,
      f"{fmt(s3, '.1f')} / {fmt(s0, '.1f')} tok/s = {times(r)}")
do, _ = best("lattice-dp2-s0-offload")
off = tps(do)
r = off / s0 if off and s0 else None
opt = (do or {}).get("optimizer_bytes")
window = window_mb * 2**20
check("offload >= 0.7x no offload (dp=2 stage 0)", r, r and r >= 0.7,
      f"{fmt(off, '.1f')} / {fmt(s0, '.1f')} tok/s = {times(r)}")
check("offload: resident optimizer bytes <= the window", opt, opt is not None and opt <= window,
      f"{mib(opt).strip()} MiB resident, window {window_mb:g} MiB"
      + (f" (no offload: {mib(best('lattice-dp2-s0')[0].get('optimizer_bytes')).strip()} MiB)" if s0 else ""))
r = s0 / ddp if s0 and ddp else None
print(f"  info  lattice dp=2 stage 0 against PyTorch DDP 2 ranks x 1 thread: {fmt(s0, '.1f')} / {fmt(ddp, '.1f')} "
      f"tok/s = {times(r)}")
pt1 = t_of("pytorch-t1")
r = ddp / pt1 if ddp and pt1 else None
print(f"  info  PyTorch's own scaling, DDP 2x1 against one process x 1 thread: {fmt(ddp, '.1f')} / {fmt(pt1, '.1f')} "
      f"tok/s = {times(r)}")
EOF
