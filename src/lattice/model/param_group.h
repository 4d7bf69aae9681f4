// Parameters live in ParamGroups: one flat buffer (and one flat gradient
// buffer) per transformer block, one for the embeddings, one for the final
// LayerNorm. A group is the unit of data-parallel bucketing and of ZeRO-3
// gather/release, and it carries, for every parameter, the Hugging Face GPT-2
// name, the logical (full) shape and the ShardSpec saying which slice of the
// full tensor this rank holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lattice/core/dtype.h"
#include "lattice/core/memory.h"
#include "lattice/kernels/ops.h"

namespace lattice::model {

// Which slice of the full logical tensor a rank holds. split_dim = -1: the
// whole tensor (replicated). Otherwise the full tensor is cut along split_dim
// into num_shards equal pieces and this rank holds piece shard_index. With
// parts > 1 (fused QKV: parts = 3) the split dimension is first viewed as
// `parts` equal blocks (Q, K, V), and each block is cut separately, so a rank
// holds the same heads of Q, K and V. With replicas > 1 each piece is held
// whole by `replicas` consecutive ranks of the group (rank r holds piece
// r / replicas): key/value heads when the tensor-parallel group is larger
// than their number (model/parts/attention.h).
struct ShardSpec {
  int split_dim = -1;
  int num_shards = 1;
  int shard_index = 0;
  int parts = 1;
  int replicas = 1;

  // Local shape for a full shape.
  std::vector<int64_t> local_shape(const std::vector<int64_t>& full) const;
  // Row-major index in the full tensor of the element at row-major index
  // `local_index` of this rank's slice.
  // `local` must be local_shape(full) (passed in so hot loops compute it once).
  int64_t full_index(const std::vector<int64_t>& full, const std::vector<int64_t>& local, int64_t local_index) const;
};

// How a parameter starts: N(0, std²) for weights, or a constant.
struct InitSpec {
  enum Kind { Normal, Constant } kind = Normal;
  float value = 0.0f;  // std for Normal, the value for Constant
};

struct ParamInfo {
  std::string name;                 // HF name, e.g. "h.3.attn.c_attn.weight" (GPT-2), "model.norm.weight" (Llama)
  std::vector<int64_t> full_shape;  // logical shape in lattice's layout (Linear: [out, in])
  std::vector<int64_t> shape;       // the slice held here
  ShardSpec shard;
  InitSpec init;
  bool weight_decay = false;  // AdamW decays 2-D weights only
  // Rows of the full tensor that are real; rows past it are padding kept at
  // zero (the vocabulary padding of wte). -1: all rows are real.
  int64_t real_rows = -1;
  // Hugging Face stores this Linear weight as Conv1D, [in, out] — the
  // transpose of lattice's [out, in]; checkpoints convert.
  bool hf_conv1d = false;
  // Starts right after the previous parameter, with no alignment gap, so the
  // two are one matrix in memory (a packed Linear: model/parts/linear.h).
  bool packed = false;
  int64_t offset = 0;  // in elements, within the group's flat buffers
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Between a parameter's slice (its ShardSpec's) and its full logical tensor,
// both in lattice's layout: rank r's slice is the spec with shard_index r.
// slices[r] points at rank r's slice of p (numel() floats each); with
// replicas > 1, slices holds every rank's (num_shards · replicas) and the
// first rank of each piece's replicas is read.
void assemble_full(const ParamInfo& p, const std::vector<const float*>& slices, float* full);
// This rank's slice of p from the full tensor (full_shape, row-major).
void extract_slice(const ParamInfo& p, const float* full, float* slice);

class ParamGroup {
 public:
  ParamGroup() = default;
  explicit ParamGroup(std::string name) : name_(std::move(name)) {}

  // Declares a parameter; call allocate() after the last one.
  void add(ParamInfo info);
  // Allocates the flat parameter and/or gradient buffers (zeroed), of
  // max(numel(), capacity) elements: data parallelism pads a group to whole
  // buckets (the tail past numel() stays zero). ZeRO allocates only what a
  // rank keeps whole (nothing at stage 3).
  void allocate(int64_t capacity = 0, bool params = true, bool grads = true);
  // Fills every parameter from its InitSpec: element i of the full tensor of
  // parameter `name` gets init_normal(seed, name, i)·std, whatever slice this
  // rank holds, so every layout starts from the same weights.
  void initialize(uint64_t seed);
  // The same initial values for elements [begin, begin + n) of the flat
  // buffer, into out[0, n) (padding between parameters and past numel() is
  // 0): how ZeRO-3 initialises a shard without the whole group ever existing.
  void initial_values(uint64_t seed, int64_t begin, int64_t n, float* out) const;

