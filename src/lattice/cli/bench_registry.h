// Sub-benchmarks of `lattice bench` register themselves here, one file each
// (bench_comm.cpp, bench_train.cpp, ...), so bench.cpp never changes when one
// is added:
//
//   static int run_bench_comm(const std::vector<std::string>& args);
//   LATTICE_REGISTER_BENCH("comm", "collectives and send/recv: lattice vs raw MPI", run_bench_comm);
#pragma once

#include <string>
#include <vector>

#include "lattice/cli/command.h"

namespace lattice::cli {

// A benchmark receives its own arguments (args[0] is its name, e.g. "comm").
using BenchFn = int (*)(const std::vector<std::string>& args);

struct Bench {
  const char* name;     // "comm"
  const char* summary;  // one line for `lattice bench --help`
  BenchFn run;
};

std::vector<Bench>& bench_registry();

struct BenchRegistrar {
  explicit BenchRegistrar(Bench b) { bench_registry().push_back(b); }
};

}  // namespace lattice::cli

#define LATTICE_REGISTER_BENCH(name, summary, fn) \
  static ::lattice::cli::BenchRegistrar LATTICE_CONCAT(lattice_bench_, __LINE__)({name, summary, fn})
