// Small helpers shared by the sub-commands' argument parsing.
#pragma once

#include <string>
#include <vector>

namespace lattice::cli {

// Parses the value of `flag` as an integer / float, with an error naming the flag.
long long parse_int_flag(const std::string& flag, const std::string& value);
// The same, refusing a value below `at_least`: "<flag> must be >= <at_least>, got <value>".
long long parse_int_flag(const std::string& flag, const std::string& value, long long at_least);
double parse_float_flag(const std::string& flag, const std::string& value);

// Returns args[i + 1] or throws "<flag> needs a value".
const std::string& flag_value(const std::vector<std::string>& args, size_t i);

// `-c FILE` / `--config FILE` and `--set key=value` (repeatable) — the config
// options every command that builds a RunConfig accepts. Returns true if
// args[*i] was one of them (advancing *i past its value).
bool parse_config_flag(const std::vector<std::string>& args, size_t* i, std::string* config_path,
                       std::vector<std::string>* overrides);

}  // namespace lattice::cli
