// GPT: a decoder-only transformer of either family (model/config.h), built
// from parts (model/parts/):
//
//   x₀      = embed[tokens] (+ wpe[positions], learned positions only)
//   r_l     = x_l + Attn(Norm₁(x_l))          (causal; rotary or no positions; grouped heads)
//   x_{l+1} = r_l + MLP(Norm₂(r_l))           (GELU or SwiGLU)
//   logits  = Norm_f(x_L) · Wᵀ ;  loss = mean CE(logits, targets)
//
// with W the token embedding (tied head) or lm_head. Each part — the norm,
// the attention, the MLP, the embedding and head (model/head.h) — has its
// math in its own file and the same contract: forward, backward-input,
// backward-weight, with its parameters and activations given explicitly;
// this class composes them and does what is the same for every part: the
// parameter groups and their hooks (data parallelism, ZeRO), the pipeline
// stage, tensor/sequence parallelism's row slices, and the activations of the
// micro-batches in flight (model/activations.h, 16-bit storage included).
// Forward and backward are written out by hand, llm.c style, over the
// kernels of lattice/kernels/ops.h.
//
// Activations live in per-micro-batch *slots*: forward(slot) stores what the
// backward of that micro-batch needs, so several micro-batches can be in
// flight (pipeline schedules). Backward is split in two: backward_input(slot)
// propagates dX through every layer and keeps the output gradients each
// weight gradient needs; backward_weight(slot) then does the dW GEMMs and
// reductions. backward(slot) does both layer by layer — the same arithmetic in
// the same order, with one layer's gradient buffers instead of all of them.
//
// Pipeline parallelism: a GPT built with StageLayers holds and runs only
// layers [first, last) — the first stage also the embedding, the last the
// final norm, the head and the loss. With a tied head both hold the
// embedding group (the lookup's and the head's shares of its gradient are
// summed between them, Megatron's embedding group); an untied head lives in
// the final group. A stage takes its input activation (not the first) and
// gives its output (not the last); in backward it takes the output's
// gradient and gives the input's.
//
// Tensor parallelism (layers/tensor/tensor_parallel.h): given a TP group,
// the model declares only its slice of each parameter (ShardSpecs: the qkv
// projection by heads, the MLP's first projection by output rows, both
// output projections by input columns, the embedding and head by vocabulary
// rows; norms, row-parallel biases and wpe replicated; key/value heads split
// or replicated, parts/attention.h) and every size it works with comes from
// those slices. With sequence parallelism the residual stream and the norms'
// inputs and outputs hold this rank's rows only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lattice/kernels/ops.h"
#include "lattice/model/config.h"
#include "lattice/model/head.h"
#include "lattice/model/param_group.h"
#include "lattice/model/parts/moe.h"
#include "lattice/model/parts/norm.h"
#include "lattice/model/recompute.h"

namespace lattice::tensor {
class TensorParallel;
}
namespace lattice::context {
class ContextParallel;
}
namespace lattice::expert {
class ExpertParallel;
}

