#include "lattice/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "lattice/comm/process_mesh.h"
#include "lattice/parallel/tensor/tensor_parallel.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/threads.h"
#include "lattice/core/timer.h"
#include "lattice/io/checkpoint.h"
#include "lattice/io/file_util.h"
#include "lattice/io/json.h"
#include "lattice/io/metrics.h"
#include "lattice/io/safetensors.h"
#include "lattice/kernels/ops.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/zero/disk_store.h"
#include "lattice/train/model_io.h"
#include "lattice/train/pipeline_state.h"

namespace lattice::train {

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// Installs SIGINT/SIGTERM handlers for the lifetime of a run() and restores
// the previous ones after, so a second Ctrl-C during the final save still
// kills the process the usual way.
class StopSignalScope {
 public:
  StopSignalScope() {
    g_stop_signal.store(0);
    old_int_ = std::signal(SIGINT, on_stop_signal);
    old_term_ = std::signal(SIGTERM, on_stop_signal);
  }
  ~StopSignalScope() {
    std::signal(SIGINT, old_int_);
    std::signal(SIGTERM, old_term_);
  }

 private:
  void (*old_int_)(int);
  void (*old_term_)(int);
};

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

model::ModelConfig model_config_of(const io::ModelSection& m) {
  model::ModelConfig c;
  c.n_layer = m.n_layer;
  c.n_head = m.n_head;
  c.n_embd = m.n_embd;
  c.vocab_size = m.vocab_size;
  c.seq_len = m.seq_len;
  return c;
}

Trainer::Trainer(const io::RunConfig& config, TrainerOptions options)
    : config_(config), options_(options), model_config_(model_config_of(config.model)) {
  io::validate_config(config_);
  io::check_landed(config_);
  model_config_.validate();
  compute_ = parse_dtype(config_.precision.compute);
  if (compute_ == DType::F16) {
    const io::PrecisionSection& pr = config_.precision;
    LossScalerConfig sc;
    sc.dynamic = pr.dynamic_loss_scale();
    sc.scale = sc.dynamic ? pr.loss_scale_init : pr.loss_scale;
    sc.backoff = pr.loss_scale_backoff;
    sc.growth = pr.loss_scale_growth;
    sc.window = pr.loss_scale_window;
    sc.min_scale = std::min(pr.loss_scale_min, sc.scale);
    scaler_ = LossScaler(sc);
  }
  const auto& p = config_.parallel;
  // The mesh first: sizes whose product is not the number of ranks started
  // are refused on every rank with one message naming the keys. Then every
  // parallel dimension not implemented yet is refused, naming its key.
  const comm::MeshSizes sizes{p.pp, p.dp, p.cp, p.tp, p.ep};
  const int ranks = options_.ranks ? options_.ranks->size() : comm::world_size();
  comm::validate_mesh_sizes(ranks, sizes);
  comm::refuse_unimplemented(sizes, {"dp", "tp", "pp"});
  mesh_ = std::make_unique<comm::ProcessMesh>(options_.ranks ? comm::ProcessMesh::create(sizes, *options_.ranks)
                                                             : comm::ProcessMesh::create(sizes));
  is_root_ = mesh_->world_rank() == 0;
  micro_batches_ = io::micro_batches_per_step(config_);
  if (config_.zero.offload == "disk") parallel::check_offload_dir(config_.zero.offload_dir);

  // Threads: train.threads, or (0) this node's cores shared among its ranks.
  const int local_ranks = [&] {
    const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const int n = env ? std::atoi(env) : 0;
    return n > 0 ? n : ranks;
  }();
  // A rank that mpiexec bound to some cores (its affinity mask) uses those;
  // an unbound one shares the node's with the node's other ranks.
  const int cores = node_cores(), mine = omp_get_num_procs();
  bound_ = mine < cores;
  cpus_ = bound_ ? mine : std::max(1, cores / local_ranks);
  set_num_threads(config_.train.threads > 0 ? config_.train.threads : cpus_);
  oversubscribed_ = bound_ ? num_threads() > mine : num_threads() * local_ranks > cores;
  local_ranks_ = local_ranks;
  if (mesh_->world().size() > 1) {
    // One decision for the job: rank 0 times the bf16 GEMM paths.
    double choice[2] = {0, 0};
    if (is_root_) {
      const kernels::GemmPaths& g = kernels::gemm_paths();
      choice[0] = g.bf16_uses_primitive() ? 1 : 0;
      choice[1] = g.bf16_primitive_speedup;
    }
    mesh_->world().broadcast(choice, 2, DType::F64, 0);
    if (!is_root_) kernels::set_bf16_gemm_path(choice[0] != 0, choice[1]);
  }
  // MFU is relative to this CPU's measured fp32 peak (machine.h), at the
  // number of threads this node's ranks run at once (the all-core clock).
  peak_ = train::machine_peak(num_threads(), std::min(num_threads() * local_ranks, cores), ranks == 1);
  peak_flops_ = peak_.fp32_gflops_per_core * 1e9 * num_threads();

  const uint64_t seed = static_cast<uint64_t>(config_.train.seed);
  // The model declares its parameters; data parallelism and ZeRO (one rank:
  // stage 0 over a group of one, no communication) allocate what this rank
  // keeps, and own the optimizer and the gradient reduction.
  if (p.pp > 1) {
    build_pipeline(seed);
  } else {
    build_replicas(seed);
  }
  setup_data(seed);
}

void Trainer::build_replicas(uint64_t seed) {
  const auto& p = config_.parallel;
  if (p.tp > 1) tp_ = std::make_unique<tensor::TensorParallel>(mesh_->tp(), p.sequence_parallel);
  model_ = std::make_unique<model::GPT>(model_config_, model::GPT::Unallocated{}, tp_.get());
  model_->set_compute_dtype(compute_);
  parallel::DataParallelOptions dpo;
  dpo.zero_stage = p.zero_stage;
  dpo.bucket_bytes = p.bucket_mb * 1024.0 * 1024.0;
  dpo.progress = parallel::progress_from_env();
  dpo.offload_to_disk = config_.zero.offload == "disk";
  dpo.offload_dir = config_.zero.offload_dir;
  dpo.offload_window_bytes = config_.zero.offload_window_mb * 1024.0 * 1024.0;
  dpo.adam.beta1 = static_cast<float>(config_.optim.beta1);
  dpo.adam.beta2 = static_cast<float>(config_.optim.beta2);
  dpo.adam.eps = static_cast<float>(config_.optim.eps);
  dpo.adam.weight_decay = static_cast<float>(config_.optim.weight_decay);
  // The gradient norm over the TP group counts replicated parameters on TP rank 0 only.
  dpo.count_replicated = mesh_->coord().tp == 0;
  dpo.compression = compression_options();
  dp_ = std::make_unique<parallel::DataParallel>(*model_, mesh_->dp(), dpo);
  // Initial values: drawn, or from a model file (every rank reads it and
  // keeps its part); resuming overwrites them all, so nothing is drawn then.
  if (!config_.checkpoint.init_from.empty()) {
    io::SafeTensorsReader file(config_.checkpoint.init_from);
    const HfSource src = safetensors_source(file, config_.checkpoint.init_from);
    for (size_t g = 0; g < model_->groups().size(); g++) {
      std::vector<float> full(static_cast<size_t>(model_->groups()[g].capacity()), 0.0f);
      import_hf_group(model_->groups()[g], full.data(), src);
      dp_->load_full(g, parallel::DataParallel::State::Params, full.data());
    }
  } else if (config_.checkpoint.resume.empty()) {
    dp_->initialize(seed);
  }
}

void Trainer::setup_data(uint64_t seed) {
  const auto& p = config_.parallel;
  const int B = config_.train.micro_batch_size, T = config_.model.seq_len;

  // Each rank reads its part of every global batch (data/loader.h).
  BatchLayout layout;
  layout.B = B;
  layout.T = T;
  layout.dp_rank = mesh_->coord().dp;
  layout.dp_size = p.dp;
  layout.micro_batches = micro_batches_;
  const int V = config_.model.vocab_size;
  if (config_.data.train.empty()) {
    train_data_ = make_synthetic_source(layout, V, seed, 0);
    val_data_ = make_synthetic_source(layout, V, seed, 1);
  } else {
    train_data_ = make_shard_source(config_.data.train, layout, V, seed, true);
    if (!config_.data.val.empty()) val_data_ = make_shard_source(config_.data.val, layout, V, seed, false);
  }
  inputs_.resize(static_cast<size_t>(B) * T);
  targets_.resize(static_cast<size_t>(B) * T);

  if (!config_.checkpoint.resume.empty()) {
    LATTICE_CHECK(!config_.checkpoint.dir.empty() || config_.checkpoint.resume != "latest",
                  "checkpoint.resume=latest needs checkpoint.dir to say where to look");
    std::string spec = config_.checkpoint.resume == "latest" ? config_.checkpoint.dir : config_.checkpoint.resume;
    load_checkpoint(io::resolve_checkpoint(spec));
  }
  if (!config_.log.metrics_file.empty() && is_root_) {
    // A fresh run starts the file anew. A resumed one continues it, after
    // dropping the lines of steps past the checkpoint (logged by the run that
    // was interrupted, and about to be run again).
    const bool resumed = !config_.checkpoint.resume.empty();
    if (resumed) trim_metrics_after(config_.log.metrics_file, step_);
    metrics_ = std::make_unique<io::MetricsWriter>(config_.log.metrics_file, !resumed);
  }
}


void trim_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in.good()) return;
  std::string line, kept;
  bool dropped = false;
  for (int64_t n = 1; std::getline(in, line); n++) {
    if (line.empty()) continue;
    double line_step = 0;
    try {
      const io::JsonValue object = io::parse_json(line, path);
      const io::JsonValue* v = object.find("step");
      line_step = v && v->is_number() ? v->as_double() : 0;
    } catch (const Error&) {
      dropped = true;  // a torn last line of a run that died while writing it
      continue;
    }
    if (line_step > static_cast<double>(step)) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped) io::write_file_atomic(path, kept);
}


