#include "lattice/data/unicode.h"

#include <algorithm>
#include <array>

namespace lattice::data::unicode {
namespace {

bool in_ranges(const CodePointRange* ranges, size_t count, uint32_t cp) {
  // First range whose last >= cp; cp is inside iff that range starts at or before it.
  const CodePointRange* end = ranges + count;
  const CodePointRange* it =
      std::lower_bound(ranges, end, cp, [](const CodePointRange& r, uint32_t v) { return r.last < v; });
  return it != end && it->first <= cp;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

CharClass classify_slow(uint32_t cp) {
  if (is_white_space(cp)) return CharClass::kSpace;
  if (in_ranges(kLetterRanges, kLetterRangeCount, cp)) return CharClass::kLetter;
  if (in_ranges(kNumberRanges, kNumberRangeCount, cp)) return CharClass::kNumber;
  return CharClass::kOther;
}

// The Basic Multilingual Plane (all of the text lattice is likely to see) is a
// 64 KiB table built once; the rest goes through binary search.
struct BmpTable {
  std::array<CharClass, 0x10000> cls;
  BmpTable() {
    for (uint32_t cp = 0; cp < 0x10000; ++cp) cls[cp] = classify_slow(cp);
  }
};

}  // namespace

CharClass classify(uint32_t cp) {
  static const BmpTable table;
  if (cp < 0x10000) return table.cls[cp];
  if (cp > 0x10FFFF) return CharClass::kOther;
  return classify_slow(cp);
}

}  // namespace lattice::data::unicode
