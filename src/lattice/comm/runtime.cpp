#include "lattice/comm/runtime.h"

#include <mpi.h>

#include <cstdio>
#include <exception>

#include "lattice/core/error.h"

namespace lattice::comm {

int world_rank() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return 0;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return 1;
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

int run_guarded(int argc, char** argv, const std::function<int()>& body) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int code = 1;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world_rank(), e.what());
    std::fflush(stderr);
    if (world_size() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Finalize();
    return 1;
  }
  MPI_Finalize();
  return code;
}

}  // namespace lattice::comm
