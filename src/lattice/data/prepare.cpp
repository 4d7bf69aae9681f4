#include "lattice/data/prepare.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <regex>

#include "lattice/core/error.h"
#include "lattice/core/timer.h"
#include "lattice/data/paths.h"
#include "lattice/data/shard.h"

namespace lattice::data {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kEotText = "<|endoftext|>";

bool is_visible_ascii(char c) { return c > ' ' && c < 0x7F; }

// Length of the longest prefix of `text` after which encoding can be cut
// without changing a single token: right after a "\n" that has a visible ASCII
// character on both sides. That newline is a one-character white-space run
// (\s+ alone, or \s+(?!\S) at the end of the prefix: the same piece), the piece
// before it ends at it whatever follows, and the next piece starts after it in
// both cases. Only newlines at index >= `from` are considered (the text
// before was searched already). Returns 0 when there is no such place.
size_t safe_cut(std::string_view text, size_t from) {
  from = std::max<size_t>(from, 1);
  if (text.size() < 3 || from > text.size() - 2) return 0;
  size_t last = text.size() - 2;  // a candidate needs a character after it
  while (true) {
    const void* hit = memrchr(text.data() + from, '\n', last - from + 1);  // search [from, last]
    if (!hit) return 0;
    size_t i = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    if (is_visible_ascii(text[i - 1]) && is_visible_ascii(text[i + 1])) return i + 1;
    if (i <= from) return 0;
    last = i - 1;
  }
}

// Turns a stream of text blocks into tokens with the document rules of
// prepare.h, holding back the tail of the text that could not yet be cut.
class StreamEncoder {
 public:
  StreamEncoder(const Tokenizer& tokenizer, std::vector<int>* out) : tok_(tokenizer), out_(out) {}

  void begin_file() {
    if (out_->empty() || !doc_empty_) emit_eot();
  }
  void feed(std::string_view block) {
    // Places before the last character of the old text were searched before.
    size_t from = pending_.empty() ? 0 : pending_.size() - 1;
    pending_.append(block);
    size_t cut = safe_cut(pending_, from);
    if (cut == 0) return;
    encode_text(std::string_view(pending_).substr(0, cut));
    pending_.erase(0, cut);
  }
  void end_file() {
    encode_text(pending_);
    pending_.clear();
  }
  int64_t documents() const { return documents_; }

 private:
  void emit_eot() {
    out_->push_back(tok_.eot());
    doc_empty_ = true;
    ++documents_;
  }
  // Text without a partial "<|endoftext|>" at either end (cuts are at newlines).
  void encode_text(std::string_view text) {
    while (!text.empty()) {
      size_t sep = text.find(kEotText);
      std::string_view part = text.substr(0, sep);
      if (!part.empty()) {
        tok_.encode_append(part, out_);
        doc_empty_ = false;
      }
      if (sep == std::string_view::npos) break;
      if (!doc_empty_) emit_eot();
      text.remove_prefix(sep + kEotText.size());
    }
  }

  const Tokenizer& tok_;
  std::vector<int>* out_;
  std::string pending_;
  bool doc_empty_ = true;
  int64_t documents_ = 0;
};

[[noreturn]] void usage_error(const std::string& message) { LATTICE_FAIL("prepare: " << message); }

double parse_fraction(const std::string& value) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno != 0 || !std::isfinite(v) || v < 0 || v >= 1)
    usage_error("--val-fraction must be a number in [0, 1), got '" + value + "'");
  return v;
}

int64_t parse_token_count(const std::string& value) {
  // A whole number, optionally with K, M or G (x1000, x1e6, x1e9).
  std::string digits = value;
  int64_t scale = 1;
  if (!digits.empty()) {
    char suffix = digits.back();
    if (suffix == 'K' || suffix == 'k') scale = 1000;
    if (suffix == 'M' || suffix == 'm') scale = 1000000;
    if (suffix == 'G' || suffix == 'g') scale = 1000000000;
    if (scale != 1) digits.pop_back();
  }
  bool ok = !digits.empty() && digits.size() <= 12 &&
            digits.find_first_not_of("0123456789") == std::string::npos;
  int64_t v = ok ? std::stoll(digits) * scale : 0;
  if (!ok || v < 1 || v > kMaxShardTokens)
    usage_error("--shard-tokens must be a whole number of tokens in [1, " + std::to_string(kMaxShardTokens) +
                "] (e.g. 100000000 or 100M), got '" + value + "'");
  return v;
}

bool is_shard_name(const std::string& name) {
  static const std::regex re("(train|val)_[0-9]{6}\\.bin");
  return std::regex_match(name, re);
}

