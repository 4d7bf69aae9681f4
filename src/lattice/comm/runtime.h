// Process start-up and failure handling for every lattice program.
#pragma once

#include <functional>
#include <string>

namespace lattice::comm {

// Initialises MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) (a program started
// without mpirun is a world of one), applies LATTICE_COMM_TIMEOUT_S, starts the
// communication watchdog (watchdog.h), runs `body`, then stops the watchdog,
// finalises MPI and returns body's exit code.
//
// Any exception escaping `body` (or reaching std::terminate on any thread)
// prints "rank R: <message>" on stderr; with more than one rank the whole job
// is then aborted with MPI_Abort(1), so no rank waits forever for a peer that
// is gone and mpiexec exits non-zero. With one rank it returns 1.
int run_guarded(int argc, char** argv, const std::function<int()>& body);

// Prints "rank R: message" on stderr and ends the whole job now (MPI_Abort),
// without unwinding: for an error in a multi-rank job while another thread
// (a communication thread) may still be inside a collective on buffers that
// unwinding would free. With one rank it throws lattice::Error(message).
[[noreturn]] void abort_job(const std::string& message);

// Rank and size of MPI_COMM_WORLD (0 and 1 before initialisation).
int world_rank();
int world_size();

// lattice needs MPI_THREAD_MULTIPLE: the watchdog thread calls MPI (to ask
// peers what they wait for, and to abort) while the main thread is inside a
// blocking MPI call. Throws lattice::Error naming the granted level otherwise.
// `provided` is the MPI_THREAD_* value MPI_Init_thread returned.
void require_thread_level(int provided);

}  // namespace lattice::comm
