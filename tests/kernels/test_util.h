// Helpers for the kernel tests: deterministic random data, double-precision
// comparisons, thread-count scopes and central finite differences.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"

namespace lattice::kernels::test {

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f, float offset = 0.0f) {
  Rng rng(seed, 7);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + scale * rng.next_normal();
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Sets the thread count for the lifetime of the scope.
class ThreadScope {
 public:
  explicit ThreadScope(int n) : previous_(omp_get_max_threads()) { set_num_threads(n); }
  ~ThreadScope() { set_num_threads(previous_); }

 private:
  int previous_;
};

// Every element within atol + rtol·|want|; reports the worst one.
inline void expect_close(const float* got, const double* want, size_t n, double atol, double rtol,
                         const std::string& what) {
  double worst = 0.0;
  size_t worst_i = 0;
  bool bad = false;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::fabs(want[i]);
    if (!(err <= tol)) bad = true;
    const double excess = err / tol;
    if (!(excess <= worst)) worst = excess, worst_i = i;  // NaN counts as worst
  }
  EXPECT_FALSE(bad) << what << ": worst element " << worst_i << " got " << got[worst_i] << " want "
                    << want[worst_i] << " (" << worst << "× the tolerance)";
}
inline void expect_close(const std::vector<float>& got, const std::vector<double>& want, double atol, double rtol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  expect_close(got.data(), want.data(), got.size(), atol, rtol, what);
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// Central difference of a scalar function f of x along element i:
// (f(x + h e_i) - f(x - h e_i)) / 2h. x is restored afterwards.
template <typename T>
double central_difference(std::vector<T>& x, size_t i, const std::function<double()>& f, T h) {
  const T saved = x[i];
  x[i] = saved + h;
  const double up = f();
  x[i] = saved - h;
  const double down = f();
  x[i] = saved;
  return (up - down) / (2 * static_cast<double>(h));
}

// The central difference of a double-precision function at every element.
inline std::vector<double> finite_difference(std::vector<double>& x, const std::function<double()>& f,
                                             double h = 1e-6) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) grad[i] = central_difference(x, i, f, h);
  return grad;
}

// A float kernel's gradient `grad` at the given elements of x, each held to
// `atol` of the central difference of f.
inline void expect_float_finite_differences(std::vector<float>& x, const std::vector<int>& elements,
                                            const std::function<double()>& f, const float* grad, double atol,
                                            const std::string& what, float h = 1e-2f) {
  for (int idx : elements)
    EXPECT_NEAR(grad[idx], central_difference(x, static_cast<size_t>(idx), f, h), atol)
        << what << " element " << idx;
}

inline void expect_close_d(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                           const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  size_t worst_i = 0;
  bool bad = false;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double tol = atol + rtol * std::fabs(want[i]);
    if (!(err <= tol)) bad = true;
    if (!(err / tol <= worst)) worst = err / tol, worst_i = i;
  }
  EXPECT_FALSE(bad) << what << ": worst element " << worst_i << " got " << got[worst_i] << " want " << want[worst_i];
}

// The message of the lattice::Error that f throws, or "(no error)".
inline std::string error_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace lattice::kernels::test
