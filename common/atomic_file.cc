#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace colod {
absl::Status FileError(absl::string_view what, absl::string_view path, int err) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return absl::ResourceExhaustedError(message);
  return absl::FailedPreconditionError(message);
}

namespace {

absl::Status Errno(const std::string& what, const std::string& path) { return FileError(what, path, errno); }

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  return WriteFileAtomically(path, contents, [] { return absl::OkStatus(); });
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 const std::function<absl::Status()>& before_rename) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  absl::Status s;
  const char* p = contents.data();
  size_t left = contents.size();
  while (s.ok() && left > 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      s = Errno("cannot write", tmp);
      break;
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot fsync", tmp);
  if (::close(fd) != 0 && s.ok()) s = Errno("cannot close", tmp);
  if (s.ok()) s = before_rename();
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) s = Errno("cannot rename to", path);
  if (!s.ok()) {
    std::remove(tmp.c_str());
    return s;
  }
  // The rename is durable once the directory is.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos && name.find('\0') == absl::string_view::npos;
}

}  // namespace colod