std::string shard_path(const std::string& dir, const char* split, size_t index) {
  char name[32];
  std::snprintf(name, sizeof(name), "%s_%06zu.bin", split, index);
  return (fs::path(dir) / name).string();
}

std::vector<std::string> write_split(const std::string& dir, const char* split, const std::vector<uint16_t>& tokens,
                                     int64_t begin, int64_t end, int64_t shard_tokens) {
  std::vector<std::string> files;
  for (int64_t start = begin; start < end; start += shard_tokens) {
    int64_t count = std::min(shard_tokens, end - start);
    files.push_back(shard_path(dir, split, files.size()));
    write_shard(files.back(), tokens.data() + start, count);
  }
  return files;
}

}  // namespace

std::string prepare_usage() {
  return "usage: lattice prepare --input FILE... --out DIR [options]\n"
         "\n"
         "Tokenises text files with the GPT-2 BPE into token shards (llm.c's .bin layout):\n"
         "DIR/train_000000.bin ... and DIR/val_000000.bin ...\n"
         "Each file is one document (or several, separated by the literal text <|endoftext|>);\n"
         "every document is preceded by the <|endoftext|> token (50256).\n"
         "\n"
         "options:\n"
         "  --input FILE...       text files (UTF-8), one or more\n"
         "  --out DIR             output folder (created if missing)\n"
         "  --val-fraction F      share of the token stream, taken from its end, for validation\n"
         "                        (default 0.1; 0 writes no val shard)\n"
         "  --shard-tokens N      at most N tokens per shard (default 100M; K/M/G suffixes)\n"
         "  --tokenizer DIR       folder with encoder.json and vocab.bpe (default .cache/gpt2)\n"
         "  --overwrite           replace train_*.bin/val_*.bin shards already in DIR\n"
         "  --help                this text\n";
}

PrepareOptions parse_prepare_args(const std::vector<std::string>& args) {
  PrepareOptions opt;
  for (size_t i = 1; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool has_inline_value = false;
    if (flag.rfind("--", 0) == 0) {
      if (size_t eq = flag.find('='); eq != std::string::npos) {
        value = flag.substr(eq + 1);
        flag = flag.substr(0, eq);
        has_inline_value = true;
      }
    }
    auto take_value = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) usage_error(flag + " needs a value");
      return args[++i];
    };
    if (flag == "--help" || flag == "-h") {
      opt.help = true;
    } else if (flag == "--input") {
      if (has_inline_value) {
        opt.inputs.push_back(value);
      } else {
        size_t before = opt.inputs.size();
        while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) opt.inputs.push_back(args[++i]);
        if (opt.inputs.size() == before) usage_error("--input needs at least one FILE");
      }
    } else if (flag == "--out") {
      opt.out_dir = take_value();
    } else if (flag == "--val-fraction") {
      opt.val_fraction = parse_fraction(take_value());
    } else if (flag == "--shard-tokens") {
      opt.shard_tokens = parse_token_count(take_value());
    } else if (flag == "--tokenizer") {
      opt.tokenizer_dir = take_value();
    } else if (flag == "--overwrite") {
      if (has_inline_value) usage_error("--overwrite takes no value");
      opt.overwrite = true;
    } else if (flag.rfind("-", 0) == 0) {
      usage_error("unknown option '" + flag +
                  "' (valid: --input, --out, --val-fraction, --shard-tokens, --tokenizer, --overwrite, --help)");
    } else {
      usage_error("unexpected argument '" + flag + "' (input files follow --input)");
    }
  }
  if (opt.help) return opt;
  if (opt.inputs.empty()) usage_error("--input FILE... is required");
  if (opt.out_dir.empty()) usage_error("--out DIR is required");
  return opt;
}

std::vector<int> encode_documents(std::string_view text, const Tokenizer& tokenizer, size_t block_bytes) {
  std::vector<int> ids;
  StreamEncoder enc(tokenizer, &ids);
  enc.begin_file();
  for (size_t pos = 0; pos < text.size(); pos += block_bytes) enc.feed(text.substr(pos, block_bytes));
  enc.end_file();
  return ids;
}

