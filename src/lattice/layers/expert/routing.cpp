#include "lattice/layers/expert/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "lattice/core/error.h"

namespace lattice::expert {

void router_softmax(float* probs, float* lse, const float* logits, int64_t R, int E) {
#pragma omp parallel for schedule(static) if (R * E > 65536)
  for (int64_t t = 0; t < R; t++) {
    const float* z = logits + t * E;
    float* p = probs + t * E;
    float m = z[0];
    for (int e = 1; e < E; e++) m = std::max(m, z[e]);
    double sum = 0;
    for (int e = 0; e < E; e++) sum += std::exp(static_cast<double>(z[e] - m));
    const double log_sum = std::log(sum);
    for (int e = 0; e < E; e++) p[e] = static_cast<float>(std::exp(static_cast<double>(z[e] - m) - log_sum));
    lse[t] = static_cast<float>(m + log_sum);
  }
}

void top_k(int32_t* choice, float* weight, const float* probs, const float* bias, int64_t R, int E, int k) {
#pragma omp parallel for schedule(static) if (R * E > 65536)
  for (int64_t t = 0; t < R; t++) {
    const float* p = probs + t * E;
    int32_t* c = choice + t * k;
    // Insertion into the k best so far, scanning e upward: a later expert
    // displaces an earlier one only with a strictly larger score (ties keep the lower index).
    int n = 0;
    for (int e = 0; e < E; e++) {
      const float s = p[e] + (bias ? bias[e] : 0.0f);
      int at = n;
      while (at > 0 && s > p[c[at - 1]] + (bias ? bias[c[at - 1]] : 0.0f)) at--;
      if (at >= k) continue;
      for (int i = std::min(n, k - 1); i > at; i--) c[i] = c[i - 1];
      c[at] = e;
      n = std::min(n + 1, k);
    }
    float* w = weight + t * k;
    if (k == 1) {
      w[0] = p[c[0]];
      continue;
    }
    float sum = 0;
    for (int j = 0; j < k; j++) sum += p[c[j]];
    for (int j = 0; j < k; j++) w[j] = p[c[j]] / sum;
  }
}

void count_choices(double* counts, const int32_t* choice, int64_t R, int k) {
  for (int64_t i = 0; i < R * k; i++) counts[choice[i]] += 1.0;
}

int64_t expert_capacity(int64_t R, int k, int E, double capacity_factor) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(R) * k * capacity_factor / E));
}

int64_t drop_over_capacity(uint8_t* kept, const int32_t* choice, const float* probs, int64_t R, int E, int k,
                           int64_t capacity) {
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));  // pair index t·k + j, by token
  for (int64_t i = 0; i < R * k; i++) pairs[static_cast<size_t>(choice[i])].push_back(i);
  int64_t dropped = 0;
  for (int e = 0; e < E; e++) {
    std::vector<int64_t>& list = pairs[static_cast<size_t>(e)];
    if (static_cast<int64_t>(list.size()) <= capacity) continue;
    // Highest probability first; equal ones in token order (stable): the later token is dropped.
    std::stable_sort(list.begin(), list.end(),
                     [&](int64_t a, int64_t b) { return probs[(a / k) * E + e] > probs[(b / k) * E + e]; });
    for (size_t i = static_cast<size_t>(capacity); i < list.size(); i++) kept[list[i]] = 0;
    dropped += static_cast<int64_t>(list.size()) - capacity;
  }
  return dropped;
}

void router_backward(float* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* choice,
                     const float* weight, const double* aux_grad, double z_grad, float scale, int64_t R, int E,
                     int k) {
#pragma omp parallel for schedule(static) if (R * E > 65536)
  for (int64_t t = 0; t < R; t++) {
    const float* p = probs + t * E;
    const int32_t* c = choice + t * k;
    const float* g = dw + t * k;
    const float* w = weight + t * k;
    float* d = dlogits + t * E;
    // dp: the aux loss's share (every expert), then the chosen weights' share.
    for (int e = 0; e < E; e++) d[e] = aux_grad ? scale * static_cast<float>(aux_grad[e]) : 0.0f;
    if (k == 1) {
      d[c[0]] += g[0];
    } else {
      float S = 0, gw = 0;
      for (int j = 0; j < k; j++) S += p[c[j]], gw += g[j] * w[j];
      for (int j = 0; j < k; j++) d[c[j]] += (g[j] - gw) / S;
    }
    // Softmax backward, plus the z-loss's ∂(lse²)/∂logits = 2·lse·p (z_grad holds the 2β/N).
    double dot = 0;
    for (int e = 0; e < E; e++) dot += static_cast<double>(p[e]) * d[e];
    const float zl = scale * static_cast<float>(z_grad * lse[t]);
    for (int e = 0; e < E; e++) d[e] = p[e] * (d[e] - static_cast<float>(dot)) + zl * p[e];
  }
}

void update_selection_bias(float* bias, const double* load, int E, double rate) {
  const double mean = std::accumulate(load, load + E, 0.0) / E;
  for (int e = 0; e < E; e++) {
    const double diff = mean - load[e];
    bias[e] += static_cast<float>(rate * (diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0));
  }
}

}  // namespace lattice::expert
