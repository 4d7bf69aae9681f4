// The GPT model: configuration errors, layout-independent initialisation,
// whole-model gradient check, split backward == fused backward, determinism,
// vocabulary padding, and learning a synthetic task.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"

using namespace lattice;
using namespace lattice::model;

static ModelConfig tiny_config() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 37;
  c.seq_len = 8;
  return c;
}

static std::string error_of(const ModelConfig& c) {
  try {
    c.validate();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, InvalidValuesNameTheKey) {
  ModelConfig c = tiny_config();
  c.n_embd = 10;
  c.n_head = 4;
  EXPECT_EQ(error_of(c), "model.n_embd=10 is not divisible by model.n_head=4");
  c = tiny_config();
  c.n_layer = 0;
  EXPECT_EQ(error_of(c), "model.n_layer must be >= 1, got 0");
  c = tiny_config();
  c.n_head = 0;
  EXPECT_EQ(error_of(c), "model.n_head must be >= 1, got 0");
  c = tiny_config();
  c.n_embd = -3;
  EXPECT_EQ(error_of(c), "model.n_embd must be >= 1, got -3");
  c = tiny_config();
  c.vocab_size = 0;
  EXPECT_EQ(error_of(c), "model.vocab_size must be >= 2, got 0");
  c = tiny_config();
  c.seq_len = 0;
  EXPECT_EQ(error_of(c), "model.seq_len must be >= 1, got 0");
  c = tiny_config();
  c.vocab_size = 70000;
  EXPECT_NE(error_of(c).find("model.vocab_size=70000 exceeds 65536"), std::string::npos);
  EXPECT_EQ(error_of(tiny_config()), "");
}

TEST(ModelConfig, SequenceLongerThanMaxIsRefused) {
  GPT gpt(tiny_config(), 1);
  std::vector<int32_t> tokens(2 * 9, 1);
  try {
    gpt.evaluate(tokens.data(), tokens.data(), 2, 9);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "sequence length 9 exceeds model.seq_len=8");
  }
}

TEST(ModelConfig, ParamCountAndFlops) {
  ModelConfig gpt2;  // defaults: GPT-2 124M
  EXPECT_EQ(gpt2.num_params(), 124439808);
  EXPECT_EQ(gpt2.padded_vocab(), 50304);
  GPT tiny(tiny_config(), 1);
  int64_t declared = 0;
  for (const ParamGroup& g : tiny.groups())
    for (const ParamInfo& p : g.params()) declared += p.numel();
  // Declared includes the padding rows of wte (37 → 128).
  EXPECT_EQ(declared - (128 - 37) * 16, tiny.num_params());
  // 6·(N - wpe) + 12·L·C·T
  EXPECT_DOUBLE_EQ(gpt2.flops_per_token(1024), 6.0 * (124439808.0 - 1024 * 768) + 12.0 * 12 * 768 * 1024);
}

TEST(ParamInit, HfNamesAndShapes) {
  GPT gpt(tiny_config(), 1);
  ASSERT_EQ(gpt.groups().size(), 4u);
  EXPECT_EQ(gpt.groups()[0].params()[0].name, "wte.weight");
  EXPECT_EQ(gpt.groups()[0].params()[1].name, "wpe.weight");
  EXPECT_EQ(gpt.groups()[1].params()[2].name, "h.0.attn.c_attn.weight");
  EXPECT_EQ(gpt.groups()[1].params()[2].full_shape, (std::vector<int64_t>{48, 16}));
  EXPECT_EQ(gpt.groups()[2].params()[11].name, "h.1.mlp.c_proj.bias");
  EXPECT_EQ(gpt.groups()[3].params()[1].name, "ln_f.bias");
  // LayerNorm weights start at 1, biases at 0, padded wte rows at 0.
  auto [g, i] = gpt.find_param("h.1.ln_2.weight");
  ASSERT_NE(g, nullptr);
  for (int c = 0; c < 16; c++) EXPECT_EQ(g->param(i)[c], 1.0f);
  float* wte = gpt.embedding_group().param(0);
  for (int r = 37; r < 128; r++)
    for (int c = 0; c < 16; c++) ASSERT_EQ(wte[r * 16 + c], 0.0f);
  EXPECT_EQ(wte[5], init_normal(1, "wte.weight", 5) * 0.02f);
}