  const std::string& name() const { return name_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo* find(const std::string& name) const;
  int64_t numel() const { return numel_; }
  int64_t capacity() const { return capacity_; }
  // Grows the buffers to `capacity` elements, keeping their contents.
  void set_capacity(int64_t capacity);

  // Where the parameters and gradients live. Normally in the group's own
  // buffers; ZeRO-3 frees those (each rank keeps a shard elsewhere) and
  // attaches gathered memory only while a pass needs it, and ZeRO-2 does the
  // same for gradients. attach_*(nullptr) detaches; attached memory must hold
  // capacity() floats and is not owned.
  void release_own_params();
  void release_own_grads();
  void attach_params(float* memory) {
    data_ptr_ = memory;
    compute_fresh_ = false;
    gemm_constant_.reset();
  }
  void attach_grads(float* memory) { grad_ptr_ = memory; }
  bool has_params() const { return data_ptr_ != nullptr; }
  bool has_grads() const { return grad_ptr_ != nullptr; }

  float* data() { return checked_data(); }
  const float* data() const { return checked_data(); }
  // Gradients, for reading once a backward has written them (checked: reading
  // a parameter's gradient after zero_grad() and before any write is an error).
  float* grad() { return const_cast<float*>(checked_grad()); }
  const float* grad() const { return checked_grad(); }
  float* param(size_t i) { return data() + params_[i].offset; }
  float* param_grad(size_t i) {
    check_grad_written(i);
    return grad_storage() + params_[i].offset;
  }
  // The gradient buffer whatever its contents (for reductions; checked to exist).
  float* grad_storage();

  // Mixed precision (precision.compute). The model computes with
  // compute_param(i): at f32 the parameter itself; at bf16/f16 its value
  // rounded to that dtype (kernels::round_to), while data() keeps the f32
  // master weights that the optimizer updates, ZeRO shards and checkpoints
  // save. The rounded copy is made on the first read after the masters
  // change: params_changed() (the optimizer's step, a load) says they did.
  // Own parameters get a copy of their own (capacity() floats; f32 storage
  // holding 16-bit values, as this CPU's kernels read f32); attached memory
  // is a gathered copy of masters kept elsewhere (ZeRO-3) and is rounded in
  // place, once per attach_params(). At bf16 the copy is also registered as
  // a constant GEMM operand (kernels::GemmConstant): the bf16 GEMMs convert
  // it once per refresh, not on every product.
  void set_compute_dtype(DType t);
  DType compute_dtype() const { return compute_dtype_; }
  void params_changed() { compute_fresh_ = false; }
  float* compute_data();
  float* compute_param(size_t i) { return compute_data() + params_[i].offset; }

  // zero_grad() does not touch memory: it marks every gradient stale. The
  // first backward kernel to produce parameter i's gradient after it calls
  // write_grad(i), which returns the pointer and whether to accumulate
  // (false: overwrite, e.g. GEMM beta = 0, so the buffer is neither cleared
  // nor read); later micro-batches accumulate. This saves a pass over every
  // gradient per step (a memset of 0.5 GB at GPT-2 124M).
  void zero_grad();
  // Zeroes the gradient buffer outside the parameters (the gaps between them
  // and the tail up to capacity()). A reduction that rewrites the whole
  // buffer — a compressed one decodes every position, onebit as ±scale —
  // must find zeros there again, or what it left would be fed back in.
  void zero_grad_padding();
  // Makes every parameter's gradient exist: one not written since
  // zero_grad() (a stage's unused share, e.g. wpe on a last pipeline stage)
  // becomes zeros, written — what a reduction of the whole buffer needs.
  void zero_unwritten_grads();
  float* write_grad(size_t i, bool* accumulate);
  // True if parameter i's gradient has been written since zero_grad().
  bool grad_written(size_t i) const { return grad_written_[i] != 0; }

 private:
  const float* checked_grad() const;
  float* checked_data() const;
  void check_grad_written(size_t i) const;

  std::string name_;
  std::vector<ParamInfo> params_;
  std::vector<uint8_t> grad_written_;  // per parameter, see zero_grad()
  int64_t numel_ = 0, capacity_ = 0;
  Buffer data_;
  Buffer grad_;
  float* data_ptr_ = nullptr;  // data_ or attached memory
  DType compute_dtype_ = DType::F32;
  Buffer compute_;             // own parameters rounded to compute_dtype_
  bool compute_fresh_ = false;
  // bf16: the compute copy as a constant operand of bf16 GEMMs (kernels::Bf16GemmScope),
  // converted once per refresh. Declared after the buffers it names: it ends first.
  kernels::GemmConstant gemm_constant_;
  float* grad_ptr_ = nullptr;  // grad_ or attached memory
};

}  // namespace lattice::model
