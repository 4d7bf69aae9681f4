// Single-process tests of the comm layer's pure parts: mesh arithmetic against
// an independent enumeration for many shapes, the [parallel] error messages,
// the MPI thread-level check, the watchdog timeout settings and the run
// header's placement lines.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>

#include "lattice/comm/placement.h"
#include "lattice/comm/process_mesh.h"
#include "lattice/comm/runtime.h"
#include "lattice/comm/watchdog.h"
#include "lattice/core/error.h"
#include "mesh_enumeration.h"

using namespace lattice;
using namespace lattice::comm;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(MeshLayout, CoordinatesAndGroupsMatchAnIndependentEnumeration) {
  const MeshSizes shapes[] = {{1, 1, 1, 1, 1}, {2, 2, 1, 2, 1}, {3, 2, 1, 2, 1}, {1, 3, 2, 2, 3}, {1, 3, 2, 2, 6},
                              {2, 3, 1, 2, 3}, {1, 6, 2, 1, 4}, {2, 2, 2, 2, 2}, {2, 2, 2, 2, 4}, {4, 1, 3, 2, 1},
                              {1, 4, 1, 4, 2}, {3, 4, 2, 1, 8}, {2, 1, 1, 1, 1}, {1, 1, 1, 6, 1}};
  for (const MeshSizes& s : shapes) {
    std::vector<mesh_enumeration::Coord> all = mesh_enumeration::enumerate(s);
    for (int r = 0; r < s.world(); r++) {
      MeshCoord c = mesh_coord(s, r);
      EXPECT_EQ(c.pp, all[r].pp);
      EXPECT_EQ(c.dp, all[r].dp);
      EXPECT_EQ(c.cp, all[r].cp);
      EXPECT_EQ(c.tp, all[r].tp);
      EXPECT_EQ(mesh_world_rank(s, c.pp, c.dp, c.cp, c.tp), r);
      for (int g = 0; g < kMeshGroupCount; g++) {
        MeshGroup group = static_cast<MeshGroup>(g);
        EXPECT_EQ(mesh_group_ranks(s, r, group), mesh_enumeration::expected_group(s, all, r, group))
            << "group " << mesh_group_name(group) << " of rank " << r << " in pp" << s.pp << " dp" << s.dp << " cp"
            << s.cp << " tp" << s.tp << " ep" << s.ep;
      }
      std::vector<int> ep = mesh_group_ranks(s, r, MeshGroup::EP);
      std::vector<int> edp = mesh_group_ranks(s, r, MeshGroup::ExpertDP);
      std::vector<int> replicas = mesh_group_ranks(s, r, MeshGroup::ExpertReplicas);
      EXPECT_EQ(ep[c.ep], r);
      EXPECT_EQ(edp[c.edp], r);
      ASSERT_EQ(static_cast<int>(replicas.size()), s.tp * s.dp * s.cp / s.ep);
      EXPECT_EQ(replicas[c.edp * s.tp + c.tp], r);
    }
    // Each kind partitions the world: every rank is in exactly one group of it
    // (its members all name the same group).
    for (int g = 0; g < kMeshGroupCount; g++) {
      const MeshGroup group = static_cast<MeshGroup>(g);
      std::vector<int> seen(static_cast<size_t>(s.world()), 0);
      for (int r = 0; r < s.world(); r++) {
        const std::vector<int> members = mesh_group_ranks(s, r, group);
        EXPECT_NE(std::find(members.begin(), members.end(), r), members.end()) << mesh_group_name(group);
        for (int m : members) EXPECT_EQ(mesh_group_ranks(s, m, group), members) << mesh_group_name(group);
        if (*std::min_element(members.begin(), members.end()) == r)  // count each group once, at its smallest rank
          for (int m : members) seen[static_cast<size_t>(m)]++;
      }
      for (int r = 0; r < s.world(); r++)
        EXPECT_EQ(seen[static_cast<size_t>(r)], 1) << "rank " << r << " in group kind " << mesh_group_name(group);
    }
  }
}

