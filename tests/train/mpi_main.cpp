// GoogleTest main for tests that build a Trainer: MPI is initialised the way
// every lattice program does it (a run without mpiexec is a world of one).
#include <gtest/gtest.h>

#include "lattice/comm/runtime.h"

// Sanitizer builds: Open MPI allocates at MPI_Init_thread and keeps it past
// MPI_Finalize, in dlopen'ed plugins that LeakSanitizer cannot attribute to a
// library (so no suppression by name matches). Programs that initialise MPI
// therefore run without leak detection; AddressSanitizer's other checks and
// UBSan stay on, and the tests of the MPI-free libraries keep leak detection.
#if defined(__SANITIZE_ADDRESS__)
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return lattice::comm::run_guarded(argc, argv, [] { return RUN_ALL_TESTS(); });
}
