// Trainer: builds the model, optimizer, data and logging from a RunConfig and
// runs the step loop.
//
// One optimizer step = grad_accum_steps micro-batches, each forward + backward
// with its loss scaled by 1/grad_accum_steps, then the global gradient norm,
// clipping, the learning rate of this step and one AdamW update. Every step
// prints one line (step, loss, lr, grad norm, ms, tokens/s, MFU, peak memory)
// and appends one JSON object to log.metrics_file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lattice/io/config.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/train/batches.h"

namespace lattice::io {
class MetricsWriter;
}
namespace lattice::comm {
class ProcessMesh;
}

namespace lattice::train {

struct StepStats {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken
  double loss = 0, lr = 0, grad_norm = 0, step_ms = 0, tokens_per_sec = 0, mfu = 0, val_loss = -1;
  size_t peak_mem_bytes = 0;
};

struct TrainerOptions {
  bool print = true;  // the per-step line and the run header/summary (rank 0)
};

class Trainer {
 public:
  explicit Trainer(const io::RunConfig& config, TrainerOptions options = {});
  ~Trainer();

  // Runs steps until train.steps (evaluating, checkpointing and logging as
  // configured). Returns 0, or 130 if interrupted by SIGINT/SIGTERM (after
  // saving a checkpoint when checkpoint.dir is set).
  int run();
  // One optimizer step.
  StepStats train_step();
  // Mean loss over train.eval_steps batches of the val data (restarted each time).
  double evaluate();
  // Writes checkpoint.dir/step_NNNNNN (model, optimizer, meta.json).
  std::string save_checkpoint();
  // Loads a step directory (model, optimizer, step, loader position, RNG).
  void load_checkpoint(const std::string& step_dir);

  model::GPT& model() { return *model_; }
  optim::AdamW& optimizer() { return *optimizer_; }
  int64_t step() const { return step_; }
  const io::RunConfig& config() const { return config_; }
  const std::vector<StepStats>& history() const { return history_; }
  // Peak FLOP/s that MFU is relative to (threads × per-core peak).
  double peak_flops() const { return peak_flops_; }

 private:
  void print_header() const;
  void print_step(const StepStats& s) const;

  io::RunConfig config_;
  TrainerOptions options_;
  std::unique_ptr<comm::ProcessMesh> mesh_;
  model::ModelConfig model_config_;
  std::unique_ptr<model::GPT> model_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<io::MetricsWriter> metrics_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<StepStats> history_;
  int64_t step_ = 0;
  uint64_t tokens_seen_ = 0;
  double peak_flops_ = 0;
  bool is_root_ = true;
};

// Rewrites a metrics JSONL file without the lines whose "step" is past `step`
// (and without a torn last line); leaves it untouched when there are none.
void trim_metrics_after(const std::string& path, int64_t step);

// The model's shape from the [model] section.
model::ModelConfig model_config_of(const io::ModelSection& model);

// Model FLOPs per second of one core at fp32 that MFU divides by: the
// environment variable LATTICE_PEAK_GFLOPS_PER_CORE, else 175 (measured on the
// project's reference CPU: 2 AVX-512 FMA units at 2.8 GHz ≈ 179 GFLOP/s
// theoretical, 175 achieved by a register-blocked FMA loop).
double peak_gflops_per_core();

}  // namespace lattice::train
