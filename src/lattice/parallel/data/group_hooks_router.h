// GroupHooksRouter: one model part's GroupHooks when several data-parallel
// engines serve the model, each owning some of its groups (mixture of
// experts: the dense groups reduced over dp×cp, each layer's experts over the
// ranks that hold the same experts; data_parallel.h). A model part has one
// hooks pointer; the router is it, and forwards each call for group g to the
// hooks of the one engine that owns g. Installed with GPT::set_hooks on the
// part, over engines built with DataParallelOptions::install_hooks = false.
#pragma once

#include <functional>
#include <vector>

#include "lattice/model/gpt.h"

namespace lattice::parallel {

class DataParallel;

class GroupHooksRouter final : public model::GroupHooks {
 public:
  // Who serves some of the part's groups: `owns(g)`, and the hooks that get
  // the calls for those groups (not owned).
  struct Route {
    std::function<bool(size_t g)> owns;
    model::GroupHooks* hooks = nullptr;
  };
  // Routes for a part of `num_groups` groups: every group must be owned by
  // exactly one route (checked here, naming the group).
  GroupHooksRouter(size_t num_groups, const std::vector<Route>& routes);
  // The engines' hooks for their part `part` (DataParallel::owns, hooks).
  GroupHooksRouter(const std::vector<DataParallel*>& engines, size_t part);

  void before_params(size_t g, Pass pass) override { route(g).before_params(g, pass); }
  void after_params(size_t g, Pass pass) override { route(g).after_params(g, pass); }
  void before_grads(size_t g) override { route(g).before_grads(g); }
  void grads_done(size_t g) override { route(g).grads_done(g); }

  // The hooks that serve group g.
  model::GroupHooks& route(size_t g);

 private:
  std::vector<model::GroupHooks*> of_group_;
};

}  // namespace lattice::parallel
