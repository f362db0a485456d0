#include "server/upload_store.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "common/clock.h"
#include "tests/testing/full_disk.h"

namespace colod {
namespace {

// What each file counts against the quota besides its bytes.
constexpr int64_t kFile = UploadStore::Writer::kFileBytes;

v1::ModelChunk Chunk(const std::string& file, int64_t offset, const std::string& data) {
  v1::ModelChunk c;
  c.set_file(file);
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

std::unique_ptr<UploadStore::Writer> Begin(UploadStore& store) {
  auto w = store.Begin();
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(UploadStore, WritesFilesFromOrderedChunksAndPublishesWhole) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads";
  auto store = UploadStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto w = Begin(**store);
  ASSERT_TRUE(w->Add(Chunk("config.json", 0, "{}")).ok());
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, "abc")).ok());
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 3, "def")).ok());
  auto done = w->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  const std::string first = done->upload_id();
  EXPECT_TRUE(std::regex_match(first, std::regex("upload-000001-[0-9a-f]{16}"))) << first;
  EXPECT_EQ(done->bytes(), 8);
  EXPECT_TRUE((*store)->Exists(first));
  EXPECT_EQ(Read(dir + "/" + first + "/model.safetensors"), "abcdef");

  // Out of order, a path, a file again: refused; the broken upload leaves nothing.
  auto bad = Begin(**store);
  ASSERT_TRUE(bad->Add(Chunk("a.safetensors", 0, "x")).ok());
  EXPECT_EQ(bad->Add(Chunk("a.safetensors", 5, "y")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->Add(Chunk("../evil", 0, "y")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->Add(Chunk("sub/dir", 0, "y")).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(bad->Add(Chunk("b.safetensors", 0, "y")).ok());
  EXPECT_EQ(bad->Add(Chunk("a.safetensors", 0, "z")).code(), absl::StatusCode::kInvalidArgument);
  bad.reset();
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == first || name == first + ".sha256") << name;
  }
  EXPECT_EQ(Begin(**store)->Finish().status().code(), absl::StatusCode::kInvalidArgument);  // no files

  // Reopened, it knows its uploads and numbers on after them.
  auto again = UploadStore::Open(dir);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->Exists(first));
  EXPECT_FALSE((*again)->Exists("upload-000001"));
  EXPECT_EQ((*again)->Path("../etc").status().code(), absl::StatusCode::kNotFound);
  auto next = Begin(**again);
  ASSERT_TRUE(next->Add(Chunk("model.safetensors", 0, "q")).ok());
  const std::string second = next->Finish()->upload_id();
  EXPECT_TRUE(absl::StartsWith(second, "upload-000002-")) << second;  // failed uploads left no id behind
}

// A worker keeps a download by its upload's id: an id must never name two
// contents. A collected upload's counter comes again after a restart, and
// a coordinator with a new data directory counts from 1; the ids differ
// all the same. Ids made before the random part are still read.
TEST(UploadStore, NoIdNamesTwoContentsAfterACollectionRestartOrNewDataDirectory) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-never-reused";
  FakeClock clock;
  std::set<std::string> ids;
  for (int restart = 0; restart < 3; ++restart) {
    auto store = UploadStore::Open(dir, UploadLimits(), &clock);
    ASSERT_TRUE(store.ok()) << store.status();
    auto w = Begin(**store);
    ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, absl::StrCat("weights of run ", restart))).ok());
    auto done = w->Finish();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(absl::StartsWith(done->upload_id(), "upload-000001-")) << done->upload_id();
    EXPECT_TRUE(ids.insert(done->upload_id()).second) << done->upload_id();
    clock.Advance(absl::Hours(2));
    EXPECT_EQ((*store)->CollectGarbage({}, absl::Hours(1)), std::vector<std::string>{done->upload_id()});
  }
  std::filesystem::remove_all(dir);
  auto fresh = UploadStore::Open(dir, UploadLimits(), &clock);
  ASSERT_TRUE(fresh.ok());
  auto w = Begin(**fresh);
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, "a new data directory's")).ok());
  EXPECT_TRUE(ids.insert(w->Finish()->upload_id()).second);

  // An upload stored under an id of the earlier form is found, and counted;
  // directories whose names are no id (larger numbers) are neither.
  std::filesystem::create_directories(dir + "/upload-000041");
  std::ofstream(dir + "/upload-000041/model.safetensors") << "old";
  const std::vector<std::string> bad = {"upload-000091-", "upload-000092-0123456789ABCDEF",
                                        "upload-000093-0123456789abcde", "upload-000094-0123456789abcdef0",
                                        "upload-0-0123456789abcdef",     "upload-000095x", "upload--96"};
  for (const std::string& name : bad) {
    std::filesystem::create_directories(dir + "/" + name);
    std::ofstream(dir + "/" + name + "/model.safetensors") << "not an upload";
  }
  auto reopened = UploadStore::Open(dir, UploadLimits(), &clock);
  ASSERT_TRUE(reopened.ok());
  EXPECT_TRUE((*reopened)->Exists("upload-000041"));
  for (const std::string& name : bad) EXPECT_FALSE((*reopened)->Exists(name)) << name;
  auto after = Begin(**reopened);
  ASSERT_TRUE(after->Add(Chunk("model.safetensors", 0, "newer")).ok());
  EXPECT_TRUE(absl::StartsWith(after->Finish()->upload_id(), "upload-000042-"));
}

