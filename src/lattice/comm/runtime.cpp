#include "lattice/comm/runtime.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "lattice/comm/watchdog.h"
#include "lattice/core/error.h"

namespace lattice::comm {

int world_rank() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 1;
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

static const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

void require_thread_level(int provided) {
  LATTICE_CHECK(provided >= MPI_THREAD_MULTIPLE,
                "the MPI library granted " << thread_level_name(provided)
                                           << " but lattice needs MPI_THREAD_MULTIPLE (its watchdog thread calls MPI "
                                              "while the main thread waits inside MPI); use an MPI built with thread "
                                              "support, e.g. Open MPI configured with --enable-mpi-thread-multiple");
}

// Prints the failure with the rank and ends the job. Returns only with one rank.
static void report_failure(const char* message) {
  std::fprintf(stderr, "rank %d: %s\n", world_rank(), message);
  std::fflush(stderr);
  if (world_size() > 1) {
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  }
}

void abort_job(const std::string& message) {
  if (world_size() <= 1) throw Error(message);
  report_failure(message.c_str());
  std::_Exit(1);
}

[[noreturn]] static void on_terminate() {
  const char* what = "terminate called without an active exception";
  std::string text;
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      text = ex.what();
      what = text.c_str();
    } catch (...) {
      what = "terminate called after throwing a non-standard exception";
    }
  }
  report_failure(what);
  std::_Exit(1);
}

int run_guarded(int argc, char** argv, const std::function<int()>& body) {
  // A rank's threads share cores with its own communication thread (data
  // parallelism runs its collectives there, parallel/data/comm_stream.h), so
  // a thread waiting inside MPI yields the core instead of spinning on it.
  // Open MPI reads this at MPI_Init; a value the user set wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  std::set_terminate(on_terminate);
  int code = 1;
  try {
    require_thread_level(provided);
    load_watchdog_timeout_from_env();
    start_watchdog();
    code = body();
  } catch (const std::exception& e) {
    report_failure(e.what());
    code = 1;
  } catch (...) {
    report_failure("unknown exception");
    code = 1;
  }
  stop_watchdog();
  MPI_Finalize();
  return code;
}

}  // namespace lattice::comm
