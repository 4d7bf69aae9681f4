// Trainer: builds the model, optimizer, data and logging from a RunConfig and
// runs the step loop. Every run is one path: a schedule over this rank's
// model parts. The mesh places the rank in a (pp, dp, tp) grid; the rank
// holds the stages of the pipeline schedule its pp coordinate runs — the
// whole model, one part and a one-stage schedule, at pp = 1 — each in
// tensor-parallel slices under tp > 1 (layers/tensor). One executor
// (parallel/pipeline) runs the schedule over the parts; one data-parallel
// engine (parallel/data: ZeRO 0-3, offload, compression) wraps every part and
// is told by the executor, through the wiring here, when a part's last
// backward of the step begins and ends.
//
// One optimizer step = one global batch (train.global_batch_size, or dp ×
// micro_batch_size × grad_accum_steps sequences): each data-parallel replica
// runs its micro-batches through the schedule (loss scaled by 1/micro-batches),
// the gradients are summed over the replicas as the backward goes, then the
// global gradient norm, clipping, this step's learning rate and one AdamW
// update on each rank's shard. Every step prints one line on rank 0 and
// appends one JSON object to log.metrics_file (report.cpp). Loss, token counts
// and norms are reduced over the ranks, so the line describes the whole job;
// the run's decisions (stop on a signal, refuse a non-finite step) are taken
// once for every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lattice/io/config.h"
#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/optim/loss_scaler.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/train/batches.h"
#include "lattice/train/machine.h"
#include "lattice/train/model_io.h"

namespace lattice::io {
class MetricsWriter;
class SafeTensorsReader;
}
namespace lattice::comm {
class Communicator;
class ProcessMesh;
}
namespace lattice::parallel {
class DataParallel;
class GroupHooksRouter;
struct CompressionOptions;
}
namespace lattice::tensor {
class TensorParallel;
}
namespace lattice::context {
class ContextParallel;
}
namespace lattice::expert {
class ExpertParallel;
}
namespace lattice::pipeline {
struct MicroBatch;
class Executor;
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
  // Bytes this rank sent between pipeline stages (pp > 1): activations, their
  // gradients and the tied embedding's sum between the first and last stage.
  uint64_t pp_comm_bytes = 0;
  // Pipeline parallelism (pp > 1): the step's measured bubble (idle share of
  // ranks × span) and the simulator's for the measured action costs.
  double pp_bubble = -1, pp_bubble_simulated = -1;
  // f16 compute: the loss scale the step ran with, and whether its gradients
  // overflowed on some rank (the update was skipped everywhere).
  double loss_scale = 1;
  bool skipped = false;
  // Mixture of experts (model.n_experts > 0; docs/moe.md): the balancing
  // losses (mean over MoE layers and micro-batches), the pairs each expert
  // took over the step (min and max over every MoE layer's experts), the
  // share of pairs a capacity dropped, and expert parallelism's all-to-alls
  // (the largest of any rank's bytes sent and wall time).
  bool moe = false;
  double aux_loss = 0, z_loss = 0, dropped_fraction = 0;
  double expert_load_min = 0, expert_load_max = 0;
  double ep_comm_ms = 0;
  uint64_t ep_comm_bytes = 0;
  // Rank 0's wall time in the MoE layers outside the all-to-alls: routing and
  // the permutations, and the expert MLPs (routed and shared).
  double moe_route_ms = 0, moe_expert_ms = 0;
};

struct TrainerOptions {
  bool print = true;  // the per-step line and the run header/summary (rank 0)
  // Ranks to lay the mesh over; null = every rank of the job (MPI_COMM_WORLD).
  // Tests use a one-rank split to run a reference beside a parallel layout.
  comm::Communicator* ranks = nullptr;
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

