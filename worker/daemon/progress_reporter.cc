#include "worker/daemon/progress_reporter.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "common/text.h"
#include "worker/train/job_options.h"

namespace colod {

ProgressReporter::ProgressReporter(Options options, const v1::AssignJobRequest& assignment)
    : options_(std::move(options)),
      job_id_(assignment.job_id()),
      generation_(assignment.generation()),
      rank_(assignment.rank()),
      placed_on_(assignment.rank() >= 0 && assignment.rank() < assignment.mesh().ranks_size()
                     ? assignment.mesh().ranks(assignment.rank()).worker_id()
                     : "") {
  absl::MutexLock lock(&join_mu_);
  sender_ = std::thread([this] { SendLoop(); });
}

ProgressReporter::~ProgressReporter() { StopSender(); }

void ProgressReporter::StopSender() const {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  absl::MutexLock lock(&join_mu_);
  if (sender_.joinable()) sender_.join();
}

void ProgressReporter::SendLoop() const {
  absl::Duration backoff = kRetryFirst;
  absl::Time retry_at = absl::InfinitePast();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      // Woken by a queued step or closing_; after a failure, not before
      // retry_at (closing_ ends the wait at once).
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return closing_ || (!undelivered_.empty() && absl::Now() >= retry_at);
      };
      while (!ready()) {
        const absl::Duration wait = retry_at > absl::Now() ? retry_at - absl::Now() : absl::Hours(1);
        mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
      }
      if (closing_) return;
    }
    bool down = false;
    Flush(&down, /*wait=*/false, /*until_closing=*/true, absl::InfiniteFuture());
    absl::MutexLock lock(&mu_);
    if (down) {
      retry_at = absl::Now() + backoff;
      backoff = std::min(kRetryMost, backoff * 2);
    } else {
      retry_at = absl::InfinitePast();
      backoff = kRetryFirst;
    }
  }
}

bool ProgressReporter::Phase(v1::RankPhase phase, const std::string& message, int64_t resumed_step,
                             const std::string& resumed_from, v1::Precision precision) const {
  v1::ReportProgressRequest r;
  r.mutable_status()->set_phase(phase);
  r.mutable_status()->set_message(Utf8Prefix(message, kMaxReportedMessageBytes));
  r.mutable_status()->set_resumed_step(resumed_step);
  r.mutable_status()->set_resumed_from(Utf8Prefix(resumed_from, kMaxReportedMessageBytes));
  r.mutable_status()->set_precision(precision);
  absl::StatusOr<Answer> answer = Send(std::move(r));
  if (answer.ok() && !answer->denied.empty()) {
    absl::MutexLock lock(&mu_);
    DeniedLocked(answer->denied);
  }
  return answer.ok() && answer->stop;
}

bool ProgressReporter::Step(v1::StepProgress step) const {
  v1::ReportProgressRequest r;
  *r.mutable_step() = std::move(step);
  absl::MutexLock lock(&mu_);
  undelivered_.push_back(std::move(r));
  if (undelivered_.size() > kMaxUndelivered) {
    COLOD_LOG(WARNING) << "job " << job_id_ << ": the coordinator has been away for " << kMaxUndelivered
                       << " steps; dropping step " << undelivered_.front().step().step() << "'s report";
    undelivered_.pop_front();
  }
  return stop_;
}

void ProgressReporter::RequeueRecentLocked() const {
  while (!recent_.empty()) {
    undelivered_.push_front(std::move(recent_.back()));
    recent_.pop_back();
  }
  // Over the bound the oldest go: resends of delivered steps first.
  while (undelivered_.size() > kMaxUndelivered) undelivered_.pop_front();
}

void ProgressReporter::Flush(bool* down, bool wait, bool until_closing, absl::Time deadline) const {
  for (;;) {
    v1::ReportProgressRequest next;
    {
      absl::MutexLock lock(&mu_);
      if (undelivered_.empty() || (until_closing && closing_)) return;
    }
    if (absl::Now() > deadline) {
      *down = true;
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      next = undelivered_.front();
    }
    const int64_t step = next.step().step();
    absl::StatusOr<Answer> sent = Send(next, wait);
    absl::MutexLock lock(&mu_);
    if (!sent.ok() && sent.status().code() == absl::StatusCode::kUnavailable) {
      *down = true;  // kept for the next report
      // The coordinator is away, and may have died: the steps it took last
      // may not have reached its disk (it writes a job's record at most once
      // a second). They are sent again with the rest; it keeps each step once.
      RequeueRecentLocked();
      return;
    }
    if (!undelivered_.empty() && undelivered_.front().step().step() == step) undelivered_.pop_front();
    if (sent.ok() && sent->refused && !resent_on_refusal_) {
      // The first refusal may come from a coordinator that restarted (it
      // records the step late and answers that the job no longer runs,
      // without an incarnation): the steps the one before took last may not
      // have reached its disk. Sent again, once; it keeps each step once.
      resent_on_refusal_ = true;
      RequeueRecentLocked();
    }
    if (sent.ok() && !sent->incarnation.empty()) {
      if (!incarnation_.empty() && sent->incarnation != incarnation_) {
        // Another coordinator process than the last answer's: the one
        // before may have died before writing the steps it took last.
        COLOD_LOG(INFO) << "job " << job_id_ << ": the coordinator restarted; sending its last " << recent_.size()
                        << " steps again";
        RequeueRecentLocked();
      }
      incarnation_ = sent->incarnation;
    }
    recent_.push_back(std::move(next));
    if (recent_.size() > kResent) recent_.pop_front();
    ++delivered_;
    // Answered: recorded, or refused for good (a stale or unknown job, which
    // records a late step all the same; or an error, logged by Send). A
    // "stop" reaches the training thread's next Step at once.
    if (sent.ok() && sent->stop) stop_ = true;
    if (sent.ok() && !sent->denied.empty()) {
      DeniedLocked(sent->denied);
      return;
    }
  }
}

