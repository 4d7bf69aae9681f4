#!/usr/bin/env bash
# GPT-2 and Llama CPU training throughput: lattice against PyTorch, same configs, same run.
#
#   bench/compare_gpt2.sh [--model gpt2|llama|all] [--quick] [--threads "1 2"] [--rows FILTER]
#                         [--steps S] [--warmup W] [--repeat R] [--skip-lattice] [--skip-pytorch]
#                         [--out results.jsonl] [--coretype NAME] [--recalibrate]
#
# Rows (V = 50257), --model gpt2 (the default):
#   gpt2-124M-B4-T64     L=12 C=768 H=12  B=4 T=64
#   gpt2-124M-B4-T256    L=12 C=768 H=12  B=4 T=256
#   L6-C384-B8-T256      L=6  C=384 H=6   B=8 T=256
# --model llama (the shape is configs/llama-125m.toml's [model], read by both sides:
# L=12 C=768 H=12, 4 key/value heads, SwiGLU 2304, tied head, 121.2M parameters):
#   llama-125M-B4-T64    B=4 T=64
#   llama-125M-B4-T256   B=4 T=256
# --model all: both. Each row runs with every thread count of --threads (default "1 2").
# --rows keeps the rows whose name contains any of the comma-separated FILTERs.
# --repeat R (default 1) runs PyTorch and lattice R times each, alternating, and
# reports each side's best run with the range of all of them: on a shared
# machine other tenants only ever slow a run down, so the best of several
# interleaved runs is the fairest estimate of each side's speed, and the range
# shows how noisy the machine was.
# --quick: 2 timed steps after 1 warm-up (default 5 after 2).
# --out appends every run's JSON line (with "row" and "threads") to a file.
#
# One step = forward + backward + AdamW, fp32, no gradient accumulation.
#
# PyTorch side: bench/torch_gpt2_bench.py (GPT-2 rows) or bench/torch_llama_bench.py (Llama
# rows, --config configs/llama-125m.toml: the same driver, tools/llama_reference.py's model),
# at its best on the CPU at hand.
# First, once per thread count, bench/torch_blas.py makes torch run on
# OpenBLAS (installing python3-torch and libopenblas0-pthread with apt-get
# when missing, and pointing the libblas.so.3 alternative at OpenBLAS) and
# picks OpenBLAS's core type by timing the ones the CPU's flags allow
# (SkylakeX, Cooperlake, Haswell, Zen) on GPT-2 GEMMs; the choice is cached in
# ~/.cache/lattice/openblas_coretype.json. --coretype NAME forces a core type,
# --recalibrate measures again. If torch cannot run on OpenBLAS the script
# stops there: no ratio is printed against the reference BLAS. Each PyTorch run
# then refuses to time itself unless OpenBLAS runs the chosen core at the
# requested threads and a GEMM reaches a sane rate, runs with
# OMP_WAIT_POLICY=PASSIVE (libgomp's spinning threads otherwise take the cores
# from OpenBLAS's: 1.3-1.6x slower at 2 threads), and reports the threads that
# really ran (CPU time / wall time) — see its docstring.
#
# Where PyTorch's step goes: under each row, the PyTorch run's time in GEMMs (mm,
# addmm, bmm, matmul: self time in one profiled step after the timed ones) and
# elsewhere, the non-GEMM ops that took most, and its page faults per step. The
# same PyTorch on the same CPU model has run 2.6x slower than its healthy speed
# (82.1 against 214.5 tok/s at GPT-2 124M, T=256, one thread), nearly all of it
# outside the GEMMs; a run whose non-GEMM share is above its config's limit in
# bench/rows.py (PYTORCH_NON_GEMM_LIMITS: 50% at GPT-2 124M, B=4, T=256, one
# thread, where a healthy run spends ~30%) gets a "!" beside its ratio and a line
# saying that ratio is not a fair comparison.
#
# lattice side: $LATTICE_BIN (default build/lattice) bench train --set ... --json,
# which prints one JSON line {"impl":"lattice","tokens_per_sec","step_ms","model_flops_per_sec",...}.
# GPT-2 rows set the shape with --set model.*; Llama rows read it from the config
# (-c configs/llama-125m.toml) and set back to the defaults the GPT-2 rows run with
# the keys of that file that are not the model's: train.global_batch_size=0 and
# train.grad_accum_steps=1 (one micro-batch per step), parallel.zero_stage=0,
# optim.warmup_steps=0. Both sides count model FLOPs per token as 6*N + 12*L*C*T
# (N = the parameters that are multiplied: all but the position embedding and an
# untied token embedding, a tied embedding once; ModelConfig::flops_per_token), and
# a row whose two sides' FLOPs per token differ gets a "!" beside its ratio and a
# line saying so: they did not build the same model, and the ratio means nothing.
#
# % of peak: fp32 peak per core times the thread count. The peak per core is
# measured by "$LATTICE_BIN bench peak --json" at the start and again at the
# end, and the higher of the two is used (other load only lowers a measurement:
# on 2026-12-02 one taken as other tenants' jobs wound down read 175 GFLOP/s
# per core where the quiet machine gives 218, and put lattice at "100%"); the
# table says which and both figures. Where that is not
# available, $LATTICE_PEAK_GFLOPS_PER_CORE (GFLOP/s) is used if set, else
# % peak is n/a. The table's header names the CPU, its ISA, the peak and where
# it came from, and the OpenBLAS core type chosen per thread count; its rows
# give the core type each PyTorch run used and the threads it observed.
set -euo pipefail

