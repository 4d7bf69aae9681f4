// Every Communicator operation against a serial reference, on whatever number
// of ranks mpiexec started (CTest runs 1, 2, 3, 4 and 8), for f32, bf16 and
// f16, with counts that the world size does not divide; and every byte
// counter against its formula.
//
// Each operation runs on three groups: the world, the world in reverse order
// (group rank != world rank) and the even/odd halves of the world. Input
// values are small integers (-5..5), so every sum over at most 8 ranks is
// exact in all three types and any reduction order must reproduce the serial
// reference bit for bit.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/runtime.h"
#include "lattice/core/dtype.h"
#include "lattice/core/error.h"

using namespace lattice;
using namespace lattice::comm;

namespace {

const DType kTypes[] = {DType::F32, DType::BF16, DType::F16};

float value(int world_rank, size_t i, int salt = 0) {
  return static_cast<float>(static_cast<int>((world_rank * 7 + i * 3 + salt * 5) % 11) - 5);
}

// A buffer of `n` elements of `dtype`, read and written as floats.
class Buf {
 public:
  Buf(DType t, size_t n) : dtype_(t), n_(n), bytes_(std::max<size_t>(n, 1) * dtype_size(t)) {}
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  size_t size() const { return n_; }
  void set(size_t i, float v) { convert(&v, DType::F32, bytes_.data() + i * dtype_size(dtype_), dtype_, 1); }
  float get(size_t i) const {
    float v;
    convert(bytes_.data() + i * dtype_size(dtype_), dtype_, &v, DType::F32, 1);
    return v;
  }
  void fill(const std::function<float(size_t)>& f) {
    for (size_t i = 0; i < n_; i++) set(i, f(i));
  }

 private:
  DType dtype_;
  size_t n_;
  std::vector<uint8_t> bytes_;
};

// Checks got(i) == want(i) for every i, reporting the first few mismatches only.
void expect_all(const std::string& what, size_t n, const std::function<float(size_t)>& got,
                const std::function<float(size_t)>& want) {
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    float g = got(i), w = want(i);
    if (g == w) continue;
    if (++bad <= 3) ADD_FAILURE() << what << ": element " << i << " is " << g << ", expected " << w;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements differ";
}

std::string label(const Communicator& c, const char* op, DType t, size_t n) {
  return std::string(op) + " on '" + c.name() + "' (" + std::to_string(c.size()) + " ranks), " + dtype_name(t) +
         ", count " + std::to_string(n);
}

// The groups every test runs on.
std::vector<std::unique_ptr<Communicator>> groups() {
  std::vector<std::unique_ptr<Communicator>> out;
  out.push_back(make_world_communicator());
  Communicator& world = *out[0];
  out.push_back(world.split(0, world.size() - 1 - world.rank(), "reversed"));
  out.push_back(world.split(world.rank() % 2, world.rank(), world.rank() % 2 ? "odd" : "even"));
  return out;
}

int me(const Communicator& c) { return c.world_ranks()[c.rank()]; }

// ---- byte formulas (communicator.h), written out independently ----

uint64_t block(size_t count, int n, int j) { return count / n + (static_cast<size_t>(j) < count % n ? 1 : 0); }

uint64_t ring_all_reduce_bytes(size_t count, size_t elem, int n, int r) {
  if (n == 1) return 0;
  return (2 * count - block(count, n, r) - block(count, n, (r + 1) % n)) * elem;
}

uint64_t delta_bytes(const CommStats& before, const CommStats& after, CommOp op) {
  return after.bytes(op) - before.bytes(op);
}

// A world communicator for the tests' own bookkeeping (collecting figures
// from every rank), separate from the groups under test so it does not touch
// their counters. Like every lattice wait, it is watched: a test whose ranks
// fall out of step is aborted by the watchdog instead of hanging.
Communicator& bookkeeping() {
  static std::unique_ptr<Communicator> world = make_world_communicator();
  return *world;
}

// Every rank's value (moved as raw 16-bit words, so the bits are untouched).
std::vector<uint64_t> all_gather_u64(uint64_t v) {
  std::vector<uint64_t> all(bookkeeping().size());
  bookkeeping().all_gather(&v, all.data(), 4, DType::BF16);
  return all;
}

// Sum over the group of this rank's `bytes`. Groups are told apart by their
// lowest world rank.
uint64_t group_total(const Communicator& c, uint64_t bytes) {
  uint64_t leader = static_cast<uint64_t>(*std::min_element(c.world_ranks().begin(), c.world_ranks().end()));
  std::vector<uint64_t> all = all_gather_u64(bytes), leaders = all_gather_u64(leader);
  uint64_t total = 0;
  for (size_t r = 0; r < all.size(); r++)
    if (leaders[r] == leader) total += all[r];
  return total;
}

}  // namespace

