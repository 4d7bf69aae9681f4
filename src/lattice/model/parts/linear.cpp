#include "lattice/model/parts/linear.h"

#include "lattice/core/error.h"

namespace lattice::model::parts {

bool LinearParams::write_grads(float** dw, float** db) const {
  bool first = false;
  *db = nullptr;
  auto write = [&](size_t i, float** out) {
    bool acc = false;
    float* p = group->write_grad(i, &acc);
    if (i == w) first = acc, *out = p;
    if (i == static_cast<size_t>(b)) *out = p;
    LATTICE_CHECK(acc == first, "gradients of " << group->params()[w].name << " and " << group->params()[i].name
                                                << " are out of step");
  };
  for (size_t i = w; i < w + n; i++) write(i, dw);
  if (b >= 0)
    for (size_t i = static_cast<size_t>(b); i < static_cast<size_t>(b) + n; i++) write(i, db);
  return first;
}

}  // namespace lattice::model::parts
