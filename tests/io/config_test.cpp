#include "lattice/io/config.h"

#include <algorithm>
#include <optional>

#include <gtest/gtest.h>

#include "test_util.h"

namespace lattice::io {
namespace {

using testing::TempDir;
using testing::write_text;

RunConfig parse(const std::string& text, std::vector<std::string> overrides = {}) {
  return parse_config_text(text, "x.toml", overrides);
}

TEST(Config, DefaultsMatchTheContract) {
  RunConfig c = load_config("", {});
  EXPECT_EQ(c, RunConfig());
  EXPECT_EQ(c.model.n_layer, 12);
  EXPECT_EQ(c.model.vocab_size, 50257);
  EXPECT_EQ(c.model.seq_len, 1024);
  EXPECT_EQ(c.train.micro_batch_size, 4);
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.train.seed, 1337);
  EXPECT_DOUBLE_EQ(c.optim.lr, 6e-4);
  EXPECT_DOUBLE_EQ(c.optim.min_lr, 6e-5);
  EXPECT_DOUBLE_EQ(c.optim.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optim.eps, 1e-8);
  EXPECT_EQ(c.parallel.schedule, "1f1b");
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 4);
  EXPECT_EQ(c.precision.compute, "f32");
  EXPECT_TRUE(c.precision.dynamic_loss_scale());
  EXPECT_DOUBLE_EQ(c.precision.loss_scale_init, 65536);
  EXPECT_EQ(c.precision.loss_scale_window, 1000);
  EXPECT_EQ(c.recompute.mode, "none");
  EXPECT_EQ(c.recompute.every, 1);
  EXPECT_EQ(c.recompute.first, 0);
  EXPECT_EQ(c.compression.grad, "none");
  EXPECT_TRUE(c.compression.error_feedback);
  EXPECT_EQ(c.checkpoint.keep, 3);
  EXPECT_EQ(c.log.every, 1);
}

TEST(Config, ReadsEverySectionFromToml) {
  RunConfig c = parse(R"(
[model]
n_layer = 2
n_head = 4
n_embd = 64
[parallel]
tp = 2
pp = 2
zero_stage = 3
sequence_parallel = true
schedule = "zb-h1"
bucket_mb = 0.5
[train]
steps = 20
[optim]
lr = 1e-3
min_lr = 0
beta1 = 0.0
[precision]
compute = "f16"
loss_scale = 1024
[compression]
grad = "topk"
topk_ratio = 1
[data]
train = "data/*.bin"
[checkpoint]
resume = "latest"
[log]
metrics_file = "runs/m.jsonl"
)");
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.n_embd, 64);
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.parallel.zero_stage, 3);
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_EQ(c.parallel.schedule, "zb-h1");
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 0.5);
  EXPECT_EQ(c.train.steps, 20);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optim.min_lr, 0);  // an integer is accepted for a number
  EXPECT_EQ(c.precision.compute, "f16");
  EXPECT_FALSE(c.precision.dynamic_loss_scale());
  EXPECT_DOUBLE_EQ(c.precision.loss_scale, 1024);
  EXPECT_EQ(c.compression.grad, "topk");
  EXPECT_EQ(c.data.train, "data/*.bin");
  EXPECT_EQ(c.checkpoint.resume, "latest");
  EXPECT_EQ(c.log.metrics_file, "runs/m.jsonl");
  // Untouched keys keep their defaults.
  EXPECT_EQ(c.model.vocab_size, 50257);
  EXPECT_EQ(c.train.seed, 1337);
}

TEST(Config, OverridesAreTypedByTheKey) {
  RunConfig c = parse("[train]\nsteps = 50\n",
                      {"train.steps=10", "parallel.tp=2", "parallel.sequence_parallel=true", "data.train=data/*.bin",
                       "optim.lr=3e-4", "optim.min_lr=1e-5", "precision.loss_scale=dynamic", "precision.compute=f16",
                       "data.val=\"quoted/*.bin\"", "checkpoint.dir=", "parallel.bucket_mb=2"});
  EXPECT_EQ(c.train.steps, 10);  // override wins over the file
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_EQ(c.data.train, "data/*.bin");
  EXPECT_DOUBLE_EQ(c.optim.lr, 3e-4);
  EXPECT_TRUE(c.precision.dynamic_loss_scale());
  EXPECT_EQ(c.precision.compute, "f16");
  EXPECT_EQ(c.data.val, "quoted/*.bin");
  EXPECT_EQ(c.checkpoint.dir, "");
  EXPECT_DOUBLE_EQ(c.parallel.bucket_mb, 2);
  // Later overrides win over earlier ones.
  EXPECT_EQ(parse("", {"train.steps=3", "train.steps=4"}).train.steps, 4);
  // A string key takes digits as text.
  EXPECT_EQ(parse("", {"data.train=123"}).data.train, "123");
}

TEST(Config, UnknownKeysAndSections) {
  EXPECT_ERROR_CONTAINS(parse("[train]\nstepz = 10\n"),
                        "unknown key 'train.stepz' (valid keys in [train]: micro_batch_size, grad_accum_steps, "
                        "global_batch_size, steps, seed, eval_every, eval_steps, threads); did you mean 'train.steps'? "
                        "(config file 'x.toml' line 2)");
  EXPECT_ERROR_CONTAINS(parse("[train]\nlr = 0.1\n"), "unknown key 'train.lr'");
  EXPECT_ERROR_CONTAINS(parse("[train]\nlr = 0.1\n"), "did you mean 'optim.lr'?");
  EXPECT_ERROR_CONTAINS(parse("[trian]\nsteps = 1\n"),
                        "unknown section '[trian]' (valid sections: model, parallel, zero, train, optim, precision, recompute, "
                        "moe, compression, data, checkpoint, log); did you mean '[train]'?");
  EXPECT_ERROR_CONTAINS(parse("steps = 1\n"), "key 'steps' must be inside a section; did you mean 'train.steps'");
  EXPECT_ERROR_CONTAINS(parse("model = 3\n"), "'model' must be a section ([model]), got 3");
  EXPECT_ERROR_CONTAINS(parse("[train.sub]\nx = 1\n"), "unknown key 'train.sub'");
  EXPECT_ERROR_CONTAINS(parse("", {"train.stepz=1"}), "unknown key 'train.stepz'");
  EXPECT_ERROR_CONTAINS(parse("", {"train.stepz=1"}), "(from --set train.stepz=1)");
  EXPECT_ERROR_CONTAINS(parse("", {"nope.x=1"}), "unknown section '[nope]'");
}