  // This rank's first model part (the whole model at pp = 1), and all of
  // them in stage order.
  model::GPT& model();
  const std::vector<std::unique_ptr<model::GPT>>& parts() const { return parts_; }
  optim::AdamW& optimizer();
  parallel::DataParallel& data_parallel() { return *dp_; }
  // Mixture of experts: the engine of the expert groups (over the ranks that
  // hold the same experts; null for a dense model), and the selection bias of
  // every layer [n_layer][E] (every rank has all of it).
  parallel::DataParallel* expert_data_parallel() { return expert_dp_.get(); }
  const std::vector<float>& expert_bias() const { return expert_bias_; }
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
  const optim::LossScaler& loss_scaler() const { return scaler_; }
  // Peak FLOP/s that MFU is relative to (threads × measured per-core peak).
  double peak_flops() const { return peak_flops_; }
  const MachinePeak& machine_peak() const { return peak_; }

 private:
  // The run header, the step line, the metrics record and the closing
  // summary (report.cpp).
  void print_header() const;
  void print_step(const StepStats& s) const;
  void write_metrics(const StepStats& s);
  void print_summary(double seconds, int64_t steps_ran) const;
  std::string describe_pipeline() const;
  StepStats train_step_unguarded();
  int run_unguarded();
  // The signal number if any rank was asked to stop, else 0 (collective).
  int stop_requested();
  // The schedule, the cut of the layers into its stages, this rank's parts,
  // the data-parallel engine over them and the executor, wired together.
  void build(uint64_t seed);
  void setup_data(uint64_t seed);  // batch sources, resume, metrics file
  // The whole model's group g (index in layout_model_) as HF tensors: its
  // owner stage's rank gathers it over the data-parallel group and
  // assembles it over the TP group, then sends it to the world's root, or
  // with `all_ranks` broadcasts it to every rank. Collective.
  std::vector<HfTensor> group_tensors(size_t g, ModelBuffer which, bool all_ranks);
  // A group's full HF tensors from this TP rank's buffer `local` (n floats):
  // under tensor parallelism every TP rank's buffer is all-gathered
  // (collective over TP) and each sliced parameter assembled. Empty unless
  // `wanted` (the gather still runs).
  std::vector<HfTensor> assemble_group(const model::ParamGroup& group, const float* local, size_t n, bool wanted);
  // Every part's groups from full HF tensors: the parameters from sources[0]
  // and, with `count` 3, the Adam moments from sources[1] and [2].
  void load_state(const HfSource* sources, int count);
  // The step's reduced loss and gradient norm are finite, or the run stops
  // saying so (every rank alike: both are reduced).
  void check_finite(double loss, double norm) const;
  // After the gradients are reduced: whether to apply the update. f16: the
  // loss scaler's decision on one flag reduced over the world (a skipped step
  // is said on rank 0); otherwise check_finite.
  bool apply_update(double loss, double norm);
  // The loss gradient's factor this step on this rank (the loss scale; infinity when poisoned).
  float loss_grad_factor() const;
  // The master weights changed: the parts make their 16-bit compute copies again.
  void params_changed();
  // compression.* as the gradient reducer takes it.
  parallel::CompressionOptions compression_options() const;
  // The step's micro-batches from `source`, in the batch buffers.
  std::vector<pipeline::MicroBatch> next_batches(BatchSource& source);

