// lattice plan (--model PRESET | -c CONFIG) --cluster PRESET|FILE.toml [--nodes N] [--global-batch SEQS]
//              [--seq-len T] [--precision bf16,f32] [--no-offload] [--top N] [--explain LAYOUT]
//              [--emit-config FILE] [--list]
// How to lay a model out on a cluster: the planner (src/lattice/plan, docs/plan.md).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "lattice/cli/args.h"
#include "lattice/cli/command.h"
#include "lattice/core/error.h"
#include "lattice/io/config.h"
#include "lattice/io/file_util.h"
#include "lattice/plan/cost.h"
#include "lattice/plan/memory.h"
#include "lattice/plan/presets.h"
#include "lattice/plan/search.h"
#include "lattice/train/trainer.h"

namespace lattice::cli {

static const char* kPlanHelp =
    "usage: lattice plan (--model PRESET | -c CONFIG [--set key=value ...]) --cluster PRESET|FILE.toml\n"
    "                    [--nodes N] [--global-batch SEQUENCES] [--seq-len T] [--precision bf16,f32,f16]\n"
    "                    [--no-offload] [--top N] [--explain LAYOUT] [--emit-config FILE] [--list]\n"
    "\n"
    "Predicts the memory of every pipeline stage and the step time of every layout lattice\n"
    "accepts for the model on the cluster (dp, tp, pp, cp, ep, virtual stages, ZeRO stage,\n"
    "offload, micro-batch size and count, recomputation, sequence parallelism, precision,\n"
    "schedule), keeps those that fit, ranks them by predicted step time and says why the\n"
    "winner wins and why the obvious alternatives lose (docs/plan.md).\n"
    "  --model PRESET       a published model's shape (--list names them), or\n"
    "  -c CONFIG            a lattice config's [model] (and train.global_batch_size)\n"
    "  --cluster NAME|FILE  a cluster preset (--list) on --nodes nodes (default 1), or a TOML file\n"
    "  --global-batch N     sequences per optimizer step (the config's by default)\n"
    "  --seq-len T          the training sequence length (the preset's by default)\n"
    "  --precision LIST     compute dtypes to consider (default bf16)\n"
    "  --no-offload         leave zero.offload = disk out of the search\n"
    "  --top N              rows of the ranking (default 10)\n"
    "  --explain LAYOUT     one layout in full (a name as the table prints it,\n"
    "                       e.g. dp1.tp8.pp4.v1.z1.mb1.m16.1f1b.sp.bf16.rc-none)\n"
    "  --emit-config FILE   writes a lattice config for the winner (or the explained layout)\n"
    "  --list               the model and cluster presets\n";

namespace {

constexpr double kGB = 1e9;

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / kGB);
  return buf;
}

std::string seconds(double s) {
  char buf[32];
  if (s >= 1)
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  else
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  return buf;
}

std::string percent(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * x);
  return buf;
}

std::vector<DType> parse_precisions(const std::string& text) {
  std::vector<DType> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    LATTICE_CHECK(item == "bf16" || item == "f16" || item == "f32",
                  "--precision takes bf16, f16 and f32 separated by commas, got '" << item << "'");
    out.push_back(parse_dtype(item));
    begin = end + 1;
  }
  return out;
}

void print_presets() {
  std::printf("model presets:\n");
  for (const plan::ModelPreset& p : plan::model_presets())
    std::printf(
        "  %-14s %7.2fB parameters%s, %d layers x %d, seq %d\n      %s\n", p.name.c_str(),
        static_cast<double>(p.model.num_params()) / 1e9,
        p.model.n_experts > 0
            ? (" (" + std::to_string(static_cast<double>(p.model.active_params()) / 1e9).substr(0, 5) + "B active)")
                  .c_str()
            : "",
        p.model.n_layer, p.model.n_embd, p.model.seq_len, p.source.c_str());
  std::printf("cluster presets (--nodes N):\n");
  for (const auto& [name, what] : plan::cluster_presets()) std::printf("  %-14s %s\n", name.c_str(), what.c_str());
}

