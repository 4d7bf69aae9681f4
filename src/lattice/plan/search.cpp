#include "lattice/plan/search.h"

#include <algorithm>
#include <chrono>
#include <tuple>

#include "lattice/comm/process_mesh.h"
#include "lattice/core/error.h"
#include "lattice/parallel/pipeline/partition.h"

namespace lattice::plan {

std::string invalid_reason(const Workload& w, const Layout& l, int devices, PipelineShapes* shapes) {
  try {
    comm::validate_mesh_sizes(devices, l.pp, l.dp, l.cp, l.tp, l.ep);
    const io::RunConfig c = run_config(w.section, l, w.global_batch, l.offload ? "offload" : "");
    io::validate_config(c);
    io::check_landed(c);
    w.model.check_tensor_parallel(l.tp);
    // The partition's refusal (a layer per chunk at least) before the
    // schedule is generated (ZB-V's list scheduling is not cheap), then the
    // generator's.
    if (l.pp * l.virtual_stages > w.model.n_layer)
      pipeline::balanced_partition(std::vector<double>(static_cast<size_t>(w.model.n_layer) + 2, 1.0),
                                   l.pp * l.virtual_stages);
    if (shapes) {
      shapes->get(l);
    } else {
      pipeline_shape(w.model, l);
    }
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

MemoryOptions memory_options(const Cluster& c) {
  MemoryOptions o;
  o.backend = c.backend;
  o.threads = c.threads;
  o.fragmentation = c.fragmentation;
  o.runtime_bytes = c.runtime_bytes;
  return o;
}

Candidate evaluate(const Workload& w, const Layout& l, const Cluster& cl, PipelineShapes* shapes, MemoryPlan* plan) {
  std::unique_ptr<PipelineShapes> own;
  if (!shapes) own = std::make_unique<PipelineShapes>(w.model), shapes = own.get();
  Candidate c;
  c.layout = l;
  c.capacity = cl.device_memory;
  MemoryPlan p = predict_memory(w, l, memory_options(cl), shapes, plan != nullptr);
  c.worst_stage = p.worst_rank();
  c.memory = p.max_total();
  c.time = predict_time(w, l, cl, shapes, true);
  if (plan) *plan = std::move(p);
  return c;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; i++)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The key of `invalid_reason`'s refusal: the config key it names first, or its first words.
std::string reason_key(const std::string& reason) {
  const size_t eq = reason.find_first_of("=: ");
  return reason.substr(0, std::min<size_t>(eq, 48));
}

struct Kind {
  std::string name;
  std::function<bool(const Layout&)> member;
};

}  // namespace

SearchResult search(const Workload& w, const Cluster& cl, const SearchOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  const model::ModelConfig& m = w.model;
  const int devices = cl.devices();
  SearchResult result;
  PipelineShapes shapes(m, false), exact(m);
  const MemoryOptions mem = memory_options(cl);
  // Validity by shape: everything but the ZeRO stage, offload, precision and
  // recomputation (whose values are each valid on their own).
  std::map<std::tuple<int, int, int, int, int, int, int, int, std::string, bool, std::string>, std::string> checked;
  std::vector<Candidate> fitting;
  Candidate closest;
  closest.memory = -1;
  const std::vector<Kind> kinds = {
      {"ZeRO-3 data parallelism over every device",
       [](const Layout& l) { return l.tp == 1 && l.pp == 1 && l.cp == 1 && l.zero_stage == 3; }},
      {"no pipeline (pp = 1)", [](const Layout& l) { return l.pp == 1; }},
      {"no tensor parallelism (tp = 1)", [](const Layout& l) { return l.tp == 1; }},
      {"tensor parallelism across nodes", [&](const Layout& l) { return l.tp > cl.devices_per_node; }},
      {"neither sequence parallelism nor recomputation",
       [](const Layout& l) { return !l.sequence_parallel && l.recompute == model::Recompute::None; }},
      {"1F1B schedule", [](const Layout& l) { return l.pp > 1 && l.schedule == "1f1b"; }},
  };
  std::vector<Alternative> alternatives(kinds.size());
  for (size_t k = 0; k < kinds.size(); k++) alternatives[k].name = kinds[k].name;

  auto consider = [&](Candidate c) {
    for (size_t k = 0; k < kinds.size(); k++) {
      if (!kinds[k].member(c.layout)) continue;
      Alternative& a = alternatives[k];
      const bool better = !a.found || (c.fits() && (!a.best.fits() || c.time.step < a.best.time.step)) ||
                          (!c.fits() && !a.best.fits() && c.memory < a.best.memory);
      if (better) a.best = c, a.found = true;
    }
    if (c.fits()) {
      fitting.push_back(std::move(c));
    } else if (closest.memory < 0 || c.memory < closest.memory) {
      closest = std::move(c);
    }
  };

  const std::vector<std::string> schedules = {"1f1b", "zb-h1", "gpipe", "interleaved", "zb-v"};
  for (int tp : divisors(devices)) {
    for (int cp : divisors(devices / tp)) {
      for (int pp : divisors(devices / tp / cp)) {
        const int dp = devices / tp / cp / pp;
        for (int ep : divisors(m.n_experts > 0 ? m.n_experts : 1)) {
          if (w.global_batch % dp != 0) {
            // No micro-batch size splits the batch over these dp ranks: lattice's refusal, once.
            Layout l;
            l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp, l.ep = ep;
            l.micro_batches = static_cast<int>(std::max<int64_t>(1, w.global_batch / dp));
            const std::string why = invalid_reason(w, l, devices);
            result.refusals[reason_key(why)]++;
            result.enumerated++;
            l.zero_stage = 3;
            for (size_t k = 0; k < kinds.size(); k++)
              if (kinds[k].member(l) && alternatives[k].refusal.empty())
                alternatives[k].refusal = layout_name(l) + ": " + why;
            continue;
          }
          for (int mbs = 1; mbs <= o.max_micro_batch_size; mbs++) {
            if (w.global_batch % (static_cast<int64_t>(dp) * mbs) != 0) continue;
            const int micro = static_cast<int>(w.global_batch / (static_cast<int64_t>(dp) * mbs));
            for (const std::string& schedule : schedules) {
              // Chunks per rank: interleaved 2 or 4, ZB-V's V 2, the others 1.
              const std::vector<int> chunks = schedule == "interleaved" ? std::vector<int>{2, 4}
                                              : schedule == "zb-v"      ? std::vector<int>{2}
                                                                        : std::vector<int>{1};
              for (int v : chunks) {
                for (int sp = 0; sp <= (tp > 1 ? 1 : 0); sp++) {
                  for (const char* cp_mode : {"ring", "all_to_all"}) {
                    if (cp == 1 && std::string(cp_mode) != "ring") continue;
                    Layout l;
                    l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp, l.ep = ep, l.virtual_stages = v;
                    l.micro_batch_size = mbs, l.micro_batches = micro, l.schedule = schedule;
                    l.sequence_parallel = sp == 1, l.cp_mode = cp_mode;
                    const auto key =
                        std::make_tuple(dp, tp, pp, cp, ep, v, mbs, micro, schedule, l.sequence_parallel, l.cp_mode);
                    auto it = checked.find(key);
                    if (it == checked.end()) it = checked.emplace(key, invalid_reason(w, l, devices, &shapes)).first;
                    const int zero_count = dp * cp > 1 ? 4 : 1;
                    const int offload_count = o.offload && cl.disk_bandwidth > 0 ? 2 : 1;
                    const int64_t variants = static_cast<int64_t>(zero_count) * offload_count *
                                             static_cast<int64_t>(o.precisions.size()) * 3;
                    result.enumerated += variants;
                    if (!it->second.empty()) {
                      result.refusals[reason_key(it->second)] += variants;
                      // The kinds it would be (with the knobs every shape accepts set as they ask).
                      Layout any = l;
                      any.zero_stage = 3;
                      for (size_t k = 0; k < kinds.size(); k++)
                        if (kinds[k].member(any) && alternatives[k].refusal.empty())
                          alternatives[k].refusal = layout_name(any) + ": " + it->second;
                      continue;
                    }
                    for (int zero = 0; zero < zero_count; zero++)
                      for (int off = 0; off < offload_count; off++)
                        for (DType dtype : o.precisions)
                          for (model::Recompute rc :
                               {model::Recompute::None, model::Recompute::Selective, model::Recompute::Full}) {
                            Layout x = l;
                            x.zero_stage = zero, x.offload = off == 1, x.compute = dtype, x.recompute = rc;
                            result.valid++;
                            Candidate c;
                            c.layout = x;
                            c.capacity = cl.device_memory;
                            const MemoryPlan p = predict_memory(w, x, mem, &shapes);
                            c.worst_stage = p.worst_rank();
                            c.memory = p.ranks[static_cast<size_t>(c.worst_stage)].total();
                            c.time = predict_time(w, x, cl, &shapes, false);
                            consider(std::move(c));
                          }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  result.fitting = static_cast<int64_t>(fitting.size());
  // Second pass: the best estimates again with the trainer's own cut and
  // schedule — memory (a refined cut can move a layer: a layout that no
  // longer fits leaves) and the simulated step.
  std::sort(fitting.begin(), fitting.end(),
            [](const Candidate& a, const Candidate& b) { return a.time.step < b.time.step; });
  const size_t n = std::min(fitting.size(), static_cast<size_t>(std::max(o.simulate, o.top)));
  std::vector<Candidate> second;
  for (size_t i = 0; i < n; i++) {
    Candidate c = evaluate(w, fitting[i].layout, cl, &exact);
    if (c.fits()) second.push_back(std::move(c));
  }
  result.simulated = static_cast<int64_t>(n);
  // Equal times (recomputation that costs nothing where the GEMMs dominate):
  // the one that needs less memory first.
  std::sort(second.begin(), second.end(), [](const Candidate& a, const Candidate& b) {
    return a.time.step != b.time.step ? a.time.step < b.time.step : a.memory < b.memory;
  });
  if (second.size() > static_cast<size_t>(o.top)) second.resize(static_cast<size_t>(o.top));
  result.ranked = std::move(second);
  if (closest.memory >= 0) result.closest = evaluate(w, closest.layout, cl, &exact);
  for (Alternative& a : alternatives)
    if (a.found) a.best = evaluate(w, a.best.layout, cl, &exact);
  result.alternatives = std::move(alternatives);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace lattice::plan