// An error in the middle of a step of a multi-rank job ends the job right
// here, naming the rank and the cause: unwinding further would free buffers
// the communication thread may still be reducing into.
template <typename Fn>
static auto ending_job_on_error(const comm::ProcessMesh& mesh, Fn fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    if (mesh.world().size() > 1) comm::abort_job(e.what());
    throw;
  }
}

void Trainer::check_finite(double loss, double norm) const {
  LATTICE_CHECK(std::isfinite(loss) && std::isfinite(norm),
                "step " << step_ + 1 << ": loss " << loss << ", grad norm " << norm
                        << " is not finite; lower optim.lr or check the data"
                        << (config_.compression.grad == "f16"
                                ? " (or compression.grad=f16 overflowed: its largest value is 65504; bf16 has f32's range)"
                                : ""));
}

float Trainer::loss_grad_factor() const {
  if (options_.poison_step == step_ && options_.poison_rank == mesh_->world_rank())
    return std::numeric_limits<float>::infinity();
  return static_cast<float>(scaler_.scale());
}

bool Trainer::apply_update(double loss, double norm) {
  if (compute_ != DType::F16) {
    check_finite(loss, norm);
    return true;
  }
  // One flag for the whole job: every rank skips, or none does.
  float bad = std::isfinite(norm) ? 0.0f : 1.0f;
  if (mesh_->world().size() > 1) mesh_->world().all_reduce(&bad, 1, DType::F32, comm::ReduceOp::Max);
  const double scale = scaler_.scale();
  const LossScalerConfig& sc = scaler_.config();
  LATTICE_CHECK(bad == 0.0f || (sc.dynamic ? scale > sc.min_scale : scaler_.skipped_in_a_row() + 1 < kStaticSkipLimit),
                "step " << step_ + 1 << ": the gradients overflow at "
                        << (sc.dynamic ? "the dynamic loss scale's floor precision.loss_scale_min="
                                       : "the static loss scale ")
                        << scale << (sc.dynamic ? "" : ", " + std::to_string(kStaticSkipLimit) + " steps in a row")
                        << ": f16 cannot hold this run's gradients; lower optim.lr, check the data, or use "
                           "precision.compute=\"bf16\"");
  const bool apply = scaler_.update(bad == 0.0f);
  // Compression's error feedback holds scaled gradients: it follows the scale,
  // and a skipped step's errors are dropped.
  if (config_.compression.grad != "none" && config_.compression.error_feedback && (!apply || scaler_.scale() != scale)) {
    parallel::GradientReducer& r = pipe_ ? pipe_->optimizer->reducer() : dp_->reducer();
    r.scale_errors(apply ? static_cast<float>(scaler_.scale() / scale) : 0.0f);
  }
  if (!apply && is_root_ && options_.print) {
    std::printf("lattice: step %lld: gradients overflowed at loss scale %g on some rank; the step is skipped "
                "everywhere (%lld skipped so far), loss scale now %g\n",
                static_cast<long long>(step_ + 1), scale, static_cast<long long>(scaler_.skipped()), scaler_.scale());
    std::fflush(stdout);
  }
  return apply;
}