// Bytes of model state per parameter in lattice's convention (the winner's precision, ZeRO 0, this backend).
std::string state_convention(const plan::Cluster& cl, DType compute) {
  const bool b16 = compute != DType::F32;
  const bool cpu = cl.backend == plan::Backend::Cpu;
  const int copy = b16 ? (cpu ? 4 : 2) : 0, onednn = b16 && cpu && compute == DType::BF16 ? 2 : 0;
  const int total = 16 + copy + onednn;
  std::string s = std::to_string(total) + " B/parameter before ZeRO: f32 master 4 + f32 gradient 4 + Adam m, v 8";
  if (copy) s += " + " + std::to_string(copy) + " compute copy";
  if (onednn) s += " + 2 oneDNN bf16 copy";
  return s;
}

void print_header(const plan::Workload& w, const plan::Cluster& cl) {
  const model::ModelConfig& m = w.model;
  std::printf("model   %s: %.2fB parameters", w.name.c_str(), static_cast<double>(m.num_params()) / 1e9);
  if (m.n_experts > 0) std::printf(" (%.2fB active)", static_cast<double>(m.active_params()) / 1e9);
  std::printf(", %d layers, width %d, %d heads (%d key/value), vocabulary %d, sequence %d\n", m.n_layer, m.n_embd,
              m.n_head, m.kv_heads(), m.vocab_size, m.seq_len);
  std::printf("cluster %s: %d node%s x %d devices, %s GB each, %s backend\n", cl.name.c_str(), cl.nodes,
              cl.nodes == 1 ? "" : "s", cl.devices_per_node, gb(cl.device_memory).c_str(),
              cl.backend == plan::Backend::Cpu ? "CPU" : "GPU");
  std::printf(
      "        peak %.0f TFLOP/s bf16, %.1f f32; links %.0f GB/s inside a node, %.0f GB/s between nodes "
      "(per device and direction)\n        (%s)\n",
      cl.peak_bf16 / 1e12, cl.peak_f32 / 1e12, cl.intra.bandwidth / kGB, cl.inter.bandwidth / kGB, cl.source.c_str());
  std::printf("batch   %lld sequences x %d tokens = %lld tokens a step\n", static_cast<long long>(w.global_batch),
              m.seq_len, static_cast<long long>(w.tokens_per_step()));
  std::printf(
      "FLOPs   model: %.3g per token (6N + 12·L·C·T, causal attention not halved: what MFU divides);\n"
      "        time: the kernels' (causal attention halved, recomputation included)\n",
      m.flops_per_token(m.seq_len));
}

void print_table(const std::vector<plan::Candidate>& rows, const plan::Cluster& cl) {
  std::printf("\n%-4s %-66s %9s %9s %10s %7s %7s\n", "#", "layout", "memory", "step", "tok/s/dev", "MFU", "bubble");
  for (size_t i = 0; i < rows.size(); i++) {
    const plan::Candidate& c = rows[i];
    std::printf("%-4zu %-66s %6s GB %9s %10.0f %7s %7s\n", i + 1, plan::layout_name(c.layout).c_str(),
                gb(c.memory).c_str(), seconds(c.time.step).c_str(), c.time.tokens_per_s / cl.devices(),
                percent(c.time.mfu).c_str(), percent(c.time.bubble).c_str());
  }
}

