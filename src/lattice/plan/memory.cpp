#include "lattice/plan/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/core/error.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/model/gpt.h"
#include "lattice/parallel/data/data_parallel.h"
#include "lattice/parallel/pipeline/simulator.h"
#include "lattice/parallel/zero/shard_layout.h"

namespace lattice::plan {

using model::LayerField;
using model::Recompute;

namespace {

constexpr size_t kCategories = static_cast<size_t>(MemCategory::kCount);

// Every Buffer and every carved array is a multiple of 64 bytes
// (core/memory.h, model/activations.h's Carver).
int64_t a64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// A term's text: `format` with up to three numbers.
std::string fmt(const char* format, double a = 0, double b = 0, double c = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a, b, c);
  return buf;
}

// This rank's widths under tensor parallelism over t (model::GPT::Dims,
// model/declare.cpp): query heads split, key/value heads split or (fewer
// than t) each whole on t/KV ranks, the MLP's columns split, the vocabulary
// padded to 128·t rows and split.
struct Dims {
  int64_t C, NH, NKV, hs, A, QKV, F, FU, V;
};

Dims dims_of(const model::ModelConfig& m, int t) {
  Dims d{};
  const int64_t KV = m.kv_heads();
  d.C = m.n_embd;
  d.hs = m.head_size();
  d.NH = m.n_head / t;
  d.NKV = KV >= t ? KV / t : 1;
  d.A = d.NH * d.hs;
  d.QKV = (d.NH + 2 * d.NKV) * d.hs;
  d.F = m.ffn() / t;
  d.FU = m.mlp == model::MlpKind::SwiGLU ? 2 * d.F : d.F;
  d.V = tensor::padded_vocab(m.vocab_size, t) / t;
  return d;
}

// A group's flat buffer as ParamGroup::add lays it out: each parameter
// starts on 16 floats, except one packed onto the previous (one matrix).
struct Padded {
  int64_t numel = 0, last_offset = 0, last_numel = 0;
  void add(int64_t n, bool packed = false) {
    const int64_t offset = packed ? last_offset + last_numel : numel;
    last_offset = offset, last_numel = n;
    numel = (offset + n + 15) / 16 * 16;
  }
};

void add_norm(Padded& g, const model::ModelConfig& m) {
  g.add(m.n_embd);
  if (m.norm == model::NormKind::LayerNorm) g.add(m.n_embd);  // LayerNorm's bias
}

// Norm₁, attention, norm₂ of a block (model/declare.cpp).
void add_attention(Padded& g, const model::ModelConfig& m, const Dims& d) {
  const int64_t C = d.C;
  add_norm(g, m);
  if (m.family == model::Family::GPT2) {
    g.add(d.QKV * C);  // c_attn, its Q, K and V rows each cut by heads
    if (m.bias) g.add(d.QKV);
  } else {
    g.add(d.A * C);  // q_proj; k_proj and v_proj packed after it
    g.add(d.NKV * d.hs * C, true);
    g.add(d.NKV * d.hs * C, true);
    if (m.bias) {
      g.add(d.A);
      g.add(d.NKV * d.hs, true);
      g.add(d.NKV * d.hs, true);
    }
  }
  g.add(C * d.A);  // the output projection, row-parallel
  if (m.bias) g.add(C);
  add_norm(g, m);
}

// An MLP of hidden width F (this rank's), as declared: SwiGLU's gate and up packed.
void add_mlp(Padded& g, const model::ModelConfig& m, int64_t F, bool gate_packs_up = true) {
  const int64_t C = m.n_embd;
  const bool swiglu = m.mlp == model::MlpKind::SwiGLU;
  if (swiglu) g.add(F * C);
  g.add(F * C, swiglu && gate_packs_up);
  if (m.bias) {
    if (swiglu) g.add(F);
    g.add(F, swiglu);
  }
  g.add(C * F);
  if (m.bias) g.add(C);
}

// The carve sizes of one chunk's micro-batch (model::CarveSizes).
struct Carve {
  int64_t C, NH, A, QKV, FU, F, V, N, R, HO;
  int64_t L, L_moe;  // the chunk's layers, of which MoE layers (their MLP arrays are the experts')
  bool sp, head;
  int64_t e;         // bytes of a stored value: 4, or 2 at bf16/f16
  bool keep_logits;  // 16-bit: dlogits stored (not a local head)
  Recompute r;
};

int64_t field_elems(const Carve& z, LayerField f) {
  switch (f) {
    case LayerField::Ln1:
    case LayerField::Res1:
    case LayerField::Ln2:
      return z.R * z.C;
    case LayerField::Qkv:
      return z.N * z.QKV;
    case LayerField::Atty:
      return z.N * z.A;
    case LayerField::Fch:
      return z.N * z.FU;
    case LayerField::Hid:
      return z.N * z.F;
    case LayerField::HeadsOut:
      return z.N * z.HO;
    default:
      return 0;
  }
}
constexpr LayerField kArrays[] = {LayerField::Ln1, LayerField::Qkv, LayerField::Atty, LayerField::Res1,
                                  LayerField::Ln2, LayerField::Fch, LayerField::Hid,  LayerField::HeadsOut};
bool mlp_field(LayerField f) { return f == LayerField::Fch || f == LayerField::Hid; }

// The statistics of a layer `keep(f)` names (f32): LayerNorm/RMSNorm mean and
// rstd of each norm (both carved for either norm), the log-sum-exp.
template <typename Keep>
int64_t stats_bytes(const Carve& z, Keep keep) {
  int64_t b = 0;
  if (keep(LayerField::Ln1Stats)) b += 2 * a64(4 * z.R);
  if (keep(LayerField::Lse)) b += a64(4 * z.N * z.NH);
  if (keep(LayerField::Ln2Stats)) b += 2 * a64(4 * z.R);
  return b;
}

// One layer's stored arrays and statistics (carve_slot in model/activations.cpp):
// what recompute mode r stores (model/recompute.h), in e bytes a value.
int64_t layer_bytes(const Carve& z, bool moe) {
  int64_t b = 0;
  for (LayerField f : kArrays)
    if (model::stores(z.r, f) && !(moe && mlp_field(f))) b += a64(z.e * field_elems(z, f));
  return b + stats_bytes(z, [&](LayerField f) { return model::stores(z.r, f); });
}

// A slot's activations (carve_activations): the residual stream x_0..x_L,
// every layer's stored set, and on the last stage the final norm, its
// statistics, the logits (f32; 16-bit: dlogits only when the head is not
// local) and the losses; SP's gathered work buffer; at 16 bits a non-last
// stage's f32 output.
int64_t slot_activation_bytes(const Carve& z) {
  int64_t b = (z.L + 1) * a64(z.e * z.R * z.C);
  b += (z.L - z.L_moe) * layer_bytes(z, false) + z.L_moe * layer_bytes(z, true);
  if (z.head) {
    b += a64(z.e * z.N * z.C) + 2 * a64(4 * z.R);
    if (z.e == 4 || z.keep_logits) b += a64(z.e * z.N * z.V);
    b += a64(4 * z.N);
  }
  if (z.sp) b += a64(4 * z.N * z.C);
  if (z.e != 4 && !z.head) b += a64(4 * z.R * z.C);
  return b;
}

// A slot's gradient buffers (carve_grads, f32): the fused backward reuses one
// layer's and two dx; the split one (I then W, zero-bubble schedules) keeps
// every layer's from I to W, and of a recomputed layer what W reads again.
int64_t slot_grad_bytes(const Carve& z, bool split) {
  const int64_t NC = a64(4 * z.N * z.C);
  const int64_t dense_layers = z.L - z.L_moe;
  auto layer = [&](bool with_fch) { return (with_fch ? a64(4 * z.N * z.FU) : 0) + 3 * NC + a64(4 * z.N * z.QKV); };
  int64_t b = (split ? z.L + 1 : 2) * NC;
  if (split)
    b += dense_layers * layer(true) + z.L_moe * layer(false);
  else
    b += layer(dense_layers > 0);
  if (z.head) b += NC;                           // dlnf
  b += a64(4 * z.N * z.F) + a64(4 * z.N * z.A);  // scratch4c, scratch_c
  if (z.sp) b += a64(4 * 2 * z.C);               // ln_scratch
  if (split && z.r != Recompute::None) {
    auto kept = [&](bool moe) {
      int64_t k = 0;
      for (LayerField f : kArrays)
        if (model::kept_for_weight(z.r, f) && !(moe && mlp_field(f))) k += a64(4 * field_elems(z, f));
      return k + stats_bytes(z, [&](LayerField f) { return model::kept_for_weight(z.r, f); });
    };
    b += dense_layers * kept(false) + z.L_moe * kept(true);
  }
  return b;
}

// One layer's f32 work arrays (carve_work16), one per chunk: at 16 bits every
// array (a layer computes in f32 and stores rounded), at f32 those the
// recompute mode does not store; the residual stream in and out; at 16 bits
// on the last stage the final norm and head_rows rows of logits.
int64_t work_bytes(const Carve& z, int64_t head_rows) {
  const bool b16 = z.e != 4, full = z.r == Recompute::Full;
  if (!b16 && z.r == Recompute::None) return 0;
  auto dropped = [&](LayerField f) { return z.L > 0 && !model::stores(z.r, f); };
  int64_t b = 0;
  for (LayerField f : kArrays)
    if (b16 || dropped(f)) b += a64(4 * field_elems(z, f));
  b += stats_bytes(z, dropped);
  if (b16) b += a64(4 * z.R * z.C);
  if (b16 || full) b += a64(4 * z.R * z.C);
  if (z.head && b16) b += a64(4 * z.N * z.C) + a64(4 * head_rows * z.V) + a64(4 * head_rows);
  return b;
}

// A data-parallel engine's view of one group of a chunk.
// (`count` consecutive groups of the same size: a chunk's blocks.)
struct GroupUse {
  int64_t numel;
  bool embedding;
  bool gemm_weights;  // a GEMM reads its weights (bf16: oneDNN keeps a bf16 copy)
  int count = 1;
};

struct Accumulator {
  std::array<double, kCategories> bytes{};
  std::vector<MemoryTerm>* terms = nullptr;
  // `describe` makes the term's text, only when terms are kept (the search
  // predicts memory for hundreds of thousands of layouts a second).
  template <typename Describe>
  void add(MemCategory c, double b, Describe describe) {
    if (b == 0) return;
    bytes[static_cast<size_t>(c)] += b;
    if (terms) terms->push_back({c, describe(), b});
  }
};

// Ring reduce-scatter scratch of one communicator (mpi_communicator.h,
// kRingReduceScatterBytes): two blocks of the largest f32 reduce-scatter of
// at least 256 KiB so far, reallocated when a larger one comes — the old
// pair still alive while the new one is made, the transient.
struct RingScratch {
  double pair = 0;      // bytes held now
  double replaced = 0;  // the largest pair a larger one replaced
  // A reduce-scatter in which each rank receives `recv_bytes`, in the order they run.
  void reduce_scatter(double recv_bytes, int ranks) {
    if (ranks <= 1 || recv_bytes < static_cast<double>(comm::kRingReduceScatterBytes)) return;
    if (2 * recv_bytes > pair) {
      replaced = std::max(replaced, pair);
      pair = 2 * recv_bytes;
    }
  }
};

// What one data-parallel engine (DataParallel over `ranks` ranks at ZeRO
// stage z) keeps of its groups on this rank, as data_parallel.cpp's
// constructor allocates it. parts[j] are chunk j's groups this engine owns;
// `embedding_engine[j]`: whether it builds the sharded embedding on chunk j
// (sharded_embedding.h: stages 2-3 wherever the chunk holds the embedding,
// stages 0-1 for a whole model with a tied head over more than one rank).
struct EngineChunk {
  std::vector<GroupUse> groups;  // in declaration order: embedding, blocks (and experts), final
  bool sharded_embedding = false;
  // The embedding's reduction comes first in the backward (the head's share
  // of a tied embedding, reduced early: stages 2-3, or a whole model); else
  // it comes last (after the lookup's scatter-add, or after the tied sum).
  bool embedding_first = false;
};

void engine_memory(const std::vector<EngineChunk>& chunks, int ranks, int64_t C, const Layout& l,
                   const MemoryOptions& o, const std::string& engine, Accumulator& acc, RingScratch& ring,
                   double* transient) {
  const int z = l.zero_stage;
  const double bucket = l.bucket_mb * 1024.0 * 1024.0;
  const bool b16 = l.compute != DType::F32;
  const double copy_bytes = o.backend == Backend::Cpu ? 4 : 2;
  const bool bf16_copies = o.backend == Backend::Cpu && l.compute == DType::BF16 && o.bf16_weight_copies;
  double capacity = 0, gemm_capacity = 0, shard = 0, opt_shard = 0, emb_param_pieces = 0, emb_grad_pieces = 0;
  double largest_shard = 0, emb_shard = 0;
  std::map<int64_t, int> pooled;  // capacities of the groups borrowed whole at stages 2-3, and how many
  int groups = 0;
  // Each entry's cut over the ranks (the same for every group of its size).
  std::vector<std::vector<parallel::GroupShard>> cuts(chunks.size());
  for (size_t j = 0; j < chunks.size(); j++) {
    const EngineChunk& chunk = chunks[j];
    for (const GroupUse& g : chunk.groups) {
      groups += g.count;
      const double n = g.count;
      // Buckets (zero/shard_layout.h): the embedding in whole rows of
      // n_embd and chunks of at most 2 MiB (kEmbeddingChunkBytes), every
      // other group in bucket_mb chunks, each chunk n equal slices; stage 0's
      // optimizer walks the groups as one rank's buckets.
      const double chunk_bytes = g.embedding ? std::min(bucket, parallel::kEmbeddingChunkBytes) : bucket;
      const parallel::GroupShard lay = parallel::cut_group(g.numel, ranks, 0, chunk_bytes, g.embedding ? C : 0);
      const parallel::GroupShard opt = z == 0 ? parallel::cut_group(g.numel, 1, 0, bucket) : lay;
      cuts[j].push_back(lay);
      // A group is allocated padded to whole buckets: the larger of the two cuts.
      const int64_t cap = std::max(lay.capacity(), opt.capacity());
      capacity += n * static_cast<double>(cap);
      if (g.gemm_weights) gemm_capacity += n * static_cast<double>(cap);
      shard += n * static_cast<double>(lay.shard_numel());
      opt_shard += n * static_cast<double>(opt.shard_numel());
      largest_shard = std::max(largest_shard, static_cast<double>(lay.shard_numel()));
      if (!g.embedding) pooled[cap] += g.count;
      if (g.embedding && chunk.sharded_embedding) {
        // Its working pieces: two chunks (one in use, the next in flight), one
        // when the group is a single chunk.
        const double pieces = static_cast<double>(std::min<int64_t>(lay.chunks, 2) * lay.chunk_numel()) * 4;
        if (z == 3) emb_param_pieces += pieces;
        if (z >= 2) emb_grad_pieces += pieces;
        emb_shard = static_cast<double>(lay.shard_numel());
      }
    }
  }
  // Reduce-scatters (stages 1-3; stage 0 all-reduces), one per bucket, in
  // the backward's order: the chunks from the last stage, each from its
  // head down to its first block, the embedding first or last.
  if (z >= 1) {
    for (size_t j = chunks.size(); j-- > 0;) {
      const EngineChunk& c = chunks[j];
      auto embedding = [&] {
        for (size_t i = 0; i < c.groups.size(); i++)
          if (c.groups[i].embedding) ring.reduce_scatter(static_cast<double>(cuts[j][i].slice) * 4, ranks);
      };
      if (c.embedding_first) embedding();
      for (size_t i = c.groups.size(); i-- > 0;)
        if (!c.groups[i].embedding) ring.reduce_scatter(static_cast<double>(cuts[j][i].slice) * 4, ranks);
      if (!c.embedding_first) embedding();
    }
  }
  if (groups == 0) return;
  auto of = [&] {
    return " (" + engine + ", " + std::to_string(groups) + " groups, " + std::to_string(ranks) +
           (ranks == 1 ? " rank)" : " ranks)");
  };
  // Parameters: whole at stages 0-2 (the f32 masters, ParamGroup::allocate),
  // this rank's shard at stage 3 (the optimizer's state store holds it).
  if (z < 3) {
    acc.add(MemCategory::Params, 4 * capacity,
            [&] { return std::string(fmt("master weights, f32: 4 B x %.0f", capacity) + of()); });
    if (b16)
      acc.add(MemCategory::Params, copy_bytes * capacity, [&] {
        return std::string(
            fmt("compute copies (f32 storage of 16-bit values on the CPU, 16-bit on a GPU): %.0f B x %.0f", copy_bytes,
                capacity) +
            of());
      });
  } else {
    if (!l.offload)
      acc.add(MemCategory::Params, 4 * shard,
              [&] { return std::string(fmt("master weight shard, f32: 4 B x %.0f", shard) + of()); });
  }
  if (bf16_copies && z < 3)
    acc.add(MemCategory::Workspace, 2 * gemm_capacity, [&] {
      return std::string(fmt("oneDNN bf16 copies of the GEMM weights: 2 B x %.0f", gemm_capacity) + of());
    });
  // Gradients: whole at stages 0-1, this rank's slices at 2-3.
  if (z < 2)
    acc.add(MemCategory::Grads, 4 * capacity,
            [&] { return std::string(fmt("gradients, f32: 4 B x %.0f", capacity) + of()); });
  else
    acc.add(MemCategory::Grads, 4 * shard,
            [&] { return std::string(fmt("gradient shard, f32: 4 B x %.0f", shard) + of()); });
  // Borrowed group-sized buffers, allocated up front, per distinct size:
  // stage 3 gathers parameters into two (one in use, one prefetched; one
  // where a single group has that size), stages 2-3 write each backward's
  // gradients into one before its reduce-scatter.
  if (z >= 2) {
    double params_pool = 0, grads_pool = 0;
    for (const auto& [cap, count] : pooled) {
      params_pool += (count >= 2 ? 2 : 1) * 4.0 * static_cast<double>(cap);
      grads_pool += 4.0 * static_cast<double>(cap);
    }
    if (z == 3) {
      acc.add(MemCategory::Params, params_pool,
              [&] { return std::string("gathered groups (ZeRO-3 pool: 2 per size)" + of()); });
      // bf16: the gathered group in use gets its oneDNN copy while it is
      // attached (freed when it is released, and the next one's made).
      if (bf16_copies && !pooled.empty()) {
        const double copy = 2.0 * static_cast<double>(pooled.rbegin()->first);
        acc.add(MemCategory::Workspace, copy,
                [&] { return std::string("oneDNN bf16 copy of the gathered group in use" + of()); });
        *transient = std::max(*transient, copy);
      }
    }
    acc.add(MemCategory::Grads, grads_pool,
            [&] { return std::string("gradients being written (pool: 1 per size)" + of()); });
  }
  acc.add(MemCategory::Params, emb_param_pieces,
          [&] { return std::string("embedding pieces, gathered (sharded embedding)" + of()); });
  acc.add(MemCategory::Grads, emb_grad_pieces,
          [&] { return std::string("embedding gradient pieces (sharded embedding)" + of()); });
  // Adam's moments (optim/state_store.h): in memory, or streamed from disk
  // through 3 window buffers per array (zero/disk_store.cpp), the parameter
  // shard being a third array at stage 3.
  if (!l.offload) {
    acc.add(MemCategory::Optimizer, 8 * opt_shard,
            [&] { return std::string(fmt("Adam moments, f32: 8 B x %.0f", opt_shard) + of()); });
  } else {
    const int arrays = z == 3 ? 3 : 2;
    const int64_t align = 1024;  // 4096-byte O_DIRECT granularity, in floats
    const int64_t padded = (std::max<int64_t>(static_cast<int64_t>(opt_shard), 1) + align - 1) / align * align;
    int64_t window = static_cast<int64_t>(o.offload_window_mb * 1024 * 1024 / (3.0 * arrays * 4)) / align * align;
    window = std::min(std::max<int64_t>(align, window), padded);
    acc.add(MemCategory::Optimizer, 3.0 * arrays * 4 * static_cast<double>(window), [&] {
      return std::string(fmt("offload windows: 3 x %.0f arrays x %.0f floats", arrays, static_cast<double>(window)) +
                         of());
    });
    if (z == 3) {
      acc.add(MemCategory::Params, 4 * largest_shard,
              [&] { return std::string("offload staging of a shard read from disk" + of()); });
      if (emb_shard > 0)
        acc.add(MemCategory::Params, 4 * emb_shard,
                [&] { return std::string("offload staging of the embedding's shard" + of()); });
    }
  }
}

struct ChunkInfo {
  int stage;
  pipeline::ChunkLayers layers;
  bool first, last;
  int moe_layers;
};

}  // namespace

