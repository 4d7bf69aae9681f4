#include "lattice/parallel/zero/distributed_optimizer.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

using optim::StateStore;

// The model's hooks at stages 2-3 (model::GroupHooks): gathers around every
// pass that reads a group, a borrowed gradient buffer around every backward
// that writes one, its reduce-scatter when the model says it is written.
class DistributedOptimizer::StageHooks final : public model::GroupHooks {
 public:
  StageHooks(DistributedOptimizer& o, size_t j) : o_(o), j_(j) {}
  void before_params(size_t g, Pass) override {
    o_.reap();
    if (o_.stage_ == 3) o_.gather_params(j_, g);
  }
  void after_params(size_t g, Pass) override {
    if (o_.stage_ == 3) o_.release_params(j_, g);
  }
  void before_grads(size_t g) override {
    o_.reap();
    o_.borrow_grads(j_, g);
  }
  void grads_done(size_t g) override { o_.reduce_grads(j_, g); }

 private:
  DistributedOptimizer& o_;
  size_t j_;
};

DistributedOptimizer::DistributedOptimizer(std::vector<model::GPT*> models, comm::Communicator& dp, int zero_stage,
                                           double bucket_bytes, const optim::AdamWConfig& adam,
                                           const CompressionOptions& compression, Progress progress)
    : gpts_(std::move(models)), dp_(dp), stage_(zero_stage) {
  LATTICE_CHECK(zero_stage >= 0 && zero_stage <= 3,
                "parallel.zero_stage=" << zero_stage << " is not a ZeRO stage (0, 1, 2 or 3)");
  std::vector<optim::AdamWSegment> segments;
  int64_t total = 0, key = 0;
  for (model::GPT* g : gpts_) {
    std::vector<model::ParamGroup>& groups = g->groups();
    // The reduction's buckets are over the dp ranks at every stage; the
    // optimizer's share is this rank's slices from stage 1, everything at 0.
    const ShardLayout buckets(groups, dp.size(), dp.rank(), bucket_bytes);
    const ShardLayout mine_layout = stage_ >= 1 ? buckets : ShardLayout(groups, 1, 0, bucket_bytes);
    std::vector<Group> mine;
    for (size_t i = 0; i < groups.size(); i++) {
      Group e;
      e.group = &groups[i];
      e.key = key++;
      e.buckets = buckets.group(i);
      e.shard = mine_layout.group(i);
      e.group->set_capacity(std::max({e.group->capacity(), e.buckets.capacity(), e.shard.capacity()}));
      e.runs = mine_layout.runs(groups[i], i);
      if (compression.spec.codec == GradCodec::PowerSgd)
        e.lowrank = lowrank_layout(groups[i], compression.spec.powersgd_rank);
      e.state_base = total;
      total += e.shard.shard_numel();
      if (stage_ >= 1)
        e.shard_grad = Buffer(static_cast<size_t>(e.shard.shard_numel()) * sizeof(float), MemCategory::Grads);
      mine.push_back(std::move(e));
    }
    models_.push_back(std::move(mine));
  }
  // Stage 3 keeps the parameters as slices in the optimizer's store (kP).
  std::unique_ptr<StateStore> store = optim::make_memory_store(total, stage_ == 3 ? 3 : 2);
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine) {
      for (const ShardLayout::Run& run : e.runs) {
        optim::AdamWSegment seg;
        seg.param = stage_ < 3 ? e.group->data() + run.begin : nullptr;
        seg.grad = stage_ >= 1 ? e.shard_grad.as<float>() + run.shard_offset : e.group->grad_storage() + run.begin;
        seg.n = run.n;
        seg.state_offset = e.state_base + run.shard_offset;
        seg.decay = e.group->params()[run.param].weight_decay;
        seg.replicated = e.group->params()[run.param].shard.split_dim < 0;
        segments.push_back(seg);
      }
      if (stage_ == 3) {
        for (int64_t c = 0; c < e.shard.chunks; c++)
          store->write(StateStore::kP, e.state_base + c * e.shard.slice, e.shard.slice,
                       e.group->data() + e.shard.slice_begin(c));
        e.group->release_own_params();
      }
      if (stage_ >= 2) e.group->release_own_grads();
    }
  optimizer_ = std::make_unique<optim::AdamW>(std::move(segments), std::move(store), adam);
  stream_ = std::make_unique<CommStream>(dp, dp.size() == 1 ? Progress::Inline : progress);
  reducer_ = std::make_unique<GradientReducer>(*stream_, compression);
  if (stage_ >= 2)
    for (size_t j = 0; j < gpts_.size(); j++) {
      hooks_.push_back(std::make_unique<StageHooks>(*this, j));
      gpts_[j]->set_hooks(hooks_.back().get());
    }
}

