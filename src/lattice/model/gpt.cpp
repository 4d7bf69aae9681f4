#include "lattice/model/gpt.h"

#include <algorithm>

#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/layers/tensor/vocab_parallel.h"

namespace lattice::model {

namespace k = lattice::kernels;
using Pass = GroupHooks::Pass;

// Parameter order inside a block group.
enum BlockParam : size_t {
  kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB
};
enum EmbedParam : size_t { kWte, kWpe };
enum FinalParam : size_t { kLnfW, kLnfB };

// What one layer's forward keeps for backward. Under tensor parallelism the
// sizes are this rank's (GPT::Dims): qkv [N, 3A], atty [N, A], fch [N, F];
// with sequence parallelism x, ln1, res1, ln2 and their statistics hold
// rows(N) rows (this rank's slice) and the rest all N.
// The arrays of element type T (float, or uint16_t for 16-bit storage) ...
template <typename T>
struct LayerArrays {
  T* ln1;       // LN₁(x_l)
  T* qkv;       // [N, 3C]
  T* atty;      // attention output before c_proj [N, C]
  T* res1;      // r_l = x_l + Attn(...)
  T* ln2;       // LN₂(r_l)
  T* fch;       // c_fc output [N, 4C]
  T* fch_gelu;  // GELU(fch)
};
// ... and their statistics, always f32.
struct LayerActs : LayerArrays<float> {
  float *ln1_mean, *ln1_rstd;  // of LN₁
  float* lse;                  // [B, NH, T] log-sum-exp of the scores
  float *ln2_mean, *ln2_rstd;  // of LN₂
};

// Gradients that backward_input produces and backward_weight consumes. Every
// [N, C] one is full-sized; under sequence parallelism dln1/dln2 hold this
// rank's rows of the reduced gradient in their first rows(N) rows (the
// reduce-scatter's place), and dres1 and dx hold their slice at first_row(N)
// (the all-gather's place, so gathering is in place).
struct LayerGrads {
  float* dfch;   // dL/d fch [N, F]      (c_fc weight gradient)
  float* dln2;   // dL/d LN₂ output      (ln_2 weight gradient)
  float* dres1;  // dL/d r_l             (attn c_proj weight gradient; whole once gathered)
  float* dqkv;   // dL/d qkv [N, 3A]     (c_attn weight gradient)
  float* dln1;   // dL/d LN₁ output      (ln_1 weight gradient)
};

// The 16-bit copies of a LayerActs' arrays (precision.compute = bf16 | f16):
// what a slot keeps of a layer between its forward and its backward. The
// statistics (LayerNorm mean/rstd, attention lse) stay f32, in LayerActs.
using PackedLayer = LayerArrays<uint16_t>;

// The f32 arrays one layer computes in when activations are stored in 16
// bits: the layer's forward runs here and is stored rounded; its backward
// loads it back here. One per model, shared by the slots (one layer
// computes at a time); `holds` says which slot's layer is loaded.
struct Work16 {
  Buffer mem;
  int64_t carved_tokens = 0;  // the micro-batch size the arrays are carved for
  LayerActs layer{};         // the f32 arrays (statistics: the slot's)
  float* x[2] = {nullptr, nullptr};  // the residual stream in and out of a layer [R, C]
  float* lnf = nullptr;      // [N, C]
  float* logits = nullptr;   // [head_rows, Vw]
  float* losses = nullptr;   // [head_rows]: the recomputation's (discarded)
  int64_t head_rows = 0;     // rows of logits computed at a time
  const Slot* holds = nullptr;
  int holds_layer = -1;
  const Slot* holds_x = nullptr;
  int holds_x_index = -1;
  const Slot* holds_lnf = nullptr;  // whose LN_f output `lnf` holds (loaded by lnf_of)
  void forget() { holds = nullptr, holds_layer = -1, holds_x = nullptr, holds_x_index = -1, holds_lnf = nullptr; }
};

struct Slot {
  int B = 0, T = 0;
  int64_t capacity_tokens = 0;
  bool split_capacity = false;  // grads sized for every layer (split backward)
  Buffer act_mem, grad_mem, token_mem;
  // Activations.
  std::vector<float*> x;  // x_0 .. x_L, the residual stream [N, C]
  std::vector<LayerActs> layers;
  float *lnf, *lnf_mean, *lnf_rstd;
  float* logits;  // [N, Vw] (this rank's vocabulary rows); after forward(): dlogits
  float* losses;  // [N]
  float* work;    // [N, C] sequence parallelism: a gathered input or a partial output
  int32_t* inputs;
  int32_t* rows;  // inputs as rows of this rank's wte (-1: another rank's)
  int32_t* targets;  // 16-bit storage without logits: the targets, for the head's recomputation
  float dloss = 0;   // and the loss gradient's factor
  // Gradients.
  std::vector<float*> dx;  // dL/dx_0 .. dL/dx_L (split) or two ping-pong buffers (fused)
  std::vector<LayerGrads> dlayers;
  float *dlnf, *scratch4c, *scratch_c, *ln_scratch;
  // 16-bit storage: x, the layers' arrays, lnf and dlogits live here instead
  // (s.x, s.lnf and s.logits are then null; s.layers keep the statistics).
  DType store = DType::F32;
  bool keep_logits = true;  // 16-bit: dlogits stored (false: the head's backward recomputes them)
  std::vector<uint16_t*> x16;
  std::vector<PackedLayer> packed;
  uint16_t *lnf16 = nullptr, *logits16 = nullptr;
  float* out32 = nullptr;  // not the last stage: the output activation in f32 [R, C]
  // Pipeline stages: the output's gradient given before the backward (not the
  // last stage), and whether the input's gradient is ready (not the first).
  const float* output_grad = nullptr;  // set_stage_output_grad's, until the backward reads it
  bool input_grad_ready = false;
  // State.
  bool has_forward = false, has_backward_input = false, split = false;
};

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index);
static float* dx_of(Slot& s, int i);

// bf16 compute: the GEMMs of a pass multiply bf16 operands on the bf16 path
// chosen by measurement (kernels::Bf16GemmScope); f16 and f32 multiply f32.
struct GemmPrecision {
  std::optional<k::Bf16GemmScope> scope;
  explicit GemmPrecision(DType compute) {
    if (compute == DType::BF16) scope.emplace();
  }
};

// Carves a buffer into consecutive arrays, each 64-byte aligned. With a null
// base it only counts: used() is then the bytes the arrays need.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)), p_(base_) {}
  template <typename T = float>
  T* take(int64_t n) {
    T* r = reinterpret_cast<T*>(p_);
    p_ += (static_cast<int64_t>(sizeof(T)) * n + 63) / 64 * 64;
    return r;
  }
  uint16_t* take16(int64_t n) { return take<uint16_t>(n); }
  int64_t used() const { return p_ - base_; }

 private:
  char* base_;
  char* p_;
};

// The sizes the carvers work with: this rank's (GPT::Dims), N rows in all
// and R of them kept between the parallel regions (N/t under sequence parallelism).
// L: the stage's layers; head: it runs the final LayerNorm, head and loss.
struct CarveSizes {
  int64_t C, NH, A, F, V, L, N, R;
  bool sp, head;
  DType store = DType::F32;  // of the activations kept (statistics stay f32)
  bool keep_logits = true;   // 16-bit storage: dlogits kept (else recomputed in the backward)
};

// fn(field, elements) for each of a layer's arrays, in carving order;
// field(arrays) is that array's pointer in any LayerArrays<T>.
template <typename Fn>
static void for_each_array(const CarveSizes& z, Fn fn) {
  const int64_t RC = z.R * z.C;
  fn([](auto& a) -> auto& { return a.ln1; }, RC);
  fn([](auto& a) -> auto& { return a.qkv; }, z.N * 3 * z.A);
  fn([](auto& a) -> auto& { return a.atty; }, z.N * z.A);
  fn([](auto& a) -> auto& { return a.res1; }, RC);
  fn([](auto& a) -> auto& { return a.ln2; }, RC);
  fn([](auto& a) -> auto& { return a.fch; }, z.N * z.F);
  fn([](auto& a) -> auto& { return a.fch_gelu; }, z.N * z.F);
}

// A layer's statistics (f32 whatever the storage).
static void carve_stats(Carver& cv, const CarveSizes& z, LayerActs* a) {
  a->ln1_mean = cv.take(z.R);
  a->ln1_rstd = cv.take(z.R);
  a->lse = cv.take(z.N * z.NH);
  a->ln2_mean = cv.take(z.R);
  a->ln2_rstd = cv.take(z.R);
}

