// Routing of a mixture-of-experts layer (docs/moe.md): which k of E experts
// each token goes to, with what weight, which pairs a capacity drops, and the
// balancing losses' values and gradients. Pure arithmetic on one rank's rows;
// the reductions over the ranks that share a micro-batch are the caller's.
//
//   p      = softmax(logits)                                  [R, E]
//   choice = the k largest p_e + b_e (ties: the lower e first) [R, k]
//   w_j    = p_{e_j} / Σ_j' p_{e_j'}   (k >= 2, Mixtral)      [R, k]
//          = p_{e_1}                   (k = 1, Switch)
//   L_aux  = α·E·Σ_i f_i·P_i, f_i = n_i / (N_g·k), P_i = (1/N_g)·Σ_t p_ti
//   L_z    = β·(1/N_g)·Σ_t lse_t²,  lse_t = logsumexp_e logits_te
#pragma once

#include <cstdint>
#include <vector>

namespace lattice::expert {

// probs[R, E] = softmax of each row of logits; lse[R] its log-sum-exp.
void router_softmax(float* probs, float* lse, const float* logits, int64_t R, int E);

// The top-k choice of each row by p + bias (bias may be null: zeros), ties
// to the lower expert index, and its weights. choice and weight are [R, k].
void top_k(int32_t* choice, float* weight, const float* probs, const float* bias, int64_t R, int E, int k);

// Pairs (token, choice) each expert was chosen for: counts[e] += ... (before any drop).
void count_choices(double* counts, const int32_t* choice, int64_t R, int k);

// The capacity of an expert for R rows: ceil(R·k·cf / E).
int64_t expert_capacity(int64_t R, int k, int E, double capacity_factor);

// With a capacity: of the pairs of each expert past `capacity`, the ones with
// the lowest router probability are dropped (ties: the later token), marked
// kept[t·k + j] = 0. Returns the number dropped. kept [R, k] starts all 1.
int64_t drop_over_capacity(uint8_t* kept, const int32_t* choice, const float* probs, int64_t R, int E, int k,
                           int64_t capacity);

// The backward from dw [R, k] (∂L/∂w of the chosen pairs) to dlogits [R, E]:
//   dp_e  = Σ_j [e = e_j]·(k >= 2 ? (dw_j − Σ_j' dw_j'·w_j') / S : dw_1)   S = Σ_j p_{e_j}
//         + scale·aux_grad[e]                (∂L_aux/∂p_te = α·E·f_e/N, the same for every row)
//   dlogits_te = p_te·(dp_te − Σ_e' p_te'·dp_te') + scale·z_grad·lse_t·p_te   (z_grad = 2β/N)
// with aux_grad and z_grad times `scale` (the loss's gradient factor; dw,
// from the loss's gradient, has it already); aux_grad may be null.
void router_backward(float* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* choice,
                     const float* weight, const double* aux_grad, double z_grad, float scale, int64_t R, int E,
                     int k);

// The auxiliary-loss-free bias (DeepSeek-V3): b_e += u·sign(mean(load) − load_e).
void update_selection_bias(float* bias, const double* load, int E, double rate);

}  // namespace lattice::expert
