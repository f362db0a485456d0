#include "server/scheduler.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <optional>
#include <system_error>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "server/placement.h"
#include "spec/job_validation.h"
#include "spec/mesh.h"
#include "spec/model_config.h"
#include "spec/plan.h"

namespace colod {
namespace {

// How often a waiting job's history records a new reason at most.
constexpr absl::Duration kWaitingReasonInterval = absl::Seconds(30);


// "attempt 1: ...; attempt 2: ..." from the job's recorded failures and
// the last one.
std::string Attempts(const v1::Job& job, const std::string& last) {
  std::vector<std::string> all;
  for (const std::string& f : job.attempt_failures()) all.push_back(absl::StrCat("attempt ", all.size() + 1, ": ", f));
  all.push_back(absl::StrCat("attempt ", all.size() + 1, ": ", last));
  return absl::StrJoin(all, "; ");
}

// A step report a rank can send: paths a file system takes, at most
// kMaxReportedCheckpoints kept checkpoints and kMaxReportedCheckpointPathBytes
// of their paths (the worker trims its report to them), a trained step's
// loss finite (a diverged step fails the rank instead). INVALID_ARGUMENT
// otherwise.
absl::Status CheckStepReport(const v1::StepProgress& s) {
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"checkpoint", &s.checkpoint()},
                                     {"resumed_from", &s.resumed_from()}}) {
    if (value->size() > kMaxPathBytes) {
      return absl::InvalidArgumentError(absl::StrCat("step.", field, ": longer than ", kMaxPathBytes, " bytes"));
    }
  }
  if (static_cast<size_t>(s.checkpoints_size()) > kMaxReportedCheckpoints) {
    return absl::InvalidArgumentError(absl::StrCat("step.checkpoints: more than ", kMaxReportedCheckpoints));
  }
  size_t bytes = 0;
  for (const v1::CheckpointInfo& c : s.checkpoints()) {
    if (c.path().size() > kMaxPathBytes) {
      return absl::InvalidArgumentError(absl::StrCat("step.checkpoints.path: longer than ", kMaxPathBytes, " bytes"));
    }
    bytes += c.path().size();
  }
  if (bytes > kMaxReportedCheckpointPathBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("step.checkpoints: their paths hold more than ", kMaxReportedCheckpointPathBytes, " bytes"));
  }
  if (IsTrainedStep(s) && !std::isfinite(s.loss())) {
    return absl::InvalidArgumentError(absl::StrCat("step.loss: ", s.loss(), " is not finite"));
  }
  return absl::OkStatus();
}

// The placed ranks' devices' peak for the run summary's MFU (0 unknown),
// at the spec's precision (key PRECISION_UNSPECIFIED: where it names none,
// the device's default) and at each precision rank 0 may report training
// at instead (a run at auto resumed a checkpoint of another).
std::map<v1::Precision, double> PlacedPeakFlops(const v1::JobSpec& spec, const v1::MeshSpec& placed,
                                                const std::vector<v1::Worker>& live) {
  absl::flat_hash_map<absl::string_view, const v1::WorkerInfo*> by_id;
  for (const v1::Worker& w : live) by_id.emplace(w.info().worker_id(), &w.info());
  std::vector<v1::WorkerInfo> devices;
  devices.reserve(placed.ranks_size());
  for (const v1::RankAssignment& a : placed.ranks()) {
    auto w = by_id.find(a.worker_id());
    if (w == by_id.end()) return {};
    devices.push_back(*w->second);
  }
  std::map<v1::Precision, double> peaks = {{v1::PRECISION_UNSPECIFIED, PeakFlopsOf(spec, devices)}};
  for (v1::Precision p : {v1::PRECISION_FP32, v1::PRECISION_BF16_MIXED, v1::PRECISION_FP16_MIXED}) {
    peaks[p] = PeakFlopsOf(p, spec.train().allow_tf32(), devices);
  }
  return peaks;
}

}  // namespace

Scheduler::Scheduler(JobManager* jobs, WorkerRegistry* workers, RendezvousStore* store, Options options)
    : jobs_(jobs),
      workers_(workers),
      store_(store),
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      client_(options_.worker_client != nullptr
                  ? options_.worker_client
                  : std::make_shared<GrpcWorkerClient>(options_.credentials, options_.auth_token)),
      supervisor_(client_, RankSupervisor::Options{std::min(options_.rpc_timeout, absl::Seconds(3)),
                                                   options_.probe_timeout, options_.hang_threshold}) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() { thread_ = std::thread([this] { Loop(); }); }

void Scheduler::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  WaitForAssignments();
}

void Scheduler::TickForTest() {
  Tick();
  WaitForAssignments();
}

void Scheduler::WaitForAssignments() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return assigning_ == 0; };
  mu_.Await(absl::Condition(&idle));  // each is bounded by rpc_timeout
}

void Scheduler::StartAssign(const std::string& job_id, int64_t generation) {
  {
    absl::MutexLock lock(&mu_);
    ++assigning_;
  }
  const auto assign = [this, job_id, generation] {
    Assign(job_id, generation);
    absl::MutexLock lock(&mu_);
    --assigning_;
    wake_ = true;
  };
  try {
    std::thread(assign).detach();  // Stop waits for assigning_ to drop to zero
  } catch (const std::system_error& e) {
    // No thread to be had: this one assigns (every call within rpc_timeout).
    COLOD_LOG(WARNING) << "job " << job_id << ": assigning on the scheduler's thread (" << e.what() << ")";
    assign();
  }
}

void Scheduler::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void Scheduler::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&woken), options_.period);
    if (stopping_) break;
    wake_ = false;
    mu_.Unlock();
    try {
      Tick();
    } catch (const std::exception& e) {
      // A backstop (colod's code returns statuses): the coordinator and its
      // other jobs live on, and the next tick tries again.
      COLOD_LOG(ERROR) << "a scheduler tick threw: " << e.what();
    }
    mu_.Lock();
  }
}

