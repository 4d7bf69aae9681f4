// Small MPI programs that fail on purpose, run under mpiexec by fault_test.cpp.
//   fault_program ok      every rank all-reduces and builds a trivial mesh (also without mpiexec)
//   fault_program throw   rank 1 throws while the others wait in an all_reduce
//   fault_program skip    rank 2 skips all_reduce #2 and waits in a recv instead
//   fault_program busy    rank 1 computes (sleeps) while rank 0 waits in a barrier
//   fault_program mesh    asks for a mesh of 3 ranks (dp=3) whatever the world size
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"

using namespace lattice;
using namespace lattice::comm;

int main(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "";
  return run_guarded(argc, argv, [&] {
    auto world = make_world_communicator();
    int r = world->rank();
    float x[10] = {1};
    if (scenario == "ok") {
      world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      ProcessMesh mesh = ProcessMesh::create(world->size(), 1, 1, 1);
      std::printf("ok: rank %d of %d, sum %g, %s\n", r, world->size(), x[0], mesh.describe().c_str());
      return 0;
    }
    if (scenario == "throw") {
      world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      if (r == 1) LATTICE_FAIL("injected failure on rank " << r);
      world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      return 0;
    }
    if (scenario == "skip") {
      world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      if (r == 2) {
        // Some work first, so that ranks 0 and 1 time out before this receive does.
        std::this_thread::sleep_for(std::chrono::seconds(1));
        world->recv(x, 10, DType::F32, 0, 7);
      } else {
        world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      }
      return 0;
    }
    if (scenario == "busy") {
      world->all_reduce(x, 10, DType::F32, ReduceOp::Sum);
      if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
      world->barrier();
      return 0;
    }
    if (scenario == "mesh") {
      ProcessMesh mesh = ProcessMesh::create(1, 3, 1, 1, 1);
      return 0;
    }
    LATTICE_FAIL("unknown scenario '" << scenario << "' (valid: ok, throw, skip, busy, mesh)");
    return 2;
  });
}