void print_memory(const plan::MemoryPlan& p, double capacity, bool terms) {
  std::printf("\nmemory per pipeline rank (GB = 10^9 B; every tp x dp x cp replica of a stage alike)\n");
  std::printf("%-5s %-9s %-10s %-6s %7s %7s %7s %7s %7s %9s %7s   of %s\n", "rank", "stages", "layers", "held",
              "params", "grads", "optim", "activ", "comm+ws", "frag+rt", "total", gb(capacity).c_str());
  // One row per pipeline rank; without the terms, a run of ranks that print
  // alike (one chunk each, the same figures) is one row "first..last".
  auto figures = [&](const plan::RankMemory& r) {
    const double other = r.category(MemCategory::Comm) + r.category(MemCategory::Workspace) + r.transient +
                         (r.pp_rank == 0 ? r.rank0_extra : 0);
    char buf[160];
    std::snprintf(buf, sizeof buf, "%7s %7s %7s %7s %7s %9s %7s%s", gb(r.category(MemCategory::Params)).c_str(),
                  gb(r.category(MemCategory::Grads)).c_str(), gb(r.category(MemCategory::Optimizer)).c_str(),
                  gb(r.category(MemCategory::Activations)).c_str(), gb(other).c_str(),
                  gb(r.fragmentation + r.runtime).c_str(), gb(r.total()).c_str(),
                  r.total() > capacity ? "  does not fit" : "");
    std::string held;
    for (size_t i = 0; i < r.in_flight.size(); i++) {
      if (i) held += ',';
      held += std::to_string(r.in_flight[i]);
    }
    return held + "|" + buf;
  };
  for (size_t k = 0; k < p.ranks.size();) {
    const plan::RankMemory& r = p.ranks[k];
    size_t last = k;
    while (!terms && r.stages.size() == 1 && last + 1 < p.ranks.size() && p.ranks[last + 1].stages.size() == 1 &&
           figures(p.ranks[last + 1]) == figures(r))
      last++;
    std::string ranks = std::to_string(r.pp_rank), stages, layers;
    if (last > k) {
      ranks += ".." + std::to_string(p.ranks[last].pp_rank);
      stages = std::to_string(r.stages[0]) + ".." + std::to_string(p.ranks[last].stages[0]);
      layers = std::to_string(r.layers[0].first) + ".." + std::to_string(p.ranks[last].layers[0].last - 1);
    } else {
      for (size_t i = 0; i < r.stages.size(); i++) {
        const std::string comma = i ? "," : "";
        stages += comma + std::to_string(r.stages[i]);
        layers += comma + std::to_string(r.layers[i].first) + ".." + std::to_string(r.layers[i].last - 1);
      }
    }
    const std::string f = figures(r);
    const size_t bar = f.find('|');
    std::printf("%-5s %-9s %-10s %-6s %s\n", ranks.c_str(), stages.c_str(), layers.c_str(), f.substr(0, bar).c_str(),
                f.substr(bar + 1).c_str());
    if (terms) {
      for (const plan::MemoryTerm& t : r.terms)
        std::printf("        %-11s %10s GB  %s\n", mem_category_name(t.category), gb(t.bytes).c_str(), t.what.c_str());
      if (r.transient > 0)
        std::printf("        %-11s %10s GB  a growing buffer's old copy at the peak\n", "transient",
                    gb(r.transient).c_str());
    }
    k = last + 1;
  }
}

void print_time(const plan::StepTime& t, const plan::Layout& l) {
  std::printf("\nstep time %s (%s tokens/s, MFU %s)\n", seconds(t.step).c_str(),
              std::to_string(static_cast<long long>(t.tokens_per_s)).c_str(), percent(t.mfu).c_str());
  std::printf("  pipeline makespan %s%s: compute %s on the busiest rank (%d micro-batches of %d)\n",
              seconds(t.makespan).c_str(), t.simulated ? " (simulated)" : " (estimated)", seconds(t.compute).c_str(),
              l.micro_batches, l.micro_batch_size);
  std::printf(
      "    exposed communication: tensor-parallel %s, context-parallel %s, expert all-to-all %s, "
      "pipeline sends %s\n",
      seconds(t.tp_comm).c_str(), seconds(t.cp_comm).c_str(), seconds(t.ep_comm).c_str(), seconds(t.pp_comm).c_str());
  std::printf("    bubble %s (%s)\n", percent(t.bubble).c_str(), seconds(t.bubble * t.makespan).c_str());
  std::printf("  data-parallel/ZeRO: %s of communication, %s exposed\n", seconds(t.dp_comm).c_str(),
              seconds(t.dp_exposed).c_str());
  std::printf("  optimizer step: %s\n", seconds(t.optimizer).c_str());
}

