// Sub-commands of the `lattice` executable register themselves here, one file
// each (train.cpp, prepare.cpp, bench_*.cpp ...), so main.cpp never changes
// when a command is added.
#pragma once

#include <string>
#include <vector>

namespace lattice::cli {

// A command receives its own arguments (argv[0] is the command name).
using CommandFn = int (*)(const std::vector<std::string>& args);

struct Command {
  const char* name;     // "train"
  const char* summary;  // one line for `lattice --help`
  CommandFn run;
};

std::vector<Command>& command_registry();

struct CommandRegistrar {
  explicit CommandRegistrar(Command c) { command_registry().push_back(c); }
};

}  // namespace lattice::cli

#define LATTICE_CONCAT_INNER(a, b) a##b
#define LATTICE_CONCAT(a, b) LATTICE_CONCAT_INNER(a, b)
#define LATTICE_REGISTER_COMMAND(name, summary, fn) \
  static ::lattice::cli::CommandRegistrar LATTICE_CONCAT(lattice_command_, __LINE__)({name, summary, fn})
