#include "lattice/parallel/data/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/ops.h"
#include "lattice/parallel/zero/disk_store.h"
#include "lattice/parallel/zero/sharded_embedding.h"

namespace lattice::parallel {

using optim::StateStore;
using Pass = model::GroupHooks::Pass;

namespace {

int array_of(DataParallel::State which) {
  return which == DataParallel::State::Params  ? StateStore::kP
         : which == DataParallel::State::AdamM ? StateStore::kM
                                               : StateStore::kV;
}

}  // namespace

// One model part: its groups' layouts over the ranks, where its state sits in
// the optimizer's, and what the stage keeps of it.
struct DataParallel::Part {
  Part(model::GPT& m, const ShardLayout& buckets, const ShardLayout& mine)
      : model(m), groups(m.groups()), layout(buckets), opt_layout(mine) {}
  model::GPT& model;
  std::vector<model::ParamGroup>& groups;
  ShardLayout layout;               // over the dp ranks: buckets and shards
  ShardLayout opt_layout;           // what this rank's optimizer updates (= layout, or whole groups at stage 0)
  std::vector<uint8_t> owned;       // per group: this engine's (DataParallelOptions::owns)
  std::vector<int64_t> state_base;  // offset of each group's shard in the optimizer state (owned groups)
  // Each group's GradientReducer key group: its index in the whole model
  // (embedding 0, block l at 1 + l, ln_f at n_layer + 1), so a group keys
  // the same compression state and PowerSGD draws whatever the layout (the
  // tied embedding's two copies too: summed before their reductions at
  // stages 0-1, they must compress alike); at stages 2-3 the last stage's
  // copy, reduced apart from the first's, is n_layer + 2. A layer's experts
  // (GPT::layer_of_group) are n_layer + 3 + that layer, past every dense
  // key, the same whatever the pipeline cut. The engine checks its keys are distinct.
  std::vector<int64_t> key;
  std::vector<Buffer> shard_grads;     // stages 2-3: this rank's gradient slices per group
  std::vector<uint8_t> written;        // stages 2-3: a slice was reduced into this step; 0-1: posted this step
  std::vector<LowRankLayout> lowrank;  // compression.grad = powersgd: each group's matrices
  // compression.momentum, once past the warm-up: this rank's own momentum
  // of each owned group (capacity floats), formed from its local gradients.
  std::vector<Buffer> momentum;
  // The embedding group piece by piece (sharded_embedding.h): stages 2-3
  // whenever the part holds it, stages 0-1 for a whole model over ranks > 1.
  std::unique_ptr<ShardedEmbedding> embedding;
  Buffer embedding_staging;  // stage 3 with offload: the embedding's shard, read from disk
  // Stage 3: per group, the gather in flight and whether it is attached.
  std::vector<comm::CommStream::Ticket> gather_ticket;
  std::vector<uint8_t> gathered;
  // The order in which each pass reads the groups (prefetching follows it).
  std::vector<size_t> forward_order, backward_order;
  bool last = true;  // the backward running now is the part's last of the step
  std::unique_ptr<PartHooks> hooks;
};

class DataParallel::PartHooks final : public model::GroupHooks {
 public:
  PartHooks(DataParallel& e, size_t j) : e_(e), j_(j) {}
  void before_params(size_t g, Pass pass) override { e_.before_params(j_, g, pass); }
  void after_params(size_t g, Pass) override { e_.after_params(j_, g); }
  void before_grads(size_t g) override { e_.before_grads(j_, g); }
  void grads_done(size_t g) override { e_.grads_done(j_, g); }

 private:
  DataParallel& e_;
  size_t j_;
};

// Borrowed buffers of whole-group size, per distinct group size (the blocks,
// ln_f): `per_size` of them (parameters: 2, the one in use and the one being
// prefetched; gradients: 1 — a block's reduction finishes long before the
// next block's weight gradients are written, and when it has not,
// before_grads waits for it), one where a single group has that size. All are
// allocated up front and kept, so a rank's memory is the stated bound
// whatever the timing.
struct DataParallel::Pool {
  struct Class {
    int64_t capacity = 0;
    int limit = 0;
    std::vector<Buffer> buffers;
    std::vector<float*> free;
  };
  std::vector<Class> classes;

