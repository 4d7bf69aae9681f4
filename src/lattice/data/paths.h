// Where lattice finds the files scripts/setup.sh fetched (.cache/ at the root
// of the repository).
#pragma once

#include <string>

namespace lattice::data {

// The repository root: $LATTICE_HOME when set; else the first folder holding
// .cache/gpt2 found walking up from the running executable; else the same walk
// from the working directory; else "" (not found).
std::string find_lattice_home();

// <root>/.cache/gpt2 (encoder.json, vocab.bpe). When no root is found this is
// ".cache/gpt2" relative to the working directory, so that loading fails with
// a message naming that path.
std::string default_tokenizer_dir();

}  // namespace lattice::data
