#include "lattice/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "lattice/comm/placement.h"
#include "lattice/comm/process_mesh.h"
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
#include "lattice/layers/context/context_parallel.h"
#include "lattice/layers/expert/expert_parallel.h"
#include "lattice/layers/expert/routing.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/data/group_hooks_router.h"
#include "lattice/parallel/pipeline/executor.h"
#include "lattice/parallel/pipeline/timeline.h"
#include "lattice/parallel/zero/disk_store.h"
#include "lattice/train/checkpointing.h"
#include "lattice/train/model_io.h"

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

}  // namespace

model::ModelConfig model_config_of(const io::ModelSection& m) {
  model::ModelConfig c = model::ModelConfig::defaults(model::parse_family(m.family));
  c.n_layer = m.n_layer;
  c.n_head = m.n_head;
  c.n_embd = m.n_embd;
  c.vocab_size = m.vocab_size;
  c.seq_len = m.seq_len;
  if (!m.norm.empty()) c.norm = model::parse_norm(m.norm);
  if (!m.mlp.empty()) c.mlp = model::parse_mlp(m.mlp);
  if (!m.position.empty()) c.position = model::parse_position(m.position);
  c.n_kv_head = m.n_kv_head;
  c.ffn_hidden = m.ffn_hidden;
  if (m.rope_theta) c.rope_theta = static_cast<float>(*m.rope_theta);
  if (m.norm_eps) c.norm_eps = static_cast<float>(*m.norm_eps);
  if (m.bias) c.bias = *m.bias;
  if (m.tie_embeddings) c.tie_embeddings = *m.tie_embeddings;
  c.n_experts = m.n_experts;
  c.top_k = m.top_k;
  c.moe_every = m.moe_every;
  c.n_shared_experts = m.n_shared_experts;
  c.moe_ffn_hidden = m.moe_ffn_hidden;
  return c;
}

namespace {

// The shortest decimal that reads back as x, as a double: 1e-5f is written
// "0.00001", not 9.99999974737875e-06.
double widened(float x) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  double out = x;
  if (ec == std::errc()) std::from_chars(buf, end, out);
  return out;
}

}  // namespace

io::ModelSection model_section_of(const model::ModelConfig& c) {
  io::ModelSection m;
  m.family = model::name_of(c.family);
  m.n_layer = c.n_layer;
  m.n_head = c.n_head;
  m.n_embd = c.n_embd;
  m.vocab_size = c.vocab_size;
  m.seq_len = c.seq_len;
  m.norm = model::name_of(c.norm);
  m.mlp = model::name_of(c.mlp);
  m.position = model::name_of(c.position);
  m.n_kv_head = c.kv_heads();
  m.ffn_hidden = c.ffn();
  // rope_theta applies to rotary positions only (io's conditional keys).
  if (c.position == model::PositionKind::Rope) m.rope_theta = widened(c.rope_theta);
  m.norm_eps = widened(c.norm_eps);
  m.bias = c.bias;
  m.tie_embeddings = c.tie_embeddings;
  if (c.n_experts > 0) {  // (the other expert keys apply only with experts: io's conditional keys)
    m.n_experts = c.n_experts;
    m.top_k = c.top_k;
    m.moe_every = c.moe_every;
    m.n_shared_experts = c.n_shared_experts;
    m.moe_ffn_hidden = c.moe_ffn();
  }
  return m;
}

model::ModelConfig checked_model_config(const io::RunConfig& config) {
  model::ModelConfig c = model_config_of(config.model);
  c.validate();
  c.check_tensor_parallel(config.parallel.tp);
  return c;
}

std::vector<ModelDifference> model_differences(const model::ModelConfig& have, const model::ModelConfig& want) {
  io::RunConfig a, b;
  a.model = model_section_of(have);
  b.model = model_section_of(want);
  const auto items_a = io::config_items(a), items_b = io::config_items(b);
  std::vector<ModelDifference> out;
  for (size_t i = 0; i < items_a.size(); i++) {
    const auto& [key, value_a] = items_a[i];
    const std::string& value_b = items_b[i].second;
    // A key one side leaves unset (rope_theta of learned positions) goes
    // with a difference of another (model.position), named already.
    if (key.rfind("model.", 0) != 0 || value_a == value_b || value_a == "\"\"" || value_b == "\"\"") continue;
    out.push_back({key, value_a, value_b});
  }
  return out;
}

