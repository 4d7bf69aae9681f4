// The model: configuration errors, layout-independent initialisation and
// the parameters' names (HF GPT-2's and HF Llama's), and — on every model
// variant of model_variants.h, GPT-2 and Llama — the whole-model gradient
// check, split backward == fused backward, determinism, vocabulary padding,
// learning a synthetic task, decoding with the key/value cache, and mixed
// precision.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include "lattice/comm/communicator.h"
#include "lattice/core/dtype.h"
#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "model_variants.h"

using namespace lattice;
using lattice::model::Family;
using lattice::model::InitSpec;
using lattice::model::MlpKind;
using lattice::model::ModelConfig;
using lattice::model::NormKind;
using lattice::model::ParamGroup;
using lattice::model::ParamInfo;
using lattice::model::PositionKind;
using lattice::model::testing::as_variant;
using lattice::model::testing::random_tokens;
using lattice::model::testing::Variant;
// The value-parametrized suite below is named GPT (its tests keep their
// names: GPT.DecodeMatchesFullForward/gpt2 in CTest, /0 in gtest), so the
// model is Model here.
using Model = lattice::model::GPT;

static ModelConfig tiny_config() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.vocab_size = 37;
  c.seq_len = 8;
  return c;
}

// tiny_config() as a Llama: 4 query heads of 4, 2 key/value heads, an MLP of 40, untied, no biases.
static ModelConfig tiny_llama() {
  ModelConfig c = ModelConfig::defaults(Family::Llama);
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 16;
  c.vocab_size = 37;
  c.seq_len = 8;
  c.ffn_hidden = 40;
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

// The part keys' ranges, as ModelConfig::validate words them (a config file
// is refused earlier by io, in its own words: tests/io/config_test.cpp; the
// combinations validate refuses — grouping that does not divide, rope with
// an odd head size, a GPT-2 family with grouped heads or SwiGLU — are
// checked through the config path in tests/train/model_config_test.cpp).
TEST(ModelConfig, PartKeysOutOfRangeNameTheKey) {
  EXPECT_EQ(error_of(tiny_llama()), "");
  ModelConfig c = tiny_llama();
  c.n_kv_head = -1;
  EXPECT_EQ(error_of(c), "model.n_kv_head must be >= 1 (or 0: model.n_head), got -1");
  c = tiny_llama();
  c.ffn_hidden = -2;
  EXPECT_EQ(error_of(c), "model.ffn_hidden must be >= 1 (or 0: the family's default), got -2");
  c = tiny_llama();
  c.norm_eps = 0;
  EXPECT_EQ(error_of(c), "model.norm_eps must be in (0, 1), got 0");
  c.norm_eps = NAN;
  EXPECT_EQ(error_of(c), "model.norm_eps must be in (0, 1), got nan");
  c = tiny_llama();
  c.rope_theta = 0;
  EXPECT_EQ(error_of(c), "model.rope_theta must be a finite number > 0, got 0");
  c.position = PositionKind::Learned;  // no rotation: rope_theta is not read
  EXPECT_EQ(error_of(c), "");
}

TEST(ModelConfig, SequenceLongerThanMaxIsRefused) {
  Model gpt(tiny_config(), 1);
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
  Model tiny(tiny_config(), 1);
  int64_t declared = 0;
  for (const ParamGroup& g : tiny.groups())
    for (const ParamInfo& p : g.params()) declared += p.numel();
  // Declared includes the padding rows of wte (37 → 128).
  EXPECT_EQ(declared - (128 - 37) * 16, tiny.num_params());
  // 6·(N - wpe) + 12·L·C·T
  EXPECT_DOUBLE_EQ(gpt2.flops_per_token(1024), 6.0 * (124439808.0 - 1024 * 768) + 12.0 * 12 * 768 * 1024);
}

TEST(ParamInit, HfNamesAndShapes) {
  Model gpt(tiny_config(), 1);
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

// ---- HF Llama's parameters ----

using Shapes = std::map<std::string, std::vector<int64_t>>;

// Every parameter's full shape, by name.
static Shapes shapes_of(const Model& m) {
  Shapes s;
  for (const ParamGroup& g : m.groups())
    for (const ParamInfo& p : g.params()) EXPECT_TRUE(s.emplace(p.name, p.full_shape).second) << p.name << " twice";
  return s;
}

// What HF Llama names a family-llama model's parameters, by hand from the
// config (lattice's [out, in] layout, as HF's nn.Linear): q_proj [n_head·hs,
// C], k_proj and v_proj [n_kv_head·hs, C], the vocabulary tables padded to
// Vp rows, lm_head only when untied, biases only with model.bias. A
// LayerNorm's bias and the learned position table (which HF Llama has not)
// keep the same scheme.
static Shapes llama_shapes(const ModelConfig& c) {
  const int64_t C = c.n_embd, hs = C / c.n_head, Q = c.n_head * hs, KV = c.kv_heads() * hs, F = c.ffn();
  const int64_t Vp = (c.vocab_size + 127) / 128 * 128;
  const bool layernorm = c.norm == NormKind::LayerNorm;
  Shapes s;
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    s[name + ".weight"] = {out, in};
    if (c.bias) s[name + ".bias"] = {out};
  };
  auto norm = [&](const std::string& name) {
    s[name + ".weight"] = {C};
    if (layernorm) s[name + ".bias"] = {C};
  };
  s["model.embed_tokens.weight"] = {Vp, C};
  if (c.position == PositionKind::Learned) s["model.embed_positions.weight"] = {c.seq_len, C};
  for (int l = 0; l < c.n_layer; l++) {
    const std::string h = "model.layers." + std::to_string(l) + ".";
    norm(h + "input_layernorm");
    linear(h + "self_attn.q_proj", Q, C);
    linear(h + "self_attn.k_proj", KV, C);
    linear(h + "self_attn.v_proj", KV, C);
    linear(h + "self_attn.o_proj", C, Q);
    norm(h + "post_attention_layernorm");
    if (c.mlp == MlpKind::SwiGLU) linear(h + "mlp.gate_proj", F, C);
    linear(h + "mlp.up_proj", F, C);
    linear(h + "mlp.down_proj", C, F);
  }
  norm("model.norm");
  if (!c.tie_embeddings) s["lm_head.weight"] = {Vp, C};
  return s;
}

TEST(ParamInit, LlamaHfNamesAndShapes) {
  const ModelConfig c = tiny_llama();
  Model gpt(c, 1);
  std::vector<std::string> groups;
  for (const ParamGroup& g : gpt.groups()) groups.push_back(g.name());
  EXPECT_EQ(groups, (std::vector<std::string>{"embedding", "model.layers.0", "model.layers.1", "model.norm"}));
  // The tiny Llama literally: C = 16, 4 query heads and 2 key/value heads of 4, F = 40, V = 37 → 128.
  Shapes want = {{"model.embed_tokens.weight", {128, 16}}, {"model.norm.weight", {16}}, {"lm_head.weight", {128, 16}}};
  for (const std::string l : {"0", "1"}) {
    const std::string h = "model.layers." + l + ".";
    want[h + "input_layernorm.weight"] = {16};
    want[h + "self_attn.q_proj.weight"] = {16, 16};
    want[h + "self_attn.k_proj.weight"] = {8, 16};
    want[h + "self_attn.v_proj.weight"] = {8, 16};
    want[h + "self_attn.o_proj.weight"] = {16, 16};
    want[h + "post_attention_layernorm.weight"] = {16};
    want[h + "mlp.gate_proj.weight"] = {40, 16};
    want[h + "mlp.up_proj.weight"] = {40, 16};
    want[h + "mlp.down_proj.weight"] = {16, 40};
  }
  EXPECT_EQ(shapes_of(gpt), want);
  EXPECT_EQ(llama_shapes(c), want);
  // Each in its group: the embedding first, layer l's in group l + 1, lm_head beside the final norm.
  EXPECT_EQ(gpt.find_param("model.embed_tokens.weight").first, &gpt.embedding_group());
  EXPECT_EQ(gpt.find_param("model.layers.1.mlp.down_proj.weight").first, &gpt.block_group(1));
  EXPECT_EQ(gpt.find_param("lm_head.weight").first, &gpt.final_group());
  EXPECT_EQ(gpt.find_param("model.norm.weight").first, &gpt.final_group());
  // Initial values: N(0, 0.02²) weights, 0.02/√(2L) = 0.01 for the two that
  // write into the residual stream, norms at 1; nothing is an HF Conv1D;
  // weights decay and norms do not; the padding rows of both tables are 0.
  for (const ParamGroup& g : gpt.groups())
    for (const ParamInfo& p : g.params()) {
      EXPECT_FALSE(p.hf_conv1d) << p.name;
      EXPECT_EQ(p.weight_decay, p.full_shape.size() == 2) << p.name;
      const bool residual = p.name.find("o_proj") != std::string::npos || p.name.find("down_proj") != std::string::npos;
      if (p.full_shape.size() == 2) {
        EXPECT_EQ(p.init.kind, InitSpec::Normal) << p.name;
        EXPECT_FLOAT_EQ(p.init.value, residual ? 0.01f : 0.02f) << p.name;
      } else {
        EXPECT_EQ(p.init.kind, InitSpec::Constant) << p.name;
        EXPECT_EQ(p.init.value, 1.0f) << p.name;
      }
    }
  for (const char* table : {"model.embed_tokens.weight", "lm_head.weight"}) {
    auto [g, i] = gpt.find_param(table);
    ASSERT_NE(g, nullptr) << table;
    EXPECT_EQ(g->params()[i].real_rows, 37) << table;
    const float* w = g->param(i);
    for (int r = 37; r < 128; r++)
      for (int col = 0; col < 16; col++) ASSERT_EQ(w[r * 16 + col], 0.0f) << table;
    EXPECT_EQ(w[5], init_normal(1, table, 5) * 0.02f) << table;
  }
  auto [n, ni] = gpt.find_param("model.layers.1.post_attention_layernorm.weight");
  ASSERT_NE(n, nullptr);
  for (int col = 0; col < 16; col++) EXPECT_EQ(n->param(ni)[col], 1.0f);
  auto [k, ki] = gpt.find_param("model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->param(ki)[7], init_normal(1, "model.layers.0.self_attn.k_proj.weight", 7) * 0.02f);
}

// The parts' keys change the names and shapes as HF Llama's would, and the
// declared parameters are num_params() plus the vocabulary padding.
TEST(ParamInit, LlamaNamesFollowThePartKeys) {
  set_num_threads(1);  // tiny tensors: threads only add their start-up
  ModelConfig tied = tiny_llama();  // one key/value head, the head tied: no lm_head
  tied.n_kv_head = 1;
  tied.tie_embeddings = true;
  ModelConfig biased = tiny_llama();  // q, k, v, o, gate, up, down biases
  biased.bias = true;
  ModelConfig mixed = as_variant(tiny_config(), Variant::LlamaMixed);  // LayerNorm, GELU, learned positions, biases
  for (const ModelConfig& c : {tiny_llama(), tied, biased, mixed}) {
    Model gpt(c, 1);
    const Shapes got = shapes_of(gpt);
    EXPECT_EQ(got, llama_shapes(c));
    int64_t declared = 0;
    for (const ParamGroup& g : gpt.groups())
      for (const ParamInfo& p : g.params()) declared += p.numel();
    const int tables = c.tie_embeddings ? 1 : 2;
    EXPECT_EQ(declared - tables * (128 - 37) * 16, c.num_params());
    if (c.tie_embeddings) {
      EXPECT_FALSE(got.count("lm_head.weight"));
    }
    for (const auto& entry : got)
      if (!c.bias && entry.first.find("_proj.bias") != std::string::npos)
        ADD_FAILURE() << entry.first << " without model.bias";
  }
  EXPECT_EQ(shapes_of(Model(tied, 1)).at("model.layers.1.self_attn.v_proj.weight"), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(shapes_of(Model(biased, 1)).at("model.layers.0.mlp.gate_proj.bias"), (std::vector<int64_t>{40}));
  EXPECT_EQ(shapes_of(Model(mixed, 1)).at("model.embed_positions.weight"), (std::vector<int64_t>{8, 16}));
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

namespace {

// Rank `rank` of a tensor-parallel group of `size` that exists only in this
// process: enough to build that rank's model, whose constructor declares
// and initialises its slices without communicating. Any collective throws.
class SimulatedRank final : public comm::Communicator {
 public:
  SimulatedRank(int rank, int size) : Communicator("tp", rank, iota(size)) {}

 protected:
  void do_all_reduce(void*, size_t, DType, comm::ReduceOp) override { none("all_reduce"); }
  void do_reduce_scatter_v(const void*, void*, std::span<const size_t>, DType, comm::ReduceOp) override {
    none("reduce_scatter_v");
  }
  void do_reduce_scatter(const void*, void*, size_t, DType, comm::ReduceOp) override { none("reduce_scatter"); }
  void do_all_gather(const void*, void*, size_t, DType) override { none("all_gather"); }
  void do_all_gather_v(const void*, void*, std::span<const size_t>, DType) override { none("all_gather_v"); }
  void do_broadcast(void*, size_t, DType, int) override { none("broadcast"); }
  void do_all_to_all(const void*, void*, size_t, DType) override { none("all_to_all"); }
  void do_all_to_all_v(const void*, std::span<const size_t>, void*, std::span<const size_t>, DType) override {
    none("all_to_all_v");
  }
  void do_barrier() override { none("barrier"); }
  void do_send(const void*, size_t, DType, int, int) override { none("send"); }
  void do_recv(void*, size_t, DType, int, int) override { none("recv"); }
  comm::WorkPtr do_iall_reduce(void*, size_t, DType, comm::ReduceOp) override { none("iall_reduce"); }
  comm::WorkPtr do_ireduce_scatter(const void*, void*, size_t, DType, comm::ReduceOp) override {
    none("ireduce_scatter");
  }
  comm::WorkPtr do_ireduce_scatter_v(const void*, void*, std::span<const size_t>, DType, comm::ReduceOp) override {
    none("ireduce_scatter_v");
  }
  comm::WorkPtr do_iall_gather(const void*, void*, size_t, DType) override { none("iall_gather"); }
  comm::WorkPtr do_iall_gather_v(const void*, void*, std::span<const size_t>, DType) override {
    none("iall_gather_v");
  }
  comm::WorkPtr do_batch_isend_irecv(std::span<const comm::P2POp>) override { none("batch_isend_irecv"); }
  std::unique_ptr<comm::Communicator> do_split(int, int, const std::string&) override { none("split"); }

 private:
  static std::vector<int> iota(int n) {
    std::vector<int> v(n);
    std::iota(v.begin(), v.end(), 0);
    return v;
  }
  [[noreturn]] static void none(const char* op) {
    throw Error(std::string("a simulated tensor-parallel rank cannot ") + op);
  }
};

// The rows and columns of the full tensor a rank holds, worked out by hand.
struct Block {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int replicas = 1;
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

// A Llama's slices under tensor parallelism, on each simulated rank: q_proj,
// gate_proj and up_proj by output rows (q by whole query heads), o_proj and
// down_proj by input columns, the vocabulary tables by rows of the padded
// vocabulary, norms and row-parallel biases whole; k_proj and v_proj by
// whole key/value heads, split when t divides n_kv_head and, when t is a
// multiple of it, each head whole on the t / n_kv_head ranks of its query
// heads (ShardSpec::replicas). Each slice holds the full tensor's values
// there (the padding rows zero), counts in the gradient norm on one rank of
// its replicas, and the ranks' slices assemble into the full tensor.
TEST(ParamInit, LlamaShardedSlicesMatchTheFullTensor) {
  set_num_threads(1);  // tiny tensors: threads only add their start-up
  for (bool variant : {false, true})
    for (int kv : {4, 2, 1})
      for (int t : {2, 4}) {
        ModelConfig c = ModelConfig::defaults(Family::Llama);
        c.n_layer = 2;
        c.n_head = 4;
        c.n_kv_head = kv;
        c.n_embd = 32;
        c.vocab_size = 37;
        c.seq_len = 8;
        c.ffn_hidden = 48;
        c.bias = c.tie_embeddings = variant;  // biases (k, v ones replicated too), and a tied head
        const std::string what = "n_kv_head=" + std::to_string(kv) + " tp=" + std::to_string(t) +
                                 (variant ? " bias, tied" : " untied");
        const int64_t hs = 8, Vp = (37 + 128 * t - 1) / (128 * t) * (128 * t);
        Model full(c, 42);
        std::vector<std::unique_ptr<SimulatedRank>> comms;
        std::vector<std::unique_ptr<tensor::TensorParallel>> tps;
        std::vector<std::unique_ptr<Model>> parts;
        for (int r = 0; r < t; r++) {
          comms.push_back(std::make_unique<SimulatedRank>(r, t));
          tps.push_back(std::make_unique<tensor::TensorParallel>(*comms.back(), false));
          parts.push_back(std::make_unique<Model>(c, 42, tps.back().get()));
          ASSERT_EQ(parts.back()->tp_size(), t);
          ASSERT_EQ(parts.back()->tp_rank(), r);
        }
        int checked = 0;
        for (size_t gi = 0; gi < full.groups().size(); gi++) {
          for (size_t pi = 0; pi < full.groups()[gi].params().size(); pi++) {
            const ParamInfo& fp = full.groups()[gi].params()[pi];
            const std::string& name = fp.name;
            const bool table = name == "model.embed_tokens.weight" || name == "lm_head.weight";
            // The full tensor at this t: the vocabulary tables padded to Vp rows.
            std::vector<int64_t> shape = fp.full_shape;
            if (table) shape[0] = Vp;
            const int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
            std::vector<float> whole(rows * cols, 0.0f);
            const int64_t have = table ? 37 * cols : rows * cols;
            std::memcpy(whole.data(), full.groups()[gi].param(pi), sizeof(float) * have);
            std::vector<const float*> slices;
            for (int r = 0; r < t; r++) {
              SCOPED_TRACE(what + " rank " + std::to_string(r) + " " + name);
              Model& part = *parts[r];
              auto [g, i] = part.find_param(name);
              ASSERT_NE(g, nullptr);
              const ParamInfo& p = g->params()[i];
              ASSERT_EQ(p.full_shape, shape);
              Block b{0, rows, 0, cols, 1};
              auto split_rows = [&](int64_t n) { b.rows = n / t, b.row0 = r * (n / t); };
              if (table) {
                split_rows(Vp);
              } else if (name.find("q_proj") != std::string::npos || name.find("gate_proj") != std::string::npos ||
                         name.find("up_proj") != std::string::npos) {
                split_rows(rows);
              } else if (name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos) {
                if (kv >= t) {
                  split_rows(kv * hs);
                } else {
                  b.replicas = t / kv;
                  b.rows = hs, b.row0 = (r / b.replicas) * hs;  // key/value head r / replicas, whole
                }
              } else if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) {
                b.cols = cols / t, b.col0 = r * (cols / t);
              }
              EXPECT_EQ(p.shard.replicas, b.replicas);
              const std::vector<int64_t> local =
                  shape.size() == 2 ? std::vector<int64_t>{b.rows, b.cols} : std::vector<int64_t>{b.rows};
              ASSERT_EQ(p.shape, local);
              const float* slice = g->param(i);
              for (int64_t row = 0; row < b.rows; row++)
                for (int64_t col = 0; col < b.cols; col++)
                  ASSERT_EQ(slice[row * b.cols + col], whole[(b.row0 + row) * cols + b.col0 + col])
                      << "row " << row << " col " << col;
              // Once in the gradient norm: whole tensors on rank 0, a replicated slice on the first of its ranks.
              const bool whole_tensor = b.rows == rows && b.cols == cols && b.replicas == 1;
              const size_t group_index = static_cast<size_t>(g - part.groups().data());
              EXPECT_EQ(part.counts_in_norm(group_index, p), whole_tensor ? r == 0 : r % b.replicas == 0);
              std::vector<float> extracted(p.numel());
              model::extract_slice(p, whole.data(), extracted.data());
              EXPECT_EQ(0, std::memcmp(extracted.data(), slice, sizeof(float) * p.numel())) << "extract_slice";
              slices.push_back(slice);
              checked++;
            }
            if (slices.size() != static_cast<size_t>(t)) continue;
            std::vector<float> assembled(rows * cols, -1.0f);
            auto [g0, i0] = parts[0]->find_param(name);
            model::assemble_full(g0->params()[i0], slices, assembled.data());
            EXPECT_EQ(assembled, whole) << what << " assemble_full " << name;
          }
        }
        // Every parameter of the full model, on every rank, and nothing else.
        EXPECT_EQ(checked, t * static_cast<int>(shapes_of(full).size())) << what;
        for (auto& part : parts) EXPECT_EQ(shapes_of(*part).size(), shapes_of(full).size()) << what;
      }
}

static std::vector<std::vector<float>> grads_of(Model& gpt) {
  std::vector<std::vector<float>> out;
  for (ParamGroup& g : gpt.groups()) out.emplace_back(g.grad(), g.grad() + g.numel());
  return out;
}

// Parameter tensors of a whole model, counted from its config by hand: the
// token table (and the position table), per block two norms, the attention's
// linears (GPT-2's c_attn and c_proj, Llama's q, k, v, o) and the MLP's
// (c_fc, c_proj; gate, up, down), each with its bias under model.bias; the
// final norm, and lm_head when untied.
static int tensor_count(const ModelConfig& c) {
  const int norm = c.norm == NormKind::LayerNorm ? 2 : 1;
  const int linears = (c.family == Family::GPT2 ? 2 : 4) + (c.mlp == MlpKind::SwiGLU ? 3 : 2);
  const int block = 2 * norm + linears * (c.bias ? 2 : 1);
  return 1 + (c.learned_positions() ? 1 : 0) + c.n_layer * block + norm + (c.tie_embeddings ? 0 : 1);
}

namespace {

// The tests of the model's math and mechanics, on each variant of
// model_variants.h (in CTest GPT.SameSeedIsBitIdentical/llama_gqa; in gtest .../1).
class VariantTest : public ::testing::TestWithParam<Variant> {
 protected:
  // `shape` (tiny_config() and the test's changes) as this instance's variant.
  static ModelConfig variant_of(const ModelConfig& shape) { return as_variant(shape, GetParam()); }
  static bool gpt2() { return GetParam() == Variant::GPT2; }
};
class GPT : public VariantTest {};
class MixedPrecision : public VariantTest {};

INSTANTIATE_TEST_SUITE_P(, GPT, lattice::model::testing::kAllVariants);
INSTANTIATE_TEST_SUITE_P(, MixedPrecision, lattice::model::testing::kAllVariants);

// Every parameter tensor's gradient, checked along a random direction against
// a central finite difference of the loss. The step is 1e-2, or 1e-3 for a
// model without a position table: its first norm then reads the token
// table's rows alone (about 0.02 in size), whose loss is so curved there
// (a norm is scale-invariant: curvature ~ 1/rms(x)²) that a step of 1e-2
// leaves the central difference 27% off the derivative (it converges to
// the analytic value as the step shrinks: 0.516, 0.420, 0.407, 0.405 at
// 1e-2, 3e-3, 1e-3, 3e-4 against 0.405 for llama_gqa's token table).
TEST_P(GPT, GradientMatchesFiniteDifferences) {
  set_num_threads(1);
  ModelConfig c = variant_of(tiny_config());
  Model gpt(c, 7);
  // Non-trivial norm parameters and biases so that every path matters.
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
      const float eps = c.learned_positions() ? 1e-2f : 1e-3f;
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
  if (gpt2()) {
    EXPECT_EQ(checked, 2 + 2 * 12 + 2);
  }
  EXPECT_EQ(checked, tensor_count(c));
}

// backward_input + backward_weight (split, as zero-bubble schedules use it)
// gives exactly the gradients of the fused backward, over several micro-batches
// in flight at once.
TEST_P(GPT, SplitBackwardEqualsFusedBitwise) {
  ModelConfig c = variant_of(tiny_config());
  const int B = 2, T = 8;
  auto in0 = random_tokens(B * T, c.vocab_size, 11), tg0 = random_tokens(B * T, c.vocab_size, 12);
  auto in1 = random_tokens(B * T, c.vocab_size, 13), tg1 = random_tokens(B * T, c.vocab_size, 14);
  Model fused(c, 5), split(c, 5);
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

TEST_P(GPT, SlotMisuseIsAnError) {
  const ModelConfig c = variant_of(tiny_config());
  Model gpt(c, 1);
  std::vector<int32_t> t(16, 1);
  EXPECT_THROW(gpt.backward(0), Error);
  gpt.forward(0, t.data(), t.data(), 2, 8, 1.0f);
  EXPECT_THROW(gpt.forward(0, t.data(), t.data(), 2, 8, 1.0f), Error);
  EXPECT_THROW(gpt.backward_weight(0), Error);
  gpt.backward(0);
  std::vector<int32_t> bad(16, c.vocab_size);  // 37
  EXPECT_THROW(gpt.forward(0, bad.data(), t.data(), 2, 8, 1.0f), Error);
}

// Trains `steps` AdamW steps on a fixed batch; returns the losses.
std::vector<float> train_losses(Model& gpt, const std::vector<int32_t>& in, const std::vector<int32_t>& tg, int B,
                                int T, int steps, float lr) {
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

TEST_P(GPT, SameSeedIsBitIdentical) {
  ModelConfig c = variant_of(tiny_config());
  auto in = random_tokens(16, c.vocab_size, 1), tg = random_tokens(16, c.vocab_size, 2);
  Model a(c, 9), b(c, 9);
  auto la = train_losses(a, in, tg, 2, 8, 5, 1e-2f);
  auto lb = train_losses(b, in, tg, 2, 8, 5, 1e-2f);
  for (size_t i = 0; i < la.size(); i++) EXPECT_EQ(la[i], lb[i]);
  Model other(c, 10);
  EXPECT_NE(other.evaluate(in.data(), tg.data(), 2, 8), a.evaluate(in.data(), tg.data(), 2, 8));
}

// Thread count changes only the reassociation of sums (GEMM blocking and the
// OpenMP reductions); losses agree to fp32 rounding.
TEST_P(GPT, ThreadCountChangesOnlyRounding) {
  ModelConfig shape = tiny_config();
  shape.n_embd = 64;
  shape.n_head = 4;
  shape.seq_len = 32;
  const ModelConfig c = variant_of(shape);
  auto in = random_tokens(4 * 32, c.vocab_size, 1), tg = random_tokens(4 * 32, c.vocab_size, 2);
  set_num_threads(1);
  Model a(c, 9);
  auto la = train_losses(a, in, tg, 4, 32, 5, 1e-3f);
  set_num_threads(2);
  Model b(c, 9);
  auto lb = train_losses(b, in, tg, 4, 32, 5, 1e-3f);
  for (size_t i = 0; i < la.size(); i++) EXPECT_NEAR(la[i], lb[i], 1e-5 * std::fabs(la[i])) << i;
  set_num_threads(1);
}

// Padded vocabulary rows never win, never get gradient and stay zero: the
// token embedding's and, when the head is untied, lm_head's. Their logits
// are 0 and take no part in the softmax.
TEST_P(GPT, PaddedVocabularyStaysInert) {
  ModelConfig c = variant_of(tiny_config());
  const int V = c.vocab_size, Vp = c.padded_vocab(), C = c.n_embd;  // 37, 128, 16
  Model gpt(c, 3);
  auto in = random_tokens(16, V, 1), tg = random_tokens(16, V, 2);
  train_losses(gpt, in, tg, 2, 8, 3, 1e-2f);
  std::vector<const float*> tables = {gpt.embedding_group().param(0)};
  if (!c.tie_embeddings) {
    auto [g, i] = gpt.find_param("lm_head.weight");
    ASSERT_NE(g, nullptr);
    ASSERT_EQ(g, &gpt.final_group());
    tables.push_back(g->param(i));
  }
  for (const float* w : tables)
    for (int r = V; r < Vp; r++)
      for (int col = 0; col < C; col++) ASSERT_EQ(w[r * C + col], 0.0f) << "row " << r;
  const float* logits = gpt.last_logits(in.data(), 2, 8);
  for (int b = 0; b < 2; b++) {
    int best = 0;
    for (int v = 1; v < V; v++)
      if (logits[b * Vp + v] > logits[b * Vp + best]) best = v;
    EXPECT_LT(best, V);
    for (int v = V; v < Vp; v++) ASSERT_EQ(logits[b * Vp + v], 0.0f) << "padding logit " << v;
  }
  // The loss is the cross-entropy over the V real logits alone: 16 one-token
  // sequences, against their logits by hand (with the 91 padding logits in
  // the softmax it would be larger by about ln(128/37)).
  const int n = 16;
  const auto one = random_tokens(n, V, 3), next = random_tokens(n, V, 4);
  const float loss = gpt.evaluate(one.data(), next.data(), n, 1);
  const float* l = gpt.last_logits(one.data(), n, 1);
  double want = 0;
  for (int b = 0; b < n; b++) {
    double max = l[b * Vp];
    for (int v = 1; v < V; v++) max = std::max(max, static_cast<double>(l[b * Vp + v]));
    double sum = 0;
    for (int v = 0; v < V; v++) sum += std::exp(l[b * Vp + v] - max);
    want += std::log(sum) + max - l[b * Vp + next[b]];
  }
  want /= n;
  EXPECT_NEAR(loss, want, 1e-5 * want);
}

// A learnable task: every sequence counts up from a random start with a random
// stride (mod V). After two tokens the rest is determined, so the loss must
// fall to near the (1/T)-weighted cost of the first, unpredictable tokens.
TEST_P(GPT, LearnsArithmeticSequences) {
  ModelConfig shape = tiny_config();
  shape.n_embd = 32;
  shape.n_head = 4;
  shape.seq_len = 16;
  shape.vocab_size = 16;
  const ModelConfig c = variant_of(shape);
  Model gpt(c, 1);
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
TEST_P(GPT, EvaluationReusesTheIdleTrainingSlot) {
  ModelConfig c = variant_of(tiny_config());
  Model gpt(c, 2);
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
  Model fresh(c, 2);
  fresh.forward(0, in.data(), tg.data(), 2, 8, 1.0f);
  fresh.backward(0);
  fresh.zero_grad();
  EXPECT_EQ(fresh.forward(0, in.data(), tg.data(), 2, 8, 1.0f), loss);
  fresh.backward(0);
  auto want = grads_of(fresh);
  for (size_t g = 0; g < want.size(); g++)
    ASSERT_EQ(0, std::memcmp(want[g].data(), grads_after_eval[g].data(), want[g].size() * 4)) << g;
}

// zero_grad() marks gradients stale instead of clearing them; a backward must
// then overwrite every gradient (here: garbage NaN left in the buffers) and a
// second micro-batch must accumulate. Reading before any write is an error.
TEST_P(GPT, ZeroGradOverwritesOnFirstWriteThenAccumulates) {
  ModelConfig c = variant_of(tiny_config());
  auto in = random_tokens(16, c.vocab_size, 3), tg = random_tokens(16, c.vocab_size, 4);
  auto in2 = random_tokens(16, c.vocab_size, 5), tg2 = random_tokens(16, c.vocab_size, 6);
  Model gpt(c, 2);
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
  Model ref(c, 2);
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

// The cached logits `got` (copied out) against last_logits() of the T tokens
// ending at context + end.
void expect_logits_of(Model& gpt, const std::vector<float>& got, const int32_t* context, int64_t end, int T,
                      const std::string& what) {
  const float* want = gpt.last_logits(context + end - T, 1, T);
  for (int v = 0; v < gpt.config().vocab_size; v++)
    ASSERT_NEAR(got[v], want[v], 1e-5f + 1e-5f * std::fabs(want[v])) << what << " end=" << end << " v=" << v;
}

// decode() with its key/value cache gives last_logits() of the whole sequence,
// whether the prompt goes in at once or token by token, and refuses to run
// past seq_len.
TEST_P(GPT, DecodeMatchesFullForward) {
  ModelConfig shape = tiny_config();
  shape.seq_len = 12;
  const ModelConfig c = variant_of(shape);
  Model gpt(c, 5);
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

// next_logits() over a context longer than seq_len: the model sees the most
// recent seq_len tokens, through the cache while it fits and recomputed once
// the window slides; a context that is not an extension starts over. Either
// way the logits are last_logits() of the window, whose first token is at
// position 0: when the window slides, positions (learned or rotary) start
// again at 0.
TEST_P(GPT, NextLogitsSlidesTheWindow) {
  const ModelConfig c = variant_of(tiny_config());  // seq_len 8
  Model gpt(c, 6);
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

}  // namespace

// ---- grouped-query attention's key/value cache ----

// decode() caches n_kv_head·hs floats of keys and as many of values per layer
// and position — a cache n_head/n_kv_head times smaller than multi-head
// attention's — and gives last_logits() at every position, with n_kv_head =
// n_head, n_head/2 and 1.
TEST(LlamaDecode, CacheHoldsKeyValueHeadsPerPosition) {
  set_num_threads(1);  // tiny tensors: threads only add their start-up
  const int kv_heads[] = {4, 2, 1};
  const int64_t L = 2, T = 12, hs = 4;
  std::vector<int64_t> bytes;
  auto& mem = MemoryTracker::instance();
  for (int kv : kv_heads) {
    ModelConfig c = tiny_llama();
    c.n_kv_head = kv;
    c.seq_len = static_cast<int>(T);
    Model gpt(c, 5);
    const auto seq = random_tokens(static_cast<int>(T), c.vocab_size, 8);
    const int Vp = c.padded_vocab();
    const std::string what = "n_kv_head=" + std::to_string(kv);
    gpt.decode_reset();
    const size_t before = mem.current(MemCategory::Activations);
    const float* l = gpt.decode(seq.data(), 3);  // the first decode() makes the cache
    bytes.push_back(static_cast<int64_t>(mem.current(MemCategory::Activations) - before));
    expect_logits_of(gpt, std::vector<float>(l, l + Vp), seq.data(), 3, 3, what + " prompt");
    for (int t = 3; t < T; t++) {
      l = gpt.decode(&seq[t], 1);
      expect_logits_of(gpt, std::vector<float>(l, l + Vp), seq.data(), t + 1, t + 1, what);
    }
  }
  // Against multi-head attention, the cache of n_kv_head heads is smaller by
  // 2·L·T·(n_head - n_kv_head)·hs floats; the one chunk of working rows
  // decode() keeps besides (a layer's q|k|v among them) by at most
  // 2·T·(n_head - n_kv_head)·hs more.
  for (int i = 1; i < 3; i++) {
    const int64_t fewer = kv_heads[0] - kv_heads[i];
    const int64_t cache = 4 * 2 * L * T * fewer * hs, qkv = 4 * 2 * T * fewer * hs;
    EXPECT_GE(bytes[0] - bytes[i], cache) << "n_kv_head=" << kv_heads[i];
    EXPECT_LE(bytes[0] - bytes[i], cache + qkv) << "n_kv_head=" << kv_heads[i];
  }
}

// ---- mixed precision (precision.compute = bf16 | f16) ----

namespace {

// A model whose head runs in several chunks (kHeadRows = 128 rows at a time:
// B·T = 256 here) with its dlogits recomputed in the backward.
ModelConfig mp_shape() {
  ModelConfig c = tiny_config();
  c.seq_len = 64;
  c.vocab_size = 301;
  return c;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
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
TEST_P(MixedPrecision, LossAndGradientsTrackF32) {
  const ModelConfig c = variant_of(mp_shape());
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 21), tg = random_tokens(B * T, c.vocab_size, 22);
  Model ref(c, 3);
  const float want = ref.forward(0, in.data(), tg.data(), B, T, 1.0f);
  ref.backward(0);
  const auto want_g = grads_of(ref);
  for (DType t : {DType::BF16, DType::F16}) {
    Model m(c, 3);
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
TEST_P(MixedPrecision, SplitBackwardEqualsFusedBitwise) {
  const ModelConfig c = variant_of(mp_shape());
  const int B = 4, T = 64;
  auto in0 = random_tokens(B * T, c.vocab_size, 31), tg0 = random_tokens(B * T, c.vocab_size, 32);
  auto in1 = random_tokens(B * T, c.vocab_size, 33), tg1 = random_tokens(B * T, c.vocab_size, 34);
  for (DType t : {DType::BF16, DType::F16}) {
    Model fused(c, 5), split(c, 5);
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
TEST_P(MixedPrecision, HeadChunksAreRowIndependent) {
  const ModelConfig c = variant_of(mp_shape());
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 41), tg = random_tokens(B * T, c.vocab_size, 42);
  Model whole(c, 7), parts(c, 7);
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
// the f32 work arrays are one layer's worth: the same at any depth, and no
// more than a one-layer model's f32 slot keeps (one layer, the residual
// stream, the final norm, and one chunk of the head's logits where that
// keeps them all). GPT-2's are also below 1.5 times a layer's share of its
// f32 slot; that depends on the widths (llama_mixed's MLP of 2.5C instead
// of 4C makes its layers smaller next to the same residual and head arrays).
TEST_P(MixedPrecision, StoredActivationsTakeHalfTheBytes) {
  ModelConfig shape = mp_shape();
  shape.n_layer = 6;
  const ModelConfig c = variant_of(shape);
  const int B = 4, T = 64;
  Model f32(c, 1), bf16(c, 1);
  bf16.set_compute_dtype(DType::BF16);
  const double ratio = static_cast<double>(bf16.stored_activation_bytes(B, T)) / f32.stored_activation_bytes(B, T);
  EXPECT_LE(ratio, 0.5) << "stored activations at bf16 vs f32";
  EXPECT_GE(ratio, 0.3);
  EXPECT_EQ(f32.work16_bytes(B, T), 0u);
  if (gpt2()) {
    EXPECT_LT(bf16.work16_bytes(B, T), f32.stored_activation_bytes(B, T) / c.n_layer * 1.5);
  }
  shape.n_layer = 1;
  Model f32_one(variant_of(shape), 1), bf16_one(variant_of(shape), 1);
  bf16_one.set_compute_dtype(DType::BF16);
  EXPECT_EQ(bf16_one.work16_bytes(B, T), bf16.work16_bytes(B, T));
  EXPECT_LE(bf16.work16_bytes(B, T), f32_one.stored_activation_bytes(B, T));
}

// The compute copies follow the master weights once told they changed (the
// optimizer's step says so; zero_grad does too), and only then.
TEST_P(MixedPrecision, ComputeCopiesFollowTheMasters) {
  const ModelConfig c = variant_of(mp_shape());
  const int B = 1, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 51), tg = random_tokens(B * T, c.vocab_size, 52);
  Model a(c, 9), b(c, 10);
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
TEST_P(MixedPrecision, AnotherSizeInBetweenChangesNothing) {
  const ModelConfig c = variant_of(mp_shape());
  const int B = 4, T = 64;
  auto in = random_tokens(B * T, c.vocab_size, 61), tg = random_tokens(B * T, c.vocab_size, 62);
  Model a(c, 11), b(c, 11);
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