// ---------------------------------------------------------------- all_reduce

TEST(Collectives, AllReduceMatchesSerialReference) {
  for (auto& c : groups()) {
    for (DType t : kTypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{20011}}) {
          Buf b(t, count);
          b.fill([&](size_t i) { return value(me(*c), i); });
          CommStats before = c->stats();
          c->all_reduce(b.data(), count, t, op);
          CommStats after = c->stats();
          std::string what = label(*c, op == ReduceOp::Sum ? "all_reduce sum" : "all_reduce max", t, count);
          expect_all(what, count, [&](size_t i) { return b.get(i); },
                     [&](size_t i) {
                       float acc = op == ReduceOp::Sum ? 0.f : -INFINITY;
                       for (int w : c->world_ranks())
                         acc = op == ReduceOp::Sum ? acc + value(w, i) : std::max(acc, value(w, i));
                       return count ? acc : 0.f;
                     });
          uint64_t bytes = delta_bytes(before, after, CommOp::AllReduce);
          EXPECT_EQ(bytes, ring_all_reduce_bytes(count, dtype_size(t), c->size(), c->rank())) << what;
          EXPECT_EQ(after.calls_of(CommOp::AllReduce) - before.calls_of(CommOp::AllReduce), 1u);
          // Summed over the group: exactly 2(N-1) S.
          EXPECT_EQ(group_total(*c, bytes), 2ull * (c->size() - 1) * count * dtype_size(t)) << what;
        }
      }
    }
  }
}

TEST(Collectives, AllReduceOfRandomF32IsIdenticalOnEveryRank) {
  auto world = make_world_communicator();
  const size_t n = 100003;
  std::mt19937 rng(1234 + world->rank());
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  // Reference in double from everyone's inputs (regenerated here).
  std::vector<double> ref(n, 0.0);
  for (int r = 0; r < world->size(); r++) {
    std::mt19937 g(1234 + r);
    for (size_t i = 0; i < n; i++) ref[i] += dist(g);
  }
  world->all_reduce(x.data(), n, DType::F32, ReduceOp::Sum);
  double worst = 0;
  for (size_t i = 0; i < n; i++) worst = std::max(worst, std::abs(x[i] - ref[i]));
  EXPECT_LT(worst, 1e-5 * world->size());
  // Bit-identical results on all ranks.
  uint64_t h = 14695981039346656037ull;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(x.data());
  for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 1099511628211ull;
  std::vector<uint64_t> hashes = all_gather_u64(h);
  for (int r = 0; r < world->size(); r++) EXPECT_EQ(hashes[r], hashes[0]) << "rank " << r << " differs from rank 0";
}

TEST(Collectives, HalfPrecisionSumRoundsToNearestEvenOnce) {
  // With two contributions the f32 sum is exact and rounded once: 1 + 2^-9
  // is a quarter ulp of bf16 above 1 and must round to 1; 1 + 3*2^-9 (three
  // quarters of an ulp) to 1 + 2^-7.
  auto world = make_world_communicator();
  if (world->size() != 2) GTEST_SKIP() << "needs exactly 2 ranks";
  for (float extra : {std::ldexp(1.f, -9), 3 * std::ldexp(1.f, -9)}) {
    uint16_t v = f32_to_bf16(world->rank() == 0 ? 1.f : extra);
    world->all_reduce(&v, 1, DType::BF16, ReduceOp::Sum);
    EXPECT_EQ(bf16_to_f32(v), bf16_to_f32(f32_to_bf16(1.f + extra)));
  }
}

// ------------------------------------------------------------ reduce_scatter

