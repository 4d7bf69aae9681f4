// The trainer under pipeline parallelism (parallel.pp > 1): this rank's stage
// models (model::StageLayers, a balanced cut of the layers, tensor-parallel
// slices under parallel.tp > 1), the executor running the configured schedule
// (parallel/pipeline/), and one DistributedOptimizer over the stage models
// for data parallelism over the pipelines, at ZeRO stages 0-3
// (parallel/zero/distributed_optimizer.h): at stages 0-1 a stage's gradients
// are reduced over the replicas as soon as its last backward of the step has
// run; at stages 2-3 every micro-batch's, and at stage 3 every pass gathers
// the parameters it reads.
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "lattice/comm/process_mesh.h"
#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/metrics.h"
#include "lattice/io/safetensors.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/pipeline/executor.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/timeline.h"
#include "lattice/parallel/tensor/tensor_parallel.h"
#include "lattice/train/model_io.h"
#include "lattice/train/pipeline_state.h"
#include "lattice/train/trainer.h"

namespace lattice::train {

model::GPT& Trainer::model() { return pipe_ ? *pipe_->models.front() : *model_; }

optim::AdamW& Trainer::optimizer() { return pipe_ ? pipe_->optimizer->optimizer() : dp_->optimizer(); }

Trainer::~Trainer() = default;

void Trainer::pipeline_bubbles(double* measured, double* simulated) const {
  *measured = pipe_->last_bubble;
  *simulated = pipe_->last_simulated;
}

void Trainer::pipeline_grad_bytes(uint64_t* sent, uint64_t* uncompressed) {
  const parallel::GradientReducer::Bytes b = pipe_->optimizer->reducer().bytes();
  *sent = b.sent;
  *uncompressed = b.uncompressed;
}

std::string Trainer::describe_pipeline() const {
  const Pipeline& pp = *pipe_;
  std::string out = "pipeline " + pp.schedule.name + " over " + std::to_string(pp.schedule.ranks) + " ranks, " +
                    std::to_string(pp.schedule.stages) + " stages of layers";
  for (const pipeline::ChunkLayers& c : pp.cut)
    out += " [" + std::to_string(c.first) + "," + std::to_string(c.last) + ")";
  out += ", " + std::to_string(pp.schedule.micro_batches) +
         " micro-batches per step; simulated bubble at equal costs " +
         std::to_string(pipeline::simulate(pp.schedule).bubble).substr(0, 5);
  if (pp.optimizer->ranks() > 1)
    out += "; " + std::to_string(pp.optimizer->ranks()) + " data-parallel replicas, ZeRO stage " +
           std::to_string(pp.optimizer->stage()) +
           (pp.optimizer->stage() == 0   ? " (gradients all-reduced)"
            : pp.optimizer->stage() == 1 ? " (Adam moments sharded)"
            : pp.optimizer->stage() == 2 ? " (moments and gradients sharded)"
                                         : " (moments, gradients and parameters sharded)");
  if (pp.optimizer->ranks() > 1 && config_.compression.grad != "none")
    out += ", gradients compressed " + config_.compression.grad +
           (config_.compression.error_feedback ? " with" : " without") + " error feedback";
  return out;
}

void Trainer::build_pipeline(uint64_t seed) {
  const auto& p = config_.parallel;
  LATTICE_CHECK(config_.zero.offload == "none", "parallel.pp=" << p.pp << ": zero.offload=\"" << config_.zero.offload
                                                               << "\" does not compose with pipeline parallelism yet "
                                                                  "(ZeRO stages 0-3 do, with the state in memory)");
  pipe_ = std::make_unique<Pipeline>();
  Pipeline& pp = *pipe_;
  const std::string& name = p.schedule;
  if (name.rfind("csv:", 0) == 0) {
    const std::string path = name.substr(4);
    pp.schedule = pipeline::from_csv(io::read_whole_file(path, "parallel.schedule"), path);
    LATTICE_CHECK(pp.schedule.ranks == p.pp, "parallel.schedule=" << name << " has " << pp.schedule.ranks
                                                                  << " rows (ranks) but parallel.pp=" << p.pp);
    LATTICE_CHECK(pp.schedule.micro_batches == micro_batches_,
                  "parallel.schedule=" << name << " runs " << pp.schedule.micro_batches
                                       << " micro-batches but a step has " << micro_batches_
                                       << " (train.grad_accum_steps, or global_batch_size / micro_batch_size)");
  } else {
    pp.schedule = pipeline::make_schedule(name, p.pp, p.virtual_stages, micro_batches_);
  }
  pipeline::validate(pp.schedule);
  const int S = pp.schedule.stages, T = config_.model.seq_len;
  if (p.partition.empty()) {
    const std::vector<double> costs = pipeline::layer_costs(model_config_, T);
    pp.cut = pipeline::refine_partition(costs, pipeline::balanced_partition(costs, S, pp.schedule.rank_of_stage),
                                        pp.schedule);
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
    pp.cut =
        pipeline::explicit_partition(layers, model_config_.n_layer, S, "parallel.partition=\"" + p.partition + "\"");
  }
  const bool draw = config_.checkpoint.init_from.empty() && config_.checkpoint.resume.empty();
  optim::AdamWConfig adam;
  adam.beta1 = static_cast<float>(config_.optim.beta1);
  adam.beta2 = static_cast<float>(config_.optim.beta2);
  adam.eps = static_cast<float>(config_.optim.eps);
  adam.weight_decay = static_cast<float>(config_.optim.weight_decay);
  // Tensor parallelism inside every stage (3D): each stage model holds its slices.
  if (p.tp > 1) tp_ = std::make_unique<tensor::TensorParallel>(mesh_->tp(), p.sequence_parallel);
  std::vector<model::GPT*> mine;
  for (int s = 0; s < S; s++) {
    if (pp.schedule.rank_of_stage[s] != mesh_->coord().pp) continue;
    const model::StageLayers layers{pp.cut[s].first, pp.cut[s].last};
    pp.models.push_back(draw ? std::make_unique<model::GPT>(model_config_, seed, tp_.get(), layers)
                             : std::make_unique<model::GPT>(model_config_, model::GPT::NoInit{}, tp_.get(), layers));
    pp.models.back()->set_compute_dtype(compute_);
    pp.model_stage.push_back(s);
    mine.push_back(pp.models.back().get());
  }
  pp.whole = std::make_unique<model::GPT>(model_config_, model::GPT::Unallocated{});
  // Initial values from a model file, while every stage model still holds its
  // parameters whole (ZeRO-3 keeps only slices from here on).
  if (!config_.checkpoint.init_from.empty()) {
    io::SafeTensorsReader file(config_.checkpoint.init_from);
    const HfSource src = safetensors_source(file, config_.checkpoint.init_from);
    for (auto& m : pp.models)
      for (model::ParamGroup& g : m->groups()) import_hf_group(g, g.data(), src);
  }
  pp.optimizer = std::make_unique<parallel::DistributedOptimizer>(mine, mesh_->dp(), p.zero_stage,
                                                                  p.bucket_mb * 1024.0 * 1024.0, adam,
                                                                  compression_options(), parallel::progress_from_env());
  pp.executor = std::make_unique<pipeline::Executor>(pp.schedule, mine, mesh_->pp());
  // Stages 0-1: a stage's gradients (but the tied embedding's) go to the
  // replicas as soon as its last backward has run, overlapping the rest of
  // the schedule. Stages 2-3 reduce every micro-batch's, through the model's
  // hooks, and sum the tied embedding's copies on their slices.
  pp.executor->on_stage_done([&pp](int stage) {
    for (size_t j = 0; j < pp.models.size(); j++)
      if (pp.model_stage[j] == stage) pp.optimizer->reduce(j, false);
  });
  if (p.zero_stage >= 2) {
    pp.executor->set_sum_tied_embedding(false);
    pipeline::Executor* ex = pp.executor.get();
    pp.optimizer->set_tied_sum([ex](float* first, float* last, size_t n) { ex->sum_tied(first, last, n); });
  }
  const size_t n = static_cast<size_t>(config_.train.micro_batch_size) * T;
  pp.inputs.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(n));
  pp.targets.assign(static_cast<size_t>(micro_batches_), std::vector<int32_t>(n));
}