// A slot's activations with the arrays in element type T: float (f32
// storage, s->x, s->layers, s->lnf, s->logits) or uint16_t (16-bit storage,
// s->x16, s->packed, s->lnf16, s->logits16 — dlogits only where the head
// keeps them — and s->out32); statistics, losses and SP's work buffer f32.
// Returns the bytes (nothing is written when s is null).
template <typename T>
static int64_t carve_slot(Slot* s, void* base, const CarveSizes& z) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t C = z.C, N = z.N, R = z.R, L = z.L;
  Carver cv(base);
  std::vector<T*> x(L + 1);
  for (T*& p : x) p = cv.take<T>(R * C);
  std::vector<LayerActs> layers(L);
  std::vector<LayerArrays<T>> arrays(L);
  for (int64_t l = 0; l < L; l++) {
    for_each_array(z, [&](auto field, int64_t n) { field(arrays[l]) = cv.take<T>(n); });
    carve_stats(cv, z, &layers[l]);
    if constexpr (f32) static_cast<LayerArrays<float>&>(layers[l]) = arrays[l];
  }
  const int64_t head = z.head ? 1 : 0;
  T* lnf = cv.take<T>(head * N * C);  // whole: the head reads every row (gathered under SP)
  float* lnf_mean = cv.take(head * R);
  float* lnf_rstd = cv.take(head * R);
  T* logits = cv.take<T>((f32 || z.keep_logits ? head : 0) * N * z.V);
  float* losses = cv.take(head * N);
  float* work = z.sp ? cv.take(N * C) : nullptr;
  float* out32 = f32 ? nullptr : cv.take((1 - head) * R * C);
  if (!s) return cv.used();
  s->layers = std::move(layers);
  s->lnf_mean = lnf_mean, s->lnf_rstd = lnf_rstd, s->losses = losses, s->work = work;
  s->store = z.store;
  if constexpr (f32) {
    s->x = std::move(x), s->lnf = lnf, s->logits = logits;
    s->x16.clear(), s->packed.clear(), s->lnf16 = s->logits16 = nullptr, s->out32 = nullptr;
    s->keep_logits = true;
  } else {
    s->x.assign(L + 1, nullptr), s->lnf = s->logits = nullptr;
    s->x16 = std::move(x), s->packed = std::move(arrays), s->lnf16 = lnf, s->logits16 = logits;
    s->out32 = z.head ? nullptr : out32;
    s->keep_logits = z.keep_logits;
  }
  return cv.used();
}

// Bytes of a slot's activations (carved into s when it is not null).
static int64_t carve_activations(Slot* s, void* base, const CarveSizes& z) {
  return z.store == DType::F32 ? carve_slot<float>(s, base, z) : carve_slot<uint16_t>(s, base, z);
}

// The head at 16-bit storage. Where its operations are local (no tensor
// parallelism, the model's own embedding: not ZeRO-2/3's), the f32 logits
// never exist whole (206 MB at GPT-2's vocabulary and 1024 tokens) and
// dlogits are not kept at all: the forward computes the logits and the loss
// kHeadRows rows at a time, and the backward recomputes each chunk's
// dlogits from the stored LN_f output and the targets (one more head GEMM,
// as activation recomputation trades FLOPs for memory: ~9% of GPT-2 124M's
// step at T=256). Under tensor parallelism or with a custom embedding,
// whose head operations communicate on every call, all rows at once, and
// dlogits are stored in 16 bits. Either way the backward reads the same
// values: dlogits rounded to the compute dtype.
constexpr int64_t kHeadRows = 128;

// The f32 working arrays of the 16-bit path for N rows (sizes only when w is null).
static int64_t carve_work16(Work16* w, void* base, const CarveSizes& z, int64_t head_rows) {
  const int64_t C = z.C, N = z.N, R = z.R;
  Carver cv(base);
  LayerActs a{};
  for_each_array(z, [&](auto field, int64_t n) { field(a) = cv.take(n); });
  float* x0 = cv.take(R * C);
  float* x1 = cv.take(R * C);
  const int64_t head = z.head ? 1 : 0;
  float* lnf = cv.take(head * N * C);
  float* logits = cv.take(head * head_rows * z.V);
  float* losses = cv.take(head * head_rows);
  if (w) {
    w->layer = a, w->x[0] = x0, w->x[1] = x1, w->lnf = lnf, w->logits = logits, w->losses = losses;
    w->head_rows = head_rows;
  }
  return cv.used();
}

static int64_t carve_grads(Slot* s, void* base, const CarveSizes& z, bool split) {
  const int64_t C = z.C, N = z.N, L = z.L;
  Carver cv(base);
  const int64_t n_dx = split ? L + 1 : 2;
  const int64_t n_layers = split ? L : 1;
  std::vector<float*> dx(n_dx);
  for (auto& p : dx) p = cv.take(N * C);
  std::vector<LayerGrads> dl(n_layers);
  for (auto& g : dl) {
    g.dfch = cv.take(N * z.F);
    g.dln2 = cv.take(N * C);
    g.dres1 = cv.take(N * C);
    g.dqkv = cv.take(N * 3 * z.A);
    g.dln1 = cv.take(N * C);
  }
  float* dlnf = cv.take((z.head ? 1 : 0) * N * C);
  float* s4 = cv.take(N * z.F);
  float* sc = cv.take(N * z.A);
  float* ln = z.sp ? cv.take(2 * C) : nullptr;
  if (s) s->dx = dx, s->dlayers = dl, s->dlnf = dlnf, s->scratch4c = s4, s->scratch_c = sc, s->ln_scratch = ln;
  return cv.used();
}

// The model's own TiedEmbedding: wte and wpe whole, in the embedding group.
class LocalEmbedding final : public TiedEmbedding {
 public:
  LocalEmbedding(ParamGroup& group, const ModelConfig& config) : e_(group), c_(config) {}
  void lookup(float* x, const int32_t* tokens, int B, int T, int first_position, bool positions) override {
    const float* wpe =
        positions ? e_.compute_param(kWpe) + static_cast<int64_t>(first_position) * c_.n_embd : nullptr;
    k::embedding_forward(x, tokens, e_.compute_param(kWte), wpe, B, T, c_.n_embd);
  }
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override {
    const int C = c_.n_embd, Vw = vocab_rows();
    k::gemm(false, true, rows, Vw, C, 1.0f, lnf, ld, e_.compute_param(kWte), C, 0.0f, logits, Vw);
  }
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override {
    k::linear_backward_input(dlnf, dlogits, e_.compute_param(kWte), N, c_.n_embd, vocab_rows(), false);
  }
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override {
    bool acc = false;
    float* dwte = e_.write_grad(kWte, &acc);
    k::linear_backward_weight(dwte, nullptr, dlogits, lnf, N, c_.n_embd, vocab_rows(), acc);
  }
  void lookup_backward(const float* dx, const int32_t* tokens, int B, int T) override {
    // A scatter-add cannot overwrite: a gradient nobody has written since
    // zero_grad() is cleared first. wte normally already holds the head's
    // share (head_backward_weight runs first); wpe is cleared here on the
    // first micro-batch of a step (T·C floats).
    float* d[2];
    for (size_t p : {kWte, kWpe}) {
      bool acc = false;
      d[p] = e_.write_grad(p, &acc);
      if (!acc) std::memset(d[p], 0, sizeof(float) * e_.params()[p].numel());
    }
    k::embedding_backward(d[kWte], d[kWpe], dx, tokens, B, T, c_.n_embd);
  }

 private:
  int vocab_rows() const { return static_cast<int>(e_.params()[kWte].shape[0]); }
  ParamGroup& e_;
  const ModelConfig& c_;
};

GPT::GPT(const ModelConfig& config, uint64_t seed, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, &seed, true, tp, stage) {}

GPT::GPT(const ModelConfig& config, NoInit, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, nullptr, true, tp, stage) {}

GPT::GPT(const ModelConfig& config, Unallocated, tensor::TensorParallel* tp, StageLayers stage)
    : GPT(Build{}, config, nullptr, false, tp, stage) {}

int GPT::tp_size() const { return tp_ ? tp_->size() : 1; }
int GPT::tp_rank() const { return tp_ ? tp_->rank() : 0; }
int64_t GPT::rows(int64_t N) const { return tp_ ? tp_->local_rows(N) : N; }
int64_t GPT::first_row(int64_t N) const { return tp_ ? tp_->first_row(N) : 0; }

