#include "lattice/plan/cost.h"

#include <algorithm>
#include <cmath>

#include "lattice/core/error.h"
#include "lattice/layers/tensor/tensor_parallel.h"
#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::plan {

double collective_seconds(Collective c, double bytes, int n, const Link& link) {
  if (n <= 1 && c != Collective::SendRecv) return 0;
  const double share = static_cast<double>(n - 1) / n;
  switch (c) {
    case Collective::AllReduce:
      return 2 * share * bytes / link.bandwidth + 2.0 * (n - 1) * link.latency;
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::AllToAll:
      return share * bytes / link.bandwidth + (n - 1) * link.latency;
    case Collective::SendRecv:
      return bytes / link.bandwidth + link.latency;
  }
  return 0;
}

const Link& group_link(const Cluster& cluster, int stride, int size) {
  // Ranks [0, stride·size) hold the group (every group of the mesh is a
  // translate of this one): inside one node when they fit in it.
  return static_cast<int64_t>(stride) * size <= cluster.devices_per_node ? cluster.intra : cluster.inter;
}

namespace {

// The GEMM efficiency curve at smallest dimension d.
double efficiency(const Cluster& c, double d) { return c.gemm_efficiency * d / (d + c.gemm_half_size); }

// Seconds of one pipeline chunk's micro-batch on one rank, by action.
struct ActionCosts {
  double F = 0, I = 0, W = 0;     // seconds, compute and the exposed communication inside them
  double compute = 0;             // seconds of compute alone
  double tp = 0, cp = 0, ep = 0;  // seconds of exposed communication
};

}  // namespace