double RankMemory::model_state() const {
  return category(MemCategory::Params) + category(MemCategory::Grads) + category(MemCategory::Optimizer);
}

double RankMemory::tracked(bool rank0) const {
  double sum = transient + (rank0 ? rank0_extra : 0);
  for (double b : by_category) sum += b;
  return sum;
}

double RankMemory::total() const { return tracked(true) + fragmentation + runtime; }

int MemoryPlan::worst_rank() const {
  int worst = 0;
  for (size_t r = 1; r < ranks.size(); r++)
    if (ranks[r].total() > ranks[worst].total()) worst = static_cast<int>(r);
  return worst;
}

double MemoryPlan::max_total() const { return ranks.empty() ? 0 : ranks[worst_rank()].total(); }

std::vector<int> activation_slots(const pipeline::Schedule& s) {
  std::vector<int> slots(static_cast<size_t>(s.stages), 0);
  for (const auto& actions : s.actions) {
    std::vector<int> held(static_cast<size_t>(s.stages), 0);
    for (const pipeline::Action& a : actions) {
      int& h = held[static_cast<size_t>(a.stage)];
      if (a.op == pipeline::Op::F) {
        h++;
        slots[static_cast<size_t>(a.stage)] = std::max(slots[static_cast<size_t>(a.stage)], h);
      } else if (a.op == pipeline::Op::B || a.op == pipeline::Op::W) {
        h--;
      }
    }
  }
  return slots;
}

