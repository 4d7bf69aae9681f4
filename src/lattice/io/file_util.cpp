#include "lattice/io/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "lattice/core/error.h"

namespace lattice::io {

std::string errno_text() { return std::strerror(errno); }

FileWriter::FileWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LATTICE_CHECK(fd_ >= 0, "cannot create '" << path << "': " << errno_text());
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t bytes) {
  LATTICE_CHECK(fd_ >= 0, "write to closed file '" << path_ << "'");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; loop for larger tensors and short writes.
    size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0 && errno == EINTR) continue;
    LATTICE_CHECK(n > 0, "cannot write '" << path_ << "': " << (n < 0 ? errno_text() : "no progress"));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void FileWriter::sync_and_close() {
  LATTICE_CHECK(fd_ >= 0, "file '" << path_ << "' already closed");
  int rc = ::fsync(fd_);
  int saved = errno;
  int rc_close = ::close(fd_);
  fd_ = -1;
  errno = saved;
  LATTICE_CHECK(rc == 0, "cannot fsync '" << path_ << "': " << errno_text());
  LATTICE_CHECK(rc_close == 0, "cannot close '" << path_ << "': " << errno_text());
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATTICE_CHECK(fd >= 0, "cannot open '" << path << "' to fsync: " << errno_text());
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  LATTICE_CHECK(rc == 0, "cannot fsync '" << path << "': " << errno_text());
}

std::string parent_dir(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    FileWriter w(tmp);
    w.write(contents.data(), contents.size());
    w.sync_and_close();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string reason = errno_text();
    ::unlink(tmp.c_str());
    LATTICE_FAIL("cannot rename '" << tmp << "' to '" << path << "': " << reason);
  }
  fsync_path(parent_dir(path));
}

std::string read_whole_file(const std::string& path, const std::string& what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LATTICE_CHECK(fd >= 0, "cannot read " << what << " '" << path << "': " << errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string reason = errno_text();
    ::close(fd);
    LATTICE_FAIL("cannot read " << what << " '" << path << "': " << reason);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    LATTICE_FAIL("cannot read " << what << " '" << path << "': it is a directory");
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string reason = errno_text();
      ::close(fd);
      LATTICE_FAIL("cannot read " << what << " '" << path << "': " << reason);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace lattice::io
