#!/usr/bin/env bash
# The demo: installs what is missing, builds, tokenises Moby-Dick into token
# shards, trains the demo GPT on it (configs/demo.toml), then samples text.
#
#   scripts/demo.sh [--ranks N] [--tp T] [--sp] [--steps S] [--set section.key=value ...]
#
# --ranks N runs the training under `mpiexec` as N data-parallel ranks
# (parallel.dp=N) training the same model: the global batch stays 16
# sequences (16/N per rank; N must divide 16) and the cores are shared out.
# --tp T splits every layer over T ranks (parallel.tp=T; T must divide the
# demo's 4 heads), --sp adds sequence parallelism; the job has N x T ranks.
# --steps and --set override the demo config.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks=1
tp=1
sp=false
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ranks) ranks="$2"; shift ;;
    --tp) tp="$2"; shift ;;
    --sp) sp=true ;;
    --steps) extra+=(--set "train.steps=$2"); shift ;;
    --set) extra+=(--set "$2"); shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option '$1' (valid: --ranks N, --tp T, --sp, --steps S, --set key=value)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "demo.sh: --ranks expects a positive integer, got '$ranks'" >&2; exit 2; }
[[ "$tp" =~ ^[1-9][0-9]*$ ]] || { echo "demo.sh: --tp expects a positive integer, got '$tp'" >&2; exit 2; }
[[ "$sp" == false || "$tp" -gt 1 ]] || { echo "demo.sh: --sp needs --tp T with T > 1" >&2; exit 2; }

"$root/scripts/setup.sh"
lattice="$root/build/lattice"
cd "$root"

data_dir="$root/data/moby"  # tokenized by setup.sh
[[ -f "$data_dir/train_000000.bin" && -f "$data_dir/val_000000.bin" ]] ||
  { echo "demo.sh: $data_dir has no train/val shards (scripts/setup.sh prepares them)" >&2; exit 1; }

run_dir="$root/runs/demo"
rm -rf "$run_dir"
echo "== training (configs/demo.toml); Ctrl-C stops and saves a checkpoint"
train_cmd=("$lattice" train -c configs/demo.toml --set "checkpoint.dir=$run_dir"
           --set "log.metrics_file=$run_dir/metrics.jsonl" "${extra[@]}")
if (( ranks * tp > 1 )); then
  (( 16 % ranks == 0 )) || { echo "demo.sh: --ranks $ranks does not divide the demo's global batch of 16" >&2; exit 2; }
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpiexec -n "$((ranks * tp))" --oversubscribe --bind-to none "${train_cmd[@]}" --set "parallel.dp=$ranks" \
    --set "parallel.tp=$tp" --set "parallel.sequence_parallel=$sp" \
    --set train.global_batch_size=16 --set "train.micro_batch_size=$((16 / ranks))" || [[ $? -eq 130 ]]
else
  "${train_cmd[@]}" || [[ $? -eq 130 ]]
fi

"$lattice" inspect "$run_dir/metrics.jsonl" --plot "$run_dir/"
echo "== sampling from the trained model"
"$lattice" generate --checkpoint "$run_dir" --prompt "Call me Ishmael." --max-new-tokens 120 --temperature 0.8 --top-k 40
