// The worker's gRPC adaptor (WorkerService).
#ifndef COLOD_WORKER_DAEMON_WORKER_SERVICE_H_
#define COLOD_WORKER_DAEMON_WORKER_SERVICE_H_

#include <functional>

#include "common/auth.h"
#include "worker/daemon/job_runner.h"
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "colod/v1/worker.grpc.pb.h"

namespace colod {

// Thread-safe: `info` is fixed at construction; the status is read through
// `status_fn`, which must itself be thread-safe.
class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  // Every call is checked against `auth` first (UNAUTHENTICATED; and
  // PERMISSION_DENIED without the worker's key, GetStatus excepted).
  // `runner` runs assigned ranks; null for a standalone worker, which
  // refuses AssignJob with FAILED_PRECONDITION (no coordinator to rendezvous
  // through). It must outlive the service.
  WorkerServiceImpl(std::function<v1::WorkerInfo()> info_fn, std::function<v1::WorkerStatus()> status_fn,
                    JobRunner* runner, TokenAuth auth = TokenAuth());

  // Starts the rank (JobRunner::Assign) and returns at once; progress goes
  // to the coordinator.
  grpc::Status AssignJob(grpc::ServerContext*, const v1::AssignJobRequest*,
                         v1::AssignJobResponse*) override;
  // NOT_FOUND unless the worker runs that job; ABORTED for a stale generation.
  grpc::Status AbortJob(grpc::ServerContext*, const v1::AbortJobRequest*,
                        v1::AbortJobResponse*) override;
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse*) override;

 private:
  const std::function<v1::WorkerInfo()> info_fn_;
  const std::function<v1::WorkerStatus()> status_fn_;
  JobRunner* const runner_;
  const TokenAuth auth_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_WORKER_SERVICE_H_
