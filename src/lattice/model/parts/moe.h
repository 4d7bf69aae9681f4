// The block's MLP as a mixture of experts (docs/moe.md): a router, E experts
// — each an MLP of the family's kind (parts/mlp.h) — and optional shared
// experts, on the rows X of norm₂'s output:
//
//   logits = X·W_gᵀ  [R, E] (f32)    p = softmax(logits)
//   choice = top-k of p + b          w = p renormalised over the k (k >= 2), p itself (k = 1)
//   y_t    = Σ_j w_tj · Expert_{e_tj}(x_t)  (+ Shared(x_t))
//
// The routed experts run where expert parallelism puts them
// (layers/expert/expert_parallel.h): the pairs (token, choice) are ordered
// by expert, then token; dispatched to their expert's rank; each local
// expert multiplies its rows (source rank, then token order); the outputs
// are combined back and summed with their weights. One rank (ep = 1) runs
// the same code with the all-to-alls as copies.
//
// Tensor parallelism: the routed experts stay whole on every rank and each
// TP rank routes its own 1/t of the micro-batch's rows (the rows sequence
// parallelism already holds; without SP rows [r·N/t, (r+1)·N/t) of the
// replicated input), so a token is dispatched once, not t times; the output
// rows are all-gathered back where SP does not keep them cut. The router's
// gradient is then a partial sum per TP rank, all-reduced over the group
// like the norms' under SP; the experts' partial sums are reduced by their
// data-parallel engine, whose group spans the TP ranks. Shared experts are
// a dense MLP, column- then row-parallel like parts/mlp.h.
//
// Balancing: the auxiliary loss's f_i and P_i are sums over the rows of the
// micro-batch — all-reduced over the TP group (each routes its share) and
// the context-parallel group (other positions of the same sequences) — and
// its gradient, α·E·f_i/N per row (N this rank's share of tokens before the
// TP split: the data-parallel engine averages over dp×cp), is added to the
// router's backward with the z-loss's, times the loss's gradient factor.
#pragma once

#include <cstdint>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/memory.h"
#include "lattice/model/config.h"
#include "lattice/model/parts/linear.h"
#include "lattice/model/parts/mlp.h"

namespace lattice::tensor {
class TensorParallel;
}
namespace lattice::comm {
class Communicator;
}
namespace lattice::expert {
class ExpertParallel;
}

namespace lattice::model::parts {

// How the router is trained ([moe], docs/moe.md).
struct MoeOptions {
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0.0;
  double capacity_factor = 0.0;  // 0: dropless
  double token_bound = 0.0;      // EP receive rows as a multiple of N·k; 0: the worst case
};

// What one MoE layer counted in the forwards of a step (training forwards only).
struct MoeStats {
  std::vector<double> load;  // [E] pairs routed to each expert by this rank (before dropping)
  double aux = 0, z = 0;     // Σ over micro-batches of L_aux (the micro-batch's, whole) and this rank's share of L_z
  int64_t micro_batches = 0;
  int64_t pairs = 0, dropped = 0;
  // Wall time (forwards and backwards, every micro-batch): the router and the
  // permutations into and out of the send order, the expert MLPs (routed and
  // shared), and the all-to-alls (ExpertParallel::seconds, kept apart).
  double route_s = 0, expert_s = 0;
  void reset(int E) {
    load.assign(static_cast<size_t>(E), 0.0);
    aux = z = 0, micro_batches = 0, pairs = dropped = 0;
    route_s = expert_s = 0;
  }
};

// One micro-batch's stored state of one MoE layer (f32 at any compute dtype:
// the values are rounded as the dense MLP's are, kept at 4 bytes).
struct MoeActs {
  Buffer mem;
  int64_t cap_rows = 0, cap_recv = 0, cap_tokens = 0;  // what mem is carved for
  int64_t R = 0, N = 0;                                 // rows routed here, tokens of the micro-batch here
  float *probs = nullptr, *lse = nullptr;               // [R, E], [R]
  int32_t* choice = nullptr;                            // [R, k]
  float* weight = nullptr;                              // [R, k]
  int32_t* slot = nullptr;                              // [R, k]: the pair's row in the send order (-1: dropped)
  float *x_exp = nullptr, *fch = nullptr, *hid = nullptr;  // experts' rows [recv, C | FU | F]
  float* out_send = nullptr;                            // expert outputs back home, send order [sent, C]
  float *dout_exp = nullptr, *dfch = nullptr;           // backward_input → backward_weight
  float* dlogits = nullptr;                             // [R, E]
  float *sh_fch = nullptr, *sh_hid = nullptr, *sh_dfch = nullptr;  // shared experts [N, FU_sh | F_sh | FU_sh]
  std::vector<int64_t> counts;                          // the plan's [ep][E]
  std::vector<double> aux_grad;                         // [E] α·E·f_e/N
  double z_grad = 0;                                    // 2β/N
  float scale = 1;                                      // the loss's gradient factor of this micro-batch
};

// Work arrays shared by every MoE layer of a model (one layer runs at a time).
struct MoeWork {
  Buffer mem;
  int64_t cap_rows = 0, cap_recv = 0, cap_tokens = 0;
  float *send = nullptr, *recv = nullptr, *exp_a = nullptr, *exp_b = nullptr, *rows = nullptr, *dw = nullptr;
  float* logits = nullptr;
};

// The parameters of one MoE layer here: the router [E, C] (block group), each
// local expert's first and second projection (the expert group), and the shared experts (block group).
struct MoeParams {
  LinearParams router;
  std::vector<LinearParams> up, down;  // per local expert
  LinearParams shared_up, shared_down;
  bool shared = false;
};

class Moe {
 public:
  // C: n_embd; F: each expert's hidden width; F_shared: the shared experts'
  // width on this TP rank (0: none). cp: the context-parallel group (or
  // null); bias: the selection bias [E] (or null: zeros); stats: where the
  // training forwards count (or null).
  Moe(tensor::TensorParallel* tp, comm::Communicator* cp, expert::ExpertParallel* ep, MlpKind kind, int C, int E,
      int k, int F, int F_shared, MoeParams params, const MoeOptions& options, const float* bias, MoeStats* stats,
      int layer);

