// Helpers shared by the io tests.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

#include "lattice/core/error.h"

namespace lattice::io::testing {

// A fresh directory under the system temp dir, removed with its contents.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = (std::filesystem::temp_directory_path() /
             ("lattice_io_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
                .string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The message of the lattice::Error that fn throws ("" and a test failure if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const lattice::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a lattice::Error";
  return "";
}

}  // namespace lattice::io::testing

// Expects `statement` to throw lattice::Error whose message contains `substring`.
#define EXPECT_ERROR_CONTAINS(statement, substring)                                                   \
  do {                                                                                                \
    std::string lattice_msg_ = ::lattice::io::testing::error_of([&] { statement; });                  \
    EXPECT_NE(lattice_msg_.find(substring), std::string::npos)                                        \
        << "message: " << lattice_msg_ << "\n  expected to contain: " << (substring);                 \
  } while (0)
