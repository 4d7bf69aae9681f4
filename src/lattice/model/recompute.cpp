#include "lattice/model/recompute.h"

#include "lattice/core/error.h"

namespace lattice::model {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

Recompute recompute_from_name(const std::string& name) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (name == recompute_name(r)) return r;
  LATTICE_FAIL("recompute.mode must be one of none, selective, full, got \"" << name << "\"");
}

std::vector<Recompute> recompute_policy(const RecomputeSpec& spec, int first_layer, int last_layer) {
  LATTICE_CHECK(spec.every >= 1, "recompute.every must be an integer >= 1, got " << spec.every);
  LATTICE_CHECK(spec.first >= 0, "recompute.first must be an integer >= 0, got " << spec.first);
  std::vector<Recompute> policy;
  for (int l = first_layer; l < last_layer; l++) {
    const bool chosen = l % spec.every == 0 && (spec.first == 0 || l - first_layer < spec.first);
    policy.push_back(chosen ? spec.mode : Recompute::None);
  }
  return policy;
}

}  // namespace lattice::model