// Checks that tensor parallelism over t ranks can cut this model, naming the keys.
static void check_tp(const ModelConfig& c, int t) {
  LATTICE_CHECK(c.n_head % t == 0, "parallel.tp=" << t << " must divide model.n_head=" << c.n_head
                                                  << ": attention is split by whole heads");
  LATTICE_CHECK((4LL * c.n_embd) % t == 0, "parallel.tp=" << t << " must divide 4*model.n_embd=" << 4LL * c.n_embd
                                                          << ": the MLP's hidden layer is split by columns");
}

GPT::GPT(Build, const ModelConfig& config, const uint64_t* seed, bool allocate, tensor::TensorParallel* tp,
         StageLayers stage)
    : config_(config), tp_(tp && tp->size() > 1 ? tp : nullptr) {
  config_.validate();
  first_layer_ = stage.first_layer;
  last_layer_ = stage.last_layer < 0 ? config_.n_layer : stage.last_layer;
  LATTICE_CHECK(0 <= first_layer_ && first_layer_ < last_layer_ && last_layer_ <= config_.n_layer,
                "a pipeline stage runs layers [first, last) with 0 <= first < last <= model.n_layer="
                    << config_.n_layer << ", got [" << first_layer_ << ", " << last_layer_ << ")");
  const int t = tp_size(), r = tp_rank();
  check_tp(config_, t);
  const int64_t C = config_.n_embd, L = config_.n_layer;
  const int64_t Vp = tensor::padded_vocab(config_.vocab_size, t);
  vocab_full_ = static_cast<int>(Vp);
  const tensor::VocabRange range = tensor::vocab_range(config_.vocab_size, vocab_full_, t, r);
  vocab_first_ = range.first;
  vocab_real_ = range.real;
  dims_.C = config_.n_embd;
  dims_.NH = config_.n_head / t;
  dims_.A = dims_.NH * config_.head_size();
  dims_.F = static_cast<int>(4 * C / t);
  dims_.V = range.rows;
  // The slices of tensor parallelism (whole tensors at t = 1): Megatron's
  // column-parallel weights split by output rows (dim 0 of lattice's [out,
  // in]), row-parallel ones by input columns (dim 1); c_attn's rows are Q, K,
  // V blocks, each split by heads (parts = 3).
  auto cut = [t, r](int dim, int parts = 1) {
    ShardSpec spec;
    if (t == 1) return spec;
    spec.split_dim = dim;
    spec.num_shards = t;
    spec.shard_index = r;
    spec.parts = parts;
    return spec;
  };
  // GPT-2 initialisation: weights N(0, 0.02²); the projections that write into
  // the residual stream (attn.c_proj, mlp.c_proj) N(0, (0.02/√(2L))²) so the
  // stream's variance does not grow with depth; biases 0; LayerNorm weight 1.
  const float std_w = 0.02f;
  const float std_proj = 0.02f / std::sqrt(2.0f * static_cast<float>(L));
  auto weight = [](const std::string& name, std::vector<int64_t> shape, float std) {
    ParamInfo p;
    p.name = name;
    p.full_shape = std::move(shape);
    p.init = {InitSpec::Normal, std};
    p.weight_decay = true;
    p.hf_conv1d = p.name.rfind("h.", 0) == 0;  // every block weight is a Conv1D in HF GPT-2
    return p;
  };
  auto constant = [](const std::string& name, int64_t n, float value) {
    ParamInfo p;
    p.name = name;
    p.full_shape = {n};
    p.init = {InitSpec::Constant, value};
    return p;
  };

  auto sliced = [](ParamInfo p, ShardSpec spec) {
    p.shard = spec;
    return p;
  };
  if (has_embedding()) {
    ParamGroup embed("embedding");
    ParamInfo wte = weight("wte.weight", {Vp, C}, std_w);
    wte.real_rows = config_.vocab_size;
    embed.add(sliced(wte, cut(0)));  // vocabulary-parallel
    embed.add(weight("wpe.weight", {config_.seq_len, C}, std_w));
    groups_.push_back(std::move(embed));
  }

  for (int64_t l = first_layer_; l < last_layer_; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    ParamGroup g(h.substr(0, h.size() - 1));
    g.add(constant(h + "ln_1.weight", C, 1.0f));
    g.add(constant(h + "ln_1.bias", C, 0.0f));
    g.add(sliced(weight(h + "attn.c_attn.weight", {3 * C, C}, std_w), cut(0, 3)));  // column-parallel, by heads
    g.add(sliced(constant(h + "attn.c_attn.bias", 3 * C, 0.0f), cut(0, 3)));
    g.add(sliced(weight(h + "attn.c_proj.weight", {C, C}, std_proj), cut(1)));  // row-parallel
    g.add(constant(h + "attn.c_proj.bias", C, 0.0f));
    g.add(constant(h + "ln_2.weight", C, 1.0f));
    g.add(constant(h + "ln_2.bias", C, 0.0f));
    g.add(sliced(weight(h + "mlp.c_fc.weight", {4 * C, C}, std_w), cut(0)));  // column-parallel
    g.add(sliced(constant(h + "mlp.c_fc.bias", 4 * C, 0.0f), cut(0)));
    g.add(sliced(weight(h + "mlp.c_proj.weight", {C, 4 * C}, std_proj), cut(1)));  // row-parallel
    g.add(constant(h + "mlp.c_proj.bias", C, 0.0f));
    groups_.push_back(std::move(g));
  }

  if (last_stage()) {
    ParamGroup fin("ln_f");
    fin.add(constant("ln_f.weight", C, 1.0f));
    fin.add(constant("ln_f.bias", C, 0.0f));
    groups_.push_back(std::move(fin));
  }

  if (has_embedding()) own_embedding_ = std::make_unique<LocalEmbedding>(groups_.front(), config_);
  if (!allocate) return;
  for (ParamGroup& g : groups_) {
    g.allocate();
    if (seed) g.initialize(*seed);
  }
}

GPT::~GPT() = default;

bool GPT::counts_in_norm(size_t group, const ParamInfo& info) const {
  if (has_embedding() && group == embedding_index() && !first_stage()) return false;
  return info.shard.split_dim >= 0 || tp_rank() == 0;
}

std::pair<ParamGroup*, size_t> GPT::find_param(const std::string& name) {
  for (ParamGroup& g : groups_)
    for (size_t i = 0; i < g.params().size(); i++)
      if (g.params()[i].name == name) return {&g, i};
  return {nullptr, 0};
}

CarveSizes GPT::sizes_for(int64_t N) const {
  return {dims_.C, dims_.NH, dims_.A, dims_.F, dims_.V, local_layers(), N, rows(N),
          tp_ && tp_->sequence_parallel(), last_stage(), compute_, !local_head()};
}

bool GPT::local_head() const { return !tp_ && !custom_embedding_; }

// A slot's token ids: the inputs and their rows of wte, and at 16-bit the
// targets (the head's recomputation reads them).
size_t GPT::token_arrays() const { return compute_ != DType::F32 ? 3 : 2; }

// The 16-bit path computes rows of logits a few at a time where its head's
// operations are local (see kHeadRows).
int64_t GPT::head_rows(int64_t N) const { return local_head() ? std::min(N, kHeadRows) : N; }

void GPT::set_tied_embedding(TiedEmbedding* embedding) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_tied_embedding with a micro-batch in flight");
  custom_embedding_ = embedding;
  // The 16-bit head depends on it (local_head): slots and work arrays are carved again at their next use.
  if (compute_ != DType::F32) slots_.clear(), eval_slot_.reset(), work16_.reset();
}

size_t GPT::slot_bytes(int B, int T) const {
  const CarveSizes z = sizes_for(static_cast<int64_t>(B) * T);
  return static_cast<size_t>(carve_activations(nullptr, nullptr, z) + carve_grads(nullptr, nullptr, z, false));
}

size_t GPT::stored_activation_bytes(int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  return static_cast<size_t>(carve_activations(nullptr, nullptr, sizes_for(N))) +
         token_arrays() * static_cast<size_t>(N) * sizeof(int32_t);
}

size_t GPT::work16_bytes(int B, int T) const {
  if (compute_ == DType::F32) return 0;
  const int64_t N = static_cast<int64_t>(B) * T;
  return static_cast<size_t>(carve_work16(nullptr, nullptr, sizes_for(N), head_rows(N)));
}

