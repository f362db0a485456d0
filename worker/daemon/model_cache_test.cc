// ModelCache against a real gRPC coordinator stand-in that serves
// DownloadModel: links for local weights, a download kept once, an abort
// that ends a download in progress, and a hostile file name.
#include "worker/daemon/model_cache.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/full_disk.h"
#include "tests/testing/temp_dir.h"

namespace colod {
namespace {

namespace fs = std::filesystem;

// Serves one upload: two files, or (endless) chunks until the call is
// cancelled, or a file name that climbs out of the directory.
class FakeDownloads final : public v1::CoordinatorService::Service {
 public:
  enum class Mode { kTwoFiles, kEndless, kBadName, kFileAgain, kChunkOutOfPlace };
  std::atomic<Mode> mode{Mode::kTwoFiles};
  std::atomic<int> calls{0};
  // The first this many calls are refused with `refusal`, as a coordinator
  // at its bound refuses them: marked to ask again after `retry_after_ms`
  // (SetRetryAfter) unless it is zero; below zero, a mark that does not
  // parse.
  std::atomic<int> refuse_calls{0};
  grpc::Status refusal{grpc::StatusCode::RESOURCE_EXHAUSTED,
                       "64 downloads are in progress, the coordinator's --max-concurrent-downloads: retry when one "
                       "has ended"};
  std::atomic<int> retry_after_ms{1};
  std::atomic<bool> saw_cancel{false};
  absl::Notification streaming;  // the endless stream has sent its first chunk
  // The worker key the last call carried ("" none).
  std::string key() {
    absl::MutexLock lock(&mu_);
    return key_;
  }

  grpc::Status DownloadModel(grpc::ServerContext* ctx, const v1::DownloadModelRequest* req,
                             grpc::ServerWriter<v1::ModelChunk>* out) override {
    {
      const auto& md = ctx->client_metadata();
      const auto it = md.find("colod-worker-key");
      absl::MutexLock lock(&mu_);
      key_ = it == md.end() ? "" : std::string(it->second.data(), it->second.size());
    }
    if (++calls <= refuse_calls.load()) {
      if (retry_after_ms.load() > 0) SetRetryAfter(*ctx, absl::Milliseconds(retry_after_ms.load()));
      if (retry_after_ms.load() < 0) ctx->AddTrailingMetadata(kRetryAfterMetadata, "soon");  // malformed
      return refusal;
    }
    v1::ModelChunk c;
    switch (mode.load()) {
      case Mode::kTwoFiles:
        c.set_file("model-00001.safetensors");
        c.set_data("first");
        out->Write(c);
        c.set_offset(5);
        c.set_data(" part");
        out->Write(c);
        c.set_file("model-00002.safetensors");
        c.set_offset(0);
        c.set_data("second");
        out->Write(c);
        return grpc::Status::OK;
      case Mode::kFileAgain:        // the first file again, which would be written over
      case Mode::kChunkOutOfPlace:  // a chunk past a gap
        c.set_file("model-00001.safetensors");
        c.set_data("first");
        out->Write(c);
        c.set_file(mode.load() == Mode::kFileAgain ? "model-00002.safetensors" : "model-00001.safetensors");
        c.set_offset(mode.load() == Mode::kFileAgain ? 0 : 9);
        c.set_data("second");
        out->Write(c);
        c.set_file("model-00001.safetensors");
        c.set_offset(0);
        c.set_data("again");
        out->Write(c);
        return grpc::Status::OK;
      case Mode::kBadName:
        c.set_file("../escaped.safetensors");
        c.set_data("x");
        out->Write(c);
        return grpc::Status::OK;
      case Mode::kEndless:
        c.set_file("model.safetensors");
        c.set_data(std::string(1024, 'w'));
        for (int i = 0; i < 600; ++i) {  // 60 s at most
          if (ctx->IsCancelled()) {
            saw_cancel = true;
            return grpc::Status::CANCELLED;
          }
          c.set_offset(int64_t{1024} * i);
          out->Write(c);
          if (i == 0) streaming.Notify();
          absl::SleepFor(absl::Milliseconds(100));
        }
        return grpc::Status::OK;
    }
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  std::string key_ ABSL_GUARDED_BY(mu_);
};

class ModelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started = StartGrpcServer("127.0.0.1:0", {&service_});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started->server);
    work_ = testing::TempPath("model-cache-" + std::to_string(counter_++));
    fs::remove_all(work_);
    fs::create_directories(work_);
    ModelCache::Options o;
    o.work_dir = work_;
    o.coordinator = v1::CoordinatorService::NewStub(
        grpc::CreateChannel(started->address, grpc::InsecureChannelCredentials()));
    o.worker_key = std::string(32, 'k');
    o.download_timeout = absl::Seconds(60);
    o.busy_backoff = absl::Milliseconds(20);
    o.max_busy_backoff = absl::Milliseconds(80);
    options_ = o;
    cache_ = std::make_unique<ModelCache>(o);
  }
  void TearDown() override { StopGrpcServer(*server_, absl::Seconds(1)); }

  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  static inline int counter_ = 0;
  FakeDownloads service_;
  std::unique_ptr<grpc::Server> server_;
  std::string work_;
  ModelCache::Options options_;
  std::unique_ptr<ModelCache> cache_;
};

