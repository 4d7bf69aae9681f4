// The trainer: resume is bit-identical, checkpoints round-trip through HF
// layout, metrics files hold the contract's keys, bad configs are refused.
#include <gtest/gtest.h>


#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>

#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/data/shard.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/config.h"
#include "lattice/io/metrics.h"
#include "lattice/io/safetensors.h"
#include "lattice/train/batches.h"
#include "lattice/train/checkpointing.h"
#include "lattice/train/model_io.h"
#include "lattice/train/trainer.h"

using namespace lattice;
namespace fs = std::filesystem;

static fs::path scratch(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("lattice_trainer_test_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

static io::RunConfig tiny_run() {
  io::RunConfig c;
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.vocab_size = 300;
  c.model.seq_len = 16;
  c.train.micro_batch_size = 2;
  c.train.grad_accum_steps = 2;
  c.train.steps = 20;
  c.train.threads = 1;
  c.optim.lr = 3e-3;
  c.optim.min_lr = 3e-4;
  c.optim.warmup_steps = 3;
  c.log.every = 1;
  return c;
}

// Writes a shard of `n` pseudo-random tokens below `vocab`.
static std::string make_shard(const fs::path& dir, const std::string& name, int n, int vocab, uint64_t seed) {
  std::vector<uint16_t> tokens(n);
  Rng rng(seed);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng.next_below(vocab));
  std::string path = (dir / name).string();
  data::write_shard(path, tokens);
  return path;
}

static std::vector<float> all_params(train::Trainer& t) {
  std::vector<float> out;
  for (auto& g : t.model().groups()) out.insert(out.end(), g.data(), g.data() + g.numel());
  return out;
}

static void expect_resume_bit_identical(io::RunConfig cfg, const fs::path& dir) {
  cfg.checkpoint.dir = (dir / "ckpt").string();
  train::Trainer straight(cfg, {false});
  ASSERT_EQ(straight.run(), 0);

  io::RunConfig first = cfg;
  first.checkpoint.dir = (dir / "ckpt_split").string();
  first.train.steps = 20;
  train::Trainer a(first, {false});
  for (int i = 0; i < 10; i++) a.train_step();
  a.save_checkpoint();

  io::RunConfig second = first;
  second.checkpoint.resume = "latest";
  train::Trainer b(second, {false});
  EXPECT_EQ(b.step(), 10);
  ASSERT_EQ(b.run(), 0);

  ASSERT_EQ(straight.history().size(), 20u);
  ASSERT_EQ(b.history().size(), 10u);
  for (int i = 0; i < 10; i++) {
    EXPECT_EQ(straight.history()[10 + i].loss, b.history()[i].loss) << "step " << 11 + i;
    EXPECT_EQ(straight.history()[10 + i].grad_norm, b.history()[i].grad_norm) << "step " << 11 + i;
  }
  std::vector<float> p1 = all_params(straight), p2 = all_params(b);
  ASSERT_EQ(p1.size(), p2.size());
  EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)));
}

TEST(Trainer, ResumeIsBitIdenticalOnSyntheticData) {
  expect_resume_bit_identical(tiny_run(), scratch("resume_synthetic"));
}

TEST(Trainer, ResumeIsBitIdenticalOnShardsIncludingLoaderPosition) {
  fs::path dir = scratch("resume_shards");
  make_shard(dir, "train_000000.bin", 700, 300, 1);
  make_shard(dir, "train_000001.bin", 500, 300, 2);
  io::RunConfig cfg = tiny_run();
  cfg.data.train = (dir / "train_*.bin").string();
  // 1200 tokens = 74 windows of 16 → 18 batches of 2 x 2 per epoch: the run
  // crosses an epoch boundary after the resume point.
  expect_resume_bit_identical(cfg, dir);
}

