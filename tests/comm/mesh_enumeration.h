// An independent enumeration of the mesh layout for the tests: coordinates by
// counting through nested loops (tp fastest), groups by filtering all ranks
// on the coordinates they share and sorting by the ones that vary.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "lattice/comm/process_mesh.h"

namespace mesh_enumeration {

using lattice::comm::MeshGroup;
using lattice::comm::MeshSizes;

struct Coord {
  int pp, dp, cp, tp;
};

// World rank -> coordinates, by counting through the nested loops.
inline std::vector<Coord> enumerate(const MeshSizes& s) {
  std::vector<Coord> out;
  for (int p = 0; p < s.pp; p++)
    for (int d = 0; d < s.dp; d++)
      for (int c = 0; c < s.cp; c++)
        for (int t = 0; t < s.tp; t++) out.push_back({p, d, c, t});
  return out;
}

// Members of `me`'s group: the ranks that agree with `me` on `same`, ordered
// by `order` (a tuple of coordinates, slowest first).
template <typename Same, typename Order>
std::vector<int> members(const std::vector<Coord>& all, int me, Same same, Order order) {
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(all.size()); r++)
    if (same(all[r], all[me])) out.push_back(r);
  std::stable_sort(out.begin(), out.end(), [&](int a, int b) { return order(all[a]) < order(all[b]); });
  return out;
}

inline std::vector<int> expected_group(const MeshSizes& s, const std::vector<Coord>& all, int me, MeshGroup g) {
  auto dpcp = [&](const Coord& c) { return c.dp * s.cp + c.cp; };
  switch (g) {
    case MeshGroup::TP:
      return members(all, me, [](auto& a, auto& b) { return a.pp == b.pp && a.dp == b.dp && a.cp == b.cp; },
                     [](auto& a) { return a.tp; });
    case MeshGroup::CP:
      return members(all, me, [](auto& a, auto& b) { return a.pp == b.pp && a.dp == b.dp && a.tp == b.tp; },
                     [](auto& a) { return a.cp; });
    case MeshGroup::DP:
      return members(all, me, [](auto& a, auto& b) { return a.pp == b.pp && a.cp == b.cp && a.tp == b.tp; },
                     [](auto& a) { return a.dp; });
    case MeshGroup::PP:
      return members(all, me, [](auto& a, auto& b) { return a.dp == b.dp && a.cp == b.cp && a.tp == b.tp; },
                     [](auto& a) { return a.pp; });
    case MeshGroup::DPxCP:
      return members(all, me, [](auto& a, auto& b) { return a.pp == b.pp && a.tp == b.tp; },
                     [](auto& a) { return std::make_pair(a.dp, a.cp); });
    case MeshGroup::ModelParallel:
      return members(all, me, [](auto& a, auto& b) { return a.dp == b.dp && a.cp == b.cp; },
                     [](auto& a) { return std::make_pair(a.pp, a.tp); });
    case MeshGroup::EP:  // ep consecutive ranks of the dp_cp group
      return members(
          all, me, [&](auto& a, auto& b) { return a.pp == b.pp && a.tp == b.tp && dpcp(a) / s.ep == dpcp(b) / s.ep; },
          [&](auto& a) { return dpcp(a); });
    case MeshGroup::ExpertDP:  // same position in their ep groups
      return members(
          all, me, [&](auto& a, auto& b) { return a.pp == b.pp && a.tp == b.tp && dpcp(a) % s.ep == dpcp(b) % s.ep; },
          [&](auto& a) { return dpcp(a); });
    case MeshGroup::ExpertReplicas:  // the same experts: every tp rank of those
      return members(
          all, me, [&](auto& a, auto& b) { return a.pp == b.pp && dpcp(a) % s.ep == dpcp(b) % s.ep; },
          [&](auto& a) { return std::make_pair(dpcp(a) / s.ep, a.tp); });
    case MeshGroup::World:
      return members(all, me, [](auto&, auto&) { return true; }, [](auto&) { return 0; });
  }
  return {};
}

}  // namespace mesh_enumeration
