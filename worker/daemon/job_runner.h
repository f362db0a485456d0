// Runs the rank of a job that the coordinator assigned to this worker: opens
// the model (ModelCache), builds the rank's process group through the
// coordinator's rendezvous store (CreateRankGroup, instrumented for metrics
// and the flight recorder), runs the training loop, one forward pass or a
// TensorHost, reports its phases, steps and end (ProgressReporter), and goes
// back to idle.
#ifndef COLOD_WORKER_DAEMON_JOB_RUNNER_H_
#define COLOD_WORKER_DAEMON_JOB_RUNNER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/worker.pb.h"
#include "common/auth.h"
#include "worker/colo/process_group.h"
#include "worker/comm/flight_recorder.h"
#include "worker/comm/store.h"
#include "worker/daemon/model_cache.h"
#include "worker/daemon/path_policy.h"
#include "worker/daemon/progress_reporter.h"
#include "worker/daemon/tensor_host.h"
#include "worker/daemon/worker_metrics.h"
#include "worker/shardformer/shard_config.h"

namespace colod {

// One job rank at a time, each on a thread of its own.
//
// Thread-safe: Assign, Abort and Status are called from gRPC handlers and the
// heartbeat loop while a rank runs.
class JobRunner {
 public:
  struct Options {
    // Scratch space: each job rank gets WORK_DIR/JOB-gen-G-rank-R/, removed
    // when it ends.
    std::string work_dir;
    // Host this worker's Gloo pairs listen on and advertise to peers.
    std::string host = "127.0.0.1";
    // Run ranks on this CUDA device over NCCL (else host tensors over Gloo).
    bool cuda = false;
    int device_ordinal = 0;
    // The coordinator (rendezvous store and ReportProgress); required.
    std::shared_ptr<v1::CoordinatorService::StubInterface> coordinator;
    AuthToken auth_token;
    // This worker's key (WorkerKey), sent on its reports; "" none.
    std::string worker_key;
    absl::Duration rpc_timeout = absl::Seconds(10);
    // Rendezvous and per-collective limit: a peer that vanished makes this
    // rank fail after at most this long.
    absl::Duration comm_timeout = absl::Minutes(2);
    // This worker's id (for reports).
    std::function<std::string()> worker_id;
    // Where the rank's metrics go; may be null.
    WorkerMetrics* metrics = nullptr;
    // Deadline of downloading an uploaded model from the coordinator.
    absl::Duration download_timeout = absl::Minutes(30);
    // Downloaded uploads unused this long are removed (ModelCache).
    absl::Duration upload_cache_ttl = absl::Hours(1);
    // The memory a rank may use (the device's, or the host's for a CPU
    // worker): a rank whose model needs more at least
    // (MemoryFloorPerRank) fails RESOURCE_EXHAUSTED before it
    // allocates anything. 0: unchecked.
    int64_t memory_bytes = 0;
    // The paths a job may name; a rank whose spec names another fails
    // PERMISSION_DENIED before it opens anything.
    PathPolicy paths;
    // A TRAIN or FORWARD rank (which writes its model's files under
    // work_dir, and downloads an upload there) is refused RESOURCE_EXHAUSTED
    // at Assign while work_dir's file system has less room than this, or no
    // free inode: the coordinator then places the job on other workers, not
    // counting it against the job. 0: unchecked.
    int64_t min_free_work_dir_bytes = 0;
    // Called once, on the rank's thread after its end is reported, where a
    // rank failed and the CUDA device turns out broken (CudaDeviceUsable:
    // a broken context fails every call until the process ends). The
    // runner takes no rank after it.
    std::function<void(const absl::Status&)> on_device_lost;
  };

  explicit JobRunner(Options options);
  // Aborts a running rank and waits for it.
  ~JobRunner();

