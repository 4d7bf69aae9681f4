// What the multi-rank tests of tests/parallel/ share: the job's ranks, a
// one-rank communicator for the one-process reference run beside a layout,
// and a scratch directory every rank sees.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/runtime.h"

namespace lattice::mpitest {

inline comm::Communicator& world() {
  static std::unique_ptr<comm::Communicator> w = comm::make_world_communicator();
  return *w;
}

// A communicator of this rank alone: the one-process reference.
inline comm::Communicator& self() {
  static std::unique_ptr<comm::Communicator> s = world().split(world().rank(), 0, "self");
  return *s;
}

// Groups of `size` consecutive ranks (world rank / size), so a 4-rank job
// runs two independent 2-rank layouts. Collective on first use of a size.
inline comm::Communicator& groups_of(int size) {
  static std::unique_ptr<comm::Communicator> g[65];
  if (!g[size]) g[size] = world().split(world().rank() / size, world().rank(), "group" + std::to_string(size));
  return *g[size];
}

// The same fresh directory on every rank: $TMPDIR/<prefix>_<rank 0's pid>/<name>.
inline std::filesystem::path shared_dir(const std::string& prefix, const std::string& name) {
  double pid = comm::world_rank() == 0 ? static_cast<double>(::getpid()) : 0.0;  // exact, unlike a float
  world().all_reduce(&pid, 1, DType::F64, comm::ReduceOp::Max);
  std::filesystem::path p =
      std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(static_cast<long>(pid))) / name;
  if (world().rank() == 0) {
    std::filesystem::remove_all(p);
    std::filesystem::create_directories(p);
  }
  world().barrier();
  return p;
}

}  // namespace lattice::mpitest
