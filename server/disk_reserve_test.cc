// The coordinator's reserve of room on its data dir: a file of its size,
// allocated (not sparse), removed by Release, taken back by Refill where
// the file system has room, and never half made.
#include "server/disk_reserve.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/atomic_file.h"
#include "gtest/gtest.h"
#include "tests/testing/full_disk.h"

namespace colod {
namespace {

std::string Path(const std::string& name) { return std::string(std::getenv("TEST_TMPDIR")) + "/" + name; }

// The bytes the file system allocated for `path` (st_blocks is in 512-byte units).
int64_t Allocated(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.st_blocks) * 512;
}

TEST(DiskReserve, HoldsAnAllocatedFileThatReleaseRemovesAndRefillTakesBack) {
  const std::string path = Path("reserve");
  constexpr int64_t kBytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<DiskReserve>> r = DiskReserve::Create(path, kBytes);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)->held());
  EXPECT_EQ(std::filesystem::file_size(path), static_cast<uintmax_t>(kBytes));
  EXPECT_GE(Allocated(path), kBytes) << "sparse: it would free nothing";
  EXPECT_TRUE((*r)->Release());
  EXPECT_FALSE((*r)->held());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE((*r)->Release()) << "nothing left to free";
  EXPECT_TRUE((*r)->Refill());
  EXPECT_TRUE((*r)->held());
  EXPECT_GE(Allocated(path), kBytes);
  EXPECT_TRUE((*r)->Refill()) << "held: nothing to do";
  // An earlier run's larger reserve is cut to the size asked for.
  r->reset();
  absl::StatusOr<std::unique_ptr<DiskReserve>> smaller = DiskReserve::Create(path, kBytes / 4);
  ASSERT_TRUE(smaller.ok()) << smaller.status();
  EXPECT_TRUE((*smaller)->held());
  EXPECT_EQ(std::filesystem::file_size(path), static_cast<uintmax_t>(kBytes / 4));
  EXPECT_EQ(DiskReserve::Create(path, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// An upload's chunk is admitted while the reserve is held and the file
// system keeps as much room again as the reserve after it: a chunk that
// would leave less is refused, naming the room, so that uploads never bring
// the disk to the reserve that the job records need.
TEST(DiskReserve, ABulkWriteLeavesAsMuchRoomAgainAsTheReserve) {
  const std::string path = Path("bulk-reserve");
  constexpr int64_t kBytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<DiskReserve>> r = DiskReserve::Create(path, kBytes);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)->Admits().ok());
  EXPECT_TRUE((*r)->LeavesRoomAfter(0).ok());
  EXPECT_TRUE((*r)->LeavesRoomAfter(4 << 20).ok());
  absl::StatusOr<DiskSpace> room = FreeDiskSpace(std::getenv("TEST_TMPDIR"));
  ASSERT_TRUE(room.ok()) << room.status();
  // (Others may write meanwhile: a chunk of all the room, less half the
  // reserve, leaves less than the reserve whatever they do.)
  const absl::Status refused = (*r)->LeavesRoomAfter(room->free_bytes - kBytes / 2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("MiB free: an upload leaves at least 1 MiB"), std::string::npos) << refused;
  ASSERT_TRUE((*r)->Release());
  EXPECT_EQ((*r)->Admits().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*r)->LeavesRoomAfter(0).code(), absl::StatusCode::kResourceExhausted) << "not held";
}

// More than half the file system can never be taken back: refused. One
// the disk has no room for (a full disk, made with RLIMIT_FSIZE): not held
// and no file left (a start goes on without it), not taken back while
// there is no room, and taken back once there is.
TEST(DiskReserve, MoreThanTheDiskCanHoldIsRefusedAndOneWithoutRoomIsNotHeld) {
  const std::string path = Path("full-disk-reserve");
  absl::StatusOr<DiskSpace> room = FreeDiskSpace(std::getenv("TEST_TMPDIR"));
  ASSERT_TRUE(room.ok()) << room.status();
  EXPECT_EQ(DiskReserve::Create(path, room->total_bytes / 2 + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path));
  std::unique_ptr<DiskReserve> r;
  {
    testing::FullDisk full(4096);
    absl::StatusOr<std::unique_ptr<DiskReserve>> made = DiskReserve::Create(path, 1 << 20);
    ASSERT_TRUE(made.ok()) << made.status();
    r = *std::move(made);
    EXPECT_FALSE(r->held());
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_FALSE(r->Refill());
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_FALSE(r->Release());
  }
  EXPECT_TRUE(r->Refill());
  EXPECT_GE(Allocated(path), 1 << 20);
}

}  // namespace
}  // namespace colod
