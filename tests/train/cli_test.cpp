// The `lattice` executable end to end: bad input gets one clear line and a
// non-zero exit; good input trains, checkpoints, inspects and generates.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fs = std::filesystem;

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing its output and exit code.
static Result capture(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

static Result run(const std::string& args) { return capture(std::string(LATTICE_BIN) + " " + args + " 2>&1"); }

static const std::string kTiny =
    "--set model.n_layer=1 --set model.n_head=2 --set model.n_embd=16 --set model.vocab_size=64 "
    "--set model.seq_len=8 --set train.micro_batch_size=2 --set train.threads=1 ";

static fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("lattice_cli_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TEST(Cli, UnknownCommandAndOption) {
  Result r = run("frobnicate");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("unknown command 'frobnicate'"), std::string::npos) << r.output;
  r = run("train --bogus");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("rank 0: lattice train: unknown option '--bogus'"), std::string::npos) << r.output;
}

TEST(Cli, BadConfigValuesNameTheKey) {
  Result r = run("train " + kTiny + "--set model.n_embd=10 --set model.n_head=4");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("model.n_embd=10 is not divisible by model.n_head=4"), std::string::npos) << r.output;
  r = run("train " + kTiny + "--set train.stepz=3");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("train.stepz"), std::string::npos) << r.output;
  r = run("train -c /nonexistent/run.toml");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("/nonexistent/run.toml"), std::string::npos) << r.output;
  r = run("train " + kTiny + "--set data.train=/nonexistent/*.bin");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("/nonexistent/*.bin"), std::string::npos) << r.output;
  // Exactly one line of error, no stack trace.
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  // A combination of model keys the model refuses (ModelConfig::validate,
  // check_tensor_parallel), up front, in one line.
  const std::string llama = std::string("train -c ") + LATTICE_SOURCE_DIR + "/configs/llama-tiny.toml ";
  r = run(llama + "--set model.n_kv_head=3");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("model.n_head=4 is not a multiple of model.n_kv_head=3"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  r = run(llama + "--set parallel.tp=3");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("parallel.tp=3 must divide model.n_head=4"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  r = run("train " + kTiny + "--set model.mlp=swiglu");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("model.mlp = \"swiglu\" needs model.family = \"llama\""), std::string::npos) << r.output;
  r = run("train " + kTiny + "--set model.norm=rms");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("model.norm must be one of layernorm, rmsnorm"), std::string::npos) << r.output;
}