// The step's micro-batches from `source`, in the pipeline's batch buffers
// (every stage reads the batch alike: the first uses its tokens, the last its targets).
std::vector<pipeline::MicroBatch> Trainer::next_batches(BatchSource& source) {
  Pipeline& pp = *pipe_;
  std::vector<pipeline::MicroBatch> batches;
  for (int k = 0; k < micro_batches_; k++) {
    source.next(pp.inputs[k].data(), pp.targets[k].data());
    batches.push_back({pp.inputs[k].data(), pp.targets[k].data()});
  }
  return batches;
}

double Trainer::pipeline_step(float lr, double* norm_out) {
  Pipeline& pp = *pipe_;
  const int B = config_.train.micro_batch_size, T = config_.model.seq_len;
  for (auto& m : pp.models) m->zero_grad();
  pp.optimizer->begin_step(step_);
  pp.executor->set_loss_scale(loss_grad_factor());
  double loss = pp.executor->run_step(next_batches(*train_data_), B, T);
  // Data parallelism over pipelines: each replica ran its share of the
  // global batch. Every stage's gradients are on their way to the other
  // replicas since its last backward; the tied embedding's, summed between
  // its two stages at the end of the step, go now. The loss, the norm and
  // the update are of the mean.
  const int replicas = mesh_->dp().size();
  for (size_t j = 0; j < pp.models.size(); j++) pp.optimizer->reduce(j, true);
  pp.optimizer->finish_reductions();
  if (tp_) parallel::average_replicated_grads(pp.optimizer->reducer(), pp.optimizer->optimizer(), mesh_->tp());
  if (replicas > 1) loss = pp.optimizer->sum_over_ranks(loss) / replicas;
  // Over the pipeline: each stage's parameters, the tied embedding once,
  // TP-replicated parameters on TP rank 0 (pipeline::counts_in_norm).
  double sum_squares = pp.optimizer->grad_sum_squares([&pp](size_t j, size_t g, const model::ParamInfo& info) {
    return pipeline::counts_in_norm(*pp.models[j], g, info);
  });
  mesh_->pp().all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
  if (tp_) mesh_->tp().all_reduce(&sum_squares, 1, DType::F64, comm::ReduceOp::Sum);
  const double loss_scale = scaler_.scale();
  const double norm = std::sqrt(sum_squares) / replicas / loss_scale;
  if (apply_update(loss, norm)) {
    const double scale =
        optim::clip_scale(norm, static_cast<float>(config_.optim.grad_clip)) / (replicas * loss_scale);
    pp.optimizer->step(lr, static_cast<float>(scale));
    params_changed();
  }
  // The measured bubble beside the simulator's, fed this step's mean cost of
  // each kind of action on each stage (a full B counted as equal I and W halves).
  const auto timelines = pp.executor->gather_timelines();
  const size_t S = static_cast<size_t>(pp.schedule.stages);
  std::vector<std::array<double, 3>> sum(S, {0, 0, 0}), count(S, {0, 0, 0});
  for (const auto& row : timelines)
    for (const pipeline::Interval& iv : row) {
      const size_t st = static_cast<size_t>(iv.action.stage);
      const double d = iv.end - iv.start;
      switch (iv.action.op) {
        case pipeline::Op::F:
          sum[st][0] += d, count[st][0]++;
          break;
        case pipeline::Op::I:
          sum[st][1] += d, count[st][1]++;
          break;
        case pipeline::Op::W:
          sum[st][2] += d, count[st][2]++;
          break;
        case pipeline::Op::B:
          sum[st][1] += d / 2, count[st][1]++;
          sum[st][2] += d / 2, count[st][2]++;
          break;
      }
    }
  pipeline::Costs costs;
  costs.by_stage.resize(S);
  for (size_t st = 0; st < S; st++)
    for (int k = 0; k < 3; k++) costs.by_stage[st][k] = count[st][k] ? sum[st][k] / count[st][k] : 0.0;
  pp.last_bubble = pipeline::bubble_of(timelines);
  if (!config_.log.trace_file.empty() && is_root_)  // the latest step's timeline (Perfetto, chrome://tracing)
    io::write_file_atomic(
        config_.log.trace_file,
        pipeline::chrome_trace(timelines, 1.0, "lattice step " + std::to_string(step_ + 1) + ", " + pp.schedule.name));
  pp.last_simulated = pipeline::simulate(pp.schedule, costs).bubble;
  *norm_out = norm;
  return loss;
}

