// The worker daemon as a handle: serves WorkerService, registers with the
// coordinator and keeps its lease alive with heartbeats.
#ifndef COLOD_WORKER_DAEMON_WORKER_DAEMON_H_
#define COLOD_WORKER_DAEMON_WORKER_DAEMON_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "common/auth.h"
#include "common/exit_codes.h"
#include "common/grpc_server.h"
#include "common/metrics.h"
#include "worker/daemon/job_runner.h"
#include "worker/daemon/worker_metrics.h"
#include "worker/daemon/tensor_service.h"
#include "worker/daemon/worker_service.h"

namespace colod {

// Thread-safe. Shutdown() may be called from any thread, more than once.
class WorkerDaemon {
 public:
  struct Options {
    // WorkerService address; port 0 picks a free port.
    std::string listen = "127.0.0.1:0";
    std::string metrics_listen = "127.0.0.1:0";
    // Coordinator HOST:PORT; empty runs standalone (no registration).
    std::string coordinator;
    // Host name or address the coordinator and peers use to reach this
    // worker. Empty: the --listen host, or this machine's host name when
    // --listen binds a wildcard (0.0.0.0 or ::).
    std::string advertise_host;
    // "auto" (CUDA if built with CUDA and the GPU exists, else CPU), "cpu" or "cuda".
    std::string device = "auto";
    int device_ordinal = 0;
    // Deadline of each call to the coordinator.
    absl::Duration rpc_timeout = absl::Seconds(5);
    // Registration retries back off from this up to max_backoff, each wait
    // a random half to all of the current backoff.
    absl::Duration initial_backoff = absl::Milliseconds(100);
    absl::Duration max_backoff = absl::Seconds(5);
    // Bearer token for the coordinator's calls and required on this
    // worker's WorkerService; empty: none.
    AuthToken auth_token;
    // TLS files for both this worker's port and its calls to the coordinator.
    TlsFiles tls;
    // Scratch space for job ranks. Empty: a fresh directory under $TMPDIR
    // (or /tmp), removed at shutdown.
    std::string work_dir;
    // Free-form labels registered with the worker (zone, rack, ...).
    std::map<std::string, std::string> labels;
    // Rendezvous and per-collective limit of job ranks.
    absl::Duration comm_timeout = absl::Minutes(2);
    // The memory this worker offers a rank, reported at registration: the
    // coordinator places no rank here whose model needs more at least, and
    // the rank itself refuses one (RESOURCE_EXHAUSTED) before it allocates.
    // 0: DefaultRankMemory of the GPU's memory, or of the host's (its
    // cgroup's limit in a container).
    int64_t memory_limit_bytes = 0;
    // The device's dense peak in TFLOP/s for whatever dtype its jobs train
    // in, reported at registration for the jobs' MFU (RunSummary.mfu);
    // 0: a GPU's datasheet figures (kernels::KnownCudaPeak), none for a CPU.
    double peak_tflops = 0;
    // Directories jobs may read and write (PathPolicy); empty: every path.
    std::vector<std::string> allow_paths;
    // Uploaded models downloaded here and unused this long are removed.
    absl::Duration upload_cache_ttl = absl::Hours(1);
    // JobRunner::Options::min_free_work_dir_bytes: a rank that loads a model
    // is refused while the work directory has less room. 0: unchecked.
    int64_t min_free_work_dir_bytes = 0;
    // How long an ended rank's series stay on /metrics (WorkerMetrics).
    absl::Duration metrics_linger = absl::Minutes(1);
    // Threads the gRPC server runs calls on at once (the coordinator's job
    // and tensor calls); a call past them is RESOURCE_EXHAUSTED. >= 2 (one
    // polls for calls).
    int max_server_threads = 256;
    // Called once where a rank's failure left the CUDA device broken (the
    // worker takes no rank after it; device_lost() says why). Null: the
    // process sends itself SIGTERM, so that main shuts the daemon down
    // (deregistering) and exits kExitDeviceLost for its supervisor to
    // restart it with a new CUDA context. It runs on the rank's thread,
    // which Shutdown joins: it must not call Shutdown itself.
    std::function<void(const absl::Status&)> on_device_lost;
    // Drain's limit: how long a worker that shuts down waits for its job to
    // save a checkpoint and stop (JobRunner::Drain). 0: no drain.
    absl::Duration drain_timeout = absl::Minutes(1);
  };

  // main's exit code after a lost device (common/exit_codes.h).
  static constexpr int kExitDeviceLost = colod::kExitDeviceLost;

  // INVALID_ARGUMENT for bad options (addresses, device), UNAVAILABLE if an
  // address cannot be bound. Returns once serving; registration proceeds in
  // the background, retried until it succeeds or the daemon stops.
  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Start(Options options);
  ~WorkerDaemon();