  // Starts the rank. INVALID_ARGUMENT for a request that does not describe
  // a rank of a TRAIN, FORWARD or TENSOR job (missing mesh, rank out of range, ...),
  // FAILED_PRECONDITION while another job's rank runs, or once the device
  // is lost (Options::on_device_lost). The same assignment again (job, uid,
  // generation and rank: a duplicate delivery) of the rank that runs, or of
  // the one that last ended here, is OK and starts nothing: a rank never
  // runs twice (its end, reported, says how it ended). ABORTED for a
  // generation of a job (by id and uid) older than one that runs here or
  // ran last, or one that was aborted here before its assignment arrived.
  absl::Status Assign(const v1::AssignJobRequest& request);
  // Stops the job's rank: NOT_FOUND unless it runs that job, ABORTED for an
  // older generation than the one that runs. An abort (with a job_uid) of
  // a generation that does not run here is remembered: its assignment, if
  // it arrives after the abort, is refused.
  absl::Status Abort(const v1::AbortJobRequest& request);
  // Aborts the running rank (without waiting for it) and refuses later
  // assignments (UNAVAILABLE): a worker that shuts down does this before its
  // server drains, so that no handler stays in one of the rank's collectives
  // (a TENSOR job's) until the communicator's timeout. An empty reason is
  // "the worker is shutting down".
  void Close(const std::string& reason);
  // The start of a drain, as the worker begins to shut down: refuses later
  // assignments (UNAVAILABLE, as Close does) and asks the running rank, where
  // it is a TRAIN rank of a job that drains (AssignJobRequest.drain), to
  // have every rank of its job save a checkpoint after the same step and
  // stop (RankHooks::drain; its end is reported drained, this worker
  // leaving). True where such a rank runs: wait for it (WaitIdle), then
  // Close. False otherwise, and the rank (if any) runs on. `save` false:
  // only refuses later assignments (a worker with no time to drain).
  bool Drain(const std::string& reason, bool save = true);
  // IDLE, or BUSY with the job, rank and generation and the rank's
  // collectives per group (its flight recorder's progress); last_error is
  // the error of the last rank that failed.
  v1::WorkerStatus Status() const;
  // Blocks until no rank runs or `timeout`; false on timeout.
  bool WaitIdle(absl::Duration timeout) const;
  // The tensors of the TENSOR job `job_id` running here: NOT_FOUND unless
  // it runs on this worker, UNAVAILABLE while its rank is still connecting.
  // `call`, where given, is the job's generation (and uid) the caller
  // means: ABORTED where another generation runs here (the job was placed
  // again) or none does (the rank ended), FAILED_PRECONDITION where another
  // job of that id does.
  absl::StatusOr<std::shared_ptr<TensorHost>> Tensors(const std::string& job_id,
                                                      const std::optional<CallGeneration>& call = std::nullopt) const;

 private:
  struct Active {
    Active(v1::AssignJobRequest request, ProgressReporter::Options reporting)
        : request(std::move(request)), reporter(std::move(reporting), this->request) {}
    const v1::AssignJobRequest request;
    const ProgressReporter reporter;
    // Fired by Stop: ends a download in progress and the communicators being
    // made (the rank's process group shares it).
    const std::shared_ptr<AbortSignal> abort = std::make_shared<AbortSignal>();
    std::atomic<bool> stop{false};
    std::atomic<bool> drain{false};  // Drain: this worker shuts down
    absl::Mutex mu;
    // The rendezvous store the rank's process group was made over: kept
    // here, since it must outlive the group (used by the rank's thread only).
    std::unique_ptr<Store> store;
    // The rank's process group, from its making to the rank's end (Run ends
    // it after the coordinator heard of a failure). Shared with Stop, which
    // aborts it outside every lock.
    std::shared_ptr<ProcessGroup> pg ABSL_GUARDED_BY(mu);
    // Set once the coordinator was told of the rank's end: the rank only
    // tears down, and Assign waits for that (briefly) rather than refuse
    // the rank the coordinator may place here at once.
    std::atomic<bool> end_reported{false};
    std::shared_ptr<TensorHost> tensors ABSL_GUARDED_BY(mu);  // TENSOR jobs, once connected
    std::optional<v1::ForwardResult> forward;  // FORWARD jobs' rank 0, set by the rank's thread
    // The rank's metrics while it runs (null without Options::metrics);
    // used by the rank's thread only.
    std::unique_ptr<WorkerMetrics::Rank> metrics;
    std::string stop_reason ABSL_GUARDED_BY(mu);
    // Every collective of the rank (thread-safe): its progress goes out with
    // the heartbeats, and it is dumped to the work dir when the rank fails.
    const std::shared_ptr<FlightRecorder> recorder = std::make_shared<FlightRecorder>();
  };

