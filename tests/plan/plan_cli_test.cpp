// `lattice plan` end to end: the ranking and its explanation, --explain,
// --emit-config writing a config `lattice train` runs, and every kind of bad
// input refused with one line that names what is wrong and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;

namespace {

struct Result {
  int code;
  std::string output;  // stdout and stderr together
};

Result run(const std::string& args) {
  const std::string cmd = std::string(LATTICE_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("lattice_plan_cli_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string write(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
  return path.string();
}

bool has(const Result& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

const std::string k70B = "plan --model llama2-70b --cluster a100-80gb --nodes 4 --global-batch 16 ";

TEST(PlanCli, RanksExplainsAndNamesTheAlternatives) {
  const Result r = run(k70B + "--top 3");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* part :
       {"search  ", "#    layout", "winner  ", "memory per pipeline rank", "step time", "bubble", "why ",
        "binding constraint", "the obvious alternatives", "ZeRO-3 data parallelism over every device:",
        "tensor parallelism across nodes:", "FLOPs   model:", "B/parameter before ZeRO"})
    EXPECT_TRUE(has(r, part)) << part << "\n" << r.output;
}

TEST(PlanCli, ExplainsTheSeedsLayoutPerStage) {
  Result r = run(k70B + "--explain dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.bf16.rc-none");
  EXPECT_EQ(r.code, 1) << r.output;  // it does not fit: the exit says so
  EXPECT_TRUE(has(r, "does not fit: pipeline rank 0 needs")) << r.output;
  EXPECT_TRUE(has(r, "stored activations: 4 slots")) << r.output;
  r = run(k70B + "--explain dp1.tp8.pp4.v1.z0.mb1.m16.1f1b.sp.bf16.rc-none");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "fits: ")) << r.output;
}

TEST(PlanCli, BadInputIsOneClearLine) {
  struct Case {
    std::string args, message;
  };
  const fs::path dir = scratch("bad");
  const std::string no_nodes = write(dir / "zero.toml", "[cluster]\npreset = \"a100-80gb\"\nnodes = 0\n");
  const Case cases[] = {
      {"plan --model llama9 --cluster a100-80gb --global-batch 8", "unknown model preset 'llama9'"},
      {"plan --model llama2-7b --cluster tpu --global-batch 8", "unknown cluster preset 'tpu'"},
      {"plan --model llama2-7b --cluster " + no_nodes + " --global-batch 8", "cluster.nodes=0 is out of range"},
      {"plan --model llama2-7b --cluster a100-80gb", "needs --global-batch"},
      {"plan --cluster a100-80gb --global-batch 8", "lattice plan needs a model"},
      {"plan --model llama3-405b --cluster a100-80gb --global-batch 8 --no-offload",
       "llama3-405b fits nowhere on a100-80gb: the layout closest to fitting"},
      {k70B + "--explain dp2.tp8.pp4.mb1.m8", "dp x tp x pp x cp = 2 x 8 x 4 x 1 = 64 devices, but the cluster has 32"},
      {k70B + "--explain dp1.tp8.pp4.mb1.m8", "= 8 sequences a step, but the global batch is 16"},
      {"plan --model llama2-70b --cluster a100-80gb --nodes 3 --global-batch 16 --explain dp1.tp3.pp8.mb1.m16",
       "is not a layout lattice train accepts: parallel.tp=3 must divide model.n_head=64"},
      {k70B + "--explain dp1.tp8.pp4.mb1.m16.zb-v", "is not a layout lattice train accepts: zb-v schedule: two chunks"},
      {k70B + "--explain dp1.tq8", "cannot read 'tq8'"},
      {"plan --model llama2-7b --cluster a100-80gb --global-batch 12 --explain dp8.mb1.m1",
       "but the global batch is 12"},
      // lattice refuses an odd sequence length at any cp (it cuts sequences into 2·cp chunks).
      {"plan --model gpt2 --cluster a100-80gb --global-batch 8 --seq-len 63",
       "no layout of gpt2 is valid on 8 devices"},
  };
  for (const Case& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r, "rank 0: ")) << c.args << "\n" << r.output;
    EXPECT_TRUE(has(r, c.message)) << c.args << "\nwanted: " << c.message << "\n" << r.output;
  }
}

TEST(PlanCli, FitsNowhereSaysHowFar) {
  const Result r = run("plan --model llama3-405b --cluster a100-80gb --global-batch 8 --no-offload");
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r, "GB more than the device's 80.0 GB")) << r.output;
}

TEST(PlanCli, EmittedConfigTrains) {
  // This machine as a one-device CPU cluster; the tiny model of configs/tiny.toml.
  const fs::path dir = scratch("emit");
  const std::string cluster = write(dir / "cpu.toml",
                                    "[cluster]\nname = \"this machine, one rank\"\n[device]\nbackend = \"cpu\"\n"
                                    "memory_gib = 2\npeak_tflops_bf16 = 0.5\npeak_tflops_f16 = 0.2\n"
                                    "peak_tflops_f32 = 0.25\nmemory_gbps = 20\n[network]\nintra_gbps = 8\n");
  const std::string out = (dir / "plan.toml").string();
  Result r = run("plan -c " + std::string(LATTICE_SOURCE_DIR) + "/configs/tiny.toml --cluster " + cluster +
                 " --precision f32 --no-offload --emit-config " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "wrote " + out)) << r.output;
  r = run("train -c " + out + " --set train.steps=2 --set train.threads=1");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "step 2/2")) << r.output;
}

TEST(PlanCli, EmitConfigRefusesAModelLatticeTrainRefuses) {
  // Llama 3's vocabulary (128256) does not fit uint16 token shards.
  const fs::path dir = scratch("emit3");
  const Result r =
      run("plan --model llama3-8b --cluster h100-sxm --global-batch 8 --explain dp8.z1.mb1.m1.bf16 "
          "--emit-config " +
          (dir / "x.toml").string());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(has(r, "lattice train would refuse this config: model.vocab_size=128256 exceeds 65536")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "x.toml"));
}

}  // namespace
