// GoogleTest main for tests that build a Trainer: MPI is initialised the way
// every lattice program does it (a run without mpiexec is a world of one).
#include <gtest/gtest.h>

#include "lattice/comm/runtime.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return lattice::comm::run_guarded(argc, argv, [] { return RUN_ALL_TESTS(); });
}
