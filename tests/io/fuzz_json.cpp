// libFuzzer entry point for the JSON parser; a successful parse must also
// survive a write/re-parse round trip.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "lattice/core/error.h"
#include "lattice/io/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    lattice::io::JsonValue v = lattice::io::parse_json(text, "fuzz");
    lattice::io::JsonValue again = lattice::io::parse_json(lattice::io::to_json(v), "fuzz-roundtrip");
    if (!(again == v)) std::abort();
  } catch (const lattice::Error&) {
  }
  return 0;
}
