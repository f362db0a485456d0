#include "server/job_manager.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "server/job_validation.h"

namespace colod {

std::string JobStateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return absl::AsciiStrToLower(name);
}

bool JobManager::IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

JobManager::JobManager(Clock* clock) : clock_(clock) {}

void JobManager::AppendStateChangeLocked(Entry& e, v1::JobState state, absl::string_view reason) {
  const absl::Time now = clock_->Now();
  e.job.set_state(state);
  e.job.set_reason(std::string(reason));
  *e.job.mutable_update_time() = ToProtoTimestamp(now);
  v1::JobEvent ev;
  ev.set_job_id(e.job.job_id());
  ev.set_sequence(static_cast<int64_t>(e.events.size()) + 1);
  *ev.mutable_time() = ToProtoTimestamp(now);
  ev.mutable_state_change()->set_state(state);
  ev.mutable_state_change()->set_reason(std::string(reason));
  e.events.push_back(std::move(ev));
}

absl::StatusOr<v1::Job> JobManager::Submit(const v1::JobSpec& spec, absl::string_view request_id) {
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  absl::MutexLock lock(&mu_);
  if (!request_id.empty()) {
    auto it = job_by_request_id_.find(request_id);
    if (it != job_by_request_id_.end()) return jobs_.at(it->second).job;
  }
  Entry e;
  e.job.set_job_id(absl::StrFormat("job-%06d", next_id_++));
  *e.job.mutable_spec() = spec;
  *e.job.mutable_create_time() = ToProtoTimestamp(clock_->Now());
  AppendStateChangeLocked(e, v1::JOB_STATE_PENDING, "waiting for workers");
  const std::string id = e.job.job_id();
  if (!request_id.empty()) job_by_request_id_[std::string(request_id)] = id;
  v1::Job out = e.job;
  jobs_.emplace(id, std::move(e));
  return out;
}

absl::StatusOr<v1::Job> JobManager::Get(absl::string_view job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(std::string(job_id));
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return it->second.job;
}

std::vector<v1::Job> JobManager::List(const std::vector<v1::JobState>& states) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  for (const auto& [id, e] : jobs_) {
    if (!states.empty() && std::find(states.begin(), states.end(), e.job.state()) == states.end()) {
      continue;
    }
    out.push_back(e.job);
  }
  return out;
}

absl::StatusOr<v1::Job> JobManager::Cancel(absl::string_view job_id, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(std::string(job_id));
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  Entry& e = it->second;
  if (IsFinal(e.job.state())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job_id, "' already ended (", JobStateName(e.job.state()), ")"));
  }
  AppendStateChangeLocked(e, v1::JOB_STATE_CANCELLED,
                          reason.empty() ? "cancelled by client" : reason);
  return e.job;
}

absl::StatusOr<JobManager::Events> JobManager::WaitForEvents(absl::string_view job_id,
                                                             int64_t from_sequence,
                                                             absl::Duration timeout) {
  const std::string id(job_id);
  const int64_t from = std::max<int64_t>(from_sequence, 1);
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  const Entry& e = it->second;  // entries are never erased, so the reference stays valid
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(e.events.size()) >= from || IsFinal(e.job.state());
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  Events out;
  for (int64_t seq = from; seq <= static_cast<int64_t>(e.events.size()); ++seq) {
    out.events.push_back(e.events[seq - 1]);
  }
  out.finished = IsFinal(e.job.state());
  return out;
}

std::map<std::string, int> JobManager::CountByState() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> counts;
  for (int s = v1::JOB_STATE_PENDING; s <= v1::JOB_STATE_CANCELLED; ++s) {
    counts[JobStateName(static_cast<v1::JobState>(s))] = 0;
  }
  for (const auto& [id, e] : jobs_) ++counts[JobStateName(e.job.state())];
  return counts;
}

}  // namespace colod