void GPT::set_compute_dtype(DType t) {
  for (const auto& s : slots_)
    LATTICE_CHECK(!s || !s->has_forward, "set_compute_dtype with a micro-batch in flight");
  for (ParamGroup& g : groups_) g.set_compute_dtype(t);
  if (t == compute_) return;
  compute_ = t;
  // Every slot is carved again at its next use, in the new storage.
  slots_.clear();
  eval_slot_.reset();
  work16_.reset();
}

void GPT::params_changed() {
  for (ParamGroup& g : groups_) g.params_changed();
}

Slot& GPT::slot(int index, int B, int T) {
  LATTICE_CHECK(B >= 1 && T >= 1, "micro-batch must have B >= 1 and T >= 1, got B=" << B << " T=" << T);
  LATTICE_CHECK(T <= config_.seq_len,
                "sequence length " << T << " exceeds model.seq_len=" << config_.seq_len);
  std::unique_ptr<Slot>* holder;
  if (index < 0) {
    holder = &eval_slot_;
  } else {
    if (static_cast<size_t>(index) >= slots_.size()) slots_.resize(index + 1);
    holder = &slots_[index];
  }
  if (!*holder) *holder = std::make_unique<Slot>();
  Slot& s = **holder;
  const int64_t N = static_cast<int64_t>(B) * T;
  if (tp_) tp_->check_rows(N);
  const CarveSizes z = sizes_for(N);
  if (N > s.capacity_tokens) {
    // First use (or a larger batch): allocate once, reused by every later step.
    s.act_mem = Buffer(carve_activations(nullptr, nullptr, z), MemCategory::Activations);
    s.token_mem = Buffer(token_arrays() * N * sizeof(int32_t), MemCategory::Activations);
    s.grad_mem.reset();
    s.capacity_tokens = N;
  }
  s.B = B;
  s.T = T;
  carve_activations(&s, s.act_mem.data(), z);
  if (compute_ != DType::F32) work16_for(s).forget();  // a new forward: the work arrays hold nothing yet
  s.inputs = s.token_mem.as<int32_t>();
  s.rows = s.inputs + N;
  s.targets = compute_ != DType::F32 ? s.rows + N : nullptr;
  return s;
}

// Every id of a batch must be a row of wte, checked before any work so the
// message names the model's vocabulary rather than a kernel's argument.
static void check_ids(const char* what, const int32_t* ids, int64_t n, int vocab_size) {
  for (int64_t i = 0; i < n; i++) {
    LATTICE_CHECK(ids[i] >= 0 && ids[i] < vocab_size, what << " id " << ids[i] << " at position " << i
                                                            << " is outside the vocabulary [0, " << vocab_size
                                                            << ")");
  }
}

// One transformer block on N rows, from x into x_next (which may be x itself),
// keeping its intermediates in a. `attend` fills a.atty from a.qkv: the
// training forward's causal attention, or decode()'s cached attention.
// Under tensor parallelism (tp non-null) the linears are Megatron's column-
// and row-parallel layers on this rank's slices (d), and with sequence
// parallelism x, x_next, the LayerNorms and the residual hold this rank's
// rows only; `work` [N, C] then takes the gathered LayerNorm output and the
// row-parallel partial sums.
// Mixed precision (q = bf16 | f16): every activation is rounded to q as soon
// as it is produced, so each operation reads what a kernel storing q would
// have left (and the backward, which loads the stored copies, sees exactly
// what the forward used); the arithmetic inside each operation, GEMM sums
// and LayerNorm/softmax statistics included, stays f32.
template <typename Attend>
static void block_forward(tensor::TensorParallel* tp, const GPT::Dims& d, ParamGroup& g, const LayerActs& a,
                          const float* x, float* x_next, int64_t N, float* work, DType q, Attend attend) {
  const int C = d.C;
  const bool sp = tp && tp->sequence_parallel();
  const int64_t R = tp ? tp->local_rows(N) : N;
  auto w = [&g](size_t i) { return g.compute_param(i); };
  // r = x + c_proj(Attn(c_attn(LN₁(x))))
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w(kLn1W), w(kLn1B), R, C);
  k::round_to(q, a.ln1, R * C);
  tensor::ColumnParallelLinear(tp, C, 3 * d.A).forward(a.qkv, a.ln1, work, w(kAttnW), w(kAttnB), N);
  k::round_to(q, a.qkv, N * 3 * d.A);
  attend();
  k::round_to(q, a.atty, N * d.A);
  tensor::RowParallelLinear(tp, d.A, C).forward(a.res1, sp ? work : a.res1, a.atty, w(kAttnProjW), w(kAttnProjB), N);
  k::add_inplace(a.res1, x, R * C);
  k::round_to(q, a.res1, R * C);
  // x' = r + c_proj(GELU(c_fc(LN₂(r))))
  k::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, w(kLn2W), w(kLn2B), R, C);
  k::round_to(q, a.ln2, R * C);
  tensor::ColumnParallelLinear(tp, C, d.F).forward(a.fch, a.ln2, work, w(kFcW), w(kFcB), N);
  k::round_to(q, a.fch, N * d.F);
  k::gelu_forward(a.fch_gelu, a.fch, N * d.F);
  k::round_to(q, a.fch_gelu, N * d.F);
  tensor::RowParallelLinear(tp, d.F, C).forward(x_next, sp ? work : x_next, a.fch_gelu, w(kFcProjW), w(kFcProjB), N);
  k::add_inplace(x_next, a.res1, R * C);
  k::round_to(q, x_next, R * C);
}

// Between a slot's 16-bit storage and the f32 arrays a layer computes in.
static void store_layer(DType t, LayerActs a, PackedLayer p, const CarveSizes& z) {
  for_each_array(z, [&](auto field, int64_t n) { k::store_16bit(t, field(a), field(p), n); });
}
static void load_layer(DType t, PackedLayer p, LayerActs a, const CarveSizes& z) {
  for_each_array(z, [&](auto field, int64_t n) { k::load_16bit(t, field(p), field(a), n); });
}

// The f32 arrays of slot s's stage layer l: the slot's own at f32; with
// 16-bit storage the work arrays, loaded from the slot unless they hold that
// layer already, with the slot's statistics.
const LayerActs& GPT::layer_acts(Slot& s, int l) {
  if (s.store == DType::F32) return s.layers[l];
  Work16& w = work16_for(s);
  if (w.holds == &s && w.holds_layer == l) return w.layer;
  const LayerActs& a = work_layer(s, l);
  load_layer(s.store, s.packed[l], a, sizes_for(static_cast<int64_t>(s.B) * s.T));
  return a;
}

// The residual stream x_i of slot s in f32 (rows(N) × C).
const float* GPT::x_of(Slot& s, int i) {
  if (s.store == DType::F32) return s.x[i];
  Work16& w = work16_for(s);
  if (w.holds_x != &s || w.holds_x_index != i) {
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    k::load_16bit(s.store, s.x16[i], w.x[0], rows(N) * config_.n_embd);
    w.holds_x = &s, w.holds_x_index = i;
  }
  return w.x[0];
}

// LN_f's output of slot s in f32 (N × C), loaded once per backward.
const float* GPT::lnf_of(Slot& s) {
  if (s.store == DType::F32) return s.lnf;
  Work16& w = work16_for(s);
  if (w.holds_lnf != &s) {
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    k::load_16bit(s.store, s.lnf16, w.lnf, N * config_.n_embd);
    w.holds_lnf = &s;
  }
  return w.lnf;
}

void GPT::params_in(size_t g, Pass pass) {
  if (hooks_) hooks_->before_params(g, pass);
}
void GPT::params_out(size_t g, Pass pass) {
  if (hooks_) hooks_->after_params(g, pass);
}
void GPT::grads_in(size_t g) {
  if (hooks_) hooks_->before_grads(g);
}
void GPT::grads_out(size_t g) {
  if (hooks_) hooks_->grads_done(g);
}

