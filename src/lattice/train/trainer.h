// Trainer: builds the model, optimizer, data and logging from a RunConfig and
// runs the step loop, on one process or as one rank of a dp × tp job: each
// tensor-parallel group of parallel.tp ranks holds one replica of the model
// in slices (parallel/tensor), and data parallelism (with ZeRO sharding over
// the dp ranks of each TP rank) runs over the replicas.
//
// One optimizer step = one global batch (train.global_batch_size, or dp ×
// micro_batch_size × grad_accum_steps sequences): each data-parallel rank
// runs its micro-batches (forward + backward, loss scaled by 1/micro-batches),
// the gradients are summed over the ranks (parallel::DataParallel, with the
// ZeRO stage's sharding), then the global gradient norm, clipping, this
// step's learning rate and one AdamW update on each rank's shard. Every step
// prints one line on rank 0 (step, loss, lr, grad norm, ms, tokens/s, MFU,
// peak memory, and with dp > 1 the communication time and the share of it
// hidden behind the backward) and appends one JSON object to
// log.metrics_file. Loss, token counts and norms are reduced over the ranks,
// so the line describes the whole job; the run's decisions (stop on a
// signal, refuse a non-finite step) are taken once for every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lattice/io/config.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/train/batches.h"
#include "lattice/train/loss_scaler.h"
#include "lattice/train/machine.h"
#include "lattice/train/model_io.h"

namespace lattice::io {
class MetricsWriter;
}
namespace lattice::comm {
class Communicator;
class ProcessMesh;
}
namespace lattice::parallel {
class DataParallel;
struct CompressionOptions;
}
namespace lattice::tensor {
class TensorParallel;
}
namespace lattice::pipeline {
struct MicroBatch;
}

namespace lattice::train {

struct StepStats {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken
  double loss = 0, lr = 0, grad_norm = 0, step_ms = 0, tokens_per_sec = 0, mfu = 0, val_loss = -1;
  size_t peak_mem_bytes = 0;  // the largest of any rank's
  // Data-parallel communication of the step (0 with one rank), rank 0's.
  double comm_ms = 0;          // wall time the collectives ran on the communication thread
  double comm_exposed_ms = 0;  // of which the compute thread waited for: the cost on the critical path
  double comm_hidden = 1;      // 1 - exposed / ran
  uint64_t comm_bytes = 0;  // bytes this rank sent
  // Of which the gradient reductions (compression.grad: compressed), and what
  // they would have sent uncompressed.
  uint64_t grad_bytes = 0, grad_bytes_uncompressed = 0;
  // Tensor-parallel communication of the step (0 without TP), rank 0's: the
  // collectives sit on the critical path, so this is time the step waited.
  double tp_comm_ms = 0;
  uint64_t tp_comm_bytes = 0;
  // Pipeline parallelism (pp > 1): the step's measured bubble (idle share of
  // ranks × span) and the simulator's for the measured action costs.
  double pp_bubble = -1, pp_bubble_simulated = -1;
  // f16 compute: the loss scale the step ran with, and whether its gradients
  // overflowed on some rank (the update was skipped everywhere).
  double loss_scale = 1;
  bool skipped = false;
};

struct TrainerOptions {
  bool print = true;  // the per-step line and the run header/summary (rank 0)
  // Ranks to lay the mesh over; null = every rank of the job (MPI_COMM_WORLD).
  // Tests use a one-rank split to run a reference beside a parallel layout.
  comm::Communicator* ranks = nullptr;
  // Runs each micro-batch's backward split, backward_input then
  // backward_weight (as zero-bubble pipeline schedules will), instead of the
  // fused backward: the same arithmetic, tested to train the same model.
  bool split_backward = false;
  // Tests: at step index `poison_step` (from 0), rank `poison_rank` of the job's ranks
  // multiplies its loss gradient by infinity, as an f16 overflow in its
  // backward would (-1: never).
  int64_t poison_step = -1;
  int poison_rank = 0;
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
  // Mean loss over train.eval_steps global batches of the val data
  // (restarted each time), over every rank.
  double evaluate();
  // Writes checkpoint.dir/step_NNNNNN (model, optimizer, meta.json).
  std::string save_checkpoint();
  // Loads a step directory (model, optimizer, step, loader position, RNG).
  void load_checkpoint(const std::string& step_dir);

