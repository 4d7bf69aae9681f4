#include "lattice/data/pretokenize.h"

#include "lattice/data/unicode.h"

namespace lattice::data {
namespace {

using unicode::CharClass;

struct Char {
  CharClass cls;
  int length;  // bytes
};

// Class and byte length of the character at s[0], n > 0 bytes available.
inline Char char_at(const unsigned char* s, size_t n) {
  if (s[0] < 0x80) {
    // ASCII: letters, digits, the six ASCII white-space characters, the rest.
    unsigned char c = s[0];
    CharClass cls = CharClass::kOther;
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') cls = CharClass::kLetter;
    else if (c >= '0' && c <= '9') cls = CharClass::kNumber;
    else if (c == ' ' || (c >= 0x09 && c <= 0x0D)) cls = CharClass::kSpace;
    return {cls, 1};
  }
  int length;
  uint32_t cp = unicode::decode_utf8(s, n, &length);
  return {cp == unicode::kInvalid ? CharClass::kOther : unicode::classify(cp), length};
}

// End of the maximal run of characters of class `cls` starting at `pos`.
inline size_t run_end(const unsigned char* s, size_t n, size_t pos, CharClass cls) {
  while (pos < n) {
    Char c = char_at(s + pos, n - pos);
    if (c.cls != cls) break;
    pos += c.length;
  }
  return pos;
}

// Byte length of a contraction ('s 't 're 've 'm 'll 'd) at s[0], or 0.
inline size_t contraction_length(const unsigned char* s, size_t n) {
  if (n < 2 || s[0] != '\'') return 0;
  switch (s[1]) {
    case 's': case 't': case 'm': case 'd': return 2;
    case 'r': case 'v': return n >= 3 && s[2] == 'e' ? 3 : 0;
    case 'l': return n >= 3 && s[2] == 'l' ? 3 : 0;
    default: return 0;
  }
}

}  // namespace

bool PreTokenizer::next(std::string_view* piece) {
  const auto* s = reinterpret_cast<const unsigned char*>(text_.data());
  const size_t n = text_.size();
  const size_t start = pos_;
  if (start >= n) return false;

  size_t end = 0;
  if (size_t len = contraction_length(s + start, n - start)) {
    end = start + len;  // alternative 1
  } else {
    Char first = char_at(s + start, n - start);
    size_t word_start = start;  // where the letter/number/other run begins
    CharClass word_class = first.cls;
    if (s[start] == ' ' && start + 1 < n) {
      // " ?" takes the space when a letter, number or other character follows.
      Char second = char_at(s + start + 1, n - start - 1);
      if (second.cls != CharClass::kSpace) {
        word_start = start + 1;
        word_class = second.cls;
      }
    }
    if (word_class != CharClass::kSpace) {
      end = run_end(s, n, word_start, word_class);  // alternatives 2-4
    } else {
      // White space from `start`: find the run and the start of its last character.
      size_t pos = start, last_start = start;
      int count = 0;
      while (pos < n) {
        Char c = char_at(s + pos, n - pos);
        if (c.cls != CharClass::kSpace) break;
        last_start = pos;
        pos += c.length;
        ++count;
      }
      if (pos == n) end = pos;                     // \s+(?!\S) at the end of the text
      else if (count >= 2) end = last_start;       // \s+(?!\S), backtracked by one
      else end = pos;                              // \s+, a single character
    }
  }
  *piece = text_.substr(start, end - start);
  pos_ = end;
  return true;
}

std::vector<std::string> pretokenize(std::string_view text) {
  std::vector<std::string> pieces;
  PreTokenizer it(text);
  std::string_view piece;
  while (it.next(&piece)) pieces.emplace_back(piece);
  return pieces;
}

}  // namespace lattice::data