TEST(Config, MalformedOverrides) {
  for (const char* bad : {"foo", "train.steps", "=3", ".steps=3", "train.=3", "steps=3"}) {
    EXPECT_ERROR_CONTAINS(parse("", {bad}), std::string("--set expects section.key=value, got '") + bad + "'");
  }
}

TEST(Config, WrongTypesAndRanges) {
  EXPECT_ERROR_CONTAINS(parse("", {"train.steps=ten"}), "train.steps must be an integer >= 1, got \"ten\"");
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = \"ten\"\n"),
                        "train.steps must be an integer >= 1, got \"ten\" (config file 'x.toml' line 2)");
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = 0\n"), "train.steps must be an integer >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = 2.5\n"), "train.steps must be an integer >= 1, got 2.5");
  EXPECT_ERROR_CONTAINS(parse("", {"train.steps=2.5"}), "train.steps must be an integer >= 1, got 2.5");
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = [1]\n"), "got an array");
  EXPECT_ERROR_CONTAINS(parse("", {"model.n_layer=3000000000"}),
                        "model.n_layer must be an integer >= 1 and at most 2147483647, got 3000000000");
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.zero_stage=4"}), "parallel.zero_stage must be an integer in 0..3, got 4");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.beta1=1"}), "optim.beta1 must be a number in [0, 1), got 1");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.beta2=-0.1"}), "optim.beta2 must be a number in [0, 1), got -0.1");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.lr=-1"}), "optim.lr must be a number >= 0, got -1");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.eps=0"}), "optim.eps must be a number > 0, got 0");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.lr=nan"}), "optim.lr must be a number >= 0, got nan");
  EXPECT_ERROR_CONTAINS(parse("[optim]\nlr = inf\n"), "optim.lr must be a number >= 0, got inf");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.topk_ratio=0"}),
                        "compression.topk_ratio must be a number in (0, 1], got 0");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=powersgd", "compression.rank=0"}),
                        "compression.rank must be an integer >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.rank=8"}),
                        "compression.rank applies to compression.grad=\"powersgd\" (it is \"none\")");
  EXPECT_EQ(parse("", {"compression.grad=powersgd", "compression.rank=8"}).compression.rank, 8);
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.sequence_parallel=yes"}),
                        "parallel.sequence_parallel must be true or false, got \"yes\"");
  EXPECT_ERROR_CONTAINS(parse("[parallel]\nsequence_parallel = 1\n"),
                        "parallel.sequence_parallel must be true or false, got 1");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=fp8"}),
                        "precision.compute must be one of f32, bf16, f16, got \"fp8\"");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=zip"}),
                        "compression.grad must be one of none, bf16, f16, int8, onebit, topk, powersgd, got \"zip\"");
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.schedule=2f2b"}),
                        "parallel.schedule=\"2f2b\" is not a schedule (gpipe, 1f1b, interleaved, zb-h1, zb-v, or csv:FILE)");
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.schedule=gpipe"}),
                        "parallel.schedule=\"gpipe\" applies to pipeline parallelism: set parallel.pp > 1");
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.virtual_stages=2"}),
                        "parallel.virtual_stages=2 applies to pipeline parallelism");
  EXPECT_ERROR_CONTAINS(parse("", {"log.trace_file=t.json"}),
                        "log.trace_file=\"t.json\" records the pipeline's timeline: it needs parallel.pp > 1");
  // The loss scale is f16's: refused at f32 and bf16, saying why.
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=bf16", "precision.loss_scale=1024"}),
                        "precision.loss_scale* apply to precision.compute=\"f16\" (it is \"bf16\"): bf16 has f32's "
                        "exponent range and needs no loss scale");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.loss_scale_window=10"}),
                        "precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\")");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=f16", "precision.loss_scale=64", "precision.loss_scale_window=10"}),
                        "precision.loss_scale=64.0 is a static scale: the loss_scale_init/window/backoff/growth/min "
                        "keys apply to loss_scale=\"dynamic\"");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=f16", "precision.loss_scale_min=1e6"}),
                        "precision.loss_scale_min=1000000.0 must be <= precision.loss_scale_init=65536.0");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=f16", "precision.loss_scale_backoff=1"}),
                        "precision.loss_scale_backoff must be");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.compute=f16", "precision.loss_scale_growth=1"}),
                        "precision.loss_scale_growth must be");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.loss_scale=-4"}),
                        "precision.loss_scale must be \"dynamic\" or a number > 0, got -4");
  EXPECT_ERROR_CONTAINS(parse("", {"precision.loss_scale=auto"}),
                        "precision.loss_scale must be \"dynamic\" or a number > 0, got \"auto\"");
  EXPECT_ERROR_CONTAINS(parse("[data]\ntrain = 5\n"), "data.train must be a string, got 5");
  EXPECT_ERROR_CONTAINS(parse("", {"recompute.mode=some"}),
                        "recompute.mode must be one of none, selective, full, got \"some\"");
  EXPECT_ERROR_CONTAINS(parse("", {"recompute.mode=full", "recompute.every=0"}),
                        "recompute.every must be an integer >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parse("", {"recompute.mode=full", "recompute.first=-1"}),
                        "recompute.first must be an integer >= 0, got -1");
  EXPECT_ERROR_CONTAINS(parse("[parallel]\ndp = 0\n"), "parallel.dp must be an integer >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parse("[parallel]\nbucket_mb = 0\n"), "parallel.bucket_mb must be a number > 0, got 0");
}

