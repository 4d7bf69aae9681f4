// `lattice prepare`: text files -> GPT-2 token shards (shard.h) for training.
//
// Each input file is one document, or several when it contains the literal
// text "<|endoftext|>" (then that text is the separator and is not encoded).
// Every document is preceded by the <|endoftext|> token, as in llm.c's
// data scripts, so the stream reads  EOT doc1 EOT doc2 ...
// The last val_fraction of the token stream is the validation split, the rest
// the training split; each is cut into shards of at most shard_tokens tokens:
// DIR/train_000000.bin, DIR/train_000001.bin, ..., DIR/val_000000.bin, ...
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "lattice/data/tokenizer.h"

namespace lattice::data {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string out_dir;
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
  std::string tokenizer_dir;  // empty: default_tokenizer_dir()
  bool overwrite = false;     // replace shards already in out_dir
  bool help = false;          // --help was given
  size_t read_block_bytes = 4 << 20;  // how much text is read at a time
};

// Parses `lattice prepare` arguments (args[0] == "prepare"). Errors name the
// option and what would be valid; unknown options are refused.
PrepareOptions parse_prepare_args(const std::vector<std::string>& args);
std::string prepare_usage();

struct PrepareSummary {
  int64_t input_bytes = 0;
  int64_t documents = 0;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::vector<std::string> train_files, val_files;
  double seconds = 0;
};

// Tokenises opt.inputs and writes the shards. Progress lines (MB done, MB/s)
// go to `progress` every few seconds when it is not null.
PrepareSummary prepare_shards(const PrepareOptions& opt, const Tokenizer& tokenizer, std::FILE* progress);

// Tokenises one document stream the way prepare does, for tests: the tokens of
// `text` with the EOT rules above, encoding in blocks of `block_bytes` cut only
// where the cut cannot change GPT-2's pre-tokenisation.
std::vector<int> encode_documents(std::string_view text, const Tokenizer& tokenizer, size_t block_bytes);

}  // namespace lattice::data