  io::RunConfig config_;
  TrainerOptions options_;
  std::unique_ptr<comm::ProcessMesh> mesh_;
  model::ModelConfig model_config_;
  std::unique_ptr<tensor::TensorParallel> tp_;
  std::unique_ptr<context::ContextParallel> cp_;
  pipeline::Schedule schedule_;
  std::vector<pipeline::ChunkLayers> cut_;            // layers of each stage
  std::vector<std::unique_ptr<model::GPT>> parts_;    // this rank's stages, in stage order
  std::vector<int> part_of_stage_;                    // stage -> index in parts_, -1 elsewhere
  std::unique_ptr<model::GPT> layout_model_;          // the whole model, declared only (checkpoint names)
  std::unique_ptr<parallel::DataParallel> dp_;
  // Mixture of experts: the ep group's dispatcher, the engine of the expert
  // groups, the hooks that send each group's calls to its engine, and the
  // selection bias of every layer.
  std::unique_ptr<expert::ExpertParallel> ep_;
  std::unique_ptr<parallel::DataParallel> expert_dp_;
  std::vector<std::unique_ptr<parallel::GroupHooksRouter>> hooks_routers_;
  std::vector<float> expert_bias_;
  // The engine that holds part j's group g.
  parallel::DataParallel& engine_of(size_t part, size_t g);
  // After the gradients are reduced: the MoE step statistics into s, and the selection bias updated.
  void finish_moe_step(StepStats& s);
  // The selection bias from a model file (zeros where it has none: a Mixtral
  // file from elsewhere), given to every part.
  void load_expert_bias(const io::SafeTensorsReader& file);
  // The whole model's MoE layer l's experts as HF tensors (group_tensors' expert-parallel case).
  std::vector<HfTensor> expert_group_tensors(int layer, ModelBuffer which, bool all_ranks);
  std::unique_ptr<pipeline::Executor> executor_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<io::MetricsWriter> metrics_;
  std::vector<std::vector<int32_t>> inputs_, targets_;  // per micro-batch
  // Context parallelism: this rank's chunks of them (layers/context).
  std::vector<std::vector<int32_t>> local_inputs_, local_targets_;
  // Tokens per sequence a part runs: model.seq_len, / cp under context parallelism.
  int local_seq_len() const;
  std::vector<StepStats> history_;
  int64_t step_ = 0;
  int micro_batches_ = 1;
  DType compute_ = DType::F32;
  optim::LossScaler scaler_;
  uint64_t tokens_seen_ = 0;
  double peak_flops_ = 0;
  MachinePeak peak_;
  bool is_root_ = true;
  bool oversubscribed_ = false;  // this node runs more threads than it has cores
  int local_ranks_ = 1;          // ranks of this job on this node
  bool bound_ = false;           // mpiexec bound this rank to some of the node's cores
  int cpus_ = 1;                 // cores this rank may use (its binding, or its share of the node)
  std::vector<std::string> placement_;  // the header's lines on nodes and groups (comm/placement.h)
};

// Rewrites a metrics JSONL file without the lines whose "step" is past `step`
// (and without a torn last line); leaves it untouched when there are none.
void trim_metrics_after(const std::string& path, int64_t step);

// The model of a [model] section: model::ModelConfig::defaults of its family,
// then every part key that is set (the one conversion; the trainer, resumed
// checkpoints and inference all use it). Not checked: see checked_model_config.
model::ModelConfig model_config_of(const io::ModelSection& model);
// The inverse, every key written out (family defaults resolved): what a
// checkpoint records, so that it reads the same model whatever a later
// lattice's defaults are; model_config_of(model_section_of(c)) is the same
// model as c (n_kv_head and ffn_hidden then explicit).
io::ModelSection model_section_of(const model::ModelConfig& config);
// The model of a run's config, refused (lattice::Error, one line naming the
// keys) where ModelConfig::validate() or check_tensor_parallel(parallel.tp)
// does: the trainer's first check after the io library's, and `lattice
// inspect`'s for a config file.
model::ModelConfig checked_model_config(const io::RunConfig& config);
// The model in one line for the run header: the family and its parts, e.g.
// "llama: rmsnorm, rope(θ=10000), swiglu 2304, gqa 12q/4kv, no bias, untied".
std::string describe_model(const model::ModelConfig& config);
// The [model] keys on which two models differ, in table order, with each
// one's value as a TOML literal; empty when they are the same model.
struct ModelDifference {
  std::string key;  // "model.family"
  std::string have, want;
};
std::vector<ModelDifference> model_differences(const model::ModelConfig& have, const model::ModelConfig& want);

}  // namespace lattice::train