TEST(Config, CrossKeyChecks) {
  EXPECT_ERROR_CONTAINS(parse("[model]\nn_embd = 100\n"), "model.n_embd=100 is not divisible by model.n_head=12");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.min_lr=0.001"}), "optim.min_lr=0.001 must be <= optim.lr=0.0006");
  // Context parallelism cuts each sequence into 2·cp chunks, and sequence
  // parallelism then cuts a rank's share over tp.
  EXPECT_ERROR_CONTAINS(parse("", {"model.seq_len=1000", "parallel.cp=3"}),
                        "parallel.cp=3 cuts each sequence into 2*cp=6 chunks, but model.seq_len=1000 is not divisible "
                        "by 6");
  EXPECT_NO_THROW(parse("", {"model.seq_len=1008", "parallel.cp=3"}));
  EXPECT_ERROR_CONTAINS(parse("", {"model.seq_len=1032", "parallel.cp=4", "parallel.tp=4",
                                   "parallel.sequence_parallel=true", "model.n_head=16", "model.n_embd=1024"}),
                        "parallel.sequence_parallel=true needs model.seq_len=1032 / parallel.cp=4 divisible by "
                        "parallel.tp=4");
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.cp=2", "parallel.cp_mode=ulysses"}), "parallel.cp_mode");
  // All-to-all needs whole query and key/value heads per cp rank.
  EXPECT_NO_THROW(parse("", {"parallel.cp=4", "parallel.cp_mode=all_to_all"}));  // 12 heads
  EXPECT_ERROR_CONTAINS(parse("", {"parallel.cp=8", "parallel.cp_mode=all_to_all"}),
                        "parallel.cp_mode=\"all_to_all\" gives each of the parallel.cp=8 ranks whole heads, but each "
                        "tensor-parallel rank has 12 query heads (model.n_head=12 / parallel.tp=1) and 12 key/value "
                        "heads (model.n_kv_head=12)");
  EXPECT_ERROR_CONTAINS(parse("", {"model.family=llama", "model.n_kv_head=2", "parallel.cp=4",
                                   "parallel.cp_mode=all_to_all"}),
                        "and 2 key/value heads (model.n_kv_head=2)");
  EXPECT_NO_THROW(parse("", {"model.family=llama", "model.n_kv_head=2", "parallel.cp=4"}));  // the ring
  // 1-bit Adam: a warm-up to freeze v after, a chunk codec, a whole gradient per rank, no experts.
  EXPECT_NO_THROW(parse("", {"compression.momentum=true", "compression.warmup_steps=10"}));  // exact: ablation
  EXPECT_NO_THROW(parse("", {"compression.grad=onebit", "compression.momentum=true", "compression.warmup_steps=10",
                             "parallel.zero_stage=1"}));
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=onebit", "compression.momentum=true"}),
                        "compression.momentum=true freezes Adam's second moment after compression.warmup_steps "
                        "ordinary steps, and compression.warmup_steps is 0");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=powersgd", "compression.momentum=true",
                                   "compression.warmup_steps=10"}),
                        "not compression.grad=\"powersgd\"");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=topk", "compression.momentum=true", "compression.warmup_steps=10",
                                   "parallel.zero_stage=2"}),
                        "compression.momentum=true needs each rank's whole gradient, which parallel.zero_stage=2 never "
                        "holds: use zero_stage 0 or 1");
  EXPECT_ERROR_CONTAINS(parse("", {"compression.grad=int8", "compression.momentum=true", "compression.warmup_steps=10",
                                   "model.n_experts=4"}),
                        "compression.momentum=true is not built for mixture-of-experts models (model.n_experts=4)");
  // recompute.every chooses layers 0, K, 2K, ...: past the last layer it names one that does not exist.
  EXPECT_EQ(testing::error_of([] { parse("[model]\nn_layer = 4\n", {"recompute.mode=selective", "recompute.every=5"}); }),
            "recompute.every=5 names a layer that does not exist: it recomputes layers 0, 5, 10, ... and "
            "model.n_layer=4 has layers 0..3; set recompute.every <= 4");
  EXPECT_EQ(parse("[model]\nn_layer = 4\n", {"recompute.mode=full", "recompute.every=4", "recompute.first=2"})
                .recompute,
            (RecomputeSection{"full", 4, 2}));
  // A later override can repair what an earlier value broke: checks run after all of them.
  EXPECT_NO_THROW(parse("[model]\nn_embd = 100\n", {"model.n_head=10"}));
}

// Every key that applies only under another setting (io::conditional_keys(),
// the checker's own table): set alone where its condition does not hold, it is
// refused with one line naming it; with the condition met it is accepted. A row
// of the table without a case here fails the test.
struct ConditionalCase {
  std::string key, when;
  std::string value;                // set as key=value
  std::vector<std::string> context;  // other overrides, under which `when` does not hold
  std::vector<std::string> enable;   // added after: `when` holds
  std::string message;               // the whole refusal
};

