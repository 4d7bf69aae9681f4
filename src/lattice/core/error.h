// lattice::Error and LATTICE_CHECK: the one way lattice reports a failure.
//
//   LATTICE_CHECK(n_embd % n_head == 0,
//                 "model.n_embd=" << n_embd << " is not divisible by model.n_head=" << n_head);
//
// The message is built with operator<< only when the check fails. User mistakes
// (config, files, command line) get a message that names the key or path and
// what would be valid; the CLI prints it on one line and exits non-zero.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace lattice {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace lattice

#define LATTICE_CHECK(cond, msg)                      \
  do {                                                \
    if (!(cond)) {                                    \
      std::ostringstream lattice_check_stream_;       \
      lattice_check_stream_ << msg;                   \
      throw ::lattice::Error(lattice_check_stream_.str()); \
    }                                                 \
  } while (0)

#define LATTICE_FAIL(msg) LATTICE_CHECK(false, msg)