double Trainer::pipeline_evaluate() {
  Pipeline& pp = *pipe_;
  double sum = 0;
  val_data_->reset();
  for (int i = 0; i < config_.train.eval_steps; i++)
    sum += pp.executor->evaluate(next_batches(*val_data_), config_.train.micro_batch_size, config_.model.seq_len);
  sum = pp.optimizer->sum_over_ranks(sum);
  return sum / (static_cast<double>(config_.train.eval_steps) * mesh_->dp().size());
}

// The whole model's group g is held by the rank of the stage that runs it
// (the embedding: the first stage's copy); it sends the tensors to the world's root.
std::vector<HfTensor> Trainer::pipeline_group_tensors(size_t g, ModelBuffer which, bool all_ranks) {
  Pipeline& pp = *pipe_;
  const model::ParamGroup& shape = pp.whole->groups()[g];
  // Which stage holds it.
  int stage = 0;
  if (shape.name() == "ln_f") {
    stage = pp.schedule.stages - 1;
  } else if (shape.name() != "embedding") {
    const int layer = std::stoi(shape.name().substr(2));
    for (int s = 0; s < pp.schedule.stages; s++)
      if (pp.cut[s].first <= layer && layer < pp.cut[s].last) stage = s;
  }
  const int owner = pp.schedule.rank_of_stage[stage], me = mesh_->coord().pp;
  // The group's HF tensors, concatenated in parameter order (full tensors:
  // under tensor parallelism the owner's TP ranks assemble their slices).
  size_t total = 0;
  for (const model::ParamInfo& p : shape.params()) {
    size_t n = 1;
    for (int64_t d : hf_shape(p)) n *= static_cast<size_t>(d);
    total += n;
  }
  std::vector<float> flat(total);
  if (me == owner) {
    for (size_t j = 0; j < pp.models.size(); j++) {
      if (pp.model_stage[j] != stage) continue;
      model::GPT& m = *pp.models[j];
      for (size_t i = 0; i < m.groups().size(); i++) {
        const model::ParamGroup& local = m.groups()[i];
        if (local.name() != shape.name()) continue;
        // Whole over the replicas (collective over the data-parallel group:
        // its ranks all own this stage).
        std::vector<float> whole_group(static_cast<size_t>(local.capacity()), 0.0f);
        pp.optimizer->gather_state(j, i,
                                   which == ModelBuffer::Params  ? optim::StateStore::kP
                                   : which == ModelBuffer::AdamM ? optim::StateStore::kM
                                                                 : optim::StateStore::kV,
                                   whole_group.data());
        const float* src = whole_group.data();
        const std::vector<HfTensor> tensors = assemble_group(local, src, static_cast<size_t>(local.numel()), true);
        size_t at = 0;
        for (const HfTensor& t : tensors) {
          std::memcpy(flat.data() + at, t.data.data(), t.data.size() * sizeof(float));
          at += t.data.size();
        }
      }
    }
  }
  auto split = [&] {
    std::vector<HfTensor> out;
    size_t at = 0;
    for (const model::ParamInfo& p : shape.params()) {
      HfTensor t;
      t.name = p.name;
      t.shape = hf_shape(p);
      size_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<size_t>(d);
      t.data.assign(flat.begin() + static_cast<std::ptrdiff_t>(at), flat.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
      out.push_back(std::move(t));
    }
    return out;
  };
  if (all_ranks) {
    mesh_->pp().broadcast(flat.data(), flat.size(), DType::F32, owner);
    return split();
  }
  // The replicas are identical and so are the TP ranks' assembled tensors:
  // the root's pipeline (data-parallel rank 0, TP rank 0) writes.
  if (mesh_->coord().dp != 0 || mesh_->coord().tp != 0) return {};
  if (owner != 0) {
    if (me == owner) mesh_->pp().send(flat.data(), flat.size(), DType::F32, 0, 7);
    if (me == 0) mesh_->pp().recv(flat.data(), flat.size(), DType::F32, owner, 7);
  }
  if (!is_root_) return {};
  return split();
}

void Trainer::load_pipeline_state(const HfSource sources[3]) {
  Pipeline& pp = *pipe_;
  for (size_t j = 0; j < pp.models.size(); j++) {
    model::GPT& m = *pp.models[j];
    for (size_t i = 0; i < m.groups().size(); i++) {
      model::ParamGroup& g = m.groups()[i];
      std::vector<float> full(static_cast<size_t>(g.capacity()), 0.0f);
      const int arrays[3] = {optim::StateStore::kP, optim::StateStore::kM, optim::StateStore::kV};
      for (int k = 0; k < 3; k++) {
        import_hf_group(g, full.data(), sources[k]);
        pp.optimizer->load_state(j, i, arrays[k], full.data());
      }
    }
  }
}

}  // namespace lattice::train