  // y from the norm's output ln (the dense MLP's contract, parts/mlp.h: rows(N)
  // rows under SP, `work` [N, C] for the gathered input), keeping what the
  // backward needs in a. `record`: a training forward (counted in stats).
  void forward(MoeActs& a, MoeWork& w, float* y, const float* ln, float* work, int64_t N, DType q, float scale,
               bool record);
  // dln (the dense MLP's contract) from dy_slice (this rank's rows under SP)
  // and dy_whole (gathered into in place under SP when there are shared experts).
  void backward_input(MoeActs& a, MoeWork& w, float* dln, const float* dy_slice, float* dy_whole, int64_t N);
  // The router's, the local experts' and the shared experts' weight
  // gradients. ln_whole: norm₂'s output, every row (gathered under SP).
  void backward_weight(MoeActs& a, MoeWork& w, const float* dy_whole, const float* ln_whole, int64_t N);

  // Bytes of the state a micro-batch of N tokens keeps (MoeActs: routing,
  // the experts' rows and their gradients, the shared experts'), as sized
  // for the receive bound.
  int64_t stored_bytes(int64_t N) const;
  // The rows this rank routes of N, and the first of them.
  int64_t routed_rows(int64_t N) const;
  int64_t first_routed_row(int64_t N) const;

 private:
  void ensure(MoeActs& a, MoeWork& w, int64_t N) const;
  int64_t carve_acts(MoeActs* a, void* base, int64_t N) const;  // (sizes only with a null base)
  Mlp expert(int local_expert) const;  // local expert le: the family's MLP, whole (no TP)
  // rows [R, C]: row_t = Σ_j (weights_tj, or 1)·pairs[slot_tj] over the pairs kept.
  void sum_pairs(float* rows, const MoeActs& a, const float* pairs, const float* weights) const;
  // This rank's routed rows into `out` (added to the shared experts' when
  // `add`): all-gathered first where TP replicates the rows (no SP).
  void add_routed(float* out, const float* mine, MoeWork& w, int64_t N, bool add) const;
  int FU() const { return kind_ == MlpKind::SwiGLU ? 2 * F_ : F_; }
  int FU_shared() const { return kind_ == MlpKind::SwiGLU ? 2 * F_sh_ : F_sh_; }

  tensor::TensorParallel* tp_;
  comm::Communicator* cp_;
  expert::ExpertParallel* ep_;
  MlpKind kind_;
  int C_, E_, k_, F_, F_sh_;
  MoeParams params_;
  MoeOptions options_;
  const float* bias_;
  MoeStats* stats_;
  int layer_;
};

}  // namespace lattice::model::parts