TEST(Collectives, ReduceScatterMatchesSerialReference) {
  for (auto& c : groups()) {
    int n = c->size();
    for (DType t : kTypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        for (size_t per_rank : {size_t{1}, size_t{5}, size_t{1001}}) {
          Buf send(t, per_rank * n), recv(t, per_rank);
          send.fill([&](size_t i) { return value(me(*c), i); });
          CommStats before = c->stats();
          c->reduce_scatter(send.data(), recv.data(), per_rank, t, op);
          std::string what = label(*c, "reduce_scatter", t, per_rank);
          expect_all(what, per_rank, [&](size_t i) { return recv.get(i); },
                     [&](size_t i) {
                       size_t k = c->rank() * per_rank + i;
                       float acc = op == ReduceOp::Sum ? 0.f : -INFINITY;
                       for (int w : c->world_ranks())
                         acc = op == ReduceOp::Sum ? acc + value(w, k) : std::max(acc, value(w, k));
                       return acc;
                     });
          EXPECT_EQ(delta_bytes(before, c->stats(), CommOp::ReduceScatter),
                    uint64_t{per_rank} * (n - 1) * dtype_size(t))
              << what;
        }
      }
    }
  }
}

// Blocks from 256 KiB on take lattice's own ring (f32/f64 sums); in place,
// the result replaces the first block (MPI's convention).
TEST(Collectives, ReduceScatterLargeBlocksAndInPlace) {
  for (auto& c : groups()) {
    const int n = c->size();
    const size_t per_rank = 70001;  // 280 KB of f32
    for (bool in_place : {false, true}) {
      Buf send(DType::F32, per_rank * n), recv(DType::F32, in_place ? per_rank * n : per_rank);
      send.fill([&](size_t i) { return value(me(*c), i); });
      if (in_place) recv.fill([&](size_t i) { return value(me(*c), i); });
      CommStats before = c->stats();
      c->reduce_scatter(in_place ? recv.data() : send.data(), recv.data(), per_rank, DType::F32, ReduceOp::Sum);
      std::string what = label(*c, in_place ? "reduce_scatter in place" : "reduce_scatter", DType::F32, per_rank);
      expect_all(what, per_rank, [&](size_t i) { return recv.get(i); },
                 [&](size_t i) {
                   float acc = 0.f;
                   for (int w : c->world_ranks()) acc += value(w, c->rank() * per_rank + i);
                   return acc;
                 });
      EXPECT_EQ(delta_bytes(before, c->stats(), CommOp::ReduceScatter), uint64_t{per_rank} * (n - 1) * 4) << what;
    }
  }
}

TEST(Collectives, ReduceScatterVariableCounts) {
  for (auto& c : groups()) {
    int n = c->size();
    // Uneven blocks, some empty: rank j gets (3j + 1) % 5 * 37 elements.
    std::vector<size_t> counts(n);
    for (int j = 0; j < n; j++) counts[j] = (3 * j + 1) % 5 * 37;
    size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    size_t offset = std::accumulate(counts.begin(), counts.begin() + c->rank(), size_t{0});
    for (DType t : kTypes) {
      Buf send(t, total), recv(t, counts[c->rank()]);
      send.fill([&](size_t i) { return value(me(*c), i, 1); });
      CommStats before = c->stats();
      c->reduce_scatter_v(send.data(), recv.data(), counts, t, ReduceOp::Sum);
      std::string what = label(*c, "reduce_scatter_v", t, total);
      expect_all(what, counts[c->rank()], [&](size_t i) { return recv.get(i); },
                 [&](size_t i) {
                   float acc = 0;
                   for (int w : c->world_ranks()) acc += value(w, offset + i, 1);
                   return acc;
                 });
      uint64_t bytes = delta_bytes(before, c->stats(), CommOp::ReduceScatter);
      EXPECT_EQ(bytes, n == 1 ? 0 : (total - counts[c->rank()]) * dtype_size(t)) << what;
      EXPECT_EQ(group_total(*c, bytes), uint64_t{n - 1u} * total * dtype_size(t)) << what;
    }
  }
}

// ---------------------------------------------------------------- all_gather

TEST(Collectives, AllGatherMatchesSerialReference) {
  for (auto& c : groups()) {
    int n = c->size();
    for (DType t : kTypes) {
      for (size_t per_rank : {size_t{1}, size_t{3}, size_t{4099}}) {
        Buf send(t, per_rank), recv(t, per_rank * n);
        send.fill([&](size_t i) { return value(me(*c), i, 2); });
        CommStats before = c->stats();
        c->all_gather(send.data(), recv.data(), per_rank, t);
        std::string what = label(*c, "all_gather", t, per_rank);
        expect_all(what, per_rank * n, [&](size_t i) { return recv.get(i); },
                   [&](size_t i) { return value(c->world_ranks()[i / per_rank], i % per_rank, 2); });
        EXPECT_EQ(delta_bytes(before, c->stats(), CommOp::AllGather), uint64_t{per_rank} * (n - 1) * dtype_size(t))
            << what;
      }
    }
  }
}

