// The coordinator's reserve of room on its data dir: a file of its size,
// allocated (not sparse), removed by Release, taken back by Refill where
// the file system has room, and never half made.
#include "server/disk_reserve.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "common/atomic_file.h"
#include "gtest/gtest.h"

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

// More than the file system has: not held and no file left (a start goes
// on without it), and Refill does not take it while there is no room.
TEST(DiskReserve, MoreThanTheDiskHasIsNotHeldAndLeavesNoFile) {
  const std::string path = Path("too-big-reserve");
  absl::StatusOr<DiskSpace> room = FreeDiskSpace(std::getenv("TEST_TMPDIR"));
  ASSERT_TRUE(room.ok()) << room.status();
  ASSERT_LT(room->free_bytes, std::numeric_limits<int64_t>::max() / 4);
  absl::StatusOr<std::unique_ptr<DiskReserve>> r = DiskReserve::Create(path, room->free_bytes * 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE((*r)->held());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE((*r)->Refill());
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE((*r)->Release());
}

}  // namespace
}  // namespace colod
