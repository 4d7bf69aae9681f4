#include "lattice/comm/process_mesh.h"

#include <algorithm>
#include <sstream>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"

namespace lattice::comm {

const char* mesh_group_name(MeshGroup g) {
  switch (g) {
    case MeshGroup::TP: return "tp";
    case MeshGroup::CP: return "cp";
    case MeshGroup::DP: return "dp";
    case MeshGroup::PP: return "pp";
    case MeshGroup::DPxCP: return "dp_cp";
    case MeshGroup::ModelParallel: return "mp";
    case MeshGroup::EP: return "ep";
    case MeshGroup::ExpertDP: return "edp";
    case MeshGroup::ExpertReplicas: return "edp_tp";
    case MeshGroup::World: return "world";
  }
  return "?";
}

void validate_mesh_sizes(int world, int pp, int dp, int cp, int tp, int ep) {
  const std::pair<const char*, int> sizes[] = {{"dp", dp}, {"tp", tp}, {"pp", pp}, {"cp", cp}, {"ep", ep}};
  for (const auto& [key, value] : sizes)
    LATTICE_CHECK(value > 0, "parallel." << key << "=" << value
                                         << " is invalid: parallel sizes must be positive integers (1 turns a "
                                            "dimension off)");
  long long product = 1LL * pp * dp * cp * tp;
  if (product != world) {
    std::ostringstream ranks;
    if (world == 1)
      ranks << "the 1 rank of this run (started without mpiexec, or with -n 1)";
    else
      ranks << "the " << world << " ranks started by mpiexec";
    LATTICE_FAIL("parallel.pp=" << pp << " × parallel.dp=" << dp << " × parallel.cp=" << cp
                                << " × parallel.tp=" << tp << " = " << product << " does not equal " << ranks.str()
                                << "; start " << product << " ranks (mpiexec -n " << product
                                << ") or change the sizes");
  }
  LATTICE_CHECK((dp * cp) % ep == 0, "parallel.ep=" << ep << " does not divide parallel.dp × parallel.cp = " << dp
                                                    << " × " << cp << " = " << dp * cp
                                                    << " (expert-parallel groups are carved from the dp×cp ranks)");
}

void refuse_unimplemented(const MeshSizes& s, const std::vector<std::string>& implemented) {
  const struct {
    const char* key;
    int value;
    const char* technique;
  } dims[] = {{"dp", s.dp, "data parallelism"},
              {"tp", s.tp, "tensor parallelism"},
              {"pp", s.pp, "pipeline parallelism"},
              {"cp", s.cp, "context parallelism"},
              {"ep", s.ep, "expert parallelism"}};
  for (const auto& d : dims) {
    if (d.value <= 1) continue;
    if (std::find(implemented.begin(), implemented.end(), d.key) != implemented.end()) continue;
    LATTICE_FAIL("parallel." << d.key << "=" << d.value << ": " << d.technique
                             << " is not implemented yet; set parallel." << d.key << "=1");
  }
}

MeshCoord mesh_coord(const MeshSizes& s, int world_rank) {
  LATTICE_CHECK(world_rank >= 0 && world_rank < s.world(),
                "rank " << world_rank << " is outside a mesh of " << s.world() << " ranks");
  MeshCoord c;
  int r = world_rank;
  c.tp = r % s.tp;
  r /= s.tp;
  c.cp = r % s.cp;
  r /= s.cp;
  c.dp = r % s.dp;
  c.pp = r / s.dp;
  int dp_cp_index = c.dp * s.cp + c.cp;
  c.ep = dp_cp_index % s.ep;
  c.edp = dp_cp_index / s.ep;
  return c;
}

int mesh_world_rank(const MeshSizes& s, int pp, int dp, int cp, int tp) {
  return ((pp * s.dp + dp) * s.cp + cp) * s.tp + tp;
}

std::vector<int> mesh_group_ranks(const MeshSizes& s, int world_rank, MeshGroup g) {
  MeshCoord c = mesh_coord(s, world_rank);
  std::vector<int> out;
  // A rank of the dp_cp group by its index dp*cp + cp.
  auto dp_cp_member = [&](int index) { return mesh_world_rank(s, c.pp, index / s.cp, index % s.cp, c.tp); };
  switch (g) {
    case MeshGroup::TP:
      for (int t = 0; t < s.tp; t++) out.push_back(mesh_world_rank(s, c.pp, c.dp, c.cp, t));
      break;
    case MeshGroup::CP:
      for (int x = 0; x < s.cp; x++) out.push_back(mesh_world_rank(s, c.pp, c.dp, x, c.tp));
      break;
    case MeshGroup::DP:
      for (int d = 0; d < s.dp; d++) out.push_back(mesh_world_rank(s, c.pp, d, c.cp, c.tp));
      break;
    case MeshGroup::PP:
      for (int p = 0; p < s.pp; p++) out.push_back(mesh_world_rank(s, p, c.dp, c.cp, c.tp));
      break;
    case MeshGroup::DPxCP:
      for (int i = 0; i < s.dp * s.cp; i++) out.push_back(dp_cp_member(i));
      break;
    case MeshGroup::ModelParallel:
      for (int p = 0; p < s.pp; p++)
        for (int t = 0; t < s.tp; t++) out.push_back(mesh_world_rank(s, p, c.dp, c.cp, t));
      break;
    case MeshGroup::EP:
      for (int j = 0; j < s.ep; j++) out.push_back(dp_cp_member(c.edp * s.ep + j));
      break;
    case MeshGroup::ExpertDP:
      for (int b = 0; b < s.dp * s.cp / s.ep; b++) out.push_back(dp_cp_member(b * s.ep + c.ep));
      break;
    case MeshGroup::ExpertReplicas:
      for (int b = 0; b < s.dp * s.cp / s.ep; b++) {
        const int index = b * s.ep + c.ep;  // in dp_cp
        for (int t = 0; t < s.tp; t++) out.push_back(mesh_world_rank(s, c.pp, index / s.cp, index % s.cp, t));
      }
      break;
    case MeshGroup::World:
      for (int r = 0; r < s.world(); r++) out.push_back(r);
      break;
  }
  return out;
}

ProcessMesh ProcessMesh::create(int pp, int dp, int cp, int tp, int ep) {
  return create(MeshSizes{pp, dp, cp, tp, ep});
}

ProcessMesh ProcessMesh::create(const MeshSizes& sizes) { return create(sizes, make_world_communicator()); }

ProcessMesh ProcessMesh::create(const MeshSizes& sizes, Communicator& parent) {
  validate_mesh_sizes(parent.size(), sizes);
  return create(sizes, parent.split(0, parent.rank(), "world"));
}

ProcessMesh ProcessMesh::create(const MeshSizes& sizes, std::unique_ptr<Communicator> world) {
  validate_mesh_sizes(world->size(), sizes);
  ProcessMesh mesh;
  mesh.sizes_ = sizes;
  mesh.world_rank_ = world->rank();
  mesh.coord_ = mesh_coord(sizes, mesh.world_rank_);
  mesh.groups_.resize(kMeshGroupCount);
  for (int i = 0; i < kMeshGroupCount; i++) {
    MeshGroup g = static_cast<MeshGroup>(i);
    if (g == MeshGroup::World) continue;
    std::vector<int> members = mesh_group_ranks(sizes, mesh.world_rank_, g);
    // Groups of one kind partition the world, so the smallest member names the group.
    int color = *std::min_element(members.begin(), members.end());
    int key = static_cast<int>(std::find(members.begin(), members.end(), mesh.world_rank_) - members.begin());
    mesh.groups_[i] = world->split(color, key, mesh_group_name(g));
  }
  mesh.groups_[static_cast<int>(MeshGroup::World)] = std::move(world);
  return mesh;
}

ProcessMesh::ProcessMesh(ProcessMesh&&) noexcept = default;
ProcessMesh& ProcessMesh::operator=(ProcessMesh&&) noexcept = default;
ProcessMesh::~ProcessMesh() = default;

std::string ProcessMesh::describe() const {
  std::ostringstream s;
  s << "pp=" << sizes_.pp << " dp=" << sizes_.dp << " cp=" << sizes_.cp << " tp=" << sizes_.tp << " ep=" << sizes_.ep
    << ": rank " << world_rank_ << " = (pp " << coord_.pp << ", dp " << coord_.dp << ", cp " << coord_.cp << ", tp "
    << coord_.tp << ")";
  return s.str();
}

}  // namespace lattice::comm