TEST_F(ModelCacheTest, LinksLocalWeightsUnderTheSpecsConfig) {
  const std::string weights = work_ + "/w.safetensors";
  std::ofstream(weights) << "tensor bytes";
  v1::ModelSpec spec;
  spec.set_config_json(R"({"model_type": "gpt2"})");
  spec.set_weights_path(weights);
  AbortSignal abort;
  ASSERT_TRUE(cache_->Materialize(spec, work_ + "/job/model", abort).ok());
  EXPECT_EQ(Read(work_ + "/job/model/config.json"), spec.config_json());
  EXPECT_TRUE(fs::is_symlink(work_ + "/job/model/model.safetensors"));
  EXPECT_EQ(Read(work_ + "/job/model/model.safetensors"), "tensor bytes");

  spec.set_weights_path(work_ + "/nowhere");
  EXPECT_EQ(cache_->Materialize(spec, work_ + "/job2/model", abort).code(), absl::StatusCode::kNotFound);
  fs::create_directories(work_ + "/empty");
  spec.set_weights_path(work_ + "/empty");
  const absl::Status s = cache_->Materialize(spec, work_ + "/job3/model", abort);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("no .safetensors"), std::string::npos) << s;
  EXPECT_EQ(service_.calls.load(), 0);
}

TEST_F(ModelCacheTest, ADirectorysTokenizerComesWithItsWeights) {
  const std::string dir = work_ + "/hf";
  fs::create_directories(dir);
  for (const char* f : {"model.safetensors", "tokenizer.model", "tokenizer.json", "vocab.json", "merges.txt",
                        "tokenizer_config.json", "README.md", "config.json"}) {
    std::ofstream(dir + "/" + f) << f;
  }
  v1::ModelSpec spec;
  spec.set_config_json(R"({"model_type": "llama"})");
  spec.set_weights_path(dir);
  AbortSignal abort;
  ASSERT_TRUE(cache_->Materialize(spec, work_ + "/job/model", abort).ok());
  for (const char* f : {"model.safetensors", "tokenizer.model", "tokenizer.json", "vocab.json", "merges.txt",
                        "tokenizer_config.json"}) {
    EXPECT_EQ(Read(work_ + "/job/model/" + f), f);
  }
  EXPECT_FALSE(fs::exists(work_ + "/job/model/README.md"));
  EXPECT_EQ(Read(work_ + "/job/model/config.json"), spec.config_json());  // the spec's, not the directory's
  // Under --allow-path, a file of an allowed directory that links outside
  // it is refused, naming it: the worker would read it for the job.
  const std::string outside = work_ + "/outside";
  fs::create_directories(outside);
  std::ofstream(outside + "/secret") << "not the job's";
  fs::remove(dir + "/merges.txt");
  fs::create_symlink(outside + "/secret", dir + "/merges.txt");
  auto policy = PathPolicy::Create({dir});
  ASSERT_TRUE(policy.ok()) << policy.status();
  const absl::Status linked_out = cache_->Materialize(spec, work_ + "/job-linked/model", abort, *policy);
  EXPECT_EQ(linked_out.code(), absl::StatusCode::kPermissionDenied) << linked_out;
  EXPECT_NE(linked_out.message().find("merges.txt"), std::string::npos) << linked_out;
  fs::remove(dir + "/merges.txt");
  EXPECT_TRUE(cache_->Materialize(spec, work_ + "/job-inside/model", abort, *policy).ok());
  // A tokenizer is no model.
  fs::remove(dir + "/model.safetensors");
  EXPECT_EQ(cache_->Materialize(spec, work_ + "/job2/model", abort).code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelCacheTest, DownloadsAnUploadOnceAndLinksEveryShard) {
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  spec.set_upload_id("u1");
  AbortSignal abort;
  ASSERT_TRUE(cache_->Materialize(spec, work_ + "/a/model", abort).ok());
  EXPECT_EQ(Read(work_ + "/a/model/model-00001.safetensors"), "first part");
  EXPECT_EQ(Read(work_ + "/a/model/model-00002.safetensors"), "second");
  ASSERT_TRUE(cache_->Materialize(spec, work_ + "/b/model", abort).ok());
  EXPECT_EQ(Read(work_ + "/b/model/model-00002.safetensors"), "second");
  EXPECT_EQ(service_.calls.load(), 1) << "the second job downloaded again";
  EXPECT_FALSE(fs::exists(work_ + "/uploads/u1.tmp"));
  // It carried the worker's key: the coordinator serves an upload only to
  // the workers placed in a job that uses it.
  EXPECT_EQ(service_.key(), std::string(32, 'k'));

  spec.set_upload_id("../u1");
  EXPECT_EQ(cache_->Weights(spec, abort).status().code(), absl::StatusCode::kInvalidArgument);
}

// Downloads unused for the TTL go at the next use of the cache, a hit or a
// download; one used recently (a cache hit refreshes it) stays, and so does
// the one being fetched; a download a crash left half done goes.
TEST_F(ModelCacheTest, UploadsUnusedForTheTtlAreRemovedBeforeTheNextDownload) {
  const fs::path uploads = fs::path(work_) / "uploads";
  for (const char* id : {"old", "recent", "hit"}) {
    fs::create_directories(uploads / id);
    std::ofstream(uploads / id / "model.safetensors") << id;
  }
  fs::create_directories(uploads / "crashed.tmp");
  const auto now = fs::file_time_type::clock::now();
  fs::last_write_time(uploads / "old", now - std::chrono::hours(2));
  fs::last_write_time(uploads / "recent", now - std::chrono::minutes(10));
  fs::last_write_time(uploads / "hit", now - std::chrono::hours(3));
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  AbortSignal abort;
  // Already here: used, not downloaded; what no rank used for the TTL goes
  // all the same (a worker whose every job hits its cache lets go too).
  spec.set_upload_id("hit");
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());
  EXPECT_EQ(service_.calls.load(), 0);
  EXPECT_FALSE(fs::exists(uploads / "old"));
  EXPECT_FALSE(fs::exists(uploads / "crashed.tmp"));
  EXPECT_TRUE(fs::exists(uploads / "recent"));
  fs::create_directories(uploads / "older");
  fs::last_write_time(uploads / "older", now - std::chrono::hours(2));
  spec.set_upload_id("new");
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());
  EXPECT_EQ(service_.calls.load(), 1);
  EXPECT_FALSE(fs::exists(uploads / "older"));
  EXPECT_TRUE(fs::exists(uploads / "recent"));
  EXPECT_TRUE(fs::exists(uploads / "hit")) << "a cache hit did not count as a use";
  EXPECT_EQ(Read((uploads / "new" / "model-00002.safetensors").string()), "second");
}

