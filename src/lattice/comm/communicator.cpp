#include "lattice/comm/communicator.h"

#include <numeric>

#include "lattice/core/error.h"

namespace lattice::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::AllGather: return "all_gather";
    case CommOp::Broadcast: return "broadcast";
    case CommOp::AllToAll: return "all_to_all";
    case CommOp::Send: return "send";
    case CommOp::Recv: return "recv";
    case CommOp::Barrier: return "barrier";
  }
  return "?";
}

Communicator::Communicator(std::string name, int rank, std::vector<int> world_ranks)
    : name_(std::move(name)), rank_(rank), world_ranks_(std::move(world_ranks)) {
  LATTICE_CHECK(rank_ >= 0 && rank_ < size(),
                "communicator '" << name_ << "': rank " << rank_ << " outside a group of " << size());
}

// ---- byte accounting (formulas in communicator.h) ----

namespace {

// Block j of an even split of `count` elements over n ranks: the first
// count % n blocks hold one element more.
uint64_t even_block(size_t count, int n, int j) {
  return count / n + (static_cast<size_t>(j) < count % n ? 1 : 0);
}

uint64_t sum_of(std::span<const size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), uint64_t{0});
}

uint64_t all_reduce_bytes(size_t count, size_t elem, int n, int r) {
  if (n == 1) return 0;
  uint64_t c = count;
  return ((c - even_block(count, n, r)) + (c - even_block(count, n, (r + 1) % n))) * elem;
}

uint64_t reduce_scatter_bytes(std::span<const size_t> counts, size_t elem, int r) {
  if (counts.size() == 1) return 0;
  return (sum_of(counts) - counts[r]) * elem;
}

uint64_t all_gather_bytes(std::span<const size_t> counts, size_t elem, int r) {
  int n = static_cast<int>(counts.size());
  if (n == 1) return 0;
  return (sum_of(counts) - counts[(r + 1) % n]) * elem;
}

}  // namespace

void Communicator::count(CommOp op, uint64_t bytes) {
  size_t i = static_cast<size_t>(op);
  bytes_by_op_[i].fetch_add(bytes, std::memory_order_relaxed);
  calls_by_op_[i].fetch_add(1, std::memory_order_relaxed);
}

CommStats Communicator::stats() const {
  CommStats s;
  for (size_t i = 0; i < kCommOpCount; i++) {
    s.bytes_by_op[i] = bytes_by_op_[i].load(std::memory_order_relaxed);
    s.calls_by_op[i] = calls_by_op_[i].load(std::memory_order_relaxed);
    s.bytes_sent += s.bytes_by_op[i];
    s.calls += s.calls_by_op[i];
  }
  return s;
}

void Communicator::reset_stats() {
  for (size_t i = 0; i < kCommOpCount; i++) {
    bytes_by_op_[i].store(0, std::memory_order_relaxed);
    calls_by_op_[i].store(0, std::memory_order_relaxed);
  }
}

// ---- argument checks ----

void Communicator::check_peer(int peer, int tag, const char* what) const {
  LATTICE_CHECK(peer >= 0 && peer < size(), what << " on group '" << name_ << "': peer " << peer
                                                  << " is not a rank of this group of " << size()
                                                  << " (valid: 0.." << size() - 1 << ")");
  LATTICE_CHECK(tag >= 0, what << " on group '" << name_ << "': tag " << tag << " is negative");
}

void Communicator::check_counts(std::span<const size_t> counts, const char* what) const {
  LATTICE_CHECK(counts.size() == static_cast<size_t>(size()),
                what << " on group '" << name_ << "': " << counts.size() << " counts given for a group of "
                     << size() << " ranks");
}

#define LATTICE_CHECK_BUFFER(ptr, n, what)                                                     \
  LATTICE_CHECK((ptr) != nullptr || (n) == 0, what << " on group '" << name_ << "': null buffer for " \
                                                   << (n) << " elements")

// ---- collectives ----

