// What the multi-rank tests of tests/parallel/ share: the job's ranks, a
// one-rank communicator for the one-process reference run beside a layout,
// and a scratch directory every rank sees.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/runtime.h"

namespace lattice::mpitest {

inline comm::Communicator& world() {
  static std::unique_ptr<comm::Communicator> w = comm::make_world_communicator();
  return *w;
}

// The first rank of `c` whose `v` differs from rank 0's, or -1 when every
// rank holds the same values (collective; v the same length everywhere).
inline int first_differing_rank(comm::Communicator& c, const std::vector<float>& v) {
  std::vector<float> all(v.size() * static_cast<size_t>(c.size()));
  c.all_gather(v.data(), all.data(), v.size(), DType::F32);
  for (int r = 1; r < c.size(); r++)
    if (!std::equal(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(v.size()),
                    all.begin() + static_cast<std::ptrdiff_t>(r * v.size())))
      return r;
  return -1;
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
