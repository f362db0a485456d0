// The coordinator daemon as a handle: started with Start(), stopped with
// Shutdown() or destruction. The binary (main.cc) and the tests use it alike.
#ifndef COLOD_SERVER_COORDINATOR_H_
#define COLOD_SERVER_COORDINATOR_H_

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/clock.h"
#include "common/grpc_server.h"
#include "common/metrics.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "server/coordinator_service.h"
#include "server/disk_reserve.h"
#include "server/job_manager.h"
#include "server/key_proof_gate.h"
#include "common/rendezvous_store.h"
#include "server/scheduler.h"
#include "server/stall_watchdog.h"
#include "server/tensor_proxy.h"
#include "server/worker_registry.h"

namespace colod {

// Serves Prometheus /metrics (base units; the gauges are refreshed every
// second by the sweeper):
//   colod_build_info{component,version,cuda}      gauge, 1
//   colod_workers{state}                          gauge, registered workers: idle, busy, lost
//   colod_jobs{state}                             gauge, known jobs: pending, scheduled, running,
//                                                 succeeded, failed, cancelled
//   colod_jobs_finished_total{state}              counter, jobs that ended since this start:
//                                                 succeeded, failed, cancelled (each from 0;
//                                                 jobs failed by a restart count as failed)
//   colod_collective_hangs_total                  counter, hang reports (collectives that ranks
//                                                 waited in past --hang-threshold) since this start
//   colod_worker_heartbeat_age_seconds{worker}    gauge, per registered (or lost, until
//                                                 forgotten) worker id
//   colod_rpc_duration_seconds{method,code}       histogram (server/rpc_metrics.h)
//
// Thread-safe. Shutdown() may be called from any thread, more than once.
class Coordinator {
 public:
  struct Options {
    // gRPC address; port 0 picks a free port.
    std::string listen = "127.0.0.1:0";
    // Prometheus /metrics address; port 0 picks a free port.
    std::string metrics_listen = "127.0.0.1:0";
    // State directory; created if missing and locked against a second
    // coordinator. Required.
    std::string data_dir;
    absl::Duration heartbeat_interval = absl::Seconds(2);
    absl::Duration lease_duration = absl::Seconds(10);
    // WorkerRegistry::Options::max_workers.
    int max_workers = WorkerRegistry::kDefaultMaxWorkers;
    Clock* clock = Clock::Real();
    // The bounds of the checks of keyed registrations at their addresses
    // (KeyProofGate; its clock is `clock`).
    KeyProofGate::Options key_proofs;
    // Bearer token every client's call must carry (CoordinatorService's
    // client calls, TensorService); empty: none.
    AuthToken auth_token;
    // Bearer token of the workers: their calls (registration, heartbeats,
    // progress, the store, downloads) must carry it, and the coordinator's
    // calls to them carry it. Empty: `auth_token` plays both roles. Needs
    // an `auth_token`, and no token of it (INVALID_ARGUMENT at Start; a
    // token that comes to be in both later admits no call, TokenAuth).
    AuthToken worker_token;
    // TLS (mutual with tls.ca) on the gRPC port, and for the calls to the
    // workers; empty: plaintext.
    TlsFiles tls;
    // How often the scheduler looks at the queue and at running jobs.
    absl::Duration schedule_period = absl::Milliseconds(200);
    // Scheduler::Options::hang_threshold.
    absl::Duration hang_threshold = absl::Seconds(30);
    // Scheduler::Options::stop_grace.
    absl::Duration stop_grace = absl::Minutes(2);
    // Scheduler::Options::rpc_timeout: the deadline of the coordinator's
    // AssignJob calls to the workers (and, up to 3 s, AbortJob's); > 0.
    absl::Duration worker_rpc_timeout = absl::Seconds(10);
    // Ended jobs older than this are deleted (JobManager::Expire), checked
    // about once a minute; zero keeps them all.
    absl::Duration job_retention = absl::Hours(7 * 24);
    // And past this many ended jobs the oldest ended are deleted too, in
    // the same sweep; zero keeps however many.
    int64_t max_ended_jobs = JobManager::kDefaultMaxEndedJobs;
    // Jobs not ended at once (JobManager::SetMaxActiveJobs); >= 1.
    int64_t max_active_jobs = JobManager::kDefaultMaxActiveJobs;
    // WatchJob streams at once (each holds a server thread); more are
    // RESOURCE_EXHAUSTED.
    int max_watch_streams = 256;
    // The rendezvous store's limits (RendezvousStoreLimits): waits blocked
    // at once (more than the largest job's ranks), and bytes held.
    int max_store_waits = 8192;
    int64_t store_quota_bytes = int64_t{1} << 30;
    // Whether the store takes any scope. Off (the daemon), only a placed job
    // generation's (RendezvousStoreLimits::placed_scopes_only); on for
    // tests of the store alone, with no job.
    bool store_any_scope = false;
    // Room kept on the data dir for the job records (DiskReserve, as
    // DATA_DIR/disk-reserve), given up when a record cannot be written for
    // want of room; no new job is accepted until it is taken back. 0: none
    // (the daemon's --data-dir-reserve is 64MiB by default).
    int64_t data_dir_reserve_bytes = 0;
    // Uploads (UploadStore::Limits): bytes of all, and how many.
    int64_t upload_quota_bytes = int64_t{256} << 30;
    int max_uploads = 1000;
    // Uploads in progress at once (each a stream holding a server thread).
    int max_concurrent_uploads = 16;
    // Downloads in progress at once (DownloadModel streams; workers retry
    // on RESOURCE_EXHAUSTED).
    int max_concurrent_downloads = 64;
    // Threads the gRPC server may run calls on at once; a call past them is
    // RESOURCE_EXHAUSTED. 0: ServerThreadsFor(options), enough for every
    // bounded long call above and kServerThreadsForShortCalls more; else at
    // least 2 (one polls for calls).
    int max_server_threads = 0;
    // An UploadModel or DownloadModel stream that moves no chunk this long
    // (its client stopped sending or reading) is cancelled, freeing its
    // place and thread; zero: never.
    absl::Duration stream_stall_timeout = absl::Minutes(2);
    // An upload no job names is removed this long after it was made or last
    // named.
    absl::Duration upload_grace = absl::Hours(1);
  };