void Trainer::params_changed() {
  if (model_) model_->params_changed();
  if (pipe_)
    for (auto& m : pipe_->models) m->params_changed();
}

parallel::CompressionOptions Trainer::compression_options() const {
  parallel::CompressionOptions c;
  c.spec.codec = parallel::grad_codec_from_name(config_.compression.grad);
  c.spec.topk_ratio = config_.compression.topk_ratio;
  c.spec.powersgd_rank = config_.compression.rank;
  c.error_feedback = config_.compression.error_feedback;
  c.warmup_steps = config_.compression.warmup_steps;
  return c;
}

StepStats Trainer::train_step() {
  return ending_job_on_error(*mesh_, [&] { return train_step_unguarded(); });
}

StepStats Trainer::train_step_unguarded() {
  Timer timer;
  const double step_scale = scaler_.scale();
  const int B = config_.train.micro_batch_size, T = config_.model.seq_len;
  double loss = 0, norm = 0;
  float lr = optim::lr_at(step_, config_.train.steps, config_.optim.warmup_steps,
                          static_cast<float>(config_.optim.lr), static_cast<float>(config_.optim.min_lr));
  uint64_t tp_bytes_before = 0;
  if (pipe_) {
    tp_bytes_before = tp_ ? tp_->group().stats().bytes_sent : 0;
    if (tp_) tp_->reset_comm_seconds();
    loss = pipeline_step(lr, &norm);  // the micro-batches through the stages, and the update
  } else {
    const int micro = micro_batches_, ranks = dp_->ranks();
    tp_bytes_before = tp_ ? tp_->group().stats().bytes_sent : 0;
    if (tp_) tp_->reset_comm_seconds();
    dp_->begin_step(step_);
    double loss_sum = 0;
    for (int m = 0; m < micro; m++) {
      dp_->begin_micro_batch(m == micro - 1);
      train_data_->next(inputs_.data(), targets_.data());
      loss_sum += model_->forward(0, inputs_.data(), targets_.data(), B, T, loss_grad_factor() / static_cast<float>(micro));
      if (options_.split_backward) {
        model_->backward_input(0);
        model_->backward_weight(0);
      } else {
        model_->backward(0);
      }
    }
    dp_->finish_gradients();
    if (tp_) parallel::average_replicated_grads(dp_->reducer(), dp_->optimizer(), mesh_->tp());
    // The gradients now hold the sum over ranks of each rank's mean over its
    // micro-batches: 1/ranks makes it the mean over the global batch. (Every
    // rank of a TP group has the whole loss: the vocabulary-parallel loss is
    // reduced over the group.)
    loss = dp_->sum_over_ranks(loss_sum) / (static_cast<double>(micro) * ranks);
    double sum_squares = dp_->grad_sum_squares();
    if (tp_) mesh_->tp().all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
    // The norm of the mean gradient, the loss scale taken out.
    const double scale = scaler_.scale();
    norm = std::sqrt(sum_squares) / ranks / scale;
    if (apply_update(loss, norm)) {
      dp_->optimizer_step(lr, static_cast<float>(optim::clip_scale(norm, static_cast<float>(config_.optim.grad_clip)) /
                                                 (static_cast<double>(ranks) * scale)));
      params_changed();
    }
  }
  step_++;
  const double tokens = static_cast<double>(io::global_batch_size(config_)) * T;
  tokens_seen_ += static_cast<uint64_t>(tokens);

  StepStats s;
  s.step = step_;
  s.loss = loss;
  s.lr = lr;
  s.grad_norm = norm;
  s.skipped = scaler_.last_skipped();
  s.loss_scale = step_scale;
  s.step_ms = timer.millis();
  s.tokens_per_sec = tokens / (s.step_ms / 1e3);
  // Model FLOPs of the whole job over the peak of every rank's threads.
  const int world = mesh_->world().size();
  s.mfu = s.tokens_per_sec * model_config_.flops_per_token(T) / (peak_flops_ * world);
  if (tp_) {
    s.tp_comm_ms = tp_->comm_seconds() * 1e3;
    s.tp_comm_bytes = tp_->group().stats().bytes_sent - tp_bytes_before;
  }
  s.peak_mem_bytes = MemoryTracker::instance().peak_total();
  if (dp_) {
    const parallel::DataParallel::StepComm c = dp_->last_step_comm();
    s.comm_ms = c.ran_s * 1e3;
    s.comm_exposed_ms = c.exposed_s * 1e3;
    s.comm_hidden = c.hidden();
    s.comm_bytes = c.bytes;
    const parallel::GradientReducer::Bytes g = dp_->reducer().bytes();
    s.grad_bytes = g.sent;
    s.grad_bytes_uncompressed = g.uncompressed;
  }
  if (pipe_) {
    pipeline_bubbles(&s.pp_bubble, &s.pp_bubble_simulated);
    pipeline_grad_bytes(&s.grad_bytes, &s.grad_bytes_uncompressed);
  }
  if (mesh_->world().size() > 1) {
    // The job's step took as long as its slowest rank; memory is the largest rank's.
    double worst[2] = {s.step_ms, static_cast<double>(s.peak_mem_bytes)};
    mesh_->world().all_reduce(worst, 2, DType::F64, comm::ReduceOp::Max);
    s.step_ms = worst[0];
    s.peak_mem_bytes = static_cast<size_t>(worst[1]);
    s.tokens_per_sec = tokens / (s.step_ms / 1e3);
    s.mfu = s.tokens_per_sec * model_config_.flops_per_token(T) / (peak_flops_ * world);
  }
  return s;
}

