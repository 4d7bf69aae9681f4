// The few Unicode facts GPT-2's pre-tokenisation needs: UTF-8 decoding and the
// classes \p{L} (letter), \p{N} (number) and \s (white space).
//
// Coverage: every code point of Unicode as known to the node that ran
// tools/gen_unicode_tables.js (the version is written at the top of
// unicode_tables.cpp). \s is the Unicode White_Space property, as in the
// Python `regex` module GPT-2 was built with: U+0009..U+000D, U+0020, U+0085,
// U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
// Bytes that are not valid UTF-8 count as one "other" character each (neither
// letter, number nor space), so any byte string can be tokenised.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lattice::data::unicode {

struct CodePointRange {
  uint32_t first, last;  // inclusive
};
extern const CodePointRange kLetterRanges[];
extern const size_t kLetterRangeCount;
extern const CodePointRange kNumberRanges[];
extern const size_t kNumberRangeCount;

enum class CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

// Class of a code point (anything above U+10FFFF, or kInvalid, is kOther).
CharClass classify(uint32_t code_point);

constexpr uint32_t kInvalid = 0xFFFFFFFFu;

// Decodes the UTF-8 character starting at s[0] (n > 0 bytes available).
// Returns its code point and sets *length to its byte length; an invalid or
// truncated sequence (overlong form, surrogate, > U+10FFFF, bad continuation)
// returns kInvalid with *length = 1.
inline uint32_t decode_utf8(const unsigned char* s, size_t n, int* length) {
  unsigned char c = s[0];
  if (c < 0x80) {
    *length = 1;
    return c;
  }
  *length = 1;
  int len;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0) {
    len = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3, cp = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (static_cast<size_t>(len) > n) return kInvalid;
  for (int i = 1; i < len; ++i) {
    if ((s[i] & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (s[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  *length = len;
  return cp;
}

}  // namespace lattice::data::unicode
