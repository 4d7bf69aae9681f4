// GPT-2's byte-level BPE tokenizer (Radford et al. 2019), in C++.
//
// encode(text):
//   1. split the text into pieces with GPT-2's pattern (pretokenize.h);
//   2. each piece's bytes start as one token each (the 256 byte tokens);
//   3. repeatedly merge the adjacent pair with the lowest rank in vocab.bpe
//      until no ranked pair is left; the ids of the remaining symbols are the
//      piece's tokens. A cache of piece -> ids makes repeated words free.
// decode(ids): the concatenated bytes of the tokens (<|endoftext|> decodes to
// its literal text). decode(encode(s)) == s for every byte string s.
//
// The vocabulary files are OpenAI's encoder.json and vocab.bpe (MIT), fetched
// by scripts/setup.sh into .cache/gpt2/. encoder.json writes each token's
// bytes through GPT-2's byte->unicode table (printable bytes as themselves,
// the others shifted to U+0100..); load() maps them back to raw bytes.
//
// Text that spells "<|endoftext|>" is encoded as ordinary text (it is not
// turned into the special token); callers insert eot() themselves.
//
// A Tokenizer is safe to share between threads (the cache is locked).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lattice::data {

class Tokenizer {
 public:
  // Loads dir/encoder.json and dir/vocab.bpe. Errors name the missing or
  // malformed file (a missing one: "run scripts/setup.sh").
  static Tokenizer load(const std::string& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int> encode(std::string_view text) const;
  // Appends the ids of `text` to *out (no allocation once the cache is warm).
  void encode_append(std::string_view text, std::vector<int>* out) const;
  std::string decode(const std::vector<int>& ids) const;
  // The bytes of one token (may be part of a UTF-8 character).
  std::string decode_token(int id) const;
  int eot() const;         // <|endoftext|>, 50256 for GPT-2
  int vocab_size() const;  // 50257 for GPT-2

  // BPE of one piece by the textbook algorithm (rescan all pairs after each
  // merge, as OpenAI's encoder.py does): quadratic, uncached; a test oracle for
  // the fast path, which uses a heap and is equal to it whenever every merge
  // that uses a token comes after the merge that makes it (checked at load).
  std::vector<int> encode_piece_reference(std::string_view piece) const;
  // True when encode() uses the heap algorithm (it does for GPT-2's files).
  bool uses_heap_merge() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The byte -> unicode table of GPT-2's encoder.py: code point of each byte's
// stand-in character in encoder.json and vocab.bpe.
std::vector<uint32_t> gpt2_byte_to_unicode();

// Parsers of the two vocabulary files, exposed for tests. `path` only names the
// file in error messages.
// encoder.json: one JSON object of token string -> id.
std::vector<std::pair<std::string, int>> parse_encoder_json(std::string_view json, const std::string& path);
// vocab.bpe: a "#version" line, then one merge "left right" per line, by rank.
std::vector<std::pair<std::string, std::string>> parse_bpe_merges(std::string_view text, const std::string& path);

}  // namespace lattice::data
