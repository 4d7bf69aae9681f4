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
# measured peak, taken here, before ctest loads the cores: 3 repeats of 0.5 s
# per dtype (about 3 s). It fills the cache the trainer's MFU reads only when
# it passes train/machine.h's rule (best two repeats within 5%, every thread
# running >= 90% of the time, under the ISA x clock ceiling), and else says
# why; the trainer then measures at start-up and keeps what passes.
"$root/build/lattice" bench peak --seconds 0.5 --repeat 3 || true
cd "$root/build"
ctest --output-on-failure --timeout 600 "$@"