void Scheduler::Tick() {
  ProbeFailedJobs();
  std::set<std::string> live;
  const std::vector<v1::Worker> workers = workers_->List(/*include_lost=*/false);
  for (const v1::Worker& w : workers) live.insert(w.info().worker_id());
  {
    JobsLock lock(this);
    // A worker still running a rank of a job this coordinator does not run
    // (it ended, or the coordinator restarted since) is told to stop, once
    // (again, later and later, where the call did not reach it).
    supervisor_.StopStaleRanks(workers, [this](const std::string& job_id, int64_t generation) {
      mu_.AssertHeld();
      auto it = placed_.find(job_id);
      return it != placed_.end() && it->second.generation == generation;
    }, [this](const std::string& worker_id) { return workers_->KeyToCall(worker_id); });
    for (auto& [id, p] : placed_) {
      for (const v1::RankAssignment& a : p.mesh.ranks()) {
        if (p.ended.count(a.rank()) || live.count(a.worker_id())) continue;
        p.ended.insert(a.rank());
        if (p.stopping()) continue;
        const std::string lost =
            absl::StrCat(RankName(p.mesh, a.rank()), " was lost: ", workers_->LostReason(a.worker_id()));
        if (p.state == PlacementState::kRunning && !p.drain_reason.empty()) {
          // Its peers drained, so it had saved the drain's checkpoint with
          // them (they passed the save's last agreement): its end was not
          // delivered before its worker left. The drain's own check decides.
          if (p.AllEnded()) EndDrainLocked(p, absl::StrCat("; ", lost));
          continue;
        }
        FailLocked(p, lost, /*retryable=*/true, a.rank());
      }
    }
    NoticeLostReportsLocked(workers);
    GiveUpOnStuckRanksLocked();
    ReleaseLocked();
    if (options_.hang_threshold > absl::ZeroDuration()) ReportHangsLocked(workers);
  }
  supervisor_.SendAborts();
  ScheduleQueued();
  supervisor_.SendAborts();
}