const std::vector<ConditionalCase>& conditional_cases() {
  static const std::vector<ConditionalCase> cases = {
      {"model.rope_theta", "model.position is \"rope\" (set, or the family's)", "500000", {},
       {"model.family=llama"},
       "model.rope_theta=500000.0 applies to rotary positions, but model.position is \"learned\" (model.family = "
       "\"gpt2\"'s default): set model.position=\"rope\", or leave model.rope_theta unset"},
      {"model.top_k", "model.n_experts > 0", "3", {}, {"model.n_experts=8"},
       "model.top_k=3 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave model.top_k at 2"},
      {"model.moe_every", "model.n_experts > 0", "2", {}, {"model.n_experts=8"},
       "model.moe_every=2 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave model.moe_every at 1"},
      {"model.n_shared_experts", "model.n_experts > 0", "1", {}, {"model.n_experts=8"},
       "model.n_shared_experts=1 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave model.n_shared_experts at 0"},
      {"model.moe_ffn_hidden", "model.n_experts > 0", "256", {}, {"model.n_experts=8"},
       "model.moe_ffn_hidden=256 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave model.moe_ffn_hidden at 0"},
      {"moe.aux_loss_coef", "model.n_experts > 0", "0.1", {}, {"model.n_experts=8"},
       "moe.aux_loss_coef=0.1 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave moe.aux_loss_coef at 0.01"},
      {"moe.z_loss_coef", "model.n_experts > 0", "0.001", {}, {"model.n_experts=8"},
       "moe.z_loss_coef=0.001 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave moe.z_loss_coef at 0.0"},
      {"moe.bias_update_rate", "model.n_experts > 0", "0.001", {}, {"model.n_experts=8"},
       "moe.bias_update_rate=0.001 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave moe.bias_update_rate at 0.0"},
      {"moe.capacity_factor", "model.n_experts > 0", "1.25", {}, {"model.n_experts=8"},
       "moe.capacity_factor=1.25 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave moe.capacity_factor at 0.0"},
      {"moe.token_bound", "model.n_experts > 0", "2", {}, {"model.n_experts=8"},
       "moe.token_bound=2.0 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave moe.token_bound at 0.0"},
      {"parallel.ep", "model.n_experts > 0", "2", {"parallel.dp=2"}, {"model.n_experts=8"},
       "parallel.ep=2 applies only when model.n_experts > 0: model.n_experts is 0, so every MLP is dense; set "
       "model.n_experts (docs/moe.md), or leave parallel.ep at 1"},
      {"parallel.cp_mode", "parallel.cp > 1", "all_to_all", {}, {"parallel.cp=2"},
       "parallel.cp_mode=\"all_to_all\" applies to context parallelism: set parallel.cp > 1, or leave it at \"ring\""},
      {"parallel.sequence_parallel", "parallel.tp > 1", "true", {}, {"parallel.tp=2"},
       "parallel.sequence_parallel=true needs parallel.tp > 1: it splits the sequence over the tensor-parallel "
       "group (parallel.tp=1)"},
      {"parallel.schedule", "parallel.pp > 1 or parallel.schedule = \"zb-h1\"", "gpipe", {}, {"parallel.pp=2"},
       "parallel.schedule=\"gpipe\" applies to pipeline parallelism: set parallel.pp > 1, or leave it at \"1f1b\" "
       "(\"zb-h1\" at pp = 1 runs the split backward)"},
      {"parallel.virtual_stages", "parallel.pp > 1", "2", {}, {"parallel.pp=2", "parallel.schedule=interleaved"},
       "parallel.virtual_stages=2 applies to pipeline parallelism: set parallel.pp > 1, or leave it at 1"},
      {"parallel.partition", "parallel.pp > 1", "1,1", {}, {"parallel.pp=2"},
       "parallel.partition=\"1,1\" applies to pipeline parallelism: set parallel.pp > 1, or leave it empty"},
      {"parallel.virtual_stages", "parallel.schedule is not csv:FILE", "2", {"parallel.pp=2", "parallel.schedule=csv:s.csv"},
       {"parallel.schedule=interleaved"},
       "parallel.virtual_stages=2 applies only when parallel.schedule is not csv:FILE: parallel.schedule=\"csv:s.csv\" "
       "gives each rank's chunks itself; leave parallel.virtual_stages at 1"},
      {"zero.offload_dir", "zero.offload = \"disk\"", "/tmp/off", {}, {"zero.offload=disk"},
       "zero.offload_dir=\"/tmp/off\" applies only when zero.offload = \"disk\": zero.offload is \"none\"; set "
       "zero.offload=\"disk\", or leave zero.offload_dir empty"},
      {"zero.offload_window_mb", "zero.offload = \"disk\"", "8", {}, {"zero.offload=disk", "zero.offload_dir=/tmp/off"},
       "zero.offload_window_mb=8.0 applies only when zero.offload = \"disk\": zero.offload is \"none\"; set "
       "zero.offload=\"disk\", or leave zero.offload_window_mb at 64.0"},
      {"train.eval_every", "data.val is set or data.train is empty", "5", {"data.train=a.bin"}, {"data.val=v.bin"},
       "train.eval_every=5 applies only when data.val is set or data.train is empty: data.train=\"a.bin\" has no "
       "data.val; set data.val, or leave train.eval_every at 0"},
      {"train.eval_steps", "data.val is set or data.train is empty", "3", {"data.train=a.bin"}, {"data.val=v.bin"},
       "train.eval_steps=3 applies only when data.val is set or data.train is empty: data.train=\"a.bin\" has no "
       "data.val; set data.val, or leave train.eval_steps at 10"},
      {"precision.loss_scale", "precision.compute = \"f16\"", "1024", {}, {"precision.compute=f16"},
       "precision.loss_scale=1024.0: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\"): f32 "
       "needs no loss scale"},
      {"precision.loss_scale_init", "precision.compute = \"f16\"", "1024", {"precision.compute=bf16"},
       {"precision.compute=f16"},
       "precision.loss_scale_init=1024.0: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"bf16\"): "
       "bf16 has f32's exponent range and needs no loss scale"},
      {"precision.loss_scale_window", "precision.compute = \"f16\"", "10", {}, {"precision.compute=f16"},
       "precision.loss_scale_window=10: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\"): "
       "f32 needs no loss scale"},
      {"precision.loss_scale_backoff", "precision.compute = \"f16\"", "0.25", {}, {"precision.compute=f16"},
       "precision.loss_scale_backoff=0.25: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\"): "
       "f32 needs no loss scale"},
      {"precision.loss_scale_growth", "precision.compute = \"f16\"", "4", {}, {"precision.compute=f16"},
       "precision.loss_scale_growth=4.0: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\"): "
       "f32 needs no loss scale"},
      {"precision.loss_scale_min", "precision.compute = \"f16\"", "2", {}, {"precision.compute=f16"},
       "precision.loss_scale_min=2.0: precision.loss_scale* apply to precision.compute=\"f16\" (it is \"f32\"): "
       "f32 needs no loss scale"},
      {"precision.loss_scale_init", "precision.loss_scale = \"dynamic\"", "1024",
       {"precision.compute=f16", "precision.loss_scale=64"}, {"precision.loss_scale=dynamic"},
       "precision.loss_scale_init=1024.0: precision.loss_scale=64.0 is a static scale: the "
       "loss_scale_init/window/backoff/growth/min keys apply to loss_scale=\"dynamic\""},
      {"precision.loss_scale_window", "precision.loss_scale = \"dynamic\"", "10",
       {"precision.compute=f16", "precision.loss_scale=64"}, {"precision.loss_scale=dynamic"},
       "precision.loss_scale_window=10: precision.loss_scale=64.0 is a static scale: the "
       "loss_scale_init/window/backoff/growth/min keys apply to loss_scale=\"dynamic\""},
      {"precision.loss_scale_backoff", "precision.loss_scale = \"dynamic\"", "0.25",
       {"precision.compute=f16", "precision.loss_scale=64"}, {"precision.loss_scale=dynamic"},
       "precision.loss_scale_backoff=0.25: precision.loss_scale=64.0 is a static scale: the "
       "loss_scale_init/window/backoff/growth/min keys apply to loss_scale=\"dynamic\""},
      {"precision.loss_scale_growth", "precision.loss_scale = \"dynamic\"", "4",
       {"precision.compute=f16", "precision.loss_scale=64"}, {"precision.loss_scale=dynamic"},
       "precision.loss_scale_growth=4.0: precision.loss_scale=64.0 is a static scale: the "
       "loss_scale_init/window/backoff/growth/min keys apply to loss_scale=\"dynamic\""},
      {"precision.loss_scale_min", "precision.loss_scale = \"dynamic\"", "2",
       {"precision.compute=f16", "precision.loss_scale=64"}, {"precision.loss_scale=dynamic"},
       "precision.loss_scale_min=2.0: precision.loss_scale=64.0 is a static scale: the "
       "loss_scale_init/window/backoff/growth/min keys apply to loss_scale=\"dynamic\""},
      {"compression.topk_ratio", "compression.grad = \"topk\"", "0.5", {}, {"compression.grad=topk"},
       "compression.topk_ratio applies to compression.grad=\"topk\" (it is \"none\")"},
      {"compression.rank", "compression.grad = \"powersgd\"", "8", {"compression.grad=int8"},
       {"compression.grad=powersgd"}, "compression.rank applies to compression.grad=\"powersgd\" (it is \"int8\")"},
      {"compression.error_feedback", "compression.grad is not \"none\"", "false", {}, {"compression.grad=int8"},
       "compression.error_feedback applies to a compression.grad codec (it is \"none\")"},
      {"compression.warmup_steps", "compression.grad is not \"none\" or compression.momentum is true", "5", {},
       {"compression.grad=onebit"},
       "compression.warmup_steps applies to a compression.grad codec or to compression.momentum (the codec is "
       "\"none\" and momentum is false)"},
      {"data.val", "data.train is set", "v.bin", {}, {"data.train=a.bin"},
       "data.val=\"v.bin\" applies only when data.train is set: with data.train empty, training and validation both "
       "use synthetic tokens; set data.train, or leave data.val empty"},
      {"checkpoint.every", "checkpoint.dir is set", "10", {}, {"checkpoint.dir=runs/x"},
       "checkpoint.every=10 applies only when checkpoint.dir is set: checkpoint.dir is empty, so no checkpoint is "
       "written; set checkpoint.dir, or leave checkpoint.every at 0"},
      {"checkpoint.keep", "checkpoint.dir is set", "0", {}, {"checkpoint.dir=runs/x"},
       "checkpoint.keep=0 applies only when checkpoint.dir is set: checkpoint.dir is empty, so no checkpoint is "
       "written; set checkpoint.dir, or leave checkpoint.keep at 3"},
      {"recompute.every", "recompute.mode is not \"none\"", "2", {}, {"recompute.mode=selective"},
       "recompute.every=2 applies only when recompute.mode is not \"none\": recompute.mode is \"none\", so no "
       "layer recomputes; set recompute.mode=\"selective\" or \"full\", or leave recompute.every at 1"},
      {"recompute.first", "recompute.mode is not \"none\"", "1", {}, {"recompute.mode=full"},
       "recompute.first=1 applies only when recompute.mode is not \"none\": recompute.mode is \"none\", so no "
       "layer recomputes; set recompute.mode=\"selective\" or \"full\", or leave recompute.first at 0"},
      {"log.trace_file", "parallel.pp > 1", "t.json", {}, {"parallel.pp=2"},
       "log.trace_file=\"t.json\" records the pipeline's timeline: it needs parallel.pp > 1"},
  };
  return cases;
}

