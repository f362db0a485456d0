// An embedded colod cluster on this machine (`coloctl local`): the
// colod-coordinator and N colod-worker daemons (CPU ones, or one per CUDA
// device) as child processes on loopback. The children die with this process (PR_SET_PDEATHSIG), so a
// killed coloctl leaves no daemons behind. A worker that exits asking for a
// restart (AsksForRestart, common/exit_codes.h: its CUDA device faulted, or an
// exception escaped every handler) is started again, as Kubernetes would; one
// that exits otherwise is said on stderr and left.
//
// Thread-safe: Stop() may be called from any thread, more than once.
#ifndef COLOD_CLIENT_LOCAL_CLUSTER_H_
#define COLOD_CLIENT_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/worker.pb.h"

namespace colod {

class LocalCluster {
 public:
  // Workers one machine's cluster runs at most: each is a process with its
  // threads and its model's memory (a larger layout belongs on a cluster).
  static constexpr int kMaxWorkers = 256;
  struct Options {
    int workers = 2;  // 1 to kMaxWorkers
    // "cpu", or "cuda": worker i serves CUDA device i (one process per
    // device, as on a GPU node).
    std::string device = "cpu";
    std::string listen = "127.0.0.1:0";  // the coordinator's gRPC address
    std::string metrics_listen = "127.0.0.1:0";
    // Coordinator state and worker logs; empty: a fresh directory under
    // $TMPDIR (else /tmp), removed by Stop.
    std::string data_dir;
    // The daemon binaries; FindDaemonBinary looks next to coloctl.
    std::string coordinator_binary;
    std::string worker_binary;
    absl::Duration ready_timeout = absl::Seconds(60);
    // Restarts of one worker after it exited asking for one
    // (AsksForRestart); past them it stays down.
    int max_worker_restarts = 3;
    // Polled while Start waits for the daemons (every 10 to 20 ms): true
    // stops what was started (a temporary data dir removed) and Start
    // returns CANCELLED. A caller's Ctrl-C while a large cluster starts.
    std::function<bool()> cancelled;
    // For tests: a pause in Stop after the supervision ended and before the
    // workers are signalled (mu_ released meanwhile), so that a signal the
    // end of the supervisor's thread would send arrives on its own.
    absl::Duration stop_pause_for_test = absl::ZeroDuration();
  };

  // Starts everything and waits until every worker registered.
  // INVALID_ARGUMENT for bad options; UNAVAILABLE if an address cannot be
  // bound; DEADLINE_EXCEEDED (cluster stopped) if the workers do not register
  // in time, naming the worker logs; CANCELLED when `cancelled` said so. Each
  // worker's scratch directory (--work-dir) is DATA_DIR/worker-I.work, so
  // that nothing is left outside the data dir.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(Options options);
  ~LocalCluster();

  const std::string& address() const { return address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  const std::string& data_dir() const { return data_dir_; }
  // The coordinator's pid first, then the workers' (a restarted worker's
  // new one; -1 for one that is down).
  std::vector<pid_t> pids() const;
  // Worker restarts so far (after exits that asked for one).
  int restarts() const;
  // The registered workers, sorted by id.
  absl::StatusOr<std::vector<v1::Worker>> workers() const;

  // Ends the supervision (no worker is started again), SIGTERMs the
  // workers, reaps them, then the coordinator (SIGKILL for one still running
  // 10 s on), and removes a temporary data dir. The supervisor's thread ends
  // after the workers were reaped (Supervise). Thread-safe; once.
  void Stop();
  // Makes a Stop that runs (or comes) SIGKILL the daemons still running now,
  // not 10 s on: a worker's drain is lost. Thread-safe.
  void Hurry();
  // Stop, for a caller that took a shutdown signal (BlockShutdownSignals):
  // a further one meanwhile (a second Ctrl-C) makes it Hurry, saying so on
  // stderr.
  void StopOnSignal();

 private:
  struct Child {
    std::vector<std::string> argv;
    std::string log;
    pid_t pid = -1;  // -1: down (reaped)
    int restarts = 0;
  };
  LocalCluster() = default;
  // Every 200 ms until Stop: reaps the workers that exited and starts again
  // those that asked for it; then waits for Stop to have reaped the workers.
  void Supervise();

  std::string address_, metrics_address_;
  std::string data_dir_;
  bool temporary_ = false;
  int max_worker_restarts_ = 3;
  mutable absl::Mutex mu_;
  pid_t coordinator_pid_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<Child> workers_ ABSL_GUARDED_BY(mu_);
  int restarts_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool workers_stopped_ ABSL_GUARDED_BY(mu_) = false;  // Stop reaped the workers
  std::atomic<bool> hurry_{false};                     // Hurry
  absl::Duration stop_pause_ = absl::ZeroDuration();   // Options::stop_pause_for_test
  std::thread supervisor_;  // started by Start, joined by Stop
};

// `name` (colod-coordinator, colod-worker) next to `self` (the running
// coloctl), in the build tree's layout (../server/, ../worker/daemon/), or on
// $PATH; NOT_FOUND naming the places tried.
absl::StatusOr<std::string> FindDaemonBinary(const std::string& self, const std::string& name);

}  // namespace colod

#endif  // COLOD_CLIENT_LOCAL_CLUSTER_H_
