#include "lattice/parallel/compress/gradient_reducer.h"

#include <cstring>
#include <vector>

#include "lattice/core/error.h"

namespace lattice::parallel {

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

GradientReducer::GradientReducer(CommStream& stream, const CompressionOptions& options)
    : stream_(stream), options_(options) {
  if (options_.spec.codec == GradCodec::TopK)
    LATTICE_CHECK(options_.spec.topk_ratio > 0 && options_.spec.topk_ratio <= 1,
                  "compression.topk_ratio=" << options_.spec.topk_ratio << " must be in (0, 1]");
  LATTICE_CHECK(options_.warmup_steps >= 0, "compression.warmup_steps=" << options_.warmup_steps << " must be >= 0");
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
  return b;
}

void GradientReducer::compressed_scatter(comm::Communicator& comm, float* chunk, int64_t k, float* sum, Errors* e) {
  const int n = comm.size();
  const CodecSpec& spec = options_.spec;
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
      for (int64_t i = 0; i < k; i++) err[i] = x[i] - s.decoded[i];
    } else {
      encode(spec, x, k, s.send.data() + P * j, nullptr);
    }
  }
  comm.all_to_all(s.send.data(), s.recv.data(), P / 4, DType::F32);  // opaque 4-byte words
  std::memset(sum, 0, static_cast<size_t>(k) * sizeof(float));
  for (int j = 0; j < n; j++) decode_add(spec, s.recv.data() + P * j, k, sum);  // in rank order: deterministic
}

CommStream::Ticket GradientReducer::all_reduce(int64_t key, float* chunk, int64_t k, std::string label) {
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
      for (int64_t i = 0; i < k; i++) es[i] = y[i] - s.decoded[i];
    } else {
      encode(spec, y, k, mine, nullptr);
    }
    comm.all_gather(mine, s.recv.data(), P / 4, DType::F32);
    for (int j = 0; j < ranks; j++) decode(spec, s.recv.data() + P * j, k, chunk + static_cast<int64_t>(j) * k);
    sent_ += comm.stats().bytes_sent - before;
  });
}

CommStream::Ticket GradientReducer::reduce_scatter(int64_t key, float* chunk, int64_t k, float* dst, bool accumulate,
                                                   std::string label) {
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

}  // namespace lattice::parallel