// A slice of a tensor initialised through its ShardSpec equals the same slice
// of the full tensor: every layout starts from the same weights.
TEST(ParamInit, ShardedSliceMatchesFullTensor) {
  const std::vector<int64_t> full_shape = {3 * 8, 6};  // fused QKV: 3 parts of 8 rows
  ParamGroup full("full");
  ParamInfo p;
  p.name = "h.0.attn.c_attn.weight";
  p.full_shape = full_shape;
  p.init = {InitSpec::Normal, 1.0f};
  full.add(p);
  full.allocate();
  full.initialize(42);
  for (int shards : {2, 4}) {
    for (int s = 0; s < shards; s++) {
      ParamGroup part("part");
      ParamInfo q = p;
      q.shard = {0, shards, s, 3};  // split rows, per Q/K/V part
      part.add(q);
      part.allocate();
      part.initialize(42);
      const int64_t rows_per_part = 8 / shards;
      ASSERT_EQ(part.params()[0].shape, (std::vector<int64_t>{3 * rows_per_part, 6}));
      for (int64_t r = 0; r < 3 * rows_per_part; r++) {
        int64_t which = r / rows_per_part, within = r % rows_per_part;
        int64_t full_row = which * 8 + s * rows_per_part + within;
        for (int c = 0; c < 6; c++) ASSERT_EQ(part.param(0)[r * 6 + c], full.param(0)[full_row * 6 + c]);
      }
    }
  }
  // Column split (row-parallel weights).
  ParamGroup cols("cols");
  ParamInfo q = p;
  q.shard = {1, 2, 1, 1};
  cols.add(q);
  cols.allocate();
  cols.initialize(42);
  for (int64_t r = 0; r < 24; r++)
    for (int c = 0; c < 3; c++) ASSERT_EQ(cols.param(0)[r * 3 + c], full.param(0)[r * 6 + 3 + c]);
}

static std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.next_below(vocab));
  return t;
}

