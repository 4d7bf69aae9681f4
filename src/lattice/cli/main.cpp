// lattice: train | prepare | generate | plan | bench | inspect
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lattice/cli/command.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/cpu.h"

// Sanitizer builds: Open MPI allocates at MPI_Init_thread and keeps it past
// MPI_Finalize, in dlopen'ed plugins that LeakSanitizer cannot attribute to a
// library (so no suppression by name matches). Programs that initialise MPI
// therefore run without leak detection; AddressSanitizer's other checks and
// UBSan stay on, and the tests of the MPI-free libraries keep leak detection.
#if defined(__SANITIZE_ADDRESS__)
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

namespace lattice::cli {

std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}

static void print_usage() {
  std::printf("usage: lattice <command> [options]\n\ncommands:\n");
  auto commands = command_registry();
  std::sort(commands.begin(), commands.end(),
            [](const Command& a, const Command& b) { return std::strcmp(a.name, b.name) < 0; });
  for (const Command& c : commands) std::printf("  %-10s %s\n", c.name, c.summary);
  std::printf("\n`lattice <command> --help` describes a command's options.\n");
}

}  // namespace lattice::cli

int main(int argc, char** argv) {
  using namespace lattice::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  std::string name = argv[1];
  for (const Command& c : command_registry()) {
    if (name == c.name) {
      std::vector<std::string> args(argv + 1, argv + argc);
      // Every command runs inside the guard: MPI is initialised (a run without
      // mpirun is a world of one) and an error on any rank prints
      // "rank R: message" and ends the whole job with a non-zero exit.
      return lattice::comm::run_guarded(argc, argv, [&] {
        lattice::active_isa();  // a bad LATTICE_ISA is refused before any work
        return c.run(args);
      });
    }
  }
  std::fprintf(stderr, "lattice: unknown command '%s'\n\n", name.c_str());
  print_usage();
  return 2;
}
