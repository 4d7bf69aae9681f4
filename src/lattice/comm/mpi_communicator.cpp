#include "lattice/comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <numeric>

#include "lattice/core/error.h"

namespace lattice::comm {

namespace {

// ---- bf16 / f16 reductions: widen to f32, combine, round back ----
//
// MPI calls these on chunks of the buffers; they must be fast (they are the
// arithmetic of every bf16/f16 all-reduce): core/dtype.h's bf16 conversions
// are inline so this loop vectorises.

template <bool kMax>
inline float combine(float a, float b) {
  if constexpr (kMax)
    return (a > b || a != a) ? a : b;  // NaN wins, whatever the order
  else
    return a + b;
}

template <bool kMax>
void bf16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; i++) {
    b[i] = f32_to_bf16(combine<kMax>(bf16_to_f32(a[i]), bf16_to_f32(b[i])));
  }
}

template <bool kMax>
void f16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; i++) b[i] = f32_to_f16(combine<kMax>(f16_to_f32(a[i]), f16_to_f32(b[i])));
}

struct HalfOps {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
  HalfOps() {
    MPI_Op_create(&bf16_reduce<false>, 1, &bf16_sum);
    MPI_Op_create(&bf16_reduce<true>, 1, &bf16_max);
    MPI_Op_create(&f16_reduce<false>, 1, &f16_sum);
    MPI_Op_create(&f16_reduce<true>, 1, &f16_max);
  }
};

// Created on first use (after MPI_Init); MPI_Finalize releases them.
const HalfOps& half_ops() {
  static HalfOps ops;
  return ops;
}

MPI_Datatype wire_type(DType t) { return mpi_wire_type(t); }
MPI_Op mpi_op(DType t, ReduceOp op) { return mpi_reduce_op(t, op); }

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, len);
}

void check_mpi(int rc, const WaitInfo& info) {
  LATTICE_CHECK(rc == MPI_SUCCESS, "MPI failed in " << describe_wait(info) << ": " << mpi_error_text(rc));
}

// After completion, every receive must have got exactly the count it asked
// for: a shorter message would otherwise leave stale data unnoticed.
void check_received(const MPI_Status& status, size_t expected, DType dtype, const WaitInfo& info, int from) {
  int got = 0;
  MPI_Get_count(&status, wire_type(dtype), &got);
  LATTICE_CHECK(static_cast<size_t>(got) == expected,
                describe_wait(info) << ": the message from rank " << from << " holds " << got << " "
                                    << dtype_name(dtype) << " elements, the receive expected " << expected);
}

class MpiWork final : public Work {
 public:
  struct Recv {
    size_t request;  // index into requests
    size_t count;
    DType dtype;
    int from;  // world rank
  };

  explicit MpiWork(WaitInfo info) : info_(info) {}
  ~MpiWork() override {
    // While an exception unwinds, the job is about to be aborted: waiting could
    // only delay that. Otherwise an error here reaches std::terminate, whose
    // handler (run_guarded) prints it and aborts the job.
    if (!done_ && std::uncaught_exceptions() == 0) wait();
  }

  void wait() override {
    if (done_) return;
    // Statuses only where a receive's count must be checked.
    std::vector<MPI_Status> statuses(recvs.empty() ? 0 : requests.size());
    {
      WaitScope scope(info_);
      check_mpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(),
                            recvs.empty() ? MPI_STATUSES_IGNORE : statuses.data()),
                info_);
    }
    finish(statuses);
  }

  bool test() override {
    if (done_) return true;
    std::vector<MPI_Status> statuses(recvs.empty() ? 0 : requests.size());
    int flag = 0;
    check_mpi(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                          recvs.empty() ? MPI_STATUSES_IGNORE : statuses.data()),
              info_);
    if (flag) finish(statuses);
    return done_;
  }

  std::vector<MPI_Request> requests;
  std::vector<Recv> recvs;
  // Count and displacement arrays of v-collectives: MPI reads them until completion.
  std::vector<int> counts, displs;

 private:
  void finish(const std::vector<MPI_Status>& statuses) {
    done_ = true;
    for (const Recv& r : recvs) check_received(statuses[r.request], r.count, r.dtype, info_, r.from);
  }

  WaitInfo info_;
  bool done_ = false;
};

}  // namespace

