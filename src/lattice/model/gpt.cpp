#include "lattice/model/gpt.h"

#include <algorithm>

#include <cmath>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/parallel/tensor/tensor_parallel.h"
#include "lattice/parallel/tensor/vocab_parallel.h"

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
struct LayerActs {
  float *ln1, *ln1_mean, *ln1_rstd;  // LN₁(x_l) and its statistics
  float* qkv;                        // [N, 3C]
  float* atty;                       // attention output before c_proj [N, C]
  float* lse;                        // [B, NH, T] log-sum-exp of the scores
  float* res1;                       // r_l = x_l + Attn(...)
  float *ln2, *ln2_mean, *ln2_rstd;  // LN₂(r_l)
  float* fch;                        // c_fc output [N, 4C]
  float* fch_gelu;                   // GELU(fch)
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
  // Gradients.
  std::vector<float*> dx;  // dL/dx_0 .. dL/dx_L (split) or two ping-pong buffers (fused)
  std::vector<LayerGrads> dlayers;
  float *dlnf, *scratch4c, *scratch_c, *ln_scratch;
  // Pipeline stages: the output's gradient given before the backward (not the
  // last stage), and whether the input's gradient is ready (not the first).
  const float* output_grad = nullptr;  // set_stage_output_grad's, until the backward reads it
  bool input_grad_ready = false;
  // State.
  bool has_forward = false, has_backward_input = false, split = false;
};

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index);
static float* dx_of(Slot& s, int i);

// Carves a buffer into consecutive float arrays.
class Carver {
 public:
  explicit Carver(float* base) : p_(base) {}
  float* take(int64_t n) {
    float* r = p_;
    p_ += (n + 15) / 16 * 16;  // keep every array 64-byte aligned
    return r;
  }
  int64_t used(const float* base) const { return p_ - base; }

 private:
  float* p_;
};

// The sizes the carvers work with: this rank's (GPT::Dims), N rows in all
// and R of them kept between the parallel regions (N/t under sequence parallelism).
// L: the stage's layers; head: it runs the final LayerNorm, head and loss.
struct CarveSizes {
  int64_t C, NH, A, F, V, L, N, R;
  bool sp, head;
};

static int64_t carve_activations(Slot* s, float* base, const CarveSizes& z) {
  const int64_t C = z.C, A = z.A, F = z.F, N = z.N, R = z.R, L = z.L;
  Carver cv(base);
  if (s) s->x.assign(L + 1, nullptr), s->layers.assign(L, LayerActs{});
  for (int64_t l = 0; l <= L; l++) {
    float* p = cv.take(R * C);
    if (s) s->x[l] = p;
  }
  for (int64_t l = 0; l < L; l++) {
    LayerActs a;
    a.ln1 = cv.take(R * C);
    a.ln1_mean = cv.take(R);
    a.ln1_rstd = cv.take(R);
    a.qkv = cv.take(N * 3 * A);
    a.atty = cv.take(N * A);
    a.lse = cv.take(N * z.NH);
    a.res1 = cv.take(R * C);
    a.ln2 = cv.take(R * C);
    a.ln2_mean = cv.take(R);
    a.ln2_rstd = cv.take(R);
    a.fch = cv.take(N * F);
    a.fch_gelu = cv.take(N * F);
    if (s) s->layers[l] = a;
  }
  const int64_t head = z.head ? 1 : 0;
  float* lnf = cv.take(head * N * C);  // whole: the head reads every row (gathered under SP)
  float* lnf_mean = cv.take(head * R);
  float* lnf_rstd = cv.take(head * R);
  float* logits = cv.take(head * N * z.V);
  float* losses = cv.take(head * N);
  float* work = z.sp ? cv.take(N * C) : nullptr;
  if (s) {
    s->lnf = lnf, s->lnf_mean = lnf_mean, s->lnf_rstd = lnf_rstd, s->logits = logits, s->losses = losses;
    s->work = work;
  }
  return cv.used(base);
}

