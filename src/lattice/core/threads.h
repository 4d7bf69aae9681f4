// Thread count for OpenMP regions and the GEMM library.
#pragma once

namespace lattice {

// Sets the number of threads used by every parallel region that follows
// (OpenMP and the GEMM library). n <= 0 means "all cores".
void set_num_threads(int n);
int num_threads();

}  // namespace lattice
