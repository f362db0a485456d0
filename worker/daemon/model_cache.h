// A job's model on this worker, as a Hugging Face-style directory: the
// spec's config.json and links to its weights, which are the spec's
// weights_path or its upload, downloaded from the coordinator once per
// worker into WORK_DIR/uploads/ID. Downloaded uploads not used for
// cache_ttl are removed before the next download (the coordinator removes
// an upload no job names an hour after its last use too).
#ifndef COLOD_WORKER_DAEMON_MODEL_CACHE_H_
#define COLOD_WORKER_DAEMON_MODEL_CACHE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/job.pb.h"
#include "common/auth.h"
#include "worker/comm/abort_signal.h"
#include "worker/daemon/path_policy.h"

namespace colod {

// Thread-compatible but for PruneIfIdle, which may be called beside the
// rest: the JobRunner runs one rank, and so one download, at a time.
class ModelCache {
 public:
  struct Options {
    // Downloads go to WORK_DIR/uploads/ID (via ID.tmp: a broken download is
    // never mistaken for a whole one).
    std::string work_dir;
    // The coordinator (DownloadModel); required for uploads.
    std::shared_ptr<v1::CoordinatorService::StubInterface> coordinator;
    AuthToken auth_token;
    // The worker's key (common/auth.h), carried by each download: the
    // coordinator serves an upload only to the workers placed in a job that
    // uses it (WorkerInfo.downloads_carry_key). Empty: none.
    std::string worker_key;
    // Deadline of one download, the waits for a busy coordinator included.
    absl::Duration download_timeout = absl::Minutes(30);
    // A downloaded upload no rank used this long is removed (its use time
    // is its directory's mtime, set at each use).
    absl::Duration cache_ttl = absl::Hours(1);
    // A coordinator that refuses a download for want of room (its
    // --max-concurrent-downloads, a refusal marked to ask again:
    // common/grpc_status.h's RetryAfter, or by its text from a coordinator
    // before the mark; or gRPC's own refusal when its server threads are all
    // in use) is asked again after this, doubling up
    // to max_busy_backoff, or after the wait the refusal suggests where that
    // is longer, each wait up to half again at random. Any other refusal
    // (RESOURCE_EXHAUSTED included: the store's quota) is final.
    absl::Duration busy_backoff = absl::Milliseconds(250);
    absl::Duration max_busy_backoff = absl::Seconds(8);
  };

  explicit ModelCache(Options options);

  // Writes DIR/config.json from `model` and links its weights into DIR (a
  // file becomes DIR/model.safetensors; a directory's *.safetensors, index
  // and tokenizer files are linked by name). NOT_FOUND for weights that are not on this
  // worker or a directory without safetensors. A download in progress ends
  // when `abort` fires, with the abort's reason. Each file linked from a
  // weights directory must pass `paths` as it resolves (a link in an
  // allowed directory may point anywhere): PERMISSION_DENIED naming it.
  absl::Status Materialize(const v1::ModelSpec& model, const std::string& dir, AbortSignal& abort,
                           const PathPolicy& paths = PathPolicy());

  // Where the model's weights are on this worker: the spec's weights_path,
  // or its upload's directory (downloaded unless it is already here). A
  // disk too full for the download is RESOURCE_EXHAUSTED, and leaves
  // nothing behind. A busy coordinator is asked again until the download's
  // deadline (DEADLINE_EXCEEDED after it).
  absl::StatusOr<std::string> Weights(const v1::ModelSpec& model, AbortSignal& abort);

  // Stamps `model`'s upload (where it names one) as used now: a rank calls
  // it as it ends, so that cache_ttl counts from the end of a long job's
  // use, not from its start.
  void Used(const v1::ModelSpec& model);
  // Removes downloaded uploads unused for cache_ttl, except `keep`, and
  // downloads a crash left unfinished (*.tmp). Weights calls it before
  // each download. An upload is renamed (ID.removing) before it is
  // removed: a removal cut short leaves nothing under its id.
  void Prune(const std::string& keep) ABSL_LOCKS_EXCLUDED(files_mu_);
  // Prune, unless Weights runs (a rank's download or lookup, which prunes
  // itself): false then. Never waits for it. For a worker short of disk
  // that would refuse a rank (JobRunner).
  bool PruneIfIdle(const std::string& keep = "") ABSL_LOCKS_EXCLUDED(files_mu_);

 private:
  // One DownloadModel call writing into `tmp`; `received` says whether any
  // chunk came (a refusal sends none), `retry_after` the wait a refusal
  // marked as one to ask again after suggests, `busy_refusal` whether the
  // refusal is one for want of room (IsBusyRefusal, or an older
  // coordinator's at its --max-concurrent-downloads).
  absl::Status DownloadInto(const std::string& upload_id, const std::string& tmp, absl::Time deadline,
                            AbortSignal& abort, bool& received, std::optional<absl::Duration>& retry_after,
                            bool& busy_refusal);
  void PruneLocked(const std::string& keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(files_mu_);
  static constexpr char kRemoving[] = ".removing";
  // Held by Weights (across a download: no caller waits for it but
  // Prune's) and Prune, so that PruneIfIdle never removes what a rank is
  // downloading or about to use.
  absl::Mutex files_mu_;

  const Options options_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_MODEL_CACHE_H_