TEST(Collectives, AllGatherVariableCounts) {
  for (auto& c : groups()) {
    int n = c->size();
    std::vector<size_t> counts(n);
    for (int j = 0; j < n; j++) counts[j] = (2 * j + 3) % 4 * 101;  // 303, 101, 0?, ... uneven, some empty
    size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    for (DType t : kTypes) {
      Buf send(t, counts[c->rank()]), recv(t, total);
      send.fill([&](size_t i) { return value(me(*c), i, 3); });
      CommStats before = c->stats();
      c->all_gather_v(send.data(), recv.data(), counts, t);
      std::string what = label(*c, "all_gather_v", t, total);
      expect_all(what, total, [&](size_t i) { return recv.get(i); },
                 [&](size_t i) {
                   int j = 0;
                   size_t k = i;
                   while (k >= counts[j]) k -= counts[j++];
                   return value(c->world_ranks()[j], k, 3);
                 });
      uint64_t bytes = delta_bytes(before, c->stats(), CommOp::AllGather);
      EXPECT_EQ(bytes, n == 1 ? 0 : (total - counts[(c->rank() + 1) % n]) * dtype_size(t)) << what;
      EXPECT_EQ(group_total(*c, bytes), uint64_t{n - 1u} * total * dtype_size(t)) << what;
    }
  }
}

// ----------------------------------------------------------------- broadcast

TEST(Collectives, BroadcastFromEveryRoot) {
  for (auto& c : groups()) {
    int n = c->size();
    for (DType t : kTypes) {
      // Every rank loops as often as the world is large (group_total is
      // collective over the world); the halves visit their roots repeatedly.
      for (int i = 0; i < lattice::comm::world_size(); i++) {
        int root = i % n;
        const size_t count = 1001;
        Buf b(t, count);
        b.fill([&](size_t i) { return c->rank() == root ? value(me(*c), i, 4) : 99.f; });
        CommStats before = c->stats();
        c->broadcast(b.data(), count, t, root);
        std::string what = label(*c, "broadcast", t, count) + " from root " + std::to_string(root);
        expect_all(what, count, [&](size_t i) { return b.get(i); },
                   [&](size_t i) { return value(c->world_ranks()[root], i, 4); });
        bool last = c->rank() == (root + n - 1) % n;
        uint64_t bytes = delta_bytes(before, c->stats(), CommOp::Broadcast);
        EXPECT_EQ(bytes, n == 1 || last ? 0 : count * dtype_size(t)) << what;
        EXPECT_EQ(group_total(*c, bytes), uint64_t{n - 1u} * count * dtype_size(t)) << what;
      }
    }
  }
}

// ---------------------------------------------------------------- all_to_all

TEST(Collectives, AllToAllMatchesSerialReference) {
  for (auto& c : groups()) {
    int n = c->size();
    for (DType t : kTypes) {
      const size_t per_rank = 333;
      Buf send(t, per_rank * n), recv(t, per_rank * n);
      send.fill([&](size_t i) { return value(me(*c), i, 5); });
      CommStats before = c->stats();
      c->all_to_all(send.data(), recv.data(), per_rank, t);
      std::string what = label(*c, "all_to_all", t, per_rank);
      // Block j of recv is block rank() of rank j's send.
      expect_all(what, per_rank * n, [&](size_t i) { return recv.get(i); },
                 [&](size_t i) {
                   size_t j = i / per_rank, k = i % per_rank;
                   return value(c->world_ranks()[j], c->rank() * per_rank + k, 5);
                 });
      EXPECT_EQ(delta_bytes(before, c->stats(), CommOp::AllToAll), uint64_t{per_rank} * (n - 1) * dtype_size(t))
          << what;
    }
  }
}