static int64_t carve_grads(Slot* s, float* base, const CarveSizes& z, bool split) {
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
  return cv.used(base);
}

// The model's own TiedEmbedding: wte and wpe whole, in the embedding group.
class LocalEmbedding final : public TiedEmbedding {
 public:
  LocalEmbedding(ParamGroup& group, const ModelConfig& config) : e_(group), c_(config) {}
  void lookup(float* x, const int32_t* tokens, int B, int T, int first_position, bool positions) override {
    const float* wpe = positions ? e_.param(kWpe) + static_cast<int64_t>(first_position) * c_.n_embd : nullptr;
    k::embedding_forward(x, tokens, e_.param(kWte), wpe, B, T, c_.n_embd);
  }
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override {
    const int C = c_.n_embd, Vw = vocab_rows();
    k::gemm(false, true, rows, Vw, C, 1.0f, lnf, ld, e_.param(kWte), C, 0.0f, logits, Vw);
  }
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override {
    k::linear_backward_input(dlnf, dlogits, e_.param(kWte), N, c_.n_embd, vocab_rows(), false);
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

std::pair<ParamGroup*, size_t> GPT::find_param(const std::string& name) {
  for (ParamGroup& g : groups_)
    for (size_t i = 0; i < g.params().size(); i++)
      if (g.params()[i].name == name) return {&g, i};
  return {nullptr, 0};
}

static CarveSizes carve_sizes(const GPT::Dims& d, int layers, bool head, int64_t N, int64_t R, bool sp) {
  return {d.C, d.NH, d.A, d.F, d.V, layers, N, R, sp, head};
}

size_t GPT::slot_bytes(int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  const CarveSizes z = carve_sizes(dims_, local_layers(), last_stage(), N, rows(N), tp_ && tp_->sequence_parallel());
  return static_cast<size_t>(carve_activations(nullptr, nullptr, z) + carve_grads(nullptr, nullptr, z, false)) *
         sizeof(float);
}

size_t GPT::stored_activation_bytes(int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  const CarveSizes z = carve_sizes(dims_, local_layers(), last_stage(), N, rows(N), tp_ && tp_->sequence_parallel());
  return static_cast<size_t>(carve_activations(nullptr, nullptr, z)) * sizeof(float) +
         2 * static_cast<size_t>(N) * sizeof(int32_t);
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
  const bool sp = tp_ && tp_->sequence_parallel();
  if (N > s.capacity_tokens) {
    // First use (or a larger batch): allocate once, reused by every later step.
    const CarveSizes z = carve_sizes(dims_, local_layers(), last_stage(), N, rows(N), sp);
    s.act_mem = Buffer(carve_activations(nullptr, nullptr, z) * sizeof(float), MemCategory::Activations);
    s.token_mem = Buffer(2 * N * sizeof(int32_t), MemCategory::Activations);
    s.grad_mem.reset();
    s.capacity_tokens = N;
  }
  s.B = B;
  s.T = T;
  carve_activations(&s, s.act_mem.as<float>(), carve_sizes(dims_, local_layers(), last_stage(), N, rows(N), sp));
  s.inputs = s.token_mem.as<int32_t>();
  s.rows = s.inputs + N;
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
template <typename Attend>
static void block_forward(tensor::TensorParallel* tp, const GPT::Dims& d, ParamGroup& g, const LayerActs& a,
                          const float* x, float* x_next, int64_t N, float* work, Attend attend) {
  const int C = d.C;
  const bool sp = tp && tp->sequence_parallel();
  const int64_t R = tp ? tp->local_rows(N) : N;
  // r = x + c_proj(Attn(c_attn(LN₁(x))))
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, g.param(kLn1W), g.param(kLn1B), R, C);
  tensor::ColumnParallelLinear(tp, C, 3 * d.A).forward(a.qkv, a.ln1, work, g.param(kAttnW), g.param(kAttnB), N);
  attend();
  tensor::RowParallelLinear(tp, d.A, C)
      .forward(a.res1, sp ? work : a.res1, a.atty, g.param(kAttnProjW), g.param(kAttnProjB), N);
  k::add_inplace(a.res1, x, R * C);
  // x' = r + c_proj(GELU(c_fc(LN₂(r))))
  k::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, g.param(kLn2W), g.param(kLn2B), R, C);
  tensor::ColumnParallelLinear(tp, C, d.F).forward(a.fch, a.ln2, work, g.param(kFcW), g.param(kFcB), N);
  k::gelu_forward(a.fch_gelu, a.fch, N * d.F);
  tensor::RowParallelLinear(tp, d.F, C)
      .forward(x_next, sp ? work : x_next, a.fch_gelu, g.param(kFcProjW), g.param(kFcProjB), N);
  k::add_inplace(x_next, a.res1, R * C);
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
    float* x0 = sp ? s.work : s.x[0];
    tied().lookup(x0, s.rows, B, T, 0, tp_rank() == 0);
    if (tp_) tp_->reduce(x0, s.x[0], N, C, "embedding");
    if (!last_stage()) params_out(embedding_index(), Pass::Forward);
  } else {
    LATTICE_CHECK(input, "pipeline stage [" << first_layer_ << ", " << last_layer_ << ") needs its input activation");
    std::memcpy(s.x[0], input, R * C * sizeof(float));
  }
  for (int i = 0; i < L; i++) {
    const LayerActs& a = s.layers[i];
    const int l = first_layer_ + i;
    params_in(block_index(l), Pass::Forward);
    block_forward(tp_, dims_, block_group(l), a, s.x[i], s.x[i + 1], N, s.work,
                  [&] { k::attention_forward(a.atty, a.lse, a.qkv, B, T, dims_.A, dims_.NH); });
    params_out(block_index(l), Pass::Forward);
  }
  if (!last_stage()) return;
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  // LN_f into this rank's rows of lnf, then (SP) gathered in place: the head
  // is column-parallel over the vocabulary and reads every row.
  float* lnf_rows = s.lnf + first_row(N) * C;
  k::layernorm_forward(lnf_rows, s.lnf_mean, s.lnf_rstd, s.x[L], f.param(kLnfW), f.param(kLnfB), R, C);
  if (tp_) tp_->gather(lnf_rows, s.lnf, N, C, "final LayerNorm output");
  params_out(final_index(), Pass::Forward);
  if (!first_stage()) params_in(embedding_index(), Pass::Forward);  // the tied head's wte
}

