// lattice bench comm: bandwidth of lattice's communication calls against the
// raw MPI calls underneath, in the same run (like nccl-tests).
//
// For each size S (bytes of the full buffer, as nccl-tests counts it) and
// each operation it times lattice's call and the equivalent raw MPI call on
// the same communicator and buffers, alternating the two over several rounds,
// and prints
//   algbw = S / time          busbw = algbw * factor
// with the bus-bandwidth factors of nccl-tests: all_reduce 2(n-1)/n,
// reduce_scatter / all_gather / all_to_all (n-1)/n, send_recv and broadcast 1.
// busbw is comparable across rank counts: it is the per-link rate a
// bandwidth-optimal algorithm achieves. "ratio" is lattice's busbw over raw
// MPI's, i.e. our overhead as a ratio. A second, independent series of raw MPI
// rounds interleaved with the other two gives "A/A", raw over raw: the spread
// the machine's noise alone produces, measured under the same load.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "lattice/cli/args.h"
#include "lattice/cli/bench_registry.h"
#include "lattice/comm/mpi_communicator.h"
#include "lattice/comm/watchdog.h"
#include "lattice/core/error.h"
#include "lattice/core/memory.h"
#include "lattice/core/timer.h"

namespace lattice::cli {

namespace {

const char* kHelp =
    "usage: mpiexec -n N lattice bench comm [options]\n"
    "\n"
    "Times all_reduce, reduce_scatter, all_gather, all_to_all and send_recv (each rank\n"
    "sends to the next and receives from the previous) through lattice's Communicator\n"
    "and through the raw MPI calls, for sizes from --min-bytes to --max-bytes.\n"
    "\n"
    "options:\n"
    "  --min-bytes SIZE   smallest buffer (default 1K); sizes take K, M, G (powers of 2)\n"
    "  --max-bytes SIZE   largest buffer (default 256M)\n"
    "  --factor F         size multiplier between steps (default 2)\n"
    "  --ops LIST         comma-separated subset of all_reduce,reduce_scatter,all_gather,\n"
    "                     all_to_all,send_recv,broadcast,iall_reduce (default: the first\n"
    "                     five; iall_reduce is the non-blocking form, raw side MPI_Iallreduce)\n"
    "  --dtype T          f32 (default), bf16 or f16; bf16/f16 reductions use lattice's\n"
    "                     widening MPI operation on both sides\n"
    "  --rounds R         timed rounds per size and series (default 21)\n"
    "  --iters K          calls per round (default: 1 MiB / size, between 1 and 100)\n"
    "  --no-watchdog      pause the watchdog thread during lattice's rounds too (it is\n"
    "                     always paused during raw MPI's): isolates the watchdog's cost\n"
    "\n"
    "A round is K calls of one series after a barrier, timed on the slowest rank. Three\n"
    "series are interleaved, in rotating order: lattice, raw MPI, and raw MPI again. The\n"
    "table shows each series' fastest round (the figure least disturbed by other load);\n"
    "ratio = lattice busbw / raw busbw, A/A = second raw series / raw: the spread that\n"
    "noise alone produces on this machine at this moment.\n";

enum class Op { AllReduce, ReduceScatter, AllGather, AllToAll, SendRecv, Broadcast, IAllReduce };

struct OpInfo {
  Op op;
  const char* name;
  const char* factor_text;
};

const OpInfo kOps[] = {{Op::AllReduce, "all_reduce", "2(n-1)/n"}, {Op::ReduceScatter, "reduce_scatter", "(n-1)/n"},
                       {Op::AllGather, "all_gather", "(n-1)/n"},  {Op::AllToAll, "all_to_all", "(n-1)/n"},
                       {Op::SendRecv, "send_recv", "1"},          {Op::Broadcast, "broadcast", "1"},
                       {Op::IAllReduce, "iall_reduce", "2(n-1)/n"}};

double bus_factor(Op op, int n) {
  switch (op) {
    case Op::AllReduce:
    case Op::IAllReduce: return 2.0 * (n - 1) / n;
    case Op::ReduceScatter:
    case Op::AllGather:
    case Op::AllToAll: return static_cast<double>(n - 1) / n;
    case Op::SendRecv:
    case Op::Broadcast: return 1.0;
  }
  return 1.0;
}

// "4096", "64K", "256M", "1G", "1KiB", "16MiB" -> bytes.
size_t parse_size(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  std::string unit = end ? std::string(end) : "";
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  LATTICE_CHECK(end != text.c_str() && scale > 0 && v >= 1 && std::isfinite(v),
                flag << " '" << text << "' is not a size (e.g. 4096, 64K, 256M, 1G)");
  return static_cast<size_t>(v * scale);
}

struct Options {
  size_t min_bytes = 1024;
  size_t max_bytes = 256u << 20;
  double factor = 2;
  std::vector<Op> ops = {Op::AllReduce, Op::ReduceScatter, Op::AllGather, Op::AllToAll, Op::SendRecv};
  DType dtype = DType::F32;
  int rounds = 21;
  int iters = 0;  // 0: from the size
  bool watchdog_during_lattice = true;
};

Options parse(const std::vector<std::string>& args, bool* help) {
  Options o;
  for (size_t i = 1; i < args.size(); i++) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *help = true;
    } else if (a == "--min-bytes") {
      o.min_bytes = parse_size(a, flag_value(args, i++));
    } else if (a == "--max-bytes") {
      o.max_bytes = parse_size(a, flag_value(args, i++));
    } else if (a == "--factor") {
      o.factor = parse_float_flag(a, flag_value(args, i++));
      LATTICE_CHECK(o.factor > 1, "--factor " << o.factor << " must be above 1");
    } else if (a == "--dtype") {
      o.dtype = parse_dtype(flag_value(args, i++));
    } else if (a == "--rounds") {
      o.rounds = static_cast<int>(parse_int_flag(a, flag_value(args, i++)));
      LATTICE_CHECK(o.rounds >= 1, "--rounds " << o.rounds << " must be at least 1");
    } else if (a == "--iters") {
      o.iters = static_cast<int>(parse_int_flag(a, flag_value(args, i++)));
      LATTICE_CHECK(o.iters >= 1, "--iters " << o.iters << " must be at least 1");
    } else if (a == "--no-watchdog") {
      o.watchdog_during_lattice = false;
    } else if (a == "--ops") {
      o.ops.clear();
      std::stringstream list(flag_value(args, i++));
      std::string name;
      while (std::getline(list, name, ',')) {
        const OpInfo* found = nullptr;
        for (const OpInfo& info : kOps)
          if (name == info.name) found = &info;
        LATTICE_CHECK(found, "--ops: unknown operation '"
                                 << name << "' (valid: all_reduce, reduce_scatter, all_gather, all_to_all, "
                                            "send_recv, broadcast, iall_reduce)");
        o.ops.push_back(found->op);
      }
    } else {
      LATTICE_FAIL("lattice bench comm: unknown option '" << a << "' (see lattice bench comm --help)");
    }
  }
  LATTICE_CHECK(o.min_bytes <= o.max_bytes,
                "--min-bytes " << o.min_bytes << " is larger than --max-bytes " << o.max_bytes);
  return o;
}

