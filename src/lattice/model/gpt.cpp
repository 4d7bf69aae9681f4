#include "lattice/model/gpt.h"

#include <algorithm>

#include <cmath>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::model {

namespace k = lattice::kernels;
using Pass = GroupHooks::Pass;

// Parameter order inside a block group.
enum BlockParam : size_t {
  kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB
};
enum EmbedParam : size_t { kWte, kWpe };
enum FinalParam : size_t { kLnfW, kLnfB };

// What one layer's forward keeps for backward.
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

// Gradients that backward_input produces and backward_weight consumes.
struct LayerGrads {
  float* dfch;   // dL/d fch [N, 4C]     (c_fc weight gradient)
  float* dln2;   // dL/d LN₂ output      (ln_2 weight gradient)
  float* dres1;  // dL/d r_l             (attn c_proj weight gradient)
  float* dqkv;   // dL/d qkv [N, 3C]     (c_attn weight gradient)
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
  float* logits;  // [N, Vp]; after forward(): dlogits
  float* losses;  // [N]
  int32_t* inputs;
  // Gradients.
  std::vector<float*> dx;  // dL/dx_0 .. dL/dx_L (split) or two ping-pong buffers (fused)
  std::vector<LayerGrads> dlayers;
  float *dlnf, *scratch4c, *scratch_c;
  // State.
  bool has_forward = false, has_backward_input = false, split = false;
};

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

static int64_t carve_activations(Slot* s, float* base, const ModelConfig& c, int64_t N) {
  const int64_t C = c.n_embd, NH = c.n_head, L = c.n_layer, Vp = c.padded_vocab();
  Carver cv(base);
  if (s) s->x.assign(L + 1, nullptr), s->layers.assign(L, LayerActs{});
  for (int64_t l = 0; l <= L; l++) {
    float* p = cv.take(N * C);
    if (s) s->x[l] = p;
  }
  for (int64_t l = 0; l < L; l++) {
    LayerActs a;
    a.ln1 = cv.take(N * C);
    a.ln1_mean = cv.take(N);
    a.ln1_rstd = cv.take(N);
    a.qkv = cv.take(N * 3 * C);
    a.atty = cv.take(N * C);
    a.lse = cv.take(N * NH);
    a.res1 = cv.take(N * C);
    a.ln2 = cv.take(N * C);
    a.ln2_mean = cv.take(N);
    a.ln2_rstd = cv.take(N);
    a.fch = cv.take(N * 4 * C);
    a.fch_gelu = cv.take(N * 4 * C);
    if (s) s->layers[l] = a;
  }
  float* lnf = cv.take(N * C);
  float* lnf_mean = cv.take(N);
  float* lnf_rstd = cv.take(N);
  float* logits = cv.take(N * Vp);
  float* losses = cv.take(N);
  if (s) s->lnf = lnf, s->lnf_mean = lnf_mean, s->lnf_rstd = lnf_rstd, s->logits = logits, s->losses = losses;
  return cv.used(base);
}

static int64_t carve_grads(Slot* s, float* base, const ModelConfig& c, int64_t N, bool split) {
  const int64_t C = c.n_embd, L = c.n_layer;
  Carver cv(base);
  const int64_t n_dx = split ? L + 1 : 2;
  const int64_t n_layers = split ? L : 1;
  std::vector<float*> dx(n_dx);
  for (auto& p : dx) p = cv.take(N * C);
  std::vector<LayerGrads> dl(n_layers);
  for (auto& g : dl) {
    g.dfch = cv.take(N * 4 * C);
    g.dln2 = cv.take(N * C);
    g.dres1 = cv.take(N * C);
    g.dqkv = cv.take(N * 3 * C);
    g.dln1 = cv.take(N * C);
  }
  float* dlnf = cv.take(N * C);
  float* s4 = cv.take(N * 4 * C);
  float* sc = cv.take(N * C);
  if (s) s->dx = dx, s->dlayers = dl, s->dlnf = dlnf, s->scratch4c = s4, s->scratch_c = sc;
  return cv.used(base);
}