// A disk that fills during an upload: the chunk that does not fit is
// RESOURCE_EXHAUSTED naming the file, the abandoned upload leaves no files
// and gives back its reserved bytes, and the store goes on.
TEST(UploadStore, AFullDiskFailsTheUploadAndLeavesNothing) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-full";
  std::filesystem::remove_all(dir);
  auto store = UploadStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto w = Begin(**store);
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, std::string(100, 'a'))).ok());
  absl::Status full;
  {
    testing::FullDisk disk(128);
    full = w->Add(Chunk("model.safetensors", 100, std::string(100, 'b')));
  }
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("model.safetensors"), std::string::npos) << full;
  w.reset();
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the failed upload left files";
  EXPECT_EQ((*store)->bytes(), 0);  // the reservation given back
  auto again = Begin(**store);
  ASSERT_TRUE(again->Add(Chunk("model.safetensors", 0, "fits")).ok());
  auto done = again->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(Read(dir + "/" + done->upload_id() + "/model.safetensors"), "fits");
}

// While the coordinator's data dir is full (its admit says so), no upload
// starts and one in progress fails at its next chunk, leaving nothing; once
// it admits again, uploads go on.
TEST(UploadStore, NoUploadTakesTheRoomKeptForTheJobRecords) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-admit";
  std::filesystem::remove_all(dir);
  auto store = UploadStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  bool full = false;
  std::vector<int64_t> asked;  // the bytes each admit was asked about
  (*store)->SetAdmit([&](int64_t bytes) -> absl::Status {
    asked.push_back(bytes);
    return full ? absl::ResourceExhaustedError("the data dir is full") : absl::OkStatus();
  });
  auto w = Begin(**store);
  ASSERT_TRUE(w->Add(Chunk("model.safetensors", 0, "abc")).ok());
  EXPECT_EQ(asked, (std::vector<int64_t>{0, 3})) << "the upload, then its chunk's bytes";
  full = true;
  const absl::Status refused = w->Add(Chunk("model.safetensors", 3, "def"));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(refused.message(), "the data dir is full");
  w.reset();
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the abandoned upload left files";
  EXPECT_EQ((*store)->Begin().status().code(), absl::StatusCode::kResourceExhausted);
  full = false;
  auto again = Begin(**store);
  ASSERT_TRUE(again->Add(Chunk("model.safetensors", 0, "fits")).ok());
  EXPECT_TRUE(again->Finish().ok());
}

