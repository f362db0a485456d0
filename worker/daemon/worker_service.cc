#include "worker/daemon/worker_service.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace colod {

WorkerServiceImpl::WorkerServiceImpl(std::function<v1::WorkerInfo()> info_fn,
                                     std::function<v1::WorkerStatus()> status_fn, JobRunner* runner,
                                     TokenAuth auth)
    : info_fn_(std::move(info_fn)), status_fn_(std::move(status_fn)), runner_(runner), auth_(std::move(auth)) {}

grpc::Status WorkerServiceImpl::AssignJob(grpc::ServerContext* ctx, const v1::AssignJobRequest* req,
                                          v1::AssignJobResponse*) {
  if (absl::Status a = auth_.Check(*ctx, CallerRole::kWorker); !a.ok()) return ToGrpcStatus(a);
  if (req->job_id().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  if (runner_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this worker runs standalone (no --coordinator) and cannot rendezvous for a job");
  }
  return ToGrpcStatus(runner_->Assign(*req));
}

grpc::Status WorkerServiceImpl::AbortJob(grpc::ServerContext* ctx, const v1::AbortJobRequest* req,
                                         v1::AbortJobResponse*) {
  if (absl::Status a = auth_.Check(*ctx, CallerRole::kWorker); !a.ok()) return ToGrpcStatus(a);
  if (req->job_id().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  if (runner_ == nullptr) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("this worker does not run job '", req->job_id(), "'"));
  }
  return ToGrpcStatus(runner_->Abort(*req));
}

grpc::Status WorkerServiceImpl::GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                                          v1::GetStatusResponse* resp) {
  // A read: the token and no other process's key, not this one's
  // (TokenAuth::CheckToken); whether it carries this one's is the
  // coordinator's proof of a registration (worker_key_held).
  if (absl::Status a = auth_.CheckToken(*ctx, CallerRole::kWorker); !a.ok()) return ToGrpcStatus(a);
  *resp->mutable_info() = info_fn_();
  *resp->mutable_status() = status_fn_();
  resp->set_worker_key_held(auth_.CarriesOwnKey(*ctx));
  return grpc::Status::OK;
}

}  // namespace colod
