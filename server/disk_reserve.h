// Room the coordinator keeps on its data dir for its own records: a file of
// `bytes` (DATA_DIR/disk-reserve, allocated up front) that is removed the
// moment a job record cannot be written for want of room, so that the
// write, tried again, succeeds. A full disk then loses nothing a watcher has
// seen, even across a crash, until the reserve is spent too; meanwhile the
// coordinator accepts no new job (JobManager::RoomHooks), and the sweep
// takes the reserve back once the file system has room for it twice over.
#ifndef COLOD_SERVER_DISK_RESERVE_H_
#define COLOD_SERVER_DISK_RESERVE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"

namespace colod {

// Thread-safe. File operations run outside the lock: Release (a record
// write's thread) and Refill (the sweep's) may meet, and then Release frees
// nothing (returns false) while a refill is under way.
class DiskReserve {
 public:
  // The reserve `path` of `bytes` (> 0), taken now where the file system
  // has room for it (a file already there, from an earlier run, is kept and
  // cut or grown to `bytes`); else released, with a warning, until Refill
  // finds room. INVALID_ARGUMENT for bytes <= 0 or more than half the file
  // system (Refill could never take it back).
  static absl::StatusOr<std::unique_ptr<DiskReserve>> Create(std::string path, int64_t bytes);

  // Removes the reserve's file: true where it was held (room was made).
  bool Release();
  // Takes the reserve again where it was released and the file system has
  // room for twice its size: true where it is held after the call.
  bool Refill();
  bool held() const;
  // OK while held; else RESOURCE_EXHAUSTED saying that the coordinator
  // takes no new job or upload until there is room again.
  absl::Status Admits() const;
  // Whether a bulk write of `bytes` (an upload's chunk) leaves the file
  // system room for the job records: held, and as much free again as the
  // reserve after the write (Admits, then RESOURCE_EXHAUSTED naming the room
  // otherwise; OK where the file system cannot be examined: a write then
  // shows).
  // Uploads never bring the disk to the reserve: a record write gives it
  // up only when the records themselves filled it.
  absl::Status LeavesRoomAfter(int64_t bytes) const;
  int64_t bytes() const { return bytes_; }
  const std::string& path() const { return path_; }

 private:
  DiskReserve(std::string path, int64_t bytes) : path_(std::move(path)), bytes_(bytes) {}
  // Allocates the file (fallocate; the whole of it or nothing).
  absl::Status Allocate();
  // The file system of path_'s directory: its room and its size.
  absl::StatusOr<DiskSpace> Space() const;

  const std::string path_;
  const int64_t bytes_;
  mutable absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  bool refilling_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace colod

#endif  // COLOD_SERVER_DISK_RESERVE_H_