  // The model (under pipeline parallelism: the first stage this rank runs).
  model::GPT& model();
  bool pipelined() const { return pipe_ != nullptr; }
  optim::AdamW& optimizer();
  parallel::DataParallel& data_parallel() { return *dp_; }
  // Every parameter as its full logical tensor in HF layout (the checkpoint's
  // view: the same names and values whatever the layout). Collective: every
  // rank calls it; every rank gets the tensors.
  std::vector<HfTensor> full_tensors(ModelBuffer which = ModelBuffer::Params);
  const comm::ProcessMesh& mesh() const { return *mesh_; }
  // Micro-batches each rank runs per step.
  int micro_batches() const { return micro_batches_; }
  int64_t step() const { return step_; }
  const io::RunConfig& config() const { return config_; }
  const std::vector<StepStats>& history() const { return history_; }
  // precision.compute, and f16's loss scale (scale 1, never moving, otherwise).
  DType compute_dtype() const { return compute_; }
  const LossScaler& loss_scaler() const { return scaler_; }
  // Peak FLOP/s that MFU is relative to (threads × measured per-core peak).
  double peak_flops() const { return peak_flops_; }
  const MachinePeak& machine_peak() const { return peak_; }

 private:
  void print_header() const;
  void print_step(const StepStats& s) const;
  StepStats train_step_unguarded();
  int run_unguarded();
  // The signal number if any rank was asked to stop, else 0 (collective).
  int stop_requested();
  // Group g's buffer `which` as HF tensors: gathered over the DP group, then
  // over the TP group. Collective; `all_ranks` false lets ranks other than
  // the world's root skip the TP assembly (they return nothing).
  std::vector<HfTensor> group_tensors(size_t g, ModelBuffer which, bool all_ranks);
  // A group's full HF tensors from this TP rank's buffer `local` (n floats):
  // under tensor parallelism every TP rank's buffer is all-gathered
  // (collective over TP) and each sliced parameter assembled. Empty unless
  // `wanted` (the gather still runs).
  std::vector<HfTensor> assemble_group(const model::ParamGroup& group, const float* local, size_t n, bool wanted);
  // Pipeline parallelism (pipeline_training.cpp).
  struct Pipeline;
  void build_pipeline(uint64_t seed);
  void build_replicas(uint64_t seed);  // dp × tp: the model (in TP slices) and DataParallel
  void setup_data(uint64_t seed);      // batch sources, resume, metrics file
  void pipeline_bubbles(double* measured, double* simulated) const;
  void pipeline_grad_bytes(uint64_t* sent, uint64_t* uncompressed);
  std::string describe_pipeline() const;
  // One step's micro-batches and the update at learning rate `lr`; returns the loss.
  double pipeline_step(float lr, double* norm);
  // The step's reduced loss and gradient norm are finite, or the run stops
  // saying so (every rank alike: both are reduced).
  void check_finite(double loss, double norm) const;
  // After the gradients are reduced: whether to apply the update. f16: the
  // loss scaler's decision on one flag reduced over the world (a skipped step
  // is said on rank 0); otherwise check_finite.
  bool apply_update(double loss, double norm);
  // The loss gradient's factor this step on this rank (the loss scale; infinity when poisoned).
  float loss_grad_factor() const;
  // The master weights changed: the models make their 16-bit compute copies again.
  void params_changed();
  // compression.* as the gradient reducer takes it.
  parallel::CompressionOptions compression_options() const;
  double pipeline_evaluate();
  std::vector<pipeline::MicroBatch> next_batches(BatchSource& source);
  // Group g of the whole model (by whole-model index) as HF tensors, on the
  // world's root, or with `all_ranks` on every rank (collective over the
  // pipeline; empty elsewhere).
  std::vector<HfTensor> pipeline_group_tensors(size_t g, ModelBuffer which, bool all_ranks);
  void load_pipeline_state(const HfSource sources[3]);

  io::RunConfig config_;
  TrainerOptions options_;
  std::unique_ptr<comm::ProcessMesh> mesh_;
  model::ModelConfig model_config_;
  std::unique_ptr<tensor::TensorParallel> tp_;
  std::unique_ptr<Pipeline> pipe_;
  std::unique_ptr<model::GPT> model_;
  std::unique_ptr<parallel::DataParallel> dp_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<io::MetricsWriter> metrics_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<StepStats> history_;
  int64_t step_ = 0;
  int micro_batches_ = 1;
  DType compute_ = DType::F32;
  LossScaler scaler_;
  uint64_t tokens_seen_ = 0;
  double peak_flops_ = 0;
  MachinePeak peak_;
  bool is_root_ = true;
  bool oversubscribed_ = false;  // this node runs more threads than it has cores
  int local_ranks_ = 1;          // ranks of this job on this node
  bool bound_ = false;           // mpiexec bound this rank to some of the node's cores
  int cpus_ = 1;                 // cores this rank may use (its binding, or its share of the node)
};

// Rewrites a metrics JSONL file without the lines whose "step" is past `step`
// (and without a torn last line); leaves it untouched when there are none.
void trim_metrics_after(const std::string& path, int64_t step);

// The model's shape from the [model] section.
model::ModelConfig model_config_of(const io::ModelSection& model);

}  // namespace lattice::train