namespace lattice::model {

struct Slot;         // one micro-batch's activations (activations.h)
struct CarveSizes;   // the sizes its buffers are carved with (activations.h)
struct LayerActs;    // one layer's stored activations (activations.h)
struct Work16;       // the f32 arrays of 16-bit activation storage (activations.h)
struct DecodeState;  // the key/value cache of decode() (decode.cpp)
namespace parts {
class Attention;
class Mlp;
}  // namespace parts

// What the model tells the parallel layers about its parameter groups as it
// runs, so that data parallelism and ZeRO act at the right moments without
// any of their code inside the model. Group indices are those of
// GPT::groups(). Every method may block (e.g. to wait for a gather).
//
// Order of the calls (emb = embedding group 0, h_l = block l + 1, ln_f = the
// final group, last; "(emb)" only with a tied head, whose weight is emb's):
//   forward   before_params(emb), then per block before_params(h_l)
//             after_params(h_l), before/after_params(ln_f), and after_params(emb)
//             once the head has used the tied wte (untied: after the lookup;
//             ln_f's after the head)
//   backward  before_params((emb), ln_f), after_params((emb), ln_f) around the
//             head's input gradient; before_grads((emb), ln_f), grads_done(ln_f)
//             around its weight gradients; per block from the last:
//             before/after_params(h_l), before_grads(h_l), grads_done(h_l);
//             grads_done(emb) after the embedding's scatter-add, last.
// backward_input / backward_weight split the backward: parameters are read
// in backward_input only, gradients are written in backward_weight.
class GroupHooks {
 public:
  enum class Pass { Forward, Backward };
  virtual ~GroupHooks() = default;
  // Group g's parameters are about to be read (ZeRO-3 gathers them).
  virtual void before_params(size_t g, Pass pass) { (void)g, (void)pass; }
  // Group g's parameters are not read again in this pass (ZeRO-3 releases them).
  virtual void after_params(size_t g, Pass pass) { (void)g, (void)pass; }
  // This micro-batch's backward is about to write group g's gradients for
  // the first time (ZeRO-2/3 make the buffer exist).
  virtual void before_grads(size_t g) { (void)g; }
  // Every gradient of group g from this micro-batch is written (data
  // parallelism starts reducing them).
  virtual void grads_done(size_t g) { (void)g; }
};

// Layers [first_layer, last_layer) of the model (last_layer -1: all), and
// of a mixture-of-experts model's experts the share this rank holds: expert
// parallelism over `expert_shards` ranks, this one `expert_shard`
// (layers/expert/expert_parallel.h: experts [shard·E/shards, (shard+1)·E/shards)).
struct StageLayers {
  int first_layer = 0;
  int last_layer = -1;
  int expert_shards = 1;
  int expert_shard = 0;
};

// The group of layer `layer`'s experts [first, first + count) as declared by
// a model (HF names, whole tensors); *per_expert gets the parameters of one.
// The checkpoint writer names another expert-parallel rank's experts with it.
ParamGroup declare_experts(const ModelConfig& config, int layer, int first, int count, size_t* per_expert = nullptr);
// The checkpoint name of MoE layer `layer`'s selection bias [E] (docs/moe.md).
std::string expert_bias_name(const ModelConfig& config, int layer);

class GPT {
 public:
  // Declares, allocates and initialises every parameter from (seed, name, index).
  // `tp`: the tensor-parallel group this rank belongs to (not owned), or null
  // for the whole model on one rank. Every constructor takes it.
  GPT(const ModelConfig& config, uint64_t seed, tensor::TensorParallel* tp = nullptr, StageLayers stage = {});
  // For a caller that loads every parameter from a file next: allocates the
  // parameters (zero) without drawing initial values, which takes seconds at
  // GPT-2 124M for nothing.
  struct NoInit {};
  GPT(const ModelConfig& config, NoInit, tensor::TensorParallel* tp = nullptr, StageLayers stage = {});
  // Declares every parameter without allocating anything: for data
  // parallelism, which allocates what each rank keeps (ZeRO) and initialises
  // it with ParamGroup::initial_values.
  struct Unallocated {};
  GPT(const ModelConfig& config, Unallocated, tensor::TensorParallel* tp = nullptr, StageLayers stage = {});
  ~GPT();
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const ModelConfig& config() const { return config_; }
  tensor::TensorParallel* tensor_parallel() const { return tp_; }
  // The pipeline stage this model runs (the whole model: layers 0..n_layer).
  int first_layer() const { return first_layer_; }
  int last_layer() const { return last_layer_; }
  bool first_stage() const { return first_layer_ == 0; }
  bool last_stage() const { return last_layer_ == config_.n_layer; }
  bool whole_model() const { return first_stage() && last_stage(); }
  // Ranks of the TP group (1 without one) and this rank's place in it.
  int tp_size() const;
  int tp_rank() const;
  // Rows of wte over all ranks (the padded vocabulary, tensor::padded_vocab)
  // and here (its slice: the width of the logits forward() computes).
  int wte_rows() const { return vocab_full_; }
  int local_vocab() const { return dims_.V; }
  // Groups in order: "embedding" (the token embedding and wpe; the first
  // stage, and the last when the head is tied), the stage's blocks (GPT-2
  // "h.{l}", Llama "model.layers.{l}"), the final group (last stage: the
  // final norm, and lm_head when untied; GPT-2 "ln_f", Llama "model.norm"),
  // then one group per MoE layer of the stage holding this rank's experts of
  // it ("h.{l}.mlp.experts", "model.layers.{l}.block_sparse_moe.experts"):
  // their gradients are reduced over the ranks holding the same experts,
  // not over every data-parallel rank (the trainer's second engine).
  std::vector<ParamGroup>& groups() { return groups_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  bool has_embedding() const { return first_stage() || (last_stage() && config_.tie_embeddings); }
  bool tied_head() const { return config_.tie_embeddings; }
  ParamGroup& embedding_group() { return groups_.front(); }
  ParamGroup& block_group(int layer) { return groups_[block_index(layer)]; }  // a layer of this stage
  ParamGroup& final_group() { return groups_[final_index()]; }
  // Mixture of experts: whether group g holds experts, the group of stage
  // layer l's experts (npos: a dense layer), and the order in which a pass
  // reads the groups (what ZeRO-3 prefetches by).
  bool is_expert_group(size_t g) const { return g > final_index_ && g < groups_.size(); }
  size_t expert_index(int layer) const;
  // The layer (of the whole model) whose block or experts group g holds; -1
  // for the embedding and the final group.
  int layer_of_group(size_t g) const;
  std::vector<size_t> group_order(GroupHooks::Pass pass) const;
  // Whether parameter `info` of group `group` counts in the global gradient
  // norm from this rank, so that the sum over the pipeline and tensor-parallel
  // groups counts every element once: the tied embedding on its first stage
  // only; under tensor parallelism a parameter whole on every TP rank
  // (LayerNorms, row-parallel biases, wpe) on TP rank 0 only, slices everywhere.
  bool counts_in_norm(size_t group, const ParamInfo& info) const;
  // Finds a parameter by name (HF GPT-2's or HF Llama's, by family): its group and index, or {nullptr, 0}.
  std::pair<ParamGroup*, size_t> find_param(const std::string& name);

  // Training forward of one micro-batch of B sequences of T tokens
  // (inputs/targets are [B·T] token ids). Stores activations in `slot`, and in
  // the same pass over the logits writes the gradient of
  //   loss_grad_scale · mean_loss
  // with respect to the logits, ready for backward. Returns the mean loss.
  // The whole model only; a pipeline stage runs forward_stage.
  float forward(int slot, const int32_t* inputs, const int32_t* targets, int B, int T, float loss_grad_scale);
  // One stage's forward: `inputs` (token ids) on the first stage, else
  // `input` (the previous stage's output activation, rows(B·T) × C floats:
  // this rank's rows under sequence parallelism); `targets` on the last
  // stage, which returns the mean loss (others return 0).
  float forward_stage(int slot, const int32_t* inputs, const float* input, const int32_t* targets, int B, int T,
                      float loss_grad_scale);
  // Not the last stage: the output activation of slot's forward (rows × C),
  // valid until the slot's backward; before the slot's backward, the
  // gradient of the loss with respect to it (not copied: `grad` must stay
  // as it is until the slot's backward or backward_input has read it).
  const float* stage_output(int slot);
  void set_stage_output_grad(int slot, const float* grad);
  // Not the first stage: after backward / backward_input, the gradient with
  // respect to the stage's input (rows × C), valid until the slot's next forward.
  const float* stage_input_grad(int slot);
  // Rows of a B·T micro-batch's activation this rank holds between stages
  // (B·T, or B·T / tp under sequence parallelism).
  int64_t stage_rows(int64_t N) const { return rows(N); }
  // dX through every layer (and dX of the embedding); records the dW work.
  void backward_input(int slot);
  // The recorded dW work: accumulates (+=) into the groups' gradients and
  // releases the slot for the next forward.
  void backward_weight(int slot);
  // backward_input + backward_weight, layer by layer.
  void backward(int slot);
  // Drops slot's forward without a backward (evaluation through pipeline stages).
  void release(int slot);

  // Mean loss without storing anything for backward (evaluation).
  float evaluate(const int32_t* inputs, const int32_t* targets, int B, int T);
  // Logits [B, Vp] of the last position of each of the B sequences (generation;
  // one process: `lattice generate` loads any layout's checkpoint whole).
  // The pointer is valid until the next call.
  const float* last_logits(const int32_t* inputs, int B, int T);

  // Generation with a key/value cache, one sequence at a time. decode_reset()
  // starts a new sequence; decode(tokens, n) runs the next n tokens (positions
  // [decode_position(), decode_position() + n), at most seq_len in all)
  // through the model, appends their keys and values to the cache and
  // returns the logits [Vp] of the last of them, valid until the next call.
  // These are last_logits() of the whole sequence up to float reassociation,
  // at O(n) cost per call instead of O(sequence length).
  void decode_reset();
  const float* decode(const int32_t* tokens, int n);
  int decode_position() const;
  // Logits [Vp] of the token that follows context[0, n), as the model sees it:
  // the most recent min(n, seq_len) tokens. Calls on a growing context reuse
  // the cache (one new position per token); when the window slides, or the
  // context is not an extension of the cached tokens, the window is recomputed.
  const float* next_logits(const int32_t* context, int64_t n);

  // Context parallelism (layers/context): every micro-batch's B·T rows are
  // then this rank's chunks of B sequences of T·cp tokens, at their global
  // positions, and the attention runs over the whole sequences with the
  // other ranks of `cp` (not owned; null: none). Set before the first
  // forward. The loss is this rank's tokens' mean: the data-parallel engine
  // averages over dp×cp.
  void set_context_parallel(context::ContextParallel* cp);
  context::ContextParallel* context_parallel() const { return cp_; }

  // Installs (or, with nullptr, removes) the hooks; not owned.
  void set_hooks(GroupHooks* hooks) { hooks_ = hooks; }
  // Replaces (nullptr: restores) the model's own embedding operations; not owned.
  void set_tied_embedding(TiedEmbedding* embedding);
  GroupHooks* hooks() const { return hooks_; }
  size_t embedding_index() const { return 0; }
  size_t block_index(int layer) const {
    return (has_embedding() ? 1 : 0) + static_cast<size_t>(layer - first_layer_);
  }
  size_t final_index() const { return final_index_; }

  // ---- mixture of experts (docs/moe.md) ----
  // The ep group the experts are dispatched over (not owned; null: every
  // expert here, ep = 1). Its size and rank must be the StageLayers' expert
  // shards. Set before the first forward.
  void set_expert_parallel(expert::ExpertParallel* ep);
  void set_moe_options(const parts::MoeOptions& options) { moe_options_ = options; }
  // Forwards that are not training's (pipeline evaluation through
  // forward_stage) are not counted in moe_stats() while this is on.
  void set_evaluation(bool on) { evaluation_ = on; }
  const parts::MoeOptions& moe_options() const { return moe_options_; }
  // The selection bias of every layer of the whole model, [n_layer][E] (this
  // stage reads its own layers'); the trainer updates it after each step.
  std::vector<float>& expert_bias() { return expert_bias_; }
  // What the training forwards of this stage's MoE layers counted since
  // reset_moe_stats() (indexed by stage layer; dense layers' stay empty).
  const std::vector<parts::MoeStats>& moe_stats() const { return moe_stats_; }
  void reset_moe_stats();
  // The routing map's counts of micro-batch slot `slot`'s last forward through
  // stage layer `stage_layer` (an MoE layer): [ep][E] pairs each ep rank sent
  // to each expert (tests check the all-to-all bytes against them).
  const std::vector<int64_t>& routing_counts(int slot, int stage_layer) const;


  // Marks every gradient stale (no memset): the next backward overwrites each
  // gradient on its first write and accumulates after (see ParamGroup::zero_grad).
  void zero_grad();

  // Mixed precision (precision.compute; docs/precision.md). At bf16 or f16
  // the model computes with its parameters rounded to that dtype (each
  // group's compute copy; the f32 values stay the master weights) and keeps
  // every activation it stores for the backward in 16 bits: each is rounded
  // where it is produced and stored at 2 bytes a value, the LayerNorm and
  // softmax statistics and the loss in f32. A layer computes in f32 work
  // arrays (one layer's worth, shared by the slots), the GEMMs and every
  // reduction accumulate in f32, and gradients (of parameters and of
  // activations) are f32. Set before the first forward (slots are carved
  // again); generation (last_logits, decode) runs at f32 only.
  void set_compute_dtype(DType t);
  DType compute_dtype() const { return compute_; }
  // The master weights changed (optimizer step, load): every group makes its
  // compute copy again on its next use. No-op at f32.
  void params_changed();
  // Activation recomputation (model/recompute.h, docs/recompute.md): entry
  // i for this stage's layer first_layer() + i (local_layers() entries;
  // empty: none anywhere). What a recomputed layer does not store is computed
  // in the one-layer work arrays, in its forward and again in its backward,
  // with the forward's kernels in the forward's order: losses and gradients
  // are bit-identical to none. A fully recomputed layer's forward runs again
  // inside the backward's before_params(group, Backward) .. after_params
  // (ZeRO-3's gather of the block), its tensor-parallel collectives included.
  // Set before the first forward (slots are carved again).
  void set_recompute(std::vector<Recompute> per_layer);
  Recompute recompute_of(int stage_layer) const {
    return recompute_.empty() ? Recompute::None : recompute_[static_cast<size_t>(stage_layer)];
  }
  // Bytes of the one-layer f32 work arrays for a B×T micro-batch: the 16-bit
  // path's, or at f32 those of recomputation (0 at f32 without it).
  size_t work16_bytes(int B, int T) const;
  // Rows of logits a local head (no tensor parallelism, the model's own
  // embedding) computes at a time at 16-bit storage, in the work arrays (head.cpp).
  static constexpr int64_t kHeadRows = 128;
  int64_t num_params() const { return config_.num_params(); }
  // Bytes of activation memory one micro-batch slot of B×T tokens takes.
  size_t slot_bytes(int B, int T) const;
  // Of which what the forward keeps for the backward (tensor/sequence
  // parallelism's activation-memory formulas count this).
  size_t stored_activation_bytes(int B, int T) const;

  // This rank's sizes: the slices of tensor parallelism (the whole model
  // without it). C is never cut; the residual stream keeps `rows(N)` rows.
  struct Dims {
    int C = 0;    // n_embd
    int NH = 0;   // query heads here
    int NKV = 0;  // key/value heads here
    int hs = 0;   // head size
    int kv_replicas = 1;  // ranks that hold each key/value head here (parts/attention.h)
    int A = 0;    // attention width here, NH·hs (C/t)
    int QKV = 0;  // the qkv projection's width here, (NH + 2·NKV)·hs
    int F = 0;    // MLP hidden width here (ffn/t)
    int FU = 0;   // the MLP's first projection's width here (F; SwiGLU 2F)
    int V = 0;    // vocabulary rows of the embedding and head here (padded vocabulary / t)
  };
  const Dims& dims() const { return dims_; }

 private:
  struct Build {};
  GPT(Build, const ModelConfig& config, const uint64_t* seed, bool allocate, tensor::TensorParallel* tp,
      StageLayers stage);  // seed null: no init
  // Where each part's parameters sit in a block group, the embedding group and
  // the final group (the same for every block; declare.cpp).
  struct Layout {
    size_t norm1 = 0, norm2 = 0;  // weight (LayerNorm: bias next)
    size_t qkv_w = 0, qkv_n = 1;  // the attention's projection, packed (parts/linear.h)
    int qkv_b = -1;
    size_t out_w = 0;
    int out_b = -1;
    size_t up_w = 0, up_n = 1;  // the MLP's first projection (SwiGLU: gate | up)
    int up_b = -1;
    size_t down_w = 0;
    int down_b = -1;
    size_t wte = 0;
    int wpe = -1;  // learned positions only
    size_t norm_f = 0;
    int lm_head = -1;  // in the final group, untied only
  };
  // Declares every parameter group of this stage (declare.cpp).
  void declare_params();
  void declare_moe_block(ParamGroup& g, int layer, const std::string& prefix);
  int local_layers() const { return last_layer_ - first_layer_; }
  // Under TP: rows kept between the parallel regions, and the first of them.
  int64_t rows(int64_t N) const;
  int64_t first_row(int64_t N) const;
  // Where an MoE block's own parameters sit in its group (after norm₂): the
  // router, then the shared experts (declare.cpp).
  struct MoeLayout {
    size_t router = 0;
    size_t sh_up_w = 0, sh_up_n = 1, sh_down_w = 0;
    int sh_up_b = -1, sh_down_b = -1;
    size_t per_expert = 0;  // parameters of one expert in its group
  };
  // The block's parts over block group g (this rank's slices).
  parts::Attention attention(ParamGroup& g);
  parts::Mlp mlp(ParamGroup& g);
  parts::Moe moe(int layer);
  bool moe_layer(int layer) const { return config_.is_moe_layer(layer); }
  parts::MoeActs& moe_acts(Slot& s, int stage_layer);
  // The head: the tied embedding's, or the untied lm_head of the final group.
  HeadOps& head();
  size_t head_index() const { return tied_head() ? embedding_index() : final_index(); }
  // Cross-entropy of N rows of logits into losses (dlogits in place with `backward`).
  void loss(float* logits, float* losses, const int32_t* targets, int64_t N, bool backward, float dloss);
  void head_and_loss(Slot& s, const int32_t* targets, bool backward, float dloss);
  void for_dlogits(Slot& s, const std::function<void(const float*, int64_t, int64_t)>& fn);
  void check_one_process(const char* what) const;
  void check_f32(const char* what) const;
  CarveSizes sizes_for(int64_t N) const;
  int64_t head_rows(int64_t N) const;
  bool local_head() const;  // the head's operations do not communicate (see kHeadRows)
  size_t token_arrays() const;
  // 16-bit storage: the f32 views of a slot's activations (see gpt.cpp).
  float* x_buf(Slot& s, int i);
  void keep_x(Slot& s, int i);
  const LayerActs& work_layer(Slot& s, int l, const LayerActs* kept = nullptr);
  void recompute_layer(Slot& s, int l, const LayerActs& a);
  // Stage layer i's training forward on slot s from x into x_next, in a.
  void layer_forward(Slot& s, int i, const LayerActs& a, const float* x, float* x_next, bool recompute = false);
  void block_params_in(int layer);
  void block_params_out(int layer);
  void block_grads_in(int layer);
  void block_grads_out(int layer);
  Work16& work16_for(const Slot& s);
  const LayerActs& layer_acts(Slot& s, int l);
  const float* x_of(Slot& s, int i);
  const float* lnf_of(Slot& s);
  CarveSizes grad_sizes(const Slot& s, bool capacity = false) const;
  Slot& slot(int index, int B, int T);
  // Slot 0 when no micro-batch is in flight there, else a separate one.
  Slot& inference_slot(int B, int T);
  // One block on N rows from x into x_next (which may be x), keeping its
  // intermediates in a; `attend` fills a.atty from a.qkv (gpt.cpp).
  // An MoE layer's MLP keeps its state in `moe` (null: a dense layer, or a
  // recomputation, which skips it: the routed experts' arrays are kept).
  void block_forward(int layer, const LayerActs& a, const float* x, float* x_next, int B, int T,
                     int first_position, float* work, DType q, const std::function<void()>& attend,
                     parts::MoeActs* moe = nullptr, bool record = false, bool recompute = false);
  // The forward through the blocks and the final norm into s.
  void forward_body(Slot& s, const int32_t* inputs, const float* input);
  void final_norm(Slot& s);
  void layer_backward_input(Slot& s, int l);
  void layer_backward_weight(Slot& s, int l);
  void head_backward_input(Slot& s, bool with_head_weight = false);
  void head_backward_weight(Slot& s, bool head_weight_done = false);
  void head_recomputed_with_hooks(Slot& s);
  void head_input_with_hooks(Slot& s);
  void head_weight_with_hooks(Slot& s);
  void embedding_weight_with_hooks(Slot& s);
  // The GroupHooks calls (no-ops without hooks).
  void params_in(size_t g, GroupHooks::Pass pass);
  void params_out(size_t g, GroupHooks::Pass pass);
  void grads_in(size_t g);
  void grads_out(size_t g);
  void embedding_backward_weight(Slot& s);

  ModelConfig config_;
  tensor::TensorParallel* tp_ = nullptr;
  context::ContextParallel* cp_ = nullptr;
  std::vector<int32_t> positions_;  // of the rows of a T-row sequence here (positions_for)
  const int32_t* positions_for(int T);
  int first_layer_ = 0, last_layer_ = 0;
  Dims dims_;
  Layout layout_;
  MoeLayout moe_layout_;
  size_t final_index_ = 0;
  std::vector<size_t> expert_group_;  // per stage layer: its expert group (npos: dense)
  std::vector<uint8_t> moe_flags_;    // per stage layer: 1 for an MoE layer (CarveSizes::moe)
  int expert_shards_ = 1, expert_shard_ = 0;
  expert::ExpertParallel* ep_ = nullptr;
  std::unique_ptr<expert::ExpertParallel> own_ep_;  // ep = 1
  parts::MoeOptions moe_options_;
  std::vector<float> expert_bias_;
  std::vector<parts::MoeStats> moe_stats_;
  std::unique_ptr<parts::MoeWork> moe_work_;
  float moe_scale_ = 1.0f;  // the running forward's loss gradient factor
  bool moe_record_ = false;  // the running forward is a training forward
  bool evaluation_ = false;
  parts::Norm norm_;
  kernels::RopeTable rope_;  // rotary positions only
  int vocab_full_ = 0;
  int64_t vocab_first_ = 0;  // first vocabulary id of this rank's embedding rows
  int vocab_real_ = 0;       // of which real (ids < vocab_size)
  std::vector<ParamGroup> groups_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<Slot> eval_slot_;
  std::unique_ptr<DecodeState> decode_;
  DType compute_ = DType::F32;
  std::vector<Recompute> recompute_;  // per stage layer; empty: none
  std::unique_ptr<Work16> work16_;
  GroupHooks* hooks_ = nullptr;
  std::unique_ptr<TiedEmbedding> own_embedding_;
  TiedEmbedding* custom_embedding_ = nullptr;
  std::unique_ptr<LocalHead> untied_head_;
  std::vector<float> kv_scratch_;  // replicated key/value heads' gradient sums (parts/attention.h)
  TiedEmbedding& tied() { return custom_embedding_ ? *custom_embedding_ : *own_embedding_; }
};

}  // namespace lattice::model
