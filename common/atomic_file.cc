#include "common/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace colod {
absl::Status FileError(absl::string_view what, absl::string_view path, int err) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) return absl::ResourceExhaustedError(message);
  if (err == EIO || err == ESTALE || err == EMFILE || err == ENFILE || err == ENOMEM || err == EINTR ||
      err == EAGAIN) {
    return absl::UnavailableError(message);
  }
  return absl::FailedPreconditionError(message);
}

namespace {

absl::Status Errno(const std::string& what, const std::string& path) { return FileError(what, path, errno); }

}  // namespace

const char* FileKind(mode_t mode) {
  return S_ISDIR(mode)    ? "a directory"
         : S_ISFIFO(mode) ? "a FIFO"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISBLK(mode)  ? "a block device"
         : S_ISSOCK(mode) ? "a socket"
         : S_ISLNK(mode)  ? "a symbolic link"
                          : "not a regular file";
}

bool IsAtomicWriteLeftover(absl::string_view name) {
  const size_t tmp = name.rfind(".tmp.");
  if (tmp == absl::string_view::npos || tmp == 0) return false;
  const absl::string_view rest = name.substr(tmp + 5);  // PID.N
  const size_t dot = rest.find('.');
  if (dot == absl::string_view::npos || dot == 0 || dot + 1 == rest.size()) return false;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i != dot && (rest[i] < '0' || rest[i] > '9')) return false;
  }
  return true;
}

absl::Status CheckReplaceable(const std::string& path) {
  // The rename would replace a link, a FIFO or a device with a file (and
  // fail on a directory): refused, so that nothing but a file is replaced.
  struct stat existing;
  if (::lstat(path.c_str(), &existing) == 0 && !S_ISREG(existing.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot write '", path, "': it is ", FileKind(existing.st_mode),
                                                      ", not a file that a new one may replace"));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  return WriteFileAtomically(path, contents, [] { return absl::OkStatus(); });
}