double Trainer::evaluate() {
  if (!val_data_) return -1;
  if (pipe_) return pipeline_evaluate();
  const int B = config_.train.micro_batch_size, T = config_.model.seq_len;
  val_data_->reset();
  double sum = 0;
  for (int i = 0; i < config_.train.eval_steps; i++)
    for (int m = 0; m < micro_batches_; m++) {
      val_data_->next(inputs_.data(), targets_.data());
      sum += model_->evaluate(inputs_.data(), targets_.data(), B, T);
    }
  return dp_->sum_over_ranks(sum) / (static_cast<double>(config_.train.eval_steps) * micro_batches_ * dp_->ranks());
}

int Trainer::stop_requested() {
  int local = g_stop_signal.load();
  if (mesh_->world().size() == 1) return local;
  float flag = static_cast<float>(local);
  mesh_->world().all_reduce(&flag, 1, DType::F32, comm::ReduceOp::Max);
  return static_cast<int>(flag);
}

void Trainer::print_header() const {
  if (!options_.print || !is_root_) return;
  const auto& m = config_.model;
  std::printf("lattice: GPT %s parameters (n_layer=%d n_head=%d n_embd=%d vocab=%d seq_len=%d)\n",
              human_count(static_cast<double>(model_config_.num_params())).c_str(), m.n_layer, m.n_head, m.n_embd,
              m.vocab_size, m.seq_len);
  std::printf("lattice: batch %d x %d tokens x %d micro-batches x %d data-parallel ranks = %lld tokens/step, %lld steps, "
              "%d threads per rank\n",
              config_.train.micro_batch_size, m.seq_len, micro_batches_, config_.parallel.dp,
              static_cast<long long>(io::global_batch_size(config_) * m.seq_len),
              static_cast<long long>(config_.train.steps), num_threads());
  if (oversubscribed_) {
    const int cores = node_cores();
    if (bound_)
      std::printf("lattice: warning: %d threads per rank on the %d core(s) mpiexec bound each rank to: threads wait "
                  "for each other's cores and a step can take many times longer; set train.threads=%d (or 0), or "
                  "start with mpiexec --bind-to none\n",
                  num_threads(), cpus_, cpus_);
    else if (local_ranks_ > cores)
      std::printf("lattice: warning: %d ranks on this node's %d cores: they take turns, so steps are slow and time "
                  "figures mean nothing (fine for checking correctness)\n",
                  local_ranks_, cores);
    else
      std::printf("lattice: warning: %d ranks x %d threads on this node's %d cores: threads wait for each other's "
                  "cores and a step can take many times longer; set train.threads=%d (or 0 to share the cores)\n",
                  local_ranks_, num_threads(), cores, cpus_);
  } else if (bound_ && local_ranks_ * cpus_ < node_cores()) {
    std::printf("lattice: note: mpiexec bound each rank to %d of this node's %d cores, leaving %d idle; "
                "mpiexec --bind-to none lets the ranks share them all\n",
                cpus_, node_cores(), node_cores() - local_ranks_ * cpus_);
  }
  if (dp_) std::printf("lattice: %s\n", dp_->describe().c_str());
  if (compute_ == DType::BF16)
    std::printf("lattice: precision: bf16 compute (weights and stored activations rounded to bf16, f32 master "
                "weights, Adam moments, gradients and accumulation); no loss scale: bf16 has f32's exponent range\n");
  else if (compute_ == DType::F16)
    std::printf("lattice: precision: f16 compute (weights and stored activations rounded to f16, f32 master "
                "weights, Adam moments, gradients and accumulation); %s\n",
                scaler_.describe().c_str());
  if (pipe_) std::printf("lattice: %s\n", describe_pipeline().c_str());
  if (tp_) {
    const model::GPT& any = pipe_ ? const_cast<Trainer*>(this)->model() : *model_;
    const model::GPT::Dims& d = any.dims();
    std::printf("lattice: tensor parallel over %d ranks%s: each holds %d of %d heads, %d of %d MLP columns and %d of "
                "%d vocabulary rows (padded from %d)\n",
                tp_->size(), tp_->sequence_parallel() ? ", sequence parallel" : "", d.NH, m.n_head, d.F,
                4 * m.n_embd, d.V, any.wte_rows(), m.vocab_size);
  }
  if (config_.parallel.zero_stage > 0 && config_.parallel.dp == 1)
    std::printf("lattice: note: parallel.zero_stage=%d with parallel.dp=1 shards over one rank: it runs the "
                "stage's machinery and trains the same model as stage 0%s\n",
                config_.parallel.zero_stage, config_.zero.offload == "disk" ? " (the offload still applies)" : "");
  if (config_.compression.grad != "none" && config_.parallel.dp == 1)
    std::printf("lattice: note: compression.grad=%s with parallel.dp=1: one rank sends no gradients, so nothing "
                "is compressed\n",
                config_.compression.grad.c_str());
  std::printf("lattice: data %s\n", train_data_->describe().c_str());
  if (val_data_ && config_.train.eval_every > 0)
    std::printf("lattice: eval every %lld steps on %s\n", static_cast<long long>(config_.train.eval_every),
                val_data_->describe().c_str());
  std::printf("lattice: machine %s\n", describe_machine().c_str());
  std::printf("lattice: MFU relative to %.0f GFLOP/s fp32 (%d threads x %.1f, %s; LATTICE_PEAK_GFLOPS_PER_CORE overrides)\n",
              peak_flops_ / 1e9, num_threads(), peak_.fp32_gflops_per_core, peak_.source.c_str());
  std::fflush(stdout);
}