void Scheduler::ScheduleQueued() {
  std::vector<v1::Job> pending = jobs_->List({v1::JOB_STATE_PENDING, v1::JOB_STATE_RESTARTING});
  std::set<std::string> held;  // running a rank, or sitting out a refusal
  std::set<std::string> sitting_out;  // of those, sitting out a refusal or a fault of their own
  std::set<std::string> pending_ids;
  std::set<std::string> backing_off;  // placements refused in a row: not tried yet (refused_in_a_row_)
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    // A restarting job waits until its previous placement's ranks all ended.
    std::vector<v1::Job> ready;
    for (v1::Job& j : pending) {
      if (placed_.count(j.job_id())) continue;
      pending_ids.insert(j.job_id());
      auto unrecorded = unrecorded_.find(j.job_id());
      if (unrecorded != unrecorded_.end() && unrecorded->second.until > now) continue;  // it says why
      auto refused = refused_in_a_row_.find(j.job_id());
      if (refused != refused_in_a_row_.end() && refused->second.until > now) backing_off.insert(j.job_id());
      if (j.state() == v1::JOB_STATE_RESTARTING) restart_since_.try_emplace(j.job_id(), now);
      ready.push_back(std::move(j));
    }
    pending = std::move(ready);
    for (auto it = restart_since_.begin(); it != restart_since_.end();) {  // placed, or cancelled
      it = pending_ids.count(it->first) ? std::next(it) : restart_since_.erase(it);
    }
    for (auto it = unrecorded_.begin(); it != unrecorded_.end();) {  // placed, or cancelled
      it = pending_ids.count(it->first) ? std::next(it) : unrecorded_.erase(it);
    }
    // What is kept per job of jobs that ended (cancelled while queued) goes.
    // Neither pending nor placed is not enough: `pending` was listed before
    // mu_ was taken, and a report may have released the job's placement
    // since (it is RESTARTING now, and keeps them).
    std::set<std::string> ended;
    const auto forget_ended = [&](auto& per_job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (auto it = per_job.begin(); it != per_job.end();) {
        const std::string& id = it->first;
        bool gone = ended.count(id) > 0;
        if (!gone && !placed_.count(id) && !pending_ids.count(id)) {
          absl::StatusOr<v1::Job> job = jobs_->Get(id);
          gone = !job.ok() || JobManager::IsFinal(job->state());
          if (gone) ended.insert(id);
        }
        it = gone ? per_job.erase(it) : std::next(it);
      }
    };
    forget_ended(rank0_keys_);
    forget_ended(refusals_);
    forget_ended(refused_in_a_row_);
    forget_ended(faulted_workers_);
    for (const auto& [id, p] : placed_) {
      for (const v1::RankAssignment& a : p.mesh.ranks()) {
        if (!p.ended.count(a.rank())) held.insert(a.worker_id());
      }
    }
    for (auto it = refused_until_.begin(); it != refused_until_.end();) {
      if (it->second <= now) {
        it = refused_until_.erase(it);
      } else {
        held.insert(it->first);
        sitting_out.insert(it->first);
        ++it;
      }
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {  // cancelled while waiting
    it = pending_ids.count(it->first) ? std::next(it) : waiting_.erase(it);
  }
  if (pending.empty()) return;
  std::vector<v1::Worker> live = workers_->List(/*include_lost=*/false);
  std::map<std::string, const v1::WorkerInfo*> live_info;  // by worker id
  for (const v1::Worker& w : live) live_info.emplace(w.info().worker_id(), &w.info());
  std::set<std::string> taken;  // placed earlier in this pass
  // Where every worker runs masked language models (an upgraded fleet), no
  // job's config is parsed to find whether it is one (RunsAMaskedLanguageModel).
  const bool every_worker_runs_masked_lms =
      std::all_of(live.begin(), live.end(), [](const v1::Worker& w) { return w.info().trains_masked_lm(); });
  for (const v1::Job& job : pending) {
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::FromShardConfig(job.spec().shard());
    if (!mesh.ok()) {  // validated on submit; only a changed rule gets here
      (void)jobs_->SetState(job.job_id(), v1::JOB_STATE_FAILED, mesh.status().message());
      continue;
    }
    std::set<std::string> unavailable = held;
    unavailable.insert(taken.begin(), taken.end());
    absl::StatusOr<PlacementDecision> decision =
        PlaceJob(*mesh, job.memory_floor().total_bytes(), live, unavailable,
                 WorkerNeeds{.masked_lm = !every_worker_runs_masked_lms && RunsAMaskedLanguageModel(job.spec()),
                             .fp16_loss_scaling = TrainsInFp16(job.spec())});
    if (!decision.ok()) {
      waiting_.erase(job.job_id());
      (void)jobs_->SetState(job.job_id(), v1::JOB_STATE_FAILED, decision.status().message());
      continue;
    }
    if (backing_off.count(job.job_id())) {
      // Its refusals' wait (its reason says until when): not placed yet, but
      // it keeps its place, holding the queue where it would (jobs behind
      // it took the workers it waited for, for as long as they ran).
      if (decision->placed.has_value() || decision->fits_cluster) return;
      continue;
    }
    if (!decision->placed.has_value()) {
      const int world = mesh->world_size();
      std::string why = decision->waiting;
      // The registered workers that are not idle only because they sit out.
      int out = 0;
      for (const v1::Worker& w : live) out += sitting_out.count(w.info().worker_id()) ? 1 : 0;
      if (out > 0) {
        absl::StrAppend(&why, "; ", out, " of the workers not idle sit", out == 1 ? "s" : "",
                        " out a refusal or a fault of ", out == 1 ? "its" : "their", " own (",
                        absl::FormatDuration(options_.refusal_cooloff), ")");
      }
      if (job.state() == v1::JOB_STATE_RESTARTING) {
        const RestartLimits limits = RestartLimitsOf(job.spec());
        absl::Time since = now;
        {
          absl::MutexLock lock(&mu_);
          since = restart_since_[job.job_id()];
        }
        if (now - since > limits.worker_wait) {
          waiting_.erase(job.job_id());
          const std::string failed = absl::StrCat("no ", world, " workers of one device kind came free within ",
                                                  absl::FormatDuration(limits.worker_wait), " to restart it");
          COLOD_LOG(WARNING) << "job " << job.job_id() << " failed: " << failed;
          (void)jobs_->SetState(
              job.job_id(), v1::JOB_STATE_FAILED,
              absl::StrCat(failed, "; ", Attempts(job, "waited for workers")));
          continue;
        }
        why = job.restarts() > 0 ? absl::StrCat("restarting (restart ", job.restarts(), " of ", limits.max_restarts,
                                                "): ", why)
                                 : absl::StrCat("restarting: ", why);
      }
      // PENDING (or RESTARTING) says why. Each new reason is an event of the
      // job's history, and one that follows the cluster (how many workers
      // are free) changes with every job that starts or ends: recorded at
      // most every kWaitingReasonInterval, the newest then.
      Waiting& w = waiting_[job.job_id()];
      if (w.why != why && now - w.recorded >= kWaitingReasonInterval) {
        COLOD_LOG(INFO) << "job " << job.job_id() << " " << why;
        (void)jobs_->SetState(job.job_id(), job.state(), why);
        w.why = why;
        w.recorded = now;
      }
      if (decision->fits_cluster) return;  // it holds the queue
      continue;
    }
    waiting_.erase(job.job_id());
    const v1::MeshSpec& placed = *decision->placed;
    std::map<v1::Precision, double> peaks = PlacedPeakFlops(job.spec(), placed, live);
    absl::StatusOr<v1::Job> scheduled = jobs_->Schedule(job.job_id(), placed, peaks[v1::PRECISION_UNSPECIFIED]);
    if (!scheduled.ok()) {  // cancelled meanwhile, or its record cannot be written (it waits, and says why)
      if (absl::IsUnavailable(scheduled.status())) {
        COLOD_LOG(WARNING) << "job " << job.job_id() << ": " << scheduled.status().message();
        absl::MutexLock lock(&mu_);
        Unrecorded& u = unrecorded_[job.job_id()];
        u.until = now + DoubledWait(options_.refusal_cooloff, u.failures, 16 * options_.refusal_cooloff);
        ++u.failures;
        restart_since_.erase(job.job_id());  // its wait for workers counts from the next try
      }
      continue;
    }
    for (const v1::RankAssignment& a : placed.ranks()) taken.insert(a.worker_id());
    // Each rank's worker's key, read before mu_ (to keep it short), by rank:
    // every call to the rank's worker carries it, its reports and the
    // scope's calls must. A worker gone since `live` was listed gets a key
    // no process holds (KeyToCall): its assignment is refused, even by a
    // daemon restarted at its address, and the job is placed again.
    // Placement lists rank r r-th; an entry that is not (it never is)
    // gets a key no one holds too: an empty one would open the scope as an
    // older worker's.
    auto keys = std::make_shared<std::vector<std::string>>();
    auto download_keys = std::make_shared<std::vector<std::string>>();
    // Drained where it saves checkpoints and every rank's worker takes part
    // (an older worker would not join the agreement's collective).
    bool drain = job.spec().kind() == v1::JOB_KIND_TRAIN && !job.spec().train().checkpoint_dir().empty() &&
                 !job.spec().train().eval_only();
    // Likewise the agreement on a resume's checkpoint.
    bool agree_on_resume = true;
    for (int r = 0; r < placed.ranks_size(); ++r) {
      const v1::RankAssignment& a = placed.ranks(r);
      keys->push_back(a.rank() == r ? workers_->KeyToCall(a.worker_id()) : NewWorkerKey());
      const auto info = live_info.find(a.worker_id());
      const bool keyless_downloads = info != live_info.end() && !info->second->downloads_carry_key();
      download_keys->push_back(keyless_downloads ? "" : keys->back());
      drain &= info != live_info.end() && info->second->drains();
      agree_on_resume &= info != live_info.end() && info->second->agrees_on_resume();
    }
    {
      absl::MutexLock lock(&mu_);
      restart_since_.erase(job.job_id());
      unrecorded_.erase(job.job_id());
      // Cancel takes mu_: one that came between Schedule and here found no
      // placement to stop, so none may begin now (its ranks could never be
      // stopped). One after this finds the placement and aborts it.
      absl::StatusOr<v1::Job> still = jobs_->Get(job.job_id());
      if (!still.ok() || still->state() != v1::JOB_STATE_SCHEDULED || still->generation() != scheduled->generation()) {
        COLOD_LOG(INFO) << "job " << job.job_id() << " ended while it was being placed ("
                        << (still.ok() ? JobStateName(still->state()) : still.status().ToString())
                        << "); no rank is assigned";
        continue;
      }
      Placed& p = placed_[job.job_id()];
      p.job_id = job.job_id();
      p.uid = scheduled->uid();
      p.generation = scheduled->generation();
      p.spec = scheduled->spec();
      p.memory_floor = scheduled->memory_floor();
      // Placed again after it wrote a checkpoint: every rank resumes from the
      // newest complete one of this job's in its checkpoint directory (a
      // later step of another job's there is passed over).
      p.resume_own = ResumesFromCheckpoint(*scheduled);
      if (p.resume_own) p.spec.mutable_train()->set_resume_from(p.spec.train().checkpoint_dir());
      p.drain = drain;
      p.agree_on_resume = agree_on_resume;
      p.mesh = placed;
      p.peak_flops = std::move(peaks);
      p.keys = std::move(keys);
      p.download_keys = std::move(download_keys);
      p.scope = absl::StrFormat("%s/gen-%d", job.job_id(), p.generation);
      store_->OpenScope(p.scope);  // before any rank is assigned; ReleaseLocked deletes it
    }
    COLOD_LOG(INFO) << "job " << job.job_id() << ": " << placed.world_size() << " ranks placed";
    StartAssign(job.job_id(), scheduled->generation());
  }
}

void Scheduler::Assign(const std::string& job_id, int64_t generation) {
  std::vector<WorkerClient::Call<v1::AssignJobRequest>> calls;
  {
    JobsLock lock(this);
    auto it = placed_.find(job_id);
    if (it == placed_.end() || it->second.generation != generation) return;
    if (it->second.stopping()) {
      // Stopped (cancelled, a worker lost) before its assignments went out:
      // no rank started, so none will report an end (their aborts are
      // answered NOT_FOUND). Each ends here, or the placement would hold
      // its workers until stop_grace, and for good without one.
      for (const v1::RankAssignment& a : it->second.mesh.ranks()) it->second.ended.insert(a.rank());
      ReleaseLocked();
      return;
    }
    v1::AssignJobRequest req;
    req.set_job_id(job_id);
    req.set_generation(it->second.generation);
    req.set_job_uid(it->second.uid);
    req.set_resume_own_checkpoints(it->second.resume_own);
    req.set_drain(it->second.drain);
    req.set_agree_on_resume(it->second.agree_on_resume);
    *req.mutable_spec() = it->second.spec;
    *req.mutable_mesh() = it->second.mesh;
    req.set_rendezvous_scope(it->second.scope);
    if (it->second.memory_floor.total_bytes() > 0) *req.mutable_memory_floor() = it->second.memory_floor;
    const std::vector<std::string>& keys = *it->second.keys;
    for (const v1::RankAssignment& a : it->second.mesh.ranks()) {
      req.set_rank(a.rank());
      calls.push_back({a.worker_address(), RankKey(keys, a.rank()), req});
    }
  }
  const std::vector<absl::Status> answers = client_->Assign(calls, options_.rpc_timeout);  // all at once
  JobsLock lock(this);
  auto it = placed_.find(job_id);
  // (A later placement of the job, made while these calls ran, is not
  // theirs to answer for: this one was released, its ranks ended.)
  if (it == placed_.end() || it->second.generation != generation) return;
  Placed& p = it->second;
  std::vector<std::string> refused;
  // A worker that says it cannot take this job (INVALID_ARGUMENT,
  // UNIMPLEMENTED) refuses it for the job's own reasons; one that does not
  // answer, is busy or rejects the coordinator refuses for the cluster's,
  // and another placement may well succeed.
  bool jobs_fault = false;
  bool stopped_before_start = false;
  for (size_t i = 0; i < answers.size(); ++i) {
    if (answers[i].ok()) continue;
    const v1::RankAssignment& a = p.mesh.ranks(static_cast<int>(i));
    if (absl::IsAborted(answers[i]) && p.stopping()) {
      // The placement's abort reached the worker before its assignment,
      // which it then refused: the rank never started, and the worker did
      // nothing wrong.
      p.ended.insert(a.rank());
      stopped_before_start = true;
      continue;
    }
    jobs_fault |= answers[i].code() == absl::StatusCode::kInvalidArgument ||
                  answers[i].code() == absl::StatusCode::kUnimplemented;
    p.ended.insert(a.rank());  // it never started
    refused_until_[a.worker_id()] = clock_->Now() + options_.refusal_cooloff;
    refused.push_back(absl::StrCat(RankName(p.mesh, a.rank()), " refused the assignment: ", answers[i].ToString()));
  }
  if (refused.empty()) {
    // Every rank took it: the placements refused before do not count
    // against a later one (refusals spread over a long run, between drains,
    // failed it as if in a row).
    refusals_.erase(job_id);
    refused_in_a_row_.erase(job_id);
    if (stopped_before_start) ReleaseLocked();  // its last rank may have been one of those
    return;
  }
  // (While a rank's failure is probed, the job fails or restarts for it:
  // a refusal does not take its place.)
  if (p.state == PlacementState::kRunning) {
    Refused& in_a_row = refused_in_a_row_[job_id];
    const absl::Duration wait = in_a_row.count == 0
                                    ? absl::ZeroDuration()
                                    : DoubledWait(absl::Seconds(1), in_a_row.count - 1, options_.refusal_cooloff);
    in_a_row.until = clock_->Now() + wait;
    ++in_a_row.count;
    const std::string next_try = wait > absl::ZeroDuration()
                                     ? absl::StrCat("; the next try in ", absl::FormatDuration(wait), " (",
                                                    in_a_row.count, " placements refused in a row)")
                                     : "";
    // The ranks that started are stopped; the refusing workers sit out
    // refusal_cooloff; the job is placed again once the started ranks ended.
    // Only refusals of the job's own count against max_placements.
    std::vector<std::string>& refusals = refusals_[job_id];
    const std::string now = absl::StrJoin(refused, "; ");
    if (jobs_fault) refusals.push_back(now);
    if (!jobs_fault) {
      p.requeue_reason =
          absl::StrCat(now, "; placing the job again without the refusing worker", refused.size() > 1 ? "s" : "",
                       " (the cluster's refusal, not counted against ", "the job)", next_try);
      StopRanksLocked(p, PlacementState::kRequeueing, p.requeue_reason, -1);
    } else if (static_cast<int>(refusals.size()) < options_.max_placements) {
      p.requeue_reason = absl::StrCat(now, "; placing the job again (placement ", refusals.size() + 1, " of ",
                                      options_.max_placements, ")", next_try);
      StopRanksLocked(p, PlacementState::kRequeueing, p.requeue_reason, -1);
    } else {
      EndLocked(p, v1::JOB_STATE_FAILED, absl::StrCat("every placement was refused: ", absl::StrJoin(refusals, "; ")),
                -1);
    }
  }
  ReleaseLocked();
}

absl::Status Scheduler::RecordLateStep(const v1::ReportProgressRequest& report, int64_t generation,
                                       CarriesKey carries) {
  // `generation`: the first that is not past (the running one, or one past
  // the job's while none runs).
  // A step an earlier attempt ran and could not report then (its worker
  // kept it while the coordinator was away): a fact of the job's history,
  // recorded unless the history has it (AddStep keeps each step once; an
  // ended job's history is closed), and only from the worker that held rank
  // 0 of that generation.
  if (!report.has_step() || report.rank() != 0 || report.generation() < 1 || report.generation() >= generation) {
    return absl::OkStatus();
  }
  if (auto job = rank0_keys_.find(report.job_id()); job != rank0_keys_.end()) {
    const auto key = job->second.find(report.generation());
    if (key != job->second.end() && !key->second.empty() && !carries(key->second)) {
      return absl::PermissionDeniedError(absl::StrCat("late step ", report.step().step(), " of job '",
                                                      report.job_id(), "' generation ", report.generation(),
                                                      ": the report lacks the key of that generation's rank 0"));
    }
  }
  const absl::Status s = jobs_->AddLateStep(report.job_id(), report.generation(), report.worker_id(), report.step());
  return absl::IsPermissionDenied(s) ? s : absl::OkStatus();
}

namespace {

// Whether a call that carries what `carries` says may act as one of the
// workers holding `keys` (a placement's, by rank): it carries one of them,
// or one is empty (an older worker, which cannot prove it is one of them,
// so none can be told apart).
bool AdmitsCaller(const std::vector<std::string>& keys, Scheduler::CarriesKey carries) {
  if (keys.empty() || std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return k.empty(); })) {
    return true;
  }
  return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) { return carries(k); });
}

}  // namespace

