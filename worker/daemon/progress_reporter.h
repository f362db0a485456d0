// What one rank tells the coordinator through ReportProgress: its phases,
// rank 0's steps, and its end. Each answer says whether the job still runs,
// which is how a rank learns that it should stop when an abort missed it.
#ifndef COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_
#define COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/worker.pb.h"
#include "common/auth.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

namespace colod {

// Steps are sent by a thread of the reporter's own, in order, so that the
// training thread never waits on the coordinator: a coordinator that is
// away (or SIGSTOPped, which answers nothing until the RPC timeout) costs
// a step nothing. Steps that cannot be delivered are kept, the newest
// kMaxUndelivered of them, and retried with backoff (kRetryFirst doubling
// to kRetryMost); once one gets through they go first, in order, after
// the last kResent delivered ones again (a coordinator that died may not
// have written them; also when an answer's coordinator_incarnation shows a
// coordinator restarted between two reports): the coordinator records each
// step once, a late one even after the job moved on to a new generation.
// End sends what is kept, waiting for the channel, before the rank's
// result.
//
// Thread-safe: the undelivered steps are guarded by a mutex that is never
// held across an RPC.
class ProgressReporter {
 public:
  struct Options {
    // The coordinator; required.
    std::shared_ptr<v1::CoordinatorService::StubInterface> coordinator;
    AuthToken auth_token;
    // Of each attempt.
    absl::Duration rpc_timeout = absl::Seconds(10);
    // This worker's id, for an assignment whose mesh does not name the
    // worker of its rank (which is the id every report carries: the one
    // the coordinator placed the rank on, also while this worker registers
    // again under a new id); may be empty.
    std::function<std::string()> worker_id;
    // This worker's key (WorkerKey), which the coordinator checks on a
    // report naming it; "" none.
    std::string worker_key;
  };

  // Reports for the rank `assignment` describes (job, generation, rank).
  ProgressReporter(Options options, const v1::AssignJobRequest& assignment);
  // Stops the sending thread (within one report's attempts: two RPC
  // timeouts); what it had not delivered is dropped: End delivers it.
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  static constexpr size_t kMaxUndelivered = 4096;
  // Delivered steps sent again after an outage (the coordinator may have
  // lost the last second of them): the newest this many.
  static constexpr size_t kResent = 256;
  static constexpr absl::Duration kRetryFirst = absl::Milliseconds(200);
  static constexpr absl::Duration kRetryMost = absl::Seconds(5);

  // Phase returns true when the coordinator says the job no longer runs (or
  // that this rank is not one of it): the rank should stop. Best effort:
  // a report that fails twice (five times for the end) is given up, logged.
  bool Phase(v1::RankPhase phase, const std::string& message = "", int64_t resumed_step = 0,
             const std::string& resumed_from = "", v1::Precision precision = v1::PRECISION_UNSPECIFIED) const;
  // Queues the step for the sending thread and returns at once: true when
  // an answer to an earlier report said stop (as soon as it came).
  bool Step(const train::StepStats& step) const { return Step(train::StepProgressOf(step)); }
  bool Step(v1::StepProgress step) const;
  // The rank's end: what is kept (for at most two RPC timeouts, each
  // report waiting for the channel), then its status and, for rank 0 of a
  // FORWARD job, the result. `worker_leaving`: a drained rank
  // (IsDrained) whose own worker shuts down (RankResult.worker_leaving).
  void End(const absl::Status& status, const std::optional<v1::ForwardResult>& forward,
           bool worker_leaving = false) const;
  // Why an answer said stop, where the coordinator gave a reason (it took
  // no report of this rank: not its worker's, or a token of the wrong
  // role); empty otherwise.
  std::string StopReason() const;
  // Steps not delivered yet (queued, or kept through an outage).
  size_t undelivered() const;
  // Steps delivered so far (each counted once, resends too); for tests.
  int64_t delivered() const;

 private:
  // OK with whether to stop (and who answered); UNAVAILABLE when it was not delivered (the
  // coordinator unreachable or not answering in time), another error when
  // the coordinator refused it (not kept).
  // `wait`: each attempt waits for the channel to be ready (up to the RPC
  // timeout) instead of failing while it reconnects.
  struct Answer {
    bool stop = false;
    std::string incarnation;  // the coordinator's, empty from an older one
    // ABORTED, NOT_FOUND or PERMISSION_DENIED: the job no longer runs there
    // (or the coordinator restarted and does not run it): no incarnation
    // tells which.
    bool refused = false;
    // PERMISSION_DENIED or UNAUTHENTICATED, its message: the coordinator
    // takes no report from this rank (it is not the rank's worker, or the
    // worker's token is not the workers'), nor will it hear any later one.
    std::string denied;
  };
  // A denied answer: stop_ and stop_reason_ set, the queue dropped (no
  // report of this rank will be taken), said once in the log.
  void DeniedLocked(const std::string& why) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Answer> Send(v1::ReportProgressRequest report, bool wait = false) const;
  // Sends the kept steps in order until the queue is empty, one fails
  // (`*down` set; the recent ones are queued again), closing_ is set (when
  // `until_closing`) or `deadline` passes (`*down` set). An answer "stop"
  // sets stop_ at once. One caller at a time: the sending thread, or End
  // once it has stopped it.
  void Flush(bool* down, bool wait, bool until_closing, absl::Time deadline) const;
  // The delivered steps kept for a resend, back at the queue's front; the
  // queue cut to kMaxUndelivered (the oldest go).
  void RequeueRecentLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sending thread: Flush whenever steps are queued, backing off while
  // the coordinator is away, until closing_.
  void SendLoop() const;
  // Ends SendLoop and joins its thread (idempotent).
  void StopSender() const;

  mutable absl::Mutex mu_;
  mutable std::deque<v1::ReportProgressRequest> undelivered_ ABSL_GUARDED_BY(mu_);
  mutable std::deque<v1::ReportProgressRequest> recent_ ABSL_GUARDED_BY(mu_);  // delivered, newest last
  mutable bool stop_ ABSL_GUARDED_BY(mu_) = false;     // an answer said stop
  mutable std::string stop_reason_ ABSL_GUARDED_BY(mu_);  // StopReason
  mutable bool closing_ ABSL_GUARDED_BY(mu_) = false;  // SendLoop ends
  mutable int64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::string incarnation_ ABSL_GUARDED_BY(mu_);  // of the last answer to a step
  mutable bool resent_on_refusal_ ABSL_GUARDED_BY(mu_) = false;  // the recent steps went again after a refusal
  mutable absl::Mutex join_mu_;  // serializes StopSender's join
  mutable std::thread sender_ ABSL_GUARDED_BY(join_mu_);

  const Options options_;
  const std::string job_id_;
  const int64_t generation_;
  const int rank_;
  // The worker the assignment's mesh names for rank_ (the one the
  // coordinator checks a report against); empty when it names none.
  const std::string placed_on_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_