TEST(Collectives, AllToAllVariableCounts) {
  for (auto& c : groups()) {
    int n = c->size();
    // Rank i sends (i + 2j) % 4 * 17 elements to rank j (some zero).
    auto amount = [](int from, int to) { return static_cast<size_t>((from + 2 * to) % 4 * 17); };
    std::vector<size_t> send_counts(n), recv_counts(n);
    for (int j = 0; j < n; j++) {
      send_counts[j] = amount(c->rank(), j);
      recv_counts[j] = amount(j, c->rank());
    }
    size_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
    size_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    for (DType t : kTypes) {
      Buf send(t, send_total), recv(t, recv_total);
      send.fill([&](size_t i) { return value(me(*c), i, 6); });
      CommStats before = c->stats();
      c->all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, t);
      std::string what = label(*c, "all_to_all_v", t, send_total);
      expect_all(what, recv_total, [&](size_t i) { return recv.get(i); },
                 [&](size_t i) {
                   int j = 0;
                   size_t k = i;
                   while (k >= recv_counts[j]) k -= recv_counts[j++];
                   // Element k of the block rank j addressed to us sits after
                   // everything j sent to ranks before us.
                   size_t offset = 0;
                   for (int q = 0; q < c->rank(); q++) offset += amount(j, q);
                   return value(c->world_ranks()[j], offset + k, 6);
                 });
      EXPECT_EQ(delta_bytes(before, c->stats(), CommOp::AllToAll),
                (send_total - send_counts[c->rank()]) * dtype_size(t))
          << what;
    }
  }
}

TEST(Collectives, BarrierCountsACallAndNoBytes) {
  for (auto& c : groups()) {
    CommStats before = c->stats();
    c->barrier();
    CommStats after = c->stats();
    EXPECT_EQ(after.calls_of(CommOp::Barrier) - before.calls_of(CommOp::Barrier), 1u);
    EXPECT_EQ(after.bytes_sent, before.bytes_sent);
  }
}

// ------------------------------------------------------------ point to point

TEST(PointToPoint, RingExchangeInOneBatch) {
  for (auto& c : groups()) {
    int n = c->size();
    int next = (c->rank() + 1) % n, prev = (c->rank() + n - 1) % n;
    for (DType t : kTypes) {
      const size_t count = 20000;  // large enough for the rendezvous protocol
      Buf a(t, count), b(t, 7), ra(t, count), rb(t, 7);
      a.fill([&](size_t i) { return value(me(*c), i, 7); });
      b.fill([&](size_t i) { return value(me(*c), i, 8); });
      P2POp ops[] = {P2POp::recv(ra.data(), count, t, prev, 1), P2POp::recv(rb.data(), 7, t, prev, 2),
                     P2POp::send(b.data(), 7, t, next, 2), P2POp::send(a.data(), count, t, next, 1)};
      CommStats before = c->stats();
      c->batch_isend_irecv(ops)->wait();
      std::string what = label(*c, "ring batch", t, count);
      expect_all(what, count, [&](size_t i) { return ra.get(i); },
                 [&](size_t i) { return value(c->world_ranks()[prev], i, 7); });
      expect_all(what, 7, [&](size_t i) { return rb.get(i); },
                 [&](size_t i) { return value(c->world_ranks()[prev], i, 8); });
      CommStats after = c->stats();
      EXPECT_EQ(delta_bytes(before, after, CommOp::Send), (count + 7) * dtype_size(t));
      EXPECT_EQ(delta_bytes(before, after, CommOp::Recv), 0u);
      EXPECT_EQ(after.calls_of(CommOp::Send) - before.calls_of(CommOp::Send), 2u);
    }
  }
}

TEST(PointToPoint, BlockingSendRecvInPairs) {
  auto world = make_world_communicator();
  int r = world->rank(), n = world->size();
  int partner = r % 2 == 0 ? r + 1 : r - 1;
  if (partner >= n) return;  // the last rank of an odd world sits this one out
  const size_t count = 100003;
  std::vector<float> out(count), in(count);
  for (size_t i = 0; i < count; i++) out[i] = value(r, i, 9);
  CommStats before = world->stats();
  if (r % 2 == 0) {
    world->send(out.data(), count, DType::F32, partner, 3);
    world->recv(in.data(), count, DType::F32, partner, 4);
  } else {
    world->recv(in.data(), count, DType::F32, partner, 3);
    world->send(out.data(), count, DType::F32, partner, 4);
  }
  expect_all("send/recv", count, [&](size_t i) { return in[i]; }, [&](size_t i) { return value(partner, i, 9); });
  EXPECT_EQ(delta_bytes(before, world->stats(), CommOp::Send), count * 4);
}