// What most separates two step times, in words: "bubble 31.0% against 15.8%".
std::string difference(const plan::StepTime& alt, const plan::StepTime& win) {
  struct Part {
    const char* what;
    double a, b;
  };
  const Part parts[] = {{"compute", alt.compute, win.compute},
                        {"tensor-parallel communication", alt.tp_comm, win.tp_comm},
                        {"context-parallel communication", alt.cp_comm, win.cp_comm},
                        {"expert all-to-alls", alt.ep_comm, win.ep_comm},
                        {"bubble", alt.bubble * alt.makespan, win.bubble * win.makespan},
                        {"exposed data-parallel communication", alt.dp_exposed, win.dp_exposed},
                        {"optimizer step", alt.optimizer, win.optimizer}};
  const Part* worst = &parts[0];
  for (const Part& p : parts)
    if (p.a - p.b > worst->a - worst->b) worst = &p;
  std::string s = std::string(worst->what) + " " + seconds(worst->a) + " against " + seconds(worst->b);
  if (std::string(worst->what) == "bubble") s += " (" + percent(alt.bubble) + " against " + percent(win.bubble) + ")";
  return s;
}

void explain_winner(const plan::SearchResult& r, const plan::Cluster& cl) {
  const plan::Candidate& w = r.ranked.front();
  std::printf("\nwhy %s wins\n", plan::layout_name(w.layout).c_str());
  const double use = w.memory / w.capacity;
  if (use > 0.9)
    std::printf("  binding constraint: memory (%s of %s GB on pipeline rank %d)\n", gb(w.memory).c_str(),
                gb(w.capacity).c_str(), w.worst_stage);
  else
    std::printf(
        "  binding constraint: time (memory at %s of the device on its fullest rank); the step is "
        "%s compute of %s\n",
        percent(use).c_str(), percent(w.time.compute / w.time.step).c_str(), seconds(w.time.step).c_str());
  if (r.ranked.size() > 1)
    std::printf("  the runner-up, %s, is %s slower: %s\n", plan::layout_name(r.ranked[1].layout).c_str(),
                percent(r.ranked[1].time.step / w.time.step - 1).c_str(), difference(r.ranked[1].time, w.time).c_str());
  std::printf("\nthe obvious alternatives\n");
  for (const plan::Alternative& a : r.alternatives) {
    if (!a.found) {
      std::printf("  %-48s no valid layout of this kind (%s)\n", (a.name + ":").c_str(), a.refusal.c_str());
      continue;
    }
    const plan::Candidate& b = a.best;
    if (b.layout == w.layout) {
      std::printf("  %-48s the winner is one\n", (a.name + ":").c_str());
    } else if (!b.fits()) {
      std::printf("  %-48s does not fit: the closest, %s, needs %s GB on pipeline rank %d, %s GB more than %s GB\n",
                  (a.name + ":").c_str(), plan::layout_name(b.layout).c_str(), gb(b.memory).c_str(), b.worst_stage,
                  gb(b.memory - b.capacity).c_str(), gb(b.capacity).c_str());
    } else {
      std::string why = difference(b.time, w.time);
      if (b.layout.tp > cl.devices_per_node) why += "; its tensor-parallel group spans nodes";
      std::printf("  %-48s %s: %s, %s slower (%s)\n", (a.name + ":").c_str(), plan::layout_name(b.layout).c_str(),
                  seconds(b.time.step).c_str(), percent(b.time.step / w.time.step - 1).c_str(), why.c_str());
    }
  }
}