std::vector<std::string> joined(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string item_of(const RunConfig& c, const std::string& key) {
  for (const auto& [k, v] : config_items(c))
    if (k == key) return v;
  ADD_FAILURE() << key << " is not a key";
  return "";
}

TEST(Config, EveryConditionalKeyIsRefusedWhereItDoesNotApplyAndAcceptedWhereItDoes) {
  for (const ConditionalCase& t : conditional_cases()) {
    SCOPED_TRACE(t.key + " (applies only when " + t.when + ")");
    const std::string set = t.key + "=" + t.value;
    ASSERT_NO_THROW(parse("", t.context));  // the context alone is valid: the refusal is the key's
    const std::string msg = testing::error_of([&] { parse("", joined(t.context, {set})); });
    EXPECT_EQ(msg, t.message);
    EXPECT_NE(msg.find(t.key), std::string::npos) << msg;
    // The same through validate_config, for configs built in code.
    RunConfig built;
    for (const std::string& o : joined(t.context, {set})) apply_override(built, o);
    EXPECT_EQ(testing::error_of([&] { validate_config(built); }), t.message);
    // With its condition met, the key is accepted and keeps its value.
    RunConfig ok;
    EXPECT_NO_THROW(ok = parse("", joined(joined(t.context, {set}), t.enable)));
    EXPECT_NE(item_of(ok, t.key), item_of(RunConfig(), t.key));
  }
  // Without data.train, training and evaluation run on synthetic tokens: the
  // evaluation keys apply.
  EXPECT_NO_THROW(parse("", {"train.eval_every=5", "train.eval_steps=3"}));
}

TEST(Config, EveryRowOfTheConditionalTableHasACaseHelpAndDocs) {
  std::vector<std::pair<std::string, std::string>> table, tested;
  for (const ConditionalKey& k : conditional_keys()) table.emplace_back(k.key, k.when);
  for (const ConditionalCase& t : conditional_cases()) tested.emplace_back(t.key, t.when);
  std::sort(table.begin(), table.end());
  std::sort(tested.begin(), tested.end());
  EXPECT_EQ(tested, table);
  const std::string help = config_help();
  const std::string docs = testing::read_text(std::string(LATTICE_SOURCE_DIR) + "/docs/config.md");
  for (const ConditionalKey& k : conditional_keys()) {
    const size_t dot = k.key.find('.');
    const size_t section = help.find("\n[" + k.key.substr(0, dot) + "]\n");
    ASSERT_NE(section, std::string::npos) << k.key;
    const size_t line = help.find("\n  " + k.key.substr(dot + 1) + " = ", section);
    ASSERT_NE(line, std::string::npos) << k.key;
    const std::string text = help.substr(line + 1, help.find('\n', line + 1) - line - 1);
    EXPECT_NE(text.find("applies only when"), std::string::npos) << text;
    EXPECT_NE(text.find(k.when), std::string::npos) << text;
    EXPECT_NE(docs.find("| `" + k.key + "` | " + k.when + " |"), std::string::npos)
        << "docs/config.md does not list " << k.key << " | " << k.when;
  }
}

// A key whose feature has not landed (parallel.microbatches: one knob, not
// two) is refused by check_landed (which the trainer runs before it builds
// the mesh); context and expert parallelism have landed, and --help-config
// does not mark them.
TEST(Config, UnlandedFeaturesAreRefusedNamingTheKey) {
  EXPECT_NO_THROW(check_landed(RunConfig()));
  RunConfig c;
  c.parallel.cp = 2;
  EXPECT_NO_THROW(check_landed(c));
  c = RunConfig();
  c.parallel.ep = 4;
  EXPECT_NO_THROW(check_landed(c));
  c = RunConfig();
  c.parallel.microbatches = 4;
  EXPECT_NE(testing::error_of([&] { check_landed(c); }).find("parallel.microbatches=4: "), std::string::npos);
  const std::string help = config_help();
  for (const char* name : {"dp", "cp", "ep"}) {
    const size_t line = help.find(std::string("\n  ") + name + " = ");
    EXPECT_EQ(help.substr(line, help.find('\n', line + 1) - line).find("not implemented"), std::string::npos) << name;
  }
}

// The shipped configs load, and with the overrides the docs show.
TEST(Config, ShippedConfigsTakeTheDocumentedOverrides) {
  const std::string dir = std::string(LATTICE_SOURCE_DIR) + "/configs/";
  EXPECT_NO_THROW(load_config(dir + "demo.toml", {}));
  // docs/config.md: lattice train -c configs/tiny.toml ... --set data.train=data/*.bin
  EXPECT_NO_THROW(load_config(dir + "tiny.toml", {"train.steps=10", "parallel.tp=2", "data.train=data/*.bin"}));
  // README: the demo on other shards.
  EXPECT_NO_THROW(load_config(dir + "demo.toml", {"data.train=data/mine/train_*.bin", "data.val=data/mine/val_*.bin"}));
}

TEST(Config, TomlSyntaxErrorsNameFileAndLine) {
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = 10\nseed = = 3\n"), "config file 'x.toml' line 3: ");
  EXPECT_ERROR_CONTAINS(parse("[train]\nsteps = 1\nsteps = 2\n"), "config file 'x.toml' line 3: ");
}

TEST(Config, LoadConfigFromFile) {
  TempDir dir;
  write_text(dir / "run.toml", "[train]\nsteps = 7\n");
  RunConfig c = load_config(dir / "run.toml", {"train.seed=5"});
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.train.seed, 5);
  EXPECT_ERROR_CONTAINS(load_config(dir / "missing.toml", {}),
                        "cannot read config file '" + (dir / "missing.toml") + "': No such file or directory");
  write_text(dir / "bad.toml", "[train]\nsteps = \n");
  EXPECT_ERROR_CONTAINS(load_config(dir / "bad.toml", {}), "config file '" + (dir / "bad.toml") + "' line 2: ");
}