TEST(PointToPoint, NonBlockingMatchesByTagNotByPostingOrder) {
  auto world = make_world_communicator();
  int r = world->rank(), n = world->size();
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> s1(100, 1.f + r), s2(200, 2.f + r), r1(100), r2(200);
  // Receives posted tag 2 first, sends issued tag 1 first.
  WorkPtr w2 = world->irecv(r2.data(), 200, DType::F32, prev, 2);
  WorkPtr w1 = world->irecv(r1.data(), 100, DType::F32, prev, 1);
  WorkPtr s_1 = world->isend(s1.data(), 100, DType::F32, next, 1);
  WorkPtr s_2 = world->isend(s2.data(), 200, DType::F32, next, 2);
  while (!w1->test()) {
  }
  w2->wait();
  s_1->wait();
  s_2.reset();  // destroying an unfinished Work waits for it
  EXPECT_EQ(r1[99], 1.f + prev);
  EXPECT_EQ(r2[199], 2.f + prev);
}

TEST(PointToPoint, ReceiveOfTheWrongSizeIsAnError) {
  auto world = make_world_communicator();
  int r = world->rank(), n = world->size();
  if (n < 2 || r > 1) return;
  std::vector<float> buf(10, 1.f);
  if (r == 0) {
    world->send(buf.data(), 5, DType::F32, 1, 11);   // shorter than the receive
    world->send(buf.data(), 10, DType::F32, 1, 12);  // longer than the receive
  } else {
    try {
      world->recv(buf.data(), 10, DType::F32, 0, 11);
      ADD_FAILURE() << "a 5-element message into a 10-element receive was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("holds 5 f32 elements, the receive expected 10"), std::string::npos)
          << e.what();
    }
    try {
      world->recv(buf.data(), 5, DType::F32, 0, 12);
      ADD_FAILURE() << "a 10-element message into a 5-element receive was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("recv from rank 0 (tag 12, 5 f32) on group 'world'"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("MPI_ERR_TRUNCATE"), std::string::npos) << e.what();
    }
  }
}

// --------------------------------------------------------------- non-blocking

TEST(NonBlocking, SeveralCollectivesInFlightCompleteInAnyOrder) {
  for (auto& c : groups()) {
    int n = c->size();
    for (DType t : kTypes) {
      const size_t count = 2003;
      std::vector<size_t> counts(n);
      for (int j = 0; j < n; j++) counts[j] = 100 + 13 * j;
      size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
      size_t offset = std::accumulate(counts.begin(), counts.begin() + c->rank(), size_t{0});

      Buf ar(t, count), rs_send(t, count * n), rs_recv(t, count), ag_send(t, count), ag_recv(t, count * n);
      Buf rsv_send(t, total), rsv_recv(t, counts[c->rank()]), agv_send(t, counts[c->rank()]), agv_recv(t, total);
      ar.fill([&](size_t i) { return value(me(*c), i, 10); });
      rs_send.fill([&](size_t i) { return value(me(*c), i, 11); });
      ag_send.fill([&](size_t i) { return value(me(*c), i, 12); });
      rsv_send.fill([&](size_t i) { return value(me(*c), i, 13); });
      agv_send.fill([&](size_t i) { return value(me(*c), i, 14); });

      CommStats before = c->stats();
      WorkPtr w_ar = c->iall_reduce(ar.data(), count, t, ReduceOp::Sum);
      WorkPtr w_rs = c->ireduce_scatter(rs_send.data(), rs_recv.data(), count, t, ReduceOp::Max);
      WorkPtr w_ag = c->iall_gather(ag_send.data(), ag_recv.data(), count, t);
      WorkPtr w_rsv = c->ireduce_scatter_v(rsv_send.data(), rsv_recv.data(), counts, t, ReduceOp::Sum);
      WorkPtr w_agv = c->iall_gather_v(agv_send.data(), agv_recv.data(), counts, t);
      while (!w_agv->test()) {
      }
      w_rsv->wait();
      w_ag->wait();
      w_rs->wait();
      w_ar.reset();  // destruction completes it
      CommStats after = c->stats();

      std::string what = label(*c, "non-blocking", t, count);
      auto sum_over = [&](size_t k, int salt) {
        float acc = 0;
        for (int w : c->world_ranks()) acc += value(w, k, salt);
        return acc;
      };
      expect_all(what + " iall_reduce", count, [&](size_t i) { return ar.get(i); },
                 [&](size_t i) { return sum_over(i, 10); });
      expect_all(what + " ireduce_scatter", count, [&](size_t i) { return rs_recv.get(i); },
                 [&](size_t i) {
                   float acc = -INFINITY;
                   for (int w : c->world_ranks()) acc = std::max(acc, value(w, c->rank() * count + i, 11));
                   return acc;
                 });
      expect_all(what + " iall_gather", count * n, [&](size_t i) { return ag_recv.get(i); },
                 [&](size_t i) { return value(c->world_ranks()[i / count], i % count, 12); });
      expect_all(what + " ireduce_scatter_v", counts[c->rank()], [&](size_t i) { return rsv_recv.get(i); },
                 [&](size_t i) { return sum_over(offset + i, 13); });
      expect_all(what + " iall_gather_v", total, [&](size_t i) { return agv_recv.get(i); },
                 [&](size_t i) {
                   int j = 0;
                   size_t k = i;
                   while (k >= counts[j]) k -= counts[j++];
                   return value(c->world_ranks()[j], k, 14);
                 });
      size_t e = dtype_size(t);
      EXPECT_EQ(delta_bytes(before, after, CommOp::AllReduce), ring_all_reduce_bytes(count, e, n, c->rank()));
      EXPECT_EQ(delta_bytes(before, after, CommOp::ReduceScatter),
                n == 1 ? 0 : (uint64_t{count} * (n - 1) + total - counts[c->rank()]) * e);
      EXPECT_EQ(delta_bytes(before, after, CommOp::AllGather),
                n == 1 ? 0 : (uint64_t{count} * (n - 1) + total - counts[(c->rank() + 1) % n]) * e);
    }
  }
}

