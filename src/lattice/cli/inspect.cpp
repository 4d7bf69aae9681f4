// lattice inspect PATH [--plot PREFIX]
//   a .bin token shard, a .safetensors file, a checkpoint directory, a .toml
//   config or a metrics .jsonl file: prints what it holds.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "lattice/cli/args.h"
#include "lattice/cli/command.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/tensor.h"
#include "lattice/data/paths.h"
#include "lattice/data/shard.h"
#include "lattice/data/tokenizer.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/config.h"
#include "lattice/io/metrics.h"
#include "lattice/cli/schedule_report.h"
#include "lattice/io/file_util.h"
#include "lattice/io/plot.h"
#include "lattice/parallel/pipeline/timeline.h"
#include "lattice/io/safetensors.h"
#include "lattice/train/trainer.h"

namespace lattice::cli {

namespace fs = std::filesystem;

static const char* kInspectHelp =
    "usage: lattice inspect PATH [--plot PREFIX] [--set section.key=value ...]\n"
    "       lattice inspect RUN1.jsonl RUN2.jsonl ... [--plot PREFIX]\n"
    "\n"
    "Prints what PATH holds:\n"
    "  *.bin           a token shard: header, token count, the first tokens decoded\n"
    "  *.safetensors   tensors (name, dtype, shape, size) and metadata\n"
    "  a directory     a checkpoint (run dir or step dir): meta.json, integrity, tensors\n"
    "  *.toml          a config, every key after defaults and --set overrides\n"
    "  *.jsonl         a metrics file: steps, first/last/best loss; --plot PREFIX draws\n"
    "                  PREFIXloss.svg and PREFIXthroughput.svg; several metrics files:\n"
    "                  each one's summary, and --plot PREFIX draws them side by side in\n"
    "                  PREFIXloss.svg (and PREFIXval_loss.svg), one line per file\n"
    "  *.csv           a pipeline schedule (PyTorch's compute-only format): validated and\n"
    "                  simulated at unit costs (lattice schedule sets costs); --plot PREFIX\n"
    "                  draws PREFIXschedule.svg\n"
    "  *.json          a pipeline timeline (Chrome trace): ranks, actions, span, bubble;\n"
    "                  --plot PREFIX draws PREFIXtimeline.svg (ranks down, time across)\n";

static void inspect_shard(const std::string& path) {
  data::ShardInfo info = data::read_shard_header(path);
  std::printf("token shard %s\n  format: llm.c .bin, magic %d, version %d\n  tokens: %lld\n", path.c_str(),
              data::kShardMagic, data::kShardVersion, static_cast<long long>(info.num_tokens));
  std::vector<uint16_t> tokens = data::read_shard(path);
  uint16_t max_id = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  std::printf("  largest token id: %u\n", max_id);
  const size_t show = std::min<size_t>(tokens.size(), 48);
  std::printf("  first %zu ids:", show);
  for (size_t i = 0; i < show; i++) std::printf(" %u", tokens[i]);
  std::printf("\n");
  try {
    data::Tokenizer tok = data::Tokenizer::load(data::default_tokenizer_dir());
    std::vector<int> ids(tokens.begin(), tokens.begin() + show);
    std::printf("  decoded: %s\n", tok.decode(ids).c_str());
  } catch (const Error&) {
    std::printf("  (GPT-2 tokenizer files not found; run scripts/setup.sh to see the text)\n");
  }
}

static void print_tensors(const io::SafeTensorsReader& r) {
  uint64_t bytes = 0;
  int64_t elements = 0;
  for (const io::TensorEntry& e : r.tensors()) {
    std::printf("  %-32s %-5s %-16s %s\n", e.name.c_str(), e.dtype_name.c_str(), shape_string(e.shape).c_str(),
                format_bytes(static_cast<double>(e.end - e.begin)).c_str());
    bytes += e.end - e.begin;
    elements += e.numel();
  }
  std::printf("  %zu tensors, %lld elements, %s\n", r.tensors().size(), static_cast<long long>(elements),
              format_bytes(static_cast<double>(bytes)).c_str());
  for (const auto& [k, v] : r.metadata()) std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
}

static void inspect_safetensors(const std::string& path) {
  io::SafeTensorsReader r(path, /*allow_unsupported_dtypes=*/true);
  std::printf("safetensors %s\n", path.c_str());
  print_tensors(r);
}

static void inspect_checkpoint(const std::string& path) {
  std::string step_dir = io::resolve_checkpoint(path);
  std::printf("checkpoint %s\n", step_dir.c_str());
  io::verify_checkpoint(step_dir);
  std::printf("  integrity: every file matches its size and CRC32C in meta.json\n");
  io::JsonValue meta = io::read_checkpoint_meta(step_dir);
  for (const auto& [key, value] : meta.as_object()) {
    if (key == "config" || key == "files") continue;
    std::printf("  %s: %s\n", key.c_str(), io::to_json(value).c_str());
  }
  if (const io::JsonValue* cfg = meta.find("config")) {
    io::RunConfig c = io::parse_saved_config(cfg->as_string(), step_dir + "/meta.json config");
    std::printf("  model: n_layer=%d n_head=%d n_embd=%d vocab_size=%d seq_len=%d, %s\n", c.model.n_layer,
                c.model.n_head, c.model.n_embd, c.model.vocab_size, c.model.seq_len,
                train::describe_model(train::model_config_of(c.model)).c_str());
  }
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    fs::path p = fs::path(step_dir) / file;
    if (!fs::exists(p)) continue;
    io::SafeTensorsReader r(p.string());
    std::printf("%s: %zu tensors, %s\n", file, r.tensors().size(),
                format_bytes(static_cast<double>(fs::file_size(p))).c_str());
  }
}

