#include "lattice/cli/args.h"

#include <cerrno>
#include <cstdlib>

#include "lattice/core/error.h"

namespace lattice::cli {

long long parse_int_flag(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(value.c_str(), &end, 10);
  LATTICE_CHECK(!value.empty() && *end == '\0' && errno == 0, flag << " expects an integer, got '" << value << "'");
  return v;
}

long long parse_int_flag(const std::string& flag, const std::string& value, long long at_least) {
  const long long v = parse_int_flag(flag, value);
  LATTICE_CHECK(v >= at_least, flag << " must be >= " << at_least << ", got " << v);
  return v;
}

double parse_float_flag(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(value.c_str(), &end);
  LATTICE_CHECK(!value.empty() && *end == '\0' && errno == 0, flag << " expects a number, got '" << value << "'");
  return v;
}

const std::string& flag_value(const std::vector<std::string>& args, size_t i) {
  LATTICE_CHECK(i + 1 < args.size(), args[i] << " needs a value");
  return args[i + 1];
}

bool parse_config_flag(const std::vector<std::string>& args, size_t* i, std::string* config_path,
                       std::vector<std::string>* overrides) {
  const std::string& a = args[*i];
  if (a == "-c" || a == "--config") {
    *config_path = flag_value(args, *i);
    ++*i;
    return true;
  }
  if (a == "--set") {
    overrides->push_back(flag_value(args, *i));
    ++*i;
    return true;
  }
  if (a.rfind("--set=", 0) == 0) {
    overrides->push_back(a.substr(6));
    return true;
  }
  return false;
}

}  // namespace lattice::cli
