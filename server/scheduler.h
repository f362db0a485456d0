// The job lifecycle on the workers: PENDING -> SCHEDULED (ranks placed,
// AssignJob sent) -> RUNNING (every rank loaded and training, or serving its
// tensors for a TENSOR job, which runs until cancelled) -> SUCCEEDED
// (every rank finished) / FAILED / CANCELLED (CancelJob). Workers stay
// allocated to a job until each of its ranks reported its end (or its worker
// was lost), so a worker never gets a second rank while the first still
// winds down.
//
// When a rank fails or its worker is lost, the job restarts while its
// RestartPolicy allows and the error is not the job's own
// (IsRetryableRankError): RESTARTING names the failed rank and worker, the
// other ranks are stopped, and once they all ended the job is placed again
// under a new generation (a TRAIN job from its newest checkpoint), waiting up
// to the policy's worker_wait for enough workers. Otherwise, or once its
// restarts are spent, it is FAILED listing every attempt's failure. A refused
// assignment places the job again too (a new placement, not a restart).
//
// Jobs are scheduled first come, first served: a job that does not fit the
// idle workers waits and holds the queue (no starvation of large jobs), but
// one larger than the registered workers of every device kind lets the jobs
// behind it go first. All of a job's workers are of one device kind: CUDA
// when enough CUDA workers are idle, else CPU.
#ifndef COLOD_SERVER_SCHEDULER_H_
#define COLOD_SERVER_SCHEDULER_H_

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.pb.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/auth.h"
#include "common/clock.h"
#include "common/rendezvous_store.h"
#include "grpcpp/security/credentials.h"
#include "server/job_manager.h"
#include "server/rank_supervisor.h"
#include "server/worker_client.h"
#include "server/worker_registry.h"

namespace colod {

// Thread-safe. One background thread places jobs (PlaceJob), watches for
// lost workers, and has its RankSupervisor send the aborts, probe a failed
// rank's peers, report hangs and stop ranks that workers still run for jobs
// it does not (after a coordinator restart); each placement's assignments go out
// at once on a thread of their own (WorkerClient), so a worker that does not
// answer delays neither the others nor other jobs. Report and Cancel come
// from gRPC handlers. The job changes made under mu_ are written to the
// state directory after it is released (JobManager::DeferredWrites), so a
// slow or full disk holds up the call that changed a job, not the others.
class Scheduler {
 public:
  struct Options {
    // How often queued jobs and leases are looked at (Wake() looks at once).
    absl::Duration period = absl::Milliseconds(200);
    // Deadline of AssignJob calls, and (at most 3 s of it) of AbortJob's.
    absl::Duration rpc_timeout = absl::Seconds(10);
    // Sent to the workers as the bearer token; empty: none.
    AuthToken auth_token;
    // How to reach the workers (TLS or insecure).
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    // How calls reach the workers; null: a GrpcWorkerClient with the two
    // fields above. Tests give a fake. Each call carries the key of the
    // worker it is meant for (WorkerRegistry::KeyToCall).
    std::shared_ptr<WorkerClient> worker_client;
    // Time of cool-offs, restart waits and hang ages; must outlive the
    // scheduler.
    Clock* clock = Clock::Real();
    // When a rank fails, its peers that have not ended are asked for their
    // status with this deadline before the job ends, so that the reason names
    // a worker that died or hangs (its peers' collectives fail first and
    // report only a broken connection). Zero: end at once, unprobed.
    absl::Duration probe_timeout = absl::Seconds(2);
    // A first failure that followed from a peer's (RankResult.peer_caused:
    // a save another rank could not write its part of) is probed only once
    // a rank's own failure took its place, every rank ended (a lost one
    // counts), or this passed: the job's reason is the cause, which its rank
    // reports after its own cleanup (removing a large save's directory).
    absl::Duration peer_caused_wait = absl::Seconds(30);
    // A worker that refuses an assignment (or does not answer it) gets no
    // other assignment for this long, and the job is placed again (on other
    // workers, or on the same one once this passed) under a new generation.
    // A worker that says the job cannot run (INVALID_ARGUMENT,
    // UNIMPLEMENTED) refuses for the job's reasons: after max_placements
    // such placements with none every rank took in between (nor a restart)
    // the job fails listing them; placements refused in a row wait before
    // the next (refused_in_a_row_). Other refusals (no answer,
    // busy, unauthenticated) are the cluster's and never fail the job. A job
    // whose new generation cannot be recorded (a full disk under the data
    // dir) waits as long before it is placed again, twice as long after
    // each failure in a row (up to 16 times).
    // A worker whose rank failed by its own fault (RankResult.worker_fault:
    // its disk, its device) sits out as long; the job restarts, whatever
    // the failure's code, within its max_restarts.
    absl::Duration refusal_cooloff = absl::Seconds(30);
    int max_placements = 3;
    // Ranks that wait in a collective this long are reported (FindHangs,
    // from the workers' heartbeats): once per group and collective, as a job
    // event. Zero: never.
    absl::Duration hang_threshold = absl::Seconds(30);
    // A stopping placement (its job ended, or restarts) waits for its
    // ranks' ends; a rank that has not ended this long after its abort, its
    // worker still heartbeating, is given up on (logged, naming it): the
    // placement is released without it, so the job ends or is placed again.
    // Its worker, still busy with the rank, gets no other until it reports
    // idle; its generation's rendezvous scope is closed to it. A safety net:
    // an abort ends a healthy rank within seconds (an NCCL communicator being
    // destroyed waits at most 30 s, and not at all once the job's abort
    // reached its worker). Zero: never.
    absl::Duration stop_grace = absl::Minutes(2);
    // A rank whose end never came though its worker's heartbeats say it ran
    // the rank to its end (WorkerStatus.ended_*, set after the worker tried
    // to report it) for this long: its report was lost (a network blip
    // longer than the worker's tries, every server thread busy), and the
    // rank counts as ended as the worker says (OK: its success; else a
    // failure with its code), where the job would otherwise run for ever,
    // and its other workers with it. Zero: never.
    absl::Duration lost_report_wait = absl::Seconds(5);
  };

