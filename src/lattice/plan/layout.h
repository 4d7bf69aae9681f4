// What the planner plans: a workload (a model and a global batch) and a
// layout (every knob of [parallel], [zero], [precision] and [recompute]
// that changes memory or time), the layout's one-line name, and the run
// config it stands for.
//
// A layout is named by its knobs, e.g.
//
//   dp2.tp8.pp4.v1.z1.mb1.m16.1f1b.sp.bf16.rc-selective
//
// (dp, tp, pp, cp, ep, virtual stages, ZeRO stage, micro-batch size, micro-
// batches per step, schedule, then the switches: sp, offload, the compute
// dtype, rc-none|selective|full); parse_layout reads it back (any order,
// knobs left out take the defaults below), so `lattice plan --explain`
// takes any name the table prints.
#pragma once

#include <cstdint>
#include <string>

#include "lattice/core/dtype.h"
#include "lattice/io/config.h"
#include "lattice/model/config.h"
#include "lattice/model/recompute.h"

namespace lattice::plan {

// A model and the batch of one optimizer step.
struct Workload {
  std::string name;          // "llama2-70b", or the config file's path
  model::ModelConfig model;  // model.seq_len is the training sequence length
  int64_t global_batch = 0;  // sequences per optimizer step (all data-parallel ranks)
  // The same model as a [model] section (train::model_section_of writes it):
  // what the layouts' run configs are checked and emitted with.
  io::ModelSection section;
  int64_t tokens_per_step() const { return global_batch * model.seq_len; }
};

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  int virtual_stages = 1;  // chunks per pipeline rank (interleaved: >= 2; zb-v: 2)
  int zero_stage = 0;
  bool offload = false;           // zero.offload = "disk": optimizer state (and ZeRO-3's parameter shard) on disk
  int micro_batch_size = 1;       // sequences per micro-batch
  int micro_batches = 1;          // per data-parallel rank per step (m)
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1 | zb-v
  bool sequence_parallel = false;
  std::string cp_mode = "ring";  // ring | all_to_all
  DType compute = DType::F32;
  model::Recompute recompute = model::Recompute::None;
  double bucket_mb = 4;  // parallel.bucket_mb

  int devices() const { return dp * tp * pp * cp; }
  // Sequences of one step: dp × micro_batch_size × micro_batches.
  int64_t global_batch() const { return static_cast<int64_t>(dp) * micro_batch_size * micro_batches; }
  bool operator==(const Layout&) const = default;
};

// "dp2.tp8.pp4.v1.z1.mb1.m16.1f1b.sp.bf16.rc-selective" (cp, ep, offload
// and cp_mode written only when they are not the defaults).
std::string layout_name(const Layout& l);
// The inverse. Throws lattice::Error naming the piece it cannot read and
// what a piece may be.
Layout parse_layout(const std::string& name);

// The run config of `layout` with the [model] section `model` (the
// workload's: train::model_section_of writes one from a ModelConfig) and
// `global_batch` sequences a step: the [parallel], [zero], [precision] and
// [recompute] keys the layout sets, train.global_batch_size, the rest at
// their defaults. `offload_dir` goes to zero.offload_dir when the layout
// offloads.
io::RunConfig run_config(const io::ModelSection& model, const Layout& layout, int64_t global_batch,
                         const std::string& offload_dir = "");

// The layout a run config describes (the inverse of run_config for the
// layout's keys; micro-batches from io::micro_batches_per_step). The
// config's recompute.every and recompute.first are the planner's "every
// layer" only: the caller refuses others.
Layout layout_of(const io::RunConfig& config);

}  // namespace lattice::plan