void Communicator::all_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
  LATTICE_CHECK_BUFFER(data, count, "all_reduce");
  this->count(CommOp::AllReduce, all_reduce_bytes(count, dtype_size(dtype), size(), rank_));
  do_all_reduce(data, count, dtype, op);
}

WorkPtr Communicator::iall_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
  LATTICE_CHECK_BUFFER(data, count, "iall_reduce");
  this->count(CommOp::AllReduce, all_reduce_bytes(count, dtype_size(dtype), size(), rank_));
  return do_iall_reduce(data, count, dtype, op);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op) {
  LATTICE_CHECK_BUFFER(send, recv_count * size(), "reduce_scatter");
  LATTICE_CHECK_BUFFER(recv, send == recv ? recv_count * size() : recv_count, "reduce_scatter");
  count(CommOp::ReduceScatter, uint64_t{recv_count} * (size() - 1) * dtype_size(dtype));
  do_reduce_scatter(send, recv, recv_count, dtype, op);
}

WorkPtr Communicator::ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                      ReduceOp op) {
  LATTICE_CHECK_BUFFER(send, recv_count * size(), "ireduce_scatter");
  LATTICE_CHECK_BUFFER(recv, recv_count, "ireduce_scatter");
  count(CommOp::ReduceScatter, uint64_t{recv_count} * (size() - 1) * dtype_size(dtype));
  return do_ireduce_scatter(send, recv, recv_count, dtype, op);
}

void Communicator::reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                    DType dtype, ReduceOp op) {
  check_counts(recv_counts, "reduce_scatter_v");
  LATTICE_CHECK_BUFFER(send, sum_of(recv_counts), "reduce_scatter_v");
  LATTICE_CHECK_BUFFER(recv, recv_counts[rank_], "reduce_scatter_v");
  count(CommOp::ReduceScatter, reduce_scatter_bytes(recv_counts, dtype_size(dtype), rank_));
  do_reduce_scatter_v(send, recv, recv_counts, dtype, op);
}

WorkPtr Communicator::ireduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                        DType dtype, ReduceOp op) {
  check_counts(recv_counts, "ireduce_scatter_v");
  LATTICE_CHECK_BUFFER(send, sum_of(recv_counts), "ireduce_scatter_v");
  LATTICE_CHECK_BUFFER(recv, recv_counts[rank_], "ireduce_scatter_v");
  count(CommOp::ReduceScatter, reduce_scatter_bytes(recv_counts, dtype_size(dtype), rank_));
  return do_ireduce_scatter_v(send, recv, recv_counts, dtype, op);
}

void Communicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  LATTICE_CHECK_BUFFER(send, send_count, "all_gather");
  LATTICE_CHECK_BUFFER(recv, send_count * size(), "all_gather");
  count(CommOp::AllGather, uint64_t{send_count} * (size() - 1) * dtype_size(dtype));
  do_all_gather(send, recv, send_count, dtype);
}

WorkPtr Communicator::iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  LATTICE_CHECK_BUFFER(send, send_count, "iall_gather");
  LATTICE_CHECK_BUFFER(recv, send_count * size(), "iall_gather");
  count(CommOp::AllGather, uint64_t{send_count} * (size() - 1) * dtype_size(dtype));
  return do_iall_gather(send, recv, send_count, dtype);
}

void Communicator::all_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype) {
  check_counts(counts, "all_gather_v");
  LATTICE_CHECK_BUFFER(send, counts[rank_], "all_gather_v");
  LATTICE_CHECK_BUFFER(recv, sum_of(counts), "all_gather_v");
  count(CommOp::AllGather, all_gather_bytes(counts, dtype_size(dtype), rank_));
  do_all_gather_v(send, recv, counts, dtype);
}

