// Helpers shared by the data tests.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "lattice/core/error.h"
#include "lattice/data/tokenizer.h"

namespace lattice::data::testing {

inline std::string source_dir() { return LATTICE_SOURCE_DIR; }
inline std::string tokenizer_dir() { return source_dir() + "/.cache/gpt2"; }
inline std::string corpus_path() { return source_dir() + "/.cache/data/moby-dick.txt"; }
inline bool have_vocab() {
  return std::filesystem::exists(tokenizer_dir() + "/encoder.json") &&
         std::filesystem::exists(tokenizer_dir() + "/vocab.bpe");
}
inline bool have_corpus() { return std::filesystem::exists(corpus_path()); }

// The GPT-2 tokenizer, loaded once for the whole test binary (null without the files).
inline const Tokenizer* shared_tokenizer() {
  static std::unique_ptr<Tokenizer> tok = have_vocab() ? std::make_unique<Tokenizer>(Tokenizer::load(tokenizer_dir()))
                                                       : nullptr;
  return tok.get();
}

#define LATTICE_REQUIRE_VOCAB()                                                                      \
  if (!::lattice::data::testing::have_vocab())                                                       \
  GTEST_SKIP() << "GPT-2 vocabulary not found in " << ::lattice::data::testing::tokenizer_dir()      \
               << "; run scripts/setup.sh to fetch it"
#define LATTICE_REQUIRE_CORPUS()                                                                     \
  if (!::lattice::data::testing::have_corpus())                                                      \
  GTEST_SKIP() << "demo corpus not found at " << ::lattice::data::testing::corpus_path()             \
               << "; run scripts/setup.sh to fetch it"

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// A fresh folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lattice_data_test_XXXXXX").string();
    char* made = ::mkdtemp(tmpl.data());
    if (!made) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Runs fn, expects a lattice::Error whose message contains every `needles` string.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a lattice::Error";
  } catch (const lattice::Error& e) {
    std::string msg = e.what();
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
  }
}

}  // namespace lattice::data::testing