  Pool(MemCategory category, const std::vector<int64_t>& capacities, int per_size) {
    for (int64_t capacity : capacities) {
      auto it = std::find_if(classes.begin(), classes.end(), [&](const Class& k) { return k.capacity == capacity; });
      if (it == classes.end()) {
        classes.push_back(Class{capacity, 1, {}, {}});
      } else {
        it->limit = per_size;
      }
    }
    for (Class& k : classes)
      while (static_cast<int>(k.buffers.size()) < k.limit) {
        k.buffers.emplace_back(static_cast<size_t>(k.capacity) * sizeof(float), category);
        k.free.push_back(k.buffers.back().as<float>());
      }
  }
  Class& of(int64_t capacity) {
    for (Class& k : classes)
      if (k.capacity == capacity) return k;
    LATTICE_FAIL("internal: no buffer class of " << capacity << " elements");
  }
  // A free buffer, or nullptr when all of them are lent out.
  float* take(int64_t capacity) {
    Class& k = of(capacity);
    if (k.free.empty()) return nullptr;
    float* p = k.free.back();
    k.free.pop_back();
    return p;
  }
  void give(int64_t capacity, float* p) { of(capacity).free.push_back(p); }
  bool available(int64_t capacity) { return !of(capacity).free.empty(); }
};

bool DataParallel::is_embedding(const Part& p, size_t g) const {
  return p.model.has_embedding() && g == p.model.embedding_index();
}

bool DataParallel::owns(size_t part, size_t g) const { return parts_.at(part)->owned.at(g) != 0; }

const model::GPT& DataParallel::part_model(size_t part) const { return parts_.at(part)->model; }

model::GroupHooks& DataParallel::hooks(size_t part) { return *parts_.at(part)->hooks; }

void DataParallel::check_owned(const Part& p, size_t j, size_t g, const char* what) const {
  LATTICE_CHECK(g < p.owned.size() && p.owned[g],
                "internal: " << what << " of group " << (g < p.groups.size() ? p.groups[g].name() : std::to_string(g))
                             << " of part " << j << " on the data-parallel engine"
                             << (options_.name.empty() ? "" : " '" + options_.name + "'")
                             << " that does not own it (another engine serves it; hooks go through a "
                                "GroupHooksRouter)");
}

DataParallel::DataParallel(std::vector<model::GPT*> parts, comm::Communicator& dp, const DataParallelOptions& options)
    : options_(options), ranks_(dp.size()) {
  const int stage = options.zero_stage;
  LATTICE_CHECK(stage >= 0 && stage <= 3, "parallel.zero_stage=" << stage << " is not a ZeRO stage (0, 1, 2 or 3)");
  LATTICE_CHECK(!parts.empty(), "internal: data parallelism over no model part");
  if (options.compression.momentum) {
    // (config.cpp refuses these with the keys to change; see "1-bit Adam" in data_parallel.h)
    LATTICE_CHECK(stage <= 1, "compression.momentum (1-bit Adam) needs a rank's whole gradient: ZeRO stage 0 or 1, "
                              "not " << stage);
    LATTICE_CHECK(options.compression.spec.codec != GradCodec::PowerSgd,
                  "compression.momentum works with the chunk codecs, not powersgd");
    LATTICE_CHECK(!options.whole_group_norm && !options.owns,
                  "compression.momentum is not built for a model served by several engines (experts)");
    LATTICE_CHECK(options.compression.warmup_steps >= 1,
                  "compression.momentum needs compression.warmup_steps >= 1 (Adam's second moment is frozen after them)");
  }
  // One rank communicates nothing: no thread for it.
  stream_ = std::make_unique<comm::CommStream>(dp, dp.size() == 1 ? comm::Progress::Inline : options.progress);
  reducer_ = std::make_unique<GradientReducer>(*stream_, options.compression);

  // Layouts: the embedding group in whole rows (sharded_embedding.h works row
  // block by row block), in chunks of at most kEmbeddingChunkBytes.
  int64_t total = 0;
  for (model::GPT* m : parts) {
    std::vector<uint8_t> owned(m->groups().size(), 1);
    if (options.owns)
      for (size_t g = 0; g < owned.size(); g++) owned[g] = options.owns(*m, g) ? 1 : 0;
    for (size_t g = 0; g < owned.size(); g++)
      LATTICE_CHECK(!owned[g] || (!m->groups()[g].has_params() && !m->groups()[g].has_grads()),
                    "internal: data parallelism takes model parts built GPT::Unallocated (group "
                        << m->groups()[g].name() << " is allocated already)");
    std::vector<int64_t> rows;
    std::vector<double> chunk_bytes;
    if (m->has_embedding()) {
      rows.assign(m->groups().size(), 0);
      chunk_bytes.assign(m->groups().size(), 0);
      rows[m->embedding_index()] = m->config().n_embd;
      chunk_bytes[m->embedding_index()] = std::min(options.bucket_bytes, kEmbeddingChunkBytes);
    }
    const ShardLayout buckets(m->groups(), dp.size(), dp.rank(), options.bucket_bytes, rows, chunk_bytes);
    auto p = std::make_unique<Part>(*m, buckets,
                                    stage == 0 ? ShardLayout(m->groups(), 1, 0, options.bucket_bytes) : buckets);
    const size_t G = p->groups.size();
    p->owned = std::move(owned);
    for (size_t g = 0; g < G; g++) {
      p->state_base.push_back(total);
      if (!p->owned[g]) {
        if (options.compression.spec.codec == GradCodec::PowerSgd) p->lowrank.emplace_back();
        continue;
      }
      total += p->opt_layout.group(g).shard_numel();
      // Whole buckets (and, at stage 0, whole optimizer chunks) in every group;
      // only the buffers this stage keeps whole.
      const int64_t capacity = std::max(p->layout.group(g).capacity(), p->opt_layout.group(g).capacity());
      p->groups[g].allocate(capacity, /*params=*/stage < 3, /*grads=*/stage < 2);
      if (options.compression.spec.codec == GradCodec::PowerSgd)
        p->lowrank.push_back(lowrank_layout(p->groups[g], options.compression.spec.powersgd_rank));
    }
    p->written.assign(G, 0);
    p->gather_ticket.assign(G, 0);
    p->gathered.assign(G, 0);
    // The pass orders: forward emb, h..., ln_f; backward (the head) emb, ln_f,
    // then the blocks from the last, the lookup's emb at the end. (Or the
    // model's own, options.order.) Only the owned groups: the prefetch
    // follows them.
    const model::GPT& mm = p->model;
    const size_t b0 = mm.block_index(mm.first_layer()),
                 b1 = b0 + static_cast<size_t>(mm.last_layer() - mm.first_layer());
    if (options.order) {
      p->forward_order = options.order(mm, Pass::Forward);
      p->backward_order = options.order(mm, Pass::Backward);
    } else {
      if (mm.first_stage()) p->forward_order.push_back(mm.embedding_index());
      for (size_t b = b0; b < b1; b++) p->forward_order.push_back(b);
      if (mm.last_stage()) {
        p->forward_order.push_back(mm.final_index());
        p->backward_order = {mm.final_index()};
        if (mm.tied_head()) p->backward_order.insert(p->backward_order.begin(), mm.embedding_index());
      }
      for (size_t b = b1; b > b0; b--) p->backward_order.push_back(b - 1);
    }
    for (std::vector<size_t>* order : {&p->forward_order, &p->backward_order}) {
      for (size_t g : *order)
        LATTICE_CHECK(g < G, "internal: a pass order names group " << g << " of a part of " << G << " groups");
      std::erase_if(*order, [&](size_t g) { return !p->owned[g]; });
    }
    const int L = mm.config().n_layer;
    for (size_t g = 0; g < G; g++) {
      int64_t k = 0;  // the embedding
      if (is_embedding(*p, g)) {
        if (!mm.first_stage() && stage >= 2) k = L + 2;
      } else if (mm.last_stage() && g == mm.final_index()) {
        k = L + 1;
      } else if (g >= b0 && g < b1) {
        k = 1 + mm.first_layer() + static_cast<int64_t>(g - b0);
      } else {
        k = L + 3 + mm.layer_of_group(g);
      }
      p->key.push_back(k);
    }
    parts_.push_back(std::move(p));
  }
  // Distinct keys for the owned groups (each keys its own compression state).
  // The tied embedding's two copies are one group and share theirs at stages
  // 0-1 on purpose (keyed 0 on both stages); they are not checked here.
  {
    std::vector<int64_t> keys;
    for (auto& p : parts_)
      for (size_t g = 0; g < p->groups.size(); g++)
        if (p->owned[g] && !is_embedding(*p, g)) keys.push_back(p->key[g]);
    std::sort(keys.begin(), keys.end());
    LATTICE_CHECK(std::adjacent_find(keys.begin(), keys.end()) == keys.end(),
                  "internal: two groups of the data-parallel engine have one compression key (more groups besides "
                  "the embedding, blocks and final group than layers in a part?)");
  }

  // Where the optimizer state lives: moments, and at stage 3 the parameters.
  std::unique_ptr<StateStore> store = options.offload_to_disk
                                          ? make_disk_store(options.offload_dir, dp.world_ranks()[dp.rank()], total,
                                                            stage == 3 ? 3 : 2, options.offload_window_bytes,
                                                            options.name)
                                          : optim::make_memory_store(total, stage == 3 ? 3 : 2);
  std::vector<optim::AdamWSegment> segments;
  std::vector<int64_t> pooled;  // capacities of the groups borrowed whole at stages 2-3 (not the embedding)
  int64_t largest_shard = 0;
  for (auto& pp : parts_) {
    Part& p = *pp;
    if (stage >= 2) {
      for (size_t g = 0; g < p.groups.size(); g++)
        p.shard_grads.push_back(
            p.owned[g] ? Buffer(static_cast<size_t>(p.layout.group(g).shard_numel()) * sizeof(float), MemCategory::Grads)
                       : Buffer());
    }
    for (size_t g = 0; g < p.groups.size(); g++) {
      if (!p.owned[g]) continue;
      model::ParamGroup& group = p.groups[g];
      for (const ShardLayout::Run& run : p.opt_layout.runs(group, g)) {
        optim::AdamWSegment seg;
        seg.param = stage < 3 ? group.data() + run.begin : nullptr;
        seg.grad = stage < 2 ? group.grad_storage() + run.begin : p.shard_grads[g].as<float>() + run.shard_offset;
        seg.n = run.n;
        seg.state_offset = p.state_base[g] + run.shard_offset;
        seg.decay = group.params()[run.param].weight_decay;
        const model::ShardSpec& shard = group.params()[run.param].shard;
        seg.replicas = shard.split_dim < 0 ? 0 : shard.replicas;
        segments.push_back(seg);
      }
      if (!is_embedding(p, g)) pooled.push_back(group.capacity());
      largest_shard = std::max(largest_shard, p.layout.group(g).shard_numel());
    }
    if (stage == 3 && options.offload_to_disk && p.model.has_embedding() && p.owned[p.model.embedding_index()])
      p.embedding_staging =
          Buffer(static_cast<size_t>(p.layout.group(p.model.embedding_index()).shard_numel()) * sizeof(float),
                 MemCategory::Params);
  }
  if (stage == 3) {
    param_pool_ = std::make_unique<Pool>(MemCategory::Params, pooled, 2);
    if (options.offload_to_disk)
      staging_ = Buffer(static_cast<size_t>(largest_shard) * sizeof(float), MemCategory::Params);
  }
  if (stage >= 2) grad_pool_ = std::make_unique<Pool>(MemCategory::Grads, pooled, 1);
  optimizer_ = std::make_unique<optim::AdamW>(std::move(segments), std::move(store), options.adam);

  for (size_t j = 0; j < parts_.size(); j++) {
    Part& p = *parts_[j];
    const bool whole = p.model.whole_model();
    // (at stages 0-1 only the tied embedding of a whole model, whose head's
    // and lookup's shares it reduces early; an untied one is a group like any)
    if (p.model.has_embedding() && p.owned[p.model.embedding_index()] &&
        (stage >= 2 || (whole && p.model.tied_head() && dp.size() > 1))) {
      const size_t e = p.model.embedding_index();
      const float* emb_params = nullptr;
      if (stage == 3) {
        float* resident = optimizer_->store().resident(StateStore::kP);
        emb_params = resident ? resident + p.state_base[e] : p.embedding_staging.as<float>();
      }
      const ShardedEmbedding::Gradients mode = stage >= 2   ? ShardedEmbedding::Gradients::Sharded
                                               : stage == 1 ? ShardedEmbedding::Gradients::Scatter
                                                            : ShardedEmbedding::Gradients::AllReduce;
      p.embedding = std::make_unique<ShardedEmbedding>(p.groups[e], p.model.config(), p.layout.group(e), *stream_,
                                                       *reducer_, p.key[e], emb_params, mode,
                                                       stage >= 2 ? p.shard_grads[e].as<float>() : nullptr);
      p.embedding->set_context_parallel(options_.context_parallel);
      p.model.set_tied_embedding(p.embedding.get());
    }
    p.hooks = std::make_unique<PartHooks>(*this, j);
    if (options.install_hooks) p.model.set_hooks(p.hooks.get());
  }
}

DataParallel::~DataParallel() {
  // Pending collectives touch the buffers below (destroyed before stream_):
  // finish them first. (While an error unwinds a multi-rank job, the job is
  // ended before this runs: the trainer calls comm::abort_job.)
  if (std::uncaught_exceptions() == 0) {
    try {
      stream_->wait_all();
    } catch (...) {
    }
  }
  for (auto& p : parts_) {
    if (options_.install_hooks && p->model.hooks() == p->hooks.get()) p->model.set_hooks(nullptr);
    if (p->embedding) p->model.set_tied_embedding(nullptr);
  }
}

const ShardLayout& DataParallel::layout(size_t part) const { return parts_.at(part)->layout; }

void DataParallel::initialize(uint64_t seed) {
  StateStore& store = optimizer_->store();
  for (auto& p : parts_)
    for (size_t g = 0; g < p->groups.size(); g++) {
      if (!p->owned[g]) continue;
      if (stage() < 3) {
        p->groups[g].initialize(seed);
        continue;
      }
      // Stage 3: each rank computes only its slices (the values depend on
      // (seed, name, index in the full tensor) alone, so they are the same
      // as the whole model's).
      const GroupShard& s = p->layout.group(g);
      std::vector<float> slice(static_cast<size_t>(s.slice));
      for (int64_t c = 0; c < s.chunks; c++) {
        p->groups[g].initial_values(seed, s.slice_begin(c), s.slice, slice.data());
        store.write(StateStore::kP, p->state_base[g] + c * s.slice, s.slice, slice.data());
      }
    }
}

std::string DataParallel::describe() const {
  std::ostringstream s;
  if (!options_.name.empty()) s << options_.name << ": ";
  s << "ZeRO stage " << stage() << " over " << ranks() << " data-parallel rank" << (ranks() == 1 ? "" : "s");
  if (parts_.size() > 1) s << ", " << parts_.size() << " model parts";
  if (options_.owns) {
    size_t mine = 0, all = 0;
    for (const auto& p : parts_) {
      mine += static_cast<size_t>(std::count(p->owned.begin(), p->owned.end(), 1));
      all += p->owned.size();
    }
    s << ", " << mine << " of " << all << " parameter groups";
  }
  if (ranks() > 1)
    s << ", buckets of at most " << format_bytes(options_.bucket_bytes) << ", communication "
      << comm::progress_name(stream_->progress());
  const CompressionOptions& c = options_.compression;
  if (c.momentum) {
    s << ", 1-bit Adam: after " << c.warmup_steps << " steps Adam's second moment frozen and each rank's momentum "
      << (ranks() > 1 ? "reduced" : "used") << " instead of its gradient";
    if (c.spec.codec != GradCodec::None && ranks() > 1) {
      s << ", compressed " << grad_codec_name(c.spec.codec);
      if (c.spec.codec == GradCodec::TopK) s << " (ratio " << c.spec.topk_ratio << ")";
      s << (c.error_feedback ? " with" : " without") << " error feedback";
    }
  } else if (c.spec.codec != GradCodec::None && ranks() > 1) {
    s << ", gradients compressed " << grad_codec_name(c.spec.codec);
    if (c.spec.codec == GradCodec::TopK) s << " (ratio " << c.spec.topk_ratio << ")";
    if (c.spec.codec == GradCodec::PowerSgd) s << " (rank " << c.spec.powersgd_rank << ")";
    s << (c.error_feedback ? " with" : " without") << " error feedback";
    if (c.warmup_steps > 0) s << " after " << c.warmup_steps << " uncompressed steps";
    if (stream_->progress() == comm::Progress::Poll)
      s << " (poll progress: compressed reductions run inline, no overlap)";
  }
  s << ", optimizer state in " << optimizer_->store().describe();
  return s.str();
}

// ---------------------------------------------------------------- a step

void DataParallel::begin_step(int64_t step) {
  reducer_->begin_step(step);
  reducer_->reset_bytes();
  momentum_phase_ = options_.compression.momentum && step >= options_.compression.warmup_steps;
  momentum_reduced_ = false;
  if (momentum_phase_ && !momentum_started_) start_momentum_phase();
  for (auto& p : parts_) {
    // GPT::zero_grad on the owned groups: gradients stale, and the compute
    // copies made again from whatever changed the master weights (an update,
    // a load) since the last step.
    for (size_t g = 0; g < p->groups.size(); g++)
      if (p->owned[g]) {
        p->groups[g].zero_grad();
        p->groups[g].params_changed();
      }
    std::fill(p->written.begin(), p->written.end(), 0);
    if (p->embedding) p->embedding->begin_step();
    p->last = true;
  }
  stream_->reset_times();
  bytes_at_step_start_ = stream_->comm().stats().bytes_sent;
}

void DataParallel::before_backward(size_t j, bool last) {
  Part& p = *parts_.at(j);
  // 1-bit Adam past its warm-up reduces nothing in the backward: every
  // backward accumulates here, as the earlier ones of a step always do.
  if (momentum_phase_) last = false;
  p.last = last;
  if (p.embedding) p.embedding->set_last(last);
}

void DataParallel::part_done(size_t j) {
  Part& p = *parts_.at(j);
  if (stage() >= 2) return;  // every backward reduced its groups as they were written
  if (momentum_phase_) return;  // the momentum is reduced in optimizer_step instead
  for (size_t g = 0; g < p.groups.size(); g++)
    if (p.owned[g] && !p.written[g] && !reduced_at_finish(p, g)) reduce_group(j, g);
}

bool DataParallel::reduced_at_finish(const Part& p, size_t g) const {
  // The embedding reduces itself (ShardedEmbedding), or, on a pipeline's
  // first or last stage at stages 0-1, after the tied copies are summed.
  return is_embedding(p, g) && (p.embedding || (stage() < 2 && !p.model.whole_model() && p.model.tied_head()));
}

void DataParallel::reap() {
  auto it = pending_grad_releases_.begin();
  while (it != pending_grad_releases_.end()) {
    if (!stream_->done(it->ticket)) {
      ++it;
      continue;
    }
    model::ParamGroup& group = parts_[it->part]->groups[it->group];
    grad_pool_->give(group.capacity(), group.grad_storage());
    group.attach_grads(nullptr);
    it = pending_grad_releases_.erase(it);
  }
}

void DataParallel::finish_gradients() {
  // The tied embedding under pipelines: its first and its last stage's copies.
  size_t first, last;
  tied_copies(&first, &last);
  const size_t any = first < parts_.size() ? first : last;
  const bool tied = any < parts_.size();
  LATTICE_CHECK(!tied || tied_sum_, "internal: pipeline stages hold the tied embedding but no tied sum was wired");
  const size_t e = tied ? parts_[any]->model.embedding_index() : 0;
  auto part = [&](size_t j) { return j < parts_.size() ? parts_[j].get() : nullptr; };
  if (tied && stage() < 2) {
    // Stages 0-1 hold the copies' whole gradients: summed first (the lookup's
    // share and the head's), then each reduced over the replicas — one sum
    // is compressed, not two shares (a low-rank codec approximates the sum
    // far better than the sparse lookup's share alone).
    auto grad = [&](size_t j) -> float* {
      Part* p = part(j);
      if (!p) return nullptr;
      p->groups[e].zero_unwritten_grads();
      return p->groups[e].grad_storage();
    };
    tied_sum_(grad(first), grad(last), static_cast<size_t>(parts_[any]->groups[e].numel()));
    // Both copies on this rank (ZB-V's rank 0): one reduction, copied.
    // (1-bit Adam past its warm-up: no reduction, each rank keeps its own.)
    if (part(first) && !momentum_phase_) reduce_group(first, e);
    if (part(last) && !part(first) && !momentum_phase_) reduce_group(last, e);
  }
  for (auto& p : parts_)
    if (p->embedding) p->embedding->finish();
  stream_->wait_all();
  reap();
  LATTICE_CHECK(pending_grad_releases_.empty(), "internal: gradient buffers still lent after the last reduction");
  if (stage() < 2) {
    if (part(first) && part(last))
      std::memcpy(part(last)->groups[e].grad_storage(), part(first)->groups[e].grad_storage(),
                  static_cast<size_t>(part(first)->groups[e].capacity()) * sizeof(float));
    return;
  }
  // A group no backward wrote this step (none should) holds zero slices.
  for (auto& p : parts_)
    for (size_t g = 0; g < p->groups.size(); g++)
      if (p->owned[g] && !p->written[g] && !(is_embedding(*p, g) && p->embedding->written()))
        std::memset(p->shard_grads[g].data(), 0, p->shard_grads[g].bytes());
  // Stages 2-3 hold no whole gradient: the copies' slices, each reduced over
  // the replicas as it went, are summed.
  if (tied) {
    auto slices = [&](size_t j) { return part(j) ? part(j)->shard_grads[e].as<float>() : nullptr; };
    tied_sum_(slices(first), slices(last), static_cast<size_t>(parts_[any]->layout.group(e).shard_numel()));
  }
}

double DataParallel::sum_over_ranks(double x) {
  if (ranks() == 1) return x;
  double v = x;
  stream_->wait(stream_->all_reduce(&v, 1, DType::F64, "sum"));
  return v;
}

double DataParallel::grad_sum_squares() {
  if (momentum_phase_) return local_grad_sum_squares();
  double local = 0;
  for (auto& p : parts_)
    for (size_t g = 0; g < p->groups.size(); g++) {
      if (!p->owned[g]) continue;
      model::ParamGroup& group = p->groups[g];
      for (const ShardLayout::Run& run : p->opt_layout.runs(group, g)) {
        const bool counts = options_.whole_group_norm ? stage() > 0 || stream_->comm().rank() == 0
                                                      : p->model.counts_in_norm(g, group.params()[run.param]);
        if (!counts) continue;
        const float* grad =
            stage() >= 2 ? p->shard_grads[g].as<float>() + run.shard_offset : group.grad_storage() + run.begin;
        local += kernels::sum_squares(grad, run.n);
      }
    }
  // Stage 0: every rank holds the whole summed gradient already (whole_group_norm: counted by rank 0, summed).
  return stage() == 0 && !options_.whole_group_norm ? local : sum_over_ranks(local);
}

void DataParallel::optimizer_step(float lr, float grad_scale) {
  if (momentum_phase_) reduce_momentum(grad_scale);
  // The update of this rank's slices: Adam, or 1-bit Adam's on the averaged
  // momentum that reduce_momentum left where the summed gradient would be.
  auto update = [&](const std::function<void(int64_t)>& updated) {
    if (momentum_phase_) {
      optimizer_->step_momentum(lr, variance_steps_, updated);
    } else {
      optimizer_->step(lr, grad_scale, updated);
    }
  };
  const bool gather = (stage() == 1 || stage() == 2) && ranks() > 1;
  // Each rank updates its slices; all-gathers make every group whole again
  // (in place: a rank's slice already sits where it is received), each
  // posted as soon as that group's slices are updated, so the gathers of the
  // first groups overlap the update of the later ones. The groups lie in the
  // state one part after another.
  size_t next_part = 0, next = 0;
  auto post_gathers_up_to = [&](int64_t end) {
    while (next_part < parts_.size()) {
      Part& p = *parts_[next_part];
      if (next == p.groups.size()) {
        next_part++, next = 0;
        continue;
      }
      if (!p.owned[next]) {  // another engine's: no state here
        next++;
        continue;
      }
      if (p.state_base[next] + p.opt_layout.group(next).shard_numel() > end) return;
      const GroupShard& s = p.layout.group(next);
      float* data = p.groups[next].data();
      for (int64_t c = 0; c < s.chunks; c++)
        stream_->all_gather(data + s.slice_begin(c), data + c * s.chunk_numel(), s.slice,
                            comm::chunk_label("params", p.groups[next].name(), c, s.chunks));
      next++;
    }
  };
  if (gather) {
    update(post_gathers_up_to);
    post_gathers_up_to(optimizer_->store().numel());  // groups whose tail holds no parameter
    stream_->wait_all();
  } else {
    update({});
  }
}

// ---------------------------------------------------------------- 1-bit Adam

void DataParallel::tied_copies(size_t* first, size_t* last) const {
  *first = *last = parts_.size();
  for (size_t j = 0; j < parts_.size(); j++) {
    const model::GPT& m = parts_[j]->model;
    if (m.has_embedding() && parts_[j]->owned[m.embedding_index()] && !m.whole_model() && m.tied_head())
      (m.first_stage() ? *first : *last) = j;
  }
}

void DataParallel::start_momentum_phase() {
  // v stops here: it has seen every update so far (fewer than warmup_steps
  // when a loss-scaled step was skipped), unless a checkpoint written in the
  // phase said when it stopped (restore_variance_steps).
  momentum_started_ = true;
  if (variance_steps_ == 0) variance_steps_ = optimizer_->steps_taken();
  LATTICE_CHECK(variance_steps_ >= 1, "compression.momentum freezes Adam's second moment after the warm-up, but no "
                                      "update has been applied yet (compression.warmup_steps="
                                          << options_.compression.warmup_steps
                                          << ", every step skipped so far): raise compression.warmup_steps");
  // Each rank's own momentum starts from the averaged one Adam kept (after a
  // resume too: the ranks' own momenta are not saved).
  for (size_t j = 0; j < parts_.size(); j++) {
    Part& p = *parts_[j];
    p.momentum.resize(p.groups.size());
    for (size_t g = 0; g < p.groups.size(); g++) {
      if (!p.owned[g]) continue;
      p.momentum[g] = Buffer(static_cast<size_t>(p.groups[g].capacity()) * sizeof(float), MemCategory::Optimizer);
      std::memset(p.momentum[g].data(), 0, p.momentum[g].bytes());
      gather_full(j, g, State::AdamM, p.momentum[g].as<float>());
    }
  }
}

double DataParallel::local_grad_sum_squares() {
  double local = 0;
  for (auto& p : parts_)
    for (size_t g = 0; g < p->groups.size(); g++) {
      if (!p->owned[g]) continue;
      model::ParamGroup& group = p->groups[g];
      group.zero_unwritten_grads();
      for (const model::ParamInfo& info : group.params())
        if (p->model.counts_in_norm(g, info))
          local += kernels::sum_squares(group.grad_storage() + info.offset, info.numel());
    }
  // The root mean square of the ranks' norms, as the trainer reads it
  // (√(sum)/ranks): n·Σ_r |g_r|² over n² is Σ_r |g_r|²/n.
  return ranks() * sum_over_ranks(local);
}

void DataParallel::reduce_momentum(float grad_scale) {
  if (!momentum_phase_ || momentum_reduced_) return;
  momentum_reduced_ = true;
  const float beta1 = options_.adam.beta1, n = static_cast<float>(ranks());
  // grad_scale makes the sum of the ranks' gradients the mean (clipped, the
  // loss scale out): n times it makes this rank's own an estimate of it.
  const float local = grad_scale * n;
  size_t first, last;
  tied_copies(&first, &last);
  for (size_t j = 0; j < parts_.size(); j++) {
    Part& p = *parts_[j];
    for (size_t g = 0; g < p.groups.size(); g++) {
      if (!p.owned[g]) continue;
      if (j == last && first < parts_.size() && is_embedding(p, g)) continue;  // the first copy's, copied below
      model::ParamGroup& group = p.groups[g];
      group.zero_unwritten_grads();
      group.zero_grad_padding();
      float* grad = group.grad_storage();
      float* mu = p.momentum[g].as<float>();
      // μ ← β1·μ + (1-β1)·g; what is summed over the ranks is μ/n.
      const int64_t cap = group.capacity();
#pragma omp parallel for if (cap > (1 << 16))
      for (int64_t i = 0; i < cap; i++) {
        mu[i] = beta1 * mu[i] + (1.0f - beta1) * local * grad[i];
        grad[i] = mu[i] / n;
      }
      if (ranks() > 1) reduce_chunks(p, g, "momentum", nullptr, false);  // (stages 0-1)
    }
  }
  stream_->wait_all();
  if (first < parts_.size() && last < parts_.size()) {  // both tied copies here: one reduction, copied
    const size_t e = parts_[first]->model.embedding_index();
    std::memcpy(parts_[last]->groups[e].grad_storage(), parts_[first]->groups[e].grad_storage(),
                static_cast<size_t>(parts_[first]->groups[e].capacity()) * sizeof(float));
    std::memcpy(parts_[last]->momentum[e].data(), parts_[first]->momentum[e].data(), parts_[first]->momentum[e].bytes());
  }
}

DataParallel::StepComm DataParallel::step_comm() {
  const comm::CommStream::Times t = stream_->times();
  StepComm c;
  c.ran_s = t.ran_s;
  c.exposed_s = t.waited_s;
  c.bytes = stream_->comm().stats().bytes_sent - bytes_at_step_start_;
  return c;
}

// ---------------------------------------------------------------- hooks

void DataParallel::before_params(size_t j, size_t g, Pass pass) {
  Part& p = *parts_[j];
  check_owned(p, j, g, "before_params");
  stream_->note(std::string(pass == Pass::Forward ? "forward " : "backward ") + p.groups[g].name());
  stream_->progress_point();
  reap();
  if (stage() < 3) return;
  if (is_embedding(p, g)) {
    // The embedding gathers itself, chunk by chunk. From disk, its shard is
    // read into memory for the pass.
    if (options_.offload_to_disk)
      optimizer_->store().read(StateStore::kP, p.state_base[g], p.layout.group(g).shard_numel(),
                               p.embedding_staging.as<float>());
    return;
  }
  if (!p.gathered[g]) {
    if (!p.gather_ticket[g]) post_gather(j, g);
    stream_->wait(p.gather_ticket[g]);
    p.gathered[g] = 1;
  }
  // Prefetch the group this pass reads next (with a disk shard the staging
  // buffer is busy until this gather is done: no prefetch then).
  if (options_.offload_to_disk) return;
  const std::vector<size_t>& order = pass == Pass::Forward ? p.forward_order : p.backward_order;
  auto at = std::find(order.begin(), order.end(), g);
  if (at == order.end() || ++at == order.end()) return;
  const size_t next = *at;
  if (!is_embedding(p, next) && !p.gathered[next] && !p.gather_ticket[next] &&
      param_pool_->available(p.groups[next].capacity()))
    post_gather(j, next);
}

void DataParallel::post_gather(size_t j, size_t g) {
  Part& p = *parts_[j];
  model::ParamGroup& group = p.groups[g];
  float* buffer = param_pool_->take(group.capacity());
  LATTICE_CHECK(buffer != nullptr, "internal: no free buffer to gather group " << group.name()
                                                                               << " into (more groups in use than "
                                                                                  "the pool holds)");
  group.attach_params(buffer);
  const GroupShard& s = p.layout.group(g);
  StateStore& store = optimizer_->store();
  const float* shard = shard_of(p, g, StateStore::kP);
  if (!shard) {
    store.read(StateStore::kP, p.state_base[g], s.shard_numel(), staging_.as<float>());
    shard = staging_.as<float>();
  }
  comm::CommStream::Ticket t = 0;
  for (int64_t c = 0; c < s.chunks; c++)
    t = stream_->all_gather(shard + c * s.slice, buffer + c * s.chunk_numel(), s.slice,
                            comm::chunk_label("gather", group.name(), c, s.chunks));
  p.gather_ticket[g] = t;
  if (shard == staging_.as<float>()) stream_->wait(t);  // the staging buffer is reused by the next gather
}

void DataParallel::after_params(size_t j, size_t g) {
  Part& p = *parts_[j];
  check_owned(p, j, g, "after_params");
  stream_->progress_point();
  reap();
  if (stage() < 3 || is_embedding(p, g)) return;
  model::ParamGroup& group = p.groups[g];
  param_pool_->give(group.capacity(), group.data());
  group.attach_params(nullptr);
  p.gathered[g] = 0;
  p.gather_ticket[g] = 0;
}

void DataParallel::before_grads(size_t j, size_t g) {
  Part& p = *parts_[j];
  check_owned(p, j, g, "before_grads");
  stream_->progress_point();
  reap();
  if (stage() < 2 || is_embedding(p, g)) return;  // the embedding has no borrowed buffer
  model::ParamGroup& group = p.groups[g];
  float* buffer = grad_pool_->take(group.capacity());
  while (!buffer) {
    // Every buffer of this size is still being reduced: wait for the oldest.
    LATTICE_CHECK(!pending_grad_releases_.empty(), "internal: no gradient buffer for group " << group.name());
    stream_->wait(pending_grad_releases_.front().ticket);
    reap();
    buffer = grad_pool_->take(group.capacity());
  }
  group.attach_grads(buffer);
  group.zero_grad();  // this backward's first writes overwrite
}

void DataParallel::grads_done(size_t j, size_t g) {
  Part& p = *parts_[j];
  check_owned(p, j, g, "grads_done");
  stream_->progress_point();
  reap();
  if (stage() < 2 && !p.last) return;  // stages 0-1 reduce the step's last backward only
  if (reduced_at_finish(p, g)) return;
  reduce_group(j, g);
}

void DataParallel::reduce_group(size_t j, size_t g) {
  Part& p = *parts_[j];
  model::ParamGroup& group = p.groups[g];
  // A parameter this part never writes (wpe on a last pipeline stage) is zeros.
  group.zero_unwritten_grads();
  group.zero_grad_padding();
  const bool accumulate = p.written[g] != 0;
  p.written[g] = 1;
  if (stage() == 0 && ranks() == 1) return;  // nothing to reduce: the gradient is the sum
  const GroupShard& s = p.layout.group(g);
  float* grad = group.grad_storage();
  const int64_t k = s.slice;
  float* shard = stage() >= 2 ? p.shard_grads[g].as<float>() : nullptr;
  comm::CommStream::Ticket t = 0;
  if (reducer_->lowrank()) {
    // PowerSGD needs the group's matrices whole: one operation for the group,
    // the result where the chunk operations below would leave it.
    const int64_t key = GradientReducer::key(p.key[g], 0);
    const std::string label = "grad " + group.name() + " powersgd";
    if (stage() == 0) {
      reducer_->all_reduce_lowrank(key, grad, p.lowrank[g], s.chunks, k, label);
    } else if (stage() == 1) {  // each slice stays at its home position
      reducer_->reduce_scatter_lowrank(key, grad, p.lowrank[g], s.chunks, k, grad + s.slice_begin(0), s.chunk_numel(),
                                       false, label);
    } else {
      t = reducer_->reduce_scatter_lowrank(key, grad, p.lowrank[g], s.chunks, k, shard, k, accumulate, label);
    }
  } else {
    t = reduce_chunks(p, g, "grad", shard, accumulate);
  }
  if (stage() >= 2) pending_grad_releases_.push_back({t, j, g});
}

comm::CommStream::Ticket DataParallel::reduce_chunks(Part& p, size_t g, const char* what, float* shard,
                                                     bool accumulate) {
  model::ParamGroup& group = p.groups[g];
  const GroupShard& s = p.layout.group(g);
  float* grad = group.grad_storage();
  const int64_t k = s.slice;
  comm::CommStream::Ticket t = 0;
  for (int64_t c = 0; c < s.chunks; c++) {
    float* chunk = grad + c * s.chunk_numel();
    const int64_t key = GradientReducer::key(p.key[g], c);
    const std::string label = comm::chunk_label(what, group.name(), c, s.chunks);
    if (stage() == 0) {
      t = reducer_->all_reduce(key, chunk, k, label);
    } else if (stage() == 1) {
      // This rank's slice summed where it belongs in the (whole) gradient buffer.
      t = reducer_->reduce_scatter(key, chunk, k, grad + s.slice_begin(c), false, label);
    } else {
      // Stages 2-3: into this rank's gradient shard (added from the step's second backward on).
      t = reducer_->reduce_scatter(key, chunk, k, shard + c * k, accumulate, label);
    }
  }
  return t;
}

// ---------------------------------------------------------------- checkpoints

float* DataParallel::shard_of(const Part& p, size_t g, int array) {
  float* base = optimizer_->store().resident(array);
  return base ? base + p.state_base[g] : nullptr;
}

void DataParallel::gather_full(size_t j, size_t g, State which, float* out) {
  Part& p = *parts_.at(j);
  check_owned(p, j, g, "gather_full");
  stream_->wait_all();
  model::ParamGroup& group = p.groups[g];
  if (which == State::Params && stage() < 3) {
    std::memcpy(out, group.data(), static_cast<size_t>(group.numel()) * sizeof(float));
    return;
  }
  const GroupShard& s = p.opt_layout.group(g);
  StateStore& store = optimizer_->store();
  const int array = array_of(which);
  if (stage() == 0) {  // the whole group is this rank's
    store.read(array, p.state_base[g], group.numel(), out);
    return;
  }
  std::vector<float> local;
  const float* shard = shard_of(p, g, array);
  if (!shard) {
    local.resize(static_cast<size_t>(s.shard_numel()));
    store.read(array, p.state_base[g], s.shard_numel(), local.data());
    shard = local.data();
  }
  for (int64_t c = 0; c < s.chunks; c++)
    stream_->all_gather(shard + c * s.slice, out + c * s.chunk_numel(), s.slice,
                        comm::chunk_label("checkpoint", group.name(), c, s.chunks));
  stream_->wait_all();
}

void DataParallel::load_full(size_t j, size_t g, State which, const float* full) {
  Part& p = *parts_.at(j);
  check_owned(p, j, g, "load_full");
  stream_->wait_all();
  model::ParamGroup& group = p.groups[g];
  if (which == State::Params && stage() < 3) {
    std::memcpy(group.data(), full, static_cast<size_t>(group.numel()) * sizeof(float));
    return;
  }
  const GroupShard& s = p.opt_layout.group(g);
  StateStore& store = optimizer_->store();
  const int array = array_of(which);
  if (stage() == 0) {
    store.write(array, p.state_base[g], group.numel(), full);
    return;
  }
  for (int64_t c = 0; c < s.chunks; c++)
    store.write(array, p.state_base[g] + c * s.slice, s.slice, full + s.slice_begin(c));
}

}  // namespace lattice::parallel