WorkPtr Communicator::iall_gather_v(const void* send, void* recv, std::span<const size_t> counts, DType dtype) {
  check_counts(counts, "iall_gather_v");
  LATTICE_CHECK_BUFFER(send, counts[rank_], "iall_gather_v");
  LATTICE_CHECK_BUFFER(recv, sum_of(counts), "iall_gather_v");
  count(CommOp::AllGather, all_gather_bytes(counts, dtype_size(dtype), rank_));
  return do_iall_gather_v(send, recv, counts, dtype);
}

void Communicator::broadcast(void* data, size_t count, DType dtype, int root) {
  LATTICE_CHECK(root >= 0 && root < size(), "broadcast on group '" << name_ << "': root " << root
                                                                    << " is not a rank of this group of "
                                                                    << size());
  LATTICE_CHECK_BUFFER(data, count, "broadcast");
  int n = size();
  bool last_of_chain = rank_ == (root + n - 1) % n;
  this->count(CommOp::Broadcast, n == 1 || last_of_chain ? 0 : uint64_t{count} * dtype_size(dtype));
  do_broadcast(data, count, dtype, root);
}

void Communicator::all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype) {
  LATTICE_CHECK_BUFFER(send, count_per_rank * size(), "all_to_all");
  LATTICE_CHECK_BUFFER(recv, count_per_rank * size(), "all_to_all");
  count(CommOp::AllToAll, uint64_t{count_per_rank} * (size() - 1) * dtype_size(dtype));
  do_all_to_all(send, recv, count_per_rank, dtype);
}

void Communicator::all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                                std::span<const size_t> recv_counts, DType dtype) {
  check_counts(send_counts, "all_to_all_v (send counts)");
  check_counts(recv_counts, "all_to_all_v (receive counts)");
  LATTICE_CHECK_BUFFER(send, sum_of(send_counts), "all_to_all_v");
  LATTICE_CHECK_BUFFER(recv, sum_of(recv_counts), "all_to_all_v");
  count(CommOp::AllToAll, (sum_of(send_counts) - send_counts[rank_]) * dtype_size(dtype));
  do_all_to_all_v(send, send_counts, recv, recv_counts, dtype);
}

void Communicator::barrier() {
  count(CommOp::Barrier, 0);
  do_barrier();
}

// ---- point to point ----

void Communicator::send(const void* data, size_t count, DType dtype, int peer, int tag) {
  check_peer(peer, tag, "send");
  LATTICE_CHECK_BUFFER(data, count, "send");
  this->count(CommOp::Send, uint64_t{count} * dtype_size(dtype));
  do_send(data, count, dtype, peer, tag);
}

void Communicator::recv(void* data, size_t count, DType dtype, int peer, int tag) {
  check_peer(peer, tag, "recv");
  LATTICE_CHECK_BUFFER(data, count, "recv");
  this->count(CommOp::Recv, 0);
  do_recv(data, count, dtype, peer, tag);
}

WorkPtr Communicator::isend(const void* data, size_t count, DType dtype, int peer, int tag) {
  P2POp op = P2POp::send(data, count, dtype, peer, tag);
  return batch_isend_irecv(std::span<const P2POp>(&op, 1));
}

WorkPtr Communicator::irecv(void* data, size_t count, DType dtype, int peer, int tag) {
  P2POp op = P2POp::recv(data, count, dtype, peer, tag);
  return batch_isend_irecv(std::span<const P2POp>(&op, 1));
}

WorkPtr Communicator::batch_isend_irecv(std::span<const P2POp> ops) {
  for (const P2POp& op : ops) {
    const char* what = op.kind == P2POp::Kind::Send ? "isend" : "irecv";
    check_peer(op.peer, op.tag, what);
    LATTICE_CHECK_BUFFER(op.data, op.count, what);
  }
  for (const P2POp& op : ops) {
    if (op.kind == P2POp::Kind::Send)
      count(CommOp::Send, uint64_t{op.count} * dtype_size(op.dtype));
    else
      count(CommOp::Recv, 0);
  }
  return do_batch_isend_irecv(ops);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  return do_split(color, key, name);
}

}  // namespace lattice::comm
