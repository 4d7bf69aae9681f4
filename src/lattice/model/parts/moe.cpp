#include "lattice/model/parts/moe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>

#include "lattice/comm/communicator.h"
#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"
#include "lattice/layers/expert/expert_parallel.h"
#include "lattice/layers/expert/routing.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/model/activations.h"
#include "lattice/model/parts/mlp.h"

namespace lattice::model::parts {

namespace k = lattice::kernels;

namespace {
// Adds the wall time of a scope to *to (null: not timed).
struct Timed {
  double* to;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  explicit Timed(double* t) : to(t) {}
  ~Timed() {
    if (to) *to += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};
}  // namespace

Moe::Moe(tensor::TensorParallel* tp, comm::Communicator* cp, expert::ExpertParallel* ep, MlpKind kind, int C, int E,
         int top_k, int F, int F_shared, MoeParams params, const MoeOptions& options, const float* bias,
         MoeStats* stats, int layer)
    : tp_(tp),
      cp_(cp),
      ep_(ep),
      kind_(kind),
      C_(C),
      E_(E),
      k_(top_k),
      F_(F),
      F_sh_(F_shared),
      params_(std::move(params)),
      options_(options),
      bias_(bias),
      stats_(stats),
      layer_(layer) {}

Mlp Moe::expert(int le) const { return Mlp(nullptr, kind_, C_, F_, params_.up[le], params_.down[le]); }

int64_t Moe::routed_rows(int64_t N) const { return tp_ ? N / tp_->size() : N; }
int64_t Moe::first_routed_row(int64_t N) const { return tp_ ? tp_->rank() * (N / tp_->size()) : 0; }

// The rows this rank's local experts may receive per micro-batch: every
// pair one rank routes (ep = 1), else at most min(k, E/ep) pairs of each of
// the ep ranks' R rows — or moe.token_bound × R·k when that is smaller.
static int64_t receive_capacity(int64_t R, int k, int ep, int local, double bound) {
  if (ep == 1) return R * k;
  const int64_t worst = static_cast<int64_t>(ep) * R * std::min(k, local);
  if (bound <= 0) return worst;
  return std::min(worst, static_cast<int64_t>(std::ceil(bound * static_cast<double>(R * k))));
}

int64_t Moe::carve_acts(MoeActs* s, void* base, int64_t N) const {
  const int64_t R = routed_rows(N), C = C_, FU = this->FU(), F = F_;
  const int64_t recv = receive_capacity(R, k_, ep_->size(), ep_->local_experts(), options_.token_bound);
  const int64_t sent = R * k_, FUs = FU_shared(), Fs = F_sh_;
  Carver cv(base);
  float* probs = cv.take(R * E_);
  float* lse = cv.take(R);
  int32_t* choice = cv.take<int32_t>(sent);
  float* weight = cv.take(sent);
  int32_t* slot = cv.take<int32_t>(sent);
  float* x_exp = cv.take(recv * C);
  float* fch = cv.take(recv * FU);
  float* hid = cv.take(recv * F);
  float* out_send = cv.take(sent * C);
  float* dout_exp = cv.take(recv * C);
  float* dfch = cv.take(recv * FU);
  float* dlogits = cv.take(R * E_);
  float* sh_fch = cv.take(N * FUs);
  float* sh_hid = cv.take(N * Fs);
  float* sh_dfch = cv.take(N * FUs);
  if (s) {
    s->probs = probs, s->lse = lse, s->choice = choice, s->weight = weight, s->slot = slot;
    s->x_exp = x_exp, s->fch = fch, s->hid = hid, s->out_send = out_send, s->dout_exp = dout_exp;
    s->dfch = dfch, s->dlogits = dlogits, s->sh_fch = sh_fch, s->sh_hid = sh_hid, s->sh_dfch = sh_dfch;
    s->cap_rows = R, s->cap_recv = recv, s->cap_tokens = N;
  }
  return cv.used();
}

int64_t Moe::stored_bytes(int64_t N) const { return carve_acts(nullptr, nullptr, N); }

void Moe::ensure(MoeActs& a, MoeWork& w, int64_t N) const {
  const int64_t R = routed_rows(N), C = C_, F = F_;
  const int64_t recv = receive_capacity(R, k_, ep_->size(), ep_->local_experts(), options_.token_bound);
  const int64_t sent = R * k_, Fs = F_sh_;
  if (a.cap_rows < R || a.cap_recv < recv || a.cap_tokens < N) {
    // Sized once for the largest micro-batch (and the bound): no allocation in later steps.
    a.mem = Buffer(static_cast<size_t>(carve_acts(nullptr, nullptr, N)), MemCategory::Activations);
    carve_acts(&a, a.mem.data(), N);
  }
  if (w.cap_rows < R || w.cap_recv < recv || w.cap_tokens < N) {
    const int64_t rows_r = std::max(recv, sent);
    auto carve = [&](Carver& cv, MoeWork* s) {
      float* send = cv.take(sent * C);
      float* rcv = cv.take(recv * C);
      float* exp_a = cv.take(rows_r * C);
      float* exp_b = cv.take(std::max(recv * F, N * Fs));
      float* rows = cv.take(N * C);
      float* dw = cv.take(sent);
      float* logits = cv.take(std::max(R * E_, static_cast<int64_t>(E_) * C));
      if (s) s->send = send, s->recv = rcv, s->exp_a = exp_a, s->exp_b = exp_b, s->rows = rows, s->dw = dw, s->logits = logits;
    };
    Carver count(nullptr);
    carve(count, nullptr);
    w.mem = Buffer(static_cast<size_t>(count.used()), MemCategory::Activations);
    Carver cv(w.mem.data());
    carve(cv, &w);
    w.cap_rows = R, w.cap_recv = recv, w.cap_tokens = N;
  }
}

static std::string expert_counts(const expert::ExpertParallel::Plan& p, int rank) {
  std::ostringstream s;
  for (int le = 0; le < p.local; le++) s << (le ? ", " : "") << "expert " << rank * p.local + le << ": "
                                         << [&] {
                                              int64_t n = 0;
                                              for (int src = 0; src < p.ep; src++)
                                                n += p.counts[static_cast<size_t>(src) * p.E + rank * p.local + le];
                                              return n;
                                            }();
  return s.str();
}

void Moe::forward(MoeActs& a, MoeWork& w, float* y, const float* ln, float* work, int64_t N, DType q, float scale,
                  bool record) {
  ensure(a, w, N);
  const bool sp = tp_ && tp_->sequence_parallel();  // (without SP the rows are replicated: this rank routes 1/t)
  double* route_s = stats_ ? &stats_->route_s : nullptr;
  double* expert_s = stats_ ? &stats_->expert_s : nullptr;
  const double a2a_before = ep_->seconds(), expert_before = expert_s ? *expert_s : 0;
  Timed whole(route_s);  // everything but the experts and the all-to-alls (taken out at the end)
  const int64_t R = routed_rows(N), row0 = first_routed_row(N), C = C_;
  LATTICE_CHECK(!tp_ || N % tp_->size() == 0,
                "an MoE layer under parallel.tp=" << tp_->size() << " routes 1/tp of a micro-batch's " << N
                                                  << " rows on each rank: train.micro_batch_size x model.seq_len "
                                                     "(/ parallel.cp) must be divisible by parallel.tp");
  const float* X = sp ? ln : ln + row0 * C;
  a.R = R, a.N = N, a.scale = scale;

  // Router: logits = X·W_gᵀ, p = softmax, the top-k by p + b and their weights.
  k::linear_forward(w.logits, X, params_.router.weight(), nullptr, R, C_, E_);
  expert::router_softmax(a.probs, a.lse, w.logits, R, E_);
  expert::top_k(a.choice, a.weight, a.probs, bias_, R, E_, k_);

  // Balancing: f and P over the rows of the whole micro-batch (the TP ranks
  // route shares of it, the CP ranks hold its other positions).
  std::vector<double> sums(static_cast<size_t>(2 * E_ + 2), 0.0);
  expert::count_choices(sums.data(), a.choice, R, k_);
  std::vector<double> local_load(sums.begin(), sums.begin() + E_);
  for (int64_t t = 0; t < R; t++) {
    for (int e = 0; e < E_; e++) sums[static_cast<size_t>(E_ + e)] += a.probs[t * E_ + e];
    sums[static_cast<size_t>(2 * E_)] += static_cast<double>(a.lse[t]) * a.lse[t];
  }
  const double my_lse2 = sums[static_cast<size_t>(2 * E_)];
  sums[static_cast<size_t>(2 * E_ + 1)] = static_cast<double>(R);
  if (tp_) tp_->all_reduce(sums.data(), static_cast<int64_t>(sums.size()), "router balance counts");
  if (cp_ && cp_->size() > 1) cp_->all_reduce(sums.data(), sums.size(), DType::F64, comm::ReduceOp::Sum);
  const double Ng = sums[static_cast<size_t>(2 * E_ + 1)];
  const double alpha = options_.aux_loss_coef, beta = options_.z_loss_coef;
  double aux = 0;
  a.aux_grad.assign(static_cast<size_t>(E_), 0.0);
  for (int e = 0; e < E_; e++) {
    const double f = sums[static_cast<size_t>(e)] / (Ng * k_), P = sums[static_cast<size_t>(E_ + e)] / Ng;
    aux += alpha * E_ * f * P;
    a.aux_grad[static_cast<size_t>(e)] = alpha * E_ * f / static_cast<double>(N);
  }
  a.z_grad = 2.0 * beta / static_cast<double>(N);

  // Capacity: a rank drops over its own rows (moe.capacity_factor; refused where rows are cut).
  std::vector<uint8_t> kept(static_cast<size_t>(R * k_), 1);
  int64_t dropped = 0;
  if (options_.capacity_factor > 0)
    dropped = expert::drop_over_capacity(kept.data(), a.choice, a.probs, R, E_, k_,
                                         expert::expert_capacity(R, k_, E_, options_.capacity_factor));
  if (record && stats_) {
    for (int e = 0; e < E_; e++) stats_->load[static_cast<size_t>(e)] += local_load[static_cast<size_t>(e)];
    stats_->aux += aux;
    stats_->z += beta * my_lse2 / Ng;
    stats_->micro_batches++;
    stats_->pairs += R * k_;
    stats_->dropped += dropped;
  }

  // The send order: pairs by expert, then token.
  std::vector<int64_t> send_count(static_cast<size_t>(E_), 0), offset(static_cast<size_t>(E_), 0);
  for (int64_t i = 0; i < R * k_; i++)
    if (kept[static_cast<size_t>(i)]) send_count[static_cast<size_t>(a.choice[i])]++;
  for (int e = 1; e < E_; e++) offset[static_cast<size_t>(e)] = offset[static_cast<size_t>(e - 1)] + send_count[static_cast<size_t>(e - 1)];
  for (int64_t i = 0; i < R * k_; i++)
    a.slot[i] = kept[static_cast<size_t>(i)] ? static_cast<int32_t>(offset[static_cast<size_t>(a.choice[i])]++) : -1;
  const expert::ExpertParallel::Plan plan = ep_->plan(send_count.data());
  // The memory guard: every rank of the ep group knows every rank's receive
  // size (the plan), so they all stop here together, before anything is written past the bound.
  for (int r = 0; r < plan.ep; r++) {
    const int64_t got = plan.received_by(r);
    LATTICE_CHECK(got <= a.cap_recv,
                  "MoE layer " << layer_ << ": the router sends " << got << " rows to the experts of expert-parallel "
                               << "rank " << r << " (" << expert_counts(plan, r) << "), past the " << a.cap_recv
                               << " its buffers hold (moe.token_bound=" << options_.token_bound << " x " << R * k_
                               << " rows routed per rank); raise moe.token_bound (0: size for the worst case, "
                               << plan.ep * R * std::min(k_, plan.local) << " rows), or balance the router "
                               << "(moe.aux_loss_coef, moe.bias_update_rate)");
  }
  a.counts = plan.counts;

  // Dispatch, the local experts on their rows, combine.
  for (int64_t i = 0; i < R * k_; i++)
    if (a.slot[i] >= 0) std::memcpy(w.send + a.slot[i] * C, X + (i / k_) * C, static_cast<size_t>(C) * sizeof(float));
  ep_->dispatch(plan, w.send, a.x_exp, w.recv, C);
  const int FU = this->FU();
  {
    Timed experts(expert_s);
    expert::ExpertParallel::for_each_expert(plan, [&](int le, int64_t off, int64_t n) {
      expert(le).forward(w.exp_a + off * C, a.fch + off * FU, a.hid + off * F_, a.x_exp + off * C, nullptr, n, q);
    });
  }
  ep_->combine(plan, w.exp_a, a.out_send, w.recv, C);

  // y_t = Σ_j w_tj · out_tj over this rank's rows (into exp_a, free again), after the shared experts'.
  sum_pairs(w.exp_a, a, a.out_send, a.weight);
  if (F_sh_ > 0) {
    Timed shared(expert_s);
    Mlp(tp_, kind_, C_, F_sh_, params_.shared_up, params_.shared_down).forward(y, a.sh_fch, a.sh_hid, ln, work, N, q);
  }
  add_routed(y, w.exp_a, w, N, F_sh_ > 0);
  if (route_s) *route_s -= (ep_->seconds() - a2a_before) + (*expert_s - expert_before);
}

void Moe::sum_pairs(float* rows, const MoeActs& a, const float* pairs, const float* weights) const {
  const int64_t R = a.R, C = C_;
#pragma omp parallel for schedule(static) if (R * C > 65536)
  for (int64_t t = 0; t < R; t++) {
    float* row = rows + t * C;
    std::fill(row, row + C, 0.0f);
    for (int j = 0; j < k_; j++) {
      const int32_t s = a.slot[t * k_ + j];
      if (s < 0) continue;  // dropped: contributes nothing
      const float wt = weights ? weights[t * k_ + j] : 1.0f;
      const float* p = pairs + static_cast<int64_t>(s) * C;
      for (int64_t c = 0; c < C; c++) row[c] += wt * p[c];
    }
  }
}

void Moe::add_routed(float* out, const float* mine, MoeWork& w, int64_t N, bool add) const {
  const bool sp = tp_ && tp_->sequence_parallel();
  const float* routed = mine;
  if (tp_ && !sp) {  // every row again on every TP rank
    tp_->group().all_gather(mine, w.rows, static_cast<size_t>(routed_rows(N) * C_), DType::F32);
    routed = w.rows;
  }
  const int64_t n = (sp ? routed_rows(N) : N) * C_;
  if (add)
    k::add_inplace(out, routed, n);
  else
    std::memcpy(out, routed, static_cast<size_t>(n) * sizeof(float));
}

void Moe::backward_input(MoeActs& a, MoeWork& w, float* dln, const float* dy_slice, float* dy_whole, int64_t N) {
  const bool sp = tp_ && tp_->sequence_parallel();
  const bool split = tp_ && !sp;
  const int64_t R = a.R, row0 = first_routed_row(N), C = C_;
  LATTICE_CHECK(a.N == N, "internal: MoE layer " << layer_ << "'s backward on " << N << " rows, forward on " << a.N);
  const float* dY = split ? dy_whole + row0 * C : dy_slice;
  double* route_s = stats_ ? &stats_->route_s : nullptr;
  double* expert_s = stats_ ? &stats_->expert_s : nullptr;
  const double a2a_before = ep_->seconds(), expert_before = expert_s ? *expert_s : 0;
  Timed whole(route_s);
  const expert::ExpertParallel::Plan plan = ep_->plan_of(a.counts);
  // ∂L/∂w_tj = dy_t · out_tj ; ∂L/∂out_tj = w_tj · dy_t (to the expert, in the send order).
#pragma omp parallel for schedule(static) if (R * C > 65536)
  for (int64_t t = 0; t < R; t++) {
    const float* d = dY + t * C;
    for (int j = 0; j < k_; j++) {
      const int64_t i = t * k_ + j;
      const int32_t s = a.slot[i];
      if (s < 0) {
        w.dw[i] = 0.0f;
        continue;
      }
      const float* o = a.out_send + static_cast<int64_t>(s) * C;
      float* g = w.send + static_cast<int64_t>(s) * C;
      const float wt = a.weight[i];
      double dot = 0;
      for (int64_t c = 0; c < C; c++) dot += static_cast<double>(d[c]) * o[c], g[c] = wt * d[c];
      w.dw[i] = static_cast<float>(dot);
    }
  }
  ep_->dispatch(plan, w.send, a.dout_exp, w.recv, C);
  const int FU = this->FU();
  {
    Timed experts(expert_s);
    expert::ExpertParallel::for_each_expert(plan, [&](int le, int64_t off, int64_t n) {
      expert(le).backward_input(w.exp_a + off * C, a.dfch + off * FU, w.exp_b, a.dout_exp + off * C,
                                a.dout_exp + off * C, a.fch + off * FU, n);
    });
  }
  ep_->combine(plan, w.exp_a, w.send, w.recv, C);
  // The router: dlogits from dw, the aux loss and the z-loss.
  expert::router_backward(a.dlogits, w.dw, a.probs, a.lse, a.choice, a.weight, a.aux_grad.data(), a.z_grad, a.scale,
                          R, E_, k_);
  // dX_t = Σ_j ∂L/∂x of pair tj (back from the experts) + dlogits_t · W_g, after the shared experts'.
  sum_pairs(w.exp_a, a, w.send, nullptr);
  k::linear_backward_input(w.exp_a, a.dlogits, params_.router.weight(), R, C_, E_, true);
  if (F_sh_ > 0) {
    Timed shared(expert_s);
    Mlp(tp_, kind_, C_, F_sh_, params_.shared_up, params_.shared_down)
        .backward_input(dln, a.sh_dfch, w.exp_b, dy_slice, dy_whole, a.sh_fch, N);
  }
  add_routed(dln, w.exp_a, w, N, F_sh_ > 0);
  if (route_s) *route_s -= (ep_->seconds() - a2a_before) + (*expert_s - expert_before);
}

void Moe::backward_weight(MoeActs& a, MoeWork& w, const float* dy_whole, const float* ln_whole, int64_t N) {
  const int64_t R = a.R, row0 = first_routed_row(N), C = C_;
  const int FU = this->FU();
  Timed experts(stats_ ? &stats_->expert_s : nullptr);  // (the router's dW is a small share of it)
  expert::ExpertParallel::for_each_expert(ep_->plan_of(a.counts), [&](int le, int64_t off, int64_t n) {
    expert(le).backward_weight(a.dout_exp + off * C, a.hid + off * F_, a.dfch + off * FU, a.x_exp + off * C, n);
  });
  // dW_g (+)= dlogitsᵀ · X over this rank's rows; under TP a share, summed over the group.
  float *dw, *db;
  const bool acc = params_.router.write_grads(&dw, &db);
  const float* X = ln_whole + row0 * C;
  if (!tp_) {
    k::linear_backward_weight(dw, nullptr, a.dlogits, X, R, C_, E_, acc);
  } else {
    float* share = w.logits;  // [E, C]
    k::linear_backward_weight(share, nullptr, a.dlogits, X, R, C_, E_, false);
    tp_->all_reduce(share, static_cast<int64_t>(E_) * C, comm::ReduceOp::Sum, "router weight gradient");
    if (acc)
      k::add_inplace(dw, share, static_cast<int64_t>(E_) * C);
    else
      std::memcpy(dw, share, static_cast<size_t>(E_ * C) * sizeof(float));
  }
  if (F_sh_ > 0)
    Mlp(tp_, kind_, C_, F_sh_, params_.shared_up, params_.shared_down)
        .backward_weight(dy_whole, a.sh_hid, a.sh_dfch, ln_whole, N);
}

}  // namespace lattice::model::parts