// Every parameter tensor's gradient, checked along a random direction against
// a central finite difference of the loss.
TEST(GPT, GradientMatchesFiniteDifferences) {
  set_num_threads(1);
  ModelConfig c = tiny_config();
  GPT gpt(c, 7);
  // Non-trivial LayerNorm parameters and biases so that every path matters.
  Rng rng(3);
  for (ParamGroup& g : gpt.groups())
    for (size_t i = 0; i < g.params().size(); i++)
      if (g.params()[i].init.kind == InitSpec::Constant)
        for (int64_t j = 0; j < g.params()[i].numel(); j++) g.param(i)[j] += 0.1f * rng.next_normal();
  const int B = 2, T = 8;
  auto inputs = random_tokens(B * T, c.vocab_size, 1), targets = random_tokens(B * T, c.vocab_size, 2);
  gpt.zero_grad();
  gpt.forward(0, inputs.data(), targets.data(), B, T, 1.0f);
  gpt.backward(0);
  int checked = 0;
  for (ParamGroup& g : gpt.groups()) {
    for (size_t i = 0; i < g.params().size(); i++) {
      const ParamInfo& p = g.params()[i];
      const int64_t n = p.real_rows >= 0 ? p.real_rows * p.full_shape[1] : p.numel();
      std::vector<float> dir(n);
      double analytic = 0;
      for (int64_t j = 0; j < n; j++) {
        dir[j] = rng.next_normal();
        analytic += static_cast<double>(dir[j]) * g.param_grad(i)[j];
      }
      std::vector<float> saved(g.param(i), g.param(i) + n);
      const float eps = 1e-2f;
      for (int64_t j = 0; j < n; j++) g.param(i)[j] = saved[j] + eps * dir[j];
      double lp = gpt.evaluate(inputs.data(), targets.data(), B, T);
      for (int64_t j = 0; j < n; j++) g.param(i)[j] = saved[j] - eps * dir[j];
      double lm = gpt.evaluate(inputs.data(), targets.data(), B, T);
      std::memcpy(g.param(i), saved.data(), n * sizeof(float));
      double numeric = (lp - lm) / (2.0 * eps);
      EXPECT_NEAR(analytic, numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << p.name;
      checked++;
    }
  }
  EXPECT_EQ(checked, 2 + 2 * 12 + 2);
}

static std::vector<std::vector<float>> grads_of(GPT& gpt) {
  std::vector<std::vector<float>> out;
  for (ParamGroup& g : gpt.groups()) out.emplace_back(g.grad(), g.grad() + g.numel());
  return out;
}

// backward_input + backward_weight (split, as zero-bubble schedules use it)
// gives exactly the gradients of the fused backward, over several micro-batches
// in flight at once.
TEST(GPT, SplitBackwardEqualsFusedBitwise) {
  ModelConfig c = tiny_config();
  const int B = 2, T = 8;
  auto in0 = random_tokens(B * T, c.vocab_size, 11), tg0 = random_tokens(B * T, c.vocab_size, 12);
  auto in1 = random_tokens(B * T, c.vocab_size, 13), tg1 = random_tokens(B * T, c.vocab_size, 14);
  GPT fused(c, 5), split(c, 5);
  float f0 = fused.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
  fused.backward(0);
  float f1 = fused.forward(0, in1.data(), tg1.data(), B, T, 0.5f);
  fused.backward(0);
  // Two micro-batches in flight, weight work deferred and done in reverse order.
  float s0 = split.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
  float s1 = split.forward(1, in1.data(), tg1.data(), B, T, 0.5f);
  split.backward_input(0);
  split.backward_weight(0);
  split.backward_input(1);
  split.backward_weight(1);
  EXPECT_EQ(f0, s0);
  EXPECT_EQ(f1, s1);
  auto a = grads_of(fused), b = grads_of(split);
  for (size_t g = 0; g < a.size(); g++) ASSERT_EQ(0, std::memcmp(a[g].data(), b[g].data(), a[g].size() * 4)) << g;
}

TEST(GPT, SlotMisuseIsAnError) {
  GPT gpt(tiny_config(), 1);
  std::vector<int32_t> t(16, 1);
  EXPECT_THROW(gpt.backward(0), Error);
  gpt.forward(0, t.data(), t.data(), 2, 8, 1.0f);
  EXPECT_THROW(gpt.forward(0, t.data(), t.data(), 2, 8, 1.0f), Error);
  EXPECT_THROW(gpt.backward_weight(0), Error);
  gpt.backward(0);
  std::vector<int32_t> bad(16, 37);
  EXPECT_THROW(gpt.forward(0, bad.data(), t.data(), 2, 8, 1.0f), Error);
}

// Trains `steps` AdamW steps on a fixed batch; returns the losses.
static std::vector<float> train_losses(GPT& gpt, const std::vector<int32_t>& in, const std::vector<int32_t>& tg,
                                       int B, int T, int steps, float lr) {
  optim::AdamW opt(gpt.groups(), optim::AdamWConfig{});
  std::vector<float> losses;
  for (int s = 0; s < steps; s++) {
    gpt.zero_grad();
    losses.push_back(gpt.forward(0, in.data(), tg.data(), B, T, 1.0f));
    gpt.backward(0);
    double norm = optim::global_grad_norm(gpt.groups());
    opt.step(lr, optim::clip_scale(norm, 1.0f));
  }
  return losses;
}

TEST(GPT, SameSeedIsBitIdentical) {
  ModelConfig c = tiny_config();
  auto in = random_tokens(16, c.vocab_size, 1), tg = random_tokens(16, c.vocab_size, 2);
  GPT a(c, 9), b(c, 9);
  auto la = train_losses(a, in, tg, 2, 8, 5, 1e-2f);
  auto lb = train_losses(b, in, tg, 2, 8, 5, 1e-2f);
  for (size_t i = 0; i < la.size(); i++) EXPECT_EQ(la[i], lb[i]);
  GPT other(c, 10);
  EXPECT_NE(other.evaluate(in.data(), tg.data(), 2, 8), a.evaluate(in.data(), tg.data(), 2, 8));
}

// Thread count changes only the reassociation of sums (GEMM blocking and the
// OpenMP reductions); losses agree to fp32 rounding.
TEST(GPT, ThreadCountChangesOnlyRounding) {
  ModelConfig c = tiny_config();
  c.n_embd = 64;
  c.n_head = 4;
  c.seq_len = 32;
  auto in = random_tokens(4 * 32, c.vocab_size, 1), tg = random_tokens(4 * 32, c.vocab_size, 2);
  set_num_threads(1);
  GPT a(c, 9);
  auto la = train_losses(a, in, tg, 4, 32, 5, 1e-3f);
  set_num_threads(2);
  GPT b(c, 9);
  auto lb = train_losses(b, in, tg, 4, 32, 5, 1e-3f);
  for (size_t i = 0; i < la.size(); i++) EXPECT_NEAR(la[i], lb[i], 1e-5 * std::fabs(la[i])) << i;
  set_num_threads(1);
}

// Padded vocabulary rows never win, never get gradient and stay zero.
TEST(GPT, PaddedVocabularyStaysInert) {
  ModelConfig c = tiny_config();
  GPT gpt(c, 3);
  auto in = random_tokens(16, c.vocab_size, 1), tg = random_tokens(16, c.vocab_size, 2);
  train_losses(gpt, in, tg, 2, 8, 3, 1e-2f);
  float* wte = gpt.embedding_group().param(0);
  for (int r = 37; r < 128; r++)
    for (int col = 0; col < 16; col++) ASSERT_EQ(wte[r * 16 + col], 0.0f);
  const float* logits = gpt.last_logits(in.data(), 2, 8);
  for (int b = 0; b < 2; b++) {
    int best = 0;
    for (int v = 1; v < 37; v++)
      if (logits[b * 128 + v] > logits[b * 128 + best]) best = v;
    EXPECT_LT(best, 37);
  }
}

// A learnable task: every sequence counts up from a random start with a random
// stride (mod V). After two tokens the rest is determined, so the loss must
// fall to near the (1/T)-weighted cost of the first, unpredictable tokens.
TEST(GPT, LearnsArithmeticSequences) {
  ModelConfig c = tiny_config();
  c.n_embd = 32;
  c.n_head = 4;
  c.seq_len = 16;
  c.vocab_size = 16;
  GPT gpt(c, 1);
  optim::AdamW opt(gpt.groups(), optim::AdamWConfig{0.9f, 0.95f, 1e-8f, 0.0f});
  const int B = 16, T = 16;
  Rng rng(5);
  float first = 0, last = 0;
  std::vector<int32_t> seq(B * (T + 1)), in(B * T), tg(B * T);
  for (int step = 0; step < 300; step++) {
    for (int b = 0; b < B; b++) {
      int start = static_cast<int>(rng.next_below(16)), stride = 1 + static_cast<int>(rng.next_below(3));
      for (int t = 0; t <= T; t++) seq[b * (T + 1) + t] = (start + stride * t) % 16;
      for (int t = 0; t < T; t++) in[b * T + t] = seq[b * (T + 1) + t], tg[b * T + t] = seq[b * (T + 1) + t + 1];
    }
    gpt.zero_grad();
    float loss = gpt.forward(0, in.data(), tg.data(), B, T, 1.0f);
    gpt.backward(0);
    opt.step(3e-3f, optim::clip_scale(optim::global_grad_norm(gpt.groups()), 1.0f));
    if (step == 0) first = loss;
    last = loss;
  }
  // Position 0 is uniform over 3 strides (ln 3 ≈ 1.1 nats) and later positions
  // are determined, so the floor is about 1.1/16 ≈ 0.07.
  EXPECT_GT(first, 2.0f);
  EXPECT_LT(last, 0.25f);
}

// Evaluation between training steps borrows the training slot's memory; while
// a micro-batch is in flight it uses a slot of its own and leaves it intact.
TEST(GPT, EvaluationReusesTheIdleTrainingSlot) {
  ModelConfig c = tiny_config();
  GPT gpt(c, 2);
  auto in = random_tokens(16, c.vocab_size, 1), tg = random_tokens(16, c.vocab_size, 2);
  gpt.forward(0, in.data(), tg.data(), 2, 8, 1.0f);
  gpt.backward(0);
  auto& mem = MemoryTracker::instance();
  const size_t before = mem.current(MemCategory::Activations);
  const float idle = gpt.evaluate(in.data(), tg.data(), 2, 8);
  EXPECT_EQ(mem.current(MemCategory::Activations), before);
  // In flight: evaluation must not clobber slot 0's activations.
  gpt.zero_grad();
  float loss = gpt.forward(0, in.data(), tg.data(), 2, 8, 1.0f);
  EXPECT_EQ(gpt.evaluate(in.data(), tg.data(), 2, 8), idle);
  gpt.backward(0);
  auto grads_after_eval = grads_of(gpt);
  GPT fresh(c, 2);
  fresh.forward(0, in.data(), tg.data(), 2, 8, 1.0f);
  fresh.backward(0);
  fresh.zero_grad();
  EXPECT_EQ(fresh.forward(0, in.data(), tg.data(), 2, 8, 1.0f), loss);
  fresh.backward(0);
  auto want = grads_of(fresh);
  for (size_t g = 0; g < want.size(); g++)
    ASSERT_EQ(0, std::memcmp(want[g].data(), grads_after_eval[g].data(), want[g].size() * 4)) << g;
}

namespace {

// zero_grad() marks gradients stale instead of clearing them; a backward must
// then overwrite every gradient (here: garbage NaN left in the buffers) and a
// second micro-batch must accumulate. Reading before any write is an error.
TEST(GPT, ZeroGradOverwritesOnFirstWriteThenAccumulates) {
  ModelConfig c = tiny_config();
  auto in = random_tokens(16, c.vocab_size, 3), tg = random_tokens(16, c.vocab_size, 4);
  auto in2 = random_tokens(16, c.vocab_size, 5), tg2 = random_tokens(16, c.vocab_size, 6);
  GPT gpt(c, 2);
  gpt.forward(0, in.data(), tg.data(), 2, 8, 1.0f);
  gpt.backward(0);
  for (ParamGroup& g : gpt.groups()) std::fill(g.grad(), g.grad() + g.numel(), NAN);
  // Padding between parameters is never written: keep it zero as allocate() leaves it.
  for (ParamGroup& g : gpt.groups()) {
    int64_t end = 0;
    for (const auto& p : g.params()) {
      std::fill(g.grad() + end, g.grad() + p.offset, 0.0f);
      end = p.offset + p.numel();
    }
    std::fill(g.grad() + end, g.grad() + g.numel(), 0.0f);
  }
  gpt.zero_grad();
  EXPECT_THROW(gpt.groups()[0].grad(), Error);
  gpt.forward(0, in.data(), tg.data(), 2, 8, 0.5f);
  gpt.backward(0);
  gpt.forward(0, in2.data(), tg2.data(), 2, 8, 0.5f);
  gpt.backward(0);
  auto got = grads_of(gpt);

  // Reference: gradients of the two micro-batches computed one at a time into
  // freshly allocated (zeroed) buffers, summed in the same order.
  GPT ref(c, 2);
  ref.forward(0, in.data(), tg.data(), 2, 8, 0.5f);
  ref.backward(0);
  auto first = grads_of(ref);
  ref.zero_grad();
  ref.forward(0, in2.data(), tg2.data(), 2, 8, 0.5f);
  ref.backward(0);
  auto second = grads_of(ref);
  for (size_t g = 0; g < got.size(); g++)
    for (size_t i = 0; i < got[g].size(); i++) {
      ASSERT_FALSE(std::isnan(got[g][i])) << "group " << g << " element " << i;
      ASSERT_NEAR(got[g][i], first[g][i] + second[g][i], 1e-6f + 1e-5f * std::fabs(got[g][i]))
          << "group " << g << " element " << i;
    }
}

}  // namespace

namespace {

// The cached logits `got` (copied out) against last_logits() of the T tokens
// ending at context + end.
void expect_logits_of(GPT& gpt, const std::vector<float>& got, const int32_t* context, int64_t end, int T,
                      const std::string& what) {
  const float* want = gpt.last_logits(context + end - T, 1, T);
  for (int v = 0; v < gpt.config().vocab_size; v++)
    ASSERT_NEAR(got[v], want[v], 1e-5f + 1e-5f * std::fabs(want[v])) << what << " end=" << end << " v=" << v;
}

// decode() with its key/value cache gives last_logits() of the whole sequence,
// whether the prompt goes in at once or token by token, and refuses to run
// past seq_len.
TEST(GPT, DecodeMatchesFullForward) {
  ModelConfig c = tiny_config();
  c.seq_len = 12;
  GPT gpt(c, 5);
  const auto seq = random_tokens(12, c.vocab_size, 8);
  const int Vp = c.padded_vocab();
  auto check = [&](const float* l, int T, const char* what) {
    expect_logits_of(gpt, std::vector<float>(l, l + Vp), seq.data(), T, T, what);
  };
  gpt.decode_reset();
  check(gpt.decode(seq.data(), 4), 4, "prompt");  // a 4-token prompt at once
  for (int t = 4; t < 12; t++) check(gpt.decode(&seq[t], 1), t + 1, "one token");
  EXPECT_EQ(gpt.decode_position(), 12);
  try {
    gpt.decode(&seq[0], 1);
    FAIL() << "decode past seq_len must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("seq_len 12"), std::string::npos) << e.what();
  }
  // A new sequence token by token from the start.
  gpt.decode_reset();
  for (int t = 0; t < 12; t++) check(gpt.decode(&seq[t], 1), t + 1, "from the start");
}

}  // namespace

namespace {

// next_logits() over a context longer than seq_len: the model sees the most
// recent seq_len tokens, through the cache while it fits and recomputed once
// the window slides; a context that is not an extension starts over.
TEST(GPT, NextLogitsSlidesTheWindow) {
  ModelConfig c = tiny_config();  // seq_len 8
  GPT gpt(c, 6);
  const auto ctx = random_tokens(20, c.vocab_size, 9);
  const int Vp = c.padded_vocab();
  auto check = [&](const std::vector<int32_t>& context, int64_t n) {
    const float* l = gpt.next_logits(context.data(), n);
    expect_logits_of(gpt, std::vector<float>(l, l + Vp), context.data(), n,
                     static_cast<int>(std::min<int64_t>(n, c.seq_len)), "next_logits");
  };
  for (int64_t n = 3; n <= 20; n++) check(ctx, n);  // a 3-token prompt, then one token at a time
  auto other = ctx;
  other[2] = (other[2] + 1) % c.vocab_size;  // same length, different history
  check(other, 5);
  check(other, 6);
  check(ctx, 6);  // back to the first context: not an extension of `other`
  check(ctx, 6);  // the same context twice (no new token)
}


// ---- mixed precision (precision.compute = bf16 | f16) ----

// A model whose head runs in several chunks (kHeadRows = 128 rows at a time:
// B·T = 256 here) with its dlogits recomputed in the backward.
static ModelConfig mp_config() {
  ModelConfig c = tiny_config();
  c.seq_len = 64;
  c.vocab_size = 301;
  return c;
}

static double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); i++) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d, den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The same weights and batch: 16-bit compute's loss and every group's
// gradient stay within the dtype's rounding of f32's (bf16 keeps 8
// significant bits: relative error ~2^-9 per rounding, a few percent after
// the roundings of 2 layers; f16 keeps 11).
TEST(MixedPrecision, LossAndGradientsTrackF32) {
  const ModelConfig c = mp_config();
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 21), tg = random_tokens(B * T, c.vocab_size, 22);
  GPT ref(c, 3);
  const float want = ref.forward(0, in.data(), tg.data(), B, T, 1.0f);
  ref.backward(0);
  const auto want_g = grads_of(ref);
  for (DType t : {DType::BF16, DType::F16}) {
    GPT m(c, 3);
    m.set_compute_dtype(t);
    const float got = m.forward(0, in.data(), tg.data(), B, T, 1.0f);
    m.backward(0);
    EXPECT_NE(got, want) << dtype_name(t) << ": nothing was rounded";
    EXPECT_NEAR(got, want, (t == DType::BF16 ? 5e-3 : 1e-3) * want) << dtype_name(t);
    const auto g = grads_of(m);
    for (size_t i = 0; i < g.size(); i++)
      EXPECT_LE(relative_error(g[i], want_g[i]), t == DType::BF16 ? 5e-2 : 1e-2)
          << dtype_name(t) << " group " << m.groups()[i].name();
    // The master weights are the f32 values, untouched.
    for (size_t i = 0; i < g.size(); i++)
      ASSERT_EQ(0, std::memcmp(m.groups()[i].data(), ref.groups()[i].data(), 4 * m.groups()[i].numel()));
  }
}

