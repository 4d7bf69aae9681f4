#include "lattice/parallel/data/group_hooks_router.h"

#include <string>

#include "lattice/core/error.h"
#include "lattice/parallel/data/data_parallel.h"

namespace lattice::parallel {

namespace {

std::vector<GroupHooksRouter::Route> routes_of(const std::vector<DataParallel*>& engines, size_t part) {
  std::vector<GroupHooksRouter::Route> routes;
  for (DataParallel* e : engines) {
    LATTICE_CHECK(e != nullptr, "internal: a null data-parallel engine to route group hooks to");
    routes.push_back({[e, part](size_t g) { return e->owns(part, g); }, &e->hooks(part)});
  }
  return routes;
}

size_t groups_of(const std::vector<DataParallel*>& engines, size_t part) {
  LATTICE_CHECK(!engines.empty() && engines.front() != nullptr, "internal: group hooks routed to no engine");
  return engines.front()->part_model(part).groups().size();
}

}  // namespace

GroupHooksRouter::GroupHooksRouter(size_t num_groups, const std::vector<Route>& routes)
    : of_group_(num_groups, nullptr) {
  for (size_t g = 0; g < num_groups; g++) {
    int owners = 0;
    for (const Route& r : routes) {
      LATTICE_CHECK(r.owns && r.hooks, "internal: a group hooks route without its predicate or its hooks");
      if (!r.owns(g)) continue;
      owners++;
      of_group_[g] = r.hooks;
    }
    LATTICE_CHECK(owners == 1, "internal: group " << g << " of a model part is owned by " << owners
                                                  << " data-parallel engines; every group needs exactly one");
  }
}

GroupHooksRouter::GroupHooksRouter(const std::vector<DataParallel*>& engines, size_t part)
    : GroupHooksRouter(groups_of(engines, part), routes_of(engines, part)) {
  for (DataParallel* e : engines)
    LATTICE_CHECK(&e->part_model(part) == &engines.front()->part_model(part),
                  "internal: engines routed together serve different models as part " << part);
}

model::GroupHooks& GroupHooksRouter::route(size_t g) {
  LATTICE_CHECK(g < of_group_.size(),
                "internal: group hooks called for group " << g << " of a part of " << of_group_.size() << " groups");
  return *of_group_[g];
}

}  // namespace lattice::parallel
