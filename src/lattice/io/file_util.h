// Small POSIX file helpers shared by the io code: durable writes (tmp file +
// fsync + rename + fsync of the directory) and whole-file reads, with errors
// that name the path and the system's reason.
#pragma once

#include <cstddef>
#include <string>

namespace lattice::io {

// strerror(errno) of the calling thread, e.g. "No such file or directory".
std::string errno_text();

// Opens `path` for writing (created or truncated). Every failure throws
// lattice::Error naming the path. The destructor closes (without fsync) if
// close() was not called.
class FileWriter {
 public:
  explicit FileWriter(const std::string& path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t bytes);
  // fsync + close.
  void sync_and_close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// fsync of a file or a directory (directories make renames and creations durable).
void fsync_path(const std::string& path);
// The directory part of a path ("." when there is none).
std::string parent_dir(const std::string& path);
// Writes contents to path atomically: path.tmp.<pid>, fsync, rename, fsync the directory.
void write_file_atomic(const std::string& path, const std::string& contents);
// Reads a whole file; `what` names it in errors ("config file", "checkpoint meta").
std::string read_whole_file(const std::string& path, const std::string& what);

}  // namespace lattice::io