// The split backward reads the stored 16-bit activations and recomputes the
// head's dlogits again in backward_weight: the same gradients, bit for bit,
// with two micro-batches in flight sharing the one set of f32 work arrays.
TEST(MixedPrecision, SplitBackwardEqualsFusedBitwise) {
  const ModelConfig c = mp_config();
  const int B = 4, T = 64;
  auto in0 = random_tokens(B * T, c.vocab_size, 31), tg0 = random_tokens(B * T, c.vocab_size, 32);
  auto in1 = random_tokens(B * T, c.vocab_size, 33), tg1 = random_tokens(B * T, c.vocab_size, 34);
  for (DType t : {DType::BF16, DType::F16}) {
    GPT fused(c, 5), split(c, 5);
    fused.set_compute_dtype(t);
    split.set_compute_dtype(t);
    const float f0 = fused.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
    fused.backward(0);
    const float f1 = fused.forward(0, in1.data(), tg1.data(), B, T, 0.5f);
    fused.backward(0);
    const float s0 = split.forward(0, in0.data(), tg0.data(), B, T, 0.5f);
    const float s1 = split.forward(1, in1.data(), tg1.data(), B, T, 0.5f);
    split.backward_input(1);
    split.backward_input(0);
    split.backward_weight(0);
    split.backward_weight(1);
    EXPECT_EQ(f0, s0);
    EXPECT_EQ(f1, s1);
    auto a = grads_of(fused), b = grads_of(split);
    for (size_t g = 0; g < a.size(); g++)
      ASSERT_EQ(0, std::memcmp(a[g].data(), b[g].data(), a[g].size() * 4)) << dtype_name(t) << " group " << g;
  }
}