Trainer::Trainer(const io::RunConfig& config, TrainerOptions options) : config_(config), options_(options) {
  io::validate_config(config_);
  io::check_landed(config_);
  model_config_ = checked_model_config(config_);
  compute_ = parse_dtype(config_.precision.compute);
  if (compute_ == DType::F16) {
    const io::PrecisionSection& pr = config_.precision;
    optim::LossScalerConfig sc;
    sc.dynamic = pr.dynamic_loss_scale();
    sc.scale = sc.dynamic ? pr.loss_scale_init : pr.loss_scale;
    sc.backoff = pr.loss_scale_backoff;
    sc.growth = pr.loss_scale_growth;
    sc.window = pr.loss_scale_window;
    sc.min_scale = std::min(pr.loss_scale_min, sc.scale);
    scaler_ = optim::LossScaler(sc);
  }
  const auto& p = config_.parallel;
  // The mesh first: sizes whose product is not the number of ranks started
  // are refused on every rank with one message naming the keys. Then every
  // parallel dimension not implemented yet is refused, naming its key.
  const comm::MeshSizes sizes{p.pp, p.dp, p.cp, p.tp, p.ep};
  const int ranks = options_.ranks ? options_.ranks->size() : comm::world_size();
  comm::validate_mesh_sizes(ranks, sizes);
  comm::refuse_unimplemented(sizes, {"dp", "tp", "pp", "cp", "ep"});
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
  // Which node each rank runs on, for the header (collective over the job).
  if (mesh_->world().size() > 1) placement_ = comm::describe_placement(sizes, comm::node_names(mesh_->world()));
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
  // The peak of the arithmetic the GEMMs run in (bf16 on oneDNN's bf16 matmul, else fp32).
  peak_flops_ = peak_.gflops_per_core(compute_) * 1e9 * num_threads();

  const uint64_t seed = static_cast<uint64_t>(config_.train.seed);
  build(seed);
  setup_data(seed);
}

Trainer::~Trainer() = default;

model::GPT& Trainer::model() { return *parts_.front(); }

optim::AdamW& Trainer::optimizer() { return dp_->optimizer(); }