// Per-call seconds of each round of the three series (a round: `iters` calls
// after a barrier, timed on the slowest rank).
struct Rounds {
  std::vector<double> ours, raw, control;
  static double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
};

class CommBench {
 public:
  CommBench(const Options& o, comm::MpiCommunicator& c) : o_(o), c_(c) {
    n_ = c_.size();
    r_ = c_.rank();
    elem_ = dtype_size(o.dtype);
    // Every operation's buffers fit in two of the largest size.
    size_t bytes = o.max_bytes + 64 * elem_ * n_;
    send_ = Buffer(bytes, MemCategory::Comm);
    recv_ = Buffer(bytes, MemCategory::Comm);
  }

  // Per-rank element count for `op` at `size` bytes, and the size actually
  // moved (rounded down so the world size divides it).
  size_t block_count(Op op, size_t size) const {
    size_t count = size / elem_;
    if (op == Op::ReduceScatter || op == Op::AllGather || op == Op::AllToAll) count = count / n_;
    return std::max<size_t>(count, 1);
  }
  size_t moved_bytes(Op op, size_t size) const {
    size_t b = block_count(op, size) * elem_;
    return (op == Op::ReduceScatter || op == Op::AllGather || op == Op::AllToAll) ? b * n_ : b;
  }

  void lattice_call(Op op, size_t count) {
    void* s = send_.data();
    void* d = recv_.data();
    switch (op) {
      case Op::AllReduce: c_.all_reduce(d, count, o_.dtype, comm::ReduceOp::Sum); break;
      case Op::IAllReduce: c_.iall_reduce(d, count, o_.dtype, comm::ReduceOp::Sum)->wait(); break;
      case Op::ReduceScatter: c_.reduce_scatter(s, d, count, o_.dtype, comm::ReduceOp::Sum); break;
      case Op::AllGather: c_.all_gather(s, d, count, o_.dtype); break;
      case Op::AllToAll: c_.all_to_all(s, d, count, o_.dtype); break;
      case Op::Broadcast: c_.broadcast(d, count, o_.dtype, 0); break;
      case Op::SendRecv: {
        comm::P2POp ops[] = {comm::P2POp::recv(d, count, o_.dtype, (r_ + n_ - 1) % n_),
                             comm::P2POp::send(s, count, o_.dtype, (r_ + 1) % n_)};
        c_.batch_isend_irecv(ops)->wait();
        break;
      }
    }
  }

