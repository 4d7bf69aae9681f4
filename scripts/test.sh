#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (unit tests
# and the multi-rank tests under mpiexec, label `mpi`).
#
#   scripts/test.sh [ctest options, e.g. -L mpi or -R kernels]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
# Open MPI refuses to run as root unless told that it is intended.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The machine as lattice sees it (CPU, kernel ISA, GEMM paths) and its
# measured peak, which also fills the cache the trainer's MFU reads.
"$root/build/lattice" bench peak --seconds 0.2 --repeat 1 || true
cd "$root/build"
ctest --output-on-failure --timeout 600 "$@"