void GPT::loss(Slot& s, const int32_t* targets, bool backward, float dloss) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int V = config_.vocab_size;
  if (!tp_) {
    if (backward)
      k::crossentropy_forward_backward(s.logits, s.losses, targets, N, V, dims_.V, dloss);
    else
      k::crossentropy_forward(s.losses, s.logits, targets, N, V, dims_.V);
    return;
  }
  tensor::vocab_parallel_cross_entropy(tp_, s.logits, s.losses, targets, N, {vocab_first_, dims_.V, vocab_real_},
                                       backward, dloss);
}

void GPT::check_one_process(const char* what) const {
  LATTICE_CHECK(whole_model(), what << " runs the whole model, not pipeline stage [" << first_layer_ << ", "
                                    << last_layer_ << "); `lattice generate` loads a checkpoint of any layout whole");
  LATTICE_CHECK(!tp_, what << " runs on one process (tensor parallelism splits the vocabulary and the heads "
                              "over parallel.tp=" << tp_size() << " ranks); `lattice generate` loads a "
                              "checkpoint of any layout whole");
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
  Slot& s = slot(slot_index, B, T);
  LATTICE_CHECK(!s.has_forward, "forward on micro-batch slot " << slot_index << " whose backward has not run");
  const int64_t N = static_cast<int64_t>(B) * T;
  const int C = config_.n_embd, V = config_.vocab_size;
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
  tied().head_forward(s.logits, s.lnf, N, C);
  params_out(embedding_index(), Pass::Forward);
  loss(s, targets, true, loss_grad_scale / static_cast<float>(N));
  return mean_of(s.losses, N);
}