// Writes a lattice config for the layout, refusing a model `lattice train` would refuse.
void emit_config(const std::string& path, const plan::Workload& w, const plan::Layout& l) {
  io::RunConfig c = plan::run_config(w.section, l, w.global_batch, l.offload ? "offload" : "");
  try {
    io::validate_config(c);
    train::checked_model_config(c);
  } catch (const Error& e) {
    LATTICE_FAIL("--emit-config " << path << ": lattice train would refuse this config: " << e.what());
  }
  io::write_file_atomic(path,
                        "# lattice plan: " + plan::layout_name(l) + " for " + w.name + "\n" +
                            (l.offload ? "# zero.offload_dir: set it to a directory on a fast local disk\n" : "") +
                            io::config_to_toml(c));
  std::printf("\nwrote %s (lattice train -c %s)\n", path.c_str(), path.c_str());
}

int run_plan(const std::vector<std::string>& args) {
  std::string preset, config_path, cluster_name, explain, emit;
  std::vector<std::string> overrides;
  int nodes = 1, seq_len = 0, top = 10;
  long long global_batch = 0;
  bool offload = true, list = false;
  std::vector<DType> precisions = {DType::BF16};
  for (size_t i = 1; i < args.size(); i++) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kPlanHelp);
      return 0;
    } else if (parse_config_flag(args, &i, &config_path, &overrides)) {
    } else if (a == "--model") {
      preset = flag_value(args, i++);
    } else if (a == "--cluster") {
      cluster_name = flag_value(args, i++);
    } else if (a == "--nodes") {
      nodes = static_cast<int>(parse_int_flag(a, flag_value(args, i++), 1));
    } else if (a == "--global-batch") {
      global_batch = parse_int_flag(a, flag_value(args, i++), 1);
    } else if (a == "--seq-len") {
      seq_len = static_cast<int>(parse_int_flag(a, flag_value(args, i++), 1));
    } else if (a == "--precision") {
      precisions = parse_precisions(flag_value(args, i++));
    } else if (a == "--no-offload") {
      offload = false;
    } else if (a == "--top") {
      top = static_cast<int>(parse_int_flag(a, flag_value(args, i++), 1));
    } else if (a == "--explain") {
      explain = flag_value(args, i++);
    } else if (a == "--emit-config") {
      emit = flag_value(args, i++);
    } else if (a == "--list") {
      list = true;
    } else {
      LATTICE_FAIL("lattice plan: unknown option '" << a << "' (see --help)");
    }
  }
  if (list) {
    print_presets();
    return 0;
  }
  LATTICE_CHECK(preset.empty() != config_path.empty(),
                "lattice plan needs a model: --model PRESET or -c CONFIG (one of them; --list names the presets)");
  LATTICE_CHECK(!cluster_name.empty(),
                "lattice plan needs a cluster: --cluster PRESET or --cluster FILE.toml "
                "(--list names the presets)");
  plan::Workload w;
  if (!preset.empty()) {
    LATTICE_CHECK(overrides.empty(), "--set applies to -c CONFIG, not to --model " << preset);
    const plan::ModelPreset& p = plan::model_preset(preset);
    w.name = p.name;
    w.model = p.model;
    LATTICE_CHECK(global_batch > 0, "--model " << preset << " needs --global-batch (sequences per optimizer step)");
  } else {
    const io::RunConfig c = io::load_config(config_path, overrides);
    w.name = config_path;
    w.model = train::model_config_of(c.model);
    w.model.validate();
    if (global_batch == 0) global_batch = io::global_batch_size(c);
  }
  if (seq_len > 0) w.model.seq_len = seq_len;
  w.global_batch = global_batch;
  w.section = train::model_section_of(w.model);
  const bool from_file = cluster_name.size() > 5 && cluster_name.compare(cluster_name.size() - 5, 5, ".toml") == 0;
  LATTICE_CHECK(!from_file || nodes == 1, "--nodes applies to a cluster preset; a cluster file says its nodes");
  const plan::Cluster cl = from_file ? plan::read_cluster(cluster_name) : plan::cluster_preset(cluster_name, nodes);
  print_header(w, cl);
  std::printf("state   %s\n", state_convention(cl, precisions.front()).c_str());

  if (!explain.empty()) {
    plan::Layout l = plan::parse_layout(explain);
    LATTICE_CHECK(l.devices() == cl.devices(),
                  "--explain " << explain << ": dp x tp x pp x cp = " << l.dp << " x " << l.tp << " x " << l.pp << " x "
                               << l.cp << " = " << l.devices() << " devices, but the cluster has " << cl.devices()
                               << " (" << cl.nodes << " x " << cl.devices_per_node << ")");
    LATTICE_CHECK(l.global_batch() == w.global_batch,
                  "--explain " << explain << ": dp x micro-batch size x micro-batches = " << l.dp << " x "
                               << l.micro_batch_size << " x " << l.micro_batches << " = " << l.global_batch()
                               << " sequences a step, but the global batch is " << w.global_batch);
    const std::string why = plan::invalid_reason(w, l, cl.devices());
    LATTICE_CHECK(why.empty(), "--explain " << explain << " is not a layout lattice train accepts: " << why);
    plan::MemoryPlan memory;
    const plan::Candidate c = plan::evaluate(w, l, cl, nullptr, &memory);
    std::printf("\nlayout  %s\n", plan::layout_name(l).c_str());
    print_memory(memory, cl.device_memory, true);
    print_time(c.time, l);
    if (c.fits())
      std::printf("\nfits: %s of %s GB on its fullest rank (pipeline rank %d)\n", gb(c.memory).c_str(),
                  gb(c.capacity).c_str(), c.worst_stage);
    else
      std::printf("\ndoes not fit: pipeline rank %d needs %s GB, %s GB more than the device's %s GB\n", c.worst_stage,
                  gb(c.memory).c_str(), gb(c.memory - c.capacity).c_str(), gb(c.capacity).c_str());
    if (!emit.empty()) emit_config(emit, w, l);
    return c.fits() ? 0 : 1;
  }

  plan::SearchOptions o;
  o.precisions = precisions;
  o.offload = offload;
  o.top = top;
  const plan::SearchResult r = plan::search(w, cl, o);
  std::printf("\nsearch  %lld layouts, %lld valid, %lld fit; %lld simulated; %.2f s (%.0f layouts/s)\n",
              static_cast<long long>(r.enumerated), static_cast<long long>(r.valid), static_cast<long long>(r.fitting),
              static_cast<long long>(r.simulated), r.seconds,
              static_cast<double>(r.enumerated) / std::max(r.seconds, 1e-9));
  if (r.valid == 0) {
    std::string reasons;
    for (const auto& [key, count] : r.refusals) reasons += "\n  " + std::to_string(count) + " x " + key;
    LATTICE_FAIL("no layout of " << w.name << " is valid on " << cl.devices() << " devices with a global batch of "
                                 << w.global_batch << " sequences; refused by:" << reasons);
  }
  LATTICE_CHECK(!r.ranked.empty(), w.name << " fits nowhere on " << cl.name << ": the layout closest to fitting, "
                                          << plan::layout_name(r.closest.layout) << ", needs " << gb(r.closest.memory)
                                          << " GB on pipeline rank " << r.closest.worst_stage << ", "
                                          << gb(r.closest.memory - r.closest.capacity) << " GB more than the device's "
                                          << gb(r.closest.capacity)
                                          << " GB (more nodes, a smaller micro-batch, recomputation or "
                                          << "offload would be the ways in)");
  print_table(r.ranked, cl);
  plan::MemoryPlan memory;
  const plan::Candidate winner = plan::evaluate(w, r.ranked.front().layout, cl, nullptr, &memory);
  std::printf("\nwinner  %s\n", plan::layout_name(winner.layout).c_str());
  print_memory(memory, cl.device_memory, false);
  print_time(winner.time, winner.layout);
  explain_winner(r, cl);
  if (!emit.empty()) emit_config(emit, w, winner.layout);
  return 0;
}

}  // namespace

LATTICE_REGISTER_COMMAND("plan", "predict memory and step time of every layout, and recommend one", run_plan);

}  // namespace lattice::cli
