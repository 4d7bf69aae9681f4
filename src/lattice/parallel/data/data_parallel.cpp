#include "lattice/parallel/data/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>

#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/ops.h"
#include "lattice/parallel/zero/disk_store.h"

namespace lattice::parallel {

using optim::StateStore;

// Borrowed buffers of whole-group size, per distinct group size (in GPT: the
// blocks, and ln_f): `per_size` of them (parameters: 2, the one in use and
// the one being prefetched; gradients: 1 — a block's reduction finishes long
// before the next block's weight gradients are written, and when it has not,
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
  MemCategory category;
  std::vector<Class> classes;

  // Buffers for groups [first, end) of `groups`.
  Pool(MemCategory c, const std::vector<model::ParamGroup>& groups, size_t first, int per_size) : category(c) {
    for (size_t i = first; i < groups.size(); i++) {
      const model::ParamGroup& g = groups[i];
      auto it = std::find_if(classes.begin(), classes.end(), [&](const Class& k) { return k.capacity == g.capacity(); });
      if (it == classes.end()) {
        classes.push_back(Class{g.capacity(), 1, {}, {}});
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
  // Whether take() would return a buffer.
  bool available(int64_t capacity) { return !of(capacity).free.empty(); }
  size_t bytes() const {
    size_t b = 0;
    for (const Class& k : classes)
      for (const Buffer& buf : k.buffers) b += buf.bytes();
    return b;
  }
};

namespace {

// The embedding's chunks are its working buffers at stages 2-3 (two of
// parameters, two of gradient): small, so the working set stays a few
// percent of the model (at GPT-2's vocabulary the table is a third of it),
// and large enough for its GEMMs (2 MiB = 682 rows of 768) and messages.
constexpr double kEmbeddingChunkBytes = 2.0 * (1 << 20);

}  // namespace

DataParallel::DataParallel(model::GPT& model, comm::Communicator& dp, const DataParallelOptions& options)
    : model_(model),
      groups_(model.groups()),
      options_(options),
      // The embedding group in whole rows (sharded_embedding.h works row block by row block),
      // in chunks of at most kEmbeddingChunkBytes.
      layout_(model.groups(), dp.size(), dp.rank(), options.bucket_bytes, {model.config().n_embd},
              {std::min(options.bucket_bytes, kEmbeddingChunkBytes)}),
      opt_layout_(options.zero_stage == 0 ? ShardLayout(model.groups(), 1, 0, options.bucket_bytes) : layout_) {
  LATTICE_CHECK(options.zero_stage >= 0 && options.zero_stage <= 3,
                "parallel.zero_stage=" << options.zero_stage << " is not a ZeRO stage (0, 1, 2 or 3)");
  // Group 0 is the embedding, handled piece by piece (sharded_embedding.h);
  // a pipeline stage without it (or sharing it with another stage) comes
  // with the pipeline executor.
  LATTICE_CHECK(model.whole_model(), "data parallelism over pipeline stage [" << model.first_layer() << ", "
                                                                               << model.last_layer()
                                                                               << ") is not implemented yet");
  const int stage = options.zero_stage;
  const size_t G = groups_.size();
  // Whole buckets (and, at stage 0, whole optimizer chunks) in every group.
  // A model built Unallocated gets only the buffers this stage keeps whole; an
  // allocated one is padded (and, further down, trimmed to the stage).
  const bool allocated = groups_.front().has_params();
  for (size_t g = 0; g < G; g++) {
    const int64_t capacity = std::max(layout_.group(g).capacity(), opt_layout_.group(g).capacity());
    if (allocated)
      groups_[g].set_capacity(capacity);
    else
      groups_[g].allocate(capacity, /*params=*/stage < 3, /*grads=*/stage < 2);
  }

  int64_t total = 0;
  for (size_t g = 0; g < G; g++) {
    shard_base_.push_back(total);
    total += opt_layout_.group(g).shard_numel();
  }
  // One rank communicates nothing: no thread for it.
  stream_ = std::make_unique<CommStream>(dp, dp.size() == 1 ? Progress::Inline : options.progress);
  reducer_ = std::make_unique<GradientReducer>(*stream_, options.compression);
  if (options.compression.spec.codec == GradCodec::PowerSgd)
    for (const model::ParamGroup& group : groups_)
      lowrank_.push_back(lowrank_layout(group, options.compression.spec.powersgd_rank));

  // Where the optimizer state lives: moments, and at stage 3 the parameters.
  const int arrays = stage == 3 ? 3 : 2;
  std::unique_ptr<StateStore> store =
      options.offload_to_disk
          ? make_disk_store(options.offload_dir, dp.world_ranks()[dp.rank()], total, arrays,
                            options.offload_window_bytes)
          : optim::make_memory_store(total, arrays);

  if (stage >= 2) {
    for (model::ParamGroup& group : groups_) group.release_own_grads();  // before the shards: no overlap
    shard_grads_.resize(G);
    shard_grad_written_.assign(G, 0);
    for (size_t g = 0; g < G; g++)
      shard_grads_[g] = Buffer(static_cast<size_t>(layout_.group(g).shard_numel()) * sizeof(float), MemCategory::Grads);
  }
  std::vector<optim::AdamWSegment> segments;
  for (size_t g = 0; g < G; g++) {
    model::ParamGroup& group = groups_[g];
    for (const ShardLayout::Run& run : opt_layout_.runs(group, g)) {
      optim::AdamWSegment seg;
      seg.param = stage < 3 ? group.data() + run.begin : nullptr;
      seg.grad = stage < 2 ? group.grad_storage() + run.begin : shard_grads_[g].as<float>() + run.shard_offset;
      seg.n = run.n;
      seg.state_offset = shard_base_[g] + run.shard_offset;
      seg.decay = group.params()[run.param].weight_decay;
      seg.replicated = group.params()[run.param].shard.split_dim < 0;
      segments.push_back(seg);
      if (!options.count_replicated && group.params()[run.param].shard.split_dim >= 0)
        norm_segments_.emplace_back(seg.grad, seg.n);
    }
  }
  if (stage == 3) {
    // The parameters move into the store as this rank's slices; the whole
    // buffers go (they come back, borrowed, for each use).
    const GroupShard* largest = nullptr;
    for (size_t g = 0; g < G; g++) {
      const GroupShard& s = layout_.group(g);
      if (allocated)
        for (int64_t c = 0; c < s.chunks; c++)
          store->write(StateStore::kP, shard_base_[g] + c * s.slice, s.slice, groups_[g].data() + s.slice_begin(c));
      if (!largest || s.shard_numel() > largest->shard_numel()) largest = &s;
    }
    if (options.offload_to_disk && largest)
      staging_ = Buffer(static_cast<size_t>(largest->shard_numel()) * sizeof(float), MemCategory::Params);
    for (model::ParamGroup& group : groups_) group.release_own_params();
    param_pool_ = std::make_unique<Pool>(MemCategory::Params, groups_, 1, 2);  // not the embedding
    if (options.offload_to_disk)
      embedding_staging_ = Buffer(static_cast<size_t>(layout_.group(0).shard_numel()) * sizeof(float),
                                  MemCategory::Params);
  }
  if (stage >= 2) grad_pool_ = std::make_unique<Pool>(MemCategory::Grads, groups_, 1, 1);
  optimizer_ = std::make_unique<optim::AdamW>(std::move(segments), std::move(store), options.adam);
  if (stage >= 2 || dp.size() > 1) {
    const float* emb_params = nullptr;
    if (stage == 3) {
      float* resident = optimizer_->store().resident(StateStore::kP);
      emb_params = resident ? resident + shard_base_[0] : embedding_staging_.as<float>();
    }
    const ShardedEmbedding::Gradients mode = stage >= 2 ? ShardedEmbedding::Gradients::Sharded
                                             : stage == 1 ? ShardedEmbedding::Gradients::Scatter
                                                          : ShardedEmbedding::Gradients::AllReduce;
    embedding_ = std::make_unique<ShardedEmbedding>(groups_[0], model_.config(), layout_.group(0), *stream_,
                                                    *reducer_, 0, emb_params, mode,
                                                    stage >= 2 ? shard_grads_[0].as<float>() : nullptr);
    model_.set_tied_embedding(embedding_.get());
  }
  gather_ticket_.assign(G, 0);
  gathered_.assign(G, 0);
  model_.set_hooks(this);
}

DataParallel::~DataParallel() {
  // Pending collectives touch the buffers below (destroyed before stream_):
  // finish them first. (While an error unwinds a multi-rank job, the job is
  // ended before this runs: Trainer calls comm::abort_job.)
  if (std::uncaught_exceptions() == 0) {
    try {
      stream_->wait_all();
    } catch (...) {
    }
  }
  if (model_.hooks() == this) model_.set_hooks(nullptr);
  if (embedding_) model_.set_tied_embedding(nullptr);
}

void DataParallel::initialize(uint64_t seed) {
  if (stage() < 3) {
    for (model::ParamGroup& group : groups_) group.initialize(seed);
    return;
  }
  // Stage 3: each rank computes only its slices (the values depend on
  // (seed, name, index in the full tensor) alone, so they are the same as
  // the whole model's).
  StateStore& store = optimizer_->store();
  for (size_t g = 0; g < groups_.size(); g++) {
    const GroupShard& s = layout_.group(g);
    std::vector<float> slice(static_cast<size_t>(s.slice));
    for (int64_t c = 0; c < s.chunks; c++) {
      groups_[g].initial_values(seed, s.slice_begin(c), s.slice, slice.data());
      store.write(StateStore::kP, shard_base_[g] + c * s.slice, s.slice, slice.data());
    }
  }
}

std::string DataParallel::describe() const {
  std::ostringstream s;
  s << "ZeRO stage " << stage() << " over " << ranks() << " data-parallel rank" << (ranks() == 1 ? "" : "s");
  if (ranks() > 1)
    s << ", buckets of at most " << format_bytes(options_.bucket_bytes) << ", communication "
      << progress_name(stream_->progress());
  const CompressionOptions& c = options_.compression;
  if (c.spec.codec != GradCodec::None && ranks() > 1) {
    s << ", gradients compressed " << grad_codec_name(c.spec.codec);
    if (c.spec.codec == GradCodec::TopK) s << " (ratio " << c.spec.topk_ratio << ")";
    if (c.spec.codec == GradCodec::PowerSgd) s << " (rank " << c.spec.powersgd_rank << ")";
    s << (c.error_feedback ? " with" : " without") << " error feedback";
    if (c.warmup_steps > 0) s << " after " << c.warmup_steps << " uncompressed steps";
    if (stream_->progress() == Progress::Poll) s << " (poll progress: compressed reductions run inline, no overlap)";
  }
  s << ", optimizer state in " << const_cast<optim::AdamW&>(*optimizer_).store().describe();
  return s.str();
}

bool DataParallel::reduce_now() const { return stage() >= 2 || last_micro_; }

// ---------------------------------------------------------------- a step

void DataParallel::begin_step(int64_t step) {
  reducer_->begin_step(step);
  reducer_->reset_bytes();
  model_.zero_grad();
  std::fill(shard_grad_written_.begin(), shard_grad_written_.end(), 0);
  stream_->reset_times();
  bytes_at_step_start_ = stream_->comm().stats().bytes_sent;
  last_micro_ = true;
}

void DataParallel::begin_micro_batch(bool last) {
  if (embedding_) embedding_->begin_micro_batch(stage() < 2 ? false : !shard_grad_written_[0], last);
  last_micro_ = last;
}

void DataParallel::reap() {
  auto it = pending_grad_releases_.begin();
  while (it != pending_grad_releases_.end()) {
    if (!stream_->done(it->ticket)) {
      ++it;
      continue;
    }
    model::ParamGroup& group = groups_[it->group];
    grad_pool_->give(group.capacity(), group.grad_storage());
    group.attach_grads(nullptr);
    it = pending_grad_releases_.erase(it);
  }
}

void DataParallel::finish_gradients() {
  if (embedding_) embedding_->finish();
  stream_->wait_all();
  reap();
  LATTICE_CHECK(pending_grad_releases_.empty(), "internal: gradient buffers still lent after the last reduction");
}

double DataParallel::sum_over_ranks(double x) {
  if (ranks() == 1) return x;
  double v = x;
  stream_->wait(stream_->all_reduce(&v, 1, DType::F64, "sum"));
  return v;
}

double DataParallel::grad_sum_squares() {
  double local = 0;
  if (options_.count_replicated) {
    local = optimizer_->grad_sum_squares();
  } else {
    for (const auto& [grad, n] : norm_segments_) local += kernels::sum_squares(grad, n);
  }
  // Stage 0: every rank holds the whole summed gradient already.
  return stage() == 0 ? local : sum_over_ranks(local);
}

void DataParallel::optimizer_step(float lr, float grad_scale) {
  const bool gather = (stage() == 1 || stage() == 2) && ranks() > 1;
  // Each rank updates its slices; all-gathers make every group whole again
  // (in place: a rank's slice already sits where it is received), each
  // posted as soon as that group's slices are updated, so the gathers of the
  // first groups overlap the update of the later ones.
  size_t next = 0;
  auto post_gathers_up_to = [&](int64_t end) {
    while (next < groups_.size() && shard_base_[next] + opt_layout_.group(next).shard_numel() <= end) {
      const GroupShard& s = layout_.group(next);
      float* data = groups_[next].data();
      for (int64_t c = 0; c < s.chunks; c++)
        stream_->all_gather(data + s.slice_begin(c), data + c * s.chunk_numel(), s.slice,
                            chunk_label("params", groups_[next].name(), c, s.chunks));
      next++;
    }
  };
  if (gather) {
    optimizer_->step(lr, grad_scale, post_gathers_up_to);
    post_gathers_up_to(optimizer_->store().numel());  // groups whose tail holds no parameter
    stream_->wait_all();
  } else {
    optimizer_->step(lr, grad_scale);
  }
  const CommStream::Times t = stream_->times();
  last_comm_.ran_s = t.ran_s;
  last_comm_.exposed_s = t.waited_s;
  last_comm_.bytes = stream_->comm().stats().bytes_sent - bytes_at_step_start_;
}

// ---------------------------------------------------------------- hooks

void DataParallel::before_params(size_t g, Pass pass) {
  stream_->note(std::string(pass == Pass::Forward ? "forward " : "backward ") + groups_[g].name());
  stream_->progress_point();
  reap();
  if (stage() < 3) return;
  if (g == 0) {
    // The embedding gathers itself, chunk by chunk. From disk, its shard is
    // read into memory for the pass.
    if (options_.offload_to_disk)
      optimizer_->store().read(StateStore::kP, shard_base_[0], layout_.group(0).shard_numel(),
                               embedding_staging_.as<float>());
    return;
  }
  if (!gathered_[g]) {
    if (!gather_ticket_[g]) post_gather(g);
    stream_->wait(gather_ticket_[g]);
    gathered_[g] = 1;
  }
  // Prefetch the group this pass uses next (with a disk shard the staging
  // buffer is busy until this gather is done: no prefetch then).
  if (options_.offload_to_disk) return;
  const size_t L = groups_.size() - 2, emb = 0, fin = groups_.size() - 1;
  size_t next = g;
  if (pass == Pass::Forward) {
    next = g == fin ? g : g + 1;  // emb, h0 .. h(L-1), ln_f
  } else {
    if (g == emb) next = fin;                              // emb, ln_f, h(L-1) .. h0
    else if (g == fin) next = L >= 1 ? 1 + (L - 1) : g;
    else if (g > 1) next = g - 1;
  }
  if (next != g && !gathered_[next] && !gather_ticket_[next] && param_pool_->available(groups_[next].capacity()))
    post_gather(next);
}

void DataParallel::post_gather(size_t g) {
  model::ParamGroup& group = groups_[g];
  float* buffer = param_pool_->take(group.capacity());
  LATTICE_CHECK(buffer != nullptr, "internal: no free buffer to gather group " << group.name()
                                                                               << " into (more groups in use than "
                                                                                  "the pool holds)");
  group.attach_params(buffer);
  const GroupShard& s = layout_.group(g);
  StateStore& store = optimizer_->store();
  const float* shard = store.resident(StateStore::kP);
  if (shard) {
    shard += shard_base_[g];
  } else {
    store.read(StateStore::kP, shard_base_[g], s.shard_numel(), staging_.as<float>());
    shard = staging_.as<float>();
  }
  CommStream::Ticket t = 0;
  for (int64_t c = 0; c < s.chunks; c++)
    t = stream_->all_gather(shard + c * s.slice, buffer + c * s.chunk_numel(), s.slice,
                            chunk_label("gather", group.name(), c, s.chunks));
  gather_ticket_[g] = t;
  if (shard == staging_.as<float>()) stream_->wait(t);  // the staging buffer is reused by the next gather
}

void DataParallel::after_params(size_t g, Pass pass) {
  (void)pass;
  stream_->progress_point();
  reap();
  if (stage() < 3 || g == 0) return;
  model::ParamGroup& group = groups_[g];
  param_pool_->give(group.capacity(), group.data());
  group.attach_params(nullptr);
  gathered_[g] = 0;
  gather_ticket_[g] = 0;
}

void DataParallel::before_grads(size_t g) {
  stream_->progress_point();
  reap();
  if (stage() < 2) return;
  if (g == 0) return;  // the embedding has no borrowed buffer
  model::ParamGroup& group = groups_[g];
  float* buffer = grad_pool_->take(group.capacity());
  while (!buffer) {
    // Every buffer of this size is still being reduced: wait for the oldest.
    LATTICE_CHECK(!pending_grad_releases_.empty(), "internal: no gradient buffer for group " << group.name());
    stream_->wait(pending_grad_releases_.front().ticket);
    reap();
    buffer = grad_pool_->take(group.capacity());
  }
  group.attach_grads(buffer);
  group.zero_grad();  // this micro-batch's first writes overwrite
}

void DataParallel::grads_done(size_t g) {
  stream_->progress_point();
  reap();
  if (!reduce_now()) return;
  if (stage() == 0 && ranks() == 1) return;
  if (g == 0 && embedding_) {  // reduced by the embedding itself, as it went
    if (stage() >= 2) shard_grad_written_[0] = 1;
    return;
  }
  reduce_group(g);
}

void DataParallel::reduce_group(size_t g) {
  model::ParamGroup& group = groups_[g];
  group.zero_grad_padding();
  const GroupShard& s = layout_.group(g);
  float* grad = group.grad_storage();
  const int64_t k = s.slice;
  CommStream::Ticket t = 0;
  if (reducer_->lowrank()) {
    // PowerSGD needs the group's matrices whole: one operation for the group,
    // the result where the chunk operations below would leave it.
    const int64_t key = GradientReducer::key(static_cast<int64_t>(g), 0);
    const std::string label = "grad " + group.name() + " powersgd";
    if (stage() == 0) {
      reducer_->all_reduce_lowrank(key, grad, lowrank_[g], s.chunks, k, label);
    } else if (stage() == 1) {  // each slice stays at its home position
      reducer_->reduce_scatter_lowrank(key, grad, lowrank_[g], s.chunks, k, grad + s.slice_begin(0), s.chunk_numel(),
                                       false, label);
    } else {
      t = reducer_->reduce_scatter_lowrank(key, grad, lowrank_[g], s.chunks, k, shard_grads_[g].as<float>(), k,
                                           shard_grad_written_[g] != 0, label);
    }
  } else {
    for (int64_t c = 0; c < s.chunks; c++) {
      float* chunk = grad + c * s.chunk_numel();
      const int64_t key = GradientReducer::key(static_cast<int64_t>(g), c);
      const std::string label = chunk_label("grad", group.name(), c, s.chunks);
      if (stage() == 0) {
        reducer_->all_reduce(key, chunk, k, label);
      } else if (stage() == 1) {
        // This rank's slice summed where it belongs in the (whole) gradient buffer.
        reducer_->reduce_scatter(key, chunk, k, grad + s.slice_begin(c), false, label);
      } else {
        // Stages 2-3: into this rank's gradient shard (added from the second micro-batch on).
        t = reducer_->reduce_scatter(key, chunk, k, shard_grads_[g].as<float>() + c * k, shard_grad_written_[g] != 0,
                                     label);
      }
    }
  }
  if (stage() >= 2) {
    shard_grad_written_[g] = 1;
    pending_grad_releases_.push_back({t, g});
  }
}

// ---------------------------------------------------------------- checkpoints

float* DataParallel::shard_of(size_t g, State which) {
  StateStore& store = optimizer_->store();
  const int array = which == State::Params ? StateStore::kP : which == State::AdamM ? StateStore::kM : StateStore::kV;
  float* base = store.resident(array);
  return base ? base + shard_base_[g] : nullptr;
}

void DataParallel::gather_full(size_t g, State which, float* out) {
  stream_->wait_all();
  model::ParamGroup& group = groups_[g];
  if (which == State::Params && stage() < 3) {
    std::memcpy(out, group.data(), static_cast<size_t>(group.numel()) * sizeof(float));
    return;
  }
  const GroupShard& s = opt_layout_.group(g);
  StateStore& store = optimizer_->store();
  const int array = which == State::Params ? StateStore::kP : which == State::AdamM ? StateStore::kM : StateStore::kV;
  if (stage() == 0) {  // the whole group is this rank's
    store.read(array, shard_base_[g], group.numel(), out);
    return;
  }
  std::vector<float> local;
  const float* shard = shard_of(g, which);
  if (!shard) {
    local.resize(static_cast<size_t>(s.shard_numel()));
    store.read(array, shard_base_[g], s.shard_numel(), local.data());
    shard = local.data();
  }
  for (int64_t c = 0; c < s.chunks; c++)
    stream_->all_gather(shard + c * s.slice, out + c * s.chunk_numel(), s.slice,
                        chunk_label("checkpoint", group.name(), c, s.chunks));
  stream_->wait_all();
}

void DataParallel::load_full(size_t g, State which, const float* full) {
  stream_->wait_all();
  model::ParamGroup& group = groups_[g];
  if (which == State::Params && stage() < 3) {
    std::memcpy(group.data(), full, static_cast<size_t>(group.numel()) * sizeof(float));
    return;
  }
  const GroupShard& s = opt_layout_.group(g);
  StateStore& store = optimizer_->store();
  const int array = which == State::Params ? StateStore::kP : which == State::AdamM ? StateStore::kM : StateStore::kV;
  if (stage() == 0) {
    store.write(array, shard_base_[g], group.numel(), full);
    return;
  }
  for (int64_t c = 0; c < s.chunks; c++) store.write(array, shard_base_[g] + c * s.slice, s.slice, full + s.slice_begin(c));
}

}  // namespace lattice::parallel