  // Threads the default --max-server-threads leaves to short calls
  // (heartbeats, job calls, the store's sets) beyond the long ones' bounds.
  static constexpr int kServerThreadsForShortCalls = 512;
  // max_server_threads, or where it is 0 the sum of the long calls' bounds
  // (store waits, watch streams, uploads, downloads, the checks of
  // registrations at their addresses: KeyProofGate::Options::max) and
  // kServerThreadsForShortCalls, at most INT_MAX.
  static int ServerThreadsFor(const Options& options);

  // INVALID_ARGUMENT for bad options, FAILED_PRECONDITION if the data dir is
  // locked by another coordinator, UNAVAILABLE if an address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(Options options);
  ~Coordinator();

  // Stops accepting calls, ends streams and waits, and releases the data dir.
  void Shutdown();

  int port() const { return grpc_.port; }
  const std::string& address() const { return grpc_.address; }
  int metrics_port() const { return metrics_->port(); }
  const std::string& metrics_address() const { return metrics_->address(); }

  WorkerRegistry& workers() { return *workers_; }
  // Transfer streams cancelled for a stall (--stream-stall-timeout) so far.
  int64_t stalled_streams() const { return stalls_->cancelled(); }
  // Transfer streams under the stall watch now (each holds its place).
  int64_t watched_streams() const { return stalls_->watched(); }
  JobManager& jobs() { return *jobs_; }

 private:
  explicit Coordinator(Options options);
  // The long calls' bounds plus kServerThreadsForShortCalls, at most INT_MAX
  // (what max_server_threads = 0 means).
  static int DerivedServerThreads(const Options& options);
  void SweepLoop();
  void UpdateGauges();

  const Options options_;
  int lock_fd_ = -1;
  // The outermost directory LockDirectory made for --data-dir (empty: it
  // was there), removed where the start fails.
  std::string made_data_dir_;
  std::unique_ptr<DiskReserve> reserve_;  // null: no reserve
  prometheus::Gauge* reserve_gauge_ = nullptr;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<WorkerRegistry> workers_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<RendezvousStore> store_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<UploadStore> uploads_;
  std::unique_ptr<StallWatchdog> stalls_;  // outlives the service's handlers
  std::unique_ptr<CoordinatorServiceImpl> service_;
  std::unique_ptr<TensorProxy> tensors_;
  prometheus::Family<prometheus::Gauge>* workers_gauge_ = nullptr;
  prometheus::Family<prometheus::Gauge>* jobs_gauge_ = nullptr;
  prometheus::Family<prometheus::Gauge>* heartbeat_age_ = nullptr;
  prometheus::Family<prometheus::Counter>* jobs_finished_ = nullptr;
  prometheus::Counter* hangs_ = nullptr;
  // The age series by worker id; touched by Start, then only by the sweeper thread.
  std::map<std::string, prometheus::Gauge*> heartbeat_ages_;
  std::unique_ptr<MetricsServer> metrics_;
  StartedGrpcServer grpc_;
  std::thread sweeper_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace colod

#endif  // COLOD_SERVER_COORDINATOR_H_
