// Models uploaded through the coordinator (UploadModel), kept in its data
// directory as DIR/uploads/ID/<files>. An id is upload-NNNNNN-RRRRRRRRRRRRRRRR:
// a counter and 64 random bits, so that no id names two contents, even
// after the upload was collected and the coordinator restarted (its counter
// starts after the uploads it still has), or on a coordinator with a new
// data directory: a worker caches a download by its id (ModelCache). An upload is written into
// a .tmp directory and renamed when complete, so a broken stream leaves
// nothing that a job could name. Uploads are deduplicated by content
// (SHA-256 over each file's name, size and bytes: DIR/uploads/upload-N.sha256
// records it), bounded by a quota, and removed when no job names them
// (CollectGarbage).
#ifndef COLOD_SERVER_UPLOAD_STORE_H_
#define COLOD_SERVER_UPLOAD_STORE_H_

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.pb.h"
#include "common/clock.h"

namespace colod {

struct UploadLimits {
  // Bytes of all uploads together, those in progress included.
  int64_t quota_bytes = int64_t{256} << 30;
  // Uploads stored and in progress.
  int max_uploads = 1000;
  // Uploads in progress at once: each is a client stream holding one of the
  // coordinator's server threads while it lasts.
  int max_concurrent_uploads = 16;
  // Downloads in progress at once (DownloadModel: workers fetching a job's
  // model), each a server stream holding a thread while it lasts.
  int max_concurrent_downloads = 64;
};

// Thread-safe; uploads proceed concurrently.
class UploadStore {
 public:
  using Limits = UploadLimits;

  // Creates DIR (and removes the .tmp leftovers of interrupted uploads).
  static absl::StatusOr<std::unique_ptr<UploadStore>> Open(const std::string& dir, Limits limits = Limits(),
                                                           Clock* clock = Clock::Real());
  ~UploadStore();

  // One upload in progress; Add chunks in order, then Finish. A Writer must
  // not outlive its store.
  class Writer {
   public:
    ~Writer();  // an unfinished upload is removed
    // INVALID_ARGUMENT for a bad file name, a chunk out of order, or a file
    // past kMaxFiles; RESOURCE_EXHAUSTED once the store's quota is spent.
    // Each file counts kFileBytes against the quota besides its bytes (so
    // that empty files are not free).
    static constexpr int kMaxFiles = 4096;
    static constexpr int64_t kFileBytes = 4096;
    absl::Status Add(const v1::ModelChunk& chunk);
    // Publishes the upload, or returns the stored one with the same content
    // (deduplicated). INVALID_ARGUMENT if no file came.
    absl::StatusOr<v1::UploadModelResponse> Finish();

   private:
    friend class UploadStore;
    Writer(UploadStore* store, std::string id, std::string tmp, std::string final_dir);
    UploadStore* const store_;
    const std::string id_, tmp_, final_;
    std::string file_;  // the file being written
    int64_t offset_ = 0;
    std::ofstream out_;
    std::vector<std::string> files_;  // in the order they came
    std::set<std::string> seen_;      // files_, to look up
    int64_t bytes_ = 0;               // of the files' contents
    int64_t reserved_ = 0;            // bytes_ and kFileBytes a file, reserved
    bool finished_ = false;
    struct Hash;
    std::unique_ptr<Hash> hash_;  // over what came so far
  };
  // RESOURCE_EXHAUSTED when max_uploads are stored or in progress, or
  // max_concurrent_uploads are in progress; or admit's error (below).
  absl::StatusOr<std::unique_ptr<Writer>> Begin();

  // Asked before an upload begins (`bytes` 0) and before each chunk is
  // written (`bytes` its data): where it returns an error, Begin refuses
  // the upload and Writer::Add the chunk with it (the coordinator's data
  // dir is full, or would be after the chunk: the room it keeps for the job
  // records must not go to an upload). Set before any upload.
  void SetAdmit(std::function<absl::Status(int64_t bytes)> admit) { admit_ = std::move(admit); }

  // One download in progress: it holds one of max_concurrent_downloads and
  // keeps its upload from being collected until it is destroyed. A Reading
  // must not outlive its store.
  class Reading {
   public:
    ~Reading();
    Reading(const Reading&) = delete;
    Reading& operator=(const Reading&) = delete;
    // The upload's directory.
    const std::string& path() const { return path_; }

   private:
    friend class UploadStore;
    Reading(UploadStore* store, std::string id, std::string path)
        : store_(store), id_(std::move(id)), path_(std::move(path)) {}
    UploadStore* const store_;
    const std::string id_, path_;
  };
  // NOT_FOUND for an unknown or malformed id; RESOURCE_EXHAUSTED when
  // max_concurrent_downloads are in progress (the caller retries later).
  absl::StatusOr<std::unique_ptr<Reading>> BeginReading(const std::string& upload_id);

  // Whether the upload is stored (published, not collected); one that is
  // counts as used now, so a job about to name it (a submit that asked)
  // keeps it a full grace period even if CollectGarbage's `in_use` was
  // taken before the job was.
  bool Exists(const std::string& upload_id);
  // Whether both uploads are stored with a hash and the hashes differ
  // (different files); false where either is unknown or has none.
  bool Differ(const std::string& a, const std::string& b) const;
  // The upload's directory; NOT_FOUND for an unknown or malformed id.
  absl::StatusOr<std::string> Path(const std::string& upload_id) const;

  // Removes the uploads that no id in `in_use` names, that no download is
  // reading, and that were made, or last seen in use, longer than `grace`
  // ago; returns their ids.
  std::vector<std::string> CollectGarbage(const std::set<std::string>& in_use, absl::Duration grace);

  // Bytes of the stored uploads and of those in progress.
  int64_t bytes() const;

 private:
  struct Stored {
    int64_t bytes = 0;
    std::string sha256;
    absl::Time last_used;
    int readers = 0;  // downloads in progress
  };
  UploadStore(std::string dir, int64_t next, Limits limits, Clock* clock)
      : dir_(std::move(dir)), limits_(limits), clock_(clock), next_(next) {}
  // Reserves `n` more bytes for an upload in progress; RESOURCE_EXHAUSTED
  // past the quota.
  absl::Status Reserve(int64_t n);
  void Release(int64_t n, bool writer_done);

  const std::string dir_;
  const Limits limits_;
  std::function<absl::Status(int64_t bytes)> admit_;  // set before any upload
  Clock* const clock_;
  mutable absl::Mutex mu_;
  int64_t next_ ABSL_GUARDED_BY(mu_);
  absl::BitGen bits_ ABSL_GUARDED_BY(mu_);  // the ids' random part
  std::map<std::string, Stored> stored_ ABSL_GUARDED_BY(mu_);        // by upload id
  std::map<std::string, std::string> by_sha_ ABSL_GUARDED_BY(mu_);  // sha256 -> upload id
  int64_t stored_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of uploads in progress
  int writers_ ABSL_GUARDED_BY(mu_) = 0;
  int readers_ ABSL_GUARDED_BY(mu_) = 0;  // downloads in progress, of every upload
};

}  // namespace colod

#endif  // COLOD_SERVER_UPLOAD_STORE_H_