void Trainer::build(uint64_t seed) {
  const auto& p = config_.parallel;
  // The schedule: pp = 1 is a one-stage schedule (1F1B: F and B per
  // micro-batch; ZB-H1: the split I and W backward), run like any other.
  const std::string& name = p.schedule;
  if (name.rfind("csv:", 0) == 0) {
    const std::string path = name.substr(4);
    schedule_ = pipeline::from_csv(io::read_whole_file(path, "parallel.schedule"), path);
    LATTICE_CHECK(schedule_.ranks == p.pp, "parallel.schedule=" << name << " has " << schedule_.ranks
                                                                << " rows (ranks) but parallel.pp=" << p.pp);
    LATTICE_CHECK(schedule_.micro_batches == micro_batches_,
                  "parallel.schedule=" << name << " runs " << schedule_.micro_batches
                                       << " micro-batches but a step has " << micro_batches_
                                       << " (train.grad_accum_steps, or global_batch_size / micro_batch_size)");
  } else {
    schedule_ = pipeline::make_schedule(name, p.pp, p.virtual_stages, micro_batches_);
  }
  pipeline::validate(schedule_);
  // The cut of the layers into the schedule's stages.
  const int S = schedule_.stages, T = config_.model.seq_len;
  if (p.partition.empty()) {
    const std::vector<double> costs = pipeline::layer_costs(model_config_, T);
    cut_ = pipeline::refine_partition(costs, pipeline::balanced_partition(costs, S, schedule_.rank_of_stage),
                                      schedule_);
  } else {
    std::vector<int> layers;
    size_t begin = 0;
    while (begin <= p.partition.size()) {
      size_t end = p.partition.find(',', begin);
      if (end == std::string::npos) end = p.partition.size();
      const std::string item = p.partition.substr(begin, end - begin);
      char* stop = nullptr;
      const long n = std::strtol(item.c_str(), &stop, 10);
      LATTICE_CHECK(!item.empty() && *stop == '\0',
                    "parallel.partition=\"" << p.partition << "\": '" << item << "' is not a number of layers");
      layers.push_back(static_cast<int>(n));
      begin = end + 1;
    }
    cut_ = pipeline::explicit_partition(layers, model_config_.n_layer, S, "parallel.partition=\"" + p.partition + "\"");
  }
  // Activation recomputation: recompute.first counts each stage's layers, so
  // it is checked against every stage of the partition (on every rank alike).
  model::RecomputeSpec recompute;
  recompute.mode = model::recompute_from_name(config_.recompute.mode);
  recompute.every = config_.recompute.every;
  recompute.first = config_.recompute.first;
  for (int s = 0; s < S && recompute.first > 0; s++) {
    const int layers = cut_[s].last - cut_[s].first;
    LATTICE_CHECK(recompute.first <= layers,
                  "recompute.first=" << recompute.first << " names layers that do not exist: pipeline stage " << s
                                     << " has " << layers << " layer" << (layers == 1 ? "" : "s") << " ("
                                     << cut_[s].first << ".." << cut_[s].last - 1 << "); set recompute.first <= "
                                     << layers << ", or 0 for every layer of each stage");
  }
  // This rank's parts: the stages its pipeline rank runs, each in this TP
  // rank's slices, declared only: the data-parallel engine allocates what
  // the ZeRO stage keeps.
  if (p.tp > 1) tp_ = std::make_unique<tensor::TensorParallel>(mesh_->tp(), p.sequence_parallel);
  if (p.cp > 1) cp_ = std::make_unique<context::ContextParallel>(mesh_->cp(), context::parse_mode(p.cp_mode));
  const bool experts = model_config_.n_experts > 0;
  if (experts) {
    ep_ = std::make_unique<expert::ExpertParallel>(p.ep > 1 ? &mesh_->ep() : nullptr, model_config_.n_experts);
    expert_bias_.assign(static_cast<size_t>(model_config_.n_layer) * model_config_.n_experts, 0.0f);
  }
  model::parts::MoeOptions moe;
  moe.aux_loss_coef = config_.moe.aux_loss_coef;
  moe.z_loss_coef = config_.moe.z_loss_coef;
  moe.capacity_factor = config_.moe.capacity_factor;
  moe.token_bound = config_.moe.token_bound;
  std::vector<model::GPT*> parts;
  part_of_stage_.assign(static_cast<size_t>(S), -1);
  for (int s = 0; s < S; s++) {
    if (schedule_.rank_of_stage[s] != mesh_->coord().pp) continue;
    const model::StageLayers layers{cut_[s].first, cut_[s].last, p.ep, mesh_->coord().ep};
    parts_.push_back(std::make_unique<model::GPT>(model_config_, model::GPT::Unallocated{}, tp_.get(), layers));
    parts_.back()->set_compute_dtype(compute_);
    parts_.back()->set_context_parallel(cp_.get());
    if (experts) {
      parts_.back()->set_expert_parallel(p.ep > 1 ? ep_.get() : nullptr);
      parts_.back()->set_moe_options(moe);
    }
    parts_.back()->set_recompute(model::recompute_policy(recompute, layers.first_layer, layers.last_layer));
    part_of_stage_[s] = static_cast<int>(parts.size());
    parts.push_back(parts_.back().get());
  }
  layout_model_ = std::make_unique<model::GPT>(model_config_, model::GPT::Unallocated{});

  parallel::DataParallelOptions dpo;
  dpo.zero_stage = p.zero_stage;
  dpo.bucket_bytes = p.bucket_mb * 1024.0 * 1024.0;
  dpo.progress = comm::progress_from_env();
  dpo.offload_to_disk = config_.zero.offload == "disk";
  dpo.offload_dir = config_.zero.offload_dir;
  dpo.offload_window_bytes = config_.zero.offload_window_mb * 1024.0 * 1024.0;
  dpo.adam.beta1 = static_cast<float>(config_.optim.beta1);
  dpo.adam.beta2 = static_cast<float>(config_.optim.beta2);
  dpo.adam.eps = static_cast<float>(config_.optim.eps);
  dpo.adam.weight_decay = static_cast<float>(config_.optim.weight_decay);
  dpo.compression = compression_options();
  // Context-parallel ranks hold the same parameters and different tokens,
  // like data-parallel ones: the engine averages (and ZeRO shards) over dp×cp.
  dpo.context_parallel = p.cp;
  if (experts) {
    // Two engines over one model: the dense groups averaged over dp×cp, the
    // experts over the ranks that hold the same experts (the dp·cp/ep
    // replicas of this ep position, and the TP ranks, each of which routed
    // its share of the rows) — and scaled by the same 1/(dp·cp) (the expert
    // ranks' sums hold every dp×cp rank's tokens; dividing by the expert
    // group's size instead is the bug that trains experts ep times too fast).
    auto order = [](const model::GPT& m, model::GroupHooks::Pass pass) { return m.group_order(pass); };
    dpo.order = order;
    dpo.install_hooks = false;
    parallel::DataParallelOptions edo = dpo;
    dpo.owns = [](const model::GPT& m, size_t g) { return !m.is_expert_group(g); };
    edo.owns = [](const model::GPT& m, size_t g) { return m.is_expert_group(g); };
    edo.whole_group_norm = true;
    dpo.name = "dense", edo.name = "experts";
    dp_ = std::make_unique<parallel::DataParallel>(parts, mesh_->dp_cp(), dpo);
    expert_dp_ = std::make_unique<parallel::DataParallel>(parts, mesh_->expert_replicas(), edo);
    for (size_t j = 0; j < parts.size(); j++) {
      hooks_routers_.push_back(std::make_unique<parallel::GroupHooksRouter>(
          std::vector<parallel::DataParallel*>{dp_.get(), expert_dp_.get()}, j));
      parts[j]->set_hooks(hooks_routers_.back().get());
    }
  } else {
    dp_ = std::make_unique<parallel::DataParallel>(parts, mesh_->dp_cp(), dpo);
  }
  executor_ = std::make_unique<pipeline::Executor>(schedule_, parts, mesh_->pp());
  // The wiring: the engine reduces a part's gradients in its last backward
  // of the step, told by the executor; the tied embedding's two copies (first
  // and last stage) are summed by the engine, over the executor's link
  // between those stages.
  executor_->on_backward([this](int stage, bool last) {
    dp_->before_backward(part_of_stage_[stage], last);
    if (expert_dp_) expert_dp_->before_backward(part_of_stage_[stage], last);
  });
  executor_->on_stage_done([this](int stage) {
    dp_->part_done(part_of_stage_[stage]);
    if (expert_dp_) expert_dp_->part_done(part_of_stage_[stage]);
  });
  pipeline::Executor* ex = executor_.get();
  dp_->set_tied_sum([ex](float* first, float* last, size_t n) { ex->sum_tied(first, last, n); });

  // Initial values: drawn (each rank only what it keeps), or from a model
  // file (every rank reads it and keeps its part); resuming overwrites them
  // all, so nothing is drawn then.
  if (!config_.checkpoint.init_from.empty()) {
    const std::string what = "checkpoint.init_from='" + config_.checkpoint.init_from + "'";
    const HfModelFiles files = find_hf_model(config_.checkpoint.init_from, what);
    io::SafeTensorsReader file(files.safetensors);
    check_init_from(what, files, file, model_config_);
    const HfSource src = safetensors_source(file, files.safetensors);
    load_state(&src, 1);
    if (expert_dp_) load_expert_bias(file);
  } else if (config_.checkpoint.resume.empty()) {
    dp_->initialize(seed);
    if (expert_dp_) expert_dp_->initialize(seed);
  }
  const size_t n = static_cast<size_t>(config_.train.micro_batch_size) * T;
  inputs_.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(n));
  targets_.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(n));
  if (cp_) {
    const size_t local = n / static_cast<size_t>(p.cp);
    local_inputs_.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(local));
    local_targets_.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(local));
  }
}