  // The pointed-to objects must outlive the scheduler.
  Scheduler(JobManager* jobs, WorkerRegistry* workers, RendezvousStore* store, Options options);
  // Stops the thread.
  ~Scheduler();

  void Start();
  // Stops the thread and waits for assignments in flight.
  void Stop();
  // One pass of the background thread's work (tests that drive the
  // scheduler without starting it); returns once the assignments it sent
  // were answered.
  void TickForTest();
  // Looks at the queue now (after a submit or a registration).
  void Wake();
  // A worker registered at `address` anew: the next call there connects
  // afresh (WorkerClient::Forget).
  void ForgetConnection(const std::string& address) { client_->Forget(address); }

  // A worker's report about its rank. Returns whether the rank should stop
  // (the job no longer runs). NOT_FOUND for an unknown job, ABORTED for a
  // stale generation, PERMISSION_DENIED when `worker_id` does not hold the
  // rank, INVALID_ARGUMENT for an empty report. A step of an earlier
  // generation (reported late: its worker kept it while the coordinator was
  // away) is still recorded if the history lacks it, and answered ABORTED.
  // `carries(key)`: whether the call carries that worker key (common/auth.h).
  // A report for a rank whose worker registered with a key must carry it,
  // the key it had when the rank was placed (a worker that registered again
  // since has another id and key): PERMISSION_DENIED otherwise; a late step
  // without the key of that generation's rank 0, or from a worker other
  // than its own, is not recorded, and PERMISSION_DENIED (the service logs
  // refusals, a line every 10 s at most).
  using CarriesKey = absl::FunctionRef<bool(absl::string_view key)>;
  absl::StatusOr<bool> Report(const v1::ReportProgressRequest& report, CarriesKey carries);
  // Whether a call to the rendezvous store's `scope` may be served: OK
  // unless a placement holds the scope, every worker of it registered with
  // a key, and the call carries none of theirs (PERMISSION_DENIED: the
  // workers' token is every worker's). A scope no placement holds is the
  // store's to answer (closed, or never opened).
  absl::Status CheckScopeCaller(absl::string_view scope, CarriesKey carries);
  // Whether a download of `upload_id` (DownloadModel) may be served: OK
  // where a placement whose spec's model is that upload has a rank whose
  // worker's downloads carry no key (an older worker: it cannot prove it is
  // one), or the call carries the key of one of its ranks' workers;
  // PERMISSION_DENIED otherwise, where no placement uses the upload too
  // (the workers' token is every worker's, and uploads are clients' models:
  // a worker downloads one only to run a rank of a job that uses it).
  absl::Status CheckDownloadCaller(absl::string_view upload_id, CarriesKey carries);
  // Cancels the job (JobManager::Cancel) and aborts its running ranks.
  absl::StatusOr<v1::Job> Cancel(absl::string_view job_id, absl::string_view reason);

