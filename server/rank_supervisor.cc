#include "server/rank_supervisor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "server/hang_detector.h"
#include "spec/job_validation.h"

namespace colod {

std::string RankName(const v1::MeshSpec& mesh, int rank) {
  const v1::RankAssignment& a = mesh.ranks(rank);
  return absl::StrCat("rank ", rank, " (worker ", a.worker_id(), " at ", a.worker_address(), ")");
}

RankSupervisor::RankSupervisor(std::shared_ptr<WorkerClient> client, Options options)
    : client_(std::move(client)), options_(options) {}

std::string RankKey(const std::vector<std::string>& keys, int rank) {
  return rank >= 0 && static_cast<size_t>(rank) < keys.size() ? keys[rank] : "";
}

void RankSupervisor::StopRanks(const std::string& job_id, const std::string& job_uid, int64_t generation,
                               const v1::MeshSpec& mesh, const std::vector<std::string>& keys,
                               const std::set<int>& ended, int except_rank, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  for (const v1::RankAssignment& a : mesh.ranks()) {
    if (ended.count(a.rank()) || a.rank() == except_rank) continue;
    WorkerClient::Call<v1::AbortJobRequest> call;
    call.address = a.worker_address();
    call.key = RankKey(keys, a.rank());
    call.request.set_job_id(job_id);
    call.request.set_generation(generation);
    call.request.set_job_uid(job_uid);
    call.request.set_reason(reason);
    aborts_.push_back({std::move(call), ""});
  }
}

void RankSupervisor::StopStaleRanks(const std::vector<v1::Worker>& workers,
                                    const std::function<bool(const std::string&, int64_t)>& runs,
                                    const WorkerKeyToCall& key_to_call) {
  // Worker id -> the abort of its stale rank ("job/generation" its key).
  std::map<std::string, WorkerClient::Call<v1::AbortJobRequest>> stale;
  for (const v1::Worker& w : workers) {
    const v1::WorkerStatus& st = w.status();
    if (st.state() != v1::WORKER_STATE_BUSY || st.job_id().empty() || runs(st.job_id(), st.generation())) continue;
    WorkerClient::Call<v1::AbortJobRequest>& call = stale[w.info().worker_id()];
    call.address = w.info().address();
    call.key = key_to_call(w.info().worker_id());
    call.request.set_job_id(st.job_id());
    call.request.set_generation(st.generation());
    call.request.set_reason("the coordinator does not run this job (it ended, or the coordinator restarted)");
  }
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  std::map<std::string, Told> told;
  for (auto& [worker, call] : stale) {
    const std::string key = absl::StrCat(call.request.job_id(), "/", call.request.generation());
    auto before = stale_told_.find(worker);
    if (before == stale_told_.end() || before->second.key != key || now >= before->second.again) {
      aborts_.push_back({call, worker});
      told[worker] = Told{key, absl::InfiniteFuture(),
                          before != stale_told_.end() && before->second.key == key ? before->second.failures : 0};
    } else {
      told[worker] = before->second;
    }
  }
  stale_told_ = std::move(told);
}

void RankSupervisor::SendAborts() {
  std::vector<Queued> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(aborts_);
  }
  if (queued.empty()) return;
  std::vector<WorkerClient::Call<v1::AbortJobRequest>> calls;
  calls.reserve(queued.size());
  for (const Queued& q : queued) calls.push_back(q.call);
  const std::vector<absl::Status> answers = client_->Abort(calls, options_.abort_timeout);
  std::vector<size_t> failed;
  for (size_t i = 0; i < calls.size(); ++i) {
    // NOT_FOUND: the rank already ended on its own.
    const absl::Status answer = i < answers.size() ? answers[i] : absl::UnknownError("no answer");
    if (answer.ok() || absl::IsNotFound(answer)) continue;
    // Sent again where it may reach the worker later; not where the worker
    // refused it (another key, another generation running).
    const bool again = !queued[i].stale_worker.empty() &&
                       (absl::IsUnavailable(answer) || absl::IsDeadlineExceeded(answer) ||
                        absl::IsResourceExhausted(answer) || absl::IsUnknown(answer) || absl::IsCancelled(answer));
    COLOD_LOG(WARNING) << "AbortJob " << calls[i].request.job_id() << " to " << calls[i].address << ": " << answer
                       << (again ? " (sent again later)" : "");
    if (again) failed.push_back(i);
  }
  if (failed.empty()) return;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  for (size_t i : failed) {
    // (Unless the record moved on meanwhile: another generation, or not stale.)
    auto it = stale_told_.find(queued[i].stale_worker);
    const std::string key = absl::StrCat(calls[i].request.job_id(), "/", calls[i].request.generation());
    if (it == stale_told_.end() || it->second.key != key) continue;
    it->second.again = now + DoubledWait(options_.stale_abort_retry, it->second.failures, kMaxStaleAbortRetry);
    ++it->second.failures;
  }
}