DistributedOptimizer::~DistributedOptimizer() {
  // A collective in flight writes into the buffers: let it land first (while
  // an error unwinds a multi-rank job the job is being ended anyway).
  if (std::uncaught_exceptions() == 0) {
    try {
      stream_->wait_all();
    } catch (...) {
    }
  }
  for (size_t j = 0; j < hooks_.size(); j++)
    if (gpts_[j]->hooks() == hooks_[j].get()) gpts_[j]->set_hooks(nullptr);
}

void DistributedOptimizer::begin_step(int64_t step) {
  reducer_->begin_step(step);
  reducer_->reset_bytes();
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine) e.shard_written = false;
}

double DistributedOptimizer::sum_over_ranks(double x) {
  if (dp_.size() == 1) return x;
  double v = x;
  stream_->wait(stream_->all_reduce(&v, 1, DType::F64, "sum"));
  return v;
}

// ---- borrowed buffers (stages 2-3) ----

// Gradient buffers: at most kGradBuffers of a size (a block's reduction is
// usually done before the next block's weight gradients come; when it is
// not, the next borrow waits for it). Parameter buffers: as many as passes
// hold at once (the head reads wte and ln_f together), released at once.
constexpr size_t kGradBuffers = 2;

float* DistributedOptimizer::borrow(int64_t capacity, MemCategory category) {
  auto it = std::find_if(pool_.begin(), pool_.end(),
                         [&](const Pooled& p) { return p.capacity == capacity && p.category == category; });
  if (it == pool_.end()) {
    pool_.push_back(Pooled{capacity, category, {}, {}});
    it = pool_.end() - 1;
  }
  Pooled& k = *it;
  while (k.free.empty() && category == MemCategory::Grads && k.buffers.size() >= kGradBuffers) {
    // Every buffer of this size is still being reduced: wait for the oldest.
    auto oldest = std::find_if(pending_releases_.begin(), pending_releases_.end(),
                               [&](const Release& r) { return r.capacity == capacity; });
    LATTICE_CHECK(oldest != pending_releases_.end(), "internal: no gradient buffer of " << capacity << " floats");
    stream_->wait(oldest->ticket);
    reap();
  }
  if (k.free.empty()) {  // one more of this size: kept for the rest of the run
    k.buffers.emplace_back(static_cast<size_t>(capacity) * sizeof(float), category);
    return k.buffers.back().as<float>();
  }
  float* p = k.free.back();
  k.free.pop_back();
  return p;
}

void DistributedOptimizer::give_back(int64_t capacity, float* p) {
  for (Pooled& k : pool_)
    for (Buffer& b : k.buffers)
      if (k.capacity == capacity && b.data() == p) {
        k.free.push_back(p);
        return;
      }
  LATTICE_FAIL("internal: buffer returned to the wrong pool");
}

void DistributedOptimizer::reap() {
  auto it = pending_releases_.begin();
  while (it != pending_releases_.end()) {
    if (!stream_->done(it->ticket)) {
      ++it;
      continue;
    }
    give_back(it->capacity, it->buffer);
    it = pending_releases_.erase(it);
  }
}

void DistributedOptimizer::gather_params(size_t j, size_t g) {
  Group& e = models_[j][g];
  if (e.param_users++ > 0) return;  // already gathered for an enclosing pass
  float* buffer = borrow(e.group->capacity(), MemCategory::Params);
  const float* shard = optimizer_->store().resident(StateStore::kP) + e.state_base;
  CommStream::Ticket t = 0;
  for (int64_t c = 0; c < e.shard.chunks; c++)
    t = stream_->all_gather(shard + c * e.shard.slice, buffer + c * e.shard.chunk_numel(), e.shard.slice,
                            chunk_label("gather", e.group->name(), c, e.shard.chunks));
  stream_->wait(t);
  e.group->attach_params(buffer);
}

