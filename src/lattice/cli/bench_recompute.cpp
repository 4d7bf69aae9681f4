// lattice bench recompute [--case B:T ...] [--modes none,selective,full] [--steps S] [--warmup W]
//                         [--repeat R] [--threads N] [--set model.key=value ...] [--json]
//   Activation recomputation's cost and saving (docs/recompute.md): for each
//   micro-batch shape, whole training steps of one model in one process —
//   forward, backward, AdamW, each timed — and the activation memory, under
//   each recompute mode; beside them the forward's share of the step and the
//   time of the forward of the layers full recomputation runs again, measured
//   in the same run. For docs/performance.md.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "lattice/cli/args.h"
#include "lattice/cli/bench_registry.h"
#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/core/timer.h"
#include "lattice/io/config.h"
#include "lattice/io/json.h"
#include "lattice/model/gpt.h"
#include "lattice/model/recompute.h"
#include "lattice/optim/adamw.h"
#include "lattice/train/trainer.h"

namespace lattice::cli {

static const char* kBenchRecomputeHelp =
    "usage: lattice bench recompute [--case B:T ...] [--modes none,selective,full] [--steps S] [--warmup W]\n"
    "                               [--repeat R] [--threads N] [--set model.key=value ...] [--json]\n"
    "\n"
    "Times whole training steps (forward, backward, AdamW; each part timed) of one\n"
    "model in one process under each recompute mode, and its activation memory\n"
    "(MemoryTracker's activations peak, and what a micro-batch stores). Also times,\n"
    "in the same run, the forward of a one-layer model of the same shape: the\n"
    "forward of the L - 1 layers full recomputation runs again in the backward is\n"
    "the whole forward less that (the last layer is still in the work arrays).\n"
    "Defaults: GPT-2 124M, --case 4:256 --case 1:1024, all modes, --steps 3\n"
    "--warmup 1 --repeat 1 (the best step of the repeats), all cores.\n";

namespace {

struct Case {
  int B = 0, T = 0;
};

struct Times {
  double step = 0, forward = 0, backward = 0, optimizer = 0;
};

struct ModeResult {
  model::Recompute mode;
  Times best;                  // the fastest step's parts
  size_t peak_activations = 0;  // MemoryTracker's activations peak over the steps
  size_t stored = 0;            // what one micro-batch's forward keeps (slot + tokens)
  size_t work = 0;              // the one-layer work arrays
  float loss = 0;
};

std::vector<int32_t> synthetic_tokens(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng.next_below(vocab));
  return t;
}

// `steps` timed steps (after `warmup`) of a fresh model under `mode`; the fastest step.
ModeResult run_mode(const model::ModelConfig& mc, const Case& cs, model::Recompute mode, int warmup, int steps) {
  ModeResult r{mode, {}, 0, 0, 0, 0};
  model::GPT gpt(mc, 1337);
  gpt.set_recompute(std::vector<model::Recompute>(mc.n_layer, mode));
  optim::AdamW opt(gpt.groups(), optim::AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f});
  const int n = cs.B * cs.T;
  const std::vector<int32_t> in = synthetic_tokens(n, mc.vocab_size, 1), tg = synthetic_tokens(n, mc.vocab_size, 2);
  MemoryTracker::instance().reset_peaks();
  r.best.step = 1e300;
  for (int s = 0; s < warmup + steps; s++) {
    Timer t;
    gpt.zero_grad();
    r.loss = gpt.forward(0, in.data(), tg.data(), cs.B, cs.T, 1.0f);
    const double f = t.millis();
    gpt.backward(0);
    const double b = t.millis();
    opt.step(1e-4f, 1.0f);
    gpt.params_changed();
    const double o = t.millis();
    if (s >= warmup && o < r.best.step) r.best = {o, f, b - f, o - b};
  }
  r.peak_activations = MemoryTracker::instance().peak(MemCategory::Activations);
  r.stored = gpt.stored_activation_bytes(cs.B, cs.T);
  r.work = gpt.work16_bytes(cs.B, cs.T);
  return r;
}

