// Jobs: submission, lifecycle, and the per-job event log that WatchJob streams.
#ifndef COLOD_SERVER_JOB_MANAGER_H_
#define COLOD_SERVER_JOB_MANAGER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "common/clock.h"

namespace colod {

// Holds every job and its event history. Jobs are validated on submit and
// then wait in PENDING until a scheduler assigns ranks.
//
// Thread-safe. WaitForEvents blocks its caller, never the others.
class JobManager {
 public:
  explicit JobManager(Clock* clock = Clock::Real());

  // Validates (ValidateJobSpec) and adds a PENDING job. With a non-empty
  // request_id, a repeated submit returns the first job instead of a new one.
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, absl::string_view request_id);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::Job> Get(absl::string_view job_id);
  // Jobs in submission order; only `states` if non-empty.
  std::vector<v1::Job> List(const std::vector<v1::JobState>& states);
  // Moves a job that has not ended to CANCELLED. FAILED_PRECONDITION if it
  // already ended, NOT_FOUND if unknown.
  absl::StatusOr<v1::Job> Cancel(absl::string_view job_id, absl::string_view reason);

  struct Events {
    std::vector<v1::JobEvent> events;
    // True when the job is in a final state and `events` reaches its last event.
    bool finished = false;
  };
  // Events with sequence >= from_sequence. Waits up to `timeout` for at least
  // one if there are none yet. NOT_FOUND for an unknown id.
  absl::StatusOr<Events> WaitForEvents(absl::string_view job_id, int64_t from_sequence,
                                       absl::Duration timeout);

  // Number of jobs per state name ("pending", "running", ...).
  std::map<std::string, int> CountByState();

  static bool IsFinal(v1::JobState state);

 private:
  struct Entry {
    v1::Job job;
    std::vector<v1::JobEvent> events;
  };
  void AppendStateChangeLocked(Entry& e, v1::JobState state, absl::string_view reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  absl::Mutex mu_;
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> job_by_request_id_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

// "pending", "scheduled", ... for metrics labels and tables.
std::string JobStateName(v1::JobState state);

}  // namespace colod

#endif  // COLOD_SERVER_JOB_MANAGER_H_
