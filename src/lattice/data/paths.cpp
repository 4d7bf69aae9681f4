#include "lattice/data/paths.h"

#include <cstdlib>
#include <filesystem>

namespace lattice::data {
namespace fs = std::filesystem;
namespace {

std::string search_upwards(fs::path dir) {
  std::error_code ec;
  for (int depth = 0; depth < 16 && !dir.empty(); ++depth) {
    if (fs::is_directory(dir / ".cache" / "gpt2", ec)) return dir.string();
    fs::path parent = dir.parent_path();
    if (parent == dir) break;
    dir = parent;
  }
  return "";
}

}  // namespace

std::string find_lattice_home() {
  if (const char* home = std::getenv("LATTICE_HOME"); home && *home) return home;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    if (std::string root = search_upwards(exe.parent_path()); !root.empty()) return root;
  }
  fs::path cwd = fs::current_path(ec);
  if (!ec) return search_upwards(cwd);
  return "";
}

std::string default_tokenizer_dir() {
  std::string root = find_lattice_home();
  return root.empty() ? std::string(".cache/gpt2") : (fs::path(root) / ".cache" / "gpt2").string();
}

}  // namespace lattice::data