  void raw_call(Op op, size_t count) {
    void* s = send_.data();
    void* d = recv_.data();
    int n = static_cast<int>(count);
    MPI_Datatype t = comm::mpi_wire_type(o_.dtype);
    MPI_Comm mc = c_.mpi_comm();
    switch (op) {
      case Op::AllReduce:
        MPI_Allreduce(MPI_IN_PLACE, d, n, t, comm::mpi_reduce_op(o_.dtype, comm::ReduceOp::Sum), mc);
        break;
      case Op::IAllReduce: {
        MPI_Request request;
        MPI_Iallreduce(MPI_IN_PLACE, d, n, t, comm::mpi_reduce_op(o_.dtype, comm::ReduceOp::Sum), mc, &request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
        break;
      }
      case Op::ReduceScatter:
        MPI_Reduce_scatter_block(s, d, n, t, comm::mpi_reduce_op(o_.dtype, comm::ReduceOp::Sum), mc);
        break;
      case Op::AllGather: MPI_Allgather(s, n, t, d, n, t, mc); break;
      case Op::AllToAll: MPI_Alltoall(s, n, t, d, n, t, mc); break;
      case Op::Broadcast: MPI_Bcast(d, n, t, 0, mc); break;
      case Op::SendRecv:
        MPI_Sendrecv(s, n, t, (r_ + 1) % n_, 0, d, n, t, (r_ + n_ - 1) % n_, 0, mc, MPI_STATUS_IGNORE);
        break;
    }
  }

  // Seconds per call of `iters` calls, on the slowest rank.
  double time_round(const std::function<void()>& call, int iters) {
    MPI_Barrier(c_.mpi_comm());
    Timer t;
    for (int i = 0; i < iters; i++) call();
    double local = t.seconds() / iters, slowest = 0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, c_.mpi_comm());
    return slowest;
  }

  Rounds measure(Op op, size_t size, int iters) {
    Rounds out;
    size_t count = block_count(op, size);
    auto lattice_fn = [&] { lattice_call(op, count); };
    auto raw_fn = [&] { raw_call(op, count); };
    // Warm-up: first touch of the pages, connection set-up.
    lattice_fn();
    {
      comm::WatchdogPause pause;
      raw_fn();
    }
    for (int round = 0; round < o_.rounds; round++) {
      // Rotate the order, so a drift in machine load hits every series alike.
      for (int k = 0; k < 3; k++) {
        int series = (round + k) % 3;
        if (series == 0) {
          std::optional<comm::WatchdogPause> pause;
          if (!o_.watchdog_during_lattice) pause.emplace();
          out.ours.push_back(time_round(lattice_fn, iters));
        } else {
          comm::WatchdogPause pause;  // raw MPI runs with lattice's watchdog thread idle
          (series == 1 ? out.raw : out.control).push_back(time_round(raw_fn, iters));
        }
      }
    }
    return out;
  }

 private:
  const Options& o_;
  comm::MpiCommunicator& c_;
  int n_ = 1, r_ = 0;
  size_t elem_ = 4;
  Buffer send_, recv_;
};

// "6.70 6.81 6.30" from /proc/loadavg: the machine may be shared.
std::string load_average() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return "unknown";
  double a = 0, b = 0, c = 0;
  int got = std::fscanf(f, "%lf %lf %lf", &a, &b, &c);
  std::fclose(f);
  if (got != 3) return "unknown";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %.2f %.2f (1, 5, 15 min)", a, b, c);
  return buf;
}

std::string human_size(size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20))
    std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / 1048576.0);
  else if (bytes >= 1024)
    std::snprintf(buf, sizeof buf, "%.0f KiB", bytes / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  return buf;
}