absl::Status Scheduler::CheckScopeCaller(absl::string_view scope, CarriesKey carries) {
  const std::string job_id(scope.substr(0, scope.find('/')));
  std::shared_ptr<const std::vector<std::string>> placed_keys;
  {
    absl::MutexLock lock(&mu_);
    auto it = placed_.find(job_id);
    if (it == placed_.end() || it->second.scope != scope) return absl::OkStatus();
    placed_keys = it->second.keys;
  }
  // Compared outside mu_: a rank's every store call compares the world's keys.
  if (AdmitsCaller(*placed_keys, carries)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("this call to rendezvous scope '", scope,
                                                  "' carries the key of none of the workers placed in it"));
}

absl::Status Scheduler::CheckDownloadCaller(absl::string_view upload_id, CarriesKey carries) {
  std::vector<std::shared_ptr<const std::vector<std::string>>> users;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, p] : placed_) {
      if (!upload_id.empty() && p.spec.model().upload_id() == upload_id) users.push_back(p.download_keys);
    }
  }
  // Compared outside mu_, as the scopes' keys are.
  for (const std::shared_ptr<const std::vector<std::string>>& keys : users) {
    if (AdmitsCaller(*keys, carries)) return absl::OkStatus();
  }
  if (users.empty()) {
    return absl::PermissionDeniedError(absl::StrCat("no job placed now uses upload '", upload_id,
                                                    "': only the workers placed in one may download it"));
  }
  return absl::PermissionDeniedError(absl::StrCat("this download of upload '", upload_id,
                                                  "' carries the key of none of the workers placed in the jobs "
                                                  "that use it"));
}