StepTime predict_time(const Workload& w, const Layout& l, const Cluster& cl, PipelineShapes* shapes, bool simulate) {
  const model::ModelConfig& m = w.model;
  std::unique_ptr<PipelineShapes> own;
  if (!shapes) own = std::make_unique<PipelineShapes>(m), shapes = own.get();
  const PipelineShape& shape = shapes->get(l);
  const int t = l.tp, S = shape.schedule.stages;
  const double peak = cl.peak(l.compute);
  // Bytes of an activation value on the wire: lattice's CPU collectives move
  // f32; a 16-bit GPU backend moves the compute dtype.
  const double e = cl.backend == Backend::Gpu && l.compute != DType::F32 ? 2 : 4;

  // Sizes of one micro-batch on one rank.
  const double T_local = static_cast<double>(m.seq_len) / l.cp;
  const double N = l.micro_batch_size * T_local;  // tokens of this rank (its share of each sequence)
  const double C = m.n_embd, Q = static_cast<double>(m.q_width()), KV = static_cast<double>(m.kv_width());
  const double F = m.ffn(), up = m.mlp == model::MlpKind::SwiGLU ? 2 * F : F;
  const double V = tensor::padded_vocab(m.vocab_size, t);
  const double hs = m.head_size();
  // Per token per layer on one TP rank: the weights' multiply-adds (2 FLOPs
  // each) and causal attention (QKᵀ and PV over T/2 keys on average: 2·T·Q/t).
  const double dense_gemm = 2 * (C * (Q + 2 * KV) + Q * C + C * up + F * C) / t;
  const double attn_gemm = 2 * (C * (Q + 2 * KV) + Q * C) / t;
  const double attention = 2.0 * m.seq_len * Q / t;
  const double Fe = m.moe_ffn(), up_e = m.mlp == model::MlpKind::SwiGLU ? 2 * Fe : Fe;
  const double Fs = m.shared_ffn(), up_s = m.mlp == model::MlpKind::SwiGLU ? 2 * Fs : Fs;
  // An MoE layer: the router (E·C), k experts per routed row (each TP rank
  // routes 1/t of the rows, each expert whole), the shared experts cut by TP.
  const double moe_gemm =
      attn_gemm + 2 * m.n_experts * C / t + m.top_k * 2 * (C * up_e + Fe * C) / t + 2 * (C * up_s + Fs * C) / t;
  const double head_gemm = 2 * C * V / t;
  const double eff_gemm = efficiency(cl, std::min({N, C, Q / t, F / t}));
  const double eff_attention = efficiency(cl, hs);
  auto seconds = [&](double gemm_flops, double attention_flops) {
    return gemm_flops / (peak * eff_gemm) + attention_flops / (peak * eff_attention);
  };

  // Communication per layer per micro-batch.
  const Link& tp_link = group_link(cl, 1, t);
  const Link& cp_link = group_link(cl, t, l.cp);
  const Link& ep_link = group_link(cl, t, l.ep);
  const double act_bytes = N * C * e;
  // Tensor parallelism: 2 all-reduces each way (SP: 2 all-gathers + 2
  // reduce-scatters each way, the same bytes: Korthikanti et al. §4.2.2).
  const double tp_pass = t == 1 ? 0
                         : l.sequence_parallel
                             ? 2 * (collective_seconds(Collective::AllGather, act_bytes, t, tp_link) +
                                    collective_seconds(Collective::ReduceScatter, act_bytes, t, tp_link))
                             : 2 * collective_seconds(Collective::AllReduce, act_bytes, t, tp_link);
  // Context parallelism: the ring passes the key/value blocks (B·T_local·2·KV/t
  // values, and their gradients backward) cp − 1 times, hidden behind the
  // attention blocks; the all-to-all reshuffles Q/K/V and the output.
  double cp_forward = 0, cp_backward = 0;
  if (l.cp > 1) {
    const double kv_block = N * 2 * KV / t * e;
    const double att_fwd = seconds(0, N * attention), att_bwd = 2.5 * att_fwd;
    if (l.cp_mode == "ring") {
      const double step = collective_seconds(Collective::SendRecv, kv_block, 2, cp_link);
      cp_forward = std::max(0.0, (l.cp - 1) * step - att_fwd);
      cp_backward = std::max(0.0, (l.cp - 1) * 2 * step - att_bwd);
    } else {
      const double qkv = N * (Q + 2 * KV) / t * e, out = N * Q / t * e;
      cp_forward = collective_seconds(Collective::AllToAll, qkv, l.cp, cp_link) +
                   collective_seconds(Collective::AllToAll, out, l.cp, cp_link);
      cp_backward = cp_forward;
    }
  }
  // Expert parallelism: dispatch and combine, N/t rows × k choices × C each way.
  const double ep_pass =
      l.ep > 1 ? 2 * collective_seconds(Collective::AllToAll, N / t * m.top_k * C * e, l.ep, ep_link) : 0;

  const bool full = l.recompute == model::Recompute::Full;
  const bool local_head_16 = t == 1 && l.compute != DType::F32;  // dlogits recomputed (docs/precision.md)
  std::vector<std::array<double, 3>> by_stage(static_cast<size_t>(S));
  std::vector<ActionCosts> stage_costs(static_cast<size_t>(S));
  for (int s = 0; s < S; s++) {
    const pipeline::ChunkLayers c = shape.cut[static_cast<size_t>(s)];
    ActionCosts a;
    double gemm_f = 0, att_f = 0;
    int layers = 0, moe_layers = 0;
    for (int i = c.first; i < c.last; i++) {
      const bool moe = m.is_moe_layer(i);
      gemm_f += N * (moe ? moe_gemm : dense_gemm);
      att_f += N * attention;
      layers++;
      moe_layers += moe ? 1 : 0;
    }
    double head_f = s == S - 1 ? N * head_gemm : 0;
    const double fwd = seconds(gemm_f + head_f, att_f);
    // I: dX of every GEMM (its FLOPs again), attention's backward (2.5×),
    // full recomputation's forward again; the 16-bit local head recomputes
    // its logits. W: dW of every GEMM.
    double input = seconds(gemm_f + head_f + (local_head_16 && s == S - 1 ? head_f : 0), 2.5 * att_f);
    if (full) input += seconds(gemm_f, att_f);
    const double weight = seconds(gemm_f + head_f, 0);
    a.compute = fwd + input + weight;
    a.tp = layers * tp_pass * (2 + (full ? 1 : 0));  // forward, backward (and the forward again)
    a.cp = layers * (cp_forward * (1 + (full ? 1 : 0)) + cp_backward);
    a.ep = moe_layers * ep_pass * (2 + (full ? 1 : 0));
    a.F = fwd + layers * tp_pass + layers * cp_forward + moe_layers * ep_pass;
    a.I = input + (a.tp + a.cp + a.ep) - (layers * tp_pass + layers * cp_forward + moe_layers * ep_pass);
    a.W = weight;
    stage_costs[static_cast<size_t>(s)] = a;
  }

  // Data parallelism and ZeRO (over dp × cp ranks): this pipeline rank's
  // parameters (f32 gradients and weights on the wire: lattice reduces f32).
  const GroupNumels numels = group_numels(m, t, l.ep);
  const int n = l.dp * l.cp;
  const Link& dp_link = group_link(cl, t * l.cp, l.dp);  // (the cp ranks of a group are contiguous to it)
  const int m_batches = l.micro_batches;
  StepTime out;
  std::vector<double> rank_compute(static_cast<size_t>(l.pp), 0), rank_params(static_cast<size_t>(l.pp), 0);
  std::vector<double> rank_backward(static_cast<size_t>(l.pp), 0), rank_forward(static_cast<size_t>(l.pp), 0);
  for (int s = 0; s < S; s++) {
    const int r = shape.schedule.rank_of_stage[static_cast<size_t>(s)];
    const pipeline::ChunkLayers c = shape.cut[static_cast<size_t>(s)];
    double params = 0;
    for (int i = c.first; i < c.last; i++)
      params += static_cast<double>(m.is_moe_layer(i) ? numels.moe_block + numels.experts : numels.block);
    if (s == 0 || (s == S - 1 && m.tie_embeddings)) params += static_cast<double>(numels.embedding);
    if (s == S - 1) params += static_cast<double>(numels.final);
    rank_params[static_cast<size_t>(r)] += params;
    const ActionCosts& a = stage_costs[static_cast<size_t>(s)];
    rank_compute[static_cast<size_t>(r)] += m_batches * a.compute;
    rank_backward[static_cast<size_t>(r)] += a.I + a.W;
    rank_forward[static_cast<size_t>(r)] += a.F;
  }
  double dp_exposed_per_mb = 0, dp_tail = 0, dp_total = 0, optimizer = 0;
  for (int r = 0; r < l.pp; r++) {
    const double P = rank_params[static_cast<size_t>(r)];
    const double grads = 4 * P, weights = 4 * P;
    double total = 0, per_mb = 0, tail = 0;
    switch (l.zero_stage) {
      case 0: {  // all-reduce in the last micro-batch's backward
        const double ar = collective_seconds(Collective::AllReduce, grads, n, dp_link);
        total = ar;
        tail = std::max(0.0, ar - rank_backward[static_cast<size_t>(r)]);
        break;
      }
      case 1: {  // reduce-scatter in the last backward, all-gather after the update
        const double rs = collective_seconds(Collective::ReduceScatter, grads, n, dp_link);
        const double ag = collective_seconds(Collective::AllGather, weights, n, dp_link);
        total = rs + ag;
        tail = std::max(0.0, rs - rank_backward[static_cast<size_t>(r)]) + ag;
        break;
      }
      case 2: {  // reduce-scatter in every backward, all-gather after the update
        const double rs = collective_seconds(Collective::ReduceScatter, grads, n, dp_link);
        const double ag = collective_seconds(Collective::AllGather, weights, n, dp_link);
        total = m_batches * rs + ag;
        per_mb = std::max(0.0, rs - rank_backward[static_cast<size_t>(r)]);
        tail = ag;
        break;
      }
      default: {  // stage 3: gather for F and for I, reduce-scatter in every backward
        const double ag = collective_seconds(Collective::AllGather, weights, n, dp_link);
        const double rs = collective_seconds(Collective::ReduceScatter, grads, n, dp_link);
        total = m_batches * (2 * ag + rs);
        per_mb = std::max(0.0, ag - rank_forward[static_cast<size_t>(r)]) +
                 std::max(0.0, ag + rs - rank_backward[static_cast<size_t>(r)]);
        break;
      }
    }
    if (n == 1) total = per_mb = tail = 0;
    dp_total = std::max(dp_total, total);
    dp_exposed_per_mb = std::max(dp_exposed_per_mb, per_mb);
    dp_tail = std::max(dp_tail, tail);
    // AdamW on this rank's shard: read p, g, m, v and write p, m, v (28
    // bytes a parameter), then the compute copies remade (16-bit: 4 + 2).
    const double shard = l.zero_stage == 0 ? P : P / n;
    double opt = 28 * shard / cl.memory_bandwidth;
    if (l.compute != DType::F32) opt += 6 * P / cl.memory_bandwidth;
    // Offload: the moments (and at stage 3 the parameter shard) read from
    // disk and written back every step.
    if (l.offload) opt += 2 * (l.zero_stage == 3 ? 12 : 8) * shard / std::max(cl.disk_bandwidth, 1.0);
    optimizer = std::max(optimizer, opt);
  }

  // The pipeline: each stage's F, I, W with the exposed per-micro-batch
  // data-parallel time in its backward (stages 2-3), the transfers.
  for (int s = 0; s < S; s++) {
    const ActionCosts& a = stage_costs[static_cast<size_t>(s)];
    by_stage[static_cast<size_t>(s)] = {a.F, a.I + dp_exposed_per_mb, a.W};
  }
  const bool sp = t > 1 && l.sequence_parallel;
  const double transfer_bytes = (sp ? N / t : N) * C * e;
  const Link& pp_link = group_link(cl, t * l.cp * l.dp, l.pp);
  const double transfer = l.pp > 1 ? collective_seconds(Collective::SendRecv, transfer_bytes, 2, pp_link) : 0;
  double busiest = 0, tp = 0, cp = 0, ep = 0;
  for (int r = 0; r < l.pp; r++) {
    double tp_r = 0, cp_r = 0, ep_r = 0, busy = 0;
    for (int s = 0; s < S; s++) {
      if (shape.schedule.rank_of_stage[static_cast<size_t>(s)] != r) continue;
      const ActionCosts& a = stage_costs[static_cast<size_t>(s)];
      tp_r += m_batches * a.tp, cp_r += m_batches * a.cp, ep_r += m_batches * a.ep;
      busy += m_batches * (a.F + a.I + a.W + dp_exposed_per_mb);
    }
    if (busy > busiest) busiest = busy, tp = tp_r, cp = cp_r, ep = ep_r;
    out.compute = std::max(out.compute, rank_compute[static_cast<size_t>(r)]);
  }
  if (simulate) {
    LATTICE_CHECK(shape.exact, "internal: the simulator runs an exact pipeline shape only");
    pipeline::Costs costs;
    costs.by_stage = by_stage;
    costs.transfer = transfer;
    const pipeline::Simulation sim = pipeline::simulate(shape.schedule, costs);
    out.makespan = sim.makespan;
    out.bubble = sim.bubble;
    out.simulated = true;
  } else {
    // The busiest rank's work stretched by the schedule's unit-cost bubble,
    // plus the fill's transfers.
    out.bubble = shape.unit_bubble;
    out.makespan = busiest / (1 - shape.unit_bubble) + 2.0 * (l.pp - 1) * transfer;
  }
  out.tp_comm = tp, out.cp_comm = cp, out.ep_comm = ep;
  out.pp_comm = 2.0 * (l.pp - 1) * transfer;
  out.dp_comm = dp_total;
  out.dp_exposed = dp_tail + m_batches * dp_exposed_per_mb;
  out.optimizer = optimizer;
  out.step = out.makespan + dp_tail + optimizer;
  out.model_flops = m.flops_per_token(m.seq_len) * static_cast<double>(w.tokens_per_step());
  out.mfu = out.model_flops / (out.step * l.devices() * peak);
  out.tokens_per_s = static_cast<double>(w.tokens_per_step()) / out.step;
  return out;
}

}  // namespace lattice::plan
