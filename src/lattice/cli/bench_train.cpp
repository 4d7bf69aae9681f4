// lattice bench train [--set key=value ...] [--steps S] [--warmup W] [--json]
//   Times whole training steps (forward, backward, AdamW) of a model on
//   synthetic tokens: tokens/s and model FLOP/s, for bench/compare_gpt2.sh.
#include <algorithm>
#include <cstdio>

#include "lattice/cli/args.h"
#include "lattice/cli/bench_registry.h"
#include "lattice/core/cpu.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/threads.h"
#include "lattice/core/timer.h"
#include "lattice/io/config.h"
#include "lattice/io/json.h"
#include "lattice/comm/process_mesh.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/train/trainer.h"

namespace lattice::cli {

static const char* kBenchTrainHelp =
    "usage: lattice bench train [-c CONFIG] [--set key=value ...] [--steps S] [--warmup W] [--json]\n"
    "\n"
    "Times S training steps (after W untimed warm-up steps) on synthetic tokens.\n"
    "Under mpiexec with --set parallel.dp=N (and/or parallel.tp, cp, pp) it times the parallel\n"
    "job (rank 0 prints: tokens/s of the whole job, this rank's memory by category,\n"
    "communication).\n"
    "Defaults: GPT-2 124M, the config's batch, --steps 5 --warmup 2. Model FLOPs per\n"
    "token = 6*(N - wpe) + 12*L*C*T (see ModelConfig::flops_per_token).\n";

static int bench_train(const std::vector<std::string>& args) {
  std::string config_path;
  std::vector<std::string> overrides;
  long long steps = 5, warmup = 2;
  bool json = false;
  for (size_t i = 1; i < args.size(); i++) {
    if (parse_config_flag(args, &i, &config_path, &overrides)) continue;
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf("%s", kBenchTrainHelp);
      return 0;
    } else if (args[i] == "--steps") {
      steps = parse_int_flag("--steps", flag_value(args, i++), 1);
    } else if (args[i] == "--warmup") {
      warmup = parse_int_flag("--warmup", flag_value(args, i++), 0);
    } else if (args[i] == "--json") {
      json = true;
    } else {
      LATTICE_FAIL("lattice bench train: unknown option '" << args[i] << "' (see lattice bench train --help)");
    }
  }
  // Synthetic tokens, no evaluation, checkpoints or metrics: only the steps.
  overrides.push_back("data.train=");
  overrides.push_back("data.val=");
  overrides.push_back("checkpoint.dir=");
  // Keys that go with a checkpoint directory are refused without one (docs/config.md).
  overrides.push_back("checkpoint.every=0");
  overrides.push_back("checkpoint.keep=" + std::to_string(io::CheckpointSection().keep));
  overrides.push_back("log.metrics_file=");
  overrides.push_back("train.steps=" + std::to_string(steps + warmup));
  io::RunConfig cfg = io::load_config(config_path, overrides);
  train::Trainer trainer(cfg, train::TrainerOptions{false});
  for (long long i = 0; i < warmup; i++) trainer.train_step();
  std::vector<double> ms;
  double comm_ms = 0, hidden = 0, tp_ms = 0, bubble = 0, bubble_sim = 0;
  uint64_t comm_bytes = 0, tp_bytes = 0, ep_bytes = 0;
  double loss_last = 0, route_ms = 0, expert_ms = 0, ep_ms = 0;
  Timer total;
  for (long long i = 0; i < steps; i++) {
    const train::StepStats st = trainer.train_step();
    ms.push_back(st.step_ms);
    loss_last = st.loss;
    comm_ms += st.comm_ms, hidden += st.comm_hidden, comm_bytes += st.comm_bytes;
    tp_ms += st.tp_comm_ms, tp_bytes += st.tp_comm_bytes;
    bubble += st.pp_bubble, bubble_sim += st.pp_bubble_simulated;
    route_ms += st.moe_route_ms, expert_ms += st.moe_expert_ms, ep_ms += st.ep_comm_ms, ep_bytes += st.ep_comm_bytes;
  }
  const double seconds = total.seconds();
  const int ranks = trainer.mesh().world().size(), dp = trainer.mesh().dp().size();
  const double tokens = static_cast<double>(io::global_batch_size(cfg)) * cfg.model.seq_len * steps;
  model::ModelConfig mc = trainer.model().config();
  const double tok_s = tokens / seconds;
  const double flops = tok_s * mc.flops_per_token(cfg.model.seq_len);
  // The peak of the arithmetic the GEMMs run in (train/machine.h): bf16's
  // when bf16 GEMMs run on oneDNN's bf16 matmul, fp32's otherwise.
  const train::MachinePeak& peak = trainer.machine_peak();
  const double peak_per_core = peak.gflops_per_core(trainer.compute_dtype());
  const double mfu = flops / (peak_per_core * 1e9 * num_threads() * ranks);
  std::sort(ms.begin(), ms.end());
  // Memory of this rank (rank 0 prints; every rank of a data-parallel job
  // holds the same amounts).
  const MemoryTracker& mem = MemoryTracker::instance();
  const double model_state = static_cast<double>(mem.peak(MemCategory::Params) + mem.peak(MemCategory::Grads) +
                                                 mem.peak(MemCategory::Optimizer));
  if (trainer.mesh().world_rank() != 0) return 0;
  if (json) {
    std::printf(
        "{\"impl\":\"lattice\",\"family\":\"%s\",\"n_layer\":%d,\"n_head\":%d,\"n_kv_head\":%d,\"n_embd\":%d,"
        "\"ffn_hidden\":%d,\"vocab_size\":%d,\"tie_embeddings\":%s,\"n_params\":%lld,\"flops_per_token\":%.0f,"
        "\"batch\":%d,"
        "\"seq\":%d,\"threads\":%d,\"ranks\":%d,\"zero_stage\":%d,\"offload\":\"%s\",\"steps\":%lld,"
        "\"tokens_per_sec\":%.3f,\"step_ms\":%.3f,\"step_ms_median\":%.3f,\"model_flops_per_sec\":%.6e,"
        "\"mfu\":%.4f,\"peak_gflops_per_core\":%.3f,\"peak_dtype\":\"%s\",\"comm_ms\":%.3f,\"comm_hidden\":%.4f,"
        "\"comm_bytes_per_step\":%.0f,\"peak_mem_bytes\":%zu,\"params_bytes\":%zu,\"grads_bytes\":%zu,"
        "\"optimizer_bytes\":%zu,\"activations_bytes\":%zu,\"model_state_bytes\":%.0f,\"dp\":%d,\"tp\":%d,"
        "\"sequence_parallel\":%s,\"tp_comm_ms\":%.3f,\"tp_comm_bytes_per_step\":%.0f,"
        "\"stored_activation_bytes\":%zu,\"cp\":%d,\"cp_mode\":\"%s\",\"pp\":%d,\"schedule\":%s,\"micro_batches\":%d,\"pp_bubble\":%.4f,"
        "\"pp_bubble_simulated\":%.4f,\"compute\":\"%s\",\"loss_last\":%.6f,\"n_experts\":%d,\"top_k\":%d,\"ep\":%d,"
        "\"active_params\":%lld,\"moe_route_ms\":%.3f,\"moe_expert_ms\":%.3f,\"ep_comm_ms\":%.3f,"
        "\"ep_comm_bytes_per_step\":%.0f,\"cpu\":%s,\"isa\":\"%s\"}\n",
        model::name_of(mc.family), mc.n_layer, mc.n_head, mc.kv_heads(), mc.n_embd, mc.ffn(), mc.vocab_size,
        mc.tie_embeddings ? "true" : "false", static_cast<long long>(mc.num_params() - mc.lookup_params()),
        mc.flops_per_token(cfg.model.seq_len), cfg.train.micro_batch_size, cfg.model.seq_len,
        num_threads(), ranks, cfg.parallel.zero_stage, cfg.zero.offload.c_str(), steps, tok_s, 1e3 * seconds / steps,
        ms[ms.size() / 2], flops, mfu, peak_per_core,
        peak.gemm_dtype(trainer.compute_dtype()) == DType::BF16 ? "bf16" : "fp32", comm_ms / steps, hidden / steps,
        static_cast<double>(comm_bytes) / steps, mem.peak_total(), mem.peak(MemCategory::Params),
        mem.peak(MemCategory::Grads), mem.peak(MemCategory::Optimizer), mem.peak(MemCategory::Activations),
        model_state, dp, cfg.parallel.tp, cfg.parallel.sequence_parallel ? "true" : "false", tp_ms / steps,
        static_cast<double>(tp_bytes) / steps,
        trainer.model().stored_activation_bytes(cfg.train.micro_batch_size, cfg.model.seq_len / cfg.parallel.cp),
        cfg.parallel.cp, cfg.parallel.cp_mode.c_str(), cfg.parallel.pp,
        io::json_quote(cfg.parallel.schedule).c_str(), trainer.micro_batches(), bubble / steps, bubble_sim / steps,
        cfg.precision.compute.c_str(), loss_last, mc.n_experts, mc.n_experts > 0 ? mc.top_k : 0, cfg.parallel.ep,
        static_cast<long long>(mc.active_params() - mc.lookup_params()), route_ms / steps, expert_ms / steps,
        ep_ms / steps, static_cast<double>(ep_bytes) / steps, io::json_quote(cpu_info().model).c_str(),
        isa_name(active_isa()));
  } else {
    std::printf("model L=%d C=%d H=%d V=%d, batch %d x %d x %d micro-batches x %d dp ranks, %d threads per rank, "
                "%lld steps\n",
                mc.n_layer, mc.n_embd, mc.n_head, mc.vocab_size, cfg.train.micro_batch_size, cfg.model.seq_len,
                trainer.micro_batches(), dp, num_threads(), steps);
    std::printf("  %.1f tokens/s, %.1f ms/step (median %.1f), %.1f GFLOP/s model, MFU %.1f%%\n", tok_s,
                1e3 * seconds / steps, ms[ms.size() / 2], flops / 1e9, 100.0 * mfu);
    if (dp > 1)
      std::printf("  communication %.1f ms/step, %.0f%% hidden, %s sent per rank per step\n", comm_ms / steps,
                  100.0 * hidden / steps, format_bytes(static_cast<double>(comm_bytes) / steps).c_str());
    if (cfg.parallel.pp > 1)
      std::printf("  pipeline %s, %d micro-batches: measured bubble %.1f%%, simulated for the measured costs %.1f%%\n",
                  cfg.parallel.schedule.c_str(), trainer.micro_batches(), 100.0 * bubble / steps,
                  100.0 * bubble_sim / steps);
    if (cfg.parallel.cp > 1)
      std::printf("  context parallelism cp=%d (%s): each rank holds %d of the %d tokens of a sequence\n",
                  cfg.parallel.cp, cfg.parallel.cp_mode.c_str(), cfg.model.seq_len / cfg.parallel.cp,
                  cfg.model.seq_len);
    if (cfg.parallel.tp > 1)
      std::printf("  tensor-parallel communication %.1f ms/step (%.0f%% of the step), %s sent per rank per step\n",
                  tp_ms / steps, 100.0 * tp_ms / (1e3 * seconds),
                  format_bytes(static_cast<double>(tp_bytes) / steps).c_str());
    std::printf("  memory per rank: %s\n", mem.summary().c_str());
    std::printf("  machine %s\n  MFU relative to %s\n", train::describe_machine().c_str(),
                peak.describe(trainer.compute_dtype()).c_str());
  }
  return 0;
}

LATTICE_REGISTER_BENCH("train", "time whole training steps of a model (tokens/s, model FLOP/s)", bench_train);

}  // namespace lattice::cli
