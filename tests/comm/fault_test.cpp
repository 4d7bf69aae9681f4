// Failure never hangs: runs fault_program under mpiexec (and without it) and
// checks the exit status, the message and how long the job took. Every child
// runs under `timeout`, so a regression shows up as a failed test, not a hung CI.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct Outcome {
  int status = -1;  // exit status (124: killed by timeout)
  std::string output;
  double seconds = 0;
};

Outcome run(const std::string& env, const std::string& command) {
  std::string line = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + env + " timeout -k 5 60 " +
                     command + " 2>&1";
  auto start = std::chrono::steady_clock::now();
  Outcome out;
  FILE* pipe = popen(line.c_str(), "r");
  if (!pipe) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.output.append(buf, n);
  int status = pclose(pipe);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

std::string mpiexec(int ranks, const std::string& scenario) {
  return std::string(LATTICE_MPIEXEC) + " -n " + std::to_string(ranks) + " --oversubscribe " +
         LATTICE_FAULT_PROGRAM + " " + scenario;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(Faults, WithoutMpiexecTheProgramIsAWorldOfOne) {
  Outcome o = run("", LATTICE_FAULT_PROGRAM " ok");
  EXPECT_EQ(o.status, 0) << o.output;
  EXPECT_TRUE(contains(o.output, "ok: rank 0 of 1, sum 1, pp=1 dp=1 cp=1 tp=1 ep=1")) << o.output;
}

TEST(Faults, MpiexecRunsEveryRank) {
  Outcome o = run("", mpiexec(3, "ok"));
  EXPECT_EQ(o.status, 0) << o.output;
  for (int r = 0; r < 3; r++) EXPECT_TRUE(contains(o.output, "ok: rank " + std::to_string(r) + " of 3, sum 3")) << o.output;
}

TEST(Faults, AnExceptionOnOneRankAbortsTheJobWithinSeconds) {
  // The watchdog timeout is long here: it must be the abort that ends the job.
  Outcome o = run("LATTICE_COMM_TIMEOUT_S=60", mpiexec(3, "throw"));
  EXPECT_NE(o.status, 0) << o.output;
  EXPECT_NE(o.status, 124) << "the job hung\n" << o.output;
  EXPECT_TRUE(contains(o.output, "rank 1: injected failure on rank 1")) << o.output;
  EXPECT_LT(o.seconds, 15) << o.output;
}

TEST(Faults, AnExceptionWithoutMpiexecExitsNonZero) {
  Outcome o = run("", LATTICE_FAULT_PROGRAM " no-such-scenario");
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_TRUE(contains(o.output, "rank 0: unknown scenario 'no-such-scenario' (valid: ok, throw, skip, busy, mesh)"))
      << o.output;
}

TEST(Faults, ARankThatSkipsACollectiveIsNamedByTheWatchdog) {
  Outcome o = run("LATTICE_COMM_TIMEOUT_S=2", mpiexec(3, "skip"));
  EXPECT_EQ(o.status, 3) << o.output;  // kWatchdogExitCode
  EXPECT_TRUE(contains(o.output, ": watchdog: all_reduce #2 (10 f32, sum) on group 'world' (world ranks 0,1,2) has "
                                 "waited "))
      << o.output;
  EXPECT_TRUE(contains(o.output, "longer than the timeout of 2 s")) << o.output;
  EXPECT_TRUE(contains(o.output, "waiting in it: ranks 0, 1; not arrived: rank 2; aborting the job")) << o.output;
  EXPECT_TRUE(contains(o.output, "  rank 2: has started 1 collectives on this group; waiting ")) << o.output;
  EXPECT_TRUE(contains(o.output, " in recv from rank 0 (tag 7, 10 f32) on group 'world'")) << o.output;
  EXPECT_LT(o.seconds, 15) << o.output;
}

TEST(Faults, ARankBusyOutsideCommunicationIsReportedAsSuch) {
  Outcome o = run("LATTICE_COMM_TIMEOUT_S=2", mpiexec(2, "busy"));
  EXPECT_EQ(o.status, 3) << o.output;
  EXPECT_TRUE(contains(o.output, "rank 0: watchdog: barrier #2 on group 'world' (world ranks 0,1) has waited"))
      << o.output;
  EXPECT_TRUE(contains(o.output, "not arrived: rank 1")) << o.output;
  EXPECT_TRUE(contains(o.output, "rank 1: has started 1 collectives on this group; not in a communication call; "
                                 "last finished all_reduce #1 (10 f32, sum) on group 'world'"))
      << o.output;
  EXPECT_LT(o.seconds, 15) << "the job waited for the busy rank instead of aborting\n" << o.output;
}

TEST(Faults, AMeshThatDoesNotFitTheWorldIsRefusedOnEveryRank) {
  Outcome o = run("", mpiexec(2, "mesh"));
  EXPECT_NE(o.status, 0) << o.output;
  EXPECT_NE(o.status, 124) << o.output;
  EXPECT_TRUE(contains(o.output, "parallel.pp=1 × parallel.dp=3 × parallel.cp=1 × parallel.tp=1 = 3 does not equal "
                                 "the 2 ranks started by mpiexec; start 3 ranks (mpiexec -n 3) or change the sizes"))
      << o.output;
  EXPECT_LT(o.seconds, 15) << o.output;
}

TEST(Faults, ABadTimeoutVariableIsRefused) {
  Outcome o = run("LATTICE_COMM_TIMEOUT_S=soon", LATTICE_FAULT_PROGRAM " ok");
  EXPECT_EQ(o.status, 1) << o.output;
  EXPECT_TRUE(contains(o.output, "rank 0: LATTICE_COMM_TIMEOUT_S='soon' is not a positive number of seconds"))
      << o.output;
}