TEST(Config, ToTomlRoundTripsExactly) {
  RunConfig c;
  c.model.n_layer = 3;
  c.optim.lr = 0.1 + 0.2;  // not a short decimal
  c.optim.min_lr = 1e-10;
  c.optim.eps = 1e-8;
  c.parallel.bucket_mb = 25;
  c.parallel.tp = 4;
  c.parallel.sequence_parallel = true;
  c.precision.compute = "f16";
  c.precision.loss_scale = 128;
  c.data.train = "a \"quoted\" \\ path\twith\ncontrol \x01 chars and \xc3\xa9";
  c.train.seed = 9007199254740993;  // > 2^53
  std::string text = config_to_toml(c);
  EXPECT_EQ(parse_config_text(text, "roundtrip", {}), c) << text;
  RunConfig d;
  EXPECT_EQ(parse_config_text(config_to_toml(d), "roundtrip", {}), d);
  EXPECT_NE(text.find("[model]\nfamily = \"gpt2\"\nn_layer = 3\n"), std::string::npos) << text;
  EXPECT_NE(config_to_toml(d).find("loss_scale = \"dynamic\""), std::string::npos);
}

TEST(Config, ItemsAndHelp) {
  RunConfig c;
  auto items = config_items(c);
  ASSERT_FALSE(items.empty());
  EXPECT_EQ(items.front(), (std::pair<std::string, std::string>("model.family", "\"gpt2\"")));
  EXPECT_EQ(items[1], (std::pair<std::string, std::string>("model.n_layer", "12")));
  bool found = false;
  for (const auto& [k, v] : items)
    if (k == "data.train") found = v == "\"\"";
  EXPECT_TRUE(found);
  EXPECT_EQ(items.size(), 83u);
  std::string help = config_help();
  for (const auto& [k, v] : items) {
    std::string name = k.substr(k.find('.') + 1);
    // A key of the family's default shows the families' (ModelFamilyKeysHelpShowsBothFamilies).
    const bool by_family = std::any_of(family_defaults().begin(), family_defaults().end(),
                                       [&](const FamilyDefault& d) { return d.key == k; });
    if (!by_family) {
      EXPECT_NE(help.find("  " + name + " = " + v), std::string::npos) << k;
    }
  }
  EXPECT_NE(help.find("[an integer in 0..3]"), std::string::npos);
}

TEST(Config, ValidateConfigBuiltInCode) {
  RunConfig c;
  EXPECT_NO_THROW(validate_config(c));
  c.train.steps = 0;
  EXPECT_ERROR_CONTAINS(validate_config(c), "train.steps must be an integer >= 1, got 0");
  c = RunConfig();
  c.parallel.schedule = "bogus";
  EXPECT_ERROR_CONTAINS(validate_config(c), "parallel.schedule=\"bogus\" is not a schedule");
  c = RunConfig();
  c.model.n_head = 0;
  EXPECT_ERROR_CONTAINS(validate_config(c), "model.n_head must be an integer >= 1, got 0");
  c = RunConfig();
  c.model.n_head = 7;
  EXPECT_ERROR_CONTAINS(validate_config(c), "model.n_embd=768 is not divisible by model.n_head=7");
}

TEST(Config, ShippedConfigsLoad) {
  RunConfig tiny = load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/tiny.toml", {});
  EXPECT_EQ(tiny.model.n_layer, 2);
  EXPECT_EQ(tiny.model.n_embd, 64);
  EXPECT_EQ(tiny.model.family, "gpt2");
  RunConfig small = load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/gpt2-124m.toml", {});
  EXPECT_EQ(small.model.n_layer, 12);
  EXPECT_EQ(small.model.n_embd, 768);
  RunConfig llama_tiny = load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/llama-tiny.toml", {});
  EXPECT_EQ(llama_tiny.model.family, "llama");
  EXPECT_EQ(llama_tiny.model.n_head, 4);
  EXPECT_EQ(llama_tiny.model.n_kv_head, 2);
  EXPECT_GT(llama_tiny.model.ffn_hidden, 0);
  EXPECT_EQ(llama_tiny.model.n_embd, tiny.model.n_embd);
  EXPECT_EQ(llama_tiny.train, tiny.train);
  RunConfig llama = load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/llama-125m.toml", {});
  EXPECT_EQ(llama.model.family, "llama");
  EXPECT_EQ(llama.model.n_layer, 12);
  EXPECT_EQ(llama.model.n_embd, 768);
  EXPECT_EQ(llama.model.n_head, 12);
  EXPECT_EQ(llama.model.n_kv_head, 4);
  EXPECT_EQ(llama.model.ffn_hidden, 2304);
  EXPECT_EQ(llama.model.vocab_size, 50257);
  EXPECT_EQ(llama.model.seq_len, 1024);
  EXPECT_EQ(llama.model.tie_embeddings, std::optional<bool>(true));
  // Otherwise gpt2-124m.toml's recipe.
  EXPECT_EQ(llama.train, small.train);
  EXPECT_EQ(llama.optim, small.optim);
  EXPECT_EQ(llama.parallel, small.parallel);
  EXPECT_EQ(llama.precision, small.precision);
  EXPECT_EQ(llama.data, small.data);
}