TEST(MeshSizesCheck, WorldSizeMustEqualTheProduct) {
  EXPECT_EQ(error_of([] { validate_mesh_sizes(2, 1, 3, 1, 1, 1); }),
            "parallel.pp=1 × parallel.dp=3 × parallel.cp=1 × parallel.tp=1 = 3 does not equal the 2 ranks started by "
            "mpiexec; start 3 ranks (mpiexec -n 3) or change the sizes");
  EXPECT_EQ(error_of([] { validate_mesh_sizes(1, 2, 1, 1, 2, 1); }),
            "parallel.pp=2 × parallel.dp=1 × parallel.cp=1 × parallel.tp=2 = 4 does not equal the 1 rank of this run "
            "(started without mpiexec, or with -n 1); start 4 ranks (mpiexec -n 4) or change the sizes");
  EXPECT_EQ(error_of([] { validate_mesh_sizes(12, 3, 2, 1, 2, 1); }), "(no error)");
}

TEST(MeshSizesCheck, SizesMustBePositive) {
  EXPECT_EQ(error_of([] { validate_mesh_sizes(2, 1, 2, 1, 0, 1); }),
            "parallel.tp=0 is invalid: parallel sizes must be positive integers (1 turns a dimension off)");
  EXPECT_EQ(error_of([] { validate_mesh_sizes(2, -2, 1, 1, 1, 1); }),
            "parallel.pp=-2 is invalid: parallel sizes must be positive integers (1 turns a dimension off)");
  EXPECT_EQ(error_of([] { validate_mesh_sizes(2, 1, 2, 1, 1, 0); }),
            "parallel.ep=0 is invalid: parallel sizes must be positive integers (1 turns a dimension off)");
}

TEST(MeshSizesCheck, EpMustDivideDpTimesCp) {
  EXPECT_EQ(error_of([] { validate_mesh_sizes(4, 1, 2, 2, 1, 3); }),
            "parallel.ep=3 does not divide parallel.dp × parallel.cp = 2 × 2 = 4 (expert-parallel groups are carved "
            "from the dp×cp ranks)");
  EXPECT_EQ(error_of([] { validate_mesh_sizes(8, 1, 2, 2, 2, 4); }), "(no error)");
}

TEST(MeshSizesCheck, UnimplementedDimensionsAreRefusedByName) {
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 1, 1, 2, 1}); }),
            "parallel.tp=2: tensor parallelism is not implemented yet; set parallel.tp=1");
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 3, 1, 1, 1}); }),
            "parallel.dp=3: data parallelism is not implemented yet; set parallel.dp=1");
  EXPECT_EQ(error_of([] { refuse_unimplemented({2, 1, 1, 1, 1}); }),
            "parallel.pp=2: pipeline parallelism is not implemented yet; set parallel.pp=1");
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 1, 2, 1, 1}); }),
            "parallel.cp=2: context parallelism is not implemented yet; set parallel.cp=1");
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 2, 1, 1, 2}, {"dp"}); }),
            "parallel.ep=2: expert parallelism is not implemented yet; set parallel.ep=1");
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 2, 1, 2, 1}, {"dp", "tp"}); }), "(no error)");
  EXPECT_EQ(error_of([] { refuse_unimplemented({1, 1, 1, 1, 1}); }), "(no error)");
}

TEST(Runtime, ThreadLevelBelowMultipleIsRefusedWithItsName) {
  EXPECT_EQ(error_of([] { require_thread_level(MPI_THREAD_MULTIPLE); }), "(no error)");
  std::string e = error_of([] { require_thread_level(MPI_THREAD_SERIALIZED); });
  EXPECT_EQ(e.substr(0, 85),
            "the MPI library granted MPI_THREAD_SERIALIZED but lattice needs MPI_THREAD_MULTIPLE (");
}

TEST(Watchdog, TimeoutMustBePositiveAndComesFromTheEnvironment) {
  double old = watchdog_timeout();
  EXPECT_EQ(old, kDefaultWatchdogTimeoutS);
  EXPECT_EQ(error_of([] { set_watchdog_timeout(0); }),
            "watchdog timeout 0 s is invalid: it must be a positive number of seconds");
  setenv("LATTICE_COMM_TIMEOUT_S", "2.5", 1);
  load_watchdog_timeout_from_env();
  EXPECT_EQ(watchdog_timeout(), 2.5);
  setenv("LATTICE_COMM_TIMEOUT_S", "-1", 1);
  EXPECT_EQ(error_of([] { load_watchdog_timeout_from_env(); }),
            "LATTICE_COMM_TIMEOUT_S='-1' is not a positive number of seconds (e.g. LATTICE_COMM_TIMEOUT_S=60)");
  unsetenv("LATTICE_COMM_TIMEOUT_S");
  set_watchdog_timeout(old);
}

