#include "lattice/model/param_group.h"

#include <algorithm>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/kernels/ops.h"

namespace lattice::model {

std::vector<int64_t> ShardSpec::local_shape(const std::vector<int64_t>& full) const {
  std::vector<int64_t> s = full;
  if (split_dim < 0) return s;
  LATTICE_CHECK(split_dim < static_cast<int>(full.size()), "shard split_dim " << split_dim << " out of range");
  LATTICE_CHECK(full[split_dim] % (static_cast<int64_t>(parts) * num_shards) == 0,
                "dimension " << full[split_dim] << " cannot be split into " << parts << " parts x " << num_shards
                             << " shards");
  s[split_dim] = full[split_dim] / num_shards;
  return s;
}

int64_t ShardSpec::full_index(const std::vector<int64_t>& full, const std::vector<int64_t>& local,
                              int64_t local_index) const {
  if (split_dim < 0) return local_index;
  // Decompose the local index into coordinates, map the split coordinate, recompose.
  int64_t idx = local_index, result = 0, stride = 1;
  for (int d = static_cast<int>(full.size()) - 1; d >= 0; d--) {
    int64_t coord = idx % local[d];
    idx /= local[d];
    if (d == split_dim) {
      int64_t part_len_local = local[d] / parts;  // length of one part held here
      int64_t part = coord / part_len_local, within = coord % part_len_local;
      int64_t part_len_full = full[d] / parts;
      coord = part * part_len_full + static_cast<int64_t>(shard_index) * part_len_local + within;
    }
    result += coord * stride;
    stride *= full[d];
  }
  return result;
}

void assemble_full(const ParamInfo& p, const std::vector<const float*>& slices, float* full) {
  if (p.shard.split_dim < 0) {
    std::copy(slices[0], slices[0] + p.numel(), full);
    return;
  }
  const int replicas = p.shard.replicas;
  LATTICE_CHECK(static_cast<int>(slices.size()) == p.shard.num_shards * replicas,
                "assemble_full(" << p.name << "): " << slices.size() << " slices for " << p.shard.num_shards
                                 << " shards x " << replicas << " replicas");
  const int64_t n = p.numel();
  for (int r = 0; r < p.shard.num_shards; r++) {
    ShardSpec spec = p.shard;
    spec.shard_index = r;
    const float* src = slices[static_cast<size_t>(r) * replicas];
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) full[spec.full_index(p.full_shape, p.shape, i)] = src[i];
  }
}

void extract_slice(const ParamInfo& p, const float* full, float* slice) {
  const int64_t n = p.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) slice[i] = full[p.shard.full_index(p.full_shape, p.shape, i)];
}

void ParamGroup::add(ParamInfo info) {
  LATTICE_CHECK(data_.empty(), "ParamGroup " << name_ << ": add() after allocate()");
  info.shape = info.shard.local_shape(info.full_shape);
  LATTICE_CHECK(!info.packed || !params_.empty(), "ParamGroup " << name_ << ": " << info.name
                                                                << " is packed but follows no parameter");
  // Each parameter starts on a 64-byte boundary (16 floats) for aligned
  // vector loads, except a packed one, which follows the previous directly.
  info.offset = info.packed ? params_.back().offset + params_.back().numel() : numel_;
  numel_ = (info.offset + info.numel() + 15) / 16 * 16;
  params_.push_back(std::move(info));
  grad_written_.push_back(1);  // buffers start zeroed: a valid (zero) gradient
}

void ParamGroup::allocate(int64_t capacity, bool params, bool grads) {
  capacity_ = std::max(numel_, capacity);
  if (params) {
    data_ = Buffer(static_cast<size_t>(capacity_) * sizeof(float), MemCategory::Params);
    data_ptr_ = data_.as<float>();
  }
  if (grads) {
    grad_ = Buffer(static_cast<size_t>(capacity_) * sizeof(float), MemCategory::Grads);
    grad_ptr_ = grad_.as<float>();
  }
  grad_written_.assign(params_.size(), 1);  // Buffer memory starts zeroed: a valid (zero) gradient
}

void ParamGroup::set_capacity(int64_t capacity) {
  LATTICE_CHECK(data_ptr_ == data_.as<float>() && grad_ptr_ == grad_.as<float>() && !data_.empty(),
                "ParamGroup " << name_ << ": set_capacity needs the group's own buffers");
  if (capacity <= capacity_) return;
  Buffer data(static_cast<size_t>(capacity) * sizeof(float), MemCategory::Params);
  Buffer grad(static_cast<size_t>(capacity) * sizeof(float), MemCategory::Grads);
  std::memcpy(data.data(), data_.data(), static_cast<size_t>(capacity_) * sizeof(float));
  std::memcpy(grad.data(), grad_.data(), static_cast<size_t>(capacity_) * sizeof(float));
  data_ = std::move(data);
  grad_ = std::move(grad);
  data_ptr_ = data_.as<float>();
  grad_ptr_ = grad_.as<float>();
  capacity_ = capacity;
}

void ParamGroup::set_compute_dtype(DType t) {
  LATTICE_CHECK(t == DType::F32 || t == DType::BF16 || t == DType::F16,
                "precision.compute is f32, bf16 or f16, not " << dtype_name(t));
  compute_dtype_ = t;
  compute_fresh_ = false;
  gemm_constant_.reset();
  if (t == DType::F32) compute_.reset();
}