int run_bench_comm(const std::vector<std::string>& args) {
  bool help = false;
  Options o = parse(args, &help);
  auto world = comm::make_world_communicator();
  bool root = world->rank() == 0;
  if (help) {
    if (root) std::fputs(kHelp, stdout);
    return 0;
  }
  int n = world->size();
  CommBench bench(o, *world);

  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string lib(version, len);
  lib = lib.substr(0, lib.find_first_of(",\n"));
  if (root) {
    std::printf("# lattice bench comm: %d rank%s, %s, %s\n", n, n == 1 ? "" : "s", dtype_name(o.dtype), lib.c_str());
    std::printf("# %d rounds per size of each series, interleaved: lattice, raw MPI, raw MPI again (A/A);\n",
                o.rounds);
    std::printf("# a round is `iters` calls after a barrier, timed on its slowest rank. time = fastest round,\n");
    std::printf("# per call; algbw = size / time, busbw = algbw * factor (GB/s = 1e9 B/s)\n");
    std::printf("# ratio = lattice busbw / raw busbw (1.000: no overhead); A/A = raw again / raw (noise alone)\n");
    std::printf("# load average at start: %s\n", load_average().c_str());
    if (!o.watchdog_during_lattice) std::printf("# --no-watchdog: watchdog paused for lattice's rounds too\n");
  }

  std::vector<size_t> sizes;
  for (double s = static_cast<double>(o.min_bytes); s <= static_cast<double>(o.max_bytes) * 1.0001; s *= o.factor)
    sizes.push_back(static_cast<size_t>(s));

  struct Summary {
    const char* name;
    double log_ratio_sum = 0, log_control_sum = 0;
    int count = 0;
    double lo = 1e30, hi = 0, lo_control = 1e30, hi_control = 0;
  };
  std::vector<Summary> summaries;

  for (Op op : o.ops) {
    const OpInfo* info = nullptr;
    for (const OpInfo& i : kOps)
      if (i.op == op) info = &i;
    double factor = bus_factor(op, n);
    if (root) {
      std::printf("\n# %s (busbw factor %s = %.3f)\n", info->name, info->factor_text, factor);
      std::printf("# %10s %10s %6s | %11s %8s %8s | %11s %8s %8s | %6s %6s\n", "size", "count", "iters", "lattice us",
                  "algbw", "busbw", "raw us", "algbw", "busbw", "ratio", "A/A");
    }
    Summary summary{info->name};
    for (size_t size : sizes) {
      size_t moved = bench.moved_bytes(op, size);
      int iters = o.iters ? o.iters : static_cast<int>(std::clamp<size_t>((1u << 20) / moved, 1, 100));
      Rounds rounds = bench.measure(op, size, iters);
      double best_ours = Rounds::best(rounds.ours), best_raw = Rounds::best(rounds.raw);
      double alg_ours = moved / best_ours / 1e9, alg_raw = moved / best_raw / 1e9;
      double ratio = best_raw / best_ours, control = best_raw / Rounds::best(rounds.control);
      if (moved >= (1u << 20)) {
        summary.log_ratio_sum += std::log(ratio);
        summary.log_control_sum += std::log(control);
        summary.lo_control = std::min(summary.lo_control, control);
        summary.hi_control = std::max(summary.hi_control, control);
        summary.count++;
        summary.lo = std::min(summary.lo, ratio);
        summary.hi = std::max(summary.hi, ratio);
      }
      if (root)
        std::printf("  %10s %10zu %6d | %11.1f %8.3f %8.3f | %11.1f %8.3f %8.3f | %6.3f %6.3f\n",
                    human_size(moved).c_str(),
                    bench.block_count(op, size), iters, best_ours * 1e6, alg_ours, alg_ours * factor, best_raw * 1e6,
                    alg_raw, alg_raw * factor, ratio, control);
      std::fflush(stdout);
    }
    summaries.push_back(summary);
  }

  if (root) {
    std::printf("\n# sizes >= 1 MiB: lattice busbw / raw MPI busbw\n");
    std::printf("# %-16s %14s %14s %14s %14s\n", "operation", "ratio geomean", "ratio min-max", "A/A geomean",
                "A/A min-max");
    for (const Summary& s : summaries) {
      if (s.count == 0) continue;
      std::printf("  %-16s %14.3f %8.3f-%5.3f %14.3f %8.3f-%5.3f\n", s.name, std::exp(s.log_ratio_sum / s.count), s.lo,
                  s.hi, std::exp(s.log_control_sum / s.count), s.lo_control, s.hi_control);
    }
    std::printf("# load average at end: %s\n", load_average().c_str());
  }
  return 0;
}

}  // namespace

LATTICE_REGISTER_BENCH("comm", "collectives and send/recv: lattice's Communicator vs raw MPI, busbw per size",
                       run_bench_comm);

}  // namespace lattice::cli