cd "$(dirname "$0")/.."
source bench/common.sh
PYTHON=${PYTHON:-/usr/bin/python3}
LATTICE_BIN=${LATTICE_BIN:-build/lattice}
THREADS="1 2"
MODEL=gpt2
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

while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --model) MODEL="$2"; shift ;;
    --threads) THREADS="$2"; shift ;;
    --rows) ROWS_FILTER="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --warmup) WARMUP="$2"; shift ;;
    --repeat) REPEAT="$2"; shift ;;
    --skip-lattice) RUN_LATTICE=0 ;;
    --skip-pytorch) RUN_PYTORCH=0 ;;
    --out) OUT="$2"; shift ;;
    --coretype) CORETYPE="$2"; shift ;;
    --recalibrate) RECALIBRATE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_gpt2.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ "$MODEL" != gpt2 && "$MODEL" != llama && "$MODEL" != all ]]; then
  echo "compare_gpt2.sh: --model must be gpt2, llama or all, got '$MODEL'" >&2
  exit 2
fi
if ! [[ "$REPEAT" =~ ^[1-9][0-9]*$ ]]; then
  echo "compare_gpt2.sh: --repeat needs a positive integer, got '$REPEAT'" >&2
  exit 2
fi
if [[ -n "${LATTICE_PEAK_GFLOPS_PER_CORE:-}" ]] &&
   ! [[ "$LATTICE_PEAK_GFLOPS_PER_CORE" =~ ^[0-9]+([.][0-9]*)?$ && "$LATTICE_PEAK_GFLOPS_PER_CORE" != 0* ]]; then
  echo "compare_gpt2.sh: LATTICE_PEAK_GFLOPS_PER_CORE must be a positive number of GFLOP/s, got" \
       "'$LATTICE_PEAK_GFLOPS_PER_CORE'" >&2
  exit 2
fi
if [[ -z "$STEPS" ]]; then STEPS=$([[ $QUICK == 1 ]] && echo 2 || echo 5); fi
if [[ -z "$WARMUP" ]]; then WARMUP=$([[ $QUICK == 1 ]] && echo 1 || echo 2); fi

# name family B T, then the model: L H C V (gpt2) or the config whose [model] both sides read (llama)
ROWS=(
  "gpt2-124M-B4-T64 gpt2 4 64 12 12 768 50257"
  "gpt2-124M-B4-T256 gpt2 4 256 12 12 768 50257"
  "L6-C384-B8-T256 gpt2 8 256 6 6 384 50257"
  "llama-125M-B4-T64 llama 4 64 configs/llama-125m.toml"
  "llama-125M-B4-T256 llama 4 256 configs/llama-125m.toml"
)


