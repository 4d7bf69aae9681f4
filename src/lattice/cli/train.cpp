// lattice train -c CONFIG [--set section.key=value ...] [--resume]
#include <cstdio>

#include "lattice/cli/args.h"
#include "lattice/cli/command.h"
#include "lattice/core/error.h"
#include "lattice/io/config.h"
#include "lattice/train/trainer.h"

namespace lattice::cli {

static const char* kTrainHelp =
    "usage: lattice train [-c CONFIG] [--set section.key=value ...] [--resume]\n"
    "\n"
    "Trains a GPT from a TOML config (see configs/ and docs/config.md).\n"
    "  -c, --config FILE   the run's TOML file (without it, the defaults: GPT-2 124M on synthetic tokens)\n"
    "  --set KEY=VALUE     overrides any key, e.g. --set train.steps=10 --set model.n_layer=6\n"
    "  --resume            continue from the latest checkpoint in checkpoint.dir\n"
    "  --help-config       lists every key with its default and meaning\n"
    "Ctrl-C saves a checkpoint (when checkpoint.dir is set) and exits.\n";

static int run_train(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (size_t i = 1; i < args.size(); i++) {
    if (parse_config_flag(args, &i, &config_path, &overrides)) continue;
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf("%s", kTrainHelp);
      return 0;
    }
    if (args[i] == "--help-config") {
      std::printf("%s", io::config_help().c_str());
      return 0;
    }
    if (args[i] == "--resume") {
      overrides.push_back("checkpoint.resume=latest");
      continue;
    }
    LATTICE_FAIL("lattice train: unknown option '" << args[i] << "' (see lattice train --help)");
  }
  io::RunConfig config = io::load_config(config_path, overrides);
  train::Trainer trainer(config);
  return trainer.run();
}

LATTICE_REGISTER_COMMAND("train", "train a GPT from a config file", run_train);

}  // namespace lattice::cli