// A TTL of inf (or past a century) keeps every download: the cutoff's
// clock arithmetic overflowed and wrapped into the future, which removed
// every upload but the one in use.
TEST_F(ModelCacheTest, AnInfiniteTtlKeepsEveryUpload) {
  const fs::path uploads = fs::path(work_) / "uploads";
  for (const char* id : {"old", "hit"}) {
    fs::create_directories(uploads / id);
    std::ofstream(uploads / id / "model.safetensors") << id;
  }
  fs::last_write_time(uploads / "old", fs::file_time_type::clock::now() - std::chrono::hours(24 * 400));
  for (const absl::Duration ttl : {absl::InfiniteDuration(), absl::Hours(24 * 365 * 200)}) {
    ModelCache::Options o = options_;
    o.cache_ttl = ttl;
    ModelCache forever(o);
    v1::ModelSpec spec;
    spec.set_config_json("{}");
    spec.set_upload_id("hit");
    AbortSignal abort;
    ASSERT_TRUE(forever.Weights(spec, abort).ok());
    EXPECT_TRUE(fs::exists(uploads / "old")) << absl::FormatDuration(ttl);
  }
}

// A rank stamps its upload as used when it ends (Used): a job that ran
// longer than the TTL keeps its upload for the TTL after its end (its
// restart, or the next job of that model, finds it here), where the stamp
// of its start alone would have it removed at the next download.
TEST_F(ModelCacheTest, AnUploadCountsAsUsedUntilItsRankEnds) {
  const fs::path uploads = fs::path(work_) / "uploads";
  for (const char* id : {"long", "idle"}) {
    fs::create_directories(uploads / id);
    std::ofstream(uploads / id / "model.safetensors") << id;
  }
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  spec.set_upload_id("long");
  AbortSignal abort;
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());  // the rank starts: stamped now
  // Its job ran three hours (the TTL is one); the other upload was last used as long ago.
  const auto started = fs::file_time_type::clock::now() - std::chrono::hours(3);
  fs::last_write_time(uploads / "long", started);
  fs::last_write_time(uploads / "idle", started);
  cache_->Used(spec);  // the rank ends
  v1::ModelSpec next;
  next.set_config_json("{}");
  next.set_upload_id("new");
  ASSERT_TRUE(cache_->Weights(next, abort).ok());
  EXPECT_TRUE(fs::exists(uploads / "long")) << "removed an hour after its job's start, not its end";
  EXPECT_FALSE(fs::exists(uploads / "idle"));
  // An id that is not a plain name stamps nothing outside uploads/.
  fs::create_directories(work_ + "/x");
  fs::last_write_time(work_ + "/x", started);
  v1::ModelSpec outside;
  outside.set_upload_id("../x");
  cache_->Used(outside);
  EXPECT_EQ(fs::last_write_time(work_ + "/x"), started);
}