void Trainer::print_step(const StepStats& s) const {
  if (!options_.print || !is_root_) return;
  char val[48] = "";
  if (s.val_loss >= 0) std::snprintf(val, sizeof val, " | val %.4f", s.val_loss);
  char comm[96] = "";
  if (dp_ && dp_->ranks() > 1)
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
  std::printf("step %*lld/%lld | loss %.4f%s | lr %.2e | norm %.3f%s | %.1f ms | %s tok/s | MFU %.1f%% | mem %s%s%s%s\n",
              static_cast<int>(std::to_string(config_.train.steps).size()), static_cast<long long>(s.step),
              static_cast<long long>(config_.train.steps), s.loss, val, s.lr, s.grad_norm, scale, s.step_ms,
              human_count(s.tokens_per_sec).c_str(), 100.0 * s.mfu,
              format_bytes(static_cast<double>(s.peak_mem_bytes)).c_str(), comm, bubble, tp);
  std::fflush(stdout);
}

int Trainer::run() {
  return ending_job_on_error(*mesh_, [&] { return run_unguarded(); });
}

int Trainer::run_unguarded() {
  StopSignalScope signals;
  print_header();
  Timer total;
  const int64_t first_step = step_;
  while (step_ < config_.train.steps) {
    StepStats s = train_step();
    const bool last = step_ == config_.train.steps;
    if (val_data_ && config_.train.eval_every > 0 && (step_ % config_.train.eval_every == 0 || last)) {
      s.val_loss = evaluate();
    }
    history_.push_back(s);
    if (config_.log.every > 0 && (step_ % config_.log.every == 0 || last || s.val_loss >= 0)) print_step(s);
    if (metrics_) {
      std::vector<std::pair<std::string, double>> fields = {
          {"step", static_cast<double>(s.step)}, {"loss", s.loss},
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
      }
      if (tp_) {
        fields.push_back({"tp_comm_ms", s.tp_comm_ms});
        fields.push_back({"tp_comm_bytes", static_cast<double>(s.tp_comm_bytes)});
      }
      if (s.val_loss >= 0) fields.push_back({"val_loss", s.val_loss});
      metrics_->write(fields);
    }
    const bool want_ckpt = !config_.checkpoint.dir.empty() &&
                           ((config_.checkpoint.every > 0 && step_ % config_.checkpoint.every == 0) || last);
    // One decision for the job: a signal on any rank stops every rank after
    // this same step.
    if (const int signal = stop_requested(); signal != 0) {
      if (is_root_ && options_.print)
        std::printf("lattice: interrupted (signal %d) after step %lld\n", signal, static_cast<long long>(step_));
      if (!config_.checkpoint.dir.empty()) {
        std::string dir = save_checkpoint();
        if (is_root_ && options_.print) std::printf("lattice: saved %s; resume with --set checkpoint.resume=latest\n", dir.c_str());
      } else if (is_root_ && options_.print) {
        std::printf("lattice: no checkpoint.dir set, nothing saved\n");
      }
      std::fflush(stdout);
      return 130;
    }
    if (want_ckpt) {
      std::string dir = save_checkpoint();
      if (is_root_ && options_.print) std::printf("lattice: saved checkpoint %s\n", dir.c_str());
    }
  }
  if (options_.print && is_root_) {
    const int64_t ran = step_ - first_step;
    double tok_s = 0;
    // Steady-state throughput: skip the first step (allocation, warm-up) when there are others.
    double ms = 0;
    int counted = 0;
    for (size_t i = history_.size() > 1 ? 1 : 0; i < history_.size(); i++, counted++) ms += history_[i].step_ms;
    if (counted > 0 && ms > 0)
      tok_s = counted * static_cast<double>(io::global_batch_size(config_)) * config_.model.seq_len / (ms / 1e3);
    std::printf("lattice: done, %lld steps in %.1f s, final loss %.4f", static_cast<long long>(ran),
                total.seconds(), history_.empty() ? 0.0 : history_.back().loss);
    for (auto it = history_.rbegin(); it != history_.rend(); ++it)
      if (it->val_loss >= 0) {
        std::printf(", val loss %.4f", it->val_loss);
        break;
      }
    std::printf(", %s tok/s, MFU %.1f%%\n", human_count(tok_s).c_str(),
                100.0 * tok_s * model_config_.flops_per_token(config_.model.seq_len) /
                    (peak_flops_ * mesh_->world().size()));
    std::printf("lattice: peak memory %s\n", MemoryTracker::instance().summary().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace lattice::train
