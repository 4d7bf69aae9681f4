// Thread count for OpenMP regions and the GEMM library.
#pragma once

namespace lattice {

// Sets the number of threads used by every parallel region that follows
// (OpenMP and the GEMM library). n <= 0 means "all cores".
void set_num_threads(int n);
int num_threads();
// Cores online on this machine, whatever this process's affinity mask allows
// (omp_get_num_procs() counts the mask: mpiexec's binding shows there).
int node_cores();

}  // namespace lattice