// A weights path this worker cannot look up (here a link to itself: ELOOP;
// EACCES for a worker that is not root) is said as such, not as a path
// that does not exist.
TEST_F(ModelCacheTest, AWeightsPathThatCannotBeLookedUpIsNotCalledMissing) {
  const std::string loop = work_ + "/loop";
  fs::create_symlink(loop, loop);
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  spec.set_weights_path(loop);
  AbortSignal abort;
  const absl::Status s = cache_->Materialize(spec, work_ + "/job/model", abort);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "cannot look up")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "does not exist")) << s;
}

// A disk too full for a download is RESOURCE_EXHAUSTED, marked as the
// worker's fault, leaves no partial download, and the next attempt with
// room succeeds.
TEST_F(ModelCacheTest, AFullDiskFailsTheDownloadCleanly) {
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  spec.set_upload_id("big");
  service_.mode = FakeDownloads::Mode::kEndless;
  AbortSignal abort;
  absl::StatusOr<std::string> got;
  {
    testing::FullDisk full(64);
    got = cache_->Weights(spec, abort);
  }
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_NE(got.status().message().find("File too large"), std::string::npos) << got.status();
  EXPECT_TRUE(IsWorkerFault(got.status())) << "the worker's own disk, not the job's";
  EXPECT_FALSE(fs::exists(work_ + "/uploads/big"));
  EXPECT_FALSE(fs::exists(work_ + "/uploads/big.tmp"));
  service_.mode = FakeDownloads::Mode::kTwoFiles;
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());
  EXPECT_EQ(Read(work_ + "/uploads/big/model-00001.safetensors"), "first part");
}