// The instruction set can be forced down (to test the portable paths) but
// not up, and never to a name that is not a level; the banner says what runs.
TEST(Cli, InstructionSetOverrideAndMachineBanner) {
  fs::path dir = scratch("isa");
  const std::string cache = "LATTICE_CACHE_DIR=" + dir.string() + " ";
  Result r = capture(cache + "LATTICE_ISA=sse9 " + std::string(LATTICE_BIN) + " train " + kTiny + "2>&1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("LATTICE_ISA='sse9' is not an instruction set level (valid: avx512, avx2, baseline, auto)"),
            std::string::npos)
      << r.output;
  r = capture(cache + "LATTICE_ISA=baseline " + std::string(LATTICE_BIN) + " bench peak --threads 1 --seconds 0.05 --repeat 1 --json 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  // One repeat is not repeatable: used, not cached (train/machine.h's rule).
  for (const char* piece : {"\"impl\":\"lattice-peak\"", "\"isa\":\"baseline\"", "\"fp32_gflops_per_core\":",
                            "\"gemm_bf16\":\"widen+dnnl_sgemm\"", "\"dnnl_isa\":\"sse41\"", "\"cached\":false",
                            "one repeat (two within 5% are needed)"})
    EXPECT_NE(r.output.find(piece), std::string::npos) << piece << "\n" << r.output;
  EXPECT_FALSE(fs::exists(dir / "peak.json"));
  // The trainer's banner names the CPU, the level and where its peak came from.
  r = capture(cache + "LATTICE_ISA=baseline " + std::string(LATTICE_BIN) + " train " + kTiny + "--set train.steps=1 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* piece : {"lattice: machine ", "kernels baseline (LATTICE_ISA", "GEMM f32 dnnl_sgemm",
                            "lattice: MFU relative to ", "measured now" })
    EXPECT_NE(r.output.find(piece), std::string::npos) << piece << "\n" << r.output;
  r = capture(cache + "LATTICE_PEAK_GFLOPS_PER_CORE=-3 " + std::string(LATTICE_BIN) + " train " + kTiny + "2>&1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("LATTICE_PEAK_GFLOPS_PER_CORE must be a positive number, got '-3'"), std::string::npos)
      << r.output;
}

TEST(Cli, TrainPrintsOneLinePerStepAndResumes) {
  fs::path dir = scratch("train");
  std::string common = "train " + kTiny + "--set checkpoint.dir=" + (dir / "run").string() +
                       " --set log.metrics_file=" + (dir / "m.jsonl").string();
  Result r = run(common + " --set train.steps=3");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* piece : {"step 1/3 | loss ", "| lr ", "| norm ", " ms | ", " tok/s | MFU ", "% | mem "})
    EXPECT_NE(r.output.find(piece), std::string::npos) << piece << "\n" << r.output;
  EXPECT_NE(r.output.find("lattice: done, 3 steps"), std::string::npos) << r.output;
  r = run(common + " --set train.steps=5 --resume");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 5/5"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 3/5"), std::string::npos) << r.output;

  r = run("inspect " + (dir / "run").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step_000005"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("integrity"), std::string::npos) << r.output;
  r = run("inspect " + (dir / "m.jsonl").string() + " --plot " + (dir / "plot_").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "plot_loss.svg"));
  // Two runs side by side (here the same file twice), and a non-metrics file among several.
  fs::copy_file(dir / "m.jsonl", dir / "m2.jsonl", fs::copy_options::overwrite_existing);
  r = run("inspect " + (dir / "m.jsonl").string() + " " + (dir / "m2.jsonl").string() + " --plot " +
          (dir / "both_").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "both_loss.svg"));
  std::stringstream svg;
  svg << std::ifstream(dir / "both_loss.svg").rdbuf();
  EXPECT_NE(svg.str().find("m2"), std::string::npos);
  r = run("inspect " + (dir / "m.jsonl").string() + " " + (dir / "run").string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("or several metrics .jsonl files"), std::string::npos) << r.output;

  // Sampling from the checkpoint (needs the GPT-2 tokenizer files that
  // scripts/setup.sh fetches).
  if (!fs::exists(fs::path(LATTICE_SOURCE_DIR) / ".cache/gpt2/encoder.json")) GTEST_SKIP() << "run scripts/setup.sh";
  // The tiny model knows GPT-2's first 64 tokens: single ASCII characters ("A" = 32).
  r = run("generate --checkpoint " + (dir / "run").string() + " --prompt A --max-new-tokens 5 --seed 3 --threads 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("A", 0), 0u) << r.output;
  Result again =
      run("generate --checkpoint " + (dir / "run").string() + " --prompt A --max-new-tokens 5 --seed 3 --threads 1");
  EXPECT_EQ(r.output, again.output);  // same seed, same text
  r = run("generate --checkpoint " + (dir / "run").string() + " --prompt x --temperature -1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("--temperature must be >= 0, got -1"), std::string::npos) << r.output;
  r = run("generate --checkpoint " + (dir / "run").string() + " --prompt ' the'");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("the prompt's token 262 (' the') is outside this model's vocabulary of 64 tokens"),
            std::string::npos)
      << r.output;
}

TEST(Cli, InterruptSavesACheckpoint) {
  fs::path dir = scratch("interrupt");
  // SIGTERM after the first step lines: the trainer stops after the step in
  // flight, saves and exits with 130.
  std::string cmd = "( " + std::string(LATTICE_BIN) + " train " + kTiny + "--set train.steps=100000000 " +
                    "--set checkpoint.dir=" + (dir / "run").string() +
                    " > " + (dir / "out.txt").string() + " 2>&1 & pid=$!; " +
                    "for i in $(seq 1 200); do grep -q 'step' " + (dir / "out.txt").string() +
                    " 2>/dev/null && break; sleep 0.05; done; kill -TERM $pid; wait $pid; echo exit=$? )";
  Result r = capture(cmd);
  EXPECT_NE(r.output.find("exit=130"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "latest"));
}