static void inspect_config(const std::string& path, const std::vector<std::string>& overrides) {
  io::RunConfig c = io::load_config(path, overrides);
  const model::ModelConfig model = train::checked_model_config(c);
  std::printf("config %s (valid)\n", path.c_str());
  std::printf("  model: %s; %lld parameters\n", train::describe_model(model).c_str(),
              static_cast<long long>(model.num_params()));
  std::string section;
  for (const auto& [key, value] : io::config_items(c)) {
    std::string s = key.substr(0, key.find('.'));
    if (s != section) std::printf("[%s]\n", (section = s).c_str());
    std::printf("  %-28s = %s\n", key.substr(key.find('.') + 1).c_str(), value.c_str());
  }
}

static void inspect_metrics(const std::string& path, const std::string& plot_prefix) {
  io::MetricsColumns m = io::read_metrics_jsonl(path);
  std::printf("metrics %s: %zu lines, columns:", path.c_str(), m.rows);
  for (const std::string& n : m.names) std::printf(" %s", n.c_str());
  std::printf("\n");
  if (m.has("loss") && m.rows > 0) {
    const auto& loss = m.column("loss");
    double best = INFINITY;
    for (double x : loss)
      if (std::isfinite(x)) best = std::min(best, x);
    std::printf("  loss: first %.4f, last %.4f, best %.4f\n", loss.front(), loss.back(), best);
  }
  if (m.has("val_loss")) {
    const auto& v = m.column("val_loss");
    for (size_t i = v.size(); i-- > 0;)
      if (std::isfinite(v[i])) {
        std::printf("  last val_loss: %.4f\n", v[i]);
        break;
      }
  }
  if (!plot_prefix.empty())
    for (const std::string& p : io::plot_metrics(path, plot_prefix)) std::printf("  wrote %s\n", p.c_str());
}