 private:
  // Records the step of a report of a generation before `generation` (the
  // running one, or the job's + 1 while none runs). PERMISSION_DENIED where
  // it is refused for its key or worker; OK otherwise (recorded, kept
  // already, or no step to record).
  absl::Status RecordLateStep(const v1::ReportProgressRequest& report, int64_t generation, CarriesKey carries)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A job that holds workers.
  // Where one placement of a job is. Every change goes through
  // TransitionLocked, which holds the legal ones:
  //   kRunning    -> kProbing, kEnding, kRequeueing, kRestarting
  //   kProbing    -> kEnding, kRequeueing, kRestarting
  //   kRequeueing -> kEnding (cancelled while being placed again)
  //   kRestarting -> kEnding (cancelled while restarting)
  //   kEnding     -> kEnding (a cancel after the end only stops ranks)
  // Once every rank of a stopping placement ended, ReleaseLocked drops it:
  // kRequeueing puts the job back to PENDING, kRestarting places it again.
  enum class PlacementState {
    kRunning,     // ranks assigned and running
    kProbing,     // a rank failed; its peers are being probed
    kEnding,      // the job ended (succeeded, failed, cancelled): ranks stopping
    kRequeueing,  // an assignment was refused: ranks stopping, then PENDING again
    kRestarting,  // a retryable failure: ranks stopping, then placed again
  };
  struct Placed {
    std::string job_id;
    std::string uid;  // Job.uid, sent with each assignment
    int64_t generation = 0;
    v1::JobSpec spec;
    // Placed again after it wrote a checkpoint: its ranks resume from their
    // job's own newest (AssignJobRequest.resume_own_checkpoints).
    bool resume_own = false;
    // A TRAIN job with a checkpoint_dir on workers that all drain
    // (WorkerInfo.drains): AssignJobRequest.drain.
    bool drain = false;
    // Whether its ranks agree on a resume's checkpoint
    // (AssignJobRequest.agree_on_resume): every worker of it does.
    bool agree_on_resume = false;
    // The step rank 0 resumed from (from its TRAINING status, 0 where it
    // resumed from none; nullopt until that status came), and the newest
    // step this placement reported with a checkpoint: a drain that saved no
    // checkpoint past the one it resumed from is taken as a failure (so
    // that no worker requeues a job for ever uncounted).
    std::optional<int64_t> resumed_step;
    int64_t checkpointed_step = 0;
    v1::MemoryFloor memory_floor;  // the job's, sent with each assignment
    v1::MeshSpec mesh;
    // The placed devices' peak at each precision (PlacedPeakFlops): where
    // the spec names none, rank 0's TRAINING status says which one counts.
    std::map<v1::Precision, double> peak_flops;
    // Each rank's worker's key when it was placed ("" none: an older
    // worker); never null. Shared, so that the store's calls compare them
    // outside mu_ (CheckScopeCaller).
    std::shared_ptr<const std::vector<std::string>> keys = std::make_shared<const std::vector<std::string>>();
    // The keys its downloads carry, by rank: `keys`, "" for a worker whose
    // downloads carry none (WorkerInfo.downloads_carry_key false: an older
    // one). Compared outside mu_ too (CheckDownloadCaller).
    std::shared_ptr<const std::vector<std::string>> download_keys = std::make_shared<const std::vector<std::string>>();
    std::string scope;            // rendezvous scope of this generation
    std::set<int> training;       // ranks that reported "training" (TRAIN) or "serving" (TENSOR)
    std::set<int> ended;          // ranks that reported their end (or were lost)
    // Since when each rank's worker has said it ran the rank to its end
    // (WorkerStatus.ended_*), though its report has not come
    // (NoticeLostReportsLocked).
    std::map<int, absl::Time> lost_report_since;
    // (rank, phase) of the statuses the job's history recorded: each once,
    // so that a rank's reports add at most one event a phase.
    std::set<std::pair<int, int>> phases;
    PlacementState state = PlacementState::kRunning;  // changed by TransitionLocked only
    // Whether the placement is over (its ranks are being stopped): ending,
    // requeueing or restarting.
    bool stopping() const { return state != PlacementState::kRunning && state != PlacementState::kProbing; }
    // Whether every rank reported its end (or was lost).
    bool AllEnded() const { return static_cast<int>(ended.size()) == mesh.world_size(); }
    // kProbing: the first rank failure, while its peers are probed
    // (ProbeFailedJobs); the job fails or restarts once they were.
    int failed_rank = -1;
    std::string failure;
    // kRequeueing and kRestarting: why the job is placed again once every
    // started rank ended (back to PENDING with this reason after a refusal;
    // a restart stays RESTARTING).
    std::string requeue_reason;
    // The failed rank's error code (for IsRetryableRankError), and whether
    // its worker said the fault was its own (RankResult.worker_fault: the
    // job restarts whatever the code).
    absl::StatusCode failure_code = absl::StatusCode::kUnknown;
    bool failure_worker_fault = false;
    // Whether that failure followed from a peer's (RankResult.peer_caused),
    // and when it came: the peers are probed only once a rank's own failure
    // took its place, every rank ended, or Options::peer_caused_wait passed.
    bool failure_peer_caused = false;
    absl::Time failed_at = absl::InfiniteFuture();
    // When the placement began stopping (its ranks' aborts; Options::stop_grace).
    absl::Time stopped_at = absl::InfiniteFuture();
    // A drain (RankResult.drained), from the first rank that reported one:
    // the others stop on their own after saving the same step, and the job
    // is placed again once every rank ended (requeue_reason), or once
    // Options::stop_grace passed (the rest aborted). Not aborted at once:
    // an abort could end a rank in the save's last agreement, and its step
    // go unreported.
    std::string drain_reason;
    absl::Time drained_at = absl::InfiniteFuture();
  };
  void Loop();
  void Tick();
  // Places the first pending jobs that fit; sends their assignments.
  void ScheduleQueued();
  // Sends the placement's assignments (all at once) and handles refusals;
  // runs on a thread of its own (StartAssign), counted in assigning_.
  // Of the placement of `generation` only (none of a later one).
  void Assign(const std::string& job_id, int64_t generation);
  void StartAssign(const std::string& job_id, int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until no Assign thread runs.
  void WaitForAssignments() ABSL_LOCKS_EXCLUDED(mu_);
  // Fails or finishes the job: final state, aborts to the ranks still
  // running (not `except_rank`).
  void EndLocked(Placed& p, v1::JobState state, const std::string& reason, int except_rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // This attempt failed: restarts the job (RESTARTING; its ranks are
  // stopped and it is placed again once they ended) while its policy allows
  // and `retryable`, else ends it FAILED listing every attempt's failure.
  void FailLocked(Placed& p, const std::string& reason, bool retryable, int except_rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A drained placement whose ranks all ended, or whose drain outlasted
  // Options::stop_grace (the rest are aborted; `note` says so): back to
  // PENDING where it reported a checkpoint past the one it resumed from,
  // else a failure (FailLocked, retryable).
  void EndDrainLocked(Placed& p, const std::string& note) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank of a running placement ended without failing it (OK, or drained
  // with its peers): once every rank ended, the job's success, or where its
  // ranks drained, EndDrainLocked with `drain_note`. Nothing while the
  // placement probes a failure or stops.
  void EndIfAllEndedLocked(Placed& p, const std::string& drain_note) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends this placement, moving it to `next` (kEnding, kRequeueing or
  // kRestarting): aborts to the ranks still running (not `except_rank`); the
  // job's state is the caller's.
  void StopRanksLocked(Placed& p, PlacementState next, const std::string& reason, int except_rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place a placement's state changes: false (logged, nothing
  // changed) for a transition PlacementState does not list.
  bool TransitionLocked(Placed& p, PlacementState next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops placements whose every rank ended, releasing their workers (and
  // putting a job placed again back in the queue).
  void ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts as ended the ranks of stopping placements that did not end
  // within Options::stop_grace of their abort.
  // Counts as ended, as its worker says, each running placement's rank
  // whose worker's heartbeats have said for Options::lost_report_wait that
  // it ran the rank to its end, the end's report never come.
  void NoticeLostReportsLocked(const std::vector<v1::Worker>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GiveUpOnStuckRanksLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records, as job events, the hangs of running placements not reported
  // before (RankSupervisor::NewHangs over `workers`' last heartbeats).
  void ReportHangsLocked(const std::vector<v1::Worker>& workers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For each job with a rank failure: probes its ranks that have not ended
  // (RankSupervisor::ProbePeers), then fails it with the verdict (restarting
  // it where the policy allows). No lock is held while probing.
  void ProbeFailedJobs() ABSL_LOCKS_EXCLUDED(mu_);

  JobManager* const jobs_;
  WorkerRegistry* const workers_;
  RendezvousStore* const store_;
  const Options options_;
  Clock* const clock_;
  const std::shared_ptr<WorkerClient> client_;
  // Aborts, probes and hang reports (its lock is a leaf: taken under mu_).
  RankSupervisor supervisor_;

  // mu_ held over a section that changes jobs: the changes' record writes
  // (JobManager::DeferredWrites) run once mu_ is released, before the scope
  // ends. Every locked section that changes a job takes this, not a bare
  // MutexLock, so none writes a record (and fsyncs) under mu_.
  class ABSL_SCOPED_LOCKABLE JobsLock {
   public:
    explicit JobsLock(Scheduler* s) ABSL_EXCLUSIVE_LOCK_FUNCTION(s->mu_) : writes_(*s->jobs_), lock_(&s->mu_) {}
    ~JobsLock() ABSL_UNLOCK_FUNCTION() {}  // lock_ is released first, then writes_ writes

   private:
    JobManager::DeferredWrites writes_;  // declared first: destroyed last
    absl::MutexLock lock_;
  };

  absl::Mutex mu_;
  std::map<std::string, Placed> placed_ ABSL_GUARDED_BY(mu_);
  // Workers that refused an assignment: no other until then.
  std::map<std::string, absl::Time> refused_until_ ABSL_GUARDED_BY(mu_);
  // Jobs whose new generation could not be recorded (JobManager::Schedule's
  // UNAVAILABLE): not placed again until `until`, refusal_cooloff doubled
  // at each failure in a row up to 16 times it; kept while the job waits.
  struct Unrecorded {
    absl::Time until;
    int failures = 0;
  };
  std::map<std::string, Unrecorded> unrecorded_ ABSL_GUARDED_BY(mu_);
  // Per job not ended, the key of rank 0's worker of each of its last
  // kKeptRank0Keys generations that ended (placements released): a late
  // step of one must carry it. Lost with the coordinator (then a late step
  // is checked against the worker id its record keeps, as before keys).
  static constexpr size_t kKeptRank0Keys = 16;
  std::map<std::string, std::map<int64_t, std::string>> rank0_keys_ ABSL_GUARDED_BY(mu_);
  // RESTARTING jobs whose ranks all ended: since when each waits for workers.
  std::map<std::string, absl::Time> restart_since_ ABSL_GUARDED_BY(mu_);
  // Per job placed again after refusals: the refusals so far.
  std::map<std::string, std::vector<std::string>> refusals_ ABSL_GUARDED_BY(mu_);
  // Per job whose placements were refused in a row (either kind): not
  // placed again until `until` (its reason says when), keeping its place in
  // the queue meanwhile: at once after the first, then 1 s, doubled at each
  // up to refusal_cooloff (a cluster whose workers all refuse, a full disk
  // each, placed and refused a job twice a second, two events each, for as
  // long as it lasted). Dropped once every rank took a placement, or the job
  // restarts or ends.
  struct Refused {
    absl::Time until;
    int count = 0;
  };
  std::map<std::string, Refused> refused_in_a_row_ ABSL_GUARDED_BY(mu_);
  // Per job: the workers whose own fault (RankResult.worker_fault) failed a
  // rank of it, over its restarts.
  std::map<std::string, std::set<std::string>> faulted_workers_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int assigning_ ABSL_GUARDED_BY(mu_) = 0;  // Assign threads running
  std::thread thread_;
  // Why each waiting job waits, as its history last recorded it, and when;
  // the scheduler thread's alone.
  struct Waiting {
    std::string why;
    absl::Time recorded = absl::InfinitePast();
  };
  std::map<std::string, Waiting> waiting_;
};

}  // namespace colod

#endif  // COLOD_SERVER_SCHEDULER_H_