int OpenWithoutWaiting(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;
  const int now = ::fcntl(fd, F_GETFL);
  if (now < 0 || ::fcntl(fd, F_SETFL, now & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path) {
  while (!bytes.empty()) {
    const ssize_t w = ::write(fd, bytes.data(), bytes.size());
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return FileError("cannot write", path, w < 0 ? errno : EIO);
    bytes.remove_prefix(static_cast<size_t>(w));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 const std::function<absl::Status()>& before_rename) {
  return WriteFileAtomically(path, absl::MakeConstSpan(&contents, 1), before_rename);
}

absl::Status WriteFileAtomically(const std::string& path, absl::Span<const absl::string_view> pieces,
                                 const std::function<absl::Status()>& before_rename) {
  return WriteFileAtomicallyStreamed(
      path,
      [pieces](const PieceWriter& write) {
        for (const absl::string_view piece : pieces) {
          if (absl::Status s = write(piece); !s.ok()) return s;
        }
        return absl::OkStatus();
      },
      before_rename);
}

namespace {

absl::Mutex temporaries_mu(absl::kConstInit);
std::set<std::string>& Temporaries() ABSL_EXCLUSIVE_LOCKS_REQUIRED(temporaries_mu) {
  static auto* const files = new std::set<std::string>();
  return *files;
}
bool temporaries_removed ABSL_GUARDED_BY(temporaries_mu) = false;  // the process is ending

}  // namespace

void RegisterTemporaryFile(const std::string& path) {
  temporaries_mu.Lock();
  if (temporaries_removed) {
    // The process ends now (RemoveTemporaryFiles' caller): no file is made
    // that nothing would remove.
    temporaries_mu.Unlock();
    for (;;) ::pause();
  }
  Temporaries().insert(path);
  temporaries_mu.Unlock();
}

void TemporaryFileMade(const std::string& path) {
  temporaries_mu.Lock();
  if (temporaries_removed) {
    ::unlink(path.c_str());  // made after the cleanup: nothing else would remove it
    temporaries_mu.Unlock();
    for (;;) ::pause();
  }
  temporaries_mu.Unlock();
}

void UnregisterTemporaryFile(const std::string& path) {
  absl::MutexLock lock(&temporaries_mu);
  Temporaries().erase(path);
}

int RemoveTemporaryFiles() {
  absl::MutexLock lock(&temporaries_mu);  // (held: no file is registered or renamed meanwhile)
  int removed = 0;
  for (const std::string& path : Temporaries()) removed += std::remove(path.c_str()) == 0 ? 1 : 0;
  Temporaries().clear();
  temporaries_removed = true;
  return removed;
}

absl::Status WriteFileAtomicallyStreamed(const std::string& path,
                                         const std::function<absl::Status(const PieceWriter&)>& produce,
                                         const std::function<absl::Status()>& before_rename) {
  if (absl::Status s = CheckReplaceable(path); !s.ok()) return s;
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  RegisterTemporaryFile(tmp);  // (before it exists: a signal now removes nothing, or it)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const absl::Status failed = Errno("cannot create", tmp);  // (errno, before anything else)
    UnregisterTemporaryFile(tmp);
    return failed;
  }
  TemporaryFileMade(tmp);
  absl::Status s = produce([fd, &tmp](absl::string_view piece) { return WriteAll(fd, piece, tmp); });
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot fsync", tmp);
  if (::close(fd) != 0 && s.ok()) s = Errno("cannot close", tmp);
  if (s.ok()) s = before_rename();
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) s = Errno("cannot rename to", path);
  if (!s.ok()) std::remove(tmp.c_str());
  UnregisterTemporaryFile(tmp);
  if (!s.ok()) return s;
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

absl::StatusOr<std::string> ReadFileToString(const std::string& path, int64_t max_bytes) {
  ASSIGN_OR_RETURN(const RegularFileReader file, RegularFileReader::Open(path));
  if (file.size() > max_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read '", path, "': it holds ", file.size(),
                                                      " bytes, more than the ", max_bytes, " expected"));
  }
  std::string out(static_cast<size_t>(file.size()), '\0');
  RETURN_IF_ERROR(file.ReadAt(0, out.data(), out.size()));
  return out;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  // Not blocked in open by a FIFO without a writer; a pipe with one (a
  // shell's <(...)) is read to its end, blocking again.
  const int fd = OpenWithoutWaiting(path, O_RDONLY);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("cannot read '", path, "': ", std::strerror(errno)));
    }
    return Errno("cannot read", path);  // there, but not ours to read (EACCES, ...)
  }
  struct stat info;
  const int err = ::fstat(fd, &info) != 0 ? errno : S_ISDIR(info.st_mode) ? EISDIR : 0;
  if (err == 0 && !S_ISREG(info.st_mode) && !S_ISFIFO(info.st_mode)) {
    ::close(fd);  // a device (/dev/zero would never end) or a terminal
    return absl::FailedPreconditionError(absl::StrCat("cannot read '", path, "': not a file or a pipe"));
  }
  if (err != 0) {
    ::close(fd);
    return FileError("cannot read", path, err);
  }
  std::string out;
  if (S_ISREG(info.st_mode) && info.st_size > 0) out.reserve(static_cast<size_t>(info.st_size));
  char buffer[1 << 16];
  absl::Status s;
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      out.append(buffer, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      s = Errno("cannot read", path);  // EIO midway
      break;
    }
  }
  ::close(fd);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<RegularFileReader> RegularFileReader::Open(const std::string& path) {
  const int fd = OpenWithoutWaiting(path, O_RDONLY);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("cannot open '", path, "': ", std::strerror(errno)));
    }
    return Errno("cannot open", path);
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    return FileError("cannot stat", path, err);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", FileKind(info.st_mode), ", not a regular file"));
  }
  return RegularFileReader(path, fd, static_cast<int64_t>(info.st_size));
}

RegularFileReader::RegularFileReader(RegularFileReader&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

RegularFileReader& RegularFileReader::operator=(RegularFileReader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

RegularFileReader::~RegularFileReader() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status RegularFileReader::ReadAt(int64_t offset, void* dst, size_t n) const {
  if (offset < 0 || n > static_cast<uint64_t>(INT64_MAX - offset)) {
    return absl::InvalidArgumentError(absl::StrCat("a read of ", n, " bytes at offset ", offset, " of ", path_));
  }
  char* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Errno("cannot read", path_);
    if (got == 0) {
      return absl::DataLossError(absl::StrCat(path_, " ends at byte ", offset + static_cast<int64_t>(done),
                                              ", before the ", n, " bytes from byte ", offset,
                                              " that were asked for: the file changed while in use"));
    }
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

uint64_t RaiseOpenFileLimit() {
  static const uint64_t limit = [] {
    struct rlimit r;
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return uint64_t{0};
    if (r.rlim_cur < r.rlim_max) {
      const rlim_t was = r.rlim_cur;
      r.rlim_cur = r.rlim_max;
      if (::setrlimit(RLIMIT_NOFILE, &r) != 0) r.rlim_cur = was;
    }
    return static_cast<uint64_t>(r.rlim_cur);
  }();
  return limit;
}

absl::Status SyncDirectory(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("cannot open", dir);
  absl::Status s;
  if (::fsync(dfd) != 0) s = Errno("cannot fsync", dir);
  ::close(dfd);
  return s;
}

size_t RemoveOldestFiles(const std::string& dir, size_t keep) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return 0;
  std::vector<std::pair<struct timespec, std::string>> files;
  for (const std::string& name : *names) {
    struct stat st;
    const std::string path = absl::StrCat(dir, "/", name);
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    files.emplace_back(st.st_mtim, name);
  }
  if (files.size() <= keep) return 0;
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) {
    if (a.first.tv_sec != b.first.tv_sec) return a.first.tv_sec < b.first.tv_sec;
    if (a.first.tv_nsec != b.first.tv_nsec) return a.first.tv_nsec < b.first.tv_nsec;
    return a.second < b.second;
  });
  size_t removed = 0;
  for (size_t i = 0; i + keep < files.size(); ++i) {
    if (::unlink(absl::StrCat(dir, "/", files[i].second).c_str()) == 0) ++removed;
  }
  return removed;
}