// ------------------------------------------------------------------- groups

TEST(Groups, SplitOrdersByKeyAndTranslatesRanks) {
  auto world = make_world_communicator();
  int r = world->rank(), n = world->size();
  EXPECT_EQ(world->world_ranks()[r], r);
  auto reversed = world->split(0, n - 1 - r, "reversed");
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), n - 1 - r);
  for (int j = 0; j < n; j++) EXPECT_EQ(reversed->world_ranks()[j], n - 1 - j);
  // color < 0 leaves a rank out.
  auto evens = world->split(r % 2 == 0 ? 0 : -1, r, "evens");
  EXPECT_EQ(evens == nullptr, r % 2 == 1);
  if (evens) {
    EXPECT_EQ(evens->size(), (n + 1) / 2);
    EXPECT_EQ(evens->rank(), r / 2);
    EXPECT_EQ(evens->name(), "evens");
  }
}

TEST(Groups, ResetStatsClearsTheCounters) {
  auto world = make_world_communicator();
  float x = 1;
  world->all_reduce(&x, 1, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(world->stats().calls, 1u);
  world->reset_stats();
  EXPECT_EQ(world->stats().calls, 0u);
  EXPECT_EQ(world->stats().bytes_sent, 0u);
}

// ------------------------------------------------------------- bad arguments

TEST(BadArguments, AreRefusedBeforeAnyCommunication) {
  auto world = make_world_communicator();
  int n = world->size();
  float x[4] = {};
  auto message_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message_of([&] { world->send(x, 1, DType::F32, n); }),
            "send on group 'world': peer " + std::to_string(n) + " is not a rank of this group of " +
                std::to_string(n) + " (valid: 0.." + std::to_string(n - 1) + ")");
  EXPECT_EQ(message_of([&] { world->recv(x, 1, DType::F32, 0, -1); }), "recv on group 'world': tag -1 is negative");
  EXPECT_EQ(message_of([&] { world->broadcast(x, 1, DType::F32, -1); }),
            "broadcast on group 'world': root -1 is not a rank of this group of " + std::to_string(n));
  std::vector<size_t> wrong(n + 1, 1);
  EXPECT_EQ(message_of([&] { world->all_gather_v(x, x, wrong, DType::F32); }),
            "all_gather_v on group 'world': " + std::to_string(n + 1) + " counts given for a group of " +
                std::to_string(n) + " ranks");
  EXPECT_EQ(message_of([&] { world->all_reduce(nullptr, 3, DType::F32, ReduceOp::Sum); }),
            "all_reduce on group 'world': null buffer for 3 elements");
  // Nothing was counted for the refused calls.
  EXPECT_EQ(world->stats().calls, 0u);
}
