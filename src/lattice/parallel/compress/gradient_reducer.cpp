#include "lattice/parallel/compress/gradient_reducer.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "lattice/core/error.h"
#include "lattice/kernels/ops.h"

namespace lattice::parallel {

void average_replicated_grads(const GradientReducer& reducer, const optim::AdamW& optimizer, comm::Communicator& tp) {
  const GradCodec c = reducer.options().spec.codec;
  const bool mixes = c == GradCodec::Int8 || c == GradCodec::OneBit || c == GradCodec::TopK || c == GradCodec::PowerSgd;
  if (tp.size() == 1 || !reducer.compressing() || !mixes) return;
  // One all-reduce: a segment whole on every rank has one place in the
  // buffer; a piece held by r ranks has a place per piece (t / r of them),
  // where its r holders put their values and the others zeros, so each
  // place sums one piece's copies.
  const int t = tp.size();
  auto places = [t](const optim::AdamWSegment& s) { return s.replicas == 0 ? 1 : t / s.replicas; };
  auto holders = [t](const optim::AdamWSegment& s) { return s.replicas == 0 ? t : s.replicas; };
  auto place = [&tp](const optim::AdamWSegment& s) { return s.replicas == 0 ? 0 : tp.rank() / s.replicas; };
  int64_t n = 0;
  for (const optim::AdamWSegment& s : optimizer.segments())
    if (s.replicas != 1) n += s.n * places(s);
  if (n == 0) return;
  std::vector<float> values(static_cast<size_t>(n), 0.0f);
  int64_t at = 0;
  for (const optim::AdamWSegment& s : optimizer.segments())
    if (s.replicas != 1)
      std::memcpy(values.data() + at + s.n * place(s), s.grad, sizeof(float) * s.n), at += s.n * places(s);
  tp.all_reduce(values.data(), values.size(), DType::F32, comm::ReduceOp::Sum);
  at = 0;
  for (const optim::AdamWSegment& s : optimizer.segments()) {
    if (s.replicas == 1) continue;
    float* mine = values.data() + at + s.n * place(s);
    kernels::scale_inplace(mine, 1.0f / static_cast<float>(holders(s)), s.n);
    std::memcpy(const_cast<float*>(s.grad), mine, sizeof(float) * s.n);
    at += s.n * places(s);
  }
}

namespace {

// Scratch of the compressed collectives. They run one at a time (on the
// communication thread, or inline on the posting thread), so one set per
// thread serves every reducer.
struct Scratch {
  std::vector<uint8_t> send, recv;
  std::vector<float> decoded, sum;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

GradientReducer::GradientReducer(comm::CommStream& stream, const CompressionOptions& options)
    : stream_(stream), options_(options) {
  if (options_.spec.codec == GradCodec::TopK)
    LATTICE_CHECK(options_.spec.topk_ratio > 0 && options_.spec.topk_ratio <= 1,
                  "compression.topk_ratio=" << options_.spec.topk_ratio << " must be in (0, 1]");
  LATTICE_CHECK(options_.warmup_steps >= 0, "compression.warmup_steps=" << options_.warmup_steps << " must be >= 0");
  if (options_.spec.codec == GradCodec::PowerSgd)
    LATTICE_CHECK(options_.spec.powersgd_rank >= 1,
                  "compression.rank=" << options_.spec.powersgd_rank << " must be >= 1");
}

GradientReducer::Errors& GradientReducer::errors_of(int64_t key, int64_t chunk_numel, int64_t k, bool server) {
  Errors& e = errors_[key];
  const size_t worker = static_cast<size_t>(chunk_numel) * sizeof(float);
  if (e.worker.bytes() < worker) e.worker = Buffer(worker, MemCategory::Grads);  // zero-filled
  if (server && e.server.bytes() < static_cast<size_t>(k) * sizeof(float))
    e.server = Buffer(static_cast<size_t>(k) * sizeof(float), MemCategory::Grads);
  return e;
}

size_t GradientReducer::error_bytes() const {
  size_t b = 0;
  for (const auto& [key, e] : errors_) b += e.worker.bytes() + e.server.bytes();
  return b + powersgd_.state_bytes();
}

void GradientReducer::scale_errors(float f) {
  stream_.wait_all();
  for (auto& [key, e] : errors_) scale_error_buffer(e.worker, f), scale_error_buffer(e.server, f);
  powersgd_.scale_errors(f);
}

// err = x - decoded, where finite: a non-finite value (an overflow, whose
// step is skipped) is not carried into the next step.
static void carry_error(float* err, const float* x, const float* decoded, int64_t k) {
  for (int64_t i = 0; i < k; i++) {
    const float d = x[i] - decoded[i];
    err[i] = std::isfinite(d) ? d : 0.0f;
  }
}

void GradientReducer::compressed_scatter(comm::Communicator& comm, float* chunk, int64_t k, float* sum, Errors* e) {
  const int n = comm.size();
  const CodecSpec& spec = options_.spec;
  LATTICE_CHECK(spec.codec != GradCodec::PowerSgd,
                "internal: a PowerSGD reduction posted as a chunk operation (use the *_lowrank ones)");
  const size_t P = payload_bytes(spec, k);
  Scratch& s = scratch();
  s.send.resize(P * n);
  s.recv.resize(P * n);
  s.decoded.resize(static_cast<size_t>(k));
  float* ew = e ? e->worker.as<float>() : nullptr;
  for (int j = 0; j < n; j++) {
    float* x = chunk + static_cast<int64_t>(j) * k;
    if (ew) {
      float* err = ew + static_cast<int64_t>(j) * k;
      for (int64_t i = 0; i < k; i++) x[i] += err[i];
      encode(spec, x, k, s.send.data() + P * j, s.decoded.data());
      carry_error(err, x, s.decoded.data(), k);
    } else {
      encode(spec, x, k, s.send.data() + P * j, nullptr);
    }
  }
  comm.all_to_all(s.send.data(), s.recv.data(), P / 4, DType::F32);  // opaque 4-byte words
  std::memset(sum, 0, static_cast<size_t>(k) * sizeof(float));
  for (int j = 0; j < n; j++) decode_add(spec, s.recv.data() + P * j, k, sum);  // in rank order: deterministic
}

comm::CommStream::Ticket GradientReducer::all_reduce(int64_t key, float* chunk, int64_t k, std::string label) {
  const int n = stream_.comm().size();
  const uint64_t plain = 2ull * static_cast<uint64_t>(n - 1) * static_cast<uint64_t>(k) * sizeof(float);
  uncompressed_ += plain;
  if (!compressing_) {
    sent_ += plain;
    return stream_.all_reduce(chunk, static_cast<size_t>(n * k), DType::F32, std::move(label));
  }
  Errors* e = options_.error_feedback ? &errors_of(key, n * k, k, true) : nullptr;
  return stream_.run(std::move(label), [this, chunk, k, e](comm::Communicator& comm) {
    const uint64_t before = comm.stats().bytes_sent;
    const int ranks = comm.size();
    const CodecSpec& spec = options_.spec;
    const size_t P = payload_bytes(spec, k);
    Scratch& s = scratch();
    s.sum.resize(static_cast<size_t>(k));
    compressed_scatter(comm, chunk, k, s.sum.data(), e);
    // This rank's block of the sum, compressed again (with its own error) and gathered by everyone.
    float* y = s.sum.data();
    uint8_t* mine = s.send.data();  // free again after the all_to_all
    if (e) {
      float* es = e->server.as<float>();
      for (int64_t i = 0; i < k; i++) y[i] += es[i];
      encode(spec, y, k, mine, s.decoded.data());
      carry_error(es, y, s.decoded.data(), k);
    } else {
      encode(spec, y, k, mine, nullptr);
    }
    comm.all_gather(mine, s.recv.data(), P / 4, DType::F32);
    for (int j = 0; j < ranks; j++) decode(spec, s.recv.data() + P * j, k, chunk + static_cast<int64_t>(j) * k);
    sent_ += comm.stats().bytes_sent - before;
  });
}

comm::CommStream::Ticket GradientReducer::reduce_scatter(int64_t key, float* chunk, int64_t k, float* dst,
                                                         bool accumulate, std::string label) {
  auto place = [k, dst, accumulate](const float* sum) {
    if (accumulate) {
      for (int64_t i = 0; i < k; i++) dst[i] += sum[i];
    } else if (dst != sum) {
      std::memmove(dst, sum, static_cast<size_t>(k) * sizeof(float));
    }
  };
  const int n = stream_.comm().size();
  const uint64_t plain = static_cast<uint64_t>(n - 1) * static_cast<uint64_t>(k) * sizeof(float);
  uncompressed_ += plain;
  if (!compressing_) {  // in place: this rank's sum lands at the chunk's start
    sent_ += plain;
    return stream_.reduce_scatter(chunk, chunk, static_cast<size_t>(k), std::move(label),
                                  [chunk, place] { place(chunk); });
  }
  Errors* e = options_.error_feedback ? &errors_of(key, n * k, k, false) : nullptr;
  return stream_.run(std::move(label), [this, chunk, k, e, place](comm::Communicator& comm) {
    const uint64_t before = comm.stats().bytes_sent;
    Scratch& s = scratch();
    s.sum.resize(static_cast<size_t>(k));
    compressed_scatter(comm, chunk, k, s.sum.data(), e);
    place(s.sum.data());
    sent_ += comm.stats().bytes_sent - before;
  });
}

comm::CommStream::Ticket GradientReducer::post_lowrank(int64_t key, float* data, const LowRankLayout& layout,
                                                       int64_t chunks, int64_t k, uint64_t uncompressed,
                                                       comm::CommStream::Then then, std::string label) {
  const int n = stream_.comm().size();
  LATTICE_CHECK(lowrank(), "internal: a PowerSGD reduction posted while not compressing with it");
  LATTICE_CHECK(layout.extent <= chunks * n * k,
                "internal: PowerSGD layout of " << layout.extent << " floats over a buffer of " << chunks * n * k);
  uncompressed_ += uncompressed;
  PowerSgd::State* state = &powersgd_.state(key, layout, options_.error_feedback);
  return stream_.run(
      std::move(label),
      [this, state, data, &layout](comm::Communicator& comm) {
        const uint64_t before = comm.stats().bytes_sent;
        powersgd_.reduce(comm, *state, data, layout);
        sent_ += comm.stats().bytes_sent - before;
      },
      std::move(then));
}

comm::CommStream::Ticket GradientReducer::all_reduce_lowrank(int64_t key, float* data, const LowRankLayout& layout,
                                                             int64_t chunks, int64_t k, std::string label) {
  const uint64_t n = static_cast<uint64_t>(stream_.comm().size());
  const uint64_t plain = 2ull * (n - 1) * static_cast<uint64_t>(chunks * k) * sizeof(float);
  return post_lowrank(key, data, layout, chunks, k, plain, {}, std::move(label));
}

comm::CommStream::Ticket GradientReducer::reduce_scatter_lowrank(int64_t key, float* data, const LowRankLayout& layout,
                                                                 int64_t chunks, int64_t k, float* dst,
                                                                 int64_t dst_stride, bool accumulate,
                                                                 std::string label) {
  const int n = stream_.comm().size(), rank = stream_.comm().rank();
  const uint64_t plain = static_cast<uint64_t>(n - 1) * static_cast<uint64_t>(chunks * k) * sizeof(float);
  auto place = [data, chunks, k, n, rank, dst, dst_stride, accumulate] {
    for (int64_t c = 0; c < chunks; c++) {
      const float* sum = data + c * n * k + static_cast<int64_t>(rank) * k;
      float* to = dst + c * dst_stride;
      if (accumulate) {
        for (int64_t i = 0; i < k; i++) to[i] += sum[i];
      } else if (to != sum) {
        std::memmove(to, sum, static_cast<size_t>(k) * sizeof(float));
      }
    }
  };
  return post_lowrank(key, data, layout, chunks, k, plain, place, std::move(label));
}

}  // namespace lattice::parallel
