#include "common/atomic_file.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// A fresh directory under the test's temporary directory.
std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, ".", ::getpid());
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir;
  return dir;
}

TEST(ListDirectory, NamesEveryEntryButDotAndDotDot) {
  const std::string dir = FreshDir("list");
  ASSERT_TRUE(WriteFileAtomically(dir + "/a.json", "{}").ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/.hidden", "x").ok());
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("/nonexistent", (dir + "/dangling").c_str()), 0);
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  ASSERT_TRUE(names.ok()) << names.status();
  std::sort(names->begin(), names->end());
  EXPECT_EQ(*names, (std::vector<std::string>{".hidden", "a.json", "dangling", "sub"}));

  const std::string empty = FreshDir("empty");
  names = ListDirectory(empty);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->empty());
}

TEST(ListDirectory, IsNotFoundNamingWhatCannotBeListed) {
  const std::string dir = FreshDir("unlistable");
  ASSERT_TRUE(WriteFileAtomically(dir + "/file", "x").ok());
  for (const std::string& path : {dir + "/missing", dir + "/file"}) {
    const absl::StatusOr<std::vector<std::string>> names = ListDirectory(path);
    EXPECT_EQ(names.status().code(), absl::StatusCode::kNotFound) << path;
    EXPECT_NE(names.status().message().find(path), absl::string_view::npos) << names.status();
  }
}

TEST(ReadFileToString, ReadsWholeFilesLargerThanItsBuffer) {
  const std::string dir = FreshDir("read");
  std::string big(3 * 65536 + 17, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 % 251);
  ASSERT_TRUE(WriteFileAtomically(dir + "/big", big).ok());
  const absl::StatusOr<std::string> read = ReadFileToString(dir + "/big");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, big);
  ASSERT_TRUE(WriteFileAtomically(dir + "/empty", "").ok());
  EXPECT_EQ(ReadFileToString(dir + "/empty").value_or("not read"), "");
}

TEST(ReadFileToString, RefusesWhatIsNotAFileRatherThanReadingItAsEmptyOrForever) {
  const std::string dir = FreshDir("notfile");
  const absl::StatusOr<std::string> missing = ReadFileToString(dir + "/missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  // A directory opens, but has no content: an error, not "".
  const absl::StatusOr<std::string> directory = ReadFileToString(dir);
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kFailedPrecondition) << directory.status();
  EXPECT_NE(directory.status().message().find(dir), absl::string_view::npos) << directory.status();
  // A device that never ends (a config.json linked to it would fill memory).
  const absl::StatusOr<std::string> zero = ReadFileToString("/dev/zero");
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kFailedPrecondition) << zero.status();
}

TEST(ReadFileToString, ReadsAPipeToItsEndAndAWriterlessFifoAsEmpty) {
  // A shell's <(...): a pipe whose writer has written and closed.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ASSERT_EQ(::write(fds[1], "from a pipe", 11), 11);
  ASSERT_EQ(::close(fds[1]), 0);
  const absl::StatusOr<std::string> piped = ReadFileToString(absl::StrCat("/proc/self/fd/", fds[0]));
  ::close(fds[0]);
  ASSERT_TRUE(piped.ok()) << piped.status();
  EXPECT_EQ(*piped, "from a pipe");
  // A named FIFO nobody writes to: read at once, not a reader blocked in open.
  const std::string fifo = FreshDir("fifo") + "/f";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const absl::StatusOr<std::string> none = ReadFileToString(fifo);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, "");
}