MPI_Datatype mpi_wire_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::BF16:
    case DType::F16: return MPI_UINT16_T;
  }
  return MPI_FLOAT;
}

MPI_Op mpi_reduce_op(DType t, ReduceOp op) {
  switch (t) {
    case DType::F32: return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
    case DType::BF16: return op == ReduceOp::Sum ? half_ops().bf16_sum : half_ops().bf16_max;
    case DType::F16: return op == ReduceOp::Sum ? half_ops().f16_sum : half_ops().f16_max;
    case DType::F64: return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
  }
  return MPI_SUM;
}

// ---- construction ----

std::unique_ptr<MpiCommunicator> MpiCommunicator::adopt(MPI_Comm comm, const std::string& name) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  LATTICE_CHECK(initialized, "communicator '" << name
                                              << "': MPI is not initialised; run the program inside "
                                                 "lattice::comm::run_guarded");
  LATTICE_CHECK(comm != MPI_COMM_NULL, "communicator '" << name << "': MPI_COMM_NULL given");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Group group, world_group;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  std::vector<int> local(size), world(size);
  std::iota(local.begin(), local.end(), 0);
  MPI_Group_translate_ranks(group, size, local.data(), world_group, world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(comm, name, rank, std::move(world)));
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, const std::string& name, int rank, std::vector<int> world_ranks)
    : Communicator(name, rank, world_ranks), comm_(comm), group_(name, world_ranks) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  int* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found);
  if (found && tag_ub) tag_upper_bound_ = *tag_ub;
  // The largest tag is the communicator's own (ring_reduce_scatter's messages).
  internal_tag_ = tag_upper_bound_;
  tag_upper_bound_ = internal_tag_ - 1;
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

std::unique_ptr<MpiCommunicator> make_world_communicator() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  LATTICE_CHECK(initialized, "MPI is not initialised; run the program inside lattice::comm::run_guarded");
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return MpiCommunicator::adopt(comm, "world");
}

// ---- helpers ----

WaitInfo MpiCommunicator::collective(CommOp op, size_t count, DType dtype, const ReduceOp* reduce) {
  WaitInfo info;
  info.group = &group_;
  info.op = op;
  info.count = count;
  info.dtype = dtype;
  if (reduce) {
    info.has_reduce = true;
    info.reduce = *reduce;
  }
  info.seq = group_.start_collective();
  return info;
}

WaitInfo MpiCommunicator::p2p(CommOp op, size_t count, DType dtype, int peer, int tag) const {
  WaitInfo info;
  info.group = &group_;
  info.op = op;
  info.count = count;
  info.dtype = dtype;
  info.tag = tag;
  info.n_peers = 1;
  info.peers[0] = world_ranks()[peer];
  return info;
}

int MpiCommunicator::to_int(size_t n, const WaitInfo& info) const {
  LATTICE_CHECK(n <= static_cast<size_t>(INT_MAX), describe_wait(info) << ": " << n
                                                                       << " elements exceed MPI's count limit of "
                                                                       << INT_MAX << "; split the buffer");
  return static_cast<int>(n);
}

void MpiCommunicator::check(int rc, const WaitInfo& info) const { check_mpi(rc, info); }

// MPI_IN_PLACE when `send` is this rank's own block of `recv` (all_gather in
// place: the caller's data already sits where it would be received).
const void* MpiCommunicator::in_place_block(const void* send, const void* recv, size_t block, DType dtype) const {
  const char* own = static_cast<const char*>(recv) + static_cast<size_t>(rank()) * block * dtype_size(dtype);
  return send == own ? MPI_IN_PLACE : send;
}

// ---- blocking collectives ----

void MpiCommunicator::do_all_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
  WaitInfo info = collective(CommOp::AllReduce, count, dtype, &op);
  int n = to_int(count, info);
  WaitScope scope(info);
  check(MPI_Allreduce(MPI_IN_PLACE, data, n, wire_type(dtype), mpi_op(dtype, op), comm_), info);
}