void Trainer::setup_data(uint64_t seed) {
  const auto& p = config_.parallel;
  // Each rank reads its part of every global batch (data/loader.h).
  BatchLayout layout;
  layout.B = config_.train.micro_batch_size;
  layout.T = config_.model.seq_len;
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
  const optim::LossScalerConfig& sc = scaler_.config();
  LATTICE_CHECK(bad == 0.0f || (sc.dynamic ? scale > sc.min_scale : scaler_.skipped_in_a_row() + 1 < optim::kStaticSkipLimit),
                "step " << step_ + 1 << ": the gradients overflow at "
                        << (sc.dynamic ? "the dynamic loss scale's floor precision.loss_scale_min="
                                       : "the static loss scale ")
                        << scale << (sc.dynamic ? "" : ", " + std::to_string(optim::kStaticSkipLimit) + " steps in a row")
                        << ": f16 cannot hold this run's gradients; lower optim.lr, check the data, or use "
                           "precision.compute=\"bf16\"");
  const bool apply = scaler_.update(bad == 0.0f);
  // Compression's error feedback holds scaled gradients: it follows the scale,
  // and a skipped step's errors are dropped. (1-bit Adam's holds momenta,
  // the scale already out, and a skipped step sends nothing.)
  if (config_.compression.grad != "none" && config_.compression.error_feedback && !config_.compression.momentum &&
      (!apply || scaler_.scale() != scale)) {
    const float factor = apply ? static_cast<float>(scaler_.scale() / scale) : 0.0f;
    dp_->reducer().scale_errors(factor);
    if (expert_dp_) expert_dp_->reducer().scale_errors(factor);
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
  for (auto& part : parts_) part->params_changed();
}

parallel::CompressionOptions Trainer::compression_options() const {
  parallel::CompressionOptions c;
  c.spec.codec = parallel::grad_codec_from_name(config_.compression.grad);
  c.spec.topk_ratio = config_.compression.topk_ratio;
  c.spec.powersgd_rank = config_.compression.rank;
  c.error_feedback = config_.compression.error_feedback;
  c.warmup_steps = config_.compression.warmup_steps;
  c.momentum = config_.compression.momentum;
  return c;
}

StepStats Trainer::train_step() {
  return ending_job_on_error(*mesh_, [&] { return train_step_unguarded(); });
}

std::vector<pipeline::MicroBatch> Trainer::next_batches(BatchSource& source) {
  std::vector<pipeline::MicroBatch> batches;
  for (int k = 0; k < micro_batches_; k++) {
    source.next(inputs_[k].data(), targets_[k].data());
    if (!cp_) {
      batches.push_back({inputs_[k].data(), targets_[k].data()});
      continue;
    }
    // Every rank of a cp group read the same sequences; each keeps its chunks.
    const int B = config_.train.micro_batch_size, T = config_.model.seq_len;
    cp_->local_tokens(local_inputs_[k].data(), inputs_[k].data(), B, T);
    cp_->local_tokens(local_targets_[k].data(), targets_[k].data(), B, T);
    batches.push_back({local_inputs_[k].data(), local_targets_[k].data()});
  }
  return batches;
}

StepStats Trainer::train_step_unguarded() {
  Timer timer;
  const double step_scale = scaler_.scale();
  const int B = config_.train.micro_batch_size, T = config_.model.seq_len;
  const float lr = optim::lr_at(step_, config_.train.steps, config_.optim.warmup_steps,
                                static_cast<float>(config_.optim.lr), static_cast<float>(config_.optim.min_lr));
  const uint64_t tp_bytes_before = tp_ ? tp_->group().stats().bytes_sent : 0;
  const uint64_t pp_bytes_before = executor_->bytes_sent();
  if (tp_) tp_->reset_comm_seconds();
  // The micro-batches through the schedule; each part's gradients go to the
  // other replicas as its last backward of the step writes them.
  dp_->begin_step(step_);
  if (expert_dp_) {
    expert_dp_->begin_step(step_);
    for (auto& part : parts_) part->reset_moe_stats();
  }
  executor_->set_loss_scale(loss_grad_factor());
  double loss = executor_->run_step(next_batches(*train_data_), B, local_seq_len());
  dp_->finish_gradients();
  if (expert_dp_) expert_dp_->finish_gradients();
  const uint64_t pp_bytes = executor_->bytes_sent() - pp_bytes_before;
  // (1-bit Adam past its warm-up: nothing was reduced, each rank's own
  // gradient is here; its averaged momentum is made alike below instead.)
  if (tp_ && !dp_->momentum_phase()) parallel::average_replicated_grads(dp_->reducer(), dp_->optimizer(), mesh_->tp());
  // The gradients now hold the sum over the replicas of each one's mean over
  // its micro-batches: 1/replicas makes it the mean over the global batch.
  // (Every rank of a pipeline and of a TP group has the whole loss; the
  // replicas are the dp×cp ranks, each cp rank's loss the mean over its
  // share of the tokens, all shares equal.)
  const int replicas = dp_->ranks();
  loss = dp_->sum_over_ranks(loss) / replicas;
  // Σ g² over the pipeline's stages and the TP slices, each element once.
  double sum_squares = dp_->grad_sum_squares();
  if (mesh_->pp().size() > 1) mesh_->pp().all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
  if (tp_) mesh_->tp().all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
  if (expert_dp_) {
    // The experts: each element once over the ranks holding the same experts
    // (the engine's sum), then over the other experts (ep) and layers (pp).
    double experts = expert_dp_->grad_sum_squares();
    if (mesh_->ep().size() > 1) mesh_->ep().all_reduce(&experts, 1, DType::F64, comm::ReduceOp::Sum);
    if (mesh_->pp().size() > 1) mesh_->pp().all_reduce(&experts, 1, DType::F64, comm::ReduceOp::Sum);
    sum_squares += experts;
  }
  // The norm of the mean gradient, the loss scale taken out (1-bit Adam past
  // its warm-up: the root mean square of the ranks' own, data_parallel.h).
  const double norm = std::sqrt(sum_squares) / replicas / step_scale;
  if (apply_update(loss, norm)) {
    const float grad_scale = static_cast<float>(optim::clip_scale(norm, static_cast<float>(config_.optim.grad_clip)) /
                                                (static_cast<double>(replicas) * step_scale));
    if (dp_->momentum_phase() && tp_) {
      dp_->reduce_momentum(grad_scale);
      parallel::average_replicated_grads(dp_->reducer(), dp_->optimizer(), mesh_->tp());
    }
    dp_->optimizer_step(lr, grad_scale);
    if (expert_dp_) expert_dp_->optimizer_step(lr, grad_scale);
    params_changed();
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
  if (tp_) {
    s.tp_comm_ms = tp_->comm_seconds() * 1e3;
    s.tp_comm_bytes = tp_->group().stats().bytes_sent - tp_bytes_before;
  }
  s.pp_comm_bytes = pp_bytes;
  s.peak_mem_bytes = MemoryTracker::instance().peak_total();
  const parallel::DataParallel::StepComm c = dp_->step_comm();
  s.comm_ms = c.ran_s * 1e3;
  s.comm_exposed_ms = c.exposed_s * 1e3;
  s.comm_hidden = c.hidden();
  s.comm_bytes = c.bytes;
  const parallel::GradientReducer::Bytes g = dp_->reducer().bytes();
  s.grad_bytes = g.sent;
  s.grad_bytes_uncompressed = g.uncompressed;
  if (expert_dp_) {
    const parallel::DataParallel::StepComm e = expert_dp_->step_comm();
    s.comm_ms += e.ran_s * 1e3;
    s.comm_exposed_ms += e.exposed_s * 1e3;
    s.comm_bytes += e.bytes;
    s.comm_hidden = s.comm_ms > 0 ? std::max(0.0, 1.0 - s.comm_exposed_ms / s.comm_ms) : 1.0;
    finish_moe_step(s);
  }
  if (schedule_.ranks > 1) {
    // The measured bubble beside the simulator's, fed this step's mean cost
    // of each kind of action on each stage.
    const auto timelines = executor_->gather_timelines();
    s.pp_bubble = pipeline::bubble_of(timelines);
    s.pp_bubble_simulated = pipeline::simulate(schedule_, pipeline::measured_costs(timelines, schedule_.stages)).bubble;
    if (!config_.log.trace_file.empty() && is_root_)  // the latest step's timeline (Perfetto, chrome://tracing)
      io::write_file_atomic(config_.log.trace_file,
                            pipeline::chrome_trace(timelines, 1.0,
                                                   "lattice step " + std::to_string(step_) + ", " + schedule_.name));
  }
  if (mesh_->world().size() > 1) {
    // The job's step took as long as its slowest rank; memory is the largest rank's.
    double worst[2] = {s.step_ms, static_cast<double>(s.peak_mem_bytes)};
    mesh_->world().all_reduce(worst, 2, DType::F64, comm::ReduceOp::Max);
    s.step_ms = worst[0];
    s.peak_mem_bytes = static_cast<size_t>(worst[1]);
  }
  // Model FLOPs of the whole job over the peak of every rank's threads.
  s.tokens_per_sec = tokens / (s.step_ms / 1e3);
  s.mfu = s.tokens_per_sec * model_config_.flops_per_token(T) / (peak_flops_ * mesh_->world().size());
  return s;
}

parallel::DataParallel& Trainer::engine_of(size_t part, size_t g) {
  return expert_dp_ && parts_[part]->is_expert_group(g) ? *expert_dp_ : *dp_;
}

void Trainer::finish_moe_step(StepStats& s) {
  const int E = model_config_.n_experts, L = model_config_.n_layer;
  // Every layer's loads (this rank's rows), and the sums to report, over the
  // world: each token was routed by exactly one rank (TP ranks route shares
  // of the rows, CP ranks other positions, pipeline stages other layers).
  std::vector<double> v(static_cast<size_t>(L) * E + 6, 0.0);
  double* tail = v.data() + static_cast<size_t>(L) * E;
  for (const auto& part : parts_) {
    const auto& stats = part->moe_stats();
    for (int i = 0; i < static_cast<int>(stats.size()); i++) {
      const model::parts::MoeStats& st = stats[static_cast<size_t>(i)];
      if (st.load.empty()) continue;
      const int l = part->first_layer() + i;
      for (int e = 0; e < E; e++) v[static_cast<size_t>(l) * E + e] += st.load[static_cast<size_t>(e)];
      tail[0] += st.aux, tail[1] += st.z, tail[2] += static_cast<double>(st.micro_batches);
      tail[3] += static_cast<double>(st.pairs), tail[4] += static_cast<double>(st.dropped);
      s.moe_route_ms += st.route_s * 1e3, s.moe_expert_ms += st.expert_s * 1e3;
    }
  }
  if (mesh_->world().size() > 1) mesh_->world().all_reduce(v.data(), v.size(), DType::F64, comm::ReduceOp::Sum);
  // L_aux is the micro-batch's on each of the tp×cp ranks that share it (the
  // mean over them is the same); L_z is each rank's share of it.
  const double shares = static_cast<double>(config_.parallel.tp) * config_.parallel.cp;
  s.moe = true;
  s.aux_loss = tail[2] > 0 ? tail[0] / tail[2] : 0;
  s.z_loss = tail[2] > 0 ? tail[1] / (tail[2] / shares) : 0;
  s.dropped_fraction = tail[3] > 0 ? tail[4] / tail[3] : 0;
  s.expert_load_min = std::numeric_limits<double>::infinity(), s.expert_load_max = 0;
  for (int l = 0; l < L; l++) {
    if (!model_config_.is_moe_layer(l)) continue;
    for (int e = 0; e < E; e++) {
      const double load = v[static_cast<size_t>(l) * E + e];
      s.expert_load_min = std::min(s.expert_load_min, load), s.expert_load_max = std::max(s.expert_load_max, load);
    }
  }
  // All-to-alls: one dispatcher serves every part of this rank; the step line
  // shows the busiest rank's (a stage without MoE layers sends nothing).
  if (config_.parallel.ep > 1) {
    double a2a[2] = {static_cast<double>(ep_->bytes()), ep_->seconds() * 1e3};
    if (mesh_->world().size() > 1) mesh_->world().all_reduce(a2a, 2, DType::F64, comm::ReduceOp::Max);
    s.ep_comm_bytes = static_cast<uint64_t>(a2a[0]), s.ep_comm_ms = a2a[1];
  }
  // The auxiliary-loss-free bias follows the step's global loads (every rank
  // computes the same update of every layer), unless the step was skipped.
  const double rate = config_.moe.bias_update_rate;
  if (rate > 0 && !s.skipped) {
    for (int l = 0; l < L; l++)
      if (model_config_.is_moe_layer(l))
        expert::update_selection_bias(expert_bias_.data() + static_cast<size_t>(l) * E,
                                      v.data() + static_cast<size_t>(l) * E, E, rate);
    for (auto& part : parts_) part->expert_bias() = expert_bias_;
  }
}

double Trainer::evaluate() {
  if (!val_data_) return -1;
  val_data_->reset();
  double sum = 0;
  for (int i = 0; i < config_.train.eval_steps; i++)
    sum += executor_->evaluate(next_batches(*val_data_), config_.train.micro_batch_size, local_seq_len());
  return dp_->sum_over_ranks(sum) / (static_cast<double>(config_.train.eval_steps) * dp_->ranks());
}

int Trainer::local_seq_len() const { return config_.model.seq_len / config_.parallel.cp; }

int Trainer::stop_requested() {
  int local = g_stop_signal.load();
  if (mesh_->world().size() == 1) return local;
  float flag = static_cast<float>(local);
  mesh_->world().all_reduce(&flag, 1, DType::F32, comm::ReduceOp::Max);
  return static_cast<int>(flag);
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
    write_metrics(s);
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
  print_summary(total.seconds(), step_ - first_step);
  return 0;
}

}  // namespace lattice::train
