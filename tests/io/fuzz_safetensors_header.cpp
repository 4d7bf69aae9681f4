// libFuzzer entry point: any bytes given to parse_safetensors_header either
// parse or throw lattice::Error; nothing else (crash, other exception, UB).
#include <cstddef>
#include <cstdint>

#include "lattice/core/error.h"
#include "lattice/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    lattice::io::parse_safetensors_header(data, size, "fuzz", size % 2 == 0);
  } catch (const lattice::Error&) {
  }
  return 0;
}