if [[ $RUN_LATTICE == 1 && ! -x "$LATTICE_BIN" ]]; then
  echo "compare_gpt2.sh: $LATTICE_BIN not found or not executable (build it, set LATTICE_BIN, or pass --skip-lattice)" >&2
  exit 2
fi

# A fresh Debian machine may have no Python yet; python3-torch brings it (and torch).
if [[ ! -x "$PYTHON" && "$PYTHON" == /usr/bin/python3 ]]; then
  sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
  echo "compare_gpt2.sh: $PYTHON missing, installing python3-torch" >&2
  apt_install=($sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=1200)
  "${apt_install[@]}" python3-torch >/dev/null || { $sudo apt-get update -qq && "${apt_install[@]}" python3-torch >/dev/null; }
fi
if [[ ! -x "$PYTHON" ]]; then
  echo "compare_gpt2.sh: $PYTHON not found (set PYTHON)" >&2
  exit 2
fi

results=$(mktemp)
peak_err=$(mktemp)
trap 'rm -f "$results" "$peak_err"' EXIT

record() {  # row threads impl json-or-empty
  local row=$1 threads=$2 impl=$3 json=$4
  if [[ -z "$json" ]]; then json='{"impl":"'"$impl"'","failed":true}'; fi
  printf '%s\t%s\t%s\n' "$row" "$threads" "$json" >> "$results"
}

# The machine's fp32 GEMM peak, measured by lattice itself (at the start and at the end).
PEAK_NOTE=""
measure_peak() {  # when ("start" or "end")
  local json peak_threads
  [[ -x "$LATTICE_BIN" ]] || { PEAK_NOTE="$LATTICE_BIN not built, so no bench peak"; return 0; }
  echo "== peak ($1): $LATTICE_BIN bench peak --json" >&2
  json=$("$LATTICE_BIN" bench peak --json 2>"$peak_err" | json_line) || true
  if [[ -z "$json" ]]; then
    PEAK_NOTE="$LATTICE_BIN bench peak gave no result ($(grep -v '^[[:space:]]*$' "$peak_err" | head -n 1 || true))"
    echo "   $PEAK_NOTE" >&2
  else
    peak_threads=$(grep -o '"threads":[0-9]*' <<< "$json" | grep -o '[0-9]*$' || echo 0)
    record _peak "$peak_threads" lattice-peak "${json%\}},\"when\":\"$1\"}"
  fi
}
measure_peak start

# OpenBLAS for PyTorch, once per thread count (later runs read the cached core type).
BENCH_BLAS_ARGS=()
if [[ -n "$CORETYPE" ]]; then BENCH_BLAS_ARGS+=(--coretype "$CORETYPE"); fi
if [[ $RUN_PYTORCH == 1 ]]; then
  setup_args=("${BENCH_BLAS_ARGS[@]}")
  if [[ $RECALIBRATE == 1 ]]; then setup_args+=(--recalibrate); fi
  for n in $THREADS; do
    echo "== OpenBLAS for pytorch, threads=$n" >&2
    if ! setup=$("$PYTHON" bench/torch_blas.py --threads "$n" "${setup_args[@]}" | json_line) || [[ -z "$setup" ]]; then
      echo "compare_gpt2.sh: PyTorch cannot run on OpenBLAS with $n thread(s) here (see above); no ratio" \
           "against a crippled reference. Fix that, or pass --skip-pytorch." >&2
      exit 1
    fi
    record _setup "$n" torch-blas "$setup"
  done
fi