// The ring of reduce-scatter (kRingReduceScatterBytes, mpi_communicator.h):
// n-1 steps, each a sendrecv of one block with the neighbours and an add. The
// bytes sent are the ring's, as the counters say.
void MpiCommunicator::ring_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                          const WaitInfo& info) {
  const int n = size(), r = rank();
  const size_t elem = dtype_size(dtype), bytes = recv_count * elem;
  const int count = to_int(recv_count, info);
  if (ring_scratch_.bytes() < 2 * bytes) ring_scratch_ = Buffer(2 * bytes, MemCategory::Comm);
  char* acc = ring_scratch_.as<char>();
  char* tmp = acc + bytes;
  const char* base = static_cast<const char*>(send);
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  // Step s sends the running sum of block (r-s-1) right and receives the left
  // neighbour's running sum of block (r-s-2), to which it adds its own data;
  // after n-1 steps the sum held is block r's, over every rank.
  const void* out = base + static_cast<size_t>((r + n - 1) % n) * bytes;
  WaitScope scope(info);
  for (int s = 0; s < n - 1; s++) {
    const int idx = (r - s - 2 + 2 * n) % n;
    check(MPI_Sendrecv(out, count, wire_type(dtype), right, internal_tag_, tmp, count, wire_type(dtype), left,
                       internal_tag_, comm_, MPI_STATUS_IGNORE),
          info);
    const char* own = base + static_cast<size_t>(idx) * bytes;
    if (dtype == DType::F32) {
      const float* a = reinterpret_cast<const float*>(own);
      const float* b = reinterpret_cast<const float*>(tmp);
      float* c = reinterpret_cast<float*>(acc);
      for (size_t i = 0; i < recv_count; i++) c[i] = a[i] + b[i];
    } else {
      const double* a = reinterpret_cast<const double*>(own);
      const double* b = reinterpret_cast<const double*>(tmp);
      double* c = reinterpret_cast<double*>(acc);
      for (size_t i = 0; i < recv_count; i++) c[i] = a[i] + b[i];
    }
    out = acc;  // the sendrecv has returned: acc may be overwritten next step
  }
  std::memcpy(recv, acc, bytes);  // in place: over block 0, now that every block has been read
}

void MpiCommunicator::do_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                        ReduceOp op) {
  WaitInfo info = collective(CommOp::ReduceScatter, recv_count * size(), dtype, &op);
  int n = to_int(recv_count, info);
  to_int(recv_count * size(), info);
  if (size() > 1 && op == ReduceOp::Sum && (dtype == DType::F32 || dtype == DType::F64) &&
      recv_count * dtype_size(dtype) >= kRingReduceScatterBytes)
    return ring_reduce_scatter(send, recv, recv_count, dtype, info);
  WaitScope scope(info);
  check(MPI_Reduce_scatter_block(send == recv ? MPI_IN_PLACE : send, recv, n, wire_type(dtype), mpi_op(dtype, op),
                                 comm_),
        info);
}

void MpiCommunicator::do_reduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                          DType dtype, ReduceOp op) {
  size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  WaitInfo info = collective(CommOp::ReduceScatter, total, dtype, &op);
  to_int(total, info);
  std::vector<int> counts(recv_counts.size());
  for (size_t i = 0; i < counts.size(); i++) counts[i] = static_cast<int>(recv_counts[i]);
  WaitScope scope(info);
  check(MPI_Reduce_scatter(send, recv, counts.data(), wire_type(dtype), mpi_op(dtype, op), comm_), info);
}

void MpiCommunicator::do_all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  WaitInfo info = collective(CommOp::AllGather, send_count * size(), dtype, nullptr);
  int n = to_int(send_count, info);
  to_int(send_count * size(), info);
  WaitScope scope(info);
  check(MPI_Allgather(in_place_block(send, recv, send_count, dtype), n, wire_type(dtype), recv, n, wire_type(dtype),
                      comm_),
        info);
}

// Element counts and displacements of consecutive blocks, as MPI's ints.
static void counts_and_displs(std::span<const size_t> in, std::vector<int>& counts, std::vector<int>& displs) {
  counts.resize(in.size());
  displs.resize(in.size());
  size_t offset = 0;
  for (size_t i = 0; i < in.size(); i++) {
    counts[i] = static_cast<int>(in[i]);
    displs[i] = static_cast<int>(offset);
    offset += in[i];
  }
}

