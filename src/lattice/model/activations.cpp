#include "lattice/model/activations.h"

#include <type_traits>

#include "lattice/kernels/ops.h"

namespace lattice::model {

namespace k = lattice::kernels;

using F = LayerField;

// fn(id, field, elements) for each of a layer's arrays, in carving order;
// field(arrays) is that array's pointer in any LayerArrays<T>.
template <typename Fn>
static void for_each_array(const CarveSizes& z, Fn fn) {
  const int64_t RC = z.R * z.C;
  fn(F::Ln1, [](auto& a) -> auto& { return a.ln1; }, RC);
  fn(F::Qkv, [](auto& a) -> auto& { return a.qkv; }, z.N * z.QKV);
  fn(F::Atty, [](auto& a) -> auto& { return a.atty; }, z.N * z.A);
  fn(F::Res1, [](auto& a) -> auto& { return a.res1; }, RC);
  fn(F::Ln2, [](auto& a) -> auto& { return a.ln2; }, RC);
  fn(F::Fch, [](auto& a) -> auto& { return a.fch; }, z.N * z.FU);
  fn(F::Hid, [](auto& a) -> auto& { return a.hid; }, z.N * z.F);
  fn(F::HeadsOut, [](auto& a) -> auto& { return a.heads_out; }, z.N * z.HO);
}

// A layer's statistics (f32 whatever the storage), those `present` names.
template <typename Present>
static void carve_stats(Carver& cv, const CarveSizes& z, LayerActs* a, Present present) {
  auto take = [&](F f, int64_t n) { return present(f) ? cv.take(n) : nullptr; };
  a->ln1_mean = take(F::Ln1Stats, z.R);
  a->ln1_rstd = take(F::Ln1Stats, z.R);
  a->lse = take(F::Lse, z.N * z.NH);
  a->ln2_mean = take(F::Ln2Stats, z.R);
  a->ln2_rstd = take(F::Ln2Stats, z.R);
}

// Whether some layer does not store field f (its forward computes it in the work arrays).
static bool some_layer_drops(const CarveSizes& z, F f) {
  for (int64_t l = 0; l < z.L; l++)
    if (!stores(z.policy(l), f)) return true;
  return false;
}

template <typename T>
static int64_t carve_slot(Slot* s, void* base, const CarveSizes& z) {
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t C = z.C, N = z.N, R = z.R, L = z.L;
  Carver cv(base);
  std::vector<T*> x(L + 1);
  for (T*& p : x) p = cv.take<T>(R * C);
  std::vector<LayerActs> layers(L);
  std::vector<LayerArrays<T>> arrays(L);
  for (int64_t l = 0; l < L; l++) {
    const Recompute r = z.policy(l);
    for_each_array(z, [&](F f, auto field, int64_t n) {
      field(arrays[l]) = stores(r, f) && z.dense_field(l, f) ? cv.take<T>(n) : nullptr;
    });
    carve_stats(cv, z, &layers[l], [&](F f) { return stores(r, f); });
    if constexpr (f32) static_cast<LayerArrays<float>&>(layers[l]) = arrays[l];
  }
  const int64_t head = z.head ? 1 : 0;
  T* lnf = cv.take<T>(head * N * C);  // whole: the head reads every row (gathered under SP)
  float* lnf_mean = cv.take(head * R);
  float* lnf_rstd = cv.take(head * R);
  T* logits = cv.take<T>((f32 || z.keep_logits ? head : 0) * N * z.V);
  float* losses = cv.take(head * N);
  float* work = z.sp ? cv.take(N * C) : nullptr;
  float* out32 = f32 ? nullptr : cv.take((1 - head) * R * C);
  if (!s) return cv.used();
  s->layers = std::move(layers);
  s->lnf_mean = lnf_mean, s->lnf_rstd = lnf_rstd, s->losses = losses, s->work = work;
  s->store = z.store;
  if constexpr (f32) {
    s->x = std::move(x), s->lnf = lnf, s->logits = logits;
    s->x16.clear(), s->packed.clear(), s->lnf16 = s->logits16 = nullptr, s->out32 = nullptr;
    s->keep_logits = true;
  } else {
    s->x.assign(L + 1, nullptr), s->lnf = s->logits = nullptr;
    s->x16 = std::move(x), s->packed = std::move(arrays), s->lnf16 = lnf, s->logits16 = logits;
    s->out32 = z.head ? nullptr : out32;
    s->keep_logits = z.keep_logits;
  }
  return cv.used();
}

int64_t carve_activations(Slot* s, void* base, const CarveSizes& z) {
  return z.store == DType::F32 ? carve_slot<float>(s, base, z) : carve_slot<uint16_t>(s, base, z);
}

int64_t carve_work16(Work16* w, void* base, const CarveSizes& z, int64_t head_rows) {
  const int64_t C = z.C, N = z.N, R = z.R;
  const bool b16 = z.store != DType::F32;
  bool full = false;
  for (int64_t l = 0; l < z.L; l++) full = full || z.policy(l) == Recompute::Full;
  Carver cv(base);
  LayerActs a{};
  // 16-bit: every array (a layer computes here, then stores); f32: those some layer does not store.
  for_each_array(z, [&](F f, auto field, int64_t n) { field(a) = b16 || some_layer_drops(z, f) ? cv.take(n) : nullptr; });
  carve_stats(cv, z, &a, [&](F f) { return some_layer_drops(z, f); });
  // x[0]: x_i loaded from 16 bits; x[1]: the output of a layer's forward (full recomputation: discarded).
  float* x0 = b16 ? cv.take(R * C) : nullptr;
  float* x1 = b16 || full ? cv.take(R * C) : nullptr;
  const int64_t head = z.head && b16 ? 1 : 0;
  float* lnf = cv.take(head * N * C);
  float* logits = cv.take(head * head_rows * z.V);
  float* losses = cv.take(head * head_rows);
  if (w) {
    w->own = w->layer = a, w->x[0] = x0, w->x[1] = x1, w->lnf = lnf, w->logits = logits, w->losses = losses;
    w->head_rows = head_rows;
  }
  return cv.used();
}

int64_t carve_grads(Slot* s, void* base, const CarveSizes& z, bool split) {
  const int64_t C = z.C, N = z.N, L = z.L;
  Carver cv(base);
  const int64_t n_dx = split ? L + 1 : 2;
  const int64_t n_layers = split ? L : 1;
  std::vector<float*> dx(n_dx);
  for (auto& p : dx) p = cv.take(N * C);
  std::vector<LayerGrads> dl(n_layers);
  bool any_dense = false;
  for (int64_t l = 0; l < L; l++) any_dense = any_dense || z.dense_field(l, F::Fch);
  for (int64_t l = 0; l < n_layers; l++) {
    LayerGrads& g = dl[l];
    g.dfch = (split ? z.dense_field(l, F::Fch) : any_dense) ? cv.take(N * z.FU) : nullptr;
    g.dln2 = cv.take(N * C);
    g.dres1 = cv.take(N * C);
    g.dqkv = cv.take(N * z.QKV);
    g.dln1 = cv.take(N * C);
  }
  float* dlnf = cv.take((z.head ? 1 : 0) * N * C);
  float* s4 = cv.take(N * z.F);
  float* sc = cv.take(N * z.A);
  float* ln = z.sp ? cv.take(2 * C) : nullptr;
  std::vector<LayerActs> kept(split ? L : 0);
  for (int64_t l = 0; l < static_cast<int64_t>(kept.size()); l++) {
    const Recompute r = z.policy(l);
    if (r == Recompute::None) continue;
    for_each_array(z, [&](F f, auto field, int64_t n) {
      field(kept[l]) = kept_for_weight(r, f) && z.dense_field(l, f) ? cv.take(n) : nullptr;
    });
    carve_stats(cv, z, &kept[l], [&](F f) { return kept_for_weight(r, f); });
  }
  if (s) {
    s->dx = dx, s->dlayers = dl, s->dlnf = dlnf, s->scratch4c = s4, s->scratch_c = sc, s->ln_scratch = ln;
    s->kept = std::move(kept);
  }
  return cv.used();
}

void prepare_grads(Slot& s, const CarveSizes& now, const CarveSizes& capacity, bool split) {
  if (s.grad_mem.empty() || (split && !s.split_capacity) ||
      static_cast<size_t>(carve_grads(nullptr, nullptr, now, split)) > s.grad_mem.bytes()) {
    s.grad_mem = Buffer(carve_grads(nullptr, nullptr, capacity, split), MemCategory::Activations);
    s.split_capacity = split;
  }
  carve_grads(&s, s.grad_mem.data(), now, split);
  s.split = split;
}

void store_layer(DType t, const LayerActs& a, const PackedLayer& p, const CarveSizes& z) {
  LayerActs src = a;
  PackedLayer dst = p;
  for_each_array(z, [&](F, auto field, int64_t n) {
    if (field(dst)) k::store_16bit(t, field(src), field(dst), n);
  });
}

void load_layer(DType t, const PackedLayer& p, const LayerActs& a, const CarveSizes& z) {
  PackedLayer src = p;
  LayerActs dst = a;
  for_each_array(z, [&](F, auto field, int64_t n) {
    if (field(src)) k::load_16bit(t, field(src), field(dst), n);
  });
}

}  // namespace lattice::model