void ProgressReporter::DeniedLocked(const std::string& why) const {
  stop_ = true;
  if (stop_reason_.empty()) {  // said once
    stop_reason_ = absl::StrCat("the coordinator takes no report of this rank (", why, ")");
    COLOD_LOG(WARNING) << "job " << job_id_ << " rank " << rank_ << ": " << stop_reason_ << "; the rank stops, and "
                       << "its " << undelivered_.size() << " steps not sent are dropped";
  }
  undelivered_.clear();
}

std::string ProgressReporter::StopReason() const {
  absl::MutexLock lock(&mu_);
  return stop_reason_;
}

size_t ProgressReporter::undelivered() const {
  absl::MutexLock lock(&mu_);
  return undelivered_.size();
}

int64_t ProgressReporter::delivered() const {
  absl::MutexLock lock(&mu_);
  return delivered_;
}

void ProgressReporter::End(const absl::Status& status, const std::optional<v1::ForwardResult>& forward,
                           bool worker_leaving) const {
  // The sending thread stops (within one report's attempts, if it is sending);
  // then the rank's last chance to deliver what it kept: each waits for
  // the channel to the coordinator (which may be reconnecting after an
  // outage) up to the RPC timeout, rather than failing at once.
  StopSender();
  bool down = false;
  Flush(&down, /*wait=*/true, /*until_closing=*/false, absl::Now() + 2 * options_.rpc_timeout);
  if (down) {
    COLOD_LOG(WARNING) << "job " << job_id_ << ": " << undelivered() << " steps' reports could not be delivered";
  }
  v1::ReportProgressRequest r;
  r.mutable_result()->set_code(static_cast<int>(status.code()));
  // An error may quote a file's bytes: sent valid UTF-8 (or the report
  // would not parse, and the coordinator would never hear of the end) and
  // bounded.
  r.mutable_result()->set_message(Utf8Prefix(status.message(), kMaxReportedMessageBytes));
  r.mutable_result()->set_worker_fault(IsWorkerFault(status));
  r.mutable_result()->set_peer_caused(IsPeerCaused(status));
  if (IsDrained(status)) {
    r.mutable_result()->set_drained(true);
    r.mutable_result()->set_worker_leaving(worker_leaving);
  }
  if (status.ok() && forward.has_value()) *r.mutable_result()->mutable_forward() = *forward;
  (void)Send(std::move(r));
}

absl::StatusOr<ProgressReporter::Answer> ProgressReporter::Send(v1::ReportProgressRequest req, bool wait) const {
  req.set_job_id(job_id_);
  req.set_generation(generation_);
  req.set_rank(rank_);
  // The id the rank was placed on, not the worker's id now: one that
  // registers again (a coordinator that restarted forgot it) is briefly
  // without an id, then has another, and a report under either would be
  // refused and its step lost. The worker's own id only where the mesh
  // names none (read now, not when the rank started).
  req.set_worker_id(!placed_on_.empty() ? placed_on_ : options_.worker_id ? options_.worker_id() : "");
  const bool final = req.has_result();
  absl::Status last;
  const int attempts = wait ? 1 : final ? 5 : 2;  // a wait is one attempt of the whole timeout
  for (int attempt = 0; attempt < attempts; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AddAuthToken(ctx, options_.auth_token);
    AddWorkerKey(ctx, options_.worker_key);
    ctx.set_wait_for_ready(wait);
    v1::ReportProgressResponse resp;
    const grpc::Status s = options_.coordinator->ReportProgress(&ctx, req, &resp);
    if (s.ok()) return Answer{resp.stop(), resp.coordinator_incarnation()};
    // The job is gone or moved on: nothing to tell, and nothing to run for.
    if (s.error_code() == grpc::StatusCode::ABORTED || s.error_code() == grpc::StatusCode::NOT_FOUND) {
      return Answer{true, "", /*refused=*/true};
    }
    // A rank the coordinator no longer gives this worker, or a token it does
    // not take from workers (the clients' where it has --worker-token-file,
    // or another): no report of the rank will be heard, and a rank that
    // trained on unheard could meet the job placed again elsewhere.
    if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
        s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return Answer{true, "", /*refused=*/true, FromGrpcStatus(s).ToString()};
    }
    last = FromGrpcStatus(s);
    COLOD_LOG(WARNING) << "job " << job_id_ << ": progress report failed: " << last;
    // A coordinator at its --max-server-threads refuses for want of room
    // now: not heard, as one away is (before, the report was dropped, and a
    // final one's result lost).
    const bool busy = IsBusyRefusal(s, ctx);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
        !busy) {
      return last;  // refused, not lost: trying it again would not help
    }
    absl::SleepFor(
        std::min(std::max(absl::Milliseconds(200) * (attempt + 1), RetryAfter(ctx).value_or(absl::ZeroDuration())),
                 absl::Seconds(2)));
  }
  // Not delivered (the coordinator is away or did not answer in time):
  // UNAVAILABLE, so that a step is kept.
  return absl::UnavailableError(absl::StrCat("progress report not delivered: ", last.message()));
}

}  // namespace colod
