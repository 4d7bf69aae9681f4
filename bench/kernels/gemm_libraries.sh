#!/usr/bin/env bash
# oneDNN (what lattice's GEMM uses) against OpenBLAS with each core type this
# CPU can run, at GPT-2 124M's linear-layer shapes (N = 1024 tokens; forward,
# input gradient, weight gradient), on 1 and 2 threads — one table per CPU.
#
#   bench/kernels/gemm_libraries.sh [--reps R] [--out results.json] [--avx2]
#
# --avx2 adds the comparison an AVX2-only machine (AMD Zen 2/3) would make on
# this one: lattice with LATTICE_ISA=avx2 (oneDNN capped at AVX2) against
# OpenBLAS's Haswell and Zen kernels. It is an emulation (the same core runs
# both sides), reported as such.
#
# Needs build/bench/kernels/bench_kernels built with OpenBLAS (Debian's
# libopenblas-dev present when CMake ran). Each figure is the best of R
# repetitions (default 3); both libraries are measured in the same run,
# alternating core types, so machine noise hits them alike.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BENCH_KERNELS:-build/bench/kernels/bench_kernels}
REPS=3
OUT=""
AVX2=0
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --reps) REPS="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --avx2) AVX2=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gemm_libraries.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -x "$BIN" ]] || { echo "gemm_libraries.sh: $BIN not found (build the bench target)" >&2; exit 2; }
# (the list is read whole: grep -q would close the pipe early, and pipefail fail it)
[[ $("$BIN" --benchmark_list_tests | grep -c '/openblas/') -gt 0 ]] ||
  { echo "gemm_libraries.sh: $BIN was built without OpenBLAS (install libopenblas-dev, re-run cmake)" >&2; exit 2; }

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-) "
cores=()
[[ $flags == *" avx512f "* ]] && cores+=(SkylakeX)
[[ $flags == *" avx512_bf16 "* ]] && cores+=(Cooperlake)
[[ $flags == *" avx2 "* ]] && cores+=(Haswell Zen)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
filter='gemm/(qkv|attn_proj|fc|fc_proj|lm_head)/(fwd|bwd_input|bwd_weight)/BACKEND/threads:[12](/|$)'
run() {  # tag env-assignments... -- backend
  local tag=$1; shift
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  echo "== $tag" >&2
  env "${envs[@]}" "$BIN" --benchmark_filter="${filter/BACKEND/$1}" --benchmark_repetitions="$REPS" \
    --benchmark_report_aggregates_only=true --benchmark_out="$tmp/$tag.json" --benchmark_out_format=json \
    > /dev/null
}
run onednn LATTICE_ISA=auto -- lattice
for c in "${cores[@]}"; do run "openblas-$c" OPENBLAS_CORETYPE="$c" -- openblas; done
if [[ $AVX2 == 1 ]]; then
  run onednn-avx2 LATTICE_ISA=avx2 -- lattice
fi

python3 - "$tmp" "$AVX2" "${OUT:-}" <<'EOF'
import json, os, re, sys
tmp, avx2, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
def load(tag):
    best = {}
    for b in json.load(open(os.path.join(tmp, tag + ".json")))["benchmarks"]:
        if b.get("aggregate_name") != "max":
            continue
        m = re.match(r"gemm/(\w+)/(\w+)/\w+/threads:(\d)", b["run_name"])
        best[(m.group(1), m.group(2), int(m.group(3)))] = b["GFLOP/s"] / 1e9 if b["GFLOP/s"] > 1e6 else b["GFLOP/s"]
    return best
tags = sorted(f[:-5] for f in os.listdir(tmp) if f.endswith(".json"))
data = {t: load(t) for t in tags}
cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
keys = sorted(data["onednn"], key=lambda k: (k[2], ["qkv", "attn_proj", "fc", "fc_proj", "lm_head"].index(k[0]),
                                                  ["fwd", "bwd_input", "bwd_weight"].index(k[1])))
cols = [t for t in tags if t != "onednn"]
print(f"CPU: {cpu}; GFLOP/s, best of the repetitions; N = 1024 tokens")
print(f"{'shape':<11} {'pass':<10} {'thr':>3} {'oneDNN':>8} " + " ".join(f"{c:>18}" for c in cols))
def geo(xs):
    import math
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
for k in keys:
    print(f"{k[0]:<11} {k[1]:<10} {k[2]:>3} {data['onednn'][k]:8.1f} " +
          " ".join(f"{data[c].get(k, float('nan')):18.1f}" for c in cols))
for thr in (1, 2):
    ks = [k for k in keys if k[2] == thr]
    print(f"geomean over shapes, {thr} thread(s): oneDNN {geo([data['onednn'][k] for k in ks]):.1f}; " +
          "; ".join(f"{c} {geo([data[c][k] for k in ks if k in data[c]]):.1f} "
                    f"({geo([data[c][k] / data['onednn'][k] for k in ks if k in data[c]]):.2f}x oneDNN)"
                    for c in cols))
if "onednn-avx2" in data:
    for thr in (1, 2):
        ks = [k for k in keys if k[2] == thr]
        base = [data["onednn-avx2"][k] for k in ks]
        print(f"AVX2-only emulation, {thr} thread(s): oneDNN capped at avx2 {geo(base):.1f}; " +
              "; ".join(f"{c} {geo([data[c][k] / data['onednn-avx2'][k] for k in ks]):.2f}x it"
                        for c in ("openblas-Haswell", "openblas-Zen") if c in data))
if out:
    json.dump({"cpu": cpu, "results": {t: {"/".join(map(str, k)): v for k, v in d.items()} for t, d in data.items()}},
              open(out, "w"), indent=1)
EOF