void MpiCommunicator::do_all_gather_v(const void* send, void* recv, std::span<const size_t> counts_in,
                                      DType dtype) {
  size_t total = std::accumulate(counts_in.begin(), counts_in.end(), size_t{0});
  WaitInfo info = collective(CommOp::AllGather, total, dtype, nullptr);
  to_int(total, info);
  std::vector<int> counts, displs;
  counts_and_displs(counts_in, counts, displs);
  WaitScope scope(info);
  check(MPI_Allgatherv(send, counts[rank()], wire_type(dtype), recv, counts.data(), displs.data(),
                       wire_type(dtype), comm_),
        info);
}

void MpiCommunicator::do_broadcast(void* data, size_t count, DType dtype, int root) {
  WaitInfo info = collective(CommOp::Broadcast, count, dtype, nullptr);
  int n = to_int(count, info);
  WaitScope scope(info);
  check(MPI_Bcast(data, n, wire_type(dtype), root, comm_), info);
}

void MpiCommunicator::do_all_to_all(const void* send, void* recv, size_t count_per_rank, DType dtype) {
  WaitInfo info = collective(CommOp::AllToAll, count_per_rank * size(), dtype, nullptr);
  int n = to_int(count_per_rank, info);
  to_int(count_per_rank * size(), info);
  WaitScope scope(info);
  check(MPI_Alltoall(send, n, wire_type(dtype), recv, n, wire_type(dtype), comm_), info);
}

void MpiCommunicator::do_all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                                      std::span<const size_t> recv_counts, DType dtype) {
  size_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  size_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  WaitInfo info = collective(CommOp::AllToAll, send_total, dtype, nullptr);
  to_int(send_total, info);
  to_int(recv_total, info);
  std::vector<int> scounts, sdispls, rcounts, rdispls;
  counts_and_displs(send_counts, scounts, sdispls);
  counts_and_displs(recv_counts, rcounts, rdispls);
  WaitScope scope(info);
  check(MPI_Alltoallv(send, scounts.data(), sdispls.data(), wire_type(dtype), recv, rcounts.data(),
                      rdispls.data(), wire_type(dtype), comm_),
        info);
}

void MpiCommunicator::do_barrier() {
  WaitInfo info = collective(CommOp::Barrier, 0, DType::F32, nullptr);
  WaitScope scope(info);
  check(MPI_Barrier(comm_), info);
}

// ---- blocking point to point ----

void MpiCommunicator::do_send(const void* data, size_t count, DType dtype, int peer, int tag) {
  WaitInfo info = p2p(CommOp::Send, count, dtype, peer, tag);
  int n = to_int(count, info);
  LATTICE_CHECK(tag <= tag_upper_bound_, describe_wait(info) << ": tag above MPI_TAG_UB=" << tag_upper_bound_);
  WaitScope scope(info);
  check(MPI_Send(data, n, wire_type(dtype), peer, tag, comm_), info);
}

void MpiCommunicator::do_recv(void* data, size_t count, DType dtype, int peer, int tag) {
  WaitInfo info = p2p(CommOp::Recv, count, dtype, peer, tag);
  int n = to_int(count, info);
  LATTICE_CHECK(tag <= tag_upper_bound_, describe_wait(info) << ": tag above MPI_TAG_UB=" << tag_upper_bound_);
  MPI_Status status;
  {
    WaitScope scope(info);
    check(MPI_Recv(data, n, wire_type(dtype), peer, tag, comm_, &status), info);
  }
  check_received(status, count, dtype, info, world_ranks()[peer]);
}

// ---- non-blocking ----

WorkPtr MpiCommunicator::do_iall_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
  WaitInfo info = collective(CommOp::AllReduce, count, dtype, &op);
  int n = to_int(count, info);
  auto work = std::make_unique<MpiWork>(info);
  work->requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Iallreduce(MPI_IN_PLACE, data, n, wire_type(dtype), mpi_op(dtype, op), comm_, &work->requests[0]),
        info);
  return work;
}

WorkPtr MpiCommunicator::do_ireduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                            ReduceOp op) {
  WaitInfo info = collective(CommOp::ReduceScatter, recv_count * size(), dtype, &op);
  int n = to_int(recv_count, info);
  to_int(recv_count * size(), info);
  auto work = std::make_unique<MpiWork>(info);
  work->requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Ireduce_scatter_block(send == recv ? MPI_IN_PLACE : send, recv, n, wire_type(dtype), mpi_op(dtype, op),
                                  comm_, &work->requests[0]),
        info);
  return work;
}

