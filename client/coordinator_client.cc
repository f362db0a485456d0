#include "client/coordinator_client.h"

#include "common/auth.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace colod {
namespace {

// Prefixes the coordinator's address to transport errors so that "connection
// refused" says which address was refused.
absl::Status Annotate(const grpc::Status& s, const std::string& address, absl::string_view rpc) {
  absl::Status st = FromGrpcStatus(s);
  if (st.ok()) return st;
  if (st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(st.code(), absl::StrCat(rpc, " to coordinator ", address, ": ", st.message()));
  }
  return st;
}

}  // namespace

CoordinatorClient::CoordinatorClient(std::string address, Options options,
                                     std::unique_ptr<v1::CoordinatorService::Stub> stub)
    : address_(std::move(address)), options_(options), stub_(std::move(stub)) {}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(const std::string& address,
                                                                            Options options) {
  RETURN_IF_ERROR(ParseHostPort(address, "coordinator address", /*allow_zero_port=*/false).status());
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout: must be > 0");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, MakeChannelCredentials(options.tls));
  auto stub = v1::CoordinatorService::NewStub(grpc::CreateChannel(address, credentials));
  return std::unique_ptr<CoordinatorClient>(new CoordinatorClient(address, options, std::move(stub)));
}

void CoordinatorClient::SetDeadline(grpc::ClientContext& ctx) const {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  AddAuthToken(ctx, options_.auth_token);
}

absl::StatusOr<std::vector<v1::Worker>> CoordinatorClient::ListWorkers(bool include_lost) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::ListWorkersRequest req;
  req.set_include_lost(include_lost);
  v1::ListWorkersResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->ListWorkers(&ctx, req, &resp), address_, "ListWorkers"));
  return std::vector<v1::Worker>(resp.workers().begin(), resp.workers().end());
}

absl::StatusOr<v1::RegisterWorkerResponse> CoordinatorClient::RegisterWorker(const v1::WorkerInfo& info) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::RegisterWorkerRequest req;
  *req.mutable_worker() = info;
  v1::RegisterWorkerResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->RegisterWorker(&ctx, req, &resp), address_, "RegisterWorker"));
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(const std::string& worker_id,
                                                                   const v1::WorkerStatus& status) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id);
  *req.mutable_status() = status;
  v1::HeartbeatResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->Heartbeat(&ctx, req, &resp), address_, "Heartbeat"));
  return resp;
}

absl::StatusOr<v1::Job> CoordinatorClient::SubmitJob(const v1::JobSpec& spec,
                                                     const std::string& request_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;
  req.set_request_id(request_id);
  v1::SubmitJobResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->SubmitJob(&ctx, req, &resp), address_, "SubmitJob"));
  return resp.job();
}

absl::StatusOr<v1::Job> CoordinatorClient::GetJob(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  v1::GetJobResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->GetJob(&ctx, req, &resp), address_, "GetJob"));
  return resp.job();
}

}  // namespace colod
