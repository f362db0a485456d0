// What one rank tells the coordinator through ReportProgress: its phases,
// rank 0's steps, and its end. Each answer says whether the job still runs,
// which is how a rank learns that it should stop when an abort missed it.
#ifndef COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_
#define COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/worker.pb.h"
#include "worker/train/trainer.h"

namespace colod {

// Thread-safe (it keeps no state of its own between reports).
class ProgressReporter {
 public:
  struct Options {
    // The coordinator; required.
    std::shared_ptr<v1::CoordinatorService::StubInterface> coordinator;
    std::string auth_token;
    // Of each attempt.
    absl::Duration rpc_timeout = absl::Seconds(10);
    // This worker's id; may be empty.
    std::function<std::string()> worker_id;
  };

  // Reports for the rank `assignment` describes (job, generation, rank).
  ProgressReporter(Options options, const v1::AssignJobRequest& assignment);

  // Each returns true when the coordinator says the job no longer runs (or
  // that this rank is not one of it): the rank should stop. Best effort:
  // a report that fails twice (five times for the end) is given up, logged.
  bool Phase(v1::RankPhase phase, const std::string& message = "") const;
  bool Step(const train::StepStats& step) const;
  // The rank's end: its status and, for rank 0 of a FORWARD job, the result.
  void End(const absl::Status& status, const std::optional<v1::ForwardResult>& forward) const;

 private:
  bool Send(v1::ReportProgressRequest report) const;

  const Options options_;
  const std::string job_id_;
  const int64_t generation_;
  const int rank_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_PROGRESS_REPORTER_H_
