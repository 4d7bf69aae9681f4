#include "lattice/plan/presets.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"

namespace lattice::plan {

namespace {

model::ModelConfig gpt2_shape(int layers, int heads, int width, int vocab, int seq) {
  model::ModelConfig c = model::ModelConfig::defaults(model::Family::GPT2);
  c.n_layer = layers, c.n_head = heads, c.n_embd = width, c.vocab_size = vocab, c.seq_len = seq;
  return c;
}

model::ModelConfig llama_shape(int layers, int heads, int kv_heads, int width, int ffn, int vocab, int seq,
                               float theta) {
  model::ModelConfig c = model::ModelConfig::defaults(model::Family::Llama);
  c.n_layer = layers, c.n_head = heads, c.n_kv_head = kv_heads, c.n_embd = width, c.ffn_hidden = ffn;
  c.vocab_size = vocab, c.seq_len = seq, c.rope_theta = theta;
  return c;
}

std::vector<ModelPreset> make_model_presets() {
  std::vector<ModelPreset> p;
  // GPT-2 (Radford et al. 2019, Table 2) as Hugging Face's gpt2* config.json
  // files write them: n_layer, n_head, n_embd, vocab_size 50257, n_positions 1024.
  const char* gpt2 = "Radford et al. 2019 (GPT-2), Table 2; HF openai-community/gpt2* config.json";
  p.push_back({"gpt2", gpt2_shape(12, 12, 768, 50257, 1024), gpt2});
  p.push_back({"gpt2-medium", gpt2_shape(24, 16, 1024, 50257, 1024), gpt2});
  p.push_back({"gpt2-large", gpt2_shape(36, 20, 1280, 50257, 1024), gpt2});
  p.push_back({"gpt2-xl", gpt2_shape(48, 25, 1600, 50257, 1024), gpt2});
  // GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96
  // heads of 128, context 2048, GPT-2's tokenizer; GPT-2's block (its
  // alternating locally banded sparse attention is not modelled: dense here).
  p.push_back({"gpt3-175b", gpt2_shape(96, 96, 12288, 50257, 2048),
               "Brown et al. 2020 (GPT-3), Table 2.1: n_layers 96, d_model 12288, n_heads 96, n_ctx 2048"});
  // Llama 2 (Touvron et al. 2023b, Table 1: context 4096; GQA for 70B) as HF
  // meta-llama/Llama-2-*-hf config.json: hidden_size, intermediate_size,
  // num_hidden_layers, num_attention_heads, num_key_value_heads, vocab 32000.
  const char* llama2 = "Touvron et al. 2023 (Llama 2), Table 1; HF meta-llama/Llama-2-{7b,13b,70b}-hf config.json";
  p.push_back({"llama2-7b", llama_shape(32, 32, 32, 4096, 11008, 32000, 4096, 10000.0f), llama2});
  p.push_back({"llama2-13b", llama_shape(40, 40, 40, 5120, 13824, 32000, 4096, 10000.0f), llama2});
  p.push_back({"llama2-70b", llama_shape(80, 64, 8, 8192, 28672, 32000, 4096, 10000.0f), llama2});
  // Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: 8B
  // 32 layers 4096 wide FFN 14336, 70B 80 x 8192 FFN 28672, 405B 126 x 16384
  // FFN 53248, 8 key/value heads, vocabulary 128K, RoPE θ 500000; pre-trained
  // at 8192 tokens) as HF meta-llama/Meta-Llama-3-8B, -70B and
  // Llama-3.1-405B config.json (vocab_size 128256).
  const char* llama3 =
      "Dubey et al. 2024 (Llama 3), Table 3; HF meta-llama/Meta-Llama-3-{8B,70B}, Llama-3.1-405B config.json";
  p.push_back({"llama3-8b", llama_shape(32, 32, 8, 4096, 14336, 128256, 8192, 500000.0f), llama3});
  p.push_back({"llama3-70b", llama_shape(80, 64, 8, 8192, 28672, 128256, 8192, 500000.0f), llama3});
  p.push_back({"llama3-405b", llama_shape(126, 128, 8, 16384, 53248, 128256, 8192, 500000.0f), llama3});
  // Mixtral 8x7B (Jiang et al. 2024, Table 1: dim 4096, 32 layers, 32 heads,
  // 8 kv heads, hidden 14336, 8 experts, top 2, context 32768) as HF
  // mistralai/Mixtral-8x7B-v0.1 config.json (vocab 32000, rope_theta 1e6);
  // trained here at 4096 tokens (set --seq-len for more).
  model::ModelConfig mixtral = llama_shape(32, 32, 8, 4096, 14336, 32000, 4096, 1e6f);
  mixtral.n_experts = 8;
  mixtral.top_k = 2;
  p.push_back({"mixtral-8x7b", mixtral,
               "Jiang et al. 2024 (Mixtral of Experts), Table 1; HF mistralai/Mixtral-8x7B-v0.1 config.json"});
  return p;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = make_model_presets();
  return presets;
}

const ModelPreset& model_preset(const std::string& name) {
  std::string names;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) return p;
    names += (names.empty() ? "" : ", ") + p.name;
  }
  LATTICE_FAIL("unknown model preset '" << name << "'; the presets are " << names
                                        << " (or give a lattice config with -c FILE)");
}

