// DiskStore: ZeRO-Infinity's disk tier. A rank's optimizer state (Adam's
// moments and, at ZeRO stage 3, its parameter shard) lives in files under
// zero.offload_dir, and only a bounded window of it is ever in memory.
//
// update_in_windows() streams the state through three rotating buffers per
// array: while the optimizer updates window i, window i+1 is being read and
// window i-1 written back by an I/O thread (reads ahead, writes behind; the
// thread serves requests in order, so a buffer is never refilled before its
// write-back is done). Resident optimizer memory is 3 windows x arrays.
//
// Files are opened with O_DIRECT where the filesystem allows it, so the state
// really leaves memory instead of moving to the page cache (sizes and offsets
// are padded to 4 KiB for that); elsewhere they are ordinary files.
//
// The I/O engine (a thread doing pread/pwrite, against io_uring) was chosen
// by measurement: docs/performance.md, "Disk offload".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "lattice/optim/state_store.h"

namespace lattice::parallel {

// `dir` must exist and be writable (checked, with a message naming it).
// Files: dir/lattice-pid<P>-rank<R>-{m,v,p}.bin (the pid keeps two jobs that
// share a directory apart; a `tag` T, dir/lattice-pid<P>-rank<R>-T-{m,v,p}.bin,
// two stores of one rank), created (truncated) here, zeros.
// `window_bytes` bounds the resident memory (all arrays, all buffers).
std::unique_ptr<optim::StateStore> make_disk_store(const std::string& dir, int rank, int64_t numel, int arrays,
                                                   double window_bytes, const std::string& tag = "");

// Checks that `dir` exists and a file can be created and written there;
// throws naming the key and the path otherwise.
void check_offload_dir(const std::string& dir);

}  // namespace lattice::parallel