PipelineShape pipeline_shape(const model::ModelConfig& model, const Layout& layout) {
  PipelineShape p;
  p.schedule = pipeline::make_schedule(layout.schedule, layout.pp, layout.virtual_stages, layout.micro_batches);
  const std::vector<double> costs = pipeline::layer_costs(model, model.seq_len);
  p.cut = pipeline::refine_partition(
      costs, pipeline::balanced_partition(costs, p.schedule.stages, p.schedule.rank_of_stage), p.schedule);
  p.slots = activation_slots(p.schedule);
  p.unit_bubble = pipeline::simulate(p.schedule).bubble;
  return p;
}

PipelineShape pipeline_shape_estimate(const model::ModelConfig& model, const Layout& layout) {
  const int p = layout.pp, v = layout.virtual_stages, m = layout.micro_batches;
  // Past 4·p·v micro-batches no schedule holds more of them in flight
  // (GPipe excepted: all m), so a schedule of that many (with m's remainder
  // modulo p, which the interleaved generator checks) has the same slots.
  const int cap = 4 * p * v;
  const bool capped = m > cap + p;
  const int generated = capped ? cap + m % p : m;
  PipelineShape s;
  s.exact = false;
  s.schedule = pipeline::make_schedule(layout.schedule, p, v, generated);
  s.cut = pipeline::balanced_partition(pipeline::layer_costs(model, model.seq_len), s.schedule.stages,
                                       s.schedule.rank_of_stage);
  s.slots = activation_slots(s.schedule);
  if (layout.schedule == "gpipe") std::fill(s.slots.begin(), s.slots.end(), m);
  if (!capped) {
    s.unit_bubble = pipeline::simulate(s.schedule).bubble;
  } else {
    // The generators' bubbles at unit costs (schedule.h): GPipe and 1F1B
    // (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1), ZB-H1 (p−1)/(3m+p−1),
    // ZB-V its bound (p−1)/(6m+p−1).
    const double work = layout.schedule == "interleaved" ? static_cast<double>(v) * m
                        : layout.schedule == "zb-h1"     ? 3.0 * m
                        : layout.schedule == "zb-v"      ? 6.0 * m
                                                         : static_cast<double>(m);
    s.unit_bubble = (p - 1) / (work + p - 1);
  }
  return s;
}