static void inspect_schedule(const std::string& path, const std::string& plot_prefix) {
  const pipeline::Schedule s = pipeline::from_csv(io::read_whole_file(path, "schedule"), path);
  const pipeline::Simulation sim = print_schedule_report(s, pipeline::Costs{});
  if (plot_prefix.empty()) return;
  write_timeline_svg(plot_prefix + "schedule.svg", sim.timeline, path + " (simulated, unit costs)", "time (cost units)");
  std::printf("  wrote %sschedule.svg\n", plot_prefix.c_str());
}

static void inspect_trace(const std::string& path, const std::string& plot_prefix) {
  const auto timeline = read_chrome_trace(path);
  size_t actions = 0;
  double lo = 1e300, hi = -1e300;
  for (const auto& row : timeline)
    for (const pipeline::Interval& iv : row) actions++, lo = std::min(lo, iv.start), hi = std::max(hi, iv.end);
  std::printf("pipeline timeline %s: %zu ranks, %zu actions over %.6g s, bubble %.4f\n", path.c_str(), timeline.size(),
              actions, hi - lo, pipeline::bubble_of(timeline));
  if (plot_prefix.empty()) return;
  write_timeline_svg(plot_prefix + "timeline.svg", timeline, path, "time (s)");
  std::printf("  wrote %stimeline.svg\n", plot_prefix.c_str());
}

static bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

static int run_inspect(const std::vector<std::string>& args) {
  std::string path, plot_prefix, config_path;
  std::vector<std::string> overrides, paths;
  for (size_t i = 1; i < args.size(); i++) {
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf("%s", kInspectHelp);
      return 0;
    }
    if (parse_config_flag(args, &i, &config_path, &overrides)) continue;
    if (args[i] == "--plot") {
      plot_prefix = flag_value(args, i++);
      continue;
    }
    LATTICE_CHECK(args[i].rfind("-", 0) != 0, "lattice inspect: unknown option '" << args[i] << "'");
    paths.push_back(args[i]);
  }
  if (paths.size() > 1) {
    std::vector<std::string> names;
    for (const std::string& p : paths) {
      LATTICE_CHECK(ends_with(p, ".jsonl"), "lattice inspect takes one PATH, or several metrics .jsonl files; got '"
                                                << p << "' among " << paths.size() << " paths");
      LATTICE_CHECK(fs::exists(p), "'" << p << "' does not exist");
      inspect_metrics(p, "");
      names.push_back(fs::path(p).stem().string());
    }
    if (!plot_prefix.empty())
      for (const std::string& p : io::plot_metrics_comparison(paths, names, plot_prefix))
        std::printf("wrote %s\n", p.c_str());
    return 0;
  }
  if (!paths.empty()) path = paths.front();
  if (path.empty()) path = config_path;
  LATTICE_CHECK(!path.empty(), "lattice inspect needs a PATH (see lattice inspect --help)");
  LATTICE_CHECK(fs::exists(path), "'" << path << "' does not exist");
  if (fs::is_directory(path)) {
    inspect_checkpoint(path);
  } else if (ends_with(path, ".bin")) {
    inspect_shard(path);
  } else if (ends_with(path, ".safetensors")) {
    inspect_safetensors(path);
  } else if (ends_with(path, ".toml")) {
    inspect_config(path, overrides);
  } else if (ends_with(path, ".jsonl")) {
    inspect_metrics(path, plot_prefix);
  } else if (ends_with(path, ".csv")) {
    inspect_schedule(path, plot_prefix);
  } else if (ends_with(path, ".json")) {
    inspect_trace(path, plot_prefix);
  } else {
    LATTICE_FAIL("lattice inspect: cannot tell what '" << path
                                                      << "' is (expected .bin, .safetensors, .toml, .jsonl, .csv, .json "
                                                         "or a checkpoint directory)");
  }
  return 0;
}

LATTICE_REGISTER_COMMAND("inspect", "print what a shard, checkpoint, config, metrics, schedule or trace file holds",
                         run_inspect);

}  // namespace lattice::cli
