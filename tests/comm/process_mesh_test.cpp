// ProcessMesh on real ranks: for every shape that fits the world size mpiexec
// started, each rank's coordinates and each group's members are checked
// against an independent enumeration (nested loops in tp-fastest order), and
// each group communicator is shown to really connect exactly those ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <string>
#include <vector>

#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "mesh_enumeration.h"

using namespace lattice;
using namespace lattice::comm;
using namespace mesh_enumeration;

namespace {

std::string shape(const MeshSizes& s) {
  return "pp" + std::to_string(s.pp) + " dp" + std::to_string(s.dp) + " cp" + std::to_string(s.cp) + " tp" +
         std::to_string(s.tp) + " ep" + std::to_string(s.ep);
}

void check_shape(const MeshSizes& s) {
  SCOPED_TRACE(shape(s));
  ProcessMesh mesh = ProcessMesh::create(s);
  std::vector<Coord> all = enumerate(s);
  int me = world_rank();
  ASSERT_EQ(static_cast<int>(all.size()), world_size());
  EXPECT_EQ(mesh.world_rank(), me);
  EXPECT_EQ(mesh.coord().pp, all[me].pp);
  EXPECT_EQ(mesh.coord().dp, all[me].dp);
  EXPECT_EQ(mesh.coord().cp, all[me].cp);
  EXPECT_EQ(mesh.coord().tp, all[me].tp);
  for (int i = 0; i < kMeshGroupCount; i++) {
    MeshGroup g = static_cast<MeshGroup>(i);
    SCOPED_TRACE(mesh_group_name(g));
    Communicator& comm = mesh.group(g);
    std::vector<int> want = expected_group(s, all, me, g);
    EXPECT_EQ(comm.world_ranks(), want);
    EXPECT_EQ(comm.rank(), std::find(want.begin(), want.end(), me) - want.begin());
    EXPECT_EQ(comm.name(), mesh_group_name(g));
    // The communicator really connects these ranks: gather everyone's world rank through it.
    std::vector<float> got(comm.size());
    float mine = static_cast<float>(me);
    comm.all_gather(&mine, got.data(), 1, DType::F32);
    for (int j = 0; j < comm.size(); j++) EXPECT_EQ(static_cast<int>(got[j]), want[j]);
  }
  EXPECT_EQ(mesh.ep().size(), s.ep);
  EXPECT_EQ(mesh.expert_dp().size(), s.dp * s.cp / s.ep);
  EXPECT_EQ(mesh.coord().ep, mesh.ep().rank());
  EXPECT_EQ(mesh.coord().edp, mesh.expert_dp().rank());
  // The holders of this rank's experts: every tp rank of its edp group, (edp, tp).
  EXPECT_EQ(mesh.expert_replicas().size(), s.tp * s.dp * s.cp / s.ep);
  EXPECT_EQ(mesh.expert_replicas().rank(), mesh.coord().edp * s.tp + mesh.coord().tp);

  // Pipeline neighbours: ranks of pp() holding the stages before and after.
  const Coord& c = all[me];
  auto rank_at = [&](int p) {
    for (int r = 0; r < static_cast<int>(all.size()); r++)
      if (all[r].pp == p && all[r].dp == c.dp && all[r].cp == c.cp && all[r].tp == c.tp) return r;
    return -1;
  };
  EXPECT_EQ(mesh.is_first_stage(), c.pp == 0);
  EXPECT_EQ(mesh.is_last_stage(), c.pp == s.pp - 1);
  if (c.pp > 0)
    EXPECT_EQ(mesh.pp().world_ranks()[mesh.prev_stage()], rank_at(c.pp - 1));
  else
    EXPECT_EQ(mesh.prev_stage(), -1);
  if (c.pp < s.pp - 1)
    EXPECT_EQ(mesh.pp().world_ranks()[mesh.next_stage()], rank_at(c.pp + 1));
  else
    EXPECT_EQ(mesh.next_stage(), -1);
  EXPECT_EQ(mesh.pp().world_ranks()[mesh.next_stage_wrapped()], rank_at((c.pp + 1) % s.pp));
  EXPECT_EQ(mesh.pp().world_ranks()[mesh.prev_stage_wrapped()], rank_at((c.pp + s.pp - 1) % s.pp));
}

}  // namespace

TEST(ProcessMesh, ShapesOfThisWorld) {
  // {pp, dp, cp, tp, ep}; only those whose product is the world size run.
  const MeshSizes shapes[] = {
      {1, 1, 1, 1, 1},                                                                    // 1
      {1, 2, 1, 1, 2}, {2, 1, 1, 1, 1}, {1, 1, 1, 2, 1},                                  // 2
      {3, 1, 1, 1, 1}, {1, 3, 1, 1, 3},                                                   // 3
      {2, 1, 1, 2, 1}, {1, 2, 2, 1, 4}, {1, 1, 2, 2, 1},                                  // 4
      {2, 2, 1, 2, 1}, {1, 2, 2, 2, 2}, {1, 2, 2, 2, 4}, {2, 4, 1, 1, 2}, {2, 1, 2, 2, 1}, {8, 1, 1, 1, 1},
      {1, 1, 1, 8, 1}, {1, 8, 1, 1, 8},                                                   // 8
      {3, 2, 1, 2, 1}, {1, 3, 2, 2, 3}, {1, 3, 2, 2, 6}, {2, 3, 1, 2, 3}, {1, 6, 2, 1, 4},  // 12
  };
  int tested = 0;
  for (const MeshSizes& s : shapes) {
    if (s.world() != world_size()) continue;
    check_shape(s);
    tested++;
  }
  EXPECT_GT(tested, 0) << "no shape for " << world_size() << " ranks";
}

TEST(ProcessMesh, WrongProductIsRefusedOnEveryRankWithoutCommunicating) {
  int n = world_size();
  try {
    ProcessMesh::create(1, n + 1, 1, 1, 1);
    ADD_FAILURE() << "a mesh of " << n + 1 << " ranks was built on " << n;
  } catch (const Error& e) {
    std::string want = "parallel.pp=1 × parallel.dp=" + std::to_string(n + 1) + " × parallel.cp=1 × parallel.tp=1 = " +
                       std::to_string(n + 1) + " does not equal ";
    EXPECT_EQ(std::string(e.what()).substr(0, want.size()), want) << e.what();
  }
}