const PipelineShape& PipelineShapes::get(const Layout& layout) {
  int id = 0;
  while (id < static_cast<int>(names_.size()) && names_[static_cast<size_t>(id)] != layout.schedule) id++;
  if (id == static_cast<int>(names_.size())) names_.push_back(layout.schedule);
  const auto key = std::make_tuple(id, layout.pp, layout.virtual_stages, layout.micro_batches);
  auto it = cache_.find(key);
  if (it == cache_.end())
    it = cache_
             .emplace(key, std::make_unique<PipelineShape>(exact_ ? pipeline_shape(model_, layout)
                                                                  : pipeline_shape_estimate(model_, layout)))
             .first;
  return *it->second;
}

GroupNumels group_numels(const model::ModelConfig& m, int tp, int ep) {
  const Dims d = dims_of(m, tp);
  GroupNumels n;
  Padded emb;
  emb.add(d.V * d.C);  // wte: this rank's vocabulary rows
  if (m.learned_positions()) emb.add(static_cast<int64_t>(m.seq_len) * d.C);
  n.embedding = emb.numel;
  Padded block;
  add_attention(block, m, d);
  add_mlp(block, m, d.F);
  n.block = block.numel;
  if (m.n_experts > 0) {
    Padded moe;
    add_attention(moe, m, d);
    moe.add(static_cast<int64_t>(m.n_experts) * d.C);  // the router, replicated
    if (m.shared_ffn() > 0) add_mlp(moe, m, m.shared_ffn() / tp, true);
    n.moe_block = moe.numel;
    Padded experts;  // each expert whole on its ep rank
    for (int e = 0; e < m.n_experts / ep; e++) add_mlp(experts, m, m.moe_ffn());
    n.experts = experts.numel;
  }
  Padded fin;
  add_norm(fin, m);
  if (!m.tie_embeddings) fin.add(d.V * d.C);  // lm_head's vocabulary rows
  n.final = fin.numel;
  return n;
}

