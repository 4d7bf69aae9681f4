// Which layers each pipeline chunk runs.
//
// The model's L blocks are cut into p·v chunks of consecutive layers (chunk
// c runs on rank c % p for the loop placement of 1F1B and interleaved
// schedules). The first chunk also runs the embedding and the last the final
// LayerNorm, the LM head and the loss, so a balanced cut counts them: with
// GPT-2's vocabulary the head alone costs about as much as 2 blocks of
// GPT-2 small (its GEMM is C × 50304 against a block's 12·C²).
#pragma once

#include <string>
#include <vector>

#include "lattice/model/config.h"

namespace lattice::pipeline {

struct ChunkLayers {
  int first = 0, last = 0;  // layers [first, last)
  bool operator==(const ChunkLayers& o) const { return first == o.first && last == o.last; }
};

// Training FLOPs per token (forward + backward) of: the embedding (index 0),
// each block (1..L), and the final LayerNorm + head + loss (L + 1), at sequence length T.
std::vector<double> layer_costs(const model::ModelConfig& c, int T);

// The cut into `chunks` chunks of at least one layer that minimises the most
// expensive chunk; costs as layer_costs() gives them (L + 2 entries: the
// embedding's goes to the first chunk, the head's to the last). Ties go to
// the earlier cut. Clear error when chunks > L.
std::vector<ChunkLayers> balanced_partition(const std::vector<double>& costs, int chunks);
// The same for chunks placed on ranks (rank_of_chunk[c], as Schedule's
// rank_of_stage): with several chunks per rank what keeps the pipeline busy
// is each rank's total, and the best cut by chunk can leave it unequal — ZB-V
// puts the first chunk (embedding) and the last (head) both on rank 0. From
// the cut above, boundaries move one layer at a time while that lowers the
// most loaded rank's total (then the most expensive chunk).
std::vector<ChunkLayers> balanced_partition(const std::vector<double>& costs, int chunks,
                                            const std::vector<int>& rank_of_chunk);

// The cut `start` improved for `schedule` (its stages are the chunks): each
// stage's cost from `costs` split equally into F, I and W, the boundaries
// moved one layer at a time while the simulated makespan (simulator.h)
// falls. What the balanced cuts cannot see — that in ZB-V a short first
// chunk starves the long one it feeds, or that the fill favours a lighter
// first stage — the simulator does.
struct Schedule;
std::vector<ChunkLayers> refine_partition(const std::vector<double>& costs, std::vector<ChunkLayers> start,
                                          const Schedule& schedule);
// The simulated makespan of `schedule` with the stages cut as `cut`, costs as above.
double simulated_makespan(const std::vector<double>& costs, const std::vector<ChunkLayers>& cut,
                          const Schedule& schedule);

// An explicit cut: layers per chunk, which must cover all L layers, each
// chunk at least one. `what` names the setting in errors.
std::vector<ChunkLayers> explicit_partition(const std::vector<int>& layers_per_chunk, int layers, int chunks,
                                            const std::string& what);

}  // namespace lattice::pipeline