for row in "${ROWS[@]}"; do
  read -r name family B T model <<< "$row"
  [[ "$MODEL" == all || "$MODEL" == "$family" ]] || continue
  keep_row "$name" || continue
  if [[ $family == gpt2 ]]; then
    read -r L H C V <<< "$model"
    torch_model=(bench/torch_gpt2_bench.py --n-layer "$L" --n-head "$H" --n-embd "$C" --vocab "$V")
    lattice_model=(--set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.vocab_size="$V")
  else
    torch_model=(bench/torch_llama_bench.py --config "$model")
    lattice_model=(-c "$model" --set train.global_batch_size=0 --set train.grad_accum_steps=1
                   --set parallel.zero_stage=0 --set optim.warmup_steps=0)
  fi
  for n in $THREADS; do
    for ((rep = 1; rep <= REPEAT; rep++)); do
      run_tag=$([[ $REPEAT -gt 1 ]] && echo " (run $rep/$REPEAT)" || true)
      if [[ $RUN_PYTORCH == 1 ]]; then
        echo "== $name threads=$n: pytorch$run_tag" >&2
        out=$("$PYTHON" "${torch_model[@]}" --batch "$B" --seq "$T" --threads "$n" --steps "$STEPS" \
                --warmup "$WARMUP" "${BENCH_BLAS_ARGS[@]}" | json_line) || true
        [[ -n "$out" ]] || echo "   pytorch run failed" >&2
        record "$name" "$n" pytorch "$out"
      fi
      if [[ $RUN_LATTICE == 1 ]]; then
        echo "== $name threads=$n: lattice$run_tag" >&2
        out=$("$LATTICE_BIN" bench train "${lattice_model[@]}" --set model.seq_len="$T" \
                --set train.micro_batch_size="$B" --set train.threads="$n" --steps "$STEPS" --warmup "$WARMUP" \
                --json | json_line) || true
        [[ -n "$out" ]] || echo "   lattice run failed" >&2
        record "$name" "$n" lattice "$out"
      fi
    done
  done
done

measure_peak end

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

"$PYTHON" - "$results" "$STEPS" "$WARMUP" "$REPEAT" "$PEAK_NOTE" "${LATTICE_PEAK_GFLOPS_PER_CORE:-}" <<'EOF'
import json, os, sys
sys.path.insert(0, "bench")
import torch_blas
from rows import pytorch_breakdown, pytorch_unfair_line, models_differ_line

path, steps, warmup, repeat, peak_note, peak_env = sys.argv[1:7]
repeat = int(repeat)
table, order, setup, peaks = {}, [], {}, []
for line in open(path):
    row, threads, js = line.rstrip("\n").split("\t", 2)
    d = json.loads(js)
    if row == "_peak":
        peaks.append(d)
        continue
    if row == "_setup":
        setup[int(threads)] = d
        continue
    key = (row, int(threads))
    if key not in table:
        table[key] = {}
        order.append(key)
    table[key].setdefault(d.get("impl", "?"), []).append(d)

# The peak per core: the higher of lattice's two measurements, else the environment's, else none
# (never a constant).
peaks = [d for d in peaks if (d.get("fp32_gflops_per_core") or 0) > 0]
peak = max(peaks, key=lambda d: d["fp32_gflops_per_core"]) if peaks else None
cpu = torch_blas.cpu_identity()
cpu_name = (peak or {}).get("cpu") or cpu["model_name"]
isa = (peak or {}).get("isa") or cpu["isa"] + ("+avx512_bf16" if cpu["bf16"] else "")
if (peak or {}).get("dnnl_isa"):
    isa += f" (oneDNN {peak['dnnl_isa']})"
peak_per_core, peak_src = None, None
if peak and (peak.get("fp32_gflops_per_core") or 0) > 0:
    peak_per_core = peak["fp32_gflops_per_core"] * 1e9
    peak_src = "measured by lattice bench peak" + (f" at {peak['threads']} threads" if peak.get("threads") else "")
    if len(peaks) > 1:
        peak_src += (f", the higher of the run's {' and '.join(str(d.get('when', '?')) for d in peaks)} "
                     f"measurements ({' and '.join(format(d['fp32_gflops_per_core'], '.1f') for d in peaks)})")
    if peak.get("bf16_gflops_per_core"):
        peak_src += f"; bf16 {peak['bf16_gflops_per_core']:.1f}"