const float* GPT::stage_output(int slot_index) {
  LATTICE_CHECK(!last_stage(), "the last pipeline stage has no output activation (it ends in the loss)");
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward, "stage_output of micro-batch slot " << slot_index << " before its forward");
  return s.x[local_layers()];
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
  Slot& s = inference_slot(B, T);
  const int64_t N = static_cast<int64_t>(B) * T;
  const int C = config_.n_embd;
  check_ids("target", targets, N, config_.vocab_size);
  forward_body(s, inputs, nullptr);
  tied().head_forward(s.logits, s.lnf, N, C);
  params_out(embedding_index(), Pass::Forward);
  loss(s, targets, false, 0.0f);
  return mean_of(s.losses, N);
}

const float* GPT::last_logits(const int32_t* inputs, int B, int T) {
  check_one_process("last_logits (generation)");
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
static int64_t carve_decode(DecodeState* d, float* base, const ModelConfig& c) {
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
  return cv.used(base);
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
  const int C = config_.n_embd, NH = config_.n_head, L = config_.n_layer, T = config_.seq_len;
  if (!decode_) {
    decode_ = std::make_unique<DecodeState>();
    decode_->cache = Buffer(sizeof(float) * 2 * static_cast<size_t>(L) * T * C, MemCategory::Activations);
    decode_->work = Buffer(sizeof(float) * carve_decode(nullptr, nullptr, config_), MemCategory::Activations);
    carve_decode(decode_.get(), decode_->work.as<float>(), config_);
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
    block_forward(nullptr, dims_, block_group(l), a, d.x, d.x, n, nullptr, [&] {
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
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, d.x + static_cast<int64_t>(n - 1) * C, f.param(kLnfW),
                       f.param(kLnfB), 1, C);
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
      static_cast<size_t>(carve_grads(nullptr, nullptr, now, split) * sizeof(float)) > s.grad_mem.bytes()) {
    s.grad_mem = Buffer(carve_grads(nullptr, nullptr, capacity, split) * sizeof(float), MemCategory::Activations);
    s.split_capacity = split;
  }
  carve_grads(&s, s.grad_mem.as<float>(), now, split);
  s.split = split;
}

// dx index i holds dL/dx_i. Fused: ping-pong between two buffers.
static float* dx_of(Slot& s, int i) { return s.split ? s.dx[i] : s.dx[i % 2]; }
static LayerGrads& dlayer_of(Slot& s, int l) { return s.split ? s.dlayers[l] : s.dlayers[0]; }

void GPT::head_backward_input(Slot& s) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const int C = config_.n_embd, L = local_layers();
  ParamGroup& f = final_group();
  // dlnf = dlogits · wte — under TP this rank's vocabulary columns' share,
  // summed over the group (the head is column-parallel: f's backward). With
  // SP this rank's rows of the sum land in dlnf's first rows.
  tied().head_backward_input(s.dlnf, s.logits, N);
  if (tp_) tp_->reduce(s.dlnf, s.dlnf, N, C, "final LayerNorm output gradient");
  // dx_L = LN_f backward (accumulating into zero), this rank's rows
  float* dxL = dx_of(s, L) + first_row(N) * C;
  std::memset(dxL, 0, R * C * sizeof(float));
  k::layernorm_backward_input(dxL, s.dlnf, s.x[L], f.param(kLnfW), s.lnf_mean, s.lnf_rstd, R, C);
}

void GPT::head_backward_weight(Slot& s) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int L = local_layers();
  ParamGroup& f = final_group();
  // d wte (+)= dlogitsᵀ · LN_f(x_L)   (the tied head's share of the wte gradient)
  tied().head_backward_weight(s.logits, s.lnf, N);
  layernorm_weight_grads_sp(f, kLnfW, kLnfB, s.dlnf, s.x[L], s.lnf_mean, s.lnf_rstd, rows(N), s.ln_scratch);
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
  LayerActs& a = s.layers[l];
  LayerGrads& d = dlayer_of(s, l);
  float* dout = dx_of(s, l + 1);  // dL/dx_{l+1}: this rank's rows at `first` (SP), else whole
  float* dx = dx_of(s, l);        // dL/dx_l (written here, the same rows)
  // MLP: x' = r + fch_gelu·W_projᵀ + b  →  d fch_gelu = dout · W_proj
  // (row-parallel: dout gathered in place under SP)
  tensor::RowParallelLinear(tp_, dims_.F, C).backward_input(s.scratch4c, dout + first, dout, g.param(kFcProjW), N);
  k::gelu_backward(d.dfch, a.fch, s.scratch4c, N * dims_.F);
  tensor::ColumnParallelLinear(tp_, C, dims_.F).backward_input(d.dln2, d.dfch, g.param(kFcW), N);
  // dr = dout (residual path) + LN₂ backward, this rank's rows
  float* dres1 = d.dres1 + first;
  std::memcpy(dres1, dout + first, R * C * sizeof(float));
  k::layernorm_backward_input(dres1, d.dln2, a.res1, g.param(kLn2W), a.ln2_mean, a.ln2_rstd, R, C);
  // Attention: r = x + atty·W_projᵀ + b
  tensor::RowParallelLinear(tp_, dims_.A, C).backward_input(s.scratch_c, dres1, d.dres1, g.param(kAttnProjW), N);
  k::attention_backward(d.dqkv, s.scratch_c, a.qkv, a.atty, a.lse, B, T, dims_.A, dims_.NH);
  tensor::ColumnParallelLinear(tp_, C, 3 * dims_.A).backward_input(d.dln1, d.dqkv, g.param(kAttnW), N);
  // dx = dr (residual path) + LN₁ backward
  std::memcpy(dx + first, dres1, R * C * sizeof(float));
  k::layernorm_backward_input(dx + first, d.dln1, s.x[l], g.param(kLn1W), a.ln1_mean, a.ln1_rstd, R, C);
}