void GPT::forward_body(Slot& s, const int32_t* inputs, const float* input) {
  const int B = s.B, T = s.T, C = config_.n_embd, L = local_layers();
  const int64_t N = static_cast<int64_t>(B) * T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  if (work16_) work16_->forget();
  if (first_stage()) {
    LATTICE_CHECK(inputs, "the first pipeline stage's forward needs the token ids");
    check_ids("token", inputs, N, config_.vocab_size);
    std::memcpy(s.inputs, inputs, N * sizeof(int32_t));
    // Token ids as rows of this rank's slice of wte (-1: held by another rank).
    const tensor::VocabRange range{vocab_first_, dims_.V, vocab_real_};
    tensor::local_tokens(s.rows, inputs, N, range);
    // The embedding's parameters stay in until the caller's head is done with wte.
    params_in(embedding_index(), Pass::Forward);
    // x₀ = wte[tokens] + wpe[0..T). Vocabulary-parallel: each rank looks up the
    // tokens it holds (zero rows for the rest), rank 0 adds wpe, and the sum
    // over the group (reduce-scattered into this rank's rows under SP) is the lookup.
    float* x0 = sp ? s.work : x_buf(s, 0);
    tied().lookup(x0, s.rows, B, T, 0, tp_rank() == 0);
    if (tp_) tp_->reduce(x0, x_buf(s, 0), N, C, "embedding");
    if (!last_stage()) params_out(embedding_index(), Pass::Forward);
  } else {
    LATTICE_CHECK(input, "pipeline stage [" << first_layer_ << ", " << last_layer_ << ") needs its input activation");
    std::memcpy(x_buf(s, 0), input, R * C * sizeof(float));
  }
  keep_x(s, 0);
  const CarveSizes z = sizes_for(N);
  for (int i = 0; i < L; i++) {
    const int l = first_layer_ + i;
    const LayerActs& a = s.store == DType::F32 ? s.layers[i] : work_layer(s, i);
    params_in(block_index(l), Pass::Forward);
    block_forward(tp_, dims_, block_group(l), a, x_buf(s, i), x_buf(s, i + 1), N, s.work, compute_,
                  [&] { k::attention_forward(a.atty, a.lse, a.qkv, B, T, dims_.A, dims_.NH); });
    params_out(block_index(l), Pass::Forward);
    if (s.store != DType::F32) store_layer(s.store, a, s.packed[i], z);
    keep_x(s, i + 1);
  }
  if (!last_stage()) {
    if (s.out32) std::memcpy(s.out32, x_buf(s, L), R * C * sizeof(float));
    return;
  }
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  // LN_f into this rank's rows of lnf, then (SP) gathered in place: the head
  // is column-parallel over the vocabulary and reads every row.
  float* lnf = s.store == DType::F32 ? s.lnf : work16_for(s).lnf;
  float* lnf_rows = lnf + first_row(N) * C;
  k::layernorm_forward(lnf_rows, s.lnf_mean, s.lnf_rstd, x_buf(s, L), f.compute_param(kLnfW),
                       f.compute_param(kLnfB), R, C);
  k::round_to(compute_, lnf_rows, R * C);
  if (tp_) tp_->gather(lnf_rows, lnf, N, C, "final LayerNorm output");
  if (s.store != DType::F32) k::store_16bit(s.store, lnf, s.lnf16, N * C);
  params_out(final_index(), Pass::Forward);
  if (!first_stage()) params_in(embedding_index(), Pass::Forward);  // the tied head's wte
}

// The forward's residual stream x_i: the slot's own at f32; with 16-bit
// storage one of the two work buffers (a layer reads x_i and writes x_{i+1}).
float* GPT::x_buf(Slot& s, int i) { return s.store == DType::F32 ? s.x[i] : work16_for(s).x[i % 2]; }

// The 16-bit path's work arrays, carved for slot s's micro-batch (two slots
// of different sizes may be in flight: carving for the other one forgets
// what the arrays held).
Work16& GPT::work16_for(const Slot& s) {
  if (!work16_) work16_ = std::make_unique<Work16>();
  Work16& w = *work16_;
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  if (w.carved_tokens == N) return w;
  const CarveSizes z = sizes_for(N);
  const size_t bytes = static_cast<size_t>(carve_work16(nullptr, nullptr, z, head_rows(N)));
  if (w.mem.bytes() < bytes) w.mem = Buffer(bytes, MemCategory::Activations);
  carve_work16(&w, w.mem.data(), z, head_rows(N));
  w.carved_tokens = N;
  w.forget();
  return w;
}

// x_i is complete: with 16-bit storage it is rounded and stored.
void GPT::keep_x(Slot& s, int i) {
  if (s.store == DType::F32) return;
  const int64_t n = rows(static_cast<int64_t>(s.B) * s.T) * config_.n_embd;
  float* x = x_buf(s, i);
  k::round_to(s.store, x, n);
  k::store_16bit(s.store, x, s.x16[i], n);
}

// The work arrays a forward of slot s's layer l computes in (statistics written into the slot).
const LayerActs& GPT::work_layer(Slot& s, int l) {
  Work16& w = work16_for(s);
  const LayerActs& stats = s.layers[l];
  w.layer.ln1_mean = stats.ln1_mean, w.layer.ln1_rstd = stats.ln1_rstd, w.layer.lse = stats.lse;
  w.layer.ln2_mean = stats.ln2_mean, w.layer.ln2_rstd = stats.ln2_rstd;
  w.holds = &s, w.holds_layer = l;
  w.holds_x = nullptr;  // x_buf is being rewritten
  return w.layer;
}

void GPT::loss(float* logits, float* losses, const int32_t* targets, int64_t N, bool backward, float dloss) {
  const int V = config_.vocab_size;
  if (!tp_) {
    if (backward)
      k::crossentropy_forward_backward(logits, losses, targets, N, V, dims_.V, dloss);
    else
      k::crossentropy_forward(losses, logits, targets, N, V, dims_.V);
    return;
  }
  tensor::vocab_parallel_cross_entropy(tp_, logits, losses, targets, N, {vocab_first_, dims_.V, vocab_real_},
                                       backward, dloss);
}

// logits = LN_f(x_L) · wteᵀ and the loss into s.losses; with `backward` the
// logits become dloss · (softmax - onehot) in the same pass (kept in the
// slot for the head's backward). With 16-bit storage the f32 logits exist
// head_rows(N) rows at a time and dlogits are stored rounded.
void GPT::head_and_loss(Slot& s, const int32_t* targets, bool backward, float dloss) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int C = config_.n_embd;
  if (s.store == DType::F32) {
    tied().head_forward(s.logits, s.lnf, N, C);
    params_out(embedding_index(), Pass::Forward);
    loss(s.logits, s.losses, targets, N, backward, dloss);
    return;
  }
  Work16& w = work16_for(s);
  const float* lnf = w.lnf;  // the forward's, still there
  const int64_t Vw = dims_.V;
  const bool keep = backward && s.keep_logits;
  for (int64_t r0 = 0; r0 < N; r0 += w.head_rows) {
    const int64_t n = std::min(w.head_rows, N - r0);
    tied().head_forward(w.logits, lnf + r0 * C, n, C);
    loss(w.logits, s.losses + r0, targets + r0, n, keep, dloss);
    if (keep) k::store_16bit(s.store, w.logits, s.logits16 + r0 * Vw, n * Vw);
  }
  if (backward && !s.keep_logits) {
    std::memcpy(s.targets, targets, static_cast<size_t>(N) * sizeof(int32_t));
    s.dloss = dloss;
  }
  params_out(embedding_index(), Pass::Forward);
}

// fn(dlogits, r0, n) over the slot's dlogits in f32, head_rows at a time
// (16-bit storage: loaded into the work buffer), else all N rows at once.
template <typename Fn>
void GPT::for_dlogits(Slot& s, Fn fn) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  if (s.store == DType::F32) return fn(static_cast<const float*>(s.logits), int64_t{0}, N);
  Work16& w = work16_for(s);
  const int64_t Vw = dims_.V, C = config_.n_embd;
  const float* lnf = s.keep_logits ? nullptr : lnf_of(s);
  for (int64_t r0 = 0; r0 < N; r0 += w.head_rows) {
    const int64_t n = std::min(w.head_rows, N - r0);
    if (s.keep_logits) {
      k::load_16bit(s.store, s.logits16 + r0 * Vw, w.logits, n * Vw);
    } else {
      // Recomputed exactly as the forward computed them (same rows, same
      // GEMM), then rounded as a stored copy would be.
      tied().head_forward(w.logits, lnf + r0 * C, n, C);
      loss(w.logits, w.losses, s.targets + r0, n, true, s.dloss);
      k::round_to(s.store, w.logits, n * Vw);
    }
    fn(static_cast<const float*>(w.logits), r0, n);
  }
}