absl::Status SyncFilesAndDirectory(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    const std::string path = absl::StrCat(dir, "/", name);
    // O_NOFOLLOW and O_NONBLOCK: a link or a FIFO is not ours to wait on.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ELOOP) continue;  // a symbolic link
      return Errno("cannot open", path);
    }
    struct stat info;
    absl::Status s;
    if (::fstat(fd, &info) != 0) {
      s = Errno("cannot stat", path);
    } else if (S_ISREG(info.st_mode) && ::fsync(fd) != 0) {
      s = Errno("cannot fsync", path);
    }
    ::close(fd);
    if (!s.ok()) return s;
  }
  return SyncDirectory(dir);
}

absl::StatusOr<DiskSpace> FreeDiskSpace(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return Errno("cannot examine the file system of", dir);
  DiskSpace d;
  // Saturated: a file system reporting more than 2^63 bytes has room.
  const auto bytes = [&st](uint64_t blocks) {
    const unsigned __int128 b = static_cast<unsigned __int128>(blocks) * st.f_frsize;
    return b > static_cast<unsigned __int128>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                                   : static_cast<int64_t>(b);
  };
  d.free_bytes = bytes(st.f_bavail);
  d.total_bytes = bytes(st.f_blocks);
  if (st.f_files > 0) {
    d.free_inodes = st.f_favail > static_cast<fsfilcnt_t>(std::numeric_limits<int64_t>::max())
                        ? std::numeric_limits<int64_t>::max()
                        : static_cast<int64_t>(st.f_favail);
  }
  return d;
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR || err == EACCES || err == EPERM) {
      return absl::NotFoundError(absl::StrCat("cannot list '", dir, "': ", std::strerror(err)));
    }
    return FileError("cannot list", dir, err);  // of the moment (EMFILE, EIO, ...): UNAVAILABLE
  }
  std::vector<std::string> names;
  for (;;) {
    errno = 0;
    const struct dirent* e = ::readdir(d);
    if (e == nullptr) break;
    const absl::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat("listing '", dir, "' failed midway: ", std::strerror(err)));
  }
  return names;
}

absl::StatusOr<int> LockDirectory(const std::string& dir, absl::string_view flag, absl::string_view holder,
                                  std::string* made) {
  if (dir.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": required"));
  std::error_code ec;
  // The outermost of `dir` and its parents that is missing; handed to the
  // caller only once the lock is ours (where it is another's, a directory
  // this call found missing may be that other daemon's by now).
  std::string outermost;
  if (made != nullptr) {
    made->clear();
    for (std::filesystem::path p = std::filesystem::absolute(dir, ec).lexically_normal();
         !ec && p.has_relative_path() && !std::filesystem::exists(p, ec) && !ec; p = p.parent_path()) {
      outermost = p.string();
    }
    if (ec) outermost.clear();  // cannot tell: nothing to remove
    ec.clear();
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat(flag, ": cannot create '", dir, "': ", ec.message()));
  const std::string lock_path = dir + "/LOCK";
  // Not through a link (a LOCK planted in a shared directory would have us
  // truncate what it points to), and a regular file.
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return FileError(absl::StrCat(flag, ": cannot open"), lock_path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(flag, ": '", lock_path, "' is not a regular file"));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err != EWOULDBLOCK) return FileError(absl::StrCat(flag, ": cannot lock"), lock_path, err);  // ENOLCK: NFS
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": '", dir, "' is in use by another ", holder, " (", lock_path, " is locked)"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::write(fd, pid.data(), pid.size()) < 0) {
    // Only a note for whoever looks: the lock is what counts.
  }
  if (made != nullptr) *made = std::move(outermost);
  return fd;
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
