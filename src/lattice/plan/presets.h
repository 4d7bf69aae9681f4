// What the planner plans for: models by name (the shapes of published
// models, each with where it comes from) and clusters (devices, their
// memory and arithmetic, the links between them) by name or from a TOML
// file.
#pragma once

#include <string>
#include <vector>

#include "lattice/model/config.h"
#include "lattice/plan/memory.h"

namespace lattice::plan {

struct ModelPreset {
  std::string name;          // "llama2-70b"
  model::ModelConfig model;  // model.seq_len: the sequence length it was trained at
  std::string source;        // where the shape comes from
};
// Every preset, in a fixed order.
const std::vector<ModelPreset>& model_presets();
// The preset called `name`; throws lattice::Error naming the presets otherwise.
const ModelPreset& model_preset(const std::string& name);

// One kind of link between two devices: its bandwidth per device and
// direction, and the latency of one step of a collective (α of the α-β model).
struct Link {
  double bandwidth = 0;  // bytes/s, per device, per direction
  double latency = 0;    // s
};

struct Cluster {
  std::string name;
  std::string source;  // where the figures come from
  int nodes = 1;
  int devices_per_node = 1;
  Backend backend = Backend::Gpu;
  double device_memory = 0;  // bytes per device
  // Dense peak arithmetic per device, FLOP/s, by the dtype the GEMMs run in.
  double peak_bf16 = 0, peak_f16 = 0, peak_f32 = 0;
  double memory_bandwidth = 0;  // bytes/s per device (the optimizer step and other memory-bound passes)
  Link intra, inter;            // inside a node (NVLink, shared memory) and between nodes (InfiniBand, TCP)
  double disk_bandwidth = 0;    // bytes/s per device to the offload tier (0: no offload)
  // The GEMM efficiency curve: a GEMM whose smallest dimension is d runs at
  //   efficiency(d) = gemm_efficiency · d / (d + gemm_half_size)
  // of the peak (saturating: half the best at d = gemm_half_size).
  double gemm_efficiency = 0.8;
  double gemm_half_size = 128;
  double runtime_bytes = 0;  // per device, outside every allocation (CUDA context, NCCL buffers)
  double fragmentation = 0;  // share of the allocated bytes the allocator loses
  int threads = 1;           // CPU backend: threads per rank
  int devices() const { return nodes * devices_per_node; }
  double peak(DType compute) const;
  // Throws lattice::Error naming the field of an impossible cluster (no
  // devices, no memory, a zero bandwidth, an efficiency outside (0, 1], ...).
  void check() const;
};

// The presets' names and one-line descriptions.
std::vector<std::pair<std::string, std::string>> cluster_presets();
// A preset by name ("a100-80gb", "h100-sxm", "h200-sxm"), on `nodes` nodes.
Cluster cluster_preset(const std::string& name, int nodes);
// A cluster described by a TOML file (see docs/plan.md for its keys): a
// `preset` to start from (optional), then [cluster], [device] and
// [network] keys. Unknown sections or keys and values out of range are
// refused with one line naming them; the result is check()ed.
Cluster read_cluster(const std::string& path);
Cluster parse_cluster(const std::string& toml_text, const std::string& source_name);

}  // namespace lattice::plan