void GPT::check_one_process(const char* what) const {
  LATTICE_CHECK(whole_model(), what << " runs the whole model, not pipeline stage [" << first_layer_ << ", "
                                    << last_layer_ << "); `lattice generate` loads a checkpoint of any layout whole");
  LATTICE_CHECK(!tp_, what << " runs on one process (tensor parallelism splits the vocabulary and the heads "
                              "over parallel.tp=" << tp_size() << " ranks); `lattice generate` loads a "
                              "checkpoint of any layout whole");
}

void GPT::check_f32(const char* what) const {
  LATTICE_CHECK(compute_ == DType::F32, what << " runs at f32 compute, not " << dtype_name(compute_)
                                              << " (`lattice generate` loads a checkpoint's f32 master weights)");
}

static float mean_of(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  return static_cast<float>(sum / static_cast<double>(n));
}

float GPT::forward(int slot_index, const int32_t* inputs, const int32_t* targets, int B, int T,
                   float loss_grad_scale) {
  LATTICE_CHECK(whole_model(), "forward() runs the whole model; pipeline stage [" << first_layer_ << ", "
                                                                                  << last_layer_
                                                                                  << ") runs forward_stage()");
  return forward_stage(slot_index, inputs, nullptr, targets, B, T, loss_grad_scale);
}

float GPT::forward_stage(int slot_index, const int32_t* inputs, const float* input, const int32_t* targets, int B,
                         int T, float loss_grad_scale) {
  LATTICE_CHECK(slot_index >= 0, "slot index must be >= 0, got " << slot_index);
  const GemmPrecision gemms(compute_);
  Slot& s = slot(slot_index, B, T);
  LATTICE_CHECK(!s.has_forward, "forward on micro-batch slot " << slot_index << " whose backward has not run");
  const int64_t N = static_cast<int64_t>(B) * T;
  const int V = config_.vocab_size;
  if (last_stage()) {
    LATTICE_CHECK(targets, "the last pipeline stage's forward needs the targets");
    check_ids("target", targets, N, V);
  }
  forward_body(s, inputs, input);
  s.has_forward = true;
  s.output_grad = nullptr;
  s.input_grad_ready = false;
  if (!last_stage()) return 0.0f;
  // logits = LN_f(x_L) · wteᵀ, then loss and dlogits in one pass:
  // dlogits = (loss_grad_scale / N) · (softmax - onehot).
  head_and_loss(s, targets, true, loss_grad_scale / static_cast<float>(N));
  return mean_of(s.losses, N);
}

const float* GPT::stage_output(int slot_index) {
  LATTICE_CHECK(!last_stage(), "the last pipeline stage has no output activation (it ends in the loss)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward, "stage_output of micro-batch slot " << slot_index << " before its forward");
  return s.store == DType::F32 ? s.x[local_layers()] : s.out32;
}

void GPT::set_stage_output_grad(int slot_index, const float* grad) {
  LATTICE_CHECK(!last_stage(), "the last pipeline stage takes no output gradient (its backward starts at the loss)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "set_stage_output_grad on micro-batch slot " << slot_index << " without a pending forward");
  s.output_grad = grad;
}

const float* GPT::stage_input_grad(int slot_index) {
  LATTICE_CHECK(!first_stage(), "the first pipeline stage has no input gradient (its input is token ids)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.input_grad_ready, "stage_input_grad of micro-batch slot " << slot_index
                                                                            << " before its backward");
  return dx_of(s, 0) + first_row(static_cast<int64_t>(s.B) * s.T) * config_.n_embd;
}

Slot& GPT::inference_slot(int B, int T) {
  // Between training steps slot 0 holds nothing: evaluation borrows its
  // memory instead of keeping a second set of activations alive.
  if (!slots_.empty() && slots_[0] && !slots_[0]->has_forward) return slot(0, B, T);
  return slot(-1, B, T);
}

float GPT::evaluate(const int32_t* inputs, const int32_t* targets, int B, int T) {
  LATTICE_CHECK(whole_model(), "evaluate() runs the whole model, not pipeline stage [" << first_layer_ << ", "
                                                                                     << last_layer_ << ")");
  const GemmPrecision gemms(compute_);
  Slot& s = inference_slot(B, T);
  const int64_t N = static_cast<int64_t>(B) * T;
  check_ids("target", targets, N, config_.vocab_size);
  forward_body(s, inputs, nullptr);
  head_and_loss(s, targets, false, 0.0f);
  return mean_of(s.losses, N);
}

const float* GPT::last_logits(const int32_t* inputs, int B, int T) {
  check_one_process("last_logits (generation)");
  check_f32("last_logits (generation)");
  Slot& s = inference_slot(B, T);
  forward_body(s, inputs, nullptr);
  const int C = config_.n_embd;
  // Only the last position of each row: lnf rows (b, T-1), stride T·C.
  tied().head_forward(s.logits, s.lnf + static_cast<int64_t>(T - 1) * C, B, static_cast<int64_t>(T) * C);
  params_out(embedding_index(), Pass::Forward);
  return s.logits;
}

// ------------------------------------------------------------------ decode --

struct DecodeState {
  std::vector<int32_t> tokens;  // the tokens of cached positions [0, tokens.size())
  int64_t window_start = 0;     // next_logits(): context index of position 0
  // Layer l: keys [seq_len, C], then values [seq_len, C].
  Buffer cache;
  // One chunk of up to seq_len new positions: the residual stream and one
  // block's intermediates (reused by every layer; LN₁ and LN₂ share buffers).
  Buffer work;
  float *x, *logits;
  LayerActs block;
};

// The chunk buffers of decode(), for up to seq_len rows (sizes only when d is null).
static int64_t carve_decode(DecodeState* d, void* base, const ModelConfig& c) {
  const int64_t rows = c.seq_len, C = c.n_embd;
  Carver cv(base);
  float* x = cv.take(rows * C);
  LayerActs a;
  a.ln1 = a.ln2 = cv.take(rows * C);
  a.ln1_mean = a.ln2_mean = cv.take(rows);
  a.ln1_rstd = a.ln2_rstd = cv.take(rows);
  a.qkv = cv.take(rows * 3 * C);
  a.atty = cv.take(rows * C);
  a.lse = nullptr;  // not needed without a backward
  a.res1 = cv.take(rows * C);
  a.fch = cv.take(rows * 4 * C);
  a.fch_gelu = cv.take(rows * 4 * C);
  float* logits = cv.take(tensor::padded_vocab(c.vocab_size, 1));
  if (d) d->x = x, d->logits = logits, d->block = a;
  return cv.used();
}

void GPT::decode_reset() {
  if (decode_) decode_->tokens.clear();
}

int GPT::decode_position() const { return decode_ ? static_cast<int>(decode_->tokens.size()) : 0; }

const float* GPT::next_logits(const int32_t* context, int64_t n) {
  LATTICE_CHECK(n >= 1, "next_logits needs a context of at least one token");
  const int64_t start = n - std::min<int64_t>(n, config_.seq_len);
  // Reuse the cache only if it holds a prefix of context[start, n) and there
  // is at least one new token (the last logits are not kept).
  const int64_t cached = decode_position();
  const bool reuse = decode_ && decode_->window_start == start && cached < n - start &&
                     std::equal(decode_->tokens.begin(), decode_->tokens.end(), context + start);
  if (!reuse) decode_reset();
  const int64_t from = start + (reuse ? cached : 0);
  const float* logits = decode(context + from, static_cast<int>(n - from));
  decode_->window_start = start;
  return logits;
}

const float* GPT::decode(const int32_t* tokens, int n) {
  check_one_process("decode (generation)");
  check_f32("decode (generation)");
  const int C = config_.n_embd, NH = config_.n_head, L = config_.n_layer, T = config_.seq_len;
  if (!decode_) {
    decode_ = std::make_unique<DecodeState>();
    decode_->cache = Buffer(sizeof(float) * 2 * static_cast<size_t>(L) * T * C, MemCategory::Activations);
    decode_->work = Buffer(carve_decode(nullptr, nullptr, config_), MemCategory::Activations);
    carve_decode(decode_.get(), decode_->work.data(), config_);
  }
  DecodeState& d = *decode_;
  const int pos = decode_position();
  LATTICE_CHECK(n >= 1, "decode needs at least one token, got " << n);
  LATTICE_CHECK(pos + n <= T, "decode: positions " << pos << ".." << pos + n - 1
                                                   << " do not fit the model's seq_len " << T
                                                   << " (decode_reset() starts over)");
  check_ids("token", tokens, n, config_.vocab_size);
  params_in(embedding_index(), Pass::Forward);
  // x = wte[tokens] + wpe[pos .. pos + n)
  tied().lookup(d.x, tokens, 1, n, pos, true);
  const LayerActs& a = d.block;
  for (int l = 0; l < L; l++) {
    float* keys = d.cache.as<float>() + static_cast<int64_t>(l) * 2 * T * C;
    float* values = keys + static_cast<int64_t>(T) * C;
    // The new positions' keys and values join the cache, then attend to all of it.
    params_in(block_index(l), Pass::Forward);
    block_forward(nullptr, dims_, block_group(l), a, d.x, d.x, n, nullptr, DType::F32, [&] {
      for (int i = 0; i < n; i++) {
        const float* row = a.qkv + static_cast<int64_t>(i) * 3 * C;
        std::memcpy(keys + static_cast<int64_t>(pos + i) * C, row + C, sizeof(float) * C);
        std::memcpy(values + static_cast<int64_t>(pos + i) * C, row + 2 * C, sizeof(float) * C);
      }
      k::attention_decode(a.atty, a.qkv, 3 * C, keys, values, C, n, pos, C, NH);
    });
    params_out(block_index(l), Pass::Forward);
  }
  // Logits of the last new position only.
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, d.x + static_cast<int64_t>(n - 1) * C,
                       f.compute_param(kLnfW), f.compute_param(kLnfB), 1, C);
  params_out(final_index(), Pass::Forward);
  tied().head_forward(d.logits, a.ln1, 1, C);
  params_out(embedding_index(), Pass::Forward);
  d.tokens.insert(d.tokens.end(), tokens, tokens + n);
  return d.logits;
}

// ---------------------------------------------------------------- backward --

// Makes sure the gradient buffers are laid out for the split (every layer
// keeps its own) or fused (one layer's worth, reused) backward.
static void prepare_grads(Slot& s, const CarveSizes& now, const CarveSizes& capacity, bool split) {
  if (s.grad_mem.empty() || (split && !s.split_capacity) ||
      static_cast<size_t>(carve_grads(nullptr, nullptr, now, split)) > s.grad_mem.bytes()) {
    s.grad_mem = Buffer(carve_grads(nullptr, nullptr, capacity, split), MemCategory::Activations);
    s.split_capacity = split;
  }
  carve_grads(&s, s.grad_mem.data(), now, split);
  s.split = split;
}

// dx index i holds dL/dx_i. Fused: ping-pong between two buffers.
static float* dx_of(Slot& s, int i) { return s.split ? s.dx[i] : s.dx[i % 2]; }
static LayerGrads& dlayer_of(Slot& s, int l) { return s.split ? s.dlayers[l] : s.dlayers[0]; }

void GPT::head_backward_input(Slot& s, bool with_wte) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const int C = config_.n_embd, L = local_layers();
  ParamGroup& f = final_group();
  // dlnf = dlogits · wte — under TP this rank's vocabulary columns' share,
  // summed over the group (the head is column-parallel: f's backward). With
  // SP this rank's rows of the sum land in dlnf's first rows. `with_wte`:
  // wte's share of the gradient in the same pass over dlogits (the fused
  // backward, when dlogits are recomputed: once instead of twice).
  const float* lnf = with_wte ? lnf_of(s) : nullptr;
  for_dlogits(s, [&](const float* dlogits, int64_t r0, int64_t n) {
    tied().head_backward_input(s.dlnf + r0 * C, dlogits, n);
    if (with_wte) tied().head_backward_weight(dlogits, lnf + r0 * C, n);
  });
  if (tp_) tp_->reduce(s.dlnf, s.dlnf, N, C, "final LayerNorm output gradient");
  // dx_L = LN_f backward (accumulating into zero), this rank's rows
  float* dxL = dx_of(s, L) + first_row(N) * C;
  std::memset(dxL, 0, R * C * sizeof(float));
  k::layernorm_backward_input(dxL, s.dlnf, x_of(s, L), f.compute_param(kLnfW), s.lnf_mean, s.lnf_rstd, R, C);
}