TEST(Trainer, LossFallsOnTheSyntheticTask) {
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 150;
  cfg.train.micro_batch_size = 8;
  cfg.train.grad_accum_steps = 1;
  cfg.optim.lr = 1e-2;
  cfg.optim.min_lr = 1e-3;
  train::Trainer t(cfg, {false});
  t.run();
  // From ln(300) ≈ 5.7 at the start to well under half of it.
  EXPECT_GT(t.history().front().loss, 5.0);
  EXPECT_LT(t.history().back().loss, 0.5 * t.history().front().loss);
}

TEST(Trainer, MetricsFileHasTheContractKeys) {
  fs::path dir = scratch("metrics");
  make_shard(dir, "val.bin", 400, 300, 3);
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 4;
  cfg.train.eval_every = 2;
  cfg.train.eval_steps = 2;
  cfg.data.val = (dir / "val.bin").string();
  cfg.log.metrics_file = (dir / "m.jsonl").string();
  // Synthetic training data with shard validation data needs data.train; use shards for both.
  make_shard(dir, "train.bin", 800, 300, 4);
  cfg.data.train = (dir / "train.bin").string();
  {
    train::Trainer t(cfg, {false});
    t.run();
  }
  io::MetricsColumns m = io::read_metrics_jsonl(cfg.log.metrics_file);
  EXPECT_EQ(m.rows, 4u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_sec", "mfu", "peak_mem_bytes",
                          "val_loss"})
    EXPECT_TRUE(m.has(key)) << key;
  EXPECT_TRUE(std::isnan(m.column("val_loss")[0]));
  EXPECT_FALSE(std::isnan(m.column("val_loss")[1]));
  EXPECT_EQ(m.column("step")[3], 4.0);
}

