// Tensor: a non-owning view of memory (pointer, dtype, shape, row-major).
// Ownership lives in Buffer; a Tensor is cheap to copy and never frees.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/error.h"

namespace lattice {

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;

  Tensor() = default;
  Tensor(void* d, DType t, std::vector<int64_t> s) : data(d), dtype(t), shape(std::move(s)) {}
  static Tensor f32(float* d, std::vector<int64_t> s) { return Tensor(d, DType::F32, std::move(s)); }

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int ndim() const { return static_cast<int>(shape.size()); }
  float* f32_data() const {
    LATTICE_CHECK(dtype == DType::F32, "tensor is " << dtype_name(dtype) << ", expected f32");
    return static_cast<float*>(data);
  }
};

// "[768, 2304]"
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace lattice