// mpirun fills each node's slots with consecutive ranks: nodes of `per_node`.
std::vector<std::string> filled_nodes(int world, int per_node) {
  std::vector<std::string> out;
  for (int r = 0; r < world; r++) out.push_back("node" + std::to_string(r / per_node));
  return out;
}

TEST(Placement, OneNodeSaysNothing) {
  EXPECT_TRUE(describe_placement({1, 2, 1, 2, 1}, filled_nodes(4, 4)).empty());
}

TEST(Placement, TensorGroupsInsideNodesAreListedWithoutWarning) {
  // dp2 x tp2 on 2 nodes x 2 ranks: each TP group is one node's two ranks.
  const std::vector<std::string> lines = describe_placement({1, 2, 1, 2, 1}, filled_nodes(4, 2));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "nodes: 2 (node0: ranks 0-1; node1: ranks 2-3)");
  EXPECT_EQ(lines[1], "tensor-parallel groups: ranks 0,1 on node0, ranks 2,3 on node1 (each inside one node)");
}

TEST(Placement, TensorGroupAcrossNodesIsWarnedAbout) {
  // tp2 on 2 nodes x 1 rank.
  std::vector<std::string> lines = describe_placement({1, 1, 1, 2, 1}, {"A", "B"});
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "nodes: 2 (A: rank 0; B: rank 1)");
  EXPECT_EQ(lines[1], "tensor-parallel groups: ranks 0,1 on A and B");
  EXPECT_EQ(lines[2],
            "warning: tensor-parallel group of ranks 0,1 spans nodes A and B: every layer's all-reduces cross the "
            "link; make parallel.tp divide the ranks per node");
  // tp4 on 2 nodes x 2 ... and tp2 on nodes of 3 ranks: group 2,3 straddles.
  lines = describe_placement({1, 3, 1, 2, 1}, filled_nodes(6, 3));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], "tensor-parallel groups: ranks 0,1 on node0, ranks 2,3 on node0 and node1, ranks 4,5 on node1");
  EXPECT_EQ(lines[2].substr(0, 75), "warning: tensor-parallel group of ranks 2,3 spans nodes node0 and node1: ev");
}

TEST(Placement, ContextGroupsAndManyGroups) {
  // cp2 x tp2 on 2 nodes x 2: TP inside the nodes, every CP group across them.
  std::vector<std::string> lines = describe_placement({1, 1, 2, 2, 1}, filled_nodes(4, 2));
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[1], "tensor-parallel groups: ranks 0,1 on node0, ranks 2,3 on node1 (each inside one node)");
  EXPECT_EQ(lines[2], "context-parallel groups: ranks 0,2 on node0 and node1, ranks 1,3 on node0 and node1");
  EXPECT_EQ(lines[3],
            "warning: context-parallel group of ranks 0,2 spans nodes node0 and node1: every layer's attention "
            "exchanges cross the link; make parallel.tp × parallel.cp divide the ranks per node (2 of 2 "
            "context-parallel groups span nodes)");
  // 20 TP groups of 2 on 5 nodes of 8: eight named, the rest counted.
  lines = describe_placement({1, 20, 1, 2, 1}, filled_nodes(40, 8));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "nodes: 5 (node0: ranks 0-7; node1: ranks 8-15; node2: ranks 16-23; node3: ranks 24-31; "
                      "node4: ranks 32-39)");
  EXPECT_NE(lines[1].find("ranks 14,15 on node1, ... (20 groups) (each inside one node)"), std::string::npos)
      << lines[1];
  EXPECT_EQ(error_of([] { describe_placement({1, 2, 1, 1, 1}, {"a"}); }),
            "describe_placement: 1 node names for a mesh of 2 ranks");
}