void DistributedOptimizer::release_params(size_t j, size_t g) {
  Group& e = models_[j][g];
  LATTICE_CHECK(e.param_users > 0, "internal: group " << e.group->name() << " released without a gather");
  if (--e.param_users > 0) return;
  give_back(e.group->capacity(), e.group->data());
  e.group->attach_params(nullptr);
}

void DistributedOptimizer::borrow_grads(size_t j, size_t g) {
  Group& e = models_[j][g];
  if (e.group->has_grads()) return;  // still attached from an enclosing backward
  e.group->attach_grads(borrow(e.group->capacity(), MemCategory::Grads));
  e.group->zero_grad();  // this micro-batch's first writes overwrite
}

// Reduce-scatters one group's whole gradient buffer into this rank's slices
// (added to them after the step's first reduction).
void DistributedOptimizer::post_reduction(Group& e, float* grad, bool accumulate) {
  const GroupShard& b = e.buckets;
  if (reducer_->lowrank()) {  // PowerSGD: the whole group at once (gradient_reducer.h)
    reducer_->reduce_scatter_lowrank(GradientReducer::key(e.key, 0), grad, e.lowrank, b.chunks, b.slice,
                                     e.shard_grad.as<float>(), b.slice, accumulate,
                                     "grad " + e.group->name() + " powersgd");
    return;
  }
  for (int64_t c = 0; c < b.chunks; c++)
    reducer_->reduce_scatter(GradientReducer::key(e.key, c), grad + c * b.chunk_numel(), b.slice,
                             e.shard_grad.as<float>() + c * b.slice, accumulate,
                             chunk_label("grad", e.group->name(), c, b.chunks));
}

void DistributedOptimizer::reduce_grads(size_t j, size_t g) {
  if (stage_ < 2) return;
  Group& e = models_[j][g];
  model::ParamGroup& group = *e.group;
  group.zero_unwritten_grads();
  group.zero_grad_padding();
  float* grad = group.grad_storage();
  const int64_t capacity = group.capacity();
  if (dp_.size() == 1) {  // no one to reduce with: the slice is the gradient
    float* dst = e.shard_grad.as<float>();
    for (int64_t i = 0; i < e.shard.shard_numel(); i++) dst[i] = e.shard_written ? dst[i] + grad[i] : grad[i];
    give_back(capacity, grad);
  } else {
    post_reduction(e, grad, e.shard_written);
    pending_releases_.push_back({stream_->last_posted(), capacity, grad});
  }
  e.shard_written = true;
  group.attach_grads(nullptr);
}

void DistributedOptimizer::reduce(size_t j, bool embedding) {
  if (stage_ >= 2) return;  // reduced micro-batch by micro-batch, through the hooks
  model::GPT& g = *gpts_[j];
  for (size_t i = 0; i < models_[j].size(); i++) {
    const bool is_embedding = g.has_embedding() && i == g.embedding_index();
    if (is_embedding != embedding) continue;
    Group& e = models_[j][i];
    model::ParamGroup& group = *e.group;
    group.zero_unwritten_grads();
    group.zero_grad_padding();
    if (dp_.size() == 1) continue;
    float* grad = group.grad_storage();
    const GroupShard& b = e.buckets;
    if (reducer_->lowrank()) {  // PowerSGD: the whole group at once (gradient_reducer.h)
      const int64_t key = GradientReducer::key(e.key, 0);
      const std::string label = "grad " + group.name() + " powersgd";
      if (stage_ == 1) {
        reducer_->reduce_scatter_lowrank(key, grad, e.lowrank, b.chunks, b.slice, e.shard_grad.as<float>(), b.slice,
                                         false, label);
      } else {
        reducer_->all_reduce_lowrank(key, grad, e.lowrank, b.chunks, b.slice, label);
      }
      continue;
    }
    for (int64_t c = 0; c < b.chunks; c++) {
      float* chunk = grad + c * b.chunk_numel();
      const int64_t key = GradientReducer::key(e.key, c);
      const std::string label = chunk_label("grad", group.name(), c, b.chunks);
      if (stage_ == 1) {
        reducer_->reduce_scatter(key, chunk, b.slice, e.shard_grad.as<float>() + c * b.slice, false, label);
      } else {
        reducer_->all_reduce(key, chunk, b.slice, label);
      }
    }
  }
}