// Under mpiexec every rank refuses a mesh that does not fit the world, and a
// dimension that does not apply (expert parallelism without experts), with the same one-line message; the
// job exits non-zero instead of hanging.
TEST(Cli, MultiRankRefusalsReachEveryRank) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  auto mpirun = [](const std::string& args) {
    return capture(std::string(LATTICE_MPIEXEC) + " -n 2 --oversubscribe " + LATTICE_BIN + " " + args + " 2>&1");
  };
  Result r = mpirun("train " + kTiny + "--set parallel.dp=3");
  EXPECT_NE(r.code, 0);
  // Every rank refuses on its own, before any communication, so none waits
  // for the other; the first to exit ends the job, which may stop the other
  // before its line is out (on a loaded machine it often is): one rank's
  // message is what is certain.
  const std::string msg = "parallel.pp=1 × parallel.dp=3 × parallel.cp=1 × parallel.tp=1 = 3 does not equal the 2 ranks";
  EXPECT_TRUE(r.output.find("rank 0: " + msg) != std::string::npos ||
              r.output.find("rank 1: " + msg) != std::string::npos)
      << r.output;
  r = mpirun("train " + kTiny + "--set parallel.ep=2");
  EXPECT_NE(r.code, 0);
  // (expert parallelism has landed: without experts it has nothing to spread)
  EXPECT_NE(r.output.find("parallel.ep=2 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP "
                          "is dense"),
            std::string::npos)
      << r.output;
}

// More threads than the machine's cores is allowed (correctness runs), but
// the banner says why such a run is slow and what to set instead; threads=0
// shares the cores among the node's ranks.
TEST(Cli, OversubscribedThreadsAreReported) {
  const int cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const fs::path dir = scratch("threads");
  const std::string common = "train " + kTiny + "--set train.steps=1 --set checkpoint.dir=" + (dir / "run").string();
  Result r = run(common + " --set train.threads=" + std::to_string(2 * cores));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: 1 ranks x " + std::to_string(2 * cores) + " threads on this node's " +
                          std::to_string(cores) + " cores"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("set train.threads=" + std::to_string(cores)), std::string::npos) << r.output;
  r = run(common + " --set train.threads=0");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("warning:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::to_string(cores) + " threads per rank"), std::string::npos) << r.output;
}

// lattice schedule: generate, write (CSV, Chrome trace, SVG), read back; and
// lattice inspect on the CSV and the trace. Bad input exits non-zero, naming it.
TEST(Cli, ScheduleCommandWritesAndInspectReads) {
  const fs::path dir = scratch("schedule");
  const std::string csv = (dir / "s.csv").string(), trace = (dir / "t.json").string(), svg = (dir / "s.svg").string();
  Result r = run("schedule 1f1b --pp 4 --micro-batches 8 --csv " + csv + " --trace " + trace + " --plot " + svg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("bubble 0.2727 (formula 0.2727)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 3: 3F0 3B0 3F1 3B1"), std::string::npos) << r.output;
  for (const std::string& f : {csv, trace, svg}) EXPECT_TRUE(fs::exists(f)) << f;
  r = run("schedule " + csv + " --costs 1,1,1");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("bubble 0.2727"), std::string::npos) << r.output;
  r = run("inspect " + trace + " --plot " + (dir / "p_").string());
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("4 ranks, 64 actions"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bubble 0.2727"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "p_timeline.svg"));
  r = run("inspect " + csv + " --plot " + (dir / "p_").string());
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "p_schedule.svg"));
  // A deadlocked hand-written list, and a bad name.
  {
    std::ofstream bad(dir / "bad.csv");
    bad << "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
  }
  r = run("schedule " + (dir / "bad.csv").string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("deadlock: rank 0 action 2 '0B0'"), std::string::npos) << r.output;
  r = run("schedule zb-v --pp 2 --micro-batches 4");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("bubble 0.0400 (lower bound 0.0400)"), std::string::npos) << r.output;
  r = run("schedule zb-v --virtual-stages 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("zb-v schedule: two chunks per rank"), std::string::npos) << r.output;
  r = run("schedule 1f1b --costs 1,x,1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--costs needs a number > 0, got 'x'"), std::string::npos) << r.output;
}
