#include "lattice/parallel/pipeline/partition.h"

#include <algorithm>
#include <limits>
#include <string>

#include "lattice/core/error.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::pipeline {

std::vector<double> layer_costs(const model::ModelConfig& c, int T) {
  // Per token, ×3 for forward + backward (the backward does two GEMMs per one
  // of the forward): 2 FLOPs per multiply-add.
  const double C = c.n_embd, V = c.padded_vocab();
  const double Q = static_cast<double>(c.q_width()), KV = static_cast<double>(c.kv_width()), F = c.ffn();
  const double up = c.mlp == model::MlpKind::SwiGLU ? 2.0 * F : F;  // SwiGLU: gate and up
  std::vector<double> costs;
  costs.push_back(3.0 * 2.0 * C);  // the lookup: a row copy and add (tiny)
  // The weights' multiply-adds per token (GPT-2: 12C²; Llama: C(Q + 2KV) + QC + 3CF), and QKᵀ and PV
  // (causal: counted whole, like MFU).
  const double block = 3.0 * (2.0 * (C * (Q + 2.0 * KV) + Q * C + C * up + F * C) + 2.0 * 2.0 * C * T);
  for (int l = 0; l < c.n_layer; l++) costs.push_back(block);
  costs.push_back(3.0 * 2.0 * C * V);  // the head's GEMM (the loss is O(V))
  return costs;
}

std::vector<ChunkLayers> balanced_partition(const std::vector<double>& costs, int chunks) {
  const int L = static_cast<int>(costs.size()) - 2;
  LATTICE_CHECK(L >= 1, "balanced_partition: needs the embedding's, at least one layer's and the head's costs");
  LATTICE_CHECK(chunks >= 1 && chunks <= L,
                "parallel.pp x parallel.virtual_stages = " << chunks << " chunks for " << L
                                                           << " layers (model.n_layer): every chunk needs at least one "
                                                              "layer; lower parallel.pp or parallel.virtual_stages");
  // prefix[i] = cost of layers [0, i), with the embedding on layer 0 and the head on layer L-1.
  std::vector<double> prefix(static_cast<size_t>(L) + 1, 0.0);
  for (int l = 0; l < L; l++)
    prefix[l + 1] = prefix[l] + costs[l + 1] + (l == 0 ? costs[0] : 0.0) + (l == L - 1 ? costs[L + 1] : 0.0);
  auto cost = [&](int a, int b) { return prefix[b] - prefix[a]; };
  // best[c][i]: the least maximum over c chunks covering layers [0, i).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(chunks) + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(static_cast<size_t>(chunks) + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int c = 1; c <= chunks; c++)
    for (int i = c; i <= L; i++)
      for (int j = c - 1; j < i; j++) {
        const double v = std::max(best[c - 1][j], cost(j, i));
        if (v < best[c][i]) best[c][i] = v, cut[c][i] = j;
      }
  std::vector<ChunkLayers> out(static_cast<size_t>(chunks));
  for (int c = chunks, i = L; c >= 1; c--) {
    out[c - 1] = {cut[c][i], i};
    i = cut[c][i];
  }
  return out;
}

// Each chunk's cost under `cut`: its layers, the embedding on the first, the head on the last.
static std::vector<double> chunk_costs(const std::vector<double>& costs, const std::vector<ChunkLayers>& cut) {
  const int L = static_cast<int>(costs.size()) - 2, S = static_cast<int>(cut.size());
  std::vector<double> out(static_cast<size_t>(S), 0.0);
  for (int k = 0; k < S; k++) {
    out[k] = (k == 0 ? costs[0] : 0.0) + (k == S - 1 ? costs[L + 1] : 0.0);
    for (int l = cut[k].first; l < cut[k].last; l++) out[k] += costs[l + 1];
  }
  return out;
}

// Moves one boundary by one layer at a time (every chunk keeps a layer)
// while `better(candidate, current)` accepts the move.
template <typename Better>
static std::vector<ChunkLayers> move_boundaries(std::vector<ChunkLayers> cut, Better better) {
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t k = 1; k < cut.size(); k++)  // the boundary between chunks k-1 and k
      for (int delta : {-1, 1}) {
        std::vector<ChunkLayers> c = cut;
        c[k - 1].last += delta;
        c[k].first += delta;
        if (c[k - 1].last <= c[k - 1].first || c[k].first >= c[k].last) continue;
        if (better(c, cut)) cut = std::move(c), moved = true;
      }
  }
  return cut;
}

std::vector<ChunkLayers> balanced_partition(const std::vector<double>& costs, int chunks,
                                            const std::vector<int>& rank_of_chunk) {
  LATTICE_CHECK(static_cast<int>(rank_of_chunk.size()) == chunks,
                "balanced_partition: " << rank_of_chunk.size() << " placements for " << chunks << " chunks");
  const int ranks = *std::max_element(rank_of_chunk.begin(), rank_of_chunk.end()) + 1;
  // (most loaded rank, most expensive chunk) of a cut.
  auto score = [&](const std::vector<ChunkLayers>& c) {
    std::vector<double> load(static_cast<size_t>(ranks), 0.0);
    const std::vector<double> x = chunk_costs(costs, c);
    for (int k = 0; k < chunks; k++) load[rank_of_chunk[k]] += x[k];
    return std::make_pair(*std::max_element(load.begin(), load.end()), *std::max_element(x.begin(), x.end()));
  };
  return move_boundaries(balanced_partition(costs, chunks), [&](const auto& candidate, const auto& current) {
    const auto a = score(candidate), b = score(current);
    const double eps = 1e-9 * std::max(1.0, b.first);
    return a.first < b.first - eps || (a.first <= b.first + eps && a.second < b.second - eps);
  });
}

double simulated_makespan(const std::vector<double>& costs, const std::vector<ChunkLayers>& cut,
                          const Schedule& schedule) {
  LATTICE_CHECK(static_cast<int>(cut.size()) == schedule.stages,
                "simulated_makespan: " << cut.size() << " chunks for " << schedule.stages << " stages");
  Costs c;
  for (double x : chunk_costs(costs, cut)) c.by_stage.push_back({x / 3, x / 3, x / 3});
  return simulate(schedule, c).makespan;
}

std::vector<ChunkLayers> refine_partition(const std::vector<double>& costs, std::vector<ChunkLayers> cut,
                                          const Schedule& schedule) {
  return move_boundaries(std::move(cut), [&](const auto& candidate, const auto& current) {
    return simulated_makespan(costs, candidate, schedule) < simulated_makespan(costs, current, schedule) * (1 - 1e-9);
  });
}

std::vector<ChunkLayers> explicit_partition(const std::vector<int>& layers_per_chunk, int layers, int chunks,
                                            const std::string& what) {
  LATTICE_CHECK(static_cast<int>(layers_per_chunk.size()) == chunks,
                what << " lists " << layers_per_chunk.size() << " chunks but the pipeline has " << chunks
                     << " (parallel.pp x parallel.virtual_stages)");
  std::vector<ChunkLayers> out;
  int first = 0;
  for (size_t c = 0; c < layers_per_chunk.size(); c++) {
    LATTICE_CHECK(layers_per_chunk[c] >= 1, what << ": chunk " << c << " has " << layers_per_chunk[c]
                                                 << " layers; every chunk needs at least one");
    out.push_back({first, first + layers_per_chunk[c]});
    first += layers_per_chunk[c];
  }
  LATTICE_CHECK(first == layers, what << " covers " << first << " layers but the model has " << layers
                                      << " (model.n_layer): every layer must be in exactly one chunk");
  return out;
}

}  // namespace lattice::pipeline
