#include "lattice/plan/layout.h"

#include <cstdlib>
#include <vector>

#include "lattice/core/error.h"

namespace lattice::plan {

static const char* dtype_key(DType t) { return t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : "f32"; }

std::string layout_name(const Layout& l) {
  std::string s = "dp" + std::to_string(l.dp) + ".tp" + std::to_string(l.tp) + ".pp" + std::to_string(l.pp);
  if (l.cp > 1) s += ".cp" + std::to_string(l.cp);
  if (l.ep > 1) s += ".ep" + std::to_string(l.ep);
  s += ".v" + std::to_string(l.virtual_stages) + ".z" + std::to_string(l.zero_stage);
  s += ".mb" + std::to_string(l.micro_batch_size) + ".m" + std::to_string(l.micro_batches);
  s += "." + l.schedule;
  if (l.sequence_parallel) s += ".sp";
  if (l.cp > 1 && l.cp_mode != "ring") s += ".a2a";
  if (l.offload) s += ".offload";
  s += std::string(".") + dtype_key(l.compute);
  s += std::string(".rc-") + model::recompute_name(l.recompute);
  return s;
}

// A number after `prefix` in `piece` ("tp8" -> 8), or -1 when piece does not
// start with prefix followed by digits only.
static long number_after(const std::string& piece, const std::string& prefix) {
  if (piece.size() <= prefix.size() || piece.compare(0, prefix.size(), prefix) != 0) return -1;
  const std::string digits = piece.substr(prefix.size());
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  if (digits.size() > 9) return -1;
  return std::strtol(digits.c_str(), nullptr, 10);
}

Layout parse_layout(const std::string& name) {
  LATTICE_CHECK(!name.empty(), "an empty layout name (expected e.g. dp2.tp8.pp4.z1.mb1.m16.1f1b.sp.bf16)");
  Layout l;
  size_t begin = 0;
  while (begin <= name.size()) {
    size_t end = name.find('.', begin);
    if (end == std::string::npos) end = name.size();
    const std::string piece = name.substr(begin, end - begin);
    begin = end + 1;
    struct Knob {
      const char* prefix;
      int* field;
    };
    const Knob knobs[] = {{"dp", &l.dp},          {"tp", &l.tp},
                          {"pp", &l.pp},          {"cp", &l.cp},
                          {"ep", &l.ep},          {"v", &l.virtual_stages},
                          {"z", &l.zero_stage},   {"mb", &l.micro_batch_size},
                          {"m", &l.micro_batches}};
    bool matched = false;
    // "mb" before "m": number_after("mb4", "m") fails on the 'b', so the order only keeps it cheap.
    for (const Knob& k : knobs) {
      const long v = number_after(piece, k.prefix);
      if (v < 0) continue;
      LATTICE_CHECK(v >= (std::string(k.prefix) == "z" ? 0 : 1), "layout '" << name << "': '" << piece
                                                                            << "' must be at least "
                                                                            << (std::string(k.prefix) == "z" ? 0 : 1));
      *k.field = static_cast<int>(v);
      matched = true;
      break;
    }
    if (matched) continue;
    if (piece == "gpipe" || piece == "1f1b" || piece == "interleaved" || piece == "zb-h1" || piece == "zb-v") {
      l.schedule = piece;
    } else if (piece == "sp") {
      l.sequence_parallel = true;
    } else if (piece == "a2a") {
      l.cp_mode = "all_to_all";
    } else if (piece == "offload") {
      l.offload = true;
    } else if (piece == "f32" || piece == "bf16" || piece == "f16") {
      l.compute = parse_dtype(piece);
    } else if (piece.rfind("rc-", 0) == 0) {
      const std::string mode = piece.substr(3);
      LATTICE_CHECK(
          mode == "none" || mode == "selective" || mode == "full",
          "layout '" << name << "': '" << piece << "' is not a recompute mode (rc-none, rc-selective, rc-full)");
      l.recompute = model::recompute_from_name(mode);
    } else {
      LATTICE_FAIL("layout '" << name << "': cannot read '" << piece
                              << "'; a layout is dot-separated pieces: dpN tpN ppN cpN epN vN zN (ZeRO stage) mbN "
                                 "(micro-batch size) mN (micro-batches), a schedule (gpipe 1f1b interleaved zb-h1 "
                                 "zb-v), sp, a2a, offload, f32|bf16|f16, rc-none|rc-selective|rc-full");
    }
  }
  return l;
}

io::RunConfig run_config(const io::ModelSection& model, const Layout& l, int64_t global_batch,
                         const std::string& offload_dir) {
  io::RunConfig c;
  c.model = model;
  c.train.micro_batch_size = l.micro_batch_size;
  c.train.global_batch_size = static_cast<int>(global_batch);
  c.parallel.dp = l.dp;
  c.parallel.tp = l.tp;
  c.parallel.pp = l.pp;
  c.parallel.cp = l.cp;
  c.parallel.cp_mode = l.cp_mode;
  c.parallel.ep = l.ep;
  c.parallel.zero_stage = l.zero_stage;
  c.parallel.sequence_parallel = l.sequence_parallel;
  c.parallel.schedule = l.schedule;
  c.parallel.virtual_stages = l.virtual_stages;
  c.parallel.bucket_mb = l.bucket_mb;
  if (l.offload) {
    c.zero.offload = "disk";
    c.zero.offload_dir = offload_dir;
  }
  c.precision.compute = dtype_key(l.compute);
  c.recompute.mode = model::recompute_name(l.recompute);
  return c;
}

Layout layout_of(const io::RunConfig& c) {
  Layout l;
  l.dp = c.parallel.dp;
  l.tp = c.parallel.tp;
  l.pp = c.parallel.pp;
  l.cp = c.parallel.cp;
  l.cp_mode = c.parallel.cp_mode;
  l.ep = c.parallel.ep;
  l.virtual_stages = c.parallel.virtual_stages;
  l.zero_stage = c.parallel.zero_stage;
  l.offload = c.zero.offload == "disk";
  l.micro_batch_size = c.train.micro_batch_size;
  l.micro_batches = io::micro_batches_per_step(c);
  l.schedule = c.parallel.schedule;
  l.sequence_parallel = c.parallel.sequence_parallel;
  l.compute = parse_dtype(c.precision.compute);
  l.recompute = model::recompute_from_name(c.recompute.mode);
  l.bucket_mb = c.parallel.bucket_mb;
  return l;
}

}  // namespace lattice::plan