double zero_paper_bytes(double psi, double K, int Nd, int stage) {
  switch (stage) {
    case 0:
      return (2 + 2 + K) * psi;
    case 1:
      return 2 * psi + 2 * psi + K * psi / Nd;
    case 2:
      return 2 * psi + (2 + K) * psi / Nd;
    default:
      return (2 + 2 + K) * psi / Nd;
  }
}

double korthikanti_layer_bytes(double s, double b, double h, double a, int t, bool sp, Recompute r) {
  const double sbh = s * b * h;
  switch (r) {
    case Recompute::Full:
      return 2 * sbh;
    case Recompute::Selective:
      return sp ? 34 * sbh / t : sbh * (10 + 24.0 / t);
    case Recompute::None:
      break;
  }
  if (sp) return sbh * (34.0 / t + 5 * a * s / (h * t));
  return sbh * (10 + 24.0 / t + 5 * a * s / (h * t));
}

static Carve carve_of(const model::ModelConfig& m, const Layout& l, const Dims& d, const ChunkInfo& c,
                      bool keep_logits) {
  Carve z{};
  z.C = d.C, z.NH = d.NH, z.A = d.A, z.QKV = d.QKV, z.FU = d.FU, z.F = d.F, z.V = d.V;
  const int64_t T = m.seq_len / l.cp;  // this rank's share of each sequence (context parallelism)
  z.N = static_cast<int64_t>(l.micro_batch_size) * T;
  z.sp = l.tp > 1 && l.sequence_parallel;
  z.R = z.sp ? z.N / l.tp : z.N;
  z.HO = l.cp > 1 && l.cp_mode == "all_to_all" ? d.A : 0;
  z.L = c.layers.last - c.layers.first;
  z.L_moe = c.moe_layers;
  z.head = c.last;
  z.e = l.compute == DType::F32 ? 4 : 2;
  z.keep_logits = keep_logits;
  z.r = l.recompute;
  return z;
}