void GPT::head_backward_weight(Slot& s, bool wte_done) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int L = local_layers();
  ParamGroup& f = final_group();
  // d wte (+)= dlogitsᵀ · LN_f(x_L)   (the tied head's share of the wte gradient)
  if (!wte_done) {
    const float* lnf = lnf_of(s);
    for_dlogits(s, [&](const float* dlogits, int64_t r0, int64_t n) {
      tied().head_backward_weight(dlogits, lnf + r0 * config_.n_embd, n);
    });
  }
  layernorm_weight_grads_sp(f, kLnfW, kLnfB, s.dlnf, x_of(s, L), s.lnf_mean, s.lnf_rstd, rows(N), s.ln_scratch);
}

// The gradients of a weight and its bias, which are always written together,
// so they are both stale (overwrite) or both written (accumulate).
static bool write_pair(ParamGroup& g, int w, int b, float** dw, float** db) {
  bool acc_w = false, acc_b = false;
  *dw = g.write_grad(w, &acc_w);
  *db = g.write_grad(b, &acc_b);
  LATTICE_CHECK(acc_w == acc_b, "gradients of " << g.params()[w].name << " and " << g.params()[b].name
                                                << " are out of step");
  return acc_w;
}

void GPT::layernorm_weight_grads_sp(ParamGroup& g, int w, int b, const float* dout, const float* inp,
                                    const float* mean, const float* rstd, int64_t R, float* scratch) {
  if (!tp_ || !tp_->sequence_parallel()) return layernorm_weight_grads(g, w, b, dout, inp, mean, rstd, R);
  // This rank saw its rows only: this micro-batch's partial gradient is
  // summed over the group before it joins the accumulated one (summing the
  // accumulated buffer would count earlier micro-batches t times).
  const int C = config_.n_embd;
  k::layernorm_backward_weight(scratch, scratch + C, dout, inp, mean, rstd, R, C, false);
  tp_->all_reduce(scratch, 2 * C, comm::ReduceOp::Sum, "LayerNorm gradients");
  float *dw, *db;
  if (write_pair(g, w, b, &dw, &db)) {
    k::add_inplace(dw, scratch, C);
    k::add_inplace(db, scratch + C, C);
  } else {
    std::memcpy(dw, scratch, C * sizeof(float));
    std::memcpy(db, scratch + C, C * sizeof(float));
  }
}

// One Linear's (or LayerNorm's) weight gradients in group g: the first write
// after zero_grad() overwrites, later micro-batches accumulate.
void GPT::linear_weight_grads(ParamGroup& g, int w, int b, const float* dout, const float* inp, int64_t N, int IC,
                              int OC) {
  float *dw, *db;
  const bool acc = write_pair(g, w, b, &dw, &db);
  k::linear_backward_weight(dw, db, dout, inp, N, IC, OC, acc);
}

void GPT::layernorm_weight_grads(ParamGroup& g, int w, int b, const float* dout, const float* inp,
                                 const float* mean, const float* rstd, int64_t N) {
  float *dw, *db;
  const bool acc = write_pair(g, w, b, &dw, &db);
  k::layernorm_backward_weight(dw, db, dout, inp, mean, rstd, N, config_.n_embd, acc);
}

void GPT::layer_backward_input(Slot& s, int l) {
  const int B = s.B, T = s.T, C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(B) * T, R = rows(N), first = first_row(N) * C;
  ParamGroup& g = block_group(first_layer_ + l);  // l: this stage's layer index
  const LayerActs& a = layer_acts(s, l);
  LayerGrads& d = dlayer_of(s, l);
  float* dout = dx_of(s, l + 1);  // dL/dx_{l+1}: this rank's rows at `first` (SP), else whole
  float* dx = dx_of(s, l);        // dL/dx_l (written here, the same rows)
  auto w = [&g](size_t i) { return g.compute_param(i); };
  // MLP: x' = r + fch_gelu·W_projᵀ + b  →  d fch_gelu = dout · W_proj
  // (row-parallel: dout gathered in place under SP)
  tensor::RowParallelLinear(tp_, dims_.F, C).backward_input(s.scratch4c, dout + first, dout, w(kFcProjW), N);
  k::gelu_backward(d.dfch, a.fch, s.scratch4c, N * dims_.F);
  tensor::ColumnParallelLinear(tp_, C, dims_.F).backward_input(d.dln2, d.dfch, w(kFcW), N);
  // dr = dout (residual path) + LN₂ backward, this rank's rows
  float* dres1 = d.dres1 + first;
  std::memcpy(dres1, dout + first, R * C * sizeof(float));
  k::layernorm_backward_input(dres1, d.dln2, a.res1, w(kLn2W), a.ln2_mean, a.ln2_rstd, R, C);
  // Attention: r = x + atty·W_projᵀ + b
  tensor::RowParallelLinear(tp_, dims_.A, C).backward_input(s.scratch_c, dres1, d.dres1, w(kAttnProjW), N);
  k::attention_backward(d.dqkv, s.scratch_c, a.qkv, a.atty, a.lse, B, T, dims_.A, dims_.NH);
  tensor::ColumnParallelLinear(tp_, C, 3 * dims_.A).backward_input(d.dln1, d.dqkv, w(kAttnW), N);
  // dx = dr (residual path) + LN₁ backward
  std::memcpy(dx + first, dres1, R * C * sizeof(float));
  k::layernorm_backward_input(dx + first, d.dln1, x_of(s, l), w(kLn1W), a.ln1_mean, a.ln1_rstd, R, C);
}

