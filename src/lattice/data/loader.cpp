#include "lattice/data/loader.h"

#include <glob.h>

#include <algorithm>
#include <cstring>

#include "lattice/core/error.h"
#include "lattice/core/rng.h"

namespace lattice::data {
namespace {

std::vector<std::string> expand_glob(const std::string& pattern) {
  glob_t g;
  std::memset(&g, 0, sizeof(g));
  int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  LATTICE_CHECK(rc == 0 || rc == GLOB_NOMATCH, "data pattern '" << pattern << "': cannot read the folder it names");
  LATTICE_CHECK(!paths.empty(), "data pattern '" << pattern
                                    << "' matches no file (make shards with `lattice prepare --input FILE --out DIR`)");
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace

struct DataLoader::Impl {
  LoaderOptions opt;
  std::vector<MappedShard> shards;
  std::vector<ShardInfo> infos;
  std::vector<int64_t> shard_start;  // first global token index of each shard; back() = N
  int64_t num_tokens = 0;
  int64_t sequences = 0;  // S
  int64_t global = 0;     // G = dp_size*B*micro_batches
  int64_t steps = 0;      // S / G
  uint64_t epoch = 0;
  uint64_t position = 0;  // steps taken in this epoch
  int micro = 0;          // micro-batches taken in the current step
  std::vector<uint32_t> order;  // permutation of the current epoch
  std::vector<int32_t> window;  // scratch, T+1 tokens

  void build_order() {
    order.resize(static_cast<size_t>(sequences));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
    if (!opt.shuffle) return;
    Rng rng(opt.seed, kShuffleStream + epoch);
    for (size_t i = order.size(); i > 1; --i) {
      size_t j = static_cast<size_t>(rng.next_below(i));
      std::swap(order[i - 1], order[j]);
    }
  }

  // Copies tokens [start, start+count) of the stream into out, checking each.
  void copy_tokens(int64_t start, int64_t count, int32_t* out) const {
    // Shard s holds [shard_start[s], shard_start[s+1]).
    size_t s = static_cast<size_t>(std::upper_bound(shard_start.begin(), shard_start.end(), start) -
                                   shard_start.begin()) - 1;
    while (count > 0) {
      const MappedShard& shard = shards[s];
      int64_t offset = start - shard_start[s];
      int64_t n = std::min(count, shard.num_tokens() - offset);
      const uint16_t* src = shard.tokens() + offset;
      check_token_range(shard.path(), src, n, offset, opt.vocab_size);
      for (int64_t i = 0; i < n; ++i) out[i] = src[i];
      out += n, start += n, count -= n;
      ++s;
    }
  }

  // Global sequence index of row b of this rank's next micro-batch; advances nothing.
  int64_t sequence_of_row(int b) const {
    const uint64_t slot = position * static_cast<uint64_t>(global) +
                          (static_cast<uint64_t>(micro) * opt.dp_size + opt.dp_rank) * opt.B + b;
    return order[slot];
  }

  void begin_micro_batch() {
    if (micro == 0 && position == static_cast<uint64_t>(steps)) {
      ++epoch;
      position = 0;
      build_order();
    }
  }

  void end_micro_batch() {
    if (++micro == opt.micro_batches) {
      micro = 0;
      ++position;
    }
  }
};

DataLoader::DataLoader(const LoaderOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.opt = options;
  LATTICE_CHECK(options.B >= 1, "data loader: batch size B=" << options.B << " must be at least 1");
  LATTICE_CHECK(options.T >= 1, "data loader: sequence length T=" << options.T << " must be at least 1");
  LATTICE_CHECK(options.dp_size >= 1 && options.dp_rank >= 0 && options.dp_rank < options.dp_size,
                "data loader: dp_rank=" << options.dp_rank << " must be in [0, dp_size=" << options.dp_size << ")");
  LATTICE_CHECK(options.micro_batches >= 1,
                "data loader: micro_batches=" << options.micro_batches << " must be at least 1");
  LATTICE_CHECK(options.vocab_size >= 1 && options.vocab_size <= 65536,
                "data loader: vocab_size=" << options.vocab_size
                                           << " must be in [1, 65536] (shards hold uint16 tokens)");
  d.shard_start.push_back(0);
  for (const std::string& path : expand_glob(options.pattern)) {
    d.shards.emplace_back(path);
    d.infos.push_back({path, d.shards.back().num_tokens()});
    d.num_tokens += d.shards.back().num_tokens();
    d.shard_start.push_back(d.num_tokens);
  }
  const int64_t T = options.T;
  d.sequences = d.num_tokens > 0 ? (d.num_tokens - 1) / T : 0;
  d.global = static_cast<int64_t>(options.dp_size) * options.B * options.micro_batches;
  LATTICE_CHECK(d.sequences >= d.global,
                "data pattern '" << options.pattern << "' holds " << d.num_tokens << " tokens in " << d.shards.size()
                                 << " shard(s): " << d.sequences << " sequences of T+1=" << T + 1
                                 << " tokens, fewer than one step needs (the global batch: dp x micro-batch size x "
                                    "micro-batches = "
                                 << d.global << ")");
  LATTICE_CHECK(d.sequences <= static_cast<int64_t>(UINT32_MAX),
                "data pattern '" << options.pattern << "': " << d.sequences << " sequences, more than 2^32-1");
  d.steps = d.sequences / d.global;
  d.window.resize(static_cast<size_t>(T + 1));
  d.build_order();
}

DataLoader::DataLoader(DataLoader&&) noexcept = default;
DataLoader& DataLoader::operator=(DataLoader&&) noexcept = default;
DataLoader::~DataLoader() = default;

void DataLoader::next_batch(int32_t* inputs, int32_t* targets) {
  Impl& d = *impl_;
  d.begin_micro_batch();
  const int T = d.opt.T;
  for (int b = 0; b < d.opt.B; ++b) {
    d.copy_tokens(d.sequence_of_row(b) * T, T + 1, d.window.data());
    std::memcpy(inputs + static_cast<size_t>(b) * T, d.window.data(), sizeof(int32_t) * T);
    std::memcpy(targets + static_cast<size_t>(b) * T, d.window.data() + 1, sizeof(int32_t) * T);
  }
  d.end_micro_batch();
}

void DataLoader::next_windows(int32_t* windows) {
  Impl& d = *impl_;
  d.begin_micro_batch();
  const int T = d.opt.T;
  for (int b = 0; b < d.opt.B; ++b) d.copy_tokens(d.sequence_of_row(b) * T, T + 1, windows + static_cast<size_t>(b) * (T + 1));
  d.end_micro_batch();
}

int64_t DataLoader::sequences_per_epoch() const { return impl_->sequences; }
int64_t DataLoader::steps_per_epoch() const { return impl_->steps; }
int64_t DataLoader::global_batch() const { return impl_->global; }
int64_t DataLoader::epoch() const { return static_cast<int64_t>(impl_->epoch); }
int64_t DataLoader::num_tokens() const { return impl_->num_tokens; }
const std::vector<ShardInfo>& DataLoader::shards() const { return impl_->infos; }

DataLoader::State DataLoader::state() const {
  LATTICE_CHECK(impl_->micro == 0, "data loader: state() in the middle of a step (after micro-batch "
                                       << impl_->micro << " of " << impl_->opt.micro_batches << ")");
  return {impl_->epoch, impl_->position};
}

void DataLoader::restore(const State& state) {
  Impl& d = *impl_;
  LATTICE_CHECK(state.position <= static_cast<uint64_t>(d.steps),
                "data loader: saved position " << state.position << " is past the end of an epoch ("
                                               << d.steps << " steps); was the checkpoint made with other data or batch sizes?");
  if (state.epoch != d.epoch) {
    d.epoch = state.epoch;
    d.build_order();
  }
  d.position = state.position;
  d.micro = 0;
}

void DataLoader::reset() { restore({0, 0}); }

}  // namespace lattice::data