double lattice_layer_bytes(const model::ModelConfig& m, const Layout& l) {
  const Dims d = dims_of(m, l.tp);
  const ChunkInfo c{0, {0, 1}, false, false, 0};
  const Carve z = carve_of(m, l, d, c, false);
  return static_cast<double>(layer_bytes(z, false) + a64(z.e * z.R * z.C));  // its arrays and its input x_l
}

MemoryPlan predict_memory(const Workload& w, const Layout& l, const MemoryOptions& o, PipelineShapes* shapes,
                          bool detail) {
  const model::ModelConfig& m = w.model;
  std::unique_ptr<PipelineShapes> own;
  if (!shapes) own = std::make_unique<PipelineShapes>(m), shapes = own.get();
  const PipelineShape& shape = shapes->get(l);
  const Dims d = dims_of(m, l.tp);
  const GroupNumels numels = group_numels(m, l.tp, l.ep);
  const int dense_ranks = l.dp * l.cp;                 // the dense engine averages (and shards) over dp × cp
  const int expert_ranks = l.dp * l.cp / l.ep * l.tp;  // the experts': the ranks holding the same experts
  const bool cpu = o.backend == Backend::Cpu;
  const bool b16 = l.compute != DType::F32;
  const int64_t T = m.seq_len / l.cp;
  const int64_t N = static_cast<int64_t>(l.micro_batch_size) * T;
  const int S = shape.schedule.stages;
  const bool split = l.schedule == "zb-h1" || l.schedule == "zb-v";
  MemoryPlan plan;
  for (int r = 0; r < l.pp; r++) {
    RankMemory rank;
    rank.pp_rank = r;
    Accumulator acc;
    if (detail) acc.terms = &rank.terms;
    std::vector<ChunkInfo> chunks;
    for (int s = 0; s < S; s++) {
      if (shape.schedule.rank_of_stage[static_cast<size_t>(s)] != r) continue;
      const pipeline::ChunkLayers layers = shape.cut[static_cast<size_t>(s)];
      int moe = 0;
      for (int i = layers.first; i < layers.last; i++) moe += m.is_moe_layer(i) ? 1 : 0;
      chunks.push_back({s, layers, s == 0, s == S - 1, moe});
      rank.stages.push_back(s);
      rank.layers.push_back(layers);
      rank.in_flight.push_back(shape.slots[static_cast<size_t>(s)]);
    }
    // The engines' groups, chunk by chunk (model/gpt.h's order: embedding on
    // the first stage, and on the last with a tied head; the blocks; the
    // final group on the last; each MoE layer's experts).
    std::vector<EngineChunk> dense, experts;
    std::vector<bool> sharded(chunks.size(), false);
    for (size_t j = 0; j < chunks.size(); j++) {
      const ChunkInfo& c = chunks[j];
      EngineChunk e, x;
      const bool has_embedding = c.first || (c.last && m.tie_embeddings);
      // Consecutive groups of one size are one entry.
      auto add = [](EngineChunk& to, const GroupUse& g) {
        if (!to.groups.empty() && !g.embedding && !to.groups.back().embedding && to.groups.back().numel == g.numel &&
            to.groups.back().gemm_weights == g.gemm_weights)
          to.groups.back().count++;
        else
          to.groups.push_back(g);
      };
      if (has_embedding) {
        e.groups.push_back({numels.embedding, true, c.last && m.tie_embeddings});
        e.sharded_embedding = l.zero_stage >= 2 || (c.first && c.last && m.tie_embeddings && dense_ranks > 1);
        e.embedding_first = c.last && m.tie_embeddings && (l.zero_stage >= 2 || c.first);
        sharded[j] = e.sharded_embedding;
      }
      for (int i = c.layers.first; i < c.layers.last; i++) {
        const bool moe = m.is_moe_layer(i);
        add(e, {moe ? numels.moe_block : numels.block, false, true});
        if (moe) add(x, {numels.experts, false, true});
      }
      if (c.last) add(e, {numels.final, false, !m.tie_embeddings});
      dense.push_back(e);
      experts.push_back(x);
    }
    RingScratch dense_ring, expert_ring, tp_ring;
    double transient = 0;
    engine_memory(dense, dense_ranks, d.C, l, o, "dense", acc, dense_ring, &transient);
    if (m.n_experts > 0) engine_memory(experts, expert_ranks, d.C, l, o, "experts", acc, expert_ring, &transient);

    // Activations, chunk by chunk: its slots (one per micro-batch in flight),
    // each with its stored set, token ids and gradient buffers; one layer's
    // work arrays; the MoE layers' own arrays.
    for (size_t j = 0; j < chunks.size(); j++) {
      const ChunkInfo& c = chunks[j];
      // The head is local (no TP, the model's own embedding) unless TP cuts
      // the vocabulary or the sharded embedding serves a tied head; a 16-bit
      // head that is not local stores dlogits (docs/precision.md).
      const bool local_head = l.tp == 1 && (!m.tie_embeddings || !sharded[j]);
      const Carve z = carve_of(m, l, d, c, !local_head);
      const int slots = rank.in_flight[j];
      const int64_t act = slot_activation_bytes(z);
      const int64_t tokens = a64((b16 ? 3 : 2) * N * 4);  // input ids, their embedding rows (16-bit: targets)
      const int64_t grads = slot_grad_bytes(z, split);
      auto chunk = [&] {
        return " (stage " + std::to_string(c.stage) + ", layers " + std::to_string(c.layers.first) + ".." +
               std::to_string(c.layers.last - 1) + ")";
      };
      acc.add(MemCategory::Activations, static_cast<double>(slots) * act, [&] {
        return std::string(fmt("stored activations: %.0f slots x %.0f B", slots, static_cast<double>(act)) + chunk());
      });
      acc.add(MemCategory::Activations, static_cast<double>(slots) * tokens, [&] {
        return std::string(fmt("token ids: %.0f slots x %.0f B", slots, static_cast<double>(tokens)) + chunk());
      });
      acc.add(MemCategory::Activations, static_cast<double>(slots) * grads, [&] {
        return std::string(std::string(split ? "backward's gradient buffers, every layer's (split I/W)"
                                             : "backward's gradient buffers, one layer's") +
                           fmt(": %.0f slots x %.0f B", slots, static_cast<double>(grads)) + chunk());
      });
      const int64_t head_rows = local_head ? std::min<int64_t>(N, model::GPT::kHeadRows) : N;
      acc.add(MemCategory::Activations, static_cast<double>(work_bytes(z, head_rows)),
              [&] { return std::string("one layer's f32 work arrays" + chunk()); });
      if (c.moe_layers > 0) {
        // parts/moe.cpp: per MoE layer and slot the router's and the experts'
        // rows, sized for the most rows expert parallelism can deliver
        // (ep · R · min(k, local experts) without moe.token_bound); one set
        // of work arrays per chunk.
        const int64_t Rm = N / l.tp, E = m.n_experts, k = m.top_k, C = d.C;
        const int local = m.n_experts / l.ep;
        const int64_t recv = l.ep == 1 ? Rm * k : static_cast<int64_t>(l.ep) * Rm * std::min<int64_t>(k, local);
        const int64_t sent = Rm * k, F = m.moe_ffn();
        const int64_t FU = m.mlp == model::MlpKind::SwiGLU ? 2 * F : F;
        const int64_t Fs = m.shared_ffn() / l.tp, FUs = m.mlp == model::MlpKind::SwiGLU ? 2 * Fs : Fs;
        const int64_t per_layer = 2 * a64(4 * Rm * E) + a64(4 * Rm) + 3 * a64(4 * sent) + 2 * a64(4 * recv * C) +
                                  2 * a64(4 * recv * FU) + a64(4 * recv * F) + a64(4 * sent * C) +
                                  2 * a64(4 * N * FUs) + a64(4 * N * Fs);
        const int64_t work = a64(4 * sent * C) + a64(4 * recv * C) + a64(4 * std::max(recv, sent) * C) +
                             a64(4 * std::max(recv * F, N * Fs)) + a64(4 * N * C) + a64(4 * sent) +
                             a64(4 * std::max(Rm * E, E * C));
        acc.add(MemCategory::Activations, static_cast<double>(slots) * c.moe_layers * per_layer, [&] {
          return std::string(fmt("MoE layers' routing and expert rows: %.0f slots x %.0f layers x %.0f B", slots,
                                 c.moe_layers, static_cast<double>(per_layer)) +
                             chunk());
        });
        acc.add(MemCategory::Activations, static_cast<double>(work),
                [&] { return std::string("MoE work arrays" + chunk()); });
      }
      // The sharded embedding's exchanges on the first stage: every rank's
      // token ids and looked-up rows (zero/sharded_embedding.cpp).
      if (sharded[j] && c.first) {
        acc.add(MemCategory::Comm, static_cast<double>(a64(4 * dense_ranks * N)),
                [&] { return std::string("sharded embedding: every rank's token ids" + chunk()); });
        acc.add(MemCategory::Comm, static_cast<double>(a64(4 * dense_ranks * N * d.C)),
                [&] { return std::string("sharded embedding: every rank's rows of a micro-batch" + chunk()); });
        if (l.zero_stage == 3) dense_ring.reduce_scatter(4.0 * static_cast<double>(N * d.C), dense_ranks);
      }
    }
    // Sequence parallelism's reduce-scatters of [N, C] partial sums over the TP group.
    if (l.tp > 1 && l.sequence_parallel) tp_ring.reduce_scatter(4.0 * static_cast<double>(N / l.tp * d.C), l.tp);
    if (cpu) {
      for (const auto& [ring, name] : {std::pair<RingScratch*, const char*>{&dense_ring, "data-parallel group"},
                                       {&expert_ring, "expert-replica group"},
                                       {&tp_ring, "tensor-parallel group"}}) {
        acc.add(MemCategory::Comm, ring->pair,
                [&] { return std::string(std::string("ring reduce-scatter scratch, ") + name); });
        transient = std::max(transient, ring->replaced);
      }
    }
    // Context parallelism's buffers (layers/context/context_parallel.cpp):
    // the ring passes key/value blocks [B·T_local, 2·KV] with their
    // gradients (4 blocks), the all-to-all reshuffles Q/K/V (2 buffers).
    if (l.cp > 1) {
      const int64_t KV = d.NKV * d.hs;
      if (l.cp_mode == "ring") {
        acc.add(MemCategory::Comm, 4.0 * static_cast<double>(a64(4 * N * 2 * KV)),
                [&] { return std::string("context parallelism: 4 key/value blocks (ring)"); });
        if (cpu)
          acc.add(MemCategory::Workspace, 4.0 * static_cast<double>(a64(4 * l.micro_batch_size * d.NH * (T / 2))),
                  [&] { return std::string("context parallelism: half-sequence statistics"); });
      } else {
        acc.add(MemCategory::Comm, 2.0 * static_cast<double>(a64(4 * N * d.QKV)),
                [&] { return std::string("context parallelism: all-to-all send and receive buffers"); });
        if (cpu)
          acc.add(MemCategory::Workspace, static_cast<double>(a64(4 * N * d.A) + a64(4 * N * d.QKV)),
                  [&] { return std::string("context parallelism: head-sharded gradients"); });
      }
    }
    if (cpu) {
      // The attention kernel's tiles (kernels/cpu/attention.cpp, 64 query rows
      // a block): forward 64·Tk + 64 floats a thread, backward 2·64·Tk —
      // grown when the first backward runs, the forward's still alive — and
      // the backward's D [B, NH, T].
      const int64_t q = 64;
      const int64_t Tk = l.cp > 1 && l.cp_mode == "ring" ? T / 2 : (l.cp > 1 ? T * l.cp : T);
      const int64_t NH_att = l.cp > 1 && l.cp_mode != "ring" ? d.NH / l.cp : d.NH;
      const int64_t merge = l.cp > 1 && l.cp_mode == "ring" ? q * (d.hs + 1) : 0;
      const int64_t fwd = a64(4 * (q * Tk + q + merge) * o.threads), bwd = a64(4 * 2 * q * Tk * o.threads);
      acc.add(MemCategory::Workspace, static_cast<double>(std::max(fwd, bwd)), [&] {
        return std::string(fmt("attention tiles: %.0f threads x 64 x %.0f keys", o.threads, static_cast<double>(Tk)));
      });
      if (bwd > fwd) transient = std::max(transient, static_cast<double>(fwd));
      if (!(l.cp > 1 && l.cp_mode == "ring"))
        acc.add(MemCategory::Workspace, static_cast<double>(a64(4 * l.micro_batch_size * NH_att * Tk)),
                [&] { return std::string("attention backward's D"); });
      acc.add(MemCategory::Workspace, 64, [&] { return std::string("reductions' partial sums"); });
      if (l.compute == DType::BF16) {
        // The bf16 GEMMs' operands that are not weights, converted per call
        // into the thread's two operand buffers (kernels/cpu/gemm.cpp,
        // bf16_operand; 2 B a value on oneDNN's bf16 matmul, 4 B rounded on
        // the widening path): A is an activation [N, in] (forward) or an
        // output gradient [N, out] (both backward GEMMs) — at most dlogits
        // [head rows, V] on the last stage; B is an activation [N, in] (the
        // weight gradient's).
        const double e = o.bf16_weight_copies ? 2 : 4;
        int64_t dlogits = 0;
        for (size_t j = 0; j < chunks.size(); j++) {
          if (!chunks[j].last) continue;
          const bool local_head = l.tp == 1 && (!m.tie_embeddings || !sharded[j]);
          dlogits = (local_head ? std::min<int64_t>(N, model::GPT::kHeadRows) : N) * d.V;
        }
        const int64_t widest = std::max({d.C, d.A, d.F, d.QKV, d.FU});
        const double a = e * static_cast<double>(std::max(N * widest, dlogits));
        const double b = e * static_cast<double>(N * std::max({d.C, d.A, d.F}));
        acc.add(MemCategory::Workspace,
                static_cast<double>(a64(static_cast<int64_t>(a)) + a64(static_cast<int64_t>(b))),
                [&] { return std::string("bf16 GEMM operands (A and B) that are not weights"); });
      }
      if (m.position == model::PositionKind::Rope) {
        // One table per model part, and the trainer's whole-model declaration.
        const double table = static_cast<double>(a64(4 * d.hs / 2) + a64(4 * int64_t{m.seq_len} * d.hs));
        acc.add(MemCategory::Workspace, static_cast<double>(chunks.size() + 1) * table,
                [&] { return std::string("rotary tables"); });
      }
    }
    rank.by_category = acc.bytes;
    rank.transient = transient;
    if (cpu && (l.devices() > 1 || l.compute == DType::BF16))
      // kernels/cpu/gemm.cpp choose_gemm_paths: world rank 0 times the bf16
      // paths on one 256×768×768 product; the widening path's blocks
      // (4·(256·768 + 768·768) B) and oneDNN's scratchpad for it (66304 B on
      // this oneDNN) stay in the thread's workspace.
      rank.rank0_extra = r == 0 ? 4.0 * (256 * 768 + 768 * 768) + 66304 : 0;
    rank.fragmentation = o.fragmentation * rank.tracked(r == 0);
    rank.runtime = o.runtime_bytes;
    plan.ranks.push_back(std::move(rank));
  }
  return plan;
}

}  // namespace lattice::plan
