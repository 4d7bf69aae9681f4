// Process start-up and failure handling for every lattice program.
#pragma once

#include <functional>

namespace lattice::comm {

// Initialises MPI (MPI_Init_thread; a program started without mpirun is a
// world of one), runs `body`, finalises MPI and returns its exit code. Any
// exception escaping `body` prints "rank R: <message>" on stderr; with more
// than one rank the whole job is then aborted (MPI_Abort) so no rank waits
// forever for a peer that is gone. Returns 1 in the single-rank case.
int run_guarded(int argc, char** argv, const std::function<int()>& body);

// Rank and size of MPI_COMM_WORLD (0 and 1 before initialisation).
int world_rank();
int world_size();

}  // namespace lattice::comm