TEST(Trainer, CheckpointHoldsHfTensorsAndLoadsForInference) {
  fs::path dir = scratch("hf");
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 3;
  cfg.checkpoint.dir = (dir / "run").string();
  train::Trainer t(cfg, {false});
  t.run();
  std::string step_dir = io::resolve_checkpoint("latest", cfg.checkpoint.dir);
  EXPECT_EQ(fs::path(step_dir).filename(), "step_000003");
  io::SafeTensorsReader r((fs::path(step_dir) / "model.safetensors").string());
  EXPECT_EQ(r.get("wte.weight").shape, (std::vector<int64_t>{300, 32}));  // no padding rows
  EXPECT_EQ(r.get("h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{32, 96}));  // Conv1D [in, out]
  EXPECT_EQ(r.get("h.0.mlp.c_proj.weight").shape, (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(r.find("lm_head.weight"), nullptr);  // tied: stored once
  auto gpt = train::load_model_for_inference(cfg.checkpoint.dir, 0);
  std::vector<int32_t> in(16, 5), tg(16, 6);
  EXPECT_EQ(gpt->evaluate(in.data(), tg.data(), 1, 16), t.model().evaluate(in.data(), tg.data(), 1, 16));
}

static std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Trains tiny_run() for 2 steps with its checkpoints in dir/run; returns its config.
static io::RunConfig run_two_steps(const fs::path& dir) {
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 2;
  cfg.checkpoint.dir = (dir / "run").string();
  train::Trainer t(cfg, {false});
  t.run();
  return cfg;
}

TEST(Trainer, RefusesModelMismatchAndCorruptCheckpoints) {
  fs::path dir = scratch("mismatch");
  io::RunConfig cfg = run_two_steps(dir);
  io::RunConfig other = cfg;
  other.model.n_embd = 64;
  other.checkpoint.resume = "latest";
  std::string msg = error_of([&] { train::Trainer t(other, {false}); });
  EXPECT_NE(msg.find("was trained with model.n_embd=32 but this run has model.n_embd=64"), std::string::npos) << msg;

  // Flip one byte of the model file: the checksum catches it.
  std::string model_file = io::resolve_checkpoint("latest", cfg.checkpoint.dir) + "/model.safetensors";
  {
    std::fstream f(model_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(200);
    f.write(&c, 1);
  }
  io::RunConfig resume = cfg;
  resume.checkpoint.resume = "latest";
  msg = error_of([&] { train::Trainer t(resume, {false}); });
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupted"), std::string::npos) << msg;

  io::RunConfig none = cfg;
  none.checkpoint.dir = (dir / "empty").string();
  none.checkpoint.resume = "latest";
  fs::create_directories(none.checkpoint.dir);
  msg = error_of([&] { train::Trainer t(none, {false}); });
  EXPECT_NE(msg.find("no checkpoint found"), std::string::npos) << msg;
}

// A checkpoint of the other family, resumed or given to checkpoint.init_from,
// is refused naming every key that differs, before a tensor is read; a model
// file from elsewhere is refused when its names are the other family's.
TEST(Trainer, RefusesACheckpointOfAnotherModel) {
  fs::path dir = scratch("family");
  const io::RunConfig cfg = run_two_steps(dir);  // a GPT-2: n_embd 32, 2 heads
  const std::string step_dir = io::resolve_checkpoint("latest", cfg.checkpoint.dir);
  io::RunConfig llama = cfg;
  llama.model.family = "llama";
  llama.checkpoint.resume = "latest";
  const std::string differences =
      " was trained with model.family=\"gpt2\", model.norm=\"layernorm\", model.mlp=\"gelu\", "
      "model.position=\"learned\", model.bias=true, model.tie_embeddings=true but this run has "
      "model.family=\"llama\", model.norm=\"rmsnorm\", model.mlp=\"swiglu\", model.position=\"rope\", "
      "model.bias=false, model.tie_embeddings=false";
  EXPECT_EQ(error_of([&] { train::Trainer t(llama, {false}); }), "checkpoint '" + step_dir + "'" + differences);
  // One part key alone.
  io::RunConfig rms = cfg;
  rms.model.norm = "rmsnorm";
  rms.checkpoint.resume = "latest";
  EXPECT_EQ(error_of([&] { train::Trainer t(rms, {false}); }),
            "checkpoint '" + step_dir +
                "' was trained with model.norm=\"layernorm\" but this run has model.norm=\"rmsnorm\"");
  // A width the run sets itself is named; one it leaves to the family
  // follows from the family and n_embd, named already (the test above).
  io::RunConfig wide = llama;
  wide.model.ffn_hidden = 96;
  EXPECT_NE(error_of([&] { train::Trainer t(wide, {false}); }).find("model.ffn_hidden=96"), std::string::npos);
  // The same model written out resumes: the recorded section has every key.
  io::RunConfig explicit_gpt2 = cfg;
  explicit_gpt2.model.norm = "layernorm";
  explicit_gpt2.model.ffn_hidden = 128;
  explicit_gpt2.model.bias = true;
  explicit_gpt2.train.steps = 3;
  explicit_gpt2.checkpoint.resume = "latest";
  EXPECT_EQ(error_of([&] { train::Trainer t(explicit_gpt2, {false}); }), "(no error)");
  // init_from: the checkpoint's model file records its model ...
  io::RunConfig from = llama;
  from.checkpoint.resume = "";
  from.checkpoint.dir = "";
  from.checkpoint.every = 0;
  from.checkpoint.init_from = step_dir + "/model.safetensors";
  EXPECT_EQ(error_of([&] { train::Trainer t(from, {false}); }),
            "checkpoint.init_from='" + from.checkpoint.init_from + "'" + differences);
  // ... and a longer context than the run's is fine there (the first rows of wpe).
  io::RunConfig shorter = cfg;
  shorter.model.seq_len = 8;
  shorter.checkpoint = io::CheckpointSection();
  shorter.checkpoint.init_from = from.checkpoint.init_from;
  EXPECT_EQ(error_of([&] { train::Trainer t(shorter, {false}); }), "(no error)");
  // A file without lattice's record (HF GPT-2 names only) given to a Llama.
  train::Trainer gpt2(shorter, {false});
  const std::string hf = (dir / "hf.safetensors").string();
  train::save_model_safetensors(gpt2.model(), train::params_of(gpt2.model()), hf);
  from.checkpoint.init_from = hf;
  EXPECT_EQ(error_of([&] { train::Trainer t(from, {false}); }),
            "checkpoint.init_from='" + hf +
                "' has GPT-2 tensor names (h.0.attn.c_attn.weight) but model.family = \"llama\": set "
                "model.family=\"gpt2\"");
}

// A data position counts steps of one global batch: resuming it under
// another global batch would read other samples, so it is refused with the
// setting that continues the stream. Positions saved before the global batch
// was recorded counted micro-batches: they resume only at one per step.
TEST(Trainer, RefusesADataPositionOfAnotherGlobalBatch) {
  fs::path dir = scratch("global_batch");
  io::RunConfig cfg = run_two_steps(dir);  // 2 sequences x 2 micro-batches
  io::RunConfig other = cfg;
  other.train.grad_accum_steps = 1;
  other.train.steps = 4;
  other.checkpoint.resume = "latest";
  std::string msg = error_of([&] { train::Trainer t(other, {false}); });
  EXPECT_NE(msg.find("counts steps of 4 sequences but this run's global batch is 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("resume with train.global_batch_size=4"), std::string::npos) << msg;

  io::JsonValue legacy = io::JsonValue::object();
  legacy.set("kind", io::JsonValue::string("synthetic"));
  EXPECT_NO_THROW(train::check_global_batch(legacy, 4, 1));
  msg = error_of([&] { train::check_global_batch(legacy, 4, 2); });
  EXPECT_NE(msg.find("predates global batches"), std::string::npos) << msg;
  legacy.set("global_batch", io::JsonValue::integer(4));
  EXPECT_NO_THROW(train::check_global_batch(legacy, 4, 2));
}

TEST(Trainer, InitFromLoadsHfWeights) {
  fs::path dir = scratch("init_from");
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 2;
  train::Trainer a(cfg, {false});
  a.run();
  std::string file = (dir / "weights.safetensors").string();
  train::save_model_safetensors(a.model(), train::params_of(a.model()), file);
  io::RunConfig b_cfg = cfg;
  b_cfg.checkpoint.init_from = file;
  b_cfg.train.seed = 99;  // different init, overwritten by the file
  train::Trainer b(b_cfg, {false});
  EXPECT_EQ(all_params(a), all_params(b));
  io::RunConfig wrong = b_cfg;
  wrong.model.n_layer = 3;
  std::string msg = error_of([&] { train::Trainer t(wrong, {false}); });
  EXPECT_NE(msg.find("no tensor 'h.2.ln_1.weight'"), std::string::npos) << msg;
}

// Tensor and sequence parallelism cut heads, MLP columns and micro-batch rows
// into equal pieces: a degree that cannot is refused naming the keys, before
// any rank starts (ModelConfig::check_tensor_parallel; every message of it is
// tested in model_config_test.cpp).
TEST(Trainer, RefusesTensorParallelDegreesThatCannotCutTheModel) {
  io::RunConfig cfg = tiny_run();
  cfg.model.n_head = 6;
  cfg.model.n_embd = 48;
  cfg.parallel.tp = 4;
  EXPECT_EQ(error_of([&] { train::Trainer t(cfg, {false}); }),
            "parallel.tp=4 must divide model.n_head=6: attention is split by whole query heads");
  cfg = tiny_run();
  cfg.model.n_head = 4;
  cfg.model.seq_len = 18;
  cfg.parallel.tp = 4;
  cfg.parallel.sequence_parallel = true;
  EXPECT_EQ(error_of([&] { train::Trainer t(cfg, {false}); }),
            "parallel.sequence_parallel=true needs model.seq_len=18 divisible by parallel.tp=4");
  cfg.parallel.tp = 1;
  EXPECT_EQ(error_of([&] { train::Trainer t(cfg, {false}); }),
            "parallel.sequence_parallel=true needs parallel.tp > 1: it splits the sequence over the tensor-parallel "
            "group (parallel.tp=1)");
}

// f16 whose gradients overflow at any scale it may use stops with the reason
// instead of skipping every step: at the dynamic scale's floor, or after 10
// overflows in a row at a static scale.
TEST(Trainer, F16ThatCannotHoldTheGradientsStopsSayingWhy) {
  io::RunConfig cfg = tiny_run();
  cfg.precision.compute = "f16";
  cfg.precision.loss_scale_init = 1e9;
  cfg.precision.loss_scale_min = 1e8;
  std::string msg = error_of([&] {
    train::Trainer t(cfg, {false});
    for (int s = 0; s < 10; s++) t.train_step();
  });
  EXPECT_NE(msg.find("the gradients overflow at the dynamic loss scale's floor precision.loss_scale_min=1e+08"),
            std::string::npos)
      << msg;
  cfg = tiny_run();
  cfg.precision.compute = "f16";
  cfg.precision.loss_scale = 1e9;
  msg = error_of([&] {
    train::Trainer t(cfg, {false});
    for (int s = 0; s < 20; s++) t.train_step();
  });
  EXPECT_NE(msg.find("the static loss scale 1e+09, 10 steps in a row"), std::string::npos) << msg;
}

TEST(Trainer, RefusesMeshMismatchAndUnimplementedFeatures) {
  io::RunConfig cfg = tiny_run();
  cfg.parallel.tp = 2;
  // One process: the mesh does not fit the world, which is said first.
  EXPECT_NE(error_of([&] { train::Trainer t(cfg, {false}); })
                .find("parallel.tp=2 = 2 does not equal the 1 rank of this run"),
            std::string::npos);
  cfg.parallel.tp = 1;
  // A key that is not a feature of its own is refused with its reason.
  io::RunConfig m = tiny_run();
  m.parallel.microbatches = 4;
  EXPECT_NE(error_of([&] { train::Trainer t(m, {false}); }).find("set train.grad_accum_steps instead"),
            std::string::npos);
  // The loss scale is f16's: refused at f32 and bf16, saying why.
  const std::vector<std::pair<std::function<void(io::RunConfig&)>, std::string>> scale_keys = {
      {[](io::RunConfig& c) { c.precision.loss_scale = 1024; }, "bf16 has f32's exponent range"},
      {[](io::RunConfig& c) { c.precision.loss_scale_window = 10; }, "bf16 has f32's exponent range"},
  };
  for (const auto& [set, piece] : scale_keys) {
    io::RunConfig c = tiny_run();
    c.precision.compute = "bf16";
    set(c);
    const std::string msg = error_of([&] { train::Trainer t(c, {false}); });
    EXPECT_NE(msg.find("precision.loss_scale* apply to precision.compute=\"f16\""), std::string::npos) << msg;
    EXPECT_NE(msg.find(piece), std::string::npos) << msg;
  }
  // Compression settings that would do nothing are refused by name.
  io::RunConfig c = tiny_run();
  c.compression.topk_ratio = 0.5;
  EXPECT_EQ(error_of([&] { train::Trainer t(c, {false}); }),
            "compression.topk_ratio applies to compression.grad=\"topk\" (it is \"none\")");
  c = tiny_run();
  c.compression.warmup_steps = 5;
  EXPECT_NE(error_of([&] { train::Trainer t(c, {false}); })
                .find("compression.warmup_steps applies to a compression.grad codec"),
            std::string::npos);
}

// Activation recomputation through lattice train: the same losses and
// parameters, bit for bit, in every mode, with the fused backward (1F1B) and
// the split one (ZB-H1); a recompute.first beyond the stage's layers is
// refused naming the stage.
TEST(Trainer, RecomputationTrainsBitIdentically) {
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    io::RunConfig base = tiny_run();
    base.parallel.schedule = schedule;
    auto run = [&](const char* mode, int first) {
      io::RunConfig c = base;
      c.recompute.mode = mode;
      c.recompute.first = first;
      train::Trainer t(c, {false});
      std::vector<float> out;
      for (int s = 0; s < 3; s++) out.push_back(t.train_step().loss);
      for (model::ParamGroup& g : t.model().groups()) out.insert(out.end(), g.data(), g.data() + g.numel());
      return out;
    };
    const std::vector<float> none = run("none", 0);
    EXPECT_EQ(run("selective", 0), none) << schedule;
    EXPECT_EQ(run("full", 1), none) << schedule;
  }
  io::RunConfig c = tiny_run();
  c.recompute.mode = "selective";
  c.recompute.first = 3;
  EXPECT_EQ(error_of([&] { train::Trainer t(c, {false}); }),
            "recompute.first=3 names layers that do not exist: pipeline stage 0 has 2 layers (0..1); set "
            "recompute.first <= 2, or 0 for every layer of each stage");
}

// An independent reader: tools/check_checkpoint.py loads the checkpoint's
// model.safetensors into the PyTorch reference GPT-2 (HF names) and must get
// the loss lattice gets on the same batch. Needs Debian's python3-torch;
// skipped where it is not installed.
TEST(Trainer, CheckpointLoadsInPyTorchWithTheSameLoss) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-torch is not installed (apt-get install python3-torch)";
  fs::path dir = scratch("pytorch");
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 5;
  cfg.checkpoint.dir = (dir / "run").string();
  train::Trainer t(cfg, {false});
  t.run();
  const int B = 3, T = 16;
  std::string shard = make_shard(dir, "batch.bin", B * (T + 1), 300, 7);
  std::vector<uint16_t> tok = data::read_shard(shard);
  std::vector<int32_t> in, tg;
  for (int b = 0; b < B; b++)
    for (int i = 0; i < T; i++) in.push_back(tok[b * (T + 1) + i]), tg.push_back(tok[b * (T + 1) + i + 1]);
  const float loss = t.model().evaluate(in.data(), tg.data(), B, T);
  char expect[64];
  std::snprintf(expect, sizeof expect, "%.9g", loss);
  std::string cmd = "/usr/bin/python3 " + std::string(LATTICE_SOURCE_DIR) + "/tools/check_checkpoint.py --model " +
                    io::resolve_checkpoint("latest", cfg.checkpoint.dir) + "/model.safetensors --tokens " + shard +
                    " --batch 3 --seq 16 --expect " + expect + " --rtol 1e-5";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// The same for a Llama (grouped heads, rotary positions, SwiGLU, untied
// head): tools/llama_reference.py, written from HF's LlamaForCausalLM, reads
// only the checkpoint's model.safetensors and config.json (HF's names and
// keys: a θ and an ε other than the defaults too), and must get lattice's
// loss on a sequence and lattice's greedy tokens — which lattice decodes with
// its key/value cache, the reference by recomputing the whole prefix for
// every token (this nearly-bigram model's greedy tokens hardly depend on
// positions: decoding is held to the full forward, logit by logit, in
// model_test's DecodeMatchesFullForward). Needs python3-torch.
TEST(Trainer, LlamaCheckpointGivesPyTorchTheSameLossAndGreedyTokens) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3-torch is not installed (apt-get install python3-torch)";
  fs::path dir = scratch("pytorch_llama");
  for (const int kv : {2, 1}) {
    io::RunConfig cfg = tiny_run();
    io::apply_override(cfg, "model.family=llama");
    cfg.model.n_head = 4;
    cfg.model.n_kv_head = kv;
    cfg.model.ffn_hidden = 48;
    if (kv == 1) {  // Llama-3's θ and Llama-2's ε, which only config.json tells the reference
      io::apply_override(cfg, "model.rope_theta=500000");
      io::apply_override(cfg, "model.norm_eps=1e-6");
    }
    cfg.train.steps = 8;
    cfg.checkpoint.dir = (dir / ("run_kv" + std::to_string(kv))).string();
    train::Trainer t(cfg, {false});
    t.run();
    const std::string step_dir = io::resolve_checkpoint("latest", cfg.checkpoint.dir);
    ASSERT_TRUE(fs::exists(step_dir + "/config.json")) << step_dir;
    // A sequence of 16 tokens: its loss ...
    Rng rng(11 + kv);
    std::vector<int32_t> seq(17);
    for (int32_t& id : seq) id = static_cast<int32_t>(rng.next_below(300));
    const float loss = t.model().evaluate(seq.data(), seq.data() + 1, 1, 16);
    // ... and 8 greedy tokens after its first 5 (past seq_len = 16: the window slides).
    std::unique_ptr<model::GPT> gen = train::load_model_for_inference(step_dir, 0);
    std::vector<int32_t> context(seq.begin(), seq.begin() + 5), greedy;
    for (int i = 0; i < 14; i++) {
      const float* logits = gen->next_logits(context.data(), static_cast<int64_t>(context.size()));
      const int id = static_cast<int>(std::max_element(logits, logits + 300) - logits);
      greedy.push_back(id);
      context.push_back(id);
    }
    auto ids = [](const std::vector<int32_t>& v, size_t n) {
      std::string s;
      for (size_t i = 0; i < n; i++) s += (i ? "," : "") + std::to_string(v[i]);
      return s;
    };
    const std::string tool = "/usr/bin/python3 " + std::string(LATTICE_SOURCE_DIR) + "/tools/llama_reference.py ";
    auto run = [](const std::string& cmd) {
      std::string out;
      FILE* f = popen(cmd.c_str(), "r");
      char buf[4096];
      while (f && std::fgets(buf, sizeof buf, f)) out += buf;
      EXPECT_EQ(f ? pclose(f) : -1, 0) << cmd;
      return out;
    };
    const std::string eval = run(tool + "eval --model " + step_dir + " --tokens " + ids(seq, seq.size()));
    const double want = std::stod(eval.substr(eval.find(':') + 1));
    EXPECT_NEAR(loss, want, 1e-5 * want) << "n_kv_head=" << kv << ": " << eval;
    std::string gen_out = run(tool + "generate --model " + step_dir + " --prompt " + ids(seq, 5) + " --n 14");
    gen_out.erase(std::remove(gen_out.begin(), gen_out.end(), ' '), gen_out.end());
    EXPECT_NE(gen_out.find("[" + ids(greedy, greedy.size()) + "]"), std::string::npos)
        << "n_kv_head=" << kv << ": lattice's greedy tokens " << ids(greedy, greedy.size()) << ", the reference's "
        << gen_out;
  }
}

// A resumed run continues the metrics file from the checkpoint's step: lines
// logged past it by the interrupted run are dropped, so every step appears once.
TEST(Trainer, ResumeKeepsOneMetricsLinePerStep) {
  fs::path dir = scratch("metrics_resume");
  io::RunConfig cfg = tiny_run();
  cfg.train.steps = 8;
  cfg.checkpoint.dir = (dir / "run").string();
  cfg.log.metrics_file = (dir / "m.jsonl").string();
  {
    train::Trainer t(cfg, {false});
    for (int i = 0; i < 3; i++) t.train_step();
    t.save_checkpoint();
  }
  // The interrupted run had logged steps 1..5 before dying mid-line.
  {
    std::ofstream f(cfg.log.metrics_file);
    for (int s = 1; s <= 5; s++) f << "{\"step\": " << s << ", \"loss\": 1.0}\n";
    f << "{\"step\": 6, \"lo";
  }
  io::RunConfig resume = cfg;
  resume.checkpoint.resume = "latest";
  train::Trainer b(resume, {false});
  ASSERT_EQ(b.run(), 0);
  io::MetricsColumns m = io::read_metrics_jsonl(cfg.log.metrics_file);
  ASSERT_EQ(m.rows, 8u);
  for (size_t i = 0; i < 8; i++) EXPECT_EQ(m.column("step")[i], static_cast<double>(i + 1));
}