elif peak_env:
    peak_per_core = float(peak_env) * 1e9
    peak_src = "from LATTICE_PEAK_GFLOPS_PER_CORE" + (f"; {peak_note}" if peak_note else "")

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

print(f"\nCPU: {cpu_name} ({cpu['vendor']} family {cpu['family']} model {cpu['model']}), ISA {isa}")
if peak_per_core:
    print(f"peak: {peak_per_core / 1e9:.1f} GFLOP/s fp32 per core x threads ({peak_src})")
else:
    print(f"peak: n/a, so % peak is n/a ({peak_note or 'lattice bench peak gave no result'}; "
          "set LATTICE_PEAK_GFLOPS_PER_CORE to use a known figure)")
for n, d in sorted(setup.items()):
    rates = ", ".join(f"{'auto=' + str(d.get('openblas_auto_core')) if c == 'auto' else c} {g:.0f}"
                      for c, g in d.get("openblas_coretype_gflops", {}).items())
    print(f"pytorch {n} thread(s): OpenBLAS core type {d['openblas_coretype']} ({d['openblas_coretype_source']}; "
          f"GEMM GFLOP/s {rates}), {d.get('blas_library')}")
print(f"steps={steps} warmup={warmup} repeat={repeat}" + (" (best run of each side; range over runs)" if repeat > 1 else "") +
      "; model FLOPs/token = 6N + 12*L*C*T; pt core / pt thr = the PyTorch run's OpenBLAS core type and the threads "
      "it observed (CPU time / wall time); under each row, where PyTorch's step went (one profiled step); "
      "! = PyTorch's non-GEMM share above its limit, or the two sides' FLOPs per token differ (bench/rows.py): "
      "not a fair ratio")
hdr = (f"{'config':<20} {'thr':>3} {'lattice tok/s':>13} {'pytorch tok/s':>13} {'ratio':>7} "
       f"{'lattice GFLOP/s':>15} {'% peak':>6} {'pytorch GFLOP/s':>15} {'% peak':>6} {'pt core':>10} {'pt thr':>6}")
print(hdr)
print("-" * len(hdr))
for key in order:
    row, n = key
    (lat, lat_range), (pt, pt_range) = best(table[key].get("lattice")), best(table[key].get("pytorch"))
    lt, ptt = tps(lat), tps(pt)
    ratio = lt / ptt if lt and ptt else None
    peak_n = peak_per_core * n if peak_per_core else None
    lf = lat.get("model_flops_per_sec") if lt else None
    pf = pt.get("model_flops_per_sec") if ptt else None
    pct = lambda f: 100 * f / peak_n if f and peak_n else None
    core = (pt or {}).get("openblas_coretype") or "n/a"
    unfair = pytorch_unfair_line(pt, ratio)
    differ = models_differ_line(lat, pt)
    print(f"{row:<20} {n:>3} {fmt(lt, '13.1f')} {fmt(ptt, '13.1f')} {fmt(ratio, '6.2f')}{'!' if unfair or differ else ' '} "
          f"{fmt(lf / 1e9 if lf else None, '15.1f')} {fmt(pct(lf), '6.1f')} "
          f"{fmt(pf / 1e9 if pf else None, '15.1f')} {fmt(pct(pf), '6.1f')} "
          f"{core:>10} {fmt((pt or {}).get('threads_observed'), '6.2f')}")
    if repeat > 1:
        rng = lambda r: f"{r[0]:.1f}-{r[1]:.1f}" if r else "n/a"
        print(f"{'':<20} {'':>3} tok/s ranges: lattice {rng(lat_range)}, pytorch {rng(pt_range)}")
    breakdown = pytorch_breakdown(pt)
    if breakdown:
        print(f"{'':<20} {'':>3} pytorch step: {breakdown}")
    if unfair:
        print(f"{'':<20} {'':>3} {unfair}")
    if differ:
        print(f"{'':<20} {'':>3} {differ}")
EOF