// The probe: 81 submits of one model stored 81 copies. The same
// files are stored once (SHA-256 over names, sizes and bytes), across a
// reopen too; different files or names are not the same upload.
TEST(UploadStore, IdenticalUploadsAreStoredOnce) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-dedupe";
  std::filesystem::remove_all(dir);
  auto upload = [](UploadStore& store, const std::string& name, const std::string& data) {
    auto w = Begin(store);
    EXPECT_TRUE(w->Add(Chunk("config.json", 0, "{}")).ok());
    EXPECT_TRUE(w->Add(Chunk(name, 0, data.substr(0, 2))).ok());
    EXPECT_TRUE(w->Add(Chunk(name, 2, data.substr(2))).ok());
    auto done = w->Finish();
    EXPECT_TRUE(done.ok()) << done.status();
    return *done;
  };
  {
    auto store = UploadStore::Open(dir);
    ASSERT_TRUE(store.ok());
    const v1::UploadModelResponse first = upload(**store, "model.safetensors", "weights");
    EXPECT_FALSE(first.deduplicated());
    EXPECT_EQ(first.sha256().size(), 64u);
    for (int i = 0; i < 5; ++i) {
      const v1::UploadModelResponse again = upload(**store, "model.safetensors", "weights");
      EXPECT_TRUE(again.deduplicated());
      EXPECT_EQ(again.upload_id(), first.upload_id());
      EXPECT_EQ(again.sha256(), first.sha256());
    }
    EXPECT_EQ((*store)->bytes(), 9 + 2 * kFile);  // one copy (of two files)
    const v1::UploadModelResponse other = upload(**store, "model.safetensors", "weightz");
    EXPECT_FALSE(other.deduplicated());
    // Different files are known to differ; an upload not stored is not.
    EXPECT_TRUE((*store)->Differ(first.upload_id(), other.upload_id()));
    EXPECT_FALSE((*store)->Differ(first.upload_id(), first.upload_id()));
    EXPECT_FALSE((*store)->Differ(first.upload_id(), "upload-000099-00000000000000aa"));
    EXPECT_FALSE(upload(**store, "other.safetensors", "weights").deduplicated());
    int dirs = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) dirs += e.is_directory();
    EXPECT_EQ(dirs, 3);
  }
  auto reopened = UploadStore::Open(dir);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->bytes(), 27 + 6 * kFile);
  EXPECT_TRUE(absl::StartsWith(upload(**reopened, "model.safetensors", "weights").upload_id(), "upload-000001-"));
}

TEST(UploadStore, QuotasRefuseAndReleaseBytesAndCount) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-quota";
  std::filesystem::remove_all(dir);
  UploadLimits limits;
  limits.quota_bytes = 10 + 2 * kFile;
  limits.max_uploads = 2;
  auto store = UploadStore::Open(dir, limits);
  ASSERT_TRUE(store.ok());
  auto a = Begin(**store);
  ASSERT_TRUE(a->Add(Chunk("m.safetensors", 0, "12345678")).ok());
  auto b = Begin(**store);
  const absl::Status over = b->Add(Chunk("m.safetensors", 0, "abcde"));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("--upload-quota"), std::string::npos) << over;
  EXPECT_EQ((*store)->Begin().status().code(), absl::StatusCode::kResourceExhausted);  // 2 in progress
  b.reset();  // abandoned: its count and bytes come back
  ASSERT_TRUE(a->Finish().ok());
  EXPECT_EQ((*store)->bytes(), 8 + kFile);
  auto c = Begin(**store);
  EXPECT_TRUE(c->Add(Chunk("n.safetensors", 0, "xy")).ok());
  EXPECT_EQ(c->Add(Chunk("n.safetensors", 2, "z")).code(), absl::StatusCode::kResourceExhausted);
}

// Empty files are not free: each counts kFileBytes against the quota, and
// an upload holds at most kMaxFiles (a million empty files would otherwise
// take the coordinator's inodes for nothing).
TEST(UploadStore, FilesAreBoundedAndCountedEvenWhenEmpty) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-files";
  std::filesystem::remove_all(dir);
  UploadLimits limits;
  limits.quota_bytes = 100 * kFile;
  auto store = UploadStore::Open(dir, limits);
  ASSERT_TRUE(store.ok());
  auto w = Begin(**store);
  absl::Status st;
  int files = 0;
  while (files < 1000 && (st = w->Add(Chunk("e" + std::to_string(files) + ".safetensors", 0, ""))).ok()) ++files;
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(files, 100);
  w.reset();
  EXPECT_EQ((*store)->bytes(), 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir));

  auto roomy = UploadStore::Open(dir + "-roomy");
  ASSERT_TRUE(roomy.ok());
  auto many = Begin(**roomy);
  for (int i = 0; i < UploadStore::Writer::kMaxFiles; ++i) {
    ASSERT_TRUE(many->Add(Chunk("f" + std::to_string(i), 0, i == 0 ? "x" : "")).ok()) << i;
  }
  st = many->Add(Chunk("one-more", 0, ""));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("at most 4096"), std::string::npos) << st;
  auto done = many->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->files_size(), UploadStore::Writer::kMaxFiles);
  EXPECT_EQ(done->bytes(), 1);
  EXPECT_EQ((*roomy)->bytes(), 1 + UploadStore::Writer::kMaxFiles * kFile);
  // Reopened, it counts them the same.
  many.reset();
  auto reopened = UploadStore::Open(dir + "-roomy");
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->bytes(), 1 + UploadStore::Writer::kMaxFiles * kFile);
}