  // The first half of a shutdown, before Shutdown: where a TRAIN rank of a
  // job that drains runs here (JobRunner::Drain), waits up to
  // Options::drain_timeout for every rank of the job to save a checkpoint
  // after the same step and stop, heartbeating meanwhile, so that the
  // coordinator places the job again from that checkpoint and loses no step
  // (a worker that leaves without it restarts its job from the last
  // periodic checkpoint). No rank is assigned here from its start.
  // `interrupted`, polled every 100 ms, ends the wait early (main: a second
  // signal). Returns at once where nothing drains.
  void Drain(const std::function<bool()>& interrupted = nullptr);
  void Shutdown();

  int port() const { return grpc_.port; }
  const std::string& address() const { return grpc_.address; }
  const std::string& metrics_address() const { return metrics_->address(); }
  // The id the coordinator assigned; empty until registered.
  std::string worker_id() const;
  // Blocks until registered and the WorkerService health status says SERVING,
  // or `timeout`; false on timeout.
  bool WaitRegistered(absl::Duration timeout) const;
  // Heartbeats the coordinator accepted since start.
  int64_t heartbeats_acked() const;
  // IDLE, or BUSY with the rank it runs.
  v1::WorkerStatus status() const { return Status(); }
  // OK, or why the CUDA device was found broken after a rank failed.
  absl::Status device_lost() const;

  // What a worker offers a rank of `device_bytes` (a GPU's, or the host's
  // or its cgroup's) without --memory-limit: less a tenth, at least 1 GiB
  // (half of a device under 2 GiB), for what no plan counts: the process
  // itself, the CUDA context, NCCL's, cuBLAS's and gRPC's buffers, the data
  // in flight. Placing ranks up to the whole limit got them killed for
  // memory at its edge.
  static int64_t DefaultRankMemory(int64_t device_bytes);

  // Removes the default work directories (ROOT/colod-worker.*) of this
  // user's workers that ended without removing theirs (killed): those
  // whose LOCK is unlocked and was last written over `unlocked_for` ago. A
  // live worker holds its lock; one starting has none yet, or wrote it just
  // now. How many it removed.
  static int RemoveAbandonedWorkDirs(const std::string& root, absl::Duration unlocked_for = absl::Minutes(1));

  // The heartbeat interval a registration's answer asks for, within sense:
  // 2 s where it asks none; at least 10 ms; at most a third of its lease
  // (a minute without one).
  static absl::Duration HeartbeatInterval(const v1::RegisterWorkerResponse& resp);

 private:
  explicit WorkerDaemon(Options options);
  void CoordinatorLoop();

  absl::Status RegisterOnce();
  absl::Status HeartbeatOnce();
  // Tells the coordinator this worker (id) leaves; Shutdown's last word.
  absl::Status DeregisterOnce(const std::string& id);
  v1::WorkerInfo Info() const;
  // Removes the work directory this worker made and lets go of its lock.
  void ReleaseWorkDir();
  v1::WorkerStatus Status() const;

  const Options options_;
  v1::WorkerInfo info_;  // fixed after Start (worker_id excepted, kept in worker_id_)
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<WorkerMetrics> job_metrics_;
  std::unique_ptr<JobRunner> runner_;  // null when standalone
  std::string work_dir_;
  bool own_work_dir_ = false;   // made by mkdtemp: removed at shutdown
  // The outermost directory of --work-dir that did not exist (its parents
  // too, where they did not): removed only if the start fails.
  std::string made_work_dir_;
  int work_dir_lock_ = -1;  // LockDirectory's flock on WORK_DIR/LOCK
  // This process's key: registered with the coordinator, carried by the
  // calls naming this worker, and required of the calls to it once the
  // coordinator took it.
  const std::shared_ptr<WorkerKey> key_ = std::make_shared<WorkerKey>();
  std::unique_ptr<WorkerServiceImpl> service_;
  std::unique_ptr<WorkerTensorService> tensor_service_;
  std::unique_ptr<MetricsServer> metrics_;
  StartedGrpcServer grpc_;
  std::shared_ptr<v1::CoordinatorService::Stub> coordinator_;
  std::thread loop_;

  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  int64_t heartbeats_acked_ ABSL_GUARDED_BY(mu_) = 0;
  // Set while the health status says SERVING: registered (cleared when the
  // coordinator forgets this worker, until it registers again).
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // The runner's on_device_lost reason, kept here because Shutdown frees the
  // runner (whose own copy refuses ranks) before main reads it for the exit code.
  absl::Status device_lost_ ABSL_GUARDED_BY(mu_);
  // Drain or Shutdown began: a lost device no longer signals main.
  bool leaving_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_WORKER_DAEMON_H_
