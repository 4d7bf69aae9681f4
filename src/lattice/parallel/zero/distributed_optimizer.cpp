#include "lattice/parallel/zero/distributed_optimizer.h"

#include <cstring>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

using optim::StateStore;

DistributedOptimizer::DistributedOptimizer(std::vector<model::GPT*> models, comm::Communicator& dp, int zero_stage,
                                           double bucket_bytes, const optim::AdamWConfig& adam)
    : gpts_(std::move(models)), dp_(dp), stage_(zero_stage) {
  LATTICE_CHECK(zero_stage == 0 || zero_stage == 1,
                "DistributedOptimizer: ZeRO stage " << zero_stage << " (stages 0 and 1 only)");
  const int n = stage_ == 1 ? dp.size() : 1, r = stage_ == 1 ? dp.rank() : 0;
  std::vector<optim::AdamWSegment> segments;
  int64_t total = 0;
  for (model::GPT* g : gpts_) {
    std::vector<model::ParamGroup>& groups = g->groups();
    const ShardLayout layout(groups, n, r, bucket_bytes);
    std::vector<Group> mine;
    for (size_t i = 0; i < groups.size(); i++) {
      Group e;
      e.group = &groups[i];
      e.shard = layout.group(i);
      e.group->set_capacity(std::max(e.group->capacity(), e.shard.capacity()));
      e.runs = layout.runs(groups[i], i);
      e.state_base = total;
      total += e.shard.shard_numel();
      if (stage_ == 1)
        e.shard_grad = Buffer(static_cast<size_t>(e.shard.shard_numel()) * sizeof(float), MemCategory::Grads);
      mine.push_back(std::move(e));
    }
    models_.push_back(std::move(mine));
  }
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine)
      for (const ShardLayout::Run& run : e.runs) {
        optim::AdamWSegment seg;
        seg.param = e.group->data() + run.begin;
        seg.grad = stage_ == 1 ? e.shard_grad.as<float>() + run.shard_offset : e.group->grad_storage() + run.begin;
        seg.n = run.n;
        seg.state_offset = e.state_base + run.shard_offset;
        seg.decay = e.group->params()[run.param].weight_decay;
        segments.push_back(seg);
      }
  optimizer_ = std::make_unique<optim::AdamW>(std::move(segments), optim::make_memory_store(total, 2), adam);
}

DistributedOptimizer::~DistributedOptimizer() {
  // A collective in flight writes into the buffers: let it land first (while
  // an error unwinds a multi-rank job the job is being ended anyway).
  for (comm::WorkPtr& w : pending_) try {
      if (w) w->wait();
    } catch (...) {
    }
}

void DistributedOptimizer::reduce(size_t j, bool embedding) {
  model::GPT& g = *gpts_[j];
  for (size_t i = 0; i < models_[j].size(); i++) {
    const bool is_embedding = g.has_embedding() && i == g.embedding_index();
    if (is_embedding != embedding) continue;
    Group& e = models_[j][i];
    model::ParamGroup& group = *e.group;
    for (size_t p = 0; p < group.params().size(); p++) {
      bool acc = false;
      if (!group.grad_written(p)) std::memset(group.write_grad(p, &acc), 0, sizeof(float) * group.params()[p].numel());
    }
    if (dp_.size() == 1) continue;
    float* grad = group.grad_storage();
    const int64_t chunk = e.shard.chunk_numel();  // one reduction call
    for (int64_t c = 0; c < e.shard.chunks; c++) {
      float* at = grad + c * chunk;
      if (stage_ == 1) {
        pending_.push_back(dp_.ireduce_scatter(at, e.shard_grad.as<float>() + c * e.shard.slice,
                                               static_cast<size_t>(e.shard.slice), DType::F32, comm::ReduceOp::Sum));
      } else {
        pending_.push_back(dp_.iall_reduce(at, static_cast<size_t>(chunk), DType::F32, comm::ReduceOp::Sum));
      }
    }
  }
}

void DistributedOptimizer::finish_reductions() {
  for (comm::WorkPtr& w : pending_) w->wait();
  pending_.clear();
  if (stage_ == 1 && dp_.size() == 1)  // nothing was scattered: the slice is the whole gradient
    for (std::vector<Group>& mine : models_)
      for (Group& e : mine)
        std::memcpy(e.shard_grad.as<float>(), e.group->grad_storage(),
                    static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
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
            stage_ == 1 ? e.shard_grad.as<float>() + run.shard_offset : e.group->grad_storage() + run.begin;
        sum += kernels::sum_squares(g, run.n);
      }
    }
  if (stage_ == 1 && dp_.size() > 1) dp_.all_reduce(&sum, 1, DType::F64, comm::ReduceOp::Sum);
  return sum;
}

void DistributedOptimizer::step(float lr, float grad_scale) {
  optimizer_->step(lr, grad_scale);
  if (stage_ == 0 || dp_.size() == 1) return;
  for (std::vector<Group>& mine : models_)
    for (Group& e : mine) {
      float* data = e.group->data();
      for (int64_t c = 0; c < e.shard.chunks; c++)  // in place: this rank's slice is its block of the chunk
        pending_.push_back(dp_.iall_gather(data + e.shard.slice_begin(c), data + c * e.shard.chunk_numel(),
                                           static_cast<size_t>(e.shard.slice), DType::F32));
    }
  for (comm::WorkPtr& w : pending_) w->wait();
  pending_.clear();
}

void DistributedOptimizer::gather_moments(size_t j, size_t g, int array, float* out) {
  const Group& e = models_[j][g];
  const float* state = optimizer_->store().resident(array) + e.state_base;
  if (stage_ == 0 || dp_.size() == 1) {
    std::memcpy(out, state, static_cast<size_t>(e.shard.shard_numel()) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < e.shard.chunks; c++)
    dp_.all_gather(state + c * e.shard.slice, out + c * e.shard.chunk_numel(), static_cast<size_t>(e.shard.slice),
                   DType::F32);
}

void DistributedOptimizer::load_moments(size_t j, size_t g, int array, const float* full) {
  const Group& e = models_[j][g];
  float* state = optimizer_->store().resident(array) + e.state_base;
  for (int64_t c = 0; c < e.shard.chunks; c++)
    std::memcpy(state + c * e.shard.slice, full + e.shard.slice_begin(c),
                static_cast<size_t>(e.shard.slice) * sizeof(float));
}

}  // namespace lattice::parallel