// The rename would put a file where a link, a FIFO or a directory was:
// refused before a byte is written, and what was there stays.
TEST(WriteFileAtomically, ReplacesOnlyARegularFile) {
  const std::string dir = FreshDir("replaces");
  ASSERT_TRUE(WriteFileAtomically(dir + "/target", "kept").ok());
  ASSERT_EQ(::symlink((dir + "/target").c_str(), (dir + "/link").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  for (const char* name : {"link", "fifo", "sub"}) {
    const std::string path = absl::StrCat(dir, "/", name);
    const absl::Status s = WriteFileAtomically(path, "new");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << name << ": " << s;
    EXPECT_NE(s.message().find("not a file that a new one may replace"), absl::string_view::npos) << s;
  }
  struct stat st;
  ASSERT_EQ(::lstat((dir + "/link").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  EXPECT_EQ(ReadFileToString(dir + "/target").value_or("?"), "kept");
  ASSERT_EQ(::lstat((dir + "/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST(IsAtomicWriteLeftover, NamesWhatWriteFileAtomicallyLeavesOnly) {
  const std::string dir = FreshDir("leftover");
  // What a write cut short leaves: the temporary name, there after a crash.
  for (const char* name : {"job-000001.pb.tmp.4242.0", "next-id.tmp.1.17", "upload-000003.sha256.tmp.99.2"}) {
    EXPECT_TRUE(IsAtomicWriteLeftover(name)) << name;
  }
  for (const char* name : {"job-000001.pb", "upload-000003.tmp", "a.tmp.", "a.tmp.12", "a.tmp.12.", "a.tmp.x.1",
                           ".tmp.1.2", "a.tmp.1.2x"}) {
    EXPECT_FALSE(IsAtomicWriteLeftover(name)) << name;
  }
}

TEST(RegularFileReader, ReadsRangesAndIsDataLossWhereTheFileWasCutShort) {
  const std::string path = FreshDir("reader") + "/f";
  std::string bytes(100000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + i / 256);
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  absl::StatusOr<RegularFileReader> f = RegularFileReader::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->size(), 100000);
  EXPECT_EQ(f->path(), path);
  std::string got(30000, '\0');
  ASSERT_TRUE(f->ReadAt(70000, got.data(), got.size()).ok());
  EXPECT_EQ(got, bytes.substr(70000));
  ASSERT_TRUE(f->ReadAt(5, got.data(), 0).ok());
  // Moved, it still reads; the moved-from one is closed without a word.
  RegularFileReader moved = *std::move(f);
  ASSERT_EQ(::truncate(path.c_str(), 50000), 0);
  const absl::Status cut = moved.ReadAt(40000, got.data(), 20000);
  EXPECT_EQ(cut.code(), absl::StatusCode::kDataLoss) << cut;
  EXPECT_NE(cut.message().find(absl::StrCat(path, " ends at byte 50000")), absl::string_view::npos) << cut;
  EXPECT_EQ(moved.ReadAt(-1, got.data(), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(moved.ReadAt(INT64_MAX, got.data(), 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RegularFileReader, RefusesWhatIsNotARegularFileWithoutBlocking) {
  const std::string dir = FreshDir("reader_refuses");
  EXPECT_EQ(RegularFileReader::Open(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const struct {
    std::string path;
    const char* says;
  } cases[] = {{dir, "is a directory, not a regular file"},
               {fifo, "is a FIFO, not a regular file"},
               {"/dev/zero", "is a character device, not a regular file"}};
  for (const auto& c : cases) {
    const absl::Status s = RegularFileReader::Open(c.path).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.path + " " + c.says), absl::string_view::npos) << s;
  }
}

TEST(RaiseOpenFileLimit, RaisesTheSoftLimitToTheHardOne) {
  struct rlimit r;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &r), 0);
  const rlim_t hard = r.rlim_max;
  r.rlim_cur = std::min<rlim_t>(hard, 256);  // lowering needs no privilege
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &r), 0);
  EXPECT_EQ(RaiseOpenFileLimit(), static_cast<uint64_t>(hard));
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &r), 0);
  EXPECT_EQ(r.rlim_cur, hard);
}

// A downloaded directory made durable before its rename: its files are
// synced, and what is not a file (a FIFO, a link to one, a subdirectory) is
// passed over, never opened to wait on. A directory not there is an error.
TEST(RemoveOldestFiles, KeepsTheNewestFilesAndTouchesNothingElse) {
  const std::string dir = FreshDir("oldest");
  for (int i = 0; i < 6; ++i) {
    const std::string path = absl::StrCat(dir, "/dump-", i);
    ASSERT_TRUE(WriteFileAtomically(path, "x").ok());
    const struct timespec times[2] = {{1000 + i, 0}, {1000 + i, 0}};  // dump-0 the oldest
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  }
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("dump-0", (dir + "/link").c_str()), 0);
  EXPECT_EQ(RemoveOldestFiles(dir, 10), 0u);
  EXPECT_EQ(RemoveOldestFiles(dir, 2), 4u);
  auto names = ListDirectory(dir);
  ASSERT_TRUE(names.ok()) << names.status();
  std::sort(names->begin(), names->end());
  EXPECT_EQ(*names, (std::vector<std::string>{"dump-4", "dump-5", "link", "sub"}));
  EXPECT_EQ(RemoveOldestFiles(dir + "/missing", 0), 0u);
}

// The room std::filesystem::space reports (its own statvfs), within what
// the tests running beside this one may write meanwhile; a directory that
// is not there is an error naming it.
TEST(FreeDiskSpace, IsTheRoomTheFileSystemReports) {
  const std::string dir = std::getenv("TEST_TMPDIR");
  absl::StatusOr<DiskSpace> got = FreeDiskSpace(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::filesystem::space_info want = std::filesystem::space(dir);
  EXPECT_GT(got->free_bytes, 0);
  EXPECT_NEAR(static_cast<double>(got->free_bytes), static_cast<double>(want.available), 256.0 * (1 << 20));
  EXPECT_NE(got->free_inodes, 0);
  EXPECT_EQ(got->total_bytes, static_cast<int64_t>(want.capacity));
  EXPECT_LE(got->free_bytes, got->total_bytes);
  absl::StatusOr<DiskSpace> missing = FreeDiskSpace(dir + "/no-such-dir");
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no-such-dir"), std::string::npos) << missing.status();
}

// The directories a lock made are the caller's to remove only where the
// lock is its own: a second daemon refused the lock is told it made none,
// even of a directory it found missing when it started.
TEST(LockDirectory, NamesWhatItMadeOnlyToTheHolderOfTheLock) {
  const std::string root = std::string(std::getenv("TEST_TMPDIR")) + "/lock-made";
  const std::string dir = root + "/a/b";
  std::string made = "stale";
  absl::StatusOr<int> first = LockDirectory(dir, "--data-dir", "coordinator", &made);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(made, root);
  std::string second_made = "stale";
  absl::StatusOr<int> second = LockDirectory(dir, "--data-dir", "coordinator", &second_made);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_TRUE(second_made.empty()) << second_made;
  ::close(*first);
  std::string again = "stale";
  absl::StatusOr<int> third = LockDirectory(dir, "--data-dir", "coordinator", &again);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(again.empty()) << "it was there: " << again;
  ::close(*third);
}

TEST(SyncFilesAndDirectory, SyncsTheFilesAndPassesOverTheRest) {
  const std::string dir = FreshDir("sync");
  ASSERT_TRUE(WriteFileAtomically(dir + "/model.safetensors", "weights").ok());
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::symlink((dir + "/fifo").c_str(), (dir + "/link").c_str()), 0);
  ASSERT_EQ(::mkdir((dir + "/sub").c_str(), 0755), 0);
  EXPECT_TRUE(SyncFilesAndDirectory(dir).ok());
  EXPECT_TRUE(SyncDirectory(dir).ok());
  const absl::Status missing = SyncFilesAndDirectory(dir + "/nowhere");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find("nowhere"), std::string::npos) << missing;
  const absl::Status not_dir = SyncDirectory(dir + "/model.safetensors");
  EXPECT_EQ(not_dir.code(), absl::StatusCode::kFailedPrecondition) << not_dir;
}

}  // namespace
}  // namespace colod