// Rows are independent: one batch of 4 sequences (two head chunks) gives the
// mean of the losses of its sequences one at a time (one chunk each), and
// its gradient is their accumulated gradient, to f32 reassociation.
TEST(MixedPrecision, HeadChunksAreRowIndependent) {
  const ModelConfig c = mp_config();
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 41), tg = random_tokens(B * T, c.vocab_size, 42);
  GPT whole(c, 7), parts(c, 7);
  whole.set_compute_dtype(DType::BF16);
  parts.set_compute_dtype(DType::BF16);
  const float want = whole.forward(0, in.data(), tg.data(), B, T, 1.0f);
  whole.backward(0);
  double sum = 0;
  for (int b = 0; b < B; b++) {
    sum += parts.forward(0, in.data() + b * T, tg.data() + b * T, 1, T, 1.0f / B);
    parts.backward(0);
  }
  EXPECT_NEAR(sum / B, want, 1e-5 * want);
  const auto a = grads_of(whole), g = grads_of(parts);
  for (size_t i = 0; i < a.size(); i++) EXPECT_LE(relative_error(g[i], a[i]), 1e-4) << whole.groups()[i].name();
  EXPECT_NEAR(whole.evaluate(in.data(), tg.data(), B, T), want, 1e-6 * want);
}

