// lattice bench <name> [options]: dispatches to the benchmarks registered with
// LATTICE_REGISTER_BENCH (bench_registry.h).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "lattice/cli/bench_registry.h"
#include "lattice/cli/command.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"

namespace lattice::cli {

std::vector<Bench>& bench_registry() {
  static std::vector<Bench> benches;
  return benches;
}

static std::vector<Bench> sorted_benches() {
  std::vector<Bench> b = bench_registry();
  std::sort(b.begin(), b.end(), [](const Bench& x, const Bench& y) { return std::strcmp(x.name, y.name) < 0; });
  return b;
}

static void print_bench_usage() {
  if (comm::world_rank() != 0) return;
  std::printf("usage: lattice bench <benchmark> [options]\n\nbenchmarks:\n");
  for (const Bench& b : sorted_benches()) std::printf("  %-10s %s\n", b.name, b.summary);
  std::printf("\n`lattice bench <benchmark> --help` describes its options. Multi-rank benchmarks run under\n"
              "mpiexec, e.g. `mpiexec -n 4 lattice bench comm`.\n");
}

static int run_bench(const std::vector<std::string>& args) {
  if (args.size() < 2 || args[1] == "--help" || args[1] == "-h" || args[1] == "help") {
    print_bench_usage();
    return args.size() < 2 ? 2 : 0;
  }
  for (const Bench& b : bench_registry())
    if (args[1] == b.name) return b.run(std::vector<std::string>(args.begin() + 1, args.end()));
  std::ostringstream names;
  for (const Bench& b : sorted_benches()) names << (names.tellp() ? ", " : "") << b.name;
  LATTICE_FAIL("unknown benchmark '" << args[1] << "' (available: " << names.str() << ")");
}

LATTICE_REGISTER_COMMAND("bench", "run a benchmark: lattice vs its reference (see lattice bench --help)", run_bench);

}  // namespace lattice::cli