PrepareSummary prepare_shards(const PrepareOptions& opt, const Tokenizer& tokenizer, std::FILE* progress) {
  LATTICE_CHECK(!opt.inputs.empty(), "prepare: no input files");
  LATTICE_CHECK(tokenizer.vocab_size() <= 65536, "prepare: the vocabulary has " << tokenizer.vocab_size()
                                                     << " tokens; shards hold uint16 tokens (at most 65536)");
  LATTICE_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1,
                "prepare: --val-fraction must be in [0, 1), got " << opt.val_fraction);
  LATTICE_CHECK(opt.shard_tokens >= 1 && opt.shard_tokens <= kMaxShardTokens,
                "prepare: --shard-tokens must be in [1, " << kMaxShardTokens << "], got " << opt.shard_tokens);
  LATTICE_CHECK(opt.read_block_bytes >= 1, "prepare: read_block_bytes must be positive");

  // Check everything that can be checked before the long part.
  PrepareSummary summary;
  int64_t total_bytes = 0;
  for (const std::string& path : opt.inputs) {
    std::error_code ec;
    LATTICE_CHECK(fs::exists(path, ec), "prepare: input file " << path << " not found");
    LATTICE_CHECK(fs::is_regular_file(path, ec), "prepare: input " << path << " is not a regular file");
    total_bytes += static_cast<int64_t>(fs::file_size(path, ec));
  }
  std::error_code ec;
  LATTICE_CHECK(!fs::exists(opt.out_dir, ec) || fs::is_directory(opt.out_dir, ec),
                "prepare: --out " << opt.out_dir << " exists and is not a folder");
  fs::create_directories(opt.out_dir, ec);
  LATTICE_CHECK(!ec, "prepare: cannot create --out folder " << opt.out_dir << ": " << ec.message());
  std::vector<fs::path> old_shards;
  for (const auto& entry : fs::directory_iterator(opt.out_dir)) {
    if (is_shard_name(entry.path().filename().string())) old_shards.push_back(entry.path());
  }
  std::sort(old_shards.begin(), old_shards.end());
  LATTICE_CHECK(old_shards.empty() || opt.overwrite,
                "prepare: " << opt.out_dir << " already holds " << old_shards.size() << " token shard(s) ("
                            << old_shards.front().filename().string()
                            << "...); pass --overwrite to replace them, or choose another --out");

  // Tokenise, streaming each file in blocks.
  Timer timer;
  double last_report = 0;
  std::vector<uint16_t> tokens;
  std::vector<int> ids;
  StreamEncoder enc(tokenizer, &ids);
  std::string block(opt.read_block_bytes, '\0');
  auto flush_ids = [&] {
    tokens.insert(tokens.end(), ids.begin(), ids.end());  // ids < vocab_size <= 65536
    ids.clear();
  };
  for (const std::string& path : opt.inputs) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    LATTICE_CHECK(f, "prepare: cannot open input file " << path << ": " << std::strerror(errno));
    enc.begin_file();
    while (true) {
      size_t n = std::fread(block.data(), 1, block.size(), f);
      if (n == 0) {
        bool failed = std::ferror(f);
        std::fclose(f);
        LATTICE_CHECK(!failed, "prepare: read error in " << path);
        break;
      }
      enc.feed(std::string_view(block.data(), n));
      flush_ids();
      summary.input_bytes += static_cast<int64_t>(n);
      double now = timer.seconds();
      if (progress && now - last_report >= 2.0) {
        last_report = now;
        std::fprintf(progress, "prepare: %.1f of %.1f MB (%.0f%%), %.2f MB/s, %lld tokens\n",
                     summary.input_bytes / 1e6, total_bytes / 1e6,
                     total_bytes > 0 ? 100.0 * summary.input_bytes / total_bytes : 100.0,
                     summary.input_bytes / 1e6 / now, static_cast<long long>(tokens.size()));
        std::fflush(progress);
      }
    }
    enc.end_file();
    flush_ids();
  }
  summary.documents = enc.documents();

  // Split: val is the last val_fraction of the stream.
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t val = std::llround(static_cast<double>(total) * opt.val_fraction);
  LATTICE_CHECK(opt.val_fraction == 0 || val > 0,
                "prepare: --val-fraction " << opt.val_fraction << " of " << total
                                           << " tokens is no token at all; give more text or --val-fraction 0");
  LATTICE_CHECK(total - val > 0, "prepare: no token left for training (" << total << " tokens, --val-fraction "
                                                                        << opt.val_fraction << ")");
  for (const fs::path& old : old_shards) fs::remove(old);
  summary.train_tokens = total - val;
  summary.val_tokens = val;
  summary.train_files = write_split(opt.out_dir, "train", tokens, 0, total - val, opt.shard_tokens);
  summary.val_files = write_split(opt.out_dir, "val", tokens, total - val, total, opt.shard_tokens);
  summary.seconds = timer.seconds();
  return summary;
}

}  // namespace lattice::data