void GPT::layer_backward_weight(Slot& s, int l) {
  const int C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  ParamGroup& g = block_group(first_layer_ + l);
  const LayerActs& a = layer_acts(s, l);
  LayerGrads& d = dlayer_of(s, l);
  const float* dout = dx_of(s, l + 1);  // whole (gathered by backward_input under SP)
  // The column-parallel layers' inputs are LayerNorm outputs, kept as this
  // rank's rows under SP: gathered again here (Megatron does the same)
  // rather than kept whole, which would undo half of SP's saving.
  auto whole = [&](const float* ln) { return sp ? tp_->gather(ln, s.work, N, C, "LayerNorm output (again)") : ln; };
  linear_weight_grads(g, kFcProjW, kFcProjB, dout, a.fch_gelu, N, dims_.F, C);
  linear_weight_grads(g, kFcW, kFcB, d.dfch, whole(a.ln2), N, C, dims_.F);
  layernorm_weight_grads_sp(g, kLn2W, kLn2B, d.dln2, a.res1, a.ln2_mean, a.ln2_rstd, R, s.ln_scratch);
  linear_weight_grads(g, kAttnProjW, kAttnProjB, d.dres1, a.atty, N, dims_.A, C);
  linear_weight_grads(g, kAttnW, kAttnB, d.dqkv, whole(a.ln1), N, C, 3 * dims_.A);
  layernorm_weight_grads_sp(g, kLn1W, kLn1B, d.dln1, x_of(s, l), a.ln1_mean, a.ln1_rstd, R, s.ln_scratch);
}

void GPT::embedding_backward_weight(Slot& s) {
  // Every rank needs the whole dx₀: its wte rows may be any token's, and
  // wpe (replicated) gets the same whole gradient on every rank.
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  float* dx0 = dx_of(s, 0);
  if (tp_) tp_->gather(dx0 + first_row(N) * config_.n_embd, dx0, N, config_.n_embd, "embedding gradient");
  tied().lookup_backward(dx0, s.rows, s.B, s.T);
}

// The carve sizes of slot s's micro-batch (or of its capacity).
CarveSizes GPT::grad_sizes(const Slot& s, bool capacity) const {
  return sizes_for(capacity ? s.capacity_tokens : static_cast<int64_t>(s.B) * s.T);
}

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index) {
  LATTICE_CHECK(index >= 0 && static_cast<size_t>(index) < slots.size() && slots[index],
                "micro-batch slot " << index << " has no forward");
  return *slots[index];
}

void GPT::backward_input(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward_input on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, grad_sizes(s), grad_sizes(s, true), true);
  head_input_with_hooks(s);
  for (int l = local_layers() - 1; l >= 0; l--) {
    params_in(block_index(first_layer_ + l), Pass::Backward);
    layer_backward_input(s, l);
    params_out(block_index(first_layer_ + l), Pass::Backward);
  }
  s.has_backward_input = true;
  s.input_grad_ready = !first_stage();
}

void GPT::backward_weight(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_backward_input, "backward_weight on micro-batch slot " << slot_index
                                                                           << " before its backward_input");
  // Same order as backward(): head, blocks from last to first, embedding.
  head_weight_with_hooks(s);
  for (int l = local_layers() - 1; l >= 0; l--) {
    grads_in(block_index(first_layer_ + l));
    layer_backward_weight(s, l);
    grads_out(block_index(first_layer_ + l));
  }
  embedding_weight_with_hooks(s);
  s.has_forward = s.has_backward_input = false;
}

void GPT::backward(int slot_index) {
  const GemmPrecision gemms(compute_);
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, grad_sizes(s), grad_sizes(s, true), false);
  if (last_stage() && s.store != DType::F32 && !s.keep_logits) {
    head_recomputed_with_hooks(s);
  } else {
    head_input_with_hooks(s);
    head_weight_with_hooks(s);
  }
  for (int l = local_layers() - 1; l >= 0; l--) {
    params_in(block_index(first_layer_ + l), Pass::Backward);
    layer_backward_input(s, l);
    params_out(block_index(first_layer_ + l), Pass::Backward);
    grads_in(block_index(first_layer_ + l));
    layer_backward_weight(s, l);
    grads_out(block_index(first_layer_ + l));
  }
  embedding_weight_with_hooks(s);
  s.has_forward = false;
  s.input_grad_ready = !first_stage();
}

void GPT::release(int slot_index) {
  Slot& s = existing_slot(slots_, slot_index);
  s.has_forward = s.has_backward_input = false;
  s.output_grad = nullptr;
}

// The embedding's gradient is complete after the lookup's scatter-add (first
// stage) — on a last stage that is not the first, after the head's share.
void GPT::embedding_weight_with_hooks(Slot& s) {
  if (!first_stage()) return;
  if (!last_stage()) grads_in(embedding_index());  // (a whole model announced it before the head's share)
  embedding_backward_weight(s);
  grads_out(embedding_index());
}

// The head's backward reads wte and ln_f's weights, then writes their
// gradients (the embedding's are completed at the very end, by its scatter-add).
void GPT::head_input_with_hooks(Slot& s) {
  if (!last_stage()) {
    // The next stage's gradient of this stage's output starts the backward.
    LATTICE_CHECK(s.output_grad, "backward of pipeline stage [" << first_layer_ << ", " << last_layer_
                                                                    << ") before set_stage_output_grad");
    const int64_t N = static_cast<int64_t>(s.B) * s.T;
    std::memcpy(dx_of(s, local_layers()) + first_row(N) * config_.n_embd, s.output_grad,
                rows(N) * config_.n_embd * sizeof(float));
    s.output_grad = nullptr;
    return;
  }
  params_in(embedding_index(), Pass::Backward);
  params_in(final_index(), Pass::Backward);
  head_backward_input(s);
  params_out(embedding_index(), Pass::Backward);
  params_out(final_index(), Pass::Backward);
}

// The fused backward's head when dlogits are recomputed (16-bit storage,
// local head): one pass over the chunks gives dlnf and wte's share; the
// hooks see the head's parameters in and its gradients written as usual.
void GPT::head_recomputed_with_hooks(Slot& s) {
  params_in(embedding_index(), Pass::Backward);
  params_in(final_index(), Pass::Backward);
  grads_in(embedding_index());
  grads_in(final_index());
  head_backward_input(s, true);
  params_out(embedding_index(), Pass::Backward);
  params_out(final_index(), Pass::Backward);
  head_backward_weight(s, true);
  grads_out(final_index());
  if (!first_stage()) grads_out(embedding_index());
}

void GPT::head_weight_with_hooks(Slot& s) {
  if (!last_stage()) return;
  // Recomputing dlogits (16-bit storage without logits) reads wte again.
  const bool reads_wte = s.store != DType::F32 && !s.keep_logits;
  if (reads_wte) params_in(embedding_index(), Pass::Backward);
  grads_in(embedding_index());
  grads_in(final_index());
  head_backward_weight(s);
  if (reads_wte) params_out(embedding_index(), Pass::Backward);
  grads_out(final_index());
  if (!first_stage()) grads_out(embedding_index());  // no lookup here: the head's share is all of it
}

void GPT::zero_grad() {
  for (ParamGroup& g : groups_) g.zero_grad();
  // A step starts: whatever changed the master weights since the last one
  // (an update, a load), the compute copies follow them.
  params_changed();
}

}  // namespace lattice::model