double Cluster::peak(DType compute) const {
  return compute == DType::BF16 ? peak_bf16 : compute == DType::F16 ? peak_f16 : peak_f32;
}

void Cluster::check() const {
  const std::string where = "cluster '" + name + "': ";
  LATTICE_CHECK(nodes >= 1, where << "nodes must be >= 1, got " << nodes);
  LATTICE_CHECK(devices_per_node >= 1, where << "devices_per_node must be >= 1, got " << devices_per_node);
  LATTICE_CHECK(device_memory > 0, where << "device memory must be > 0 (device.memory_gib)");
  LATTICE_CHECK(peak_bf16 > 0 && peak_f16 > 0 && peak_f32 > 0,
                where << "every peak must be > 0 (device.peak_tflops_bf16, _f16, _f32)");
  LATTICE_CHECK(memory_bandwidth > 0, where << "device.memory_gbps must be > 0");
  LATTICE_CHECK(intra.bandwidth > 0 && intra.latency >= 0,
                where << "network.intra_gbps must be > 0 and network.intra_latency_us >= 0");
  LATTICE_CHECK(nodes == 1 || (inter.bandwidth > 0 && inter.latency >= 0),
                where << nodes << " nodes need network.inter_gbps > 0 and network.inter_latency_us >= 0");
  LATTICE_CHECK(gemm_efficiency > 0 && gemm_efficiency <= 1,
                where << "device.gemm_efficiency must be in (0, 1], got " << gemm_efficiency);
  LATTICE_CHECK(gemm_half_size >= 0, where << "device.gemm_half_size must be >= 0");
  LATTICE_CHECK(fragmentation >= 0 && fragmentation < 1, where << "device.fragmentation must be in [0, 1)");
  LATTICE_CHECK(runtime_bytes >= 0 && runtime_bytes < device_memory,
                where << "device.runtime_gib must be >= 0 and below the device's memory");
  LATTICE_CHECK(threads >= 1, where << "device.threads must be >= 1");
}

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;
constexpr double kGB = 1e9;