// Uploads in progress at once are bounded apart from the stored count:
// each is a stream holding a server thread. An ended one (finished or
// abandoned) frees its place.
TEST(UploadStore, UploadsInProgressAtOnceAreBounded) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-concurrent";
  std::filesystem::remove_all(dir);
  UploadLimits limits;
  limits.max_concurrent_uploads = 2;
  auto store = UploadStore::Open(dir, limits);
  ASSERT_TRUE(store.ok());
  auto a = Begin(**store);
  auto b = Begin(**store);
  const absl::StatusOr<std::unique_ptr<UploadStore::Writer>> third = (*store)->Begin();
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max-concurrent-uploads"), std::string::npos) << third.status();
  b.reset();  // abandoned
  auto c = Begin(**store);
  ASSERT_TRUE(a->Add(Chunk("m.safetensors", 0, "1234")).ok());
  ASSERT_TRUE(a->Finish().ok());
  a.reset();
  auto d = Begin(**store);  // a finished: its place is free, its upload stored
  EXPECT_EQ((*store)->Begin().status().code(), absl::StatusCode::kResourceExhausted);  // c and d
  EXPECT_EQ((*store)->bytes(), 4 + kFile);
}

TEST(UploadStore, UploadsNoJobNamesAreCollectedAfterTheirGrace) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-gc";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  auto store = UploadStore::Open(dir, UploadLimits(), &clock);
  ASSERT_TRUE(store.ok());
  std::vector<std::string> ids;
  for (const char* data : {"aaa", "bbb", "ccc"}) {
    auto w = Begin(**store);
    ASSERT_TRUE(w->Add(Chunk("m.safetensors", 0, data)).ok());
    ids.push_back(w->Finish()->upload_id());
  }
  clock.Advance(absl::Minutes(30));
  EXPECT_TRUE((*store)->CollectGarbage({}, absl::Hours(1)).empty());  // within the grace
  clock.Advance(absl::Minutes(45));
  // ids[0] is named by a job: kept, and its grace starts again.
  EXPECT_EQ((*store)->CollectGarbage({ids[0]}, absl::Hours(1)), (std::vector<std::string>{ids[1], ids[2]}));
  EXPECT_FALSE((*store)->Exists(ids[1]));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[1]));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[1] + ".sha256"));
  EXPECT_EQ((*store)->bytes(), 3 + kFile);
  clock.Advance(absl::Minutes(59));
  EXPECT_TRUE((*store)->CollectGarbage({}, absl::Hours(1)).empty());
  clock.Advance(absl::Minutes(2));
  // ids[2] was collected; a submit that asks for it is told so.
  EXPECT_FALSE((*store)->Exists(ids[2]));
  EXPECT_EQ((*store)->CollectGarbage({}, absl::Hours(1)), std::vector<std::string>{ids[0]});
  EXPECT_EQ((*store)->bytes(), 0);
  // An upload a submit found (Exists) is used then: a collection whose
  // `in_use` was taken before that job was recorded keeps it.
  auto fresh = Begin(**store);
  ASSERT_TRUE(fresh->Add(Chunk("m.safetensors", 0, "ddd")).ok());
  const std::string kept = fresh->Finish()->upload_id();
  clock.Advance(absl::Minutes(61));
  EXPECT_TRUE((*store)->Exists(kept));
  EXPECT_TRUE((*store)->CollectGarbage({}, absl::Hours(1)).empty());
  clock.Advance(absl::Minutes(61));
  EXPECT_EQ((*store)->CollectGarbage({}, absl::Hours(1)), std::vector<std::string>{kept});
  // Collected content uploads anew.
  auto w = Begin(**store);
  ASSERT_TRUE(w->Add(Chunk("m.safetensors", 0, "bbb")).ok());
  auto again = w->Finish();
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->deduplicated());
}

