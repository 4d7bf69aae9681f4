// DataLoader: window layout, DP disjointness and layout independence, seeded
// order, save/restore, and its errors.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "lattice/data/loader.h"
#include "lattice/data/shard.h"
#include "test_util.h"

namespace lattice::data {
namespace {

using testing::expect_error;
using testing::TempDir;

// Shards whose concatenation is the tokens 0, 1, 2, ..., so a window names itself.
void write_counting_shards(const TempDir& dir, const std::vector<int>& sizes) {
  uint16_t next = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<uint16_t> t(sizes[s]);
    for (auto& x : t) x = next++;
    char name[32];
    std::snprintf(name, sizeof(name), "train_%06zu.bin", s);
    write_shard(dir.file(name), t);
  }
}

LoaderOptions options(const TempDir& dir, int B, int T) {
  LoaderOptions o;
  o.pattern = dir.path() + "/train_*.bin";
  o.B = B;
  o.T = T;
  return o;
}

// Start token of each row of one batch (every window is consecutive integers).
std::vector<int> batch_starts(DataLoader& loader, int B, int T) {
  std::vector<int32_t> in(B * T), tg(B * T);
  loader.next_batch(in.data(), tg.data());
  std::vector<int> starts;
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(in[b * T + t], in[b * T] + t);
      EXPECT_EQ(tg[b * T + t], in[b * T] + t + 1);
    }
    starts.push_back(in[b * T]);
  }
  return starts;
}

TEST(DataLoader, SequentialWindowsShareBoundaryTokensAcrossShards) {
  TempDir dir;
  write_counting_shards(dir, {7, 13, 5});  // 25 tokens; windows span shards
  LoaderOptions o = options(dir, 2, 4);
  o.shuffle = false;
  DataLoader loader(o);
  EXPECT_EQ(loader.num_tokens(), 25);
  EXPECT_EQ(loader.sequences_per_epoch(), 6);  // (25-1)/4
  EXPECT_EQ(loader.steps_per_epoch(), 3);
  ASSERT_EQ(loader.shards().size(), 3u);
  EXPECT_EQ(loader.shards()[1].num_tokens, 13);
  EXPECT_EQ(batch_starts(loader, 2, 4), (std::vector<int>{0, 4}));
  EXPECT_EQ(batch_starts(loader, 2, 4), (std::vector<int>{8, 12}));
  EXPECT_EQ(batch_starts(loader, 2, 4), (std::vector<int>{16, 20}));  // window 5 = tokens 20..24
  EXPECT_EQ(loader.epoch(), 0);
  EXPECT_EQ(batch_starts(loader, 2, 4), (std::vector<int>{0, 4}));
  EXPECT_EQ(loader.epoch(), 1);
  std::vector<int32_t> windows(2 * 5);
  loader.next_windows(windows.data());
  EXPECT_EQ(windows, (std::vector<int32_t>{8, 9, 10, 11, 12, 12, 13, 14, 15, 16}));
}

TEST(DataLoader, EpochIsASeededPermutation) {
  TempDir dir;
  write_counting_shards(dir, {1000, 601});  // 1601 tokens, T=8: 200 windows
  LoaderOptions o = options(dir, 5, 8);
  o.seed = 42;
  DataLoader a(o), b(o);
  o.seed = 43;
  DataLoader c(o);
  ASSERT_EQ(a.steps_per_epoch(), 40);
  std::vector<int> epoch0, epoch1, other_seed;
  for (int s = 0; s < 40; ++s) {
    auto x = batch_starts(a, 5, 8);
    EXPECT_EQ(x, batch_starts(b, 5, 8));  // same seed, same order
    auto y = batch_starts(c, 5, 8);
    epoch0.insert(epoch0.end(), x.begin(), x.end());
    other_seed.insert(other_seed.end(), y.begin(), y.end());
  }
  for (int s = 0; s < 40; ++s) {
    auto x = batch_starts(a, 5, 8);
    epoch1.insert(epoch1.end(), x.begin(), x.end());
  }
  std::set<int> all0(epoch0.begin(), epoch0.end()), all1(epoch1.begin(), epoch1.end());
  EXPECT_EQ(all0.size(), 200u);  // every window exactly once per epoch
  EXPECT_EQ(all1.size(), 200u);
  for (int s : all0) EXPECT_EQ(s % 8, 0);
  EXPECT_NE(epoch0, epoch1);  // a new permutation each epoch
  EXPECT_NE(epoch0, other_seed);
  std::vector<int> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, epoch0);  // shuffled at all
}

