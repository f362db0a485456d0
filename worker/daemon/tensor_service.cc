#include "worker/daemon/tensor_service.h"

#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace colod {

template <typename Fn>
grpc::Status WorkerTensorService::With(grpc::ServerContext* ctx, const std::string& job_id, Fn&& fn) {
  if (absl::Status a = auth_.Check(*ctx, CallerRole::kWorker); !a.ok()) return ToGrpcStatus(a);
  if (job_id.empty()) return ToGrpcStatus(absl::InvalidArgumentError("job_id: required"));
  if (runner_ == nullptr) return ToGrpcStatus(absl::NotFoundError("this worker runs standalone: no jobs"));
  absl::StatusOr<std::optional<CallGeneration>> generation = JobGenerationOf(*ctx);
  if (!generation.ok()) return ToGrpcStatus(generation.status());
  absl::StatusOr<std::shared_ptr<TensorHost>> host = runner_->Tensors(job_id, *generation);
  if (!host.ok()) return ToGrpcStatus(host.status());
  return ToGrpcStatus(fn(**host));
}

grpc::Status WorkerTensorService::CreateTensor(grpc::ServerContext* ctx, const v1::CreateTensorRequest* req,
                                               v1::CreateTensorResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    ASSIGN_OR_RETURN(*resp->mutable_layout(), h.Create(*req));
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::SetDistSpec(grpc::ServerContext* ctx, const v1::SetDistSpecRequest* req,
                                              v1::SetDistSpecResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    ASSIGN_OR_RETURN(*resp->mutable_layout(), h.SetDistSpec(*req));
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::GetShard(grpc::ServerContext* ctx, const v1::GetShardRequest* req,
                                           v1::GetShardResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    ASSIGN_OR_RETURN(*resp, h.GetShard(*req));
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::GetGlobal(grpc::ServerContext* ctx, const v1::GetGlobalRequest* req,
                                            v1::GetGlobalResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    ASSIGN_OR_RETURN(*resp->mutable_value(),
                     h.GetGlobal(req->name(), !req->value_on_rank_zero_only() || h.rank() == 0));
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::DescribeTensor(grpc::ServerContext* ctx, const v1::DescribeTensorRequest* req,
                                                 v1::DescribeTensorResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    ASSIGN_OR_RETURN(*resp->mutable_layout(), h.Describe(req->name()));
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::ListTensors(grpc::ServerContext* ctx, const v1::ListTensorsRequest* req,
                                              v1::ListTensorsResponse* resp) {
  return With(ctx, req->job_id(), [&](TensorHost& h) -> absl::Status {
    if (req->page_token().size() > TensorHost::kMaxNameBytes) {
      return absl::InvalidArgumentError("page_token: longer than a tensor name");
    }
    for (v1::TensorLayout& l : h.List(req->page_token(), resp->mutable_next_page_token())) {
      *resp->add_tensors() = std::move(l);
    }
    return absl::OkStatus();
  });
}

grpc::Status WorkerTensorService::DeleteTensor(grpc::ServerContext* ctx, const v1::DeleteTensorRequest* req,
                                               v1::DeleteTensorResponse*) {
  return With(ctx, req->job_id(), [&](TensorHost& h) { return h.Delete(req->name()); });
}

}  // namespace colod