// The fastest forward of a one-layer model of the same shape.
double one_layer_forward_ms(model::ModelConfig mc, const Case& cs, int warmup, int steps) {
  mc.n_layer = 1;
  model::GPT gpt(mc, 1337);
  const int n = cs.B * cs.T;
  const std::vector<int32_t> in = synthetic_tokens(n, mc.vocab_size, 1), tg = synthetic_tokens(n, mc.vocab_size, 2);
  double best = 1e300;
  for (int s = 0; s < warmup + steps; s++) {
    Timer t;
    gpt.forward(0, in.data(), tg.data(), cs.B, cs.T, 1.0f);
    const double f = t.millis();
    gpt.release(0);
    if (s >= warmup) best = std::min(best, f);
  }
  return best;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= s.size()) {
    size_t end = s.find(',', begin);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

static int bench_recompute(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  std::vector<Case> cases;
  std::vector<model::Recompute> modes = {model::Recompute::None, model::Recompute::Selective, model::Recompute::Full};
  long long steps = 3, warmup = 1, repeat = 1, threads = 0;
  bool json = false;
  for (size_t i = 1; i < args.size(); i++) {
    if (parse_config_flag(args, &i, &config_path, &overrides)) continue;
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf("%s", kBenchRecomputeHelp);
      return 0;
    } else if (args[i] == "--case") {
      const std::string v = flag_value(args, i++);
      const size_t colon = v.find(':');
      LATTICE_CHECK(colon != std::string::npos, "--case expects B:T (e.g. 4:256), got '" << v << "'");
      cases.push_back({static_cast<int>(parse_int_flag("--case", v.substr(0, colon))),
                       static_cast<int>(parse_int_flag("--case", v.substr(colon + 1)))});
      LATTICE_CHECK(cases.back().B >= 1 && cases.back().T >= 1, "--case expects B, T >= 1, got '" << v << "'");
    } else if (args[i] == "--modes") {
      modes.clear();
      for (const std::string& m : split_commas(flag_value(args, i++))) modes.push_back(model::recompute_from_name(m));
    } else if (args[i] == "--steps") {
      steps = parse_int_flag("--steps", flag_value(args, i++), 1);
    } else if (args[i] == "--warmup") {
      warmup = parse_int_flag("--warmup", flag_value(args, i++), 0);
    } else if (args[i] == "--repeat") {
      repeat = parse_int_flag("--repeat", flag_value(args, i++), 1);
    } else if (args[i] == "--threads") {
      threads = parse_int_flag("--threads", flag_value(args, i++), 0);
    } else if (args[i] == "--json") {
      json = true;
    } else {
      LATTICE_FAIL("lattice bench recompute: unknown option '" << args[i] << "' (see lattice bench recompute --help)");
    }
  }
  if (cases.empty()) cases = {{4, 256}, {1, 1024}};
  // The model: GPT-2 124M unless -c / --set say otherwise (only [model] is read).
  const io::RunConfig cfg = io::load_config(config_path, overrides);
  model::ModelConfig mc = train::checked_model_config(cfg);
  if (threads > 0) set_num_threads(static_cast<int>(threads));
  for (const Case& cs : cases) {
    LATTICE_CHECK(cs.T <= mc.seq_len, "--case " << cs.B << ":" << cs.T << ": T exceeds model.seq_len=" << mc.seq_len);
    std::vector<ModeResult> best;
    double one_layer = 1e300;
    for (long long rep = 0; rep < repeat; rep++) {
      one_layer = std::min(one_layer, one_layer_forward_ms(mc, cs, static_cast<int>(warmup), static_cast<int>(steps)));
      for (size_t m = 0; m < modes.size(); m++) {
        ModeResult r = run_mode(mc, cs, modes[m], static_cast<int>(warmup), static_cast<int>(steps));
        if (rep == 0)
          best.push_back(r);
        else if (r.best.step < best[m].best.step)
          best[m].best = r.best;
      }
    }
    const ModeResult* none = nullptr;
    for (const ModeResult& r : best)
      if (r.mode == model::Recompute::None) none = &r;
    const double base_step = none ? none->best.step : best.front().best.step;
    const double base_forward = none ? none->best.forward : best.front().best.forward;
    // The forward of the L - 1 layers full recomputation runs again: the
    // whole forward less a one-layer model's (embedding, one layer, head, loss).
    const double rerun = base_forward - one_layer;
    if (json) {
      for (const ModeResult& r : best)
        std::printf(
            "{\"bench\":\"recompute\",\"n_layer\":%d,\"n_embd\":%d,\"n_head\":%d,\"batch\":%d,\"seq\":%d,"
            "\"threads\":%d,\"mode\":\"%s\",\"step_ms\":%.3f,\"forward_ms\":%.3f,\"backward_ms\":%.3f,"
            "\"optimizer_ms\":%.3f,\"overhead\":%.5f,\"forward_share_none\":%.5f,\"rerun_forward_share\":%.5f,"
            "\"one_layer_forward_ms\":%.3f,\"peak_activation_bytes\":%zu,\"stored_activation_bytes\":%zu,"
            "\"work_bytes\":%zu,\"loss\":%.6f,\"cpu\":%s}\n",
            mc.n_layer, mc.n_embd, mc.n_head, cs.B, cs.T, num_threads(), model::recompute_name(r.mode), r.best.step,
            r.best.forward, r.best.backward, r.best.optimizer, r.best.step / base_step - 1, base_forward / base_step,
            rerun / base_step, one_layer, r.peak_activations, r.stored, r.work, r.loss,
            io::json_quote(cpu_info().model).c_str());
      continue;
    }
    std::printf("model L=%d C=%d H=%d V=%d, B=%d T=%d, %d threads, best of %lld steps x %lld repeats\n", mc.n_layer,
                mc.n_embd, mc.n_head, mc.vocab_size, cs.B, cs.T, num_threads(), steps, repeat);
    std::printf("  %-10s %9s %9s %9s %9s %9s %12s %11s\n", "mode", "step ms", "fwd ms", "bwd ms", "adamw ms",
                "overhead", "peak act MiB", "stored MiB");
    for (const ModeResult& r : best)
      std::printf("  %-10s %9.1f %9.1f %9.1f %9.1f %8.1f%% %12.1f %11.1f\n", model::recompute_name(r.mode),
                  r.best.step, r.best.forward, r.best.backward, r.best.optimizer,
                  100.0 * (r.best.step / base_step - 1), mib(r.peak_activations), mib(r.stored));
    std::printf("  forward share of the step (none): %.1f%%; forward of the %d layers full re-runs: %.1f%% of the "
                "step (one-layer model's forward %.1f ms)\n",
                100.0 * base_forward / base_step, mc.n_layer - 1, 100.0 * rerun / base_step, one_layer);
  }
  return 0;
}

LATTICE_REGISTER_BENCH("recompute", "activation recomputation: step time and activation memory per mode",
                       bench_recompute);

}  // namespace lattice::cli
