#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/train/batches.h"

namespace lattice::train {

namespace {

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(int B, int T, int V, uint64_t seed, uint64_t stream, int dp_rank, int dp_size)
      : B_(B), T_(T), V_(V), seed_(seed), stream_(stream), dp_rank_(dp_rank), dp_size_(dp_size) {}

  void next(int32_t* inputs, int32_t* targets) override {
    for (int b = 0; b < B_; b++) {
      // Sequence id across the global batch: DP ranks take disjoint rows.
      uint64_t row = (batch_ * dp_size_ + dp_rank_) * static_cast<uint64_t>(B_) + b;
      Rng rng(seed_, stream_ * 0x100000000ull + row);
      int64_t start = static_cast<int64_t>(rng.next_below(V_));
      int64_t stride = 1 + static_cast<int64_t>(rng.next_below(8));
      for (int t = 0; t < T_; t++) {
        inputs[b * T_ + t] = static_cast<int32_t>((start + stride * t) % V_);
        targets[b * T_ + t] = static_cast<int32_t>((start + stride * (t + 1)) % V_);
      }
    }
    batch_++;
  }
  void reset() override { batch_ = 0; }
  io::JsonValue state() const override {
    io::JsonValue s = io::JsonValue::object();
    s.set("kind", io::JsonValue::string("synthetic"));
    s.set("batch", io::JsonValue::unsigned_integer(batch_));
    return s;
  }
  void restore(const io::JsonValue& s) override {
    LATTICE_CHECK(s.at("kind").as_string() == "synthetic",
                  "checkpoint was saved with data from '" << s.at("kind").as_string()
                                                          << "' but this run uses synthetic tokens (data.train is empty)");
    LATTICE_CHECK(s.at("batch").get_u64(&batch_), "checkpoint loader position 'batch' is not an integer");
  }
  std::string describe() const override {
    return "synthetic arithmetic sequences (no data.train set), vocab " + std::to_string(V_);
  }

 private:
  int B_, T_, V_;
  uint64_t seed_, stream_;
  int dp_rank_, dp_size_;
  uint64_t batch_ = 0;
};

}  // namespace

std::unique_ptr<BatchSource> make_synthetic_source(int B, int T, int vocab_size, uint64_t seed, uint64_t stream,
                                                   int dp_rank, int dp_size) {
  return std::make_unique<SyntheticSource>(B, T, vocab_size, seed, stream, dp_rank, dp_size);
}

}  // namespace lattice::train
