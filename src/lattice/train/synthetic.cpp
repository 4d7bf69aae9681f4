#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/train/batches.h"

namespace lattice::train {

namespace {

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(const BatchLayout& layout, int V, uint64_t seed, uint64_t stream)
      : layout_(layout), V_(V), seed_(seed), stream_(stream) {}

  void next(int32_t* inputs, int32_t* targets) override {
    const int B = layout_.B, T = layout_.T;
    for (int b = 0; b < B; b++) {
      // Sequence id across the stream: global batch `step_`, then the
      // loader's offset of this rank's micro-batch in it.
      const uint64_t row = step_ * static_cast<uint64_t>(layout_.global()) +
                           (static_cast<uint64_t>(micro_) * layout_.dp_size + layout_.dp_rank) * B + b;
      Rng rng(seed_, stream_ * 0x100000000ull + row);
      int64_t start = static_cast<int64_t>(rng.next_below(V_));
      int64_t stride = 1 + static_cast<int64_t>(rng.next_below(8));
      for (int t = 0; t < T; t++) {
        inputs[b * T + t] = static_cast<int32_t>((start + stride * t) % V_);
        targets[b * T + t] = static_cast<int32_t>((start + stride * (t + 1)) % V_);
      }
    }
    if (++micro_ == layout_.micro_batches) micro_ = 0, step_++;
  }
  void reset() override { step_ = 0, micro_ = 0; }
  io::JsonValue state() const override {
    LATTICE_CHECK(micro_ == 0, "synthetic data: state() in the middle of a step");
    io::JsonValue s = io::JsonValue::object();
    s.set("kind", io::JsonValue::string("synthetic"));
    s.set("batch", io::JsonValue::unsigned_integer(step_));
    s.set("global_batch", io::JsonValue::integer(layout_.global()));
    return s;
  }
  void restore(const io::JsonValue& s) override {
    LATTICE_CHECK(s.at("kind").as_string() == "synthetic",
                  "checkpoint was saved with data from '" << s.at("kind").as_string()
                                                          << "' but this run uses synthetic tokens (data.train is empty)");
    LATTICE_CHECK(s.at("batch").get_u64(&step_), "checkpoint loader position 'batch' is not an integer");
    check_global_batch(s, layout_.global(), layout_.micro_batches);
    micro_ = 0;
  }
  std::string describe() const override {
    return "synthetic arithmetic sequences (no data.train set), vocab " + std::to_string(V_);
  }

 private:
  BatchLayout layout_;
  int V_;
  uint64_t seed_, stream_;
  uint64_t step_ = 0;  // global batches taken
  int micro_ = 0;      // micro-batches taken in the current one
};

}  // namespace

std::unique_ptr<BatchSource> make_synthetic_source(const BatchLayout& layout, int vocab_size, uint64_t seed,
                                                   uint64_t stream) {
  return std::make_unique<SyntheticSource>(layout, vocab_size, seed, stream);
}

}  // namespace lattice::train
