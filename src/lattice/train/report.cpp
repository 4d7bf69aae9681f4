// What a run says: the run header, the step line, the metrics record and
// the closing summary (the contract of docs/config.md's [log] section).
#include <cstdio>
#include <string>

#include "lattice/comm/process_mesh.h"
#include "lattice/core/memory.h"
#include "lattice/core/threads.h"
#include "lattice/io/metrics.h"
#include "lattice/layers/context/context_parallel.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/pipeline/simulator.h"
#include "lattice/train/trainer.h"

#include "lattice/layers/context/context_parallel.h"

namespace lattice::train {

namespace {

std::string human_count(double x) {
  char buf[32];
  if (x >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fB", x / 1e9);
  else if (x >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
  else if (x >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fK", x / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

}  // namespace

std::string describe_model(const model::ModelConfig& c) {
  std::string s = std::string(model::name_of(c.family)) + ": " + model::name_of(c.norm) + ", ";
  if (c.position == model::PositionKind::Rope) {
    char theta[48];
    std::snprintf(theta, sizeof theta, "rope(θ=%g)", static_cast<double>(c.rope_theta));
    s += theta;
  } else {
    s += "learned positions";
  }
  s += std::string(", ") + model::name_of(c.mlp) + " " + std::to_string(c.ffn());
  if (c.kv_heads() == c.n_head)
    s += ", mha " + std::to_string(c.n_head) + " heads";
  else
    s += ", gqa " + std::to_string(c.n_head) + "q/" + std::to_string(c.kv_heads()) + "kv";
  s += c.bias ? ", biases" : ", no bias";
  s += c.tie_embeddings ? ", tied" : ", untied";
  return s;
}

std::string Trainer::describe_pipeline() const {
  std::string out = "pipeline " + schedule_.name + " over " + std::to_string(schedule_.ranks) + " ranks, " +
                    std::to_string(schedule_.stages) + " stages of layers";
  for (const pipeline::ChunkLayers& c : cut_)
    out += " [" + std::to_string(c.first) + "," + std::to_string(c.last) + ")";
  out += ", " + std::to_string(schedule_.micro_batches) + " micro-batches per step; simulated bubble at equal costs " +
         std::to_string(pipeline::simulate(schedule_).bubble).substr(0, 5);
  return out;
}

void Trainer::print_header() const {
  if (!options_.print || !is_root_) return;
  const auto& m = config_.model;
  std::printf("lattice: model %s parameters (n_layer=%d n_head=%d n_embd=%d vocab=%d seq_len=%d), %s\n",
              human_count(static_cast<double>(model_config_.num_params())).c_str(), m.n_layer, m.n_head, m.n_embd,
              m.vocab_size, m.seq_len, describe_model(model_config_).c_str());
  std::printf(
      "lattice: batch %d x %d tokens x %d micro-batches x %d data-parallel ranks = %lld tokens/step, %lld steps, "
      "%d threads per rank\n",
      config_.train.micro_batch_size, m.seq_len, micro_batches_, config_.parallel.dp,
      static_cast<long long>(io::global_batch_size(config_) * m.seq_len), static_cast<long long>(config_.train.steps),
      num_threads());
  if (oversubscribed_) {
    const int cores = node_cores();
    if (bound_)
      std::printf(
          "lattice: warning: %d threads per rank on the %d core(s) mpiexec bound each rank to: threads wait "
          "for each other's cores and a step can take many times longer; set train.threads=%d (or 0), or "
          "start with mpiexec --bind-to none\n",
          num_threads(), cpus_, cpus_);
    else if (local_ranks_ > cores)
      std::printf(
          "lattice: warning: %d ranks on this node's %d cores: they take turns, so steps are slow and time "
          "figures mean nothing (fine for checking correctness)\n",
          local_ranks_, cores);
    else
      std::printf(
          "lattice: warning: %d ranks x %d threads on this node's %d cores: threads wait for each other's "
          "cores and a step can take many times longer; set train.threads=%d (or 0 to share the cores)\n",
          local_ranks_, num_threads(), cores, cpus_);
  } else if (bound_ && local_ranks_ * cpus_ < node_cores()) {
    std::printf(
        "lattice: note: mpiexec bound each rank to %d of this node's %d cores, leaving %d idle; "
        "mpiexec --bind-to none lets the ranks share them all\n",
        cpus_, node_cores(), node_cores() - local_ranks_ * cpus_);
  }
  std::printf("lattice: %s\n", dp_->describe().c_str());
  for (const std::string& line : placement_) std::printf("lattice: %s\n", line.c_str());
  if (expert_dp_) {
    const model::ModelConfig& c = model_config_;
    char capacity[48];
    std::snprintf(capacity, sizeof capacity, ", capacity factor %g", config_.moe.capacity_factor);
    std::printf(
        "lattice: mixture of experts: %d of %d layers (every %d), %d experts of width %d, top-%d%s%s; %lld of %lld "
        "parameters active per token; expert parallel over %d rank%s (%d experts each); %s\n",
        c.moe_layers(), c.n_layer, c.moe_every, c.n_experts, c.moe_ffn(), c.top_k,
        c.n_shared_experts > 0 ? (" + " + std::to_string(c.n_shared_experts) + " shared").c_str() : "",
        config_.moe.capacity_factor > 0 ? capacity : ", dropless",
        static_cast<long long>(c.active_params()), static_cast<long long>(c.num_params()), config_.parallel.ep,
        config_.parallel.ep == 1 ? "" : "s", c.n_experts / config_.parallel.ep, expert_dp_->describe().c_str());
  }
  if (compute_ == DType::BF16)
    std::printf(
        "lattice: precision: bf16 compute (weights and stored activations rounded to bf16, f32 master "
        "weights, Adam moments, gradients and accumulation); no loss scale: bf16 has f32's exponent range\n");
  else if (compute_ == DType::F16)
    std::printf(
        "lattice: precision: f16 compute (weights and stored activations rounded to f16, f32 master "
        "weights, Adam moments, gradients and accumulation); %s\n",
        scaler_.describe().c_str());
  if (config_.recompute.mode != "none") {
    // This rank's parts: how many of their layers recompute, and what a micro-batch keeps.
    int recomputed = 0, layers = 0;
    size_t stored = 0;
    for (const auto& part : parts_) {
      for (int i = 0; i < part->last_layer() - part->first_layer(); i++, layers++)
        recomputed += part->recompute_of(i) != model::Recompute::None ? 1 : 0;
      stored += part->stored_activation_bytes(config_.train.micro_batch_size, m.seq_len);
    }
    std::printf("lattice: activation recomputation: %s on %d of this rank's %d layers (recompute.every=%d, "
                "recompute.first=%d); a micro-batch stores %s of activations (docs/recompute.md)\n",
                config_.recompute.mode.c_str(), recomputed, layers, config_.recompute.every, config_.recompute.first,
                format_bytes(static_cast<double>(stored)).c_str());
  }
  if (schedule_.ranks > 1) std::printf("lattice: %s\n", describe_pipeline().c_str());
  if (tp_) {
    const model::GPT& any = *parts_.front();
    const model::GPT::Dims& d = any.dims();
    std::printf(
        "lattice: tensor parallel over %d ranks%s: each holds %d of %d heads, %d of %d MLP columns and %d of "
        "%d vocabulary rows (padded from %d)\n",
        tp_->size(), tp_->sequence_parallel() ? ", sequence parallel" : "", d.NH, m.n_head, d.F, model_config_.ffn(),
        d.V, any.wte_rows(), m.vocab_size);
  }
  if (cp_) {
    const int T = config_.model.seq_len;
    std::printf(
        "lattice: context parallel over %d ranks (%s): each holds %d of a sequence's %d tokens (chunks of %d, "
        "the balanced causal split); gradients averaged and ZeRO sharded over dp x cp = %d ranks\n",
        cp_->size(), context::name_of(cp_->mode()), T / cp_->size(), T, T / (2 * cp_->size()), dp_->ranks());
  }
  if (config_.parallel.zero_stage > 0 && config_.parallel.dp * config_.parallel.cp == 1)
    std::printf(
        "lattice: note: parallel.zero_stage=%d with parallel.dp=1 shards over one rank: it runs the "
        "stage's machinery and trains the same model as stage 0%s\n",
        config_.parallel.zero_stage, config_.zero.offload == "disk" ? " (the offload still applies)" : "");
  if (config_.compression.grad != "none" && config_.parallel.dp * config_.parallel.cp == 1)
    std::printf(
        "lattice: note: compression.grad=%s with parallel.dp=1: one rank sends no gradients, so nothing "
        "is compressed\n",
        config_.compression.grad.c_str());
  std::printf("lattice: data %s\n", train_data_->describe().c_str());
  if (val_data_ && config_.train.eval_every > 0)
    std::printf("lattice: eval every %lld steps on %s\n", static_cast<long long>(config_.train.eval_every),
                val_data_->describe().c_str());
  std::printf("lattice: machine %s\n", describe_machine().c_str());
  std::printf("lattice: MFU relative to %s\n", peak_.describe(compute_).c_str());
  std::fflush(stdout);
}

void Trainer::print_step(const StepStats& s) const {
  if (!options_.print || !is_root_) return;
  char val[48] = "";
  if (s.val_loss >= 0) std::snprintf(val, sizeof val, " | val %.4f", s.val_loss);
  char comm[96] = "";
  if (dp_->ranks() > 1)
    std::snprintf(comm, sizeof comm, " | comm %.0f ms, %.0f%% hidden, %.0f ms exposed", s.comm_ms,
                  100.0 * s.comm_hidden, s.comm_exposed_ms);
  char bubble[64] = "";
  if (s.pp_bubble >= 0)
    std::snprintf(bubble, sizeof bubble, " | bubble %.0f%% (simulated %.0f%%)", 100.0 * s.pp_bubble,
                  100.0 * s.pp_bubble_simulated);
  char scale[80] = "";
  if (compute_ == DType::F16)
    std::snprintf(scale, sizeof scale, " | scale %g%s", s.loss_scale, s.skipped ? " (overflow: skipped)" : "");
  char tp[64] = "";
  if (tp_)
    std::snprintf(tp, sizeof tp, " | tp comm %.0f ms (%.0f%%)", s.tp_comm_ms,
                  s.step_ms > 0 ? 100.0 * s.tp_comm_ms / s.step_ms : 0.0);
  char moe[160] = "";
  if (s.moe) {
    int n = std::snprintf(moe, sizeof moe, " | aux %.4f z %.4f | experts %.0f..%.0f", s.aux_loss, s.z_loss,
                          s.expert_load_min, s.expert_load_max);
    if (config_.moe.capacity_factor > 0 && n > 0)
      n += std::snprintf(moe + n, sizeof moe - n, ", dropped %.1f%%", 100.0 * s.dropped_fraction);
    if (config_.parallel.ep > 1 && n > 0)
      std::snprintf(moe + n, sizeof moe - n, " | a2a %.0f ms %s", s.ep_comm_ms,
                    format_bytes(static_cast<double>(s.ep_comm_bytes)).c_str());
  }
  std::printf(
      "step %*lld/%lld | loss %.4f%s | lr %.2e | norm %.3f%s | %.1f ms | %s tok/s | MFU %.1f%% | mem %s%s%s%s%s\n",
      static_cast<int>(std::to_string(config_.train.steps).size()), static_cast<long long>(s.step),
      static_cast<long long>(config_.train.steps), s.loss, val, s.lr, s.grad_norm, scale, s.step_ms,
      human_count(s.tokens_per_sec).c_str(), 100.0 * s.mfu, format_bytes(static_cast<double>(s.peak_mem_bytes)).c_str(),
      comm, bubble, tp, moe);
  std::fflush(stdout);
}

void Trainer::write_metrics(const StepStats& s) {
  if (!metrics_) return;
  std::vector<std::pair<std::string, double>> fields = {{"step", static_cast<double>(s.step)},
                                                        {"loss", s.loss},
                                                        {"lr", s.lr},
                                                        {"grad_norm", s.grad_norm},
                                                        {"step_ms", s.step_ms},
                                                        {"tokens_per_sec", s.tokens_per_sec},
                                                        {"mfu", s.mfu},
                                                        {"peak_mem_bytes", static_cast<double>(s.peak_mem_bytes)},
                                                        {"tokens", static_cast<double>(tokens_seen_)},
                                                        {"comm_ms", s.comm_ms},
                                                        {"comm_hidden", s.comm_hidden},
                                                        {"comm_exposed_ms", s.comm_exposed_ms},
                                                        {"comm_bytes", static_cast<double>(s.comm_bytes)}};
  if (config_.compression.grad != "none") {
    fields.push_back({"grad_bytes", static_cast<double>(s.grad_bytes)});
    fields.push_back({"grad_bytes_uncompressed", static_cast<double>(s.grad_bytes_uncompressed)});
  }
  if (compute_ == DType::F16) {
    fields.push_back({"loss_scale", s.loss_scale});
    fields.push_back({"skipped", s.skipped ? 1.0 : 0.0});
    fields.push_back({"skipped_total", static_cast<double>(scaler_.skipped())});
  }
  if (s.pp_bubble >= 0) {
    fields.push_back({"pp_bubble", s.pp_bubble});
    fields.push_back({"pp_bubble_simulated", s.pp_bubble_simulated});
    fields.push_back({"pp_comm_bytes", static_cast<double>(s.pp_comm_bytes)});
  }
  if (tp_) {
    fields.push_back({"tp_comm_ms", s.tp_comm_ms});
    fields.push_back({"tp_comm_bytes", static_cast<double>(s.tp_comm_bytes)});
  }
  if (s.moe) {
    fields.push_back({"aux_loss", s.aux_loss});
    fields.push_back({"z_loss", s.z_loss});
    fields.push_back({"expert_load_min", s.expert_load_min});
    fields.push_back({"expert_load_max", s.expert_load_max});
    fields.push_back({"dropped_fraction", s.dropped_fraction});
    fields.push_back({"ep_comm_ms", s.ep_comm_ms});
    fields.push_back({"ep_comm_bytes", static_cast<double>(s.ep_comm_bytes)});
    fields.push_back({"moe_route_ms", s.moe_route_ms});
    fields.push_back({"moe_expert_ms", s.moe_expert_ms});
  }
  if (s.val_loss >= 0) fields.push_back({"val_loss", s.val_loss});
  metrics_->write(fields);
}

void Trainer::print_summary(double seconds, int64_t steps_ran) const {
  if (!options_.print || !is_root_) return;
  double tok_s = 0;
  // Steady-state throughput: skip the first step (allocation, warm-up) when there are others.
  double ms = 0;
  int counted = 0;
  for (size_t i = history_.size() > 1 ? 1 : 0; i < history_.size(); i++, counted++) ms += history_[i].step_ms;
  if (counted > 0 && ms > 0)
    tok_s = counted * static_cast<double>(io::global_batch_size(config_)) * config_.model.seq_len / (ms / 1e3);
  std::printf("lattice: done, %lld steps in %.1f s, final loss %.4f", static_cast<long long>(steps_ran), seconds,
              history_.empty() ? 0.0 : history_.back().loss);
  for (auto it = history_.rbegin(); it != history_.rend(); ++it)
    if (it->val_loss >= 0) {
      std::printf(", val loss %.4f", it->val_loss);
      break;
    }
  std::printf(
      ", %s tok/s, MFU %.1f%%\n", human_count(tok_s).c_str(),
      100.0 * tok_s * model_config_.flops_per_token(config_.model.seq_len) / (peak_flops_ * mesh_->world().size()));
  std::printf("lattice: peak memory %s\n", MemoryTracker::instance().summary().c_str());
  std::fflush(stdout);
}

}  // namespace lattice::train