// The model's own TiedEmbedding: wte and wpe whole, in the embedding group.
class LocalEmbedding final : public TiedEmbedding {
 public:
  LocalEmbedding(ParamGroup& group, const ModelConfig& config) : e_(group), c_(config) {}
  void lookup(float* x, const int32_t* tokens, int B, int T, int first_position) override {
    k::embedding_forward(x, tokens, e_.param(kWte), e_.param(kWpe) + static_cast<int64_t>(first_position) * c_.n_embd,
                         B, T, c_.n_embd);
  }
  void head_forward(float* logits, const float* lnf, int64_t rows, int64_t ld) override {
    const int C = c_.n_embd, Vp = c_.padded_vocab();
    k::gemm(false, true, rows, Vp, C, 1.0f, lnf, ld, e_.param(kWte), C, 0.0f, logits, Vp);
  }
  void head_backward_input(float* dlnf, const float* dlogits, int64_t N) override {
    k::linear_backward_input(dlnf, dlogits, e_.param(kWte), N, c_.n_embd, c_.padded_vocab(), false);
  }
  void head_backward_weight(const float* dlogits, const float* lnf, int64_t N) override {
    bool acc = false;
    float* dwte = e_.write_grad(kWte, &acc);
    k::linear_backward_weight(dwte, nullptr, dlogits, lnf, N, c_.n_embd, c_.padded_vocab(), acc);
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
  ParamGroup& e_;
  const ModelConfig& c_;
};

GPT::GPT(const ModelConfig& config, uint64_t seed) : GPT(Build{}, config, &seed, true) {}

GPT::GPT(const ModelConfig& config, NoInit) : GPT(Build{}, config, nullptr, true) {}

GPT::GPT(const ModelConfig& config, Unallocated) : GPT(Build{}, config, nullptr, false) {}

GPT::GPT(Build, const ModelConfig& config, const uint64_t* seed, bool allocate) : config_(config) {
  config_.validate();
  const int64_t C = config_.n_embd, L = config_.n_layer, Vp = config_.padded_vocab();
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

  ParamGroup embed("embedding");
  ParamInfo wte = weight("wte.weight", {Vp, C}, std_w);
  wte.real_rows = config_.vocab_size;
  embed.add(wte);
  embed.add(weight("wpe.weight", {config_.seq_len, C}, std_w));
  groups_.push_back(std::move(embed));

  for (int64_t l = 0; l < L; l++) {
    const std::string h = "h." + std::to_string(l) + ".";
    ParamGroup g(h.substr(0, h.size() - 1));
    g.add(constant(h + "ln_1.weight", C, 1.0f));
    g.add(constant(h + "ln_1.bias", C, 0.0f));
    g.add(weight(h + "attn.c_attn.weight", {3 * C, C}, std_w));
    g.add(constant(h + "attn.c_attn.bias", 3 * C, 0.0f));
    g.add(weight(h + "attn.c_proj.weight", {C, C}, std_proj));
    g.add(constant(h + "attn.c_proj.bias", C, 0.0f));
    g.add(constant(h + "ln_2.weight", C, 1.0f));
    g.add(constant(h + "ln_2.bias", C, 0.0f));
    g.add(weight(h + "mlp.c_fc.weight", {4 * C, C}, std_w));
    g.add(constant(h + "mlp.c_fc.bias", 4 * C, 0.0f));
    g.add(weight(h + "mlp.c_proj.weight", {C, 4 * C}, std_proj));
    g.add(constant(h + "mlp.c_proj.bias", C, 0.0f));
    groups_.push_back(std::move(g));
  }

  ParamGroup fin("ln_f");
  fin.add(constant("ln_f.weight", C, 1.0f));
  fin.add(constant("ln_f.bias", C, 0.0f));
  groups_.push_back(std::move(fin));

  own_embedding_ = std::make_unique<LocalEmbedding>(groups_.front(), config_);
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

size_t GPT::slot_bytes(int B, int T) const {
  const int64_t N = static_cast<int64_t>(B) * T;
  return static_cast<size_t>(carve_activations(nullptr, nullptr, config_, N) +
                             carve_grads(nullptr, nullptr, config_, N, false)) *
         sizeof(float);
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
  if (N > s.capacity_tokens) {
    // First use (or a larger batch): allocate once, reused by every later step.
    s.act_mem = Buffer(carve_activations(nullptr, nullptr, config_, N) * sizeof(float), MemCategory::Activations);
    s.token_mem = Buffer(N * sizeof(int32_t), MemCategory::Activations);
    s.grad_mem.reset();
    s.capacity_tokens = N;
  }
  s.B = B;
  s.T = T;
  carve_activations(&s, s.act_mem.as<float>(), config_, N);
  s.inputs = s.token_mem.as<int32_t>();
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
template <typename Attend>
static void block_forward(ParamGroup& g, const LayerActs& a, const float* x, float* x_next, int64_t N, int C,
                          Attend attend) {
  // r = x + c_proj(Attn(c_attn(LN₁(x))))
  k::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, g.param(kLn1W), g.param(kLn1B), N, C);
  k::linear_forward(a.qkv, a.ln1, g.param(kAttnW), g.param(kAttnB), N, C, 3 * C);
  attend();
  k::linear_forward(a.res1, a.atty, g.param(kAttnProjW), g.param(kAttnProjB), N, C, C);
  k::add_inplace(a.res1, x, N * C);
  // x' = r + c_proj(GELU(c_fc(LN₂(r))))
  k::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res1, g.param(kLn2W), g.param(kLn2B), N, C);
  k::linear_forward(a.fch, a.ln2, g.param(kFcW), g.param(kFcB), N, C, 4 * C);
  k::gelu_forward(a.fch_gelu, a.fch, N * 4 * C);
  k::linear_forward(x_next, a.fch_gelu, g.param(kFcProjW), g.param(kFcProjB), N, 4 * C, C);
  k::add_inplace(x_next, a.res1, N * C);
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

void GPT::forward_body(Slot& s, const int32_t* inputs) {
  const int B = s.B, T = s.T, C = config_.n_embd, NH = config_.n_head, L = config_.n_layer;
  const int64_t N = static_cast<int64_t>(B) * T;
  check_ids("token", inputs, N, config_.vocab_size);
  std::memcpy(s.inputs, inputs, N * sizeof(int32_t));
  // The embedding's parameters stay in until the caller's head is done with wte.
  params_in(embedding_index(), Pass::Forward);
  // x₀ = wte[tokens] + wpe[0..T)
  tied().lookup(s.x[0], inputs, B, T, 0);
  for (int l = 0; l < L; l++) {
    const LayerActs& a = s.layers[l];
    params_in(block_index(l), Pass::Forward);
    block_forward(block_group(l), a, s.x[l], s.x[l + 1], N, C,
                  [&] { k::attention_forward(a.atty, a.lse, a.qkv, B, T, C, NH); });
    params_out(block_index(l), Pass::Forward);
  }
  params_in(final_index(), Pass::Forward);
  ParamGroup& f = final_group();
  k::layernorm_forward(s.lnf, s.lnf_mean, s.lnf_rstd, s.x[L], f.param(kLnfW), f.param(kLnfB), N, C);
  params_out(final_index(), Pass::Forward);
}

static float mean_of(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  return static_cast<float>(sum / static_cast<double>(n));
}

float GPT::forward(int slot_index, const int32_t* inputs, const int32_t* targets, int B, int T,
                   float loss_grad_scale) {
  LATTICE_CHECK(slot_index >= 0, "slot index must be >= 0, got " << slot_index);
  Slot& s = slot(slot_index, B, T);
  LATTICE_CHECK(!s.has_forward, "forward on micro-batch slot " << slot_index << " whose backward has not run");
  forward_body(s, inputs);
  const int64_t N = static_cast<int64_t>(B) * T;
  const int C = config_.n_embd, V = config_.vocab_size, Vp = config_.padded_vocab();
  check_ids("target", targets, N, V);
  // logits = LN_f(x_L) · wteᵀ, then loss and dlogits in one pass:
  // dlogits = (loss_grad_scale / N) · (softmax - onehot).
  tied().head_forward(s.logits, s.lnf, N, C);
  params_out(embedding_index(), Pass::Forward);
  k::crossentropy_forward_backward(s.logits, s.losses, targets, N, V, Vp,
                                   loss_grad_scale / static_cast<float>(N));
  s.has_forward = true;
  return mean_of(s.losses, N);
}

Slot& GPT::inference_slot(int B, int T) {
  // Between training steps slot 0 holds nothing: evaluation borrows its
  // memory instead of keeping a second set of activations alive.
  if (!slots_.empty() && slots_[0] && !slots_[0]->has_forward) return slot(0, B, T);
  return slot(-1, B, T);
}

float GPT::evaluate(const int32_t* inputs, const int32_t* targets, int B, int T) {
  Slot& s = inference_slot(B, T);
  forward_body(s, inputs);
  const int64_t N = static_cast<int64_t>(B) * T;
  const int C = config_.n_embd, V = config_.vocab_size, Vp = config_.padded_vocab();
  check_ids("target", targets, N, V);
  tied().head_forward(s.logits, s.lnf, N, C);
  params_out(embedding_index(), Pass::Forward);
  k::crossentropy_forward(s.losses, s.logits, targets, N, V, Vp);
  return mean_of(s.losses, N);
}

const float* GPT::last_logits(const int32_t* inputs, int B, int T) {
  Slot& s = inference_slot(B, T);
  forward_body(s, inputs);
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
  float* logits = cv.take(c.padded_vocab());
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
  tied().lookup(d.x, tokens, 1, n, pos);
  const LayerActs& a = d.block;
  for (int l = 0; l < L; l++) {
    float* keys = d.cache.as<float>() + static_cast<int64_t>(l) * 2 * T * C;
    float* values = keys + static_cast<int64_t>(T) * C;
    // The new positions' keys and values join the cache, then attend to all of it.
    params_in(block_index(l), Pass::Forward);
    block_forward(block_group(l), a, d.x, d.x, n, C, [&] {
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
static void prepare_grads(Slot& s, const ModelConfig& c, bool split) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  if (s.grad_mem.empty() || (split && !s.split_capacity) ||
      static_cast<size_t>(carve_grads(nullptr, nullptr, c, N, split) * sizeof(float)) > s.grad_mem.bytes()) {
    s.grad_mem = Buffer(carve_grads(nullptr, nullptr, c, s.capacity_tokens, split) * sizeof(float),
                        MemCategory::Activations);
    s.split_capacity = split;
  }
  carve_grads(&s, s.grad_mem.as<float>(), c, N, split);
  s.split = split;
}

// dx index i holds dL/dx_i. Fused: ping-pong between two buffers.
static float* dx_of(Slot& s, int i) { return s.split ? s.dx[i] : s.dx[i % 2]; }
static LayerGrads& dlayer_of(Slot& s, int l) { return s.split ? s.dlayers[l] : s.dlayers[0]; }

void GPT::head_backward_input(Slot& s) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int C = config_.n_embd, L = config_.n_layer;
  ParamGroup& f = final_group();
  // dlnf = dlogits · wte ;  dx_L = LN_f backward (accumulating into zero)
  tied().head_backward_input(s.dlnf, s.logits, N);
  float* dxL = dx_of(s, L);
  std::memset(dxL, 0, N * C * sizeof(float));
  k::layernorm_backward_input(dxL, s.dlnf, s.x[L], f.param(kLnfW), s.lnf_mean, s.lnf_rstd, N, C);
}

void GPT::head_backward_weight(Slot& s) {
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  const int L = config_.n_layer;
  ParamGroup& f = final_group();
  // d wte (+)= dlogitsᵀ · LN_f(x_L)   (the tied head's share of the wte gradient)
  tied().head_backward_weight(s.logits, s.lnf, N);
  layernorm_weight_grads(f, kLnfW, kLnfB, s.dlnf, s.x[L], s.lnf_mean, s.lnf_rstd, N);
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
  const int B = s.B, T = s.T, C = config_.n_embd, NH = config_.n_head;
  const int64_t N = static_cast<int64_t>(B) * T;
  ParamGroup& g = block_group(l);
  LayerActs& a = s.layers[l];
  LayerGrads& d = dlayer_of(s, l);
  const float* dout = dx_of(s, l + 1);  // dL/dx_{l+1}
  float* dx = dx_of(s, l);              // dL/dx_l (written here)
  // MLP: x' = r + fch_gelu·W_projᵀ + b  →  d fch_gelu = dout · W_proj
  k::linear_backward_input(s.scratch4c, dout, g.param(kFcProjW), N, 4 * C, C, false);
  k::gelu_backward(d.dfch, a.fch, s.scratch4c, N * 4 * C);
  k::linear_backward_input(d.dln2, d.dfch, g.param(kFcW), N, C, 4 * C, false);
  // dr = dout (residual path) + LN₂ backward
  std::memcpy(d.dres1, dout, N * C * sizeof(float));
  k::layernorm_backward_input(d.dres1, d.dln2, a.res1, g.param(kLn2W), a.ln2_mean, a.ln2_rstd, N, C);
  // Attention: r = x + atty·W_projᵀ + b
  k::linear_backward_input(s.scratch_c, d.dres1, g.param(kAttnProjW), N, C, C, false);
  k::attention_backward(d.dqkv, s.scratch_c, a.qkv, a.atty, a.lse, B, T, C, NH);
  k::linear_backward_input(d.dln1, d.dqkv, g.param(kAttnW), N, C, 3 * C, false);
  // dx = dr (residual path) + LN₁ backward
  std::memcpy(dx, d.dres1, N * C * sizeof(float));
  k::layernorm_backward_input(dx, d.dln1, s.x[l], g.param(kLn1W), a.ln1_mean, a.ln1_rstd, N, C);
}

void GPT::layer_backward_weight(Slot& s, int l) {
  const int C = config_.n_embd;
  const int64_t N = static_cast<int64_t>(s.B) * s.T;
  ParamGroup& g = block_group(l);
  LayerActs& a = s.layers[l];
  LayerGrads& d = dlayer_of(s, l);
  const float* dout = dx_of(s, l + 1);
  linear_weight_grads(g, kFcProjW, kFcProjB, dout, a.fch_gelu, N, 4 * C, C);
  linear_weight_grads(g, kFcW, kFcB, d.dfch, a.ln2, N, C, 4 * C);
  layernorm_weight_grads(g, kLn2W, kLn2B, d.dln2, a.res1, a.ln2_mean, a.ln2_rstd, N);
  linear_weight_grads(g, kAttnProjW, kAttnProjB, d.dres1, a.atty, N, C, C);
  linear_weight_grads(g, kAttnW, kAttnB, d.dqkv, a.ln1, N, C, 3 * C);
  layernorm_weight_grads(g, kLn1W, kLn1B, d.dln1, s.x[l], a.ln1_mean, a.ln1_rstd, N);
}

void GPT::embedding_backward_weight(Slot& s) { tied().lookup_backward(dx_of(s, 0), s.inputs, s.B, s.T); }

static Slot& existing_slot(std::vector<std::unique_ptr<Slot>>& slots, int index) {
  LATTICE_CHECK(index >= 0 && static_cast<size_t>(index) < slots.size() && slots[index],
                "micro-batch slot " << index << " has no forward");
  return *slots[index];
}

void GPT::backward_input(int slot_index) {
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward_input on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, config_, true);
  head_input_with_hooks(s);
  for (int l = config_.n_layer - 1; l >= 0; l--) {
    params_in(block_index(l), Pass::Backward);
    layer_backward_input(s, l);
    params_out(block_index(l), Pass::Backward);
  }
  s.has_backward_input = true;
}

void GPT::backward_weight(int slot_index) {
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_backward_input, "backward_weight on micro-batch slot " << slot_index
                                                                           << " before its backward_input");
  // Same order as backward(): head, blocks from last to first, embedding.
  head_weight_with_hooks(s);
  for (int l = config_.n_layer - 1; l >= 0; l--) {
    grads_in(block_index(l));
    layer_backward_weight(s, l);
    grads_out(block_index(l));
  }
  embedding_backward_weight(s);
  grads_out(embedding_index());
  s.has_forward = s.has_backward_input = false;
}

void GPT::backward(int slot_index) {
  Slot& s = existing_slot(slots_, slot_index);
  LATTICE_CHECK(s.has_forward && !s.has_backward_input,
                "backward on micro-batch slot " << slot_index << " without a pending forward");
  prepare_grads(s, config_, false);
  head_input_with_hooks(s);
  head_weight_with_hooks(s);
  for (int l = config_.n_layer - 1; l >= 0; l--) {
    params_in(block_index(l), Pass::Backward);
    layer_backward_input(s, l);
    params_out(block_index(l), Pass::Backward);
    grads_in(block_index(l));
    layer_backward_weight(s, l);
    grads_out(block_index(l));
  }
  embedding_backward_weight(s);
  grads_out(embedding_index());
  s.has_forward = false;
}

// The head's backward reads wte and ln_f's weights, then writes their
// gradients (the embedding's are completed at the very end, by its scatter-add).
void GPT::head_input_with_hooks(Slot& s) {
  params_in(embedding_index(), Pass::Backward);
  params_in(final_index(), Pass::Backward);
  head_backward_input(s);
  params_out(embedding_index(), Pass::Backward);
  params_out(final_index(), Pass::Backward);
}

void GPT::head_weight_with_hooks(Slot& s) {
  grads_in(embedding_index());
  grads_in(final_index());
  head_backward_weight(s);
  grads_out(final_index());
}

void GPT::zero_grad() {
  for (ParamGroup& g : groups_) g.zero_grad();
}

}  // namespace lattice::model