// ---------------------------------------------------------------- the model's family and parts

// Nothing written: a GPT-2, every part key unset ("", 0, no value), which
// the trainer resolves to the family's default (ModelConfig::defaults).
TEST(Config, ModelFamilyKeysDefaultToUnset) {
  const ModelSection m = parse("").model;
  EXPECT_EQ(m.family, "gpt2");
  EXPECT_EQ(m.norm, "");
  EXPECT_EQ(m.mlp, "");
  EXPECT_EQ(m.position, "");
  EXPECT_EQ(m.n_kv_head, 0);
  EXPECT_EQ(m.ffn_hidden, 0);
  EXPECT_FALSE(m.rope_theta.has_value());
  EXPECT_FALSE(m.norm_eps.has_value());
  EXPECT_FALSE(m.bias.has_value());
  EXPECT_FALSE(m.tie_embeddings.has_value());
  // family = "llama" alone is a Llama: the parts stay unset, the family's.
  const ModelSection llama = parse("[model]\nfamily = \"llama\"\n").model;
  EXPECT_EQ(llama.family, "llama");
  ModelSection expected;
  expected.family = "llama";
  EXPECT_EQ(llama, expected);
}

TEST(Config, ModelFamilyKeysReadFromTomlAndOverrides) {
  const ModelSection m = parse(R"(
[model]
family = "llama"
n_head = 8
n_embd = 512
norm = "layernorm"
mlp = "gelu"
position = "learned"
n_kv_head = 2
ffn_hidden = 1536
norm_eps = 1e-6
bias = true
tie_embeddings = true
)").model;
  EXPECT_EQ(m.family, "llama");
  EXPECT_EQ(m.norm, "layernorm");
  EXPECT_EQ(m.mlp, "gelu");
  EXPECT_EQ(m.position, "learned");
  EXPECT_EQ(m.n_kv_head, 2);
  EXPECT_EQ(m.ffn_hidden, 1536);
  EXPECT_EQ(m.norm_eps, std::optional<double>(1e-6));
  EXPECT_EQ(m.bias, std::optional<bool>(true));
  EXPECT_EQ(m.tie_embeddings, std::optional<bool>(true));
  // Each key on the command line, typed by the key.
  const ModelSection o =
      parse("", {"model.family=llama", "model.norm=rmsnorm", "model.mlp=swiglu", "model.position=rope",
                 "model.n_kv_head=4", "model.ffn_hidden=2304", "model.rope_theta=500000", "model.norm_eps=0.00001",
                 "model.bias=false", "model.tie_embeddings=false"})
          .model;
  EXPECT_EQ(o.family, "llama");
  EXPECT_EQ(o.norm, "rmsnorm");
  EXPECT_EQ(o.mlp, "swiglu");
  EXPECT_EQ(o.position, "rope");
  EXPECT_EQ(o.n_kv_head, 4);
  EXPECT_EQ(o.ffn_hidden, 2304);
  EXPECT_EQ(o.rope_theta, std::optional<double>(500000));
  EXPECT_EQ(o.norm_eps, std::optional<double>(1e-5));
  EXPECT_EQ(o.bias, std::optional<bool>(false));
  EXPECT_EQ(o.tie_embeddings, std::optional<bool>(false));
  // An empty value gives a key back to the family, over what the file said.
  const ModelSection back = parse("[model]\nfamily = \"llama\"\nnorm = \"layernorm\"\nbias = true\nnorm_eps = 1e-6\n",
                                  {"model.norm=", "model.bias=", "model.norm_eps=\"\""})
                                .model;
  EXPECT_EQ(back.norm, "");
  EXPECT_FALSE(back.bias.has_value());
  EXPECT_FALSE(back.norm_eps.has_value());
  // ... and so does "" in a file (what config_to_toml writes for an unset key).
  EXPECT_FALSE(parse("[model]\nbias = \"\"\nrope_theta = \"\"\n").model.bias.has_value());
}

TEST(Config, ModelFamilyKeysRefuseBadSpellingsAndValues) {
  EXPECT_ERROR_CONTAINS(parse("[model]\nfamily = \"mistral\"\n"),
                        "model.family must be one of gpt2, llama, got \"mistral\" (config file 'x.toml' line 2)");
  EXPECT_ERROR_CONTAINS(parse("", {"model.family="}), "model.family must be one of gpt2, llama, got \"\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.norm=rms"}),
                        "model.norm must be one of layernorm, rmsnorm (\"\": the family's), got \"rms\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.mlp=relu"}),
                        "model.mlp must be one of gelu, swiglu (\"\": the family's), got \"relu\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.position=alibi"}),
                        "model.position must be one of learned, rope (\"\": the family's), got \"alibi\"");
  EXPECT_ERROR_CONTAINS(parse("[model]\nnorm = \"RMSNorm\"\n"),
                        "model.norm must be one of layernorm, rmsnorm (\"\": the family's), got \"RMSNorm\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.n_kv_head=-1"}),
                        "model.n_kv_head must be an integer >= 0 (0: the family's), got -1");
  EXPECT_ERROR_CONTAINS(parse("", {"model.ffn_hidden=1.5"}),
                        "model.ffn_hidden must be an integer >= 0 (0: the family's), got 1.5");
  EXPECT_ERROR_CONTAINS(parse("", {"model.family=llama", "model.rope_theta=0"}),
                        "model.rope_theta must be a number > 0 (\"\": the family's), got 0");
  EXPECT_ERROR_CONTAINS(parse("", {"model.family=llama", "model.rope_theta=fast"}),
                        "model.rope_theta must be a number > 0 (\"\": the family's), got \"fast\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.norm_eps=1"}),
                        "model.norm_eps must be a number in (0, 1) (\"\": the family's), got 1");
  EXPECT_ERROR_CONTAINS(parse("[model]\nnorm_eps = nan\n"),
                        "model.norm_eps must be a number in (0, 1) (\"\": the family's), got nan");
  EXPECT_ERROR_CONTAINS(parse("", {"model.bias=yes"}),
                        "model.bias must be true or false (\"\": the family's), got \"yes\"");
  EXPECT_ERROR_CONTAINS(parse("[model]\ntie_embeddings = 1\n"),
                        "model.tie_embeddings must be true or false (\"\": the family's), got 1");
  EXPECT_ERROR_CONTAINS(parse("[model]\nbias = \"false\"\n"),
                        "model.bias must be true or false (\"\": the family's), got \"false\"");
  EXPECT_ERROR_CONTAINS(parse("", {"model.n_kv_heads=4"}), "did you mean 'model.n_kv_head'?");
}

