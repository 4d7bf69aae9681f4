// ProcessMesh: the world's ranks laid out as (pp, dp, cp, tp), one
// communicator per parallel group.
//
// tp varies fastest (neighbouring ranks, i.e. one node, share a TP group), then
// cp, then dp, then pp:
//
//   world_rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
//
// Groups (each rank belongs to exactly one of each kind; group ranks are
// ordered by the coordinates that vary inside the group, slowest first):
//   tp     the tp ranks of one (pp, dp, cp)           - TP all-reduces, SP
//   cp     the cp ranks of one (pp, dp, tp)           - ring attention
//   dp     the dp ranks of one (pp, cp, tp)           - gradient all-reduce
//   pp     the pp ranks of one (dp, cp, tp)           - stage-to-stage send/recv; rank = stage
//   dp_cp  the dp*cp ranks of one (pp, tp), ordered (dp, cp) - ZeRO sharding, EP
//   mp     "model parallel": the tp*pp ranks of one (dp, cp), ordered (pp, tp)
//   ep     blocks of ep consecutive ranks of dp_cp    - MoE dispatch/combine all-to-all
//   edp    "expert data parallel": the dp*cp/ep ranks of dp_cp with the same
//          position in their ep group                 - expert gradient all-reduce
//   edp_tp the tp*dp*cp/ep ranks that hold the same experts: one (pp, ep
//          position), ordered (edp, tp)                - expert gradients' ZeRO engine
//   world  every rank
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lattice/comm/communicator.h"

namespace lattice::comm {

// The [parallel] sizes.
struct MeshSizes {
  int pp = 1, dp = 1, cp = 1, tp = 1, ep = 1;
  int world() const { return pp * dp * cp * tp; }
};

// Where one rank sits. ep is its rank in its ep group, edp the index of that
// group (its rank in the edp group).
struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, tp = 0, ep = 0, edp = 0;
};

enum class MeshGroup { TP, CP, DP, PP, DPxCP, ModelParallel, EP, ExpertDP, ExpertReplicas, World };
inline constexpr int kMeshGroupCount = 10;
// "tp", "cp", "dp", "pp", "dp_cp", "mp", "ep", "edp", "edp_tp", "world"
const char* mesh_group_name(MeshGroup g);

// Refuses sizes that cannot form a mesh on `world` ranks, with one message
// naming the [parallel] keys: a size that is not positive, a product that is
// not the number of ranks started, or ep not dividing dp*cp. Pure (no MPI).
void validate_mesh_sizes(int world, int pp, int dp, int cp, int tp, int ep);
inline void validate_mesh_sizes(int world, const MeshSizes& s) { validate_mesh_sizes(world, s.pp, s.dp, s.cp, s.tp, s.ep); }

// Until a dimension is implemented by the trainer, a size > 1 for it is
// refused: "parallel.tp=2: tensor parallelism is not implemented yet; set
// parallel.tp=1". `implemented` lists the keys that are ("dp", "tp", ...).
// Checks dp, tp, pp, cp, ep in that order.
void refuse_unimplemented(const MeshSizes& sizes, const std::vector<std::string>& implemented = {});

// Pure layout arithmetic (no MPI), shared by ProcessMesh and the planner.
MeshCoord mesh_coord(const MeshSizes& sizes, int world_rank);
int mesh_world_rank(const MeshSizes& sizes, int pp, int dp, int cp, int tp);
// World ranks of the group of kind `g` that holds `world_rank`, in group-rank order.
std::vector<int> mesh_group_ranks(const MeshSizes& sizes, int world_rank, MeshGroup g);

class ProcessMesh {
 public:
  // Validates the sizes against MPI_COMM_WORLD (validate_mesh_sizes: every
  // rank throws the same message) and builds every group. Collective over
  // the world; call it inside run_guarded.
  static ProcessMesh create(int pp, int dp, int cp, int tp, int ep = 1);
  static ProcessMesh create(const MeshSizes& sizes);
  // The same over the ranks of `parent` instead of the whole world (its
  // ranks are the mesh's world ranks): lets a test run a one-rank reference
  // and a parallel layout side by side in one job. Collective over parent.
  static ProcessMesh create(const MeshSizes& sizes, Communicator& parent);

  ProcessMesh(ProcessMesh&&) noexcept;
  ProcessMesh& operator=(ProcessMesh&&) noexcept;
  ~ProcessMesh();

  const MeshSizes& sizes() const { return sizes_; }
  const MeshCoord& coord() const { return coord_; }
  int world_rank() const { return world_rank_; }

  Communicator& group(MeshGroup g) const { return *groups_[static_cast<int>(g)]; }
  Communicator& world() const { return group(MeshGroup::World); }
  Communicator& tp() const { return group(MeshGroup::TP); }
  Communicator& cp() const { return group(MeshGroup::CP); }
  Communicator& dp() const { return group(MeshGroup::DP); }
  Communicator& pp() const { return group(MeshGroup::PP); }
  Communicator& dp_cp() const { return group(MeshGroup::DPxCP); }
  Communicator& model_parallel() const { return group(MeshGroup::ModelParallel); }
  Communicator& ep() const { return group(MeshGroup::EP); }
  Communicator& expert_dp() const { return group(MeshGroup::ExpertDP); }
  // The ranks holding the same experts as this one (edp × tp, ordered (edp,
  // tp)): the data-parallel engine of the expert groups reduces over them.
  Communicator& expert_replicas() const { return group(MeshGroup::ExpertReplicas); }

  // Pipeline neighbours as ranks of pp() (= stage numbers): -1 past the ends.
  bool is_first_stage() const { return coord_.pp == 0; }
  bool is_last_stage() const { return coord_.pp == sizes_.pp - 1; }
  int prev_stage() const { return coord_.pp - 1; }
  int next_stage() const { return coord_.pp + 1 < sizes_.pp ? coord_.pp + 1 : -1; }
  // With wrap-around (interleaved schedules pass from the last stage to the first).
  int prev_stage_wrapped() const { return (coord_.pp + sizes_.pp - 1) % sizes_.pp; }
  int next_stage_wrapped() const { return (coord_.pp + 1) % sizes_.pp; }

  // "pp=2 dp=2 cp=1 tp=2 ep=1: rank 5 = (pp 1, dp 0, cp 0, tp 1)"
  std::string describe() const;

 private:
  ProcessMesh() = default;
  static ProcessMesh create(const MeshSizes& sizes, std::unique_ptr<Communicator> world);
  MeshSizes sizes_;
  MeshCoord coord_;
  int world_rank_ = 0;
  std::vector<std::unique_ptr<Communicator>> groups_;
};

}  // namespace lattice::comm