// What the GPU presets assume beyond their data sheets (docs/plan.md, "what
// is calibrated"): the latency of a collective step, the GEMM efficiency
// curve, the runtime's memory (CUDA context, NCCL buffers) and the caching
// allocator's fragmentation. None of these is measured here.
void gpu_assumptions(Cluster& c, double efficiency) {
  c.backend = Backend::Gpu;
  c.intra.latency = 5e-6;
  c.inter.latency = 10e-6;
  c.gemm_efficiency = efficiency;
  c.gemm_half_size = 128;
  c.runtime_bytes = 2 * kGiB;
  c.fragmentation = 0.05;
  c.disk_bandwidth = 3 * kGB;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> cluster_presets() {
  return {
      {"a100-80gb", "8 x A100-SXM4-80GB per node, NVLink 3 (300 GB/s a direction), HDR InfiniBand 200 Gb/s per GPU"},
      {"h100-sxm", "8 x H100-SXM5-80GB per node, NVLink 4 (450 GB/s a direction), NDR InfiniBand 400 Gb/s per GPU"},
      {"h200-sxm", "8 x H200-SXM-141GB per node, NVLink 4 (450 GB/s a direction), NDR InfiniBand 400 Gb/s per GPU"}};
}

Cluster cluster_preset(const std::string& name, int nodes) {
  Cluster c;
  c.name = name;
  c.nodes = nodes;
  c.devices_per_node = 8;
  if (name == "a100-80gb") {
    // NVIDIA A100 Tensor Core GPU data sheet (2021), SXM 80GB: BF16/FP16
    // tensor 312 TFLOPS dense, FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s,
    // NVLink 600 GB/s (both directions). DGX A100: one 200 Gb/s HDR
    // InfiniBand adapter per GPU (25 GB/s a direction).
    c.source = "NVIDIA A100 data sheet (SXM4 80GB), DGX A100 (8 HDR 200 Gb/s adapters)";
    c.device_memory = 80 * kGB;
    c.peak_bf16 = c.peak_f16 = 312e12;
    c.peak_f32 = 19.5e12;
    c.memory_bandwidth = 2039 * kGB;
    c.intra.bandwidth = 300 * kGB;
    c.inter.bandwidth = 25 * kGB;
    gpu_assumptions(c, 0.8);
  } else if (name == "h100-sxm" || name == "h200-sxm") {
    // NVIDIA H100 Tensor Core GPU data sheet, SXM5: BF16/FP16 tensor 1,979
    // TFLOPS with sparsity (989.4 dense), FP32 67 TFLOPS, 80 GB HBM3 at 3.35
    // TB/s, NVLink 900 GB/s (both directions). H200 data sheet: the same
    // arithmetic, 141 GB HBM3e at 4.8 TB/s. DGX H100/H200: one 400 Gb/s NDR
    // ConnectX-7 per GPU (50 GB/s a direction).
    const bool h200 = name == "h200-sxm";
    c.source = h200 ? "NVIDIA H200 data sheet (SXM 141GB), DGX H200 (8 NDR 400 Gb/s adapters)"
                    : "NVIDIA H100 data sheet (SXM5 80GB), DGX H100 (8 NDR 400 Gb/s adapters)";
    c.device_memory = (h200 ? 141 : 80) * kGB;
    c.peak_bf16 = c.peak_f16 = 989.4e12;
    c.peak_f32 = 67e12;
    c.memory_bandwidth = (h200 ? 4800 : 3350) * kGB;
    c.intra.bandwidth = 450 * kGB;
    c.inter.bandwidth = 50 * kGB;
    gpu_assumptions(c, 0.75);
  } else {
    std::string names;
    for (const auto& [n, what] : cluster_presets()) names += (names.empty() ? "" : ", ") + n;
    LATTICE_FAIL("unknown cluster preset '" << name << "'; the presets are " << names
                                            << " (or describe one in a TOML file: --cluster FILE.toml)");
  }
  c.check();
  return c;
}

namespace {

// One [section] of the cluster file: each key read once, unknown keys refused.
class Section {
 public:
  Section(const toml::table* t, std::string name, const std::string& source)
      : t_(t), name_(std::move(name)), source_(source) {}
  ~Section() = default;
  double number(const char* key, double fallback, double low, double high, bool low_open = false) {
    seen_.push_back(key);
    if (!t_) return fallback;
    const toml::node* n = t_->get(key);
    if (!n) return fallback;
    const std::optional<double> v = n->value<double>();
    LATTICE_CHECK(v.has_value(), where(key) << " must be a number");
    LATTICE_CHECK(std::isfinite(*v) && (low_open ? *v > low : *v >= low) && *v <= high,
                  where(key) << "=" << *v << " is out of range: it must be " << (low_open ? "> " : ">= ") << low
                             << (high < 1e300 ? " and <= " + std::to_string(high) : std::string()));
    return *v;
  }
  std::string text(const char* key, const std::string& fallback) {
    seen_.push_back(key);
    if (!t_) return fallback;
    const toml::node* n = t_->get(key);
    if (!n) return fallback;
    const std::optional<std::string> v = n->value<std::string>();
    LATTICE_CHECK(v.has_value(), where(key) << " must be a string");
    return *v;
  }
  // After every key was read: any other key in the section is a mistake.
  void refuse_unknown() const {
    if (!t_) return;
    for (const auto& [k, v] : *t_) {
      const std::string key(k.str());
      if (std::find(seen_.begin(), seen_.end(), key) == seen_.end()) {
        std::string known;
        for (const std::string& s : seen_) known += (known.empty() ? "" : ", ") + s;
        LATTICE_FAIL(where(key.c_str()) << " is not a key of [" << name_ << "] (its keys: " << known << ")");
      }
    }
  }

 private:
  std::string where(const char* key) const { return "cluster file '" + source_ + "': " + name_ + "." + key; }
  const toml::table* t_;
  std::string name_;
  const std::string& source_;
  std::vector<std::string> seen_;
};

}  // namespace

Cluster parse_cluster(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    LATTICE_FAIL("cluster file '" << source << "' line " << e.source().begin.line << ": " << e.description());
  }
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    LATTICE_CHECK(key == "cluster" || key == "device" || key == "network",
                  "cluster file '" << source << "': [" << key
                                   << "] is not a section of a cluster file (they are [cluster], [device], [network])");
    LATTICE_CHECK(v.is_table(), "cluster file '" << source << "': " << key << " must be a [section]");
  }
  Section cluster(root["cluster"].as_table(), "cluster", source);
  const std::string preset = cluster.text("preset", "");
  const double nodes = cluster.number("nodes", 1, 1, 1e6);
  Cluster c;
  if (!preset.empty()) {
    c = cluster_preset(preset, static_cast<int>(nodes));
  } else {
    c.backend = Backend::Gpu;
  }
  c.nodes = static_cast<int>(nodes);
  c.name = cluster.text("name", preset.empty() ? source : preset + " (" + source + ")");
  c.devices_per_node = static_cast<int>(cluster.number("devices_per_node", c.devices_per_node, 1, 1e6));
  cluster.refuse_unknown();

  Section device(root["device"].as_table(), "device", source);
  const std::string backend = device.text("backend", c.backend == Backend::Cpu ? "cpu" : "gpu");
  LATTICE_CHECK(
      backend == "cpu" || backend == "gpu",
      "cluster file '" << source << "': device.backend must be \"cpu\" or \"gpu\", got \"" << backend << "\"");
  c.backend = backend == "cpu" ? Backend::Cpu : Backend::Gpu;
  c.device_memory = device.number("memory_gib", c.device_memory / kGiB, 0, 1e9, true) * kGiB;
  c.peak_bf16 = device.number("peak_tflops_bf16", c.peak_bf16 / 1e12, 0, 1e9, true) * 1e12;
  c.peak_f16 = device.number("peak_tflops_f16", c.peak_f16 / 1e12, 0, 1e9, true) * 1e12;
  c.peak_f32 = device.number("peak_tflops_f32", c.peak_f32 / 1e12, 0, 1e9, true) * 1e12;
  c.memory_bandwidth = device.number("memory_gbps", c.memory_bandwidth / kGB, 0, 1e9, true) * kGB;
  c.gemm_efficiency = device.number("gemm_efficiency", c.gemm_efficiency, 0, 1, true);
  c.gemm_half_size = device.number("gemm_half_size", c.gemm_half_size, 0, 1e9);
  c.runtime_bytes = device.number("runtime_gib", c.runtime_bytes / kGiB, 0, 1e9) * kGiB;
  c.fragmentation = device.number("fragmentation", c.fragmentation, 0, 0.99);
  c.threads = static_cast<int>(device.number("threads", c.threads, 1, 1e4));
  device.refuse_unknown();

  Section network(root["network"].as_table(), "network", source);
  c.intra.bandwidth = network.number("intra_gbps", c.intra.bandwidth / kGB, 0, 1e9, true) * kGB;
  c.intra.latency = network.number("intra_latency_us", c.intra.latency * 1e6, 0, 1e9) * 1e-6;
  c.inter.bandwidth = network.number("inter_gbps", c.inter.bandwidth / kGB, 0, 1e9) * kGB;
  c.inter.latency = network.number("inter_latency_us", c.inter.latency * 1e6, 0, 1e9) * 1e-6;
  c.disk_bandwidth = network.number("disk_gbps", c.disk_bandwidth / kGB, 0, 1e9) * kGB;
  network.refuse_unknown();
  if (c.source.empty()) c.source = "cluster file '" + source + "'";
  c.check();
  return c;
}

Cluster read_cluster(const std::string& path) { return parse_cluster(io::read_whole_file(path, "cluster file"), path); }

}  // namespace lattice::plan
