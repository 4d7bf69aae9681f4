#include "lattice/io/config.h"

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
                        "unknown section '[trian]' (valid sections: model, parallel, zero, train, optim, precision, "
                        "compression, data, checkpoint, log); did you mean '[train]'?");
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
  EXPECT_ERROR_CONTAINS(parse("[parallel]\ndp = 0\n"), "parallel.dp must be an integer >= 1, got 0");
  EXPECT_ERROR_CONTAINS(parse("[parallel]\nbucket_mb = 0\n"), "parallel.bucket_mb must be a number > 0, got 0");
}

TEST(Config, CrossKeyChecks) {
  EXPECT_ERROR_CONTAINS(parse("[model]\nn_embd = 100\n"), "model.n_embd=100 is not divisible by model.n_head=12");
  EXPECT_ERROR_CONTAINS(parse("", {"optim.min_lr=0.001"}), "optim.min_lr=0.001 must be <= optim.lr=0.0006");
  // A later override can repair what an earlier value broke: checks run after all of them.
  EXPECT_NO_THROW(parse("[model]\nn_embd = 100\n", {"model.n_head=10"}));
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
  EXPECT_NE(text.find("[model]\nn_layer = 3\n"), std::string::npos) << text;
  EXPECT_NE(config_to_toml(d).find("loss_scale = \"dynamic\""), std::string::npos);
}

TEST(Config, ItemsAndHelp) {
  RunConfig c;
  auto items = config_items(c);
  ASSERT_FALSE(items.empty());
  EXPECT_EQ(items.front(), (std::pair<std::string, std::string>("model.n_layer", "12")));
  bool found = false;
  for (const auto& [k, v] : items)
    if (k == "data.train") found = v == "\"\"";
  EXPECT_TRUE(found);
  EXPECT_EQ(items.size(), 58u);
  std::string help = config_help();
  for (const auto& [k, v] : items) {
    std::string name = k.substr(k.find('.') + 1);
    EXPECT_NE(help.find("  " + name + " = " + v), std::string::npos) << k;
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
  RunConfig small = load_config(std::string(LATTICE_SOURCE_DIR) + "/configs/gpt2-124m.toml", {});
  EXPECT_EQ(small.model.n_layer, 12);
  EXPECT_EQ(small.model.n_embd, 768);
}

}  // namespace
}  // namespace lattice::io