// 16-bit storage halves what a slot keeps (and the head keeps no logits);
// the f32 work arrays are one layer's worth.
TEST(MixedPrecision, StoredActivationsTakeHalfTheBytes) {
  ModelConfig c = mp_config();
  c.n_layer = 6;
  const int B = 4, T = 64;
  GPT f32(c, 1), bf16(c, 1);
  bf16.set_compute_dtype(DType::BF16);
  const double ratio = static_cast<double>(bf16.stored_activation_bytes(B, T)) / f32.stored_activation_bytes(B, T);
  EXPECT_LE(ratio, 0.5) << "stored activations at bf16 vs f32";
  EXPECT_GE(ratio, 0.3);
  EXPECT_EQ(f32.work16_bytes(B, T), 0u);
  EXPECT_LT(bf16.work16_bytes(B, T), f32.stored_activation_bytes(B, T) / c.n_layer * 1.5);
}

// The compute copies follow the master weights once told they changed (the
// optimizer's step says so; zero_grad does too), and only then.
TEST(MixedPrecision, ComputeCopiesFollowTheMasters) {
  const ModelConfig c = mp_config();
  const int B = 1, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 51), tg = random_tokens(B * T, c.vocab_size, 52);
  GPT a(c, 9), b(c, 10);
  a.set_compute_dtype(DType::BF16);
  b.set_compute_dtype(DType::BF16);
  const float la = a.evaluate(in.data(), tg.data(), B, T);
  const float lb = b.evaluate(in.data(), tg.data(), B, T);
  ASSERT_NE(la, lb);
  for (size_t g = 0; g < a.groups().size(); g++)
    std::memcpy(a.groups()[g].data(), b.groups()[g].data(), 4 * b.groups()[g].numel());
  EXPECT_EQ(a.evaluate(in.data(), tg.data(), B, T), la) << "the copies changed without params_changed()";
  a.params_changed();
  EXPECT_EQ(a.evaluate(in.data(), tg.data(), B, T), lb);
  EXPECT_THROW(a.decode(in.data(), 1), Error) << "generation runs at f32";
}

// The f32 work arrays are shared by the slots: an evaluation of another size
// between a micro-batch's forward and its backward (which then loads the
// slot's 16-bit copies back) changes nothing in its gradients.
TEST(MixedPrecision, AnotherSizeInBetweenChangesNothing) {
  const ModelConfig c = mp_config();
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 61), tg = random_tokens(B * T, c.vocab_size, 62);
  GPT a(c, 11), b(c, 11);
  a.set_compute_dtype(DType::BF16);
  b.set_compute_dtype(DType::BF16);
  a.forward(0, in.data(), tg.data(), B, T, 1.0f);
  a.backward(0);
  b.forward(0, in.data(), tg.data(), B, T, 1.0f);
  b.evaluate(in.data(), tg.data(), 1, 16);  // slot 0 is busy: a slot of its own, 16 tokens
  b.backward_input(0);
  b.evaluate(in.data(), tg.data(), 2, 32);
  b.backward_weight(0);
  const auto ga = grads_of(a), gb = grads_of(b);
  for (size_t g = 0; g < ga.size(); g++) ASSERT_EQ(0, std::memcmp(ga[g].data(), gb[g].data(), ga[g].size() * 4)) << g;
}
}  // namespace
