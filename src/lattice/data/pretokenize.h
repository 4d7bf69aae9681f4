// GPT-2's pre-tokenisation: splits text into the pieces ("words") that BPE
// then encodes one at a time. It is the regular expression
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// applied left to right (Python's re.findall), written out by hand on UTF-8
// bytes. The alternatives are tried in order at each position:
//   1. an ASCII apostrophe followed by s, t, re, ve, m, ll or d (case-sensitive);
//   2-4. an optional U+0020 space, then a maximal run of letters, of numbers, or
//        of characters that are none of letter/number/space;
//   5. a run of white space, minus its last character when a non-space follows
//      (the backtracking of \s+(?!\S)), so that the last space joins the next word;
//   6. otherwise a single white-space character.
// Character classes and what they cover: see unicode.h.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace lattice::data {

// Iterates over the pieces of `text` without allocating. The pieces cover the
// text exactly, in order. `text` must outlive the iterator.
class PreTokenizer {
 public:
  explicit PreTokenizer(std::string_view text) : text_(text) {}
  // Sets *piece to the next piece and returns true, or returns false at the end.
  bool next(std::string_view* piece);

 private:
  std::string_view text_;
  size_t pos_ = 0;
};

// All pieces of `text` (for tests and tools; the tokenizer uses PreTokenizer).
std::vector<std::string> pretokenize(std::string_view text);

}  // namespace lattice::data