RankSupervisor::Probe RankSupervisor::PeersToProbe(const std::string& job_id, int64_t generation,
                                                   const v1::MeshSpec& mesh, const std::vector<std::string>& keys,
                                                   const std::set<int>& ended, int failed_rank, std::string failure,
                                                   absl::StatusCode failure_code) {
  Probe probe;
  probe.job_id = job_id;
  probe.generation = generation;
  probe.failure = std::move(failure);
  probe.failure_code = failure_code;
  for (const v1::RankAssignment& a : mesh.ranks()) {
    if (ended.count(a.rank()) || a.rank() == failed_rank) continue;
    probe.names.push_back(RankName(mesh, a.rank()));
    WorkerClient::Call<v1::GetStatusRequest> call;
    call.address = a.worker_address();
    call.key = RankKey(keys, a.rank());
    probe.calls.push_back(std::move(call));
  }
  return probe;
}

RankSupervisor::Verdict RankSupervisor::ProbePeers(const Probe& probe) { return ProbePeers(std::vector{probe})[0]; }

std::vector<RankSupervisor::Verdict> RankSupervisor::ProbePeers(const std::vector<Probe>& probes) {
  std::vector<WorkerClient::Call<v1::GetStatusRequest>> calls;
  for (const Probe& p : probes) calls.insert(calls.end(), p.calls.begin(), p.calls.end());
  std::vector<absl::Status> answers;
  if (!calls.empty()) answers = client_->Probe(calls, options_.probe_timeout);
  answers.resize(calls.size(), absl::UnknownError("no answer from the probe"));  // (a client's answers are one a call)
  std::vector<Verdict> verdicts;
  size_t at = 0;
  for (const Probe& p : probes) {
    verdicts.push_back(
        JudgeProbe(p, std::vector<absl::Status>(answers.begin() + at, answers.begin() + at + p.calls.size())));
    at += p.calls.size();
  }
  return verdicts;
}

RankSupervisor::Verdict RankSupervisor::JudgeProbe(const Probe& probe, const std::vector<absl::Status>& answers) {
  std::vector<std::string> unreachable;
  for (size_t i = 0; i < answers.size() && i < probe.names.size(); ++i) {
    if (answers[i].ok()) continue;
    unreachable.push_back(absl::StrCat(probe.names[i], " does not answer (", answers[i].ToString(), ")"));
  }
  Verdict v;
  if (unreachable.empty()) {
    v.reason = probe.failure;
    v.retryable = IsRetryableRankError(probe.failure_code);
  } else {
    v.reason = absl::StrCat(absl::StrJoin(unreachable, "; "), "; first failure reported: ", probe.failure);
    v.retryable = true;
  }
  return v;
}

std::vector<v1::HangReport> RankSupervisor::NewHangs(const std::string& job_id, int64_t generation,
                                                     const v1::MeshSpec& mesh,
                                                     const std::map<std::string, const v1::Worker*>& workers,
                                                     absl::Time now) {
  std::vector<RankReport> ranks;
  for (const v1::RankAssignment& a : mesh.ranks()) {
    RankReport r;
    r.rank = a.rank();
    r.name = RankName(mesh, a.rank());
    auto w = workers.find(a.worker_id());
    if (w != workers.end()) {
      const v1::WorkerStatus& st = w->second->status();
      r.silent_for = now - FromProtoTimestamp(w->second->last_heartbeat_time());
      if (st.job_id() == job_id && st.generation() == generation) {
        r.collectives.assign(st.collectives().begin(), st.collectives().end());
        // A collective pending at the heartbeat has been pending since.
        for (v1::CollectiveProgress& c : r.collectives) {
          if (c.pending_sequence() > 0) {
            *c.mutable_pending_for() = ToProtoDuration(FromProtoDuration(c.pending_for()) + r.silent_for);
          }
        }
      }
    }
    ranks.push_back(std::move(r));
  }
  std::vector<v1::HangReport> found = FindHangs(ranks, options_.hang_threshold);
  std::vector<v1::HangReport> fresh;
  absl::MutexLock lock(&mu_);
  std::set<std::string>& seen = hangs_[job_id];
  for (v1::HangReport& h : found) {
    // Once per collective and set of silent ranks: a rank whose silence
    // passes the threshold after the first report (a stopped CUDA rank had
    // enqueued the collective before it stopped: every rank "entered" it) is
    // named in a second one.
    const std::string key =
        absl::StrCat(generation, "/", h.group(), "#", h.sequence(), " silent ", absl::StrJoin(h.silent_ranks(), ","));
    if (seen.insert(key).second) fresh.push_back(std::move(h));
  }
  return fresh;
}

void RankSupervisor::ForgetPlacement(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  hangs_.erase(job_id);
}

}  // namespace colod
