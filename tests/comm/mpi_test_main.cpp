// main() for GoogleTest binaries that run under mpiexec: every rank runs every
// test; rank 0 prints GoogleTest's usual output, every rank prints its own
// failures prefixed with "[rank R]", and at the end rank 0 names the ranks
// that failed. Each rank exits non-zero if any rank failed, so mpiexec (and
// CTest) fail. A rank that leaves a collective early (ASSERT_*) makes the
// others wait: the watchdog then aborts the job instead of hanging it.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "lattice/comm/runtime.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  // The current test is remembered here: GoogleTest calls OnTestPartResult
  // with its own lock held, and UnitTest::current_test_info() takes that lock
  // again (a self-deadlock on the first failure).
  void OnTestStart(const ::testing::TestInfo& test) override {
    current_ = std::string(test.test_suite_name()) + "." + test.name();
  }

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILURE in %s at %s:%d\n%s\n", rank_, current_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.message());
    std::fflush(stderr);
  }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    if (test.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED  %s.%s\n", rank_, test.test_suite_name(), test.name());
      std::fflush(stderr);
    }
  }

 private:
  int rank_;
  std::string current_ = "?";
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return lattice::comm::run_guarded(argc, argv, [] {
    int rank = lattice::comm::world_rank();
    int size = lattice::comm::world_size();
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (rank != 0) delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));

    int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;

    std::vector<int> all(size);
    MPI_Allgather(&failed, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::string ranks;
    for (int r = 0; r < size; r++)
      if (all[r]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    if (rank == 0) {
      if (ranks.empty())
        std::printf("[mpi] all %d ranks passed\n", size);
      else
        std::printf("[mpi] FAILED on rank(s) %s of %d\n", ranks.c_str(), size);
      std::fflush(stdout);
    }
    return ranks.empty() ? 0 : 1;
  });
}