void GPT::layer_backward_weight(Slot& s, int l) {
  const int C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(s.B) * s.T, R = rows(N);
  const bool sp = tp_ && tp_->sequence_parallel();
  ParamGroup& g = block_group(first_layer_ + l);
  LayerActs& a = s.layers[l];
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
  layernorm_weight_grads_sp(g, kLn1W, kLn1B, d.dln1, s.x[l], a.ln1_mean, a.ln1_rstd, R, s.ln_scratch);
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
  const int64_t N = capacity ? s.capacity_tokens : static_cast<int64_t>(s.B) * s.T;
  return carve_sizes(dims_, local_layers(), last_stage(), N, rows(N), tp_ && tp_->sequence_parallel());
}

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index) {
  LATTICE_CHECK(index >= 0 && static_cast<size_t>(index) < slots.size() && slots[index],
                "micro-batch slot " << index << " has no forward");
  return *slots[index];
}

void GPT::backward_input(int slot_index) {
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
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, grad_sizes(s), grad_sizes(s, true), false);
  head_input_with_hooks(s);
  head_weight_with_hooks(s);
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

void GPT::head_weight_with_hooks(Slot& s) {
  if (!last_stage()) return;
  grads_in(embedding_index());
  grads_in(final_index());
  head_backward_weight(s);
  grads_out(final_index());
  if (!first_stage()) grads_out(embedding_index());  // no lookup here: the head's share is all of it
}

void GPT::zero_grad() {
  for (ParamGroup& g : groups_) g.zero_grad();
}

}  // namespace lattice::model