TEST_F(ModelCacheTest, AnAbortEndsADownloadInProgressAndLeavesNothingBehind) {
  service_.mode = FakeDownloads::Mode::kEndless;
  v1::ModelSpec spec;
  spec.set_upload_id("big");
  AbortSignal abort;
  std::thread stopper([&] {
    service_.streaming.WaitForNotificationWithTimeout(absl::Seconds(30));
    abort.Abort(absl::AbortedError("cancelled by the user"));
  });
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::string> got = cache_->Weights(spec, abort);
  const absl::Duration took = absl::Now() - start;
  stopper.join();
  ASSERT_TRUE(service_.streaming.HasBeenNotified());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_EQ(got.status().message(), "cancelled by the user");
  EXPECT_LT(took, absl::Seconds(10)) << "the download ran on after the abort";
  EXPECT_FALSE(fs::exists(work_ + "/uploads/big"));
  EXPECT_FALSE(fs::exists(work_ + "/uploads/big.tmp"));
  // The stand-in notices the cancel within its 100 ms write period.
  for (int i = 0; i < 50 && !service_.saw_cancel; ++i) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(service_.saw_cancel.load());
  // An abort that fired before the call starts no download at all.
  const int calls = service_.calls.load();
  EXPECT_EQ(cache_->Weights(spec, abort).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(service_.calls.load(), calls);
}

TEST_F(ModelCacheTest, AFileNameThatLeavesTheDirectoryIsRefused) {
  service_.mode = FakeDownloads::Mode::kBadName;
  v1::ModelSpec spec;
  spec.set_upload_id("evil");
  AbortSignal abort;
  const absl::StatusOr<std::string> got = cache_->Weights(spec, abort);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
  EXPECT_FALSE(fs::exists(work_ + "/uploads/escaped.safetensors"));
  EXPECT_FALSE(fs::exists(work_ + "/uploads/evil"));
  EXPECT_FALSE(fs::exists(work_ + "/uploads/evil.tmp"));
}

// A download's files come whole, each chunk where the last ended: a file
// sent again (it would be written over) or a chunk out of place fails the
// download, and nothing of it is cached.
TEST_F(ModelCacheTest, AFileSentAgainOrAChunkOutOfPlaceIsRefused) {
  for (const FakeDownloads::Mode mode : {FakeDownloads::Mode::kFileAgain, FakeDownloads::Mode::kChunkOutOfPlace}) {
    service_.mode = mode;
    v1::ModelSpec spec;
    spec.set_upload_id("disordered");
    AbortSignal abort;
    const absl::StatusOr<std::string> got = cache_->Weights(spec, abort);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
    EXPECT_TRUE(absl::StrContains(got.status().message(), "out of order")) << got.status();
    EXPECT_FALSE(fs::exists(work_ + "/uploads/disordered"));
    EXPECT_FALSE(fs::exists(work_ + "/uploads/disordered.tmp"));
  }
}

// A removal cut short (a crash midway) leaves nothing under the upload's
// id: an upload is renamed out of the cache's names before it is removed,
// and what such a removal left is removed by the next prune. The cache's
// own names are no upload ids.
TEST_F(ModelCacheTest, AnUploadIsTakenOutOfTheCachesNamesBeforeItIsRemoved) {
  const fs::path uploads = fs::path(work_) / "uploads";
  fs::create_directories(uploads / "cut-short.removing");
  std::ofstream(uploads / "cut-short.removing" / "model-00002.safetensors") << "half";
  fs::create_directories(uploads / "stale");
  fs::last_write_time(uploads / "stale", fs::file_time_type::clock::now() - std::chrono::hours(2));
  EXPECT_TRUE(cache_->PruneIfIdle());
  EXPECT_FALSE(fs::exists(uploads / "cut-short.removing"));
  EXPECT_FALSE(fs::exists(uploads / "stale"));
  EXPECT_FALSE(fs::exists(uploads / "stale.removing"));
  for (const char* id : {"cut-short.removing", "x.tmp"}) {
    v1::ModelSpec spec;
    spec.set_upload_id(id);
    AbortSignal abort;
    EXPECT_EQ(cache_->Weights(spec, abort).status().code(), absl::StatusCode::kInvalidArgument) << id;
  }
}

// A coordinator at its bound of downloads (or of server threads) refuses
// before it sends anything: the worker asks again, backing off (never
// sooner than the refusal asks), until the download's deadline, and an
// abort ends the wait. Other refusals are final, whatever their text.
TEST_F(ModelCacheTest, ABusyCoordinatorIsAskedAgainUntilTheDeadline) {
  v1::ModelSpec spec;
  spec.set_config_json("{}");
  spec.set_upload_id("busy");
  AbortSignal abort;
  service_.refuse_calls = 4;
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());
  EXPECT_EQ(service_.calls.load(), 5);
  EXPECT_EQ(Read(work_ + "/uploads/busy/model-00001.safetensors"), "first part");

  // A refusal that asks for a longer wait than the worker's backoff (20 ms,
  // 40 ms) gets it.
  service_.calls = 0;
  service_.refuse_calls = 2;
  service_.retry_after_ms = 300;
  spec.set_upload_id("patient");
  absl::Time start = absl::Now();
  ASSERT_TRUE(cache_->Weights(spec, abort).ok());
  EXPECT_EQ(service_.calls.load(), 3);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(600));

  // Two refusals with `text`, marked to ask again after `mark_ms` (0: not
  // marked), then the upload: asked three times.
  const auto asked_again = [&](const std::string& upload, const std::string& text, int mark_ms) {
    SCOPED_TRACE(upload);
    service_.calls = 0;
    service_.refuse_calls = 2;
    service_.retry_after_ms = mark_ms;
    service_.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, text);
    spec.set_upload_id(upload);
    ASSERT_TRUE(cache_->Weights(spec, abort).ok());
    EXPECT_EQ(service_.calls.load(), 3);
  };
  // The mark, whatever the text, is what the worker goes by...
  asked_again("marked", "busy", 1);
  // ... and a coordinator from before the mark is known by its text, as is
  // gRPC's own refusal when the server's threads are all in use (it can
  // carry no mark of ours).
  asked_again("old-coordinator",
              "64 downloads are in progress, the coordinator's --max-concurrent-downloads: retry when one has ended",
              0);
  asked_again("threads", "Server Threadpool Exhausted", 0);
  // A mark that does not parse is none: final.
  service_.calls = 0;
  service_.retry_after_ms = -1;
  service_.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "busy");
  spec.set_upload_id("malformed");
  EXPECT_EQ(cache_->Weights(spec, abort).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(service_.calls.load(), 1);
  service_.retry_after_ms = 0;
  service_.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "Server Threadpool Exhausted");

  // Busy past the deadline: DEADLINE_EXCEEDED naming the refusal, nothing left behind.
  ModelCache::Options o = options_;
  o.download_timeout = absl::Milliseconds(600);
  ModelCache short_deadline(o);
  service_.calls = 0;
  service_.refuse_calls = 1 << 30;
  spec.set_upload_id("never");
  start = absl::Now();
  absl::StatusOr<std::string> got = short_deadline.Weights(spec, abort);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_NE(got.status().message().find("Threadpool Exhausted"), std::string::npos) << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_GE(service_.calls.load(), 3) << "it did not ask again";
  EXPECT_LE(service_.calls.load(), 30) << "it did not back off";
  EXPECT_FALSE(fs::exists(work_ + "/uploads/never.tmp"));

  // An abort ends the wait between two asks.
  service_.calls = 0;
  std::thread stopper([&] {
    for (int i = 0; i < 300 && service_.calls.load() < 1; ++i) absl::SleepFor(absl::Milliseconds(10));
    absl::SleepFor(absl::Milliseconds(100));  // into the wait
    abort.Abort(absl::CancelledError("the job was cancelled"));
  });
  o.download_timeout = absl::Minutes(5);
  o.busy_backoff = o.max_busy_backoff = absl::Seconds(30);
  ModelCache slow_asks(o);
  start = absl::Now();
  got = slow_asks.Weights(spec, abort);
  stopper.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the abort did not end the wait";
  EXPECT_EQ(service_.calls.load(), 1);

  // A refusal that waiting cannot mend (the store's quota) is final.
  AbortSignal fresh;
  service_.calls = 0;
  service_.refuse_calls = 1 << 30;
  service_.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "the upload quota is spent");
  got = cache_->Weights(spec, fresh);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_EQ(service_.calls.load(), 1);
}

}  // namespace
}  // namespace colod
