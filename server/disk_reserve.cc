#include "server/disk_reserve.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::unique_ptr<DiskReserve>> DiskReserve::Create(std::string path, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("a disk reserve of ", bytes, " bytes"));
  std::unique_ptr<DiskReserve> r(new DiskReserve(std::move(path), bytes));
  // Refill takes it back only with twice its size free: more than half the
  // file system would never be taken back, and no job accepted after.
  ASSIGN_OR_RETURN(const DiskSpace fs, r->Space());
  if (bytes > fs.total_bytes / 2) {
    return absl::InvalidArgumentError(absl::StrCat("a reserve of ", bytes, " bytes is more than half of the ",
                                                   fs.total_bytes, "-byte file system of '", r->path_, "'"));
  }
  // Never tried where it cannot fit (an allocation that fails may fill the
  // disk on its way, and a file system without fallocate writes zeros):
  // the room free, and what an earlier run's reserve holds already.
  struct stat st {};
  const int64_t had = ::stat(r->path_.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_blocks) * 512 : 0;
  const absl::Status s = fs.free_bytes <= bytes - had
                             ? absl::ResourceExhaustedError(absl::StrCat(fs.free_bytes, " bytes are free"))
                             : r->Allocate();
  if (!s.ok()) {
    COLOD_LOG(WARNING) << "no " << bytes << "-byte reserve for the data dir's records (" << s.message()
                       << "): no new job or upload is accepted until the file system has room for it twice over";
    std::error_code ec;
    std::filesystem::remove(r->path_, ec);
    return r;
  }
  absl::MutexLock lock(&r->mu_);
  r->held_ = true;
  return r;
}

absl::Status DiskReserve::Admits() const {
  if (held()) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the coordinator's --data-dir is full: the room it keeps for the running jobs' records (", bytes_ >> 20,
      " MiB, --data-dir-reserve) is not free, so it takes no new job or upload until there is room again"));
}

absl::Status DiskReserve::LeavesRoomAfter(int64_t bytes) const {
  RETURN_IF_ERROR(Admits());
  const absl::StatusOr<DiskSpace> fs = Space();
  if (!fs.ok() || fs->free_bytes - std::max<int64_t>(bytes, 0) >= bytes_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the coordinator's --data-dir has ", fs->free_bytes >> 20, " MiB free: an upload leaves at least ", bytes_ >> 20,
      " MiB (--data-dir-reserve) beside the reserve for the running jobs' records; free room there (coloctl "
      "uploads are removed an hour after their last use) or retry later"));
}

absl::StatusOr<DiskSpace> DiskReserve::Space() const {
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  return FreeDiskSpace(dir.empty() ? "." : dir);
}

absl::Status DiskReserve::Allocate() {
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return FileError("cannot create", path_, errno);
  // posix_fallocate returns the error (it does not set errno); it writes
  // zeros where the file system cannot allocate.
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
  // An earlier run's larger reserve gives back the rest.
  if (err == 0 && ::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) err = errno;
  const int synced = err == 0 ? ::fsync(fd) : 0;
  const int sync_err = errno;
  ::close(fd);
  if (err != 0) return FileError("cannot allocate", path_, err);
  if (synced != 0) return FileError("cannot sync", path_, sync_err);
  return absl::OkStatus();
}

bool DiskReserve::Release() {
  {
    absl::MutexLock lock(&mu_);
    if (!held_) return false;
    held_ = false;
  }
  std::error_code ec;
  const bool removed = std::filesystem::remove(path_, ec);
  if (ec || !removed) {
    COLOD_LOG(ERROR) << "cannot remove the data dir's reserve " << path_ << ": "
                     << (ec ? ec.message() : "it is gone");
    return false;
  }
  return true;
}

bool DiskReserve::Refill() {
  {
    absl::MutexLock lock(&mu_);
    if (held_ || refilling_) return held_;
    refilling_ = true;
  }
  absl::StatusOr<DiskSpace> room = Space();
  bool taken = false;
  if (room.ok() && room->free_bytes / 2 >= bytes_) {
    const absl::Status s = Allocate();
    taken = s.ok();
    if (!taken) {
      std::error_code ec;
      std::filesystem::remove(path_, ec);  // none half-made
    }
  }
  absl::MutexLock lock(&mu_);
  refilling_ = false;
  held_ = taken;
  return held_;
}

bool DiskReserve::held() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

}  // namespace colod
