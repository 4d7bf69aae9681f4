// Data-parallel jobs through the real executable: a stop signal on one rank
// stops every rank at the same step with one checkpoint; a rank that throws
// or is killed ends the whole job within seconds, and the last good
// checkpoint still loads; bad input gets one clear message. Every child runs
// under a deadline, so a regression is a failed test, never a hung CI.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

const std::string kTiny =
    "--set model.n_layer=2 --set model.n_head=2 --set model.n_embd=32 --set model.vocab_size=64 "
    "--set model.seq_len=16 --set train.micro_batch_size=2 --set train.threads=1 ";

fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("lattice_dp_cli_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A child process (the shell runs `command` with exec, so the pid is mpiexec's
// or lattice's own), its output going to a file.
struct Child {
  pid_t pid = -1;
  fs::path log;
  int status = -1;  // exit status, or 128 + signal
  double seconds = 0;
  std::chrono::steady_clock::time_point start;

  // Waits up to `limit` seconds; kills the process group past it (status 124).
  void wait(double limit) {
    for (;;) {
      int st = 0;
      const pid_t r = ::waitpid(pid, &st, WNOHANG);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (r == pid) {
        status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return;
      }
      if (seconds > limit) {
        ::kill(-pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        status = 124;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string output() const { return read_file(log); }
};

Child spawn(const std::string& command, const fs::path& log) {
  Child c;
  c.log = log;
  c.start = std::chrono::steady_clock::now();
  c.pid = ::fork();
  if (c.pid == 0) {
    ::setpgid(0, 0);  // its own process group: the deadline kills everything it started
    const std::string line = "exec " + command + " > '" + log.string() + "' 2>&1";
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return c;
}

std::string mpiexec(int n) {
  return std::string(LATTICE_MPIEXEC) + " -n " + std::to_string(n) + " --oversubscribe ";
}

// Pids of the processes whose parent is `parent` (mpiexec's ranks).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // pid (comm) state ppid ...: comm may hold spaces, so parse after the last ')'.
    const size_t close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

// Waits until `path` has at least `lines` lines (or the deadline passes).
bool wait_for_lines(const fs::path& path, int lines, double limit) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < limit) {
    std::ifstream f(path);
    int n = 0;
    std::string line;
    while (std::getline(f, line)) n++;
    if (n >= lines) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::string latest_step(const fs::path& run) {
  std::string s = read_file(run / "latest");
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

// SIGTERM to one rank: both finish the same step, one checkpoint is saved,
// the job exits 130, and the checkpoint resumes (here on one process).
TEST(DataParallelJob, StopSignalOnOneRankStopsEveryRankAtTheSameStep) {
  const fs::path dir = scratch("stop");
  const std::string common = kTiny + "--set checkpoint.dir=" + (dir / "run").string() +
                             " --set train.global_batch_size=4";
  Child job = spawn(mpiexec(2) + LATTICE_BIN + " train " + common + " --set parallel.dp=2 --set train.steps=100000" +
                        " --set log.metrics_file=" + (dir / "m.jsonl").string(),
                    dir / "job.log");
  ASSERT_TRUE(wait_for_lines(dir / "m.jsonl", 3, 60)) << read_file(dir / "job.log");
  std::vector<pid_t> ranks = children_of(job.pid);
  ASSERT_EQ(ranks.size(), 2u) << "mpiexec's children: " << ranks.size();
  ::kill(ranks[1], SIGTERM);
  job.wait(60);
  const std::string out = job.output();
  EXPECT_EQ(job.status, 130) << out;
  EXPECT_LT(job.seconds, 60) << out;
  EXPECT_TRUE(contains(out, "interrupted (signal 15) after step ")) << out;
  // Exactly one checkpoint, at the step the line names.
  const size_t at = out.find("interrupted (signal 15) after step ");
  const long step = std::stol(out.substr(at + std::strlen("interrupted (signal 15) after step ")));
  char name[32];
  std::snprintf(name, sizeof name, "step_%06ld", step);
  EXPECT_EQ(latest_step(dir / "run"), name) << out;
  int checkpoints = 0;
  for (const auto& e : fs::directory_iterator(dir / "run"))
    if (e.path().filename().string().rfind("step_", 0) == 0) checkpoints++;
  EXPECT_EQ(checkpoints, 1) << out;
  // It resumes on one process (same global batch, same data stream).
  Child resume = spawn(std::string(LATTICE_BIN) + " train " + common + " --set train.steps=" +
                           std::to_string(step + 2) + " --resume",
                       dir / "resume.log");
  resume.wait(60);
  EXPECT_EQ(resume.status, 0) << resume.output();
  EXPECT_TRUE(contains(resume.output(), "resumed from")) << resume.output();
}

// Runs dp_fault_program in `mode` on 2 ranks: rank 1 throws mid-backward
// while rank 0 waits for it in a collective. The job ends within seconds,
// non-zero, naming the rank and the cause.
void expect_injected_failure_ends_the_job(const std::string& mode, const std::string& where = "rank 1: ") {
  const fs::path dir = scratch(mode);
  Child job = spawn("env LATTICE_COMM_TIMEOUT_S=600 " + mpiexec(2) + LATTICE_DP_FAULT_PROGRAM + " " + mode,
                    dir / "job.log");
  job.wait(60);
  const std::string out = job.output();
  EXPECT_NE(job.status, 0) << out;
  EXPECT_NE(job.status, 124) << "the job hung\n" << out;
  EXPECT_LT(job.seconds, 30) << out;
  EXPECT_TRUE(contains(out, where + "injected failure in the backward of block 0 at step 2")) << out;
  EXPECT_FALSE(contains(out, "finished without the injected failure")) << out;
}

// Rank 0 waits in a bucket reduction.
TEST(DataParallelJob, AnExceptionMidBackwardEndsTheJob) { expect_injected_failure_ends_the_job("throw-mid-backward"); }

// Under tensor parallelism rank 0 waits inside its own backward, in a TP
// collective the failed rank never joins.
TEST(DataParallelJob, AnExceptionMidBackwardEndsATensorParallelJob) {
  expect_injected_failure_ends_the_job("throw-mid-backward-tp");
}

// Under pipeline parallelism rank 0 waits for the gradient the failed last
// stage would send; the message names the rank and the action.
TEST(DataParallelJob, AnExceptionMidScheduleEndsAPipelineJob) {
  expect_injected_failure_ends_the_job("throw-mid-pipeline", "rank 1: pipeline rank 1 action 2 '1B0': ");
}

// Starts `settings` on 2 ranks, waits for 3 steps, SIGKILLs rank `victim`:
// the job ends within 30 s, non-zero, and the launcher's message names the
// killed rank and the signal.
void expect_killed_rank_ends_the_job(const std::string& name, const std::string& settings, int victim) {
  const fs::path dir = scratch(name);
  Child job = spawn(mpiexec(2) + LATTICE_BIN + " train " + kTiny + settings + " --set train.steps=100000" +
                        " --set log.metrics_file=" + (dir / "m.jsonl").string(),
                    dir / "job.log");
  ASSERT_TRUE(wait_for_lines(dir / "m.jsonl", 3, 60)) << read_file(dir / "job.log");
  std::vector<pid_t> ranks = children_of(job.pid);
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(ranks[victim], SIGKILL);
  job.wait(60);
  const std::string out = job.output();
  EXPECT_NE(job.status, 0) << out;
  EXPECT_NE(job.status, 124) << "the job hung\n" << out;
  EXPECT_LT(job.seconds, 30) << out;
  EXPECT_TRUE(contains(out, "rank " + std::to_string(victim)) && contains(out, "signal 9"))
      << "the message should name the killed rank and the signal\n" << out;
}

// SIGKILL of one rank of a tp=2 job (the other waits in a TP collective
// inside its forward or backward) ends it within seconds.
TEST(DataParallelJob, AKilledRankEndsATensorParallelJob) {
  expect_killed_rank_ends_the_job("kill_tp", "--set parallel.tp=2", 1);
}

// The same for a pipeline job: the other stage waits for an activation or a
// gradient that never comes.
TEST(DataParallelJob, AKilledRankEndsAPipelineJob) {
  expect_killed_rank_ends_the_job("kill_pp", "--set parallel.pp=2 --set train.grad_accum_steps=4", 0);
}

// SIGKILL of one rank ends the job (no hang), and the last checkpoint written
// before it loads and continues.
TEST(DataParallelJob, AKilledRankEndsTheJobAndTheLastCheckpointLoads) {
  const fs::path dir = scratch("kill");
  const std::string common = kTiny + "--set checkpoint.dir=" + (dir / "run").string() +
                             " --set train.global_batch_size=4 --set checkpoint.every=1 --set checkpoint.keep=2";
  Child job = spawn(mpiexec(2) + LATTICE_BIN + " train " + common + " --set parallel.dp=2 --set train.steps=100000" +
                        " --set parallel.zero_stage=3 --set log.metrics_file=" + (dir / "m.jsonl").string(),
                    dir / "job.log");
  ASSERT_TRUE(wait_for_lines(dir / "m.jsonl", 4, 60)) << read_file(dir / "job.log");
  std::vector<pid_t> ranks = children_of(job.pid);
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(ranks[0], SIGKILL);
  job.wait(60);
  EXPECT_NE(job.status, 0) << job.output();
  EXPECT_NE(job.status, 124) << "the job hung\n" << job.output();
  EXPECT_LT(job.seconds, 30) << job.output();
  // The newest complete checkpoint resumes, single process and at stage 0.
  const std::string latest = latest_step(dir / "run");
  ASSERT_FALSE(latest.empty());
  const long step = std::stol(latest.substr(5));
  Child resume = spawn(std::string(LATTICE_BIN) + " train " + common + " --set train.steps=" +
                           std::to_string(step + 1) + " --resume",
                       dir / "resume.log");
  resume.wait(60);
  EXPECT_EQ(resume.status, 0) << resume.output();
  EXPECT_TRUE(contains(resume.output(), "resumed from")) << resume.output();
}

// Bad input: one line naming what is wrong, non-zero, for each case.
// Rewrites tensor `name` of a safetensors file (F32) in place with `values`.
void overwrite_tensor(const fs::path& file, const std::string& name, const std::vector<float>& values) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  std::smatch m;
  const std::regex entry("\"" + std::regex_replace(name, std::regex("\\."), "\\.") +
                         "\":\\{[^}]*\"data_offsets\":\\[(\\d+),(\\d+)\\]");
  ASSERT_TRUE(std::regex_search(header, m, entry)) << name << " not in " << file;
  const uint64_t begin = std::stoull(m[1]), end = std::stoull(m[2]);
  ASSERT_EQ(end - begin, values.size() * sizeof(float)) << name;
  f.seekp(static_cast<std::streamoff>(8 + header_len + begin));
  f.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(end - begin));
}

// A router that sends every token to two experts of one expert-parallel
// rank (a selection bias of 100 on experts 0 and 1, both on ep rank 0):
// with moe.token_bound=1 that rank's buffers hold half of what arrives, and
// both ranks stop before the all-to-all with a message naming the layer and
// the counts; sized for the worst case (the default) the same job runs.
TEST(DataParallelJob, AnAdversarialRouterStopsTheJobBeforeItAllocates) {
  const fs::path dir = scratch("moe_guard");
  const std::string moe = kTiny + "--set model.n_experts=8 --set model.top_k=2 --set model.moe_ffn_hidden=32 ";
  Child init = spawn(std::string(LATTICE_BIN) + " train " + moe + "--set train.steps=1 --set checkpoint.dir=" +
                         (dir / "init").string(),
                     dir / "init.log");
  init.wait(60);
  ASSERT_EQ(init.status, 0) << init.output();
  const fs::path model = dir / "init" / "step_000001" / "model.safetensors";
  for (int l = 0; l < 2; l++)
    overwrite_tensor(model, "h." + std::to_string(l) + ".mlp.router.expert_bias", {100, 100, 0, 0, 0, 0, 0, 0});
  const std::string job = mpiexec(2) + LATTICE_BIN + " train " + moe +
                          "--set parallel.dp=2 --set parallel.ep=2 --set train.steps=3 --set checkpoint.init_from=" +
                          model.string();
  Child bounded = spawn(job + " --set moe.token_bound=1", dir / "bounded.log");
  bounded.wait(60);
  const std::string out = bounded.output();
  EXPECT_NE(bounded.status, 0) << out;
  EXPECT_LT(bounded.seconds, 30) << out;
  EXPECT_TRUE(contains(out, "MoE layer 0: the router sends 128 rows to the experts of expert-parallel rank 0 "
                            "(expert 0: 64, expert 1: 64, expert 2: 0, expert 3: 0), past the 64 its buffers hold"))
      << out;
  EXPECT_TRUE(contains(out, "raise moe.token_bound")) << out;
  Child worst = spawn(job, dir / "worst.log");
  worst.wait(60);
  EXPECT_EQ(worst.status, 0) << worst.output();
  EXPECT_TRUE(contains(worst.output(), "experts 0..64")) << worst.output();  // all 128 pairs of a step on experts 0 and 1
}

TEST(DataParallelJob, BadInputNamesTheKey) {
  const fs::path dir = scratch("bad");
  struct Case {
    std::string command, message;
  };
  const std::vector<Case> cases = {
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set parallel.bucket_mb=0",
       "parallel.bucket_mb must be a number > 0, got 0"},
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set parallel.zero_stage=4",
       "parallel.zero_stage must be an integer in 0..3, got 4"},
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set zero.offload=disk --set zero.offload_dir=" +
           (dir / "missing").string(),
       "zero.offload_dir='" + (dir / "missing").string() + "' does not exist"},
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set zero.offload=disk --set zero.offload_dir=/proc",
       "zero.offload_dir='/proc' is not writable"},
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set zero.offload=disk",
       "zero.offload=disk needs zero.offload_dir"},
      {mpiexec(3) + LATTICE_BIN + " train " + kTiny + "--set parallel.dp=2",
       "parallel.pp=1 × parallel.dp=2 × parallel.cp=1 × parallel.tp=1 = 2 does not equal the 3 ranks started"},
      {std::string(LATTICE_BIN) + " train " + kTiny + "--set train.global_batch_size=10 --set parallel.dp=2",
       "train.global_batch_size=10 is not divisible by parallel.dp=2 x train.micro_batch_size=2 = 4"},
  };
  for (size_t i = 0; i < cases.size(); i++) {
    Child c = spawn(cases[i].command, dir / ("case" + std::to_string(i) + ".log"));
    c.wait(60);
    EXPECT_NE(c.status, 0) << cases[i].command << "\n" << c.output();
    EXPECT_NE(c.status, 124) << cases[i].command;
    EXPECT_TRUE(contains(c.output(), cases[i].message)) << cases[i].command << "\n" << c.output();
  }
  // ZeRO with one data-parallel rank is not an error: there is nothing to
  // shard, the run says so and goes on (disk offload still applies).
  Child note = spawn(std::string(LATTICE_BIN) + " train " + kTiny + "--set parallel.zero_stage=2 --set train.steps=2",
                     dir / "note.log");
  note.wait(60);
  EXPECT_EQ(note.status, 0) << note.output();
  EXPECT_TRUE(contains(note.output(), "note: parallel.zero_stage=2 with parallel.dp=1 shards over one rank: it runs "
                                      "the stage's machinery and trains the same model as stage 0"))
      << note.output();
}
