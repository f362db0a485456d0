// The worker's TensorService: this rank's side of the job's ColoTensors.
// The coordinator's TensorService (server/tensor_proxy.h) calls every rank
// with the same request; clients call the coordinator.
#ifndef COLOD_WORKER_DAEMON_TENSOR_SERVICE_H_
#define COLOD_WORKER_DAEMON_TENSOR_SERVICE_H_

#include "colod/v1/tensor.grpc.pb.h"
#include "common/auth.h"
#include "worker/daemon/job_runner.h"

namespace colod {

// Thread-safe; `runner` must outlive it. Every call is checked against
// `auth` first (UNAUTHENTICATED; PERMISSION_DENIED without the worker's key
// once its coordinator took it); NOT_FOUND unless the job runs here.
class WorkerTensorService final : public v1::TensorService::Service {
 public:
  WorkerTensorService(JobRunner* runner, TokenAuth auth) : runner_(runner), auth_(std::move(auth)) {}

  grpc::Status CreateTensor(grpc::ServerContext*, const v1::CreateTensorRequest*, v1::CreateTensorResponse*) override;
  grpc::Status SetDistSpec(grpc::ServerContext*, const v1::SetDistSpecRequest*, v1::SetDistSpecResponse*) override;
  grpc::Status GetShard(grpc::ServerContext*, const v1::GetShardRequest*, v1::GetShardResponse*) override;
  grpc::Status GetGlobal(grpc::ServerContext*, const v1::GetGlobalRequest*, v1::GetGlobalResponse*) override;
  grpc::Status DescribeTensor(grpc::ServerContext*, const v1::DescribeTensorRequest*,
                              v1::DescribeTensorResponse*) override;
  grpc::Status ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*, v1::ListTensorsResponse*) override;
  grpc::Status DeleteTensor(grpc::ServerContext*, const v1::DeleteTensorRequest*, v1::DeleteTensorResponse*) override;

 private:
  // Checks the token, finds the job's tensors and runs fn(host).
  template <typename Fn>
  grpc::Status With(grpc::ServerContext* ctx, const std::string& job_id, Fn&& fn);

  JobRunner* const runner_;
  const TokenAuth auth_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_TENSOR_SERVICE_H_