absl::StatusOr<bool> Scheduler::Report(const v1::ReportProgressRequest& report, CarriesKey carries) {
  if (report.has_step()) RETURN_IF_ERROR(CheckStepReport(report.step()));
  JobsLock lock(this);  // records written once mu_ is released, before this returns
  auto it = placed_.find(report.job_id());
  if (it == placed_.end()) {
    absl::StatusOr<v1::Job> job = jobs_->Get(report.job_id());
    if (!job.ok()) return job.status();
    // No generation runs: the job's own is past too.
    RETURN_IF_ERROR(RecordLateStep(report, job->generation() + 1, carries));
    return absl::AbortedError(absl::StrCat("job '", report.job_id(), "' generation ", report.generation(),
                                           " no longer runs (", JobStateName(job->state()), ")"));
  }
  Placed& p = it->second;
  if (report.generation() != p.generation) {
    RETURN_IF_ERROR(RecordLateStep(report, p.generation, carries));
    return absl::AbortedError(absl::StrCat("generation ", report.generation(), " of job '", report.job_id(),
                                           "' is stale; the job runs generation ", p.generation));
  }
  const int rank = report.rank();
  if (rank < 0 || rank >= p.mesh.ranks_size() || p.mesh.ranks(rank).worker_id() != report.worker_id()) {
    return absl::PermissionDeniedError(absl::StrCat("worker '", report.worker_id(), "' does not hold rank ", rank,
                                                    " of job '", report.job_id(), "'"));
  }
  if (const std::string key = RankKey(*p.keys, rank); !key.empty() && !carries(key)) {
    return absl::PermissionDeniedError(absl::StrCat("this report for rank ", rank, " of job '", report.job_id(),
                                                    "' lacks the key of worker '", report.worker_id(),
                                                    "' that holds it: only that worker may report for it"));
  }
  switch (report.report_case()) {
    case v1::ReportProgressRequest::kStatus: {
      v1::RankStatus status = report.status();
      if (status.phase() == v1::RANK_PHASE_UNSPECIFIED || !v1::RankPhase_IsValid(status.phase())) {
        return absl::InvalidArgumentError(absl::StrCat("rank status of job '", report.job_id(), "' with phase ",
                                                       static_cast<int>(status.phase())));
      }
      status.set_rank(rank);
      status.set_worker_id(report.worker_id());
      if (!v1::Precision_IsValid(status.precision())) status.set_precision(v1::PRECISION_UNSPECIFIED);  // a newer one
      status.set_message(Utf8Prefix(status.message(), kMaxReportedMessageBytes));
      status.set_resumed_from(Utf8Prefix(status.resumed_from(), kMaxReportedMessageBytes));
      // A phase is recorded once a rank and generation: a report sent again
      // (or a worker that sends the same phase in a loop) adds nothing.
      if (!p.stopping() && p.phases.emplace(rank, status.phase()).second) (void)jobs_->AddRankStatus(p.job_id, status);
      // Where rank 0 of a restart resumed from the job's own checkpoints:
      // the job's step, should its record lag behind (not a user's
      // resume_from, which is no checkpoint of this job, nor an eval_only
      // run's, which trains nothing).
      if (!p.stopping() && p.resume_own && !p.spec.train().eval_only() && rank == 0 &&
          status.phase() == v1::RANK_PHASE_TRAINING && status.resumed_step() > 0) {
        (void)jobs_->NoteResumed(p.job_id, status.resumed_step(), status.resumed_from());
      }
      if (rank == 0 && status.phase() == v1::RANK_PHASE_TRAINING) {
        p.resumed_step = status.resumed_step();
        // The precision it trains at, where the spec left it to the run:
        // the MFU divides by the devices' peak at that one.
        auto peak = p.peak_flops.find(status.precision());
        if (!p.stopping() && status.precision() != v1::PRECISION_UNSPECIFIED &&
            p.spec.train().precision() == v1::PRECISION_UNSPECIFIED && peak != p.peak_flops.end()) {
          (void)jobs_->SetPeakFlops(p.job_id, p.generation, peak->second);
        }
      }
      if (status.phase() == v1::RANK_PHASE_TRAINING || status.phase() == v1::RANK_PHASE_SERVING ||
          status.phase() == v1::RANK_PHASE_RUNNING) {
        p.training.insert(rank);
      }
      if (!p.stopping() && static_cast<int>(p.training.size()) == p.mesh.world_size()) {
        absl::StatusOr<v1::Job> job = jobs_->Get(p.job_id);
        if (job.ok() && job->state() == v1::JOB_STATE_SCHEDULED) {
          (void)jobs_->SetState(p.job_id, v1::JOB_STATE_RUNNING,
                                absl::StrCat("all ", p.mesh.world_size(), " ranks are ", RankPhaseName(status.phase())));
        }
      }
      break;
    }
    case v1::ReportProgressRequest::kStep:
      // A trained step is recorded while the placement stops too: its
      // checkpoint may be on disk (a save fails at its last agreement when a
      // peer died) and the restart resume after it. Once, as every step;
      // nothing once the job ended.
      (void)jobs_->AddStep(p.job_id, report.step());
      if (rank == 0 && !report.step().checkpoint().empty()) {
        p.checkpointed_step = std::max(p.checkpointed_step, report.step().step());
      }
      break;
    case v1::ReportProgressRequest::kResult: {
      p.ended.insert(rank);
      const v1::RankResult& r = report.result();
      // Its disk or its device: the worker sits out, and the job (if it
      // restarts) runs elsewhere; so too where another rank's failure came
      // first and the placement is already stopping.
      // A second worker failing so in one job makes it the job's (an upload
      // larger than the workers' disks), which no restart mends: it is not
      // passed from worker to worker up to max_restarts.
      bool worker_fault = false;
      if (r.code() != 0 && r.worker_fault()) {
        refused_until_[p.mesh.ranks(rank).worker_id()] = clock_->Now() + options_.refusal_cooloff;
        std::set<std::string>& faulted = faulted_workers_[p.job_id];
        faulted.insert(p.mesh.ranks(rank).worker_id());
        worker_fault = faulted.size() < 2;
      }
      if (!p.stopping() && r.code() == 0 && r.has_forward()) (void)jobs_->SetForwardResult(p.job_id, r.forward());
      // A drain: every rank saves a checkpoint after the same step and
      // stops on its own; the worker that shuts down sits out (it
      // deregisters once its rank ended), and once every rank ended the job
      // is placed again from that checkpoint, not counted against it
      // (EndDrainLocked). Only where the placement drains (a worker may not
      // claim it for another job's failure), and not once a rank failed.
      const bool drained = r.code() != 0 && r.drained() && p.drain;
      if (drained && r.worker_leaving()) {
        refused_until_[p.mesh.ranks(rank).worker_id()] = clock_->Now() + options_.refusal_cooloff;
      }
      if (drained && p.state == PlacementState::kRunning) {
        if (p.drain_reason.empty() || r.worker_leaving()) {  // the leaving worker's says most
          p.drain_reason = absl::StrCat(RankName(p.mesh, rank), r.worker_leaving() ? " shuts down: " : ": ",
                                        Utf8Prefix(r.message(), kMaxReportedMessageBytes));
          p.drained_at = std::min(p.drained_at, clock_->Now());
        }
        EndIfAllEndedLocked(p, "");
      } else if (!p.stopping() && r.code() != 0) {
        const absl::Status s(static_cast<absl::StatusCode>(r.code()), Utf8Prefix(r.message(), kMaxReportedMessageBytes));
        std::string reason = absl::StrCat(RankName(p.mesh, rank), ": ", s.ToString());
        if (r.worker_fault()) {
          absl::StrAppend(&reason, " (the worker's own fault: it is given no job for ",
                          absl::FormatDuration(options_.refusal_cooloff),
                          worker_fault ? ")" : "; the second worker to fail so in this job, taken as the job's own)");
        }
        if (options_.probe_timeout <= absl::ZeroDuration()) {
          FailLocked(p, reason, worker_fault || IsRetryableRankError(s.code()), rank);
        } else if (p.state == PlacementState::kRunning || (p.failure_peer_caused && !r.peer_caused())) {
          // The first failure, or the first of a rank's own after one that
          // followed from it (kProbing, the peers not probed yet): the
          // scheduler thread probes the peers.
          if (p.state == PlacementState::kRunning) {
            TransitionLocked(p, PlacementState::kProbing);
            p.failed_at = clock_->Now();
          }
          p.failed_rank = rank;
          p.failure = reason;
          p.failure_code = s.code();
          p.failure_worker_fault = worker_fault;
          p.failure_peer_caused = r.peer_caused();
          wake_ = true;
        }
      } else {
        EndIfAllEndedLocked(p, "");  // the others drained: none finished the run
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("report: one of status, step or result is required");
  }
  const bool stop = p.stopping();
  ReleaseLocked();
  return stop;
}

absl::StatusOr<v1::Job> Scheduler::Cancel(absl::string_view job_id, absl::string_view reason) {
  JobsLock lock(this);  // no report slips in between the cancel and the aborts
  absl::StatusOr<v1::Job> job = jobs_->Cancel(job_id, reason);
  if (!job.ok()) return job;
  auto it = placed_.find(std::string(job_id));
  if (it != placed_.end()) {
    EndLocked(it->second, v1::JOB_STATE_CANCELLED, job->reason(), -1);  // already CANCELLED: only the aborts
    ReleaseLocked();
  }
  wake_ = true;
  return job;
}

void Scheduler::ProbeFailedJobs() {
  std::vector<RankSupervisor::Probe> probes;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (auto& [id, p] : placed_) {
      if (p.state != PlacementState::kProbing) continue;
      // A failure that followed from a peer's waits for the peer's own.
      if (p.failure_peer_caused && !p.AllEnded() && now < p.failed_at + options_.peer_caused_wait) continue;
      probes.push_back(
          RankSupervisor::PeersToProbe(id, p.generation, p.mesh, *p.keys, p.ended, p.failed_rank, p.failure,
                                       p.failure_code));
    }
  }
  // Every failed job's ranks at once: one probe timeout in all.
  const std::vector<RankSupervisor::Verdict> verdicts = supervisor_.ProbePeers(probes);
  for (size_t i = 0; i < probes.size(); ++i) {
    const RankSupervisor::Probe& probe = probes[i];
    const RankSupervisor::Verdict& verdict = verdicts[i];
    JobsLock lock(this);
    auto it = placed_.find(probe.job_id);
    if (it == placed_.end() || it->second.state != PlacementState::kProbing ||
        it->second.generation != probe.generation || it->second.failure != probe.failure) {
      continue;  // (a rank's own failure took the place of the one probed for: probed again)
    }
    FailLocked(it->second, verdict.reason, verdict.retryable || it->second.failure_worker_fault,
               it->second.failed_rank);
    ReleaseLocked();
  }
}

void Scheduler::ReportHangsLocked(const std::vector<v1::Worker>& workers) {
  std::map<std::string, const v1::Worker*> by_id;
  for (const v1::Worker& w : workers) by_id[w.info().worker_id()] = &w;
  const absl::Time now = clock_->Now();
  for (auto& [id, p] : placed_) {
    if (p.stopping()) continue;
    for (const v1::HangReport& h : supervisor_.NewHangs(p.job_id, p.generation, p.mesh, by_id, now)) {
      COLOD_LOG(WARNING) << "job " << p.job_id << " hangs: " << h.message();
      (void)jobs_->AddHang(p.job_id, h);
    }
  }
}

void Scheduler::FailLocked(Placed& p, const std::string& reason, bool retryable, int except_rank) {
  absl::StatusOr<v1::Job> job = jobs_->Get(p.job_id);
  if (!job.ok() || JobManager::IsFinal(job->state())) {  // cancelled meanwhile: only stop the ranks
    EndLocked(p, v1::JOB_STATE_FAILED, reason, except_rank);
    return;
  }
  const RestartLimits limits = RestartLimitsOf(job->spec());
  if (retryable && job->restarts() < limits.max_restarts) {
    std::string why = absl::StrCat(reason, "; restarting (restart ", job->restarts() + 1, " of ",
                                   limits.max_restarts, ")");
    if (ResumesFromCheckpoint(*job)) {
      absl::StrAppend(&why, " from its newest checkpoint in ", job->spec().train().checkpoint_dir());
    } else if (job->spec().kind() == v1::JOB_KIND_TRAIN) {
      absl::StrAppend(&why, " from step 0 (no checkpoint yet)");
    }
    if (jobs_->Restart(p.job_id, reason, why).ok()) {
      COLOD_LOG(WARNING) << "job " << p.job_id << ": " << why;
      p.requeue_reason = why;
      StopRanksLocked(p, PlacementState::kRestarting, why, except_rank);
      return;
    }
  }
  std::string why = reason;
  if (job->restarts() > 0) {
    why = absl::StrCat(retryable ? absl::StrCat("failed after ", job->restarts(), " restarts, all its policy allows")
                                 : "failed with an error a restart does not mend",
                       ": ", Attempts(*job, reason));
  } else if (!retryable && limits.max_restarts > 0) {
    absl::StrAppend(&why, " (not restarted: an error of the job itself)");
  }
  EndLocked(p, v1::JOB_STATE_FAILED, why, except_rank);
}

void Scheduler::EndDrainLocked(Placed& p, const std::string& note) {
  // (Where rank 0's TRAINING status never came, its resumed step is not
  // known: the step it reports again as it resumes could pass for the
  // drain's.)
  if (p.resumed_step.has_value() && p.checkpointed_step > *p.resumed_step) {
    p.requeue_reason = absl::StrCat(p.drain_reason, note,
                                    "; placing the job again from that checkpoint (a drain, not counted against the "
                                    "job)");
    StopRanksLocked(p, PlacementState::kRequeueing, p.requeue_reason, -1);
    return;
  }
  // No checkpoint past the one the placement resumed from: the drain saved
  // nothing newer, and is a failure like any other (no worker requeues a
  // job for ever uncounted).
  FailLocked(p, absl::StrCat(p.drain_reason, note, " (a drain that saved no new checkpoint)"), /*retryable=*/true, -1);
}

void Scheduler::EndIfAllEndedLocked(Placed& p, const std::string& drain_note) {
  // (Not while kProbing: a rank failed, and the job fails or restarts once
  // its peers were probed, however the others ended.)
  if (p.state != PlacementState::kRunning || !p.AllEnded()) return;
  if (!p.drain_reason.empty()) {
    EndDrainLocked(p, drain_note);
  } else {
    EndLocked(p, v1::JOB_STATE_SUCCEEDED, absl::StrCat("all ", p.mesh.world_size(), " ranks finished"), -1);
  }
}

void Scheduler::EndLocked(Placed& p, v1::JobState state, const std::string& reason, int except_rank) {
  (void)jobs_->SetState(p.job_id, state, reason);  // FAILED_PRECONDITION if it already ended
  // (A cancel while it was being placed again ends it: kEnding.)
  StopRanksLocked(p, PlacementState::kEnding, reason, except_rank);
  if (state != v1::JOB_STATE_SUCCEEDED) {
    COLOD_LOG(WARNING) << "job " << p.job_id << " " << JobStateName(state) << ": " << reason;
  } else {
    COLOD_LOG(INFO) << "job " << p.job_id << " succeeded";
  }
}

bool Scheduler::TransitionLocked(Placed& p, PlacementState next) {
  using S = PlacementState;
  bool legal = false;
  switch (p.state) {
    case S::kRunning:
      legal = next != S::kRunning;
      break;
    case S::kProbing:
      legal = next == S::kEnding || next == S::kRequeueing || next == S::kRestarting;
      break;
    case S::kRequeueing:
    case S::kRestarting:
    case S::kEnding:
      legal = next == S::kEnding;
      break;
  }
  if (!legal) {
    COLOD_LOG(ERROR) << "job " << p.job_id << ": placement state " << static_cast<int>(p.state) << " -> "
                     << static_cast<int>(next) << " is not a transition the scheduler makes; kept";
    return false;
  }
  p.state = next;
  return true;
}

void Scheduler::StopRanksLocked(Placed& p, PlacementState next, const std::string& reason, int except_rank) {
  if (!TransitionLocked(p, next)) return;
  p.stopped_at = std::min(p.stopped_at, clock_->Now());  // a cancel after the end keeps the first
  store_->CancelScope(p.scope);  // ranks blocked in this generation's rendezvous are free at once
  supervisor_.StopRanks(p.job_id, p.uid, p.generation, p.mesh, *p.keys, p.ended, except_rank, reason);
  wake_ = true;
}

void Scheduler::NoticeLostReportsLocked(const std::vector<v1::Worker>& workers) {
  if (options_.lost_report_wait <= absl::ZeroDuration()) return;
  std::map<std::string, const v1::Worker*> by_id;
  for (const v1::Worker& w : workers) by_id[w.info().worker_id()] = &w;
  const absl::Time now = clock_->Now();
  for (auto& [id, p] : placed_) {
    // (A stopping placement's ranks that never end are given up on after
    // stop_grace: GiveUpOnStuckRanksLocked.)
    for (int rank = 0; rank < p.mesh.ranks_size() && !p.stopping(); ++rank) {
      if (p.ended.count(rank)) continue;
      const auto w = by_id.find(p.mesh.ranks(rank).worker_id());
      if (w == by_id.end()) continue;  // lost: Tick ends it
      const v1::WorkerStatus& st = w->second->status();
      // The worker says it ran this rank to its end (after it tried to
      // report it): a report still in flight gets lost_report_wait to come.
      if (st.ended_job_id() != p.job_id || st.ended_generation() != p.generation || st.ended_rank() != rank) {
        p.lost_report_since.erase(rank);
        continue;
      }
      const absl::Time since = p.lost_report_since.try_emplace(rank, now).first->second;
      if (now - since < options_.lost_report_wait) continue;
      p.ended.insert(rank);
      // (A code no status has, from a worker's heartbeat, is UNKNOWN.)
      const absl::StatusCode code = st.ended_code() >= 0 && st.ended_code() <= 16
                                        ? static_cast<absl::StatusCode>(st.ended_code())
                                        : absl::StatusCode::kUnknown;
      const std::string said = absl::StrCat(RankName(p.mesh, rank), " ended ",
                                            code == absl::StatusCode::kOk ? "OK" : absl::StatusCodeToString(code),
                                            " (its worker says; its report never reached the coordinator)");
      COLOD_LOG(WARNING) << "job " << p.job_id << ": " << said;
      if (p.state == PlacementState::kProbing) continue;  // the probed failure decides
      // A rank whose peers drained drained with them (as for a lost worker:
      // Tick); an OK end of a TRAIN or TENSOR rank is that rank's success (a
      // FORWARD rank's result went with its report: run again).
      if ((p.state == PlacementState::kRunning && !p.drain_reason.empty()) ||
          (code == absl::StatusCode::kOk && p.spec.kind() != v1::JOB_KIND_FORWARD)) {
        EndIfAllEndedLocked(p, absl::StrCat("; ", said));
        continue;
      }
      std::string reason = said;
      if (code != absl::StatusCode::kOk && !st.last_error().empty()) {
        absl::StrAppend(&reason, ": ", Utf8Prefix(st.last_error(), kMaxReportedMessageBytes));
      } else if (code == absl::StatusCode::kOk) {
        absl::StrAppend(&reason, ": the forward pass's result went with it");
      }
      FailLocked(p, reason, code == absl::StatusCode::kOk || IsRetryableRankError(code), rank);
    }
  }
}

void Scheduler::GiveUpOnStuckRanksLocked() {
  if (options_.stop_grace <= absl::ZeroDuration()) return;
  const absl::Time now = clock_->Now();
  for (auto& [id, p] : placed_) {
    // A drain whose other ranks did not end on their own: aborted now.
    if (p.state == PlacementState::kRunning && now - p.drained_at >= options_.stop_grace) {
      EndDrainLocked(p, absl::StrCat("; the ranks that had not ended ", absl::FormatDuration(options_.stop_grace),
                                     " later were stopped"));
      continue;
    }
    if (!p.stopping() || now - p.stopped_at < options_.stop_grace) continue;
    for (const v1::RankAssignment& a : p.mesh.ranks()) {
      if (!p.ended.insert(a.rank()).second) continue;
      COLOD_LOG(WARNING) << "job " << p.job_id << " generation " << p.generation << ": " << RankName(p.mesh, a.rank())
                         << " has not reported its end " << absl::FormatDuration(options_.stop_grace)
                         << " after its abort (--stop-grace): given up on; its worker gets no other rank until it "
                            "reports idle";
    }
  }
}

void Scheduler::ReleaseLocked() {
  for (auto it = placed_.begin(); it != placed_.end();) {
    Placed& p = it->second;
    if (p.stopping() && p.AllEnded()) {
      // Closed for good: a rank given up on, or one of a worker counted lost,
      // may still run, and its sets and waits fail CANCELLED.
      store_->DeleteScope(p.scope);
      supervisor_.ForgetPlacement(p.job_id);
      if (p.state == PlacementState::kRequeueing) {
        COLOD_LOG(WARNING) << "job " << p.job_id << ": " << p.requeue_reason;
        (void)jobs_->SetState(p.job_id, v1::JOB_STATE_PENDING, p.requeue_reason);  // not if cancelled meanwhile
      } else {
        // Done, or restarting (it stays RESTARTING; ScheduleQueued places it
        // again and times its wait for workers from now).
        refusals_.erase(p.job_id);
        refused_in_a_row_.erase(p.job_id);
        if (p.state == PlacementState::kRestarting) {
          restart_since_[p.job_id] = clock_->Now();
        } else {
          faulted_workers_.erase(p.job_id);
        }
      }
      // Rank 0's key of this generation, for its late steps; the job's are
      // dropped once it ended (its history is closed).
      absl::StatusOr<v1::Job> job = jobs_->Get(p.job_id);
      if (!job.ok() || JobManager::IsFinal(job->state())) {
        rank0_keys_.erase(p.job_id);
      } else if (!p.keys->empty()) {
        std::map<int64_t, std::string>& keys = rank0_keys_[p.job_id];
        keys[p.generation] = p.keys->front();
        while (keys.size() > kKeptRank0Keys) keys.erase(keys.begin());
      }
      it = placed_.erase(it);
      wake_ = true;  // workers came free
    } else {
      ++it;
    }
  }
}

}  // namespace colod