  void Run(std::shared_ptr<Active> active);
  absl::Status RunRank(Active& active);
  // FORWARD jobs: one pass; rank 0 writes the logits and keeps the result.
  absl::Status RunForward(Active& active, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                          const std::string& model_dir);
  // TENSOR jobs: serves the rank's tensors until the job is stopped.
  absl::Status ServeTensors(Active& active, ProcessGroup& pg);
  void Stop(Active& active, const std::string& reason);
  // Writes the rank's flight recorder to WORK_DIR/flight-recorder/
  // JOB-gen-G-rank-R.json (kept after the rank's own dir is removed).
  void DumpFlightRecorder(const Active& active);
  // WORK_DIR/JOB-gen-G-rank-R: the rank's scratch directory (its model's
  // config.json and links under model/), removed when it ends.
  std::string RankDir(const v1::AssignJobRequest& req) const;
  // A generation of a job (by id and uid) that ran here, or was aborted
  // here before its assignment arrived.
  struct Gone {
    std::string job_id, uid;
    int64_t generation = 0;
    bool ran = false;
  };
  // Why `req` is of a generation of its job (by job id and uid) that no
  // longer runs here: older than one this worker runs, or at or below one
  // that ran here or that it was told to abort (gone_); nullopt where it is
  // not, or has no uid. (The same assignment as the running rank's or the
  // last ended one's is a duplicate delivery, checked before.)
  std::optional<std::string> LaterGenerationLocked(const v1::AssignJobRequest& req) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `gone` to gone_ (the newest kMaxGoneKept), where it has a uid.
  void RememberGoneLocked(Gone gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Options::min_free_work_dir_bytes' check (RESOURCE_EXHAUSTED). Short
  // of room while no rank runs, it prunes the upload cache first, but
  // `keep_upload` (the assignment's own).
  absl::Status CheckWorkDirRoom(const std::string& keep_upload) ABSL_LOCKS_EXCLUDED(mu_);
  // The dumps WORK_DIR/flight-recorder keeps, the newest (about 0.5 MB each).
  static constexpr size_t kMaxFlightRecorderDumps = 256;

  const Options options_;
  ModelCache models_;  // used by the rank's thread only, but PruneIfIdle (CheckWorkDirRoom)
  mutable absl::Mutex mu_;
  std::shared_ptr<Active> active_ ABSL_GUARDED_BY(mu_);
  std::string closed_ ABSL_GUARDED_BY(mu_);  // Close's reason; empty while open
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  absl::Status device_lost_ ABSL_GUARDED_BY(mu_);  // OK while the device is usable
  // The last rank that ended here (job, uid, generation, rank): never
  // started again by a repeat of its assignment.
  std::optional<std::tuple<std::string, std::string, int64_t, int>> last_ended_ ABSL_GUARDED_BY(mu_);
  absl::StatusCode last_ended_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;  // its end's
  // The generations that ended here and the aborts of ones that did not
  // run here, the newest kMaxGoneKept: their assignments, arriving after
  // them, are refused.
  std::deque<Gone> gone_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kMaxGoneKept = 64;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_JOB_RUNNER_H_