// A collection cut short (the coordinator killed while it removes an
// expired upload's files) leaves nothing the next start loads as an
// upload: the hash goes first, and the directory is renamed out of the
// uploads' names before its files go (a .tmp, which Open removes). A hash
// whose directory is gone is removed at start too: a new upload of the
// same files is stored, not deduplicated onto a half-removed one.
TEST(UploadStore, ACollectionCutShortLeavesNoUploadToLoad) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-gc-crash";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::string id, sha;
  {
    auto store = UploadStore::Open(dir, UploadLimits(), &clock);
    ASSERT_TRUE(store.ok());
    auto w = Begin(**store);
    ASSERT_TRUE(w->Add(Chunk("a.safetensors", 0, "aaa")).ok());
    ASSERT_TRUE(w->Add(Chunk("b.safetensors", 0, "bbb")).ok());
    auto done = w->Finish();
    ASSERT_TRUE(done.ok()) << done.status();
    id = done->upload_id();
    sha = done->sha256();
  }
  // What a removal cut short leaves: the directory renamed aside, one file
  // of it gone; its hash still there (as the order of before 2026-12-07
  // could leave it); and another upload's half-removed directory.
  std::filesystem::rename(dir + "/" + id, dir + "/" + id + ".removed.tmp");
  std::filesystem::remove(dir + "/" + id + ".removed.tmp/a.safetensors");
  const std::string aside = dir + "/upload-000009-00000000000000ab";
  std::filesystem::create_directories(aside + ".removed.tmp");
  std::ofstream(aside + ".removed.tmp/b.safetensors") << "bbb";
  auto reopened = UploadStore::Open(dir, UploadLimits(), &clock);
  ASSERT_TRUE(reopened.ok());
  EXPECT_FALSE((*reopened)->Exists(id));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + id + ".removed.tmp"));
  EXPECT_FALSE(std::filesystem::exists(aside + ".removed.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + id + ".sha256")) << "a hash without its upload";
  EXPECT_EQ((*reopened)->bytes(), 0);
  auto w = Begin(**reopened);
  ASSERT_TRUE(w->Add(Chunk("a.safetensors", 0, "aaa")).ok());
  ASSERT_TRUE(w->Add(Chunk("b.safetensors", 0, "bbb")).ok());
  auto again = w->Finish();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sha256(), sha);
  EXPECT_FALSE(again->deduplicated()) << "stored anew, whole";
  EXPECT_EQ(Read(dir + "/" + again->upload_id() + "/a.safetensors"), "aaa");
  // A collection leaves neither the directory nor the hash, nor anything
  // beside them.
  clock.Advance(absl::Hours(2));
  EXPECT_EQ((*reopened)->CollectGarbage({}, absl::Hours(1)), std::vector<std::string>{again->upload_id()});
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

// Downloads in progress at once are bounded (each is a stream holding a
// server thread), and an upload being downloaded is never collected: its
// grace starts again when the download ends.
TEST(UploadStore, DownloadsInProgressAreBoundedAndKeepTheirUpload) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/uploads-readers";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  UploadLimits limits;
  limits.max_concurrent_downloads = 2;
  auto store = UploadStore::Open(dir, limits, &clock);
  ASSERT_TRUE(store.ok());
  auto w = Begin(**store);
  ASSERT_TRUE(w->Add(Chunk("m.safetensors", 0, "abc")).ok());
  const std::string id = w->Finish()->upload_id();
  w.reset();

  auto a = (*store)->BeginReading(id);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->path(), dir + "/" + id);
  EXPECT_EQ(Read((*a)->path() + "/m.safetensors"), "abc");
  auto b = (*store)->BeginReading(id);
  ASSERT_TRUE(b.ok()) << b.status();
  const absl::StatusOr<std::unique_ptr<UploadStore::Reading>> third = (*store)->BeginReading(id);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max-concurrent-downloads"), std::string::npos) << third.status();
  for (const char* bad : {"upload-999999", "../uploads", ""}) {
    EXPECT_EQ((*store)->BeginReading(bad).status().code(), absl::StatusCode::kNotFound) << bad;
  }

  // Long past its grace and named by no job, it stays while read.
  clock.Advance(absl::Hours(3));
  EXPECT_TRUE((*store)->CollectGarbage({}, absl::Hours(1)).empty());
  a->reset();
  auto c = (*store)->BeginReading(id);  // a's place is free
  ASSERT_TRUE(c.ok()) << c.status();
  b->reset();
  c->reset();
  clock.Advance(absl::Minutes(59));
  EXPECT_TRUE((*store)->CollectGarbage({}, absl::Hours(1)).empty()) << "the grace did not start at the end";
  clock.Advance(absl::Minutes(2));
  EXPECT_EQ((*store)->CollectGarbage({}, absl::Hours(1)), std::vector<std::string>{id});
  EXPECT_EQ((*store)->BeginReading(id).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace colod
