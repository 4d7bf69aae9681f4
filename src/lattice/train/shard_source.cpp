#include "lattice/core/error.h"
#include "lattice/data/loader.h"
#include "lattice/train/batches.h"

namespace lattice::train {

namespace {

class ShardSource : public BatchSource {
 public:
  ShardSource(const data::LoaderOptions& o) : pattern_(o.pattern), loader_(o) {}
  void next(int32_t* inputs, int32_t* targets) override { loader_.next_batch(inputs, targets); }
  void reset() override { loader_.reset(); }
  io::JsonValue state() const override {
    data::DataLoader::State st = loader_.state();
    io::JsonValue s = io::JsonValue::object();
    s.set("kind", io::JsonValue::string("shards"));
    s.set("pattern", io::JsonValue::string(pattern_));
    s.set("epoch", io::JsonValue::unsigned_integer(st.epoch));
    s.set("position", io::JsonValue::unsigned_integer(st.position));
    return s;
  }
  void restore(const io::JsonValue& s) override {
    LATTICE_CHECK(s.at("kind").as_string() == "shards",
                  "checkpoint was saved with synthetic tokens but this run reads data.train='" << pattern_ << "'");
    data::DataLoader::State st{};
    LATTICE_CHECK(s.at("epoch").get_u64(&st.epoch) && s.at("position").get_u64(&st.position),
                  "checkpoint loader position is not a pair of integers");
    loader_.restore(st);
  }
  std::string describe() const override {
    return "'" + pattern_ + "': " + std::to_string(loader_.shards().size()) + " shard(s), " +
           std::to_string(loader_.num_tokens()) + " tokens, " + std::to_string(loader_.steps_per_epoch()) +
           " batches per epoch";
  }

 private:
  std::string pattern_;
  data::DataLoader loader_;
};

}  // namespace

std::unique_ptr<BatchSource> make_shard_source(const std::string& pattern, int B, int T, int vocab_size,
                                               uint64_t seed, bool shuffle, int dp_rank, int dp_size) {
  data::LoaderOptions o;
  o.pattern = pattern;
  o.B = B;
  o.T = T;
  o.vocab_size = vocab_size;
  o.seed = seed;
  o.shuffle = shuffle;
  o.dp_rank = dp_rank;
  o.dp_size = dp_size;
  return std::make_unique<ShardSource>(o);
}

}  // namespace lattice::train