float* ParamGroup::compute_data() {
  float* masters = checked_data();
  if (compute_dtype_ == DType::F32) return masters;
  const bool own = masters == data_.as<float>();
  float* out = own ? compute_.as<float>() : masters;
  if (own && compute_.bytes() < static_cast<size_t>(capacity_) * sizeof(float)) {
    gemm_constant_.reset();
    compute_ = Buffer(static_cast<size_t>(capacity_) * sizeof(float), MemCategory::Params);
    out = compute_.as<float>();
    compute_fresh_ = false;
  }
  if (!compute_fresh_) {
    if (own) std::memcpy(out, masters, static_cast<size_t>(capacity_) * sizeof(float));
    kernels::round_to(compute_dtype_, out, capacity_);
    if (compute_dtype_ == DType::BF16) gemm_constant_.set(out, capacity_);
    compute_fresh_ = true;
  }
  return out;
}

void ParamGroup::release_own_params() {
  gemm_constant_.reset();
  if (data_ptr_ == data_.as<float>()) data_ptr_ = nullptr;
  data_.reset();
}

void ParamGroup::release_own_grads() {
  if (grad_ptr_ == grad_.as<float>()) grad_ptr_ = nullptr;
  grad_.reset();
}

float* ParamGroup::checked_data() const {
  LATTICE_CHECK(data_ptr_ != nullptr, "parameters of group " << name_
                                                             << " are not resident here (ZeRO-3 gathers a group "
                                                                "before each use; the hooks did not run)");
  return data_ptr_;
}

float* ParamGroup::grad_storage() {
  LATTICE_CHECK(grad_ptr_ != nullptr, "gradients of group " << name_
                                                            << " have no buffer (ZeRO-2/3 attach one before the "
                                                               "backward writes them; the hooks did not run)");
  return grad_ptr_;
}

// Element `i` of parameter `info`'s slice (ShardSpec) as it starts.
static inline float initial_value(const ParamInfo& info, uint64_t seed, uint64_t name_hash, int64_t row_len,
                                  int64_t i) {
  const int64_t full = info.shard.full_index(info.full_shape, info.shape, i);
  if (info.real_rows >= 0 && full / row_len >= info.real_rows) return 0.0f;
  if (info.init.kind == InitSpec::Constant) return info.init.value;
  return init_normal_hashed(seed, name_hash, static_cast<uint64_t>(full)) * info.init.value;
}

static int64_t row_length(const ParamInfo& info) {
  int64_t row_len = 1;
  for (size_t d = 1; d < info.full_shape.size(); d++) row_len *= info.full_shape[d];
  return row_len;
}

void ParamGroup::initialize(uint64_t seed) {
  for (size_t p = 0; p < params_.size(); p++) {
    const ParamInfo& info = params_[p];
    float* out = param(p);
    const int64_t n = info.numel();
    const uint64_t h = hash_name(info.name);
    const int64_t row_len = row_length(info);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = initial_value(info, seed, h, row_len, i);
  }
}

void ParamGroup::initial_values(uint64_t seed, int64_t begin, int64_t n, float* out) const {
  std::fill(out, out + n, 0.0f);
  for (const ParamInfo& info : params_) {
    const int64_t lo = std::max(begin, info.offset), hi = std::min(begin + n, info.offset + info.numel());
    if (lo >= hi) continue;
    const uint64_t h = hash_name(info.name);
    const int64_t row_len = row_length(info);
#pragma omp parallel for schedule(static) if (hi - lo > 4096)
    for (int64_t i = lo; i < hi; i++) out[i - begin] = initial_value(info, seed, h, row_len, i - info.offset);
  }
}

const ParamInfo* ParamGroup::find(const std::string& name) const {
  for (const ParamInfo& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

void ParamGroup::zero_grad() { std::fill(grad_written_.begin(), grad_written_.end(), 0); }

void ParamGroup::zero_grad_padding() {
  float* g = grad_storage();
  int64_t at = 0;  // add() lays the parameters out in order, each after the last
  for (const ParamInfo& p : params_) {
    if (p.offset > at) std::memset(g + at, 0, static_cast<size_t>(p.offset - at) * sizeof(float));
    at = p.offset + p.numel();
  }
  if (capacity_ > at) std::memset(g + at, 0, static_cast<size_t>(capacity_ - at) * sizeof(float));
}

void ParamGroup::zero_unwritten_grads() {
  for (size_t i = 0; i < params_.size(); i++) {
    bool accumulate = false;
    if (!grad_written_[i]) std::memset(write_grad(i, &accumulate), 0, sizeof(float) * params_[i].numel());
  }
}

float* ParamGroup::write_grad(size_t i, bool* accumulate) {
  float* base = grad_storage();
  *accumulate = grad_written_[i] != 0;
  grad_written_[i] = 1;
  return base + params_[i].offset;
}

void ParamGroup::check_grad_written(size_t i) const {
  LATTICE_CHECK(grad_written_[i], "gradient of " << params_[i].name
                                                 << " read after zero_grad() and before any backward wrote it");
}

const float* ParamGroup::checked_grad() const {
  for (size_t i = 0; i < params_.size(); i++) check_grad_written(i);
  return const_cast<ParamGroup*>(this)->grad_storage();
}

}  // namespace lattice::model
