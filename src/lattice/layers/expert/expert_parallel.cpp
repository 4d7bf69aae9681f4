#include "lattice/layers/expert/expert_parallel.h"

#include <chrono>
#include <cstring>

#include "lattice/core/error.h"

namespace lattice::expert {

ExpertParallel::ExpertParallel(comm::Communicator* group, int n_experts) : group_(group), E_(n_experts) {
  if (group_) size_ = group_->size(), rank_ = group_->rank();
  LATTICE_CHECK(E_ % size_ == 0, "parallel.ep=" << size_ << " does not divide model.n_experts=" << E_);
}

int64_t ExpertParallel::Plan::rows_of(int s, int le) const { return counts[static_cast<size_t>(s) * E + first + le]; }

int64_t ExpertParallel::Plan::expert_rows(int le) const {
  int64_t n = 0;
  for (int s = 0; s < ep; s++) n += rows_of(s, le);
  return n;
}

int64_t ExpertParallel::Plan::received_by(int r) const {
  int64_t n = 0;
  for (int s = 0; s < ep; s++)
    for (int e = r * local; e < (r + 1) * local; e++) n += counts[static_cast<size_t>(s) * E + e];
  return n;
}

ExpertParallel::Plan ExpertParallel::plan(const int64_t* my_counts) const {
  std::vector<int64_t> counts(static_cast<size_t>(size_) * E_, 0);
  if (group_ && size_ > 1) {
    // As doubles: exact for any count below 2^53, and a dtype every collective has.
    std::vector<double> mine(my_counts, my_counts + E_), all(counts.size());
    group_->all_gather(mine.data(), all.data(), static_cast<size_t>(E_), DType::F64);
    for (size_t i = 0; i < all.size(); i++) counts[i] = static_cast<int64_t>(all[i]);
  } else {
    std::copy(my_counts, my_counts + E_, counts.begin());
  }
  return plan_of(std::move(counts));
}

ExpertParallel::Plan ExpertParallel::plan_of(std::vector<int64_t> counts) const {
  LATTICE_CHECK(counts.size() == static_cast<size_t>(size_) * E_, "internal: a plan of " << counts.size()
                                                                                          << " counts for ep="
                                                                                          << size_ << ", E=" << E_);
  Plan p;
  p.E = E_, p.ep = size_, p.first = first_expert(), p.local = local_experts();
  p.counts = std::move(counts);
  const int64_t* mine = p.counts.data() + static_cast<size_t>(rank_) * E_;
  p.send_rows.assign(static_cast<size_t>(size_), 0);
  p.recv_rows.assign(static_cast<size_t>(size_), 0);
  for (int r = 0; r < size_; r++)
    for (int le = 0; le < p.local; le++) {
      p.send_rows[static_cast<size_t>(r)] += static_cast<size_t>(mine[r * p.local + le]);
      p.recv_rows[static_cast<size_t>(r)] += static_cast<size_t>(p.rows_of(r, le));
    }
  for (int r = 0; r < size_; r++)
    p.sent += static_cast<int64_t>(p.send_rows[r]), p.received += static_cast<int64_t>(p.recv_rows[r]);
  return p;
}

void ExpertParallel::all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                                const std::vector<size_t>& recv_rows, int64_t width) {
  std::vector<size_t> sc(send_rows.size()), rc(recv_rows.size());
  for (size_t r = 0; r < sc.size(); r++) {
    sc[r] = send_rows[r] * static_cast<size_t>(width);
    rc[r] = recv_rows[r] * static_cast<size_t>(width);
    if (static_cast<int>(r) != rank_) bytes_ += sc[r] * sizeof(float);
  }
  const auto start = std::chrono::steady_clock::now();
  group_->all_to_all_v(send, sc, recv, rc, DType::F32);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Between the all-to-all's (source, local expert) blocks and the experts'
// (local expert, source) blocks: the same blocks, in the other order.
static void reorder(const ExpertParallel::Plan& p, const float* from, float* to, int64_t width, bool to_expert_major) {
  std::vector<int64_t> src_off(static_cast<size_t>(p.ep) * p.local), exp_off(src_off.size());
  int64_t at = 0;
  for (int s = 0; s < p.ep; s++)
    for (int le = 0; le < p.local; le++) src_off[static_cast<size_t>(s) * p.local + le] = at, at += p.rows_of(s, le);
  at = 0;
  for (int le = 0; le < p.local; le++)
    for (int s = 0; s < p.ep; s++) exp_off[static_cast<size_t>(s) * p.local + le] = at, at += p.rows_of(s, le);
  for (int s = 0; s < p.ep; s++)
    for (int le = 0; le < p.local; le++) {
      const size_t i = static_cast<size_t>(s) * p.local + le;
      const int64_t a = to_expert_major ? src_off[i] : exp_off[i], b = to_expert_major ? exp_off[i] : src_off[i];
      std::memcpy(to + b * width, from + a * width, static_cast<size_t>(p.rows_of(s, le) * width) * sizeof(float));
    }
}

void ExpertParallel::dispatch(const Plan& plan, const float* send, float* rows, float* scratch, int64_t width) {
  if (size_ == 1) {
    if (rows != send) std::memcpy(rows, send, static_cast<size_t>(plan.sent * width) * sizeof(float));
    return;
  }
  all_to_all(send, plan.send_rows, scratch, plan.recv_rows, width);
  reorder(plan, scratch, rows, width, true);
}

void ExpertParallel::combine(const Plan& plan, const float* rows, float* back, float* scratch, int64_t width) {
  if (size_ == 1) {
    if (back != rows) std::memcpy(back, rows, static_cast<size_t>(plan.received * width) * sizeof(float));
    return;
  }
  reorder(plan, rows, scratch, width, false);
  all_to_all(scratch, plan.recv_rows, back, plan.send_rows, width);
}

}  // namespace lattice::expert
