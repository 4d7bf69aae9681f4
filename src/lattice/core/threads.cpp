#include "lattice/core/threads.h"

#include <omp.h>
#include <unistd.h>

namespace lattice {

void set_num_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

int node_cores() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : omp_get_num_procs();
}

}  // namespace lattice