// model.rope_theta applies to rotary positions: written, or the family's.
TEST(Config, RopeThetaAppliesOnlyToRotaryPositions) {
  EXPECT_EQ(parse("", {"model.family=llama", "model.rope_theta=500000"}).model.rope_theta,
            std::optional<double>(500000));
  EXPECT_EQ(parse("", {"model.position=rope", "model.rope_theta=500000"}).model.rope_theta,
            std::optional<double>(500000));
  EXPECT_EQ(testing::error_of([&] { parse("", {"model.rope_theta=500000"}); }),
            "model.rope_theta=500000.0 applies to rotary positions, but model.position is \"learned\" "
            "(model.family = \"gpt2\"'s default): set model.position=\"rope\", or leave model.rope_theta unset");
  EXPECT_EQ(testing::error_of([&] {
              parse("", {"model.family=llama", "model.position=learned", "model.rope_theta=10000"});
            }),
            "model.rope_theta=10000.0 applies to rotary positions, but model.position is \"learned\": set "
            "model.position=\"rope\", or leave model.rope_theta unset");
  // Unset again, it is accepted.
  EXPECT_NO_THROW(parse("", {"model.rope_theta=500000", "model.rope_theta="}));
}

// io leaves whether the parts fit together to the model (ModelConfig::validate
// and check_tensor_parallel, which the trainer runs when it loads a config:
// tests/train/model_config_test.cpp): spellings and ranges only here.
TEST(Config, ModelCombinationsAreTheModelsToRefuse) {
  EXPECT_NO_THROW(parse("", {"model.mlp=swiglu", "model.n_kv_head=4"}));
  EXPECT_NO_THROW(parse("", {"parallel.tp=5"}));
}

TEST(Config, ModelFamilyKeysRoundTripThroughToml) {
  RunConfig c;
  c.model.family = "llama";
  c.model.n_kv_head = 4;
  c.model.ffn_hidden = 2304;
  c.model.rope_theta = 500000;
  c.model.norm_eps = 1e-6;
  c.model.tie_embeddings = true;  // norm, mlp, position and bias left to the family
  const std::string text = config_to_toml(c);
  EXPECT_EQ(parse_config_text(text, "roundtrip", {}), c) << text;
  EXPECT_EQ(parse_saved_config(text, "meta.json config"), c) << text;
  EXPECT_NE(text.find("[model]\nfamily = \"llama\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nnorm = \"\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nbias = \"\"\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nrope_theta = 500000.0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\ntie_embeddings = true\n"), std::string::npos) << text;
  // Every key set, then none.
  c.model.norm = "rmsnorm";
  c.model.mlp = "swiglu";
  c.model.position = "rope";
  c.model.bias = false;
  EXPECT_EQ(parse_saved_config(config_to_toml(c), "meta.json config"), c);
  EXPECT_EQ(parse_saved_config(config_to_toml(RunConfig()), "meta.json config"), RunConfig());
}

// A checkpoint written before the families (no family keys in its recorded
// config) reads as a GPT-2 with every part the family's.
TEST(Config, SavedConfigsWithoutFamilyKeysReadAsGpt2) {
  const RunConfig c = parse_saved_config(
      "[model]\nn_layer = 2\nn_head = 4\nn_embd = 64\nvocab_size = 512\nseq_len = 64\n[train]\nsteps = 20\n",
      "meta.json config");
  ModelSection expected;
  expected.n_layer = 2;
  expected.n_head = 4;
  expected.n_embd = 64;
  expected.vocab_size = 512;
  expected.seq_len = 64;
  EXPECT_EQ(c.model, expected);
  EXPECT_EQ(c.model.family, "gpt2");
}

// --help-config (and so docs/config.md) shows a family key's default for
// both families, and how to leave a key to the family.
TEST(Config, ModelFamilyKeysHelpShowsBothFamilies) {
  const std::string help = config_help();
  for (const char* line :
       {"  family = \"gpt2\" ", "  norm = gpt2 \"layernorm\", llama \"rmsnorm\"  ",
        "  mlp = gpt2 \"gelu\", llama \"swiglu\"  ", "  position = gpt2 \"learned\", llama \"rope\"  ",
        "  n_kv_head = n_head  ", "  rope_theta = 10000.0  ", "  norm_eps = 0.00001  ",
        "  bias = gpt2 true, llama false  ", "  tie_embeddings = gpt2 true, llama false  ",
        "[one of layernorm, rmsnorm (\"\": the family's)]", "[an integer >= 0 (0: the family's)]",
        "[true or false (\"\": the family's)]"})
    EXPECT_NE(help.find(line), std::string::npos) << line;
  // Every key of family_defaults() is a key of the table, and marked.
  const auto items = config_items(RunConfig());
  for (const FamilyDefault& d : family_defaults()) {
    EXPECT_TRUE(std::any_of(items.begin(), items.end(), [&](const auto& kv) { return kv.first == d.key; })) << d.key;
    const std::string name = d.key.substr(d.key.find('.') + 1);
    const size_t at = help.find("\n  " + name + " = ");
    ASSERT_NE(at, std::string::npos) << d.key;
    const std::string text = help.substr(at + 1, help.find('\n', at + 1) - at - 1);
    EXPECT_NE(text.find("the family's"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace lattice::io

// A checkpoint's recorded config is read as written: a key a newer rule
// refuses (here train.eval_steps with shards but no data.val) still loads,
// while the same text as a run's config is refused naming the key.
TEST(Config, SavedConfigsAreReadWithoutTheCrossKeyRules) {
  const std::string text = "[train]\neval_steps = 5\n[data]\ntrain = \"x_*.bin\"\n";
  EXPECT_ERROR_CONTAINS(lattice::io::parse_config_text(text, "run.toml", {}), "train.eval_steps=5");
  const lattice::io::RunConfig c = lattice::io::parse_saved_config(text, "meta.json config");
  EXPECT_EQ(c.train.eval_steps, 5);
  EXPECT_EQ(c.data.train, "x_*.bin");
  EXPECT_ERROR_CONTAINS(lattice::io::parse_saved_config("[train]\nno_such_key = 1\n", "meta.json config"),
                        "no_such_key");
}
