#include "lattice/comm/placement.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/core/error.h"

namespace lattice::comm {

namespace {

std::string this_host() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

void check(int rc, const char* call) { LATTICE_CHECK(rc == MPI_SUCCESS, "node_names: " << call << " failed (" << rc << ")"); }

// "0-3,8,10-11"
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) j++;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return out;
}

// "0,1"
std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) {
    if (!out.empty()) out += ',';
    out += std::to_string(r);
  }
  return out;
}

// "A", "A and B", "A, B and C"
std::string name_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); i++) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

struct GroupKind {
  MeshGroup group;
  int size;
  const char* title;   // "tensor-parallel"
  const char* crosses; // what crosses the link when one spans nodes
  const char* remedy;
};

}  // namespace

std::vector<std::string> node_names(Communicator& comm) {
  const int n = comm.size();
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  if (mpi == nullptr || n == 1) return std::vector<std::string>(n, this_host());
  const MPI_Comm c = mpi->mpi_comm();

  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  check(MPI_Get_processor_name(name, &len), "MPI_Get_processor_name");
  // The node: the lowest rank of this rank's shared-memory group.
  MPI_Comm shared = MPI_COMM_NULL;
  check(MPI_Comm_split_type(c, MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &shared), "MPI_Comm_split_type");
  int leader = comm.rank();
  check(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, shared), "MPI_Allreduce");
  check(MPI_Comm_free(&shared), "MPI_Comm_free");

  std::vector<char> names(static_cast<size_t>(n) * MPI_MAX_PROCESSOR_NAME);
  std::vector<int> leaders(n);
  check(MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, c),
        "MPI_Allgather");
  check(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, c), "MPI_Allgather");

  // One name per node, in the order of the nodes' lowest ranks; a name two
  // nodes share (namespaces with one hostname) gets " #2", " #3"...
  std::map<int, std::string> node_name;
  std::map<std::string, int> seen;
  for (int r = 0; r < n; r++) {
    if (node_name.count(leaders[r])) continue;
    std::string host(&names[static_cast<size_t>(leaders[r]) * MPI_MAX_PROCESSOR_NAME]);
    const int k = ++seen[host];
    node_name[leaders[r]] = k == 1 ? host : host + " #" + std::to_string(k);
  }
  std::vector<std::string> out(n);
  for (int r = 0; r < n; r++) out[r] = node_name[leaders[r]];
  return out;
}

std::vector<std::string> describe_placement(const MeshSizes& sizes, const std::vector<std::string>& node_of_rank) {
  const int world = sizes.world();
  LATTICE_CHECK(static_cast<int>(node_of_rank.size()) == world,
                "describe_placement: " << node_of_rank.size() << " node names for a mesh of " << world << " ranks");
  // The nodes in the order of their first rank, and the ranks on each.
  std::vector<std::string> nodes;
  std::map<std::string, std::vector<int>> ranks_on;
  for (int r = 0; r < world; r++) {
    if (!ranks_on.count(node_of_rank[r])) nodes.push_back(node_of_rank[r]);
    ranks_on[node_of_rank[r]].push_back(r);
  }
  if (nodes.size() <= 1) return {};

  std::vector<std::string> lines;
  std::string head = "nodes: " + std::to_string(nodes.size()) + " (";
  for (size_t i = 0; i < nodes.size(); i++) {
    const std::vector<int>& rs = ranks_on[nodes[i]];
    head += (i ? "; " : "") + nodes[i] + ": rank" + (rs.size() > 1 ? "s " : " ") + rank_ranges(rs);
  }
  lines.push_back(head + ")");

  const GroupKind kinds[] = {
      {MeshGroup::TP, sizes.tp, "tensor-parallel", "every layer's all-reduces cross the link",
       "make parallel.tp divide the ranks per node"},
      {MeshGroup::CP, sizes.cp, "context-parallel", "every layer's attention exchanges cross the link",
       "make parallel.tp × parallel.cp divide the ranks per node"},
  };
  std::vector<std::string> warnings;
  for (const GroupKind& kind : kinds) {
    if (kind.size <= 1) continue;
    constexpr size_t kListed = 8;  // groups named in the line; the rest counted
    std::set<int> done;
    std::string listing;
    size_t groups = 0, spanning = 0;
    std::string first_warning;
    for (int r = 0; r < world; r++) {
      const std::vector<int> members = mesh_group_ranks(sizes, r, kind.group);
      if (!done.insert(members.front()).second) continue;
      std::vector<std::string> on;
      for (int m : members)
        if (std::find(on.begin(), on.end(), node_of_rank[m]) == on.end()) on.push_back(node_of_rank[m]);
      if (groups < kListed) {
        std::string where = on.size() == 1 ? on.front() : name_list(on);
        listing += (groups ? ", " : "") + std::string("ranks ") + rank_list(members) + " on " + where;
      }
      groups++;
      if (on.size() > 1) {
        if (spanning == 0)
          first_warning = std::string("warning: ") + kind.title + " group of ranks " + rank_list(members) +
                          " spans nodes " + name_list(on) + ": " + kind.crosses + "; " + kind.remedy;
        spanning++;
      }
    }
    if (groups > kListed) listing += ", ... (" + std::to_string(groups) + " groups)";
    lines.push_back(std::string(kind.title) + " groups: " + listing +
                    (spanning == 0 ? (groups == 1 ? " (inside one node)" : " (each inside one node)") : ""));
    if (spanning > 0) {
      if (spanning > 1)
        first_warning += " (" + std::to_string(spanning) + " of " + std::to_string(groups) + " " + kind.title +
                         " groups span nodes)";
      warnings.push_back(first_warning);
    }
  }
  lines.insert(lines.end(), warnings.begin(), warnings.end());
  return lines;
}

}  // namespace lattice::comm