void DistributedOptimizer::finish_reductions() {
  stream_->wait_all();
  reap();
  if (stage_ == 1 && dp_.size() == 1)  // nothing was scattered: the slice is the whole gradient
    for (std::vector<Group>& mine : models_)
      for (Group& e : mine)
        std::memcpy(e.shard_grad.as<float>(), e.group->grad_storage(),
                    static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
  if (stage_ < 2) return;
  // A stage that never wrote a group this step (none should) reduces nothing: its slices are zero.
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine)
      if (!e.shard_written)
        std::memset(e.shard_grad.data(), 0, static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
  // The tied embedding: this rank's slices of the first and the last stage's copies.
  float *first = nullptr, *last = nullptr;
  size_t n = 0;
  for (size_t j = 0; j < gpts_.size(); j++) {
    model::GPT& g = *gpts_[j];
    if (!g.has_embedding() || g.whole_model()) continue;
    Group& e = models_[j][g.embedding_index()];
    (g.first_stage() ? first : last) = e.shard_grad.as<float>();
    n = static_cast<size_t>(e.shard.shard_numel());
  }
  if ((first || last) && tied_sum_) tied_sum_(first, last, n);
}

double DistributedOptimizer::grad_sum_squares(
    const std::function<bool(size_t, size_t, const model::ParamInfo&)>& counted) {
  double sum = 0;
  for (size_t j = 0; j < models_.size(); j++)
    for (size_t i = 0; i < models_[j].size(); i++) {
      const Group& e = models_[j][i];
      for (const ShardLayout::Run& run : e.runs) {
        if (!counted(j, i, e.group->params()[run.param])) continue;
        const float* g =
            stage_ >= 1 ? e.shard_grad.as<float>() + run.shard_offset : e.group->grad_storage() + run.begin;
        sum += kernels::sum_squares(g, run.n);
      }
    }
  return stage_ >= 1 ? sum_over_ranks(sum) : sum;
}

void DistributedOptimizer::step(float lr, float grad_scale) {
  optimizer_->step(lr, grad_scale);
  if (stage_ == 0 || stage_ == 3 || dp_.size() == 1) return;  // stage 3: the slices are the parameters
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine) {
      float* data = e.group->data();
      for (int64_t c = 0; c < e.shard.chunks; c++)  // in place: this rank's slice is its block of the chunk
        stream_->all_gather(data + e.shard.slice_begin(c), data + c * e.shard.chunk_numel(), e.shard.slice,
                            chunk_label("params", e.group->name(), c, e.shard.chunks));
    }
  stream_->wait_all();
}

void DistributedOptimizer::gather_state(size_t j, size_t g, int array, float* out) {
  Group& e = models_[j][g];
  if (array == StateStore::kP && stage_ < 3) {
    std::memcpy(out, e.group->data(), static_cast<size_t>(e.group->numel()) * sizeof(float));
    return;
  }
  const float* state = optimizer_->store().resident(array) + e.state_base;
  if (stage_ == 0 || dp_.size() == 1) {
    std::memcpy(out, state, static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < e.shard.chunks; c++)
    stream_->all_gather(state + c * e.shard.slice, out + c * e.shard.chunk_numel(), e.shard.slice,
                        chunk_label("checkpoint", e.group->name(), c, e.shard.chunks));
  stream_->wait_all();
}

void DistributedOptimizer::load_state(size_t j, size_t g, int array, const float* full) {
  Group& e = models_[j][g];
  if (array == StateStore::kP && stage_ < 3) {
    std::memcpy(e.group->data(), full, static_cast<size_t>(e.group->numel()) * sizeof(float));
    return;
  }
  float* state = optimizer_->store().resident(array) + e.state_base;
  if (stage_ == 0) {
    std::memcpy(state, full, static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < e.shard.chunks; c++)
    std::memcpy(state + c * e.shard.slice, full + e.shard.slice_begin(c),
                static_cast<size_t>(e.shard.slice) * sizeof(float));
}

}  // namespace lattice::parallel