WorkPtr MpiCommunicator::do_ireduce_scatter_v(const void* send, void* recv, std::span<const size_t> recv_counts,
                                              DType dtype, ReduceOp op) {
  size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  WaitInfo info = collective(CommOp::ReduceScatter, total, dtype, &op);
  to_int(total, info);
  auto work = std::make_unique<MpiWork>(info);
  counts_and_displs(recv_counts, work->counts, work->displs);
  work->requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Ireduce_scatter(send, recv, work->counts.data(), wire_type(dtype), mpi_op(dtype, op), comm_,
                            &work->requests[0]),
        info);
  return work;
}

WorkPtr MpiCommunicator::do_iall_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  WaitInfo info = collective(CommOp::AllGather, send_count * size(), dtype, nullptr);
  int n = to_int(send_count, info);
  to_int(send_count * size(), info);
  auto work = std::make_unique<MpiWork>(info);
  work->requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Iallgather(in_place_block(send, recv, send_count, dtype), n, wire_type(dtype), recv, n, wire_type(dtype),
                       comm_, &work->requests[0]),
        info);
  return work;
}

WorkPtr MpiCommunicator::do_iall_gather_v(const void* send, void* recv, std::span<const size_t> counts,
                                          DType dtype) {
  size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  WaitInfo info = collective(CommOp::AllGather, total, dtype, nullptr);
  to_int(total, info);
  auto work = std::make_unique<MpiWork>(info);
  counts_and_displs(counts, work->counts, work->displs);
  work->requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Iallgatherv(send, work->counts[rank()], wire_type(dtype), recv, work->counts.data(),
                        work->displs.data(), wire_type(dtype), comm_, &work->requests[0]),
        info);
  return work;
}

WorkPtr MpiCommunicator::do_batch_isend_irecv(std::span<const P2POp> ops) {
  WaitInfo info;
  info.group = &group_;
  if (ops.size() == 1) {
    info = p2p(ops[0].kind == P2POp::Kind::Send ? CommOp::Send : CommOp::Recv, ops[0].count, ops[0].dtype,
               ops[0].peer, ops[0].tag);
  } else {
    info.op = ops.empty() || ops[0].kind == P2POp::Kind::Send ? CommOp::Send : CommOp::Recv;
    info.batch = true;
    info.count = ops.size();
    for (const P2POp& op : ops) {
      int world = world_ranks()[op.peer];
      if (std::find(info.peers, info.peers + info.n_peers, world) != info.peers + info.n_peers) continue;
      if (info.n_peers < WaitInfo::kMaxPeers)
        info.peers[info.n_peers++] = world;
      else
        info.more_peers++;
    }
  }
  for (const P2POp& op : ops) {
    to_int(op.count, info);
    LATTICE_CHECK(op.tag <= tag_upper_bound_, describe_wait(info) << ": tag " << op.tag << " above MPI_TAG_UB="
                                                                  << tag_upper_bound_);
  }
  auto work = std::make_unique<MpiWork>(info);
  work->requests.assign(ops.size(), MPI_REQUEST_NULL);
  for (size_t i = 0; i < ops.size(); i++) {
    const P2POp& op = ops[i];
    int n = static_cast<int>(op.count);
    if (op.kind == P2POp::Kind::Send) {
      check(MPI_Isend(op.data, n, wire_type(op.dtype), op.peer, op.tag, comm_, &work->requests[i]), info);
    } else {
      check(MPI_Irecv(op.data, n, wire_type(op.dtype), op.peer, op.tag, comm_, &work->requests[i]), info);
      work->recvs.push_back({i, op.count, op.dtype, world_ranks()[op.peer]});
    }
  }
  return work;
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key, const std::string& name) {
  WaitInfo info = collective(CommOp::Barrier, 0, DType::F32, nullptr);
  info.label = "split";
  MPI_Comm child = MPI_COMM_NULL;
  {
    WaitScope scope(info);
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child), info);
  }
  if (child == MPI_COMM_NULL) return nullptr;
  return adopt(child, name);
}

}  // namespace lattice::comm
