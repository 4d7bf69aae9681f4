// lattice prepare --input FILE... --out DIR [--val-fraction F] [--shard-tokens N]
// The work is in lattice/data/prepare.h; this file is the command line.
#include <cstdio>
#include <string>
#include <vector>

#include "lattice/cli/command.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "lattice/data/paths.h"
#include "lattice/data/prepare.h"
#include "lattice/data/tokenizer.h"

namespace {

int run_prepare(const std::vector<std::string>& args) {
  using namespace lattice::data;
  PrepareOptions opt = parse_prepare_args(args);
  if (opt.help) {
    std::fputs(prepare_usage().c_str(), stdout);
    return 0;
  }
  // Every rank would write the same files: prepare is a one-process tool.
  LATTICE_CHECK(lattice::comm::world_size() == 1,
                "prepare: runs in one process, not under mpirun (world size " << lattice::comm::world_size() << ")");
  const std::string tokenizer_dir = opt.tokenizer_dir.empty() ? default_tokenizer_dir() : opt.tokenizer_dir;
  Tokenizer tokenizer = Tokenizer::load(tokenizer_dir);
  PrepareSummary s = prepare_shards(opt, tokenizer, stdout);
  std::printf("prepare: %zu file(s), %lld document(s), %.2f MB in %.2f s (%.2f MB/s)\n", opt.inputs.size(),
              static_cast<long long>(s.documents), s.input_bytes / 1e6, s.seconds,
              s.seconds > 0 ? s.input_bytes / 1e6 / s.seconds : 0.0);
  std::printf("prepare: %lld tokens: train %lld in %zu shard(s), val %lld in %zu shard(s)\n",
              static_cast<long long>(s.train_tokens + s.val_tokens), static_cast<long long>(s.train_tokens),
              s.train_files.size(), static_cast<long long>(s.val_tokens), s.val_files.size());
  for (const auto& f : s.train_files) std::printf("  %s\n", f.c_str());
  for (const auto& f : s.val_files) std::printf("  %s\n", f.c_str());
  return 0;
}

}  // namespace

LATTICE_REGISTER_COMMAND("prepare", "tokenise text files into .bin token shards", run_prepare);