// The order of consumption does not depend on how dp_size * B * steps is
// factored: rank-major concatenation of one step on every rank equals the
// one-process batch, and DP ranks never share a sequence within an epoch.
TEST(DataLoader, DataParallelRanksAreDisjointAndLayoutIndependent) {
  TempDir dir;
  write_counting_shards(dir, {3000, 2001});  // 5001 tokens, T=10: 500 windows
  auto run = [&](int dp_size, int B, int steps) {
    std::vector<std::unique_ptr<DataLoader>> ranks;
    for (int r = 0; r < dp_size; ++r) {
      LoaderOptions o = options(dir, B, 10);
      o.seed = 7;
      o.dp_rank = r;
      o.dp_size = dp_size;
      ranks.push_back(std::make_unique<DataLoader>(o));
    }
    std::vector<int> order;
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < dp_size; ++r) {
        auto x = batch_starts(*ranks[r], B, 10);
        order.insert(order.end(), x.begin(), x.end());
      }
    return order;
  };
  std::vector<int> one = run(1, 20, 25);   // 500 sequences = one epoch
  EXPECT_EQ(std::set<int>(one.begin(), one.end()).size(), 500u);
  EXPECT_EQ(run(2, 10, 25), one);
  EXPECT_EQ(run(4, 5, 25), one);
  EXPECT_EQ(run(1, 5, 100), one);  // = dp 1 with 4 accumulation micro-steps
  EXPECT_EQ(run(5, 4, 25), one);
  // Across an epoch boundary too.
  std::vector<int> two = run(1, 20, 50), two_dp = run(4, 5, 50);
  EXPECT_EQ(two, two_dp);
}

TEST(DataLoader, SameDpRankReadsTheSameSequences) {
  // TP/CP peers build their loader with the same dp coordinates.
  TempDir dir;
  write_counting_shards(dir, {2000});
  LoaderOptions o = options(dir, 3, 16);
  o.dp_rank = 1;
  o.dp_size = 2;
  o.seed = 5;
  DataLoader tp0(o), tp1(o);
  for (int s = 0; s < 30; ++s) EXPECT_EQ(batch_starts(tp0, 3, 16), batch_starts(tp1, 3, 16));
}

TEST(DataLoader, RestoreContinuesBitIdentically) {
  TempDir dir;
  write_counting_shards(dir, {999});
  LoaderOptions o = options(dir, 4, 8);  // 124 windows, 31 steps per epoch
  o.seed = 1234;
  DataLoader a(o);
  for (int s = 0; s < 45; ++s) batch_starts(a, 4, 8);  // into the second epoch
  DataLoader::State saved = a.state();
  EXPECT_EQ(saved.epoch, 1u);
  EXPECT_EQ(saved.position, 14u);
  std::vector<std::vector<int>> expected;
  for (int s = 0; s < 40; ++s) expected.push_back(batch_starts(a, 4, 8));
  DataLoader b(o);
  b.restore(saved);
  for (int s = 0; s < 40; ++s) EXPECT_EQ(batch_starts(b, 4, 8), expected[s]) << "step " << s;
  // reset() goes back to the very first batch.
  DataLoader fresh(o);
  auto first = batch_starts(fresh, 4, 8);
  b.reset();
  EXPECT_EQ(batch_starts(b, 4, 8), first);
  EXPECT_EQ(b.epoch(), 0);
  expect_error([&] { b.restore({0, 32}); }, {"saved position 32", "31 steps"});
}

TEST(DataLoader, Errors) {
  TempDir dir;
  expect_error([&] { DataLoader x(options(dir, 1, 4)); }, {"data pattern '" + dir.path() + "/train_*.bin'", "matches no file"});
  write_counting_shards(dir, {20});
  expect_error([&] { DataLoader x(options(dir, 5, 4)); }, {"holds 20 tokens", "4 sequences", "micro-batches = 5"});
  LoaderOptions o = options(dir, 1, 4);
  o.dp_rank = 2;
  o.dp_size = 2;
  expect_error([&] { DataLoader x(o); }, {"dp_rank=2", "dp_size=2"});
  expect_error([&] { DataLoader x(options(dir, 0, 4)); }, {"B=0"});
  expect_error([&] { DataLoader x(options(dir, 1, 0)); }, {"T=0"});
  o = options(dir, 1, 4);
  o.vocab_size = 70000;
  expect_error([&] { DataLoader x(o); }, {"vocab_size=70000", "65536"});
  // A token outside the vocabulary is reported with its file and offset when read.
  write_shard(dir.file("train_000001.bin"), std::vector<uint16_t>{1, 2, 3, 60000, 5});
  o = options(dir, 1, 4);
  o.shuffle = false;
  DataLoader loader(o);
  std::vector<int32_t> in(4), tg(4);
  for (int s = 0; s < 5; ++s) loader.next_batch(in.data(), tg.data());
  expect_error([&] { loader.next_batch(in.data(), tg.data()); },
               {dir.file("train_000001.bin"), "token 60000 at index 3", "byte offset 1030", "vocabulary size 50257"});
  // A corrupt shard is refused when the loader opens it.
  testing::write_file(dir.file("train_000002.bin"), "not a shard");
  expect_error([&] { DataLoader x(options(dir, 1, 4)); }, {dir.file("train_000002.bin"), "shorter than the 1024-byte header"});
}

}  // namespace
}  // namespace lattice::data
