#include "lattice/core/error.h"
#include "lattice/data/loader.h"
#include "lattice/train/batches.h"

namespace lattice::train {

namespace {

class ShardSource : public BatchSource {
 public:
  ShardSource(const data::LoaderOptions& o) : pattern_(o.pattern), micro_batches_(o.micro_batches), loader_(o) {}
  void next(int32_t* inputs, int32_t* targets) override { loader_.next_batch(inputs, targets); }
  void reset() override { loader_.reset(); }
  io::JsonValue state() const override {
    data::DataLoader::State st = loader_.state();
    io::JsonValue s = io::JsonValue::object();
    s.set("kind", io::JsonValue::string("shards"));
    s.set("pattern", io::JsonValue::string(pattern_));
    s.set("epoch", io::JsonValue::unsigned_integer(st.epoch));
    s.set("position", io::JsonValue::unsigned_integer(st.position));
    s.set("global_batch", io::JsonValue::integer(loader_.global_batch()));
    return s;
  }
  void restore(const io::JsonValue& s) override {
    LATTICE_CHECK(s.at("kind").as_string() == "shards",
                  "checkpoint was saved with synthetic tokens but this run reads data.train='" << pattern_ << "'");
    data::DataLoader::State st{};
    LATTICE_CHECK(s.at("epoch").get_u64(&st.epoch) && s.at("position").get_u64(&st.position),
                  "checkpoint loader position is not a pair of integers");
    check_global_batch(s, loader_.global_batch(), micro_batches_);
    loader_.restore(st);
  }
  std::string describe() const override {
    return "'" + pattern_ + "': " + std::to_string(loader_.shards().size()) + " shard(s), " +
           std::to_string(loader_.num_tokens()) + " tokens, " + std::to_string(loader_.steps_per_epoch()) +
           " steps of " + std::to_string(loader_.global_batch()) + " sequences per epoch";
  }

 private:
  std::string pattern_;
  int micro_batches_;
  data::DataLoader loader_;
};

}  // namespace

void check_global_batch(const io::JsonValue& state, int64_t global, int micro_batches) {
  // Positions count steps of one global batch. A checkpoint from before
  // global batches were recorded counted micro-batches of dp × B, which is the
  // same thing only when each step has one micro-batch.
  int64_t saved = 0;
  const io::JsonValue* g = state.find("global_batch");
  if (!g) {
    LATTICE_CHECK(micro_batches == 1,
                  "the checkpoint's data position predates global batches (it counts micro-batches, not steps) "
                  "and this run takes "
                      << micro_batches
                      << " micro-batches per step; resume it with train.global_batch_size = parallel.dp x "
                         "train.micro_batch_size (one micro-batch per step)");
    return;
  }
  LATTICE_CHECK(g->get_i64(&saved), "checkpoint loader field 'global_batch' is not an integer");
  LATTICE_CHECK(saved == global, "the checkpoint's data position counts steps of "
                                     << saved << " sequences but this run's global batch is " << global
                                     << " (parallel.dp x train.micro_batch_size x micro-batches per step); "
                                        "resume with train.global_batch_size="
                                     << saved << " to continue the same data stream");
}

std::unique_ptr<BatchSource> make_shard_source(const std::string& pattern, const BatchLayout& layout,
                                               int vocab_size, uint64_t seed, bool shuffle) {
  data::LoaderOptions o;
  o.pattern = pattern;
  o.B = layout.B;
  o.T = layout.T;
  o.vocab_size = vocab_size;
  o.seed = seed;
  o.shuffle = shuffle;
  o.dp_rank = layout.dp_rank;
  o.dp_size = layout.dp_size;
  o.micro_batches = layout.micro_batches;
  return std::make_unique<ShardSource>(o);
}

}  // namespace lattice::train
