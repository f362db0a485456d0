// C++ client library for the coordinator. Every call carries a deadline.
#ifndef COLOD_CLIENT_COORDINATOR_CLIENT_H_
#define COLOD_CLIENT_COORDINATOR_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "colod/v1/tensor.grpc.pb.h"
#include "common/auth.h"
#include "common/grpc_server.h"

namespace colod {

// Thread-safe: calls may be made concurrently from several threads.
class CoordinatorClient {
 public:
  struct Options {
    // Deadline of each call, but TensorService's.
    absl::Duration timeout = absl::Seconds(10);
    // Deadline of each TensorService call. The coordinator runs one on every
    // rank of the job, with its own limit of 60 s, after the calls queued
    // before it on the same job (docs/API.md): a shorter deadline ends a call
    // that would have been answered.
    absl::Duration tensor_timeout = absl::Seconds(60);
    // Bearer token sent with every call (--auth-token-file: its first line;
    // a string is one); empty: none.
    AuthToken auth_token;
    // TLS to the coordinator (its CA, and our cert + key for mutual TLS).
    TlsFiles tls;
    // A watch whose coordinator stays unreachable (UNAVAILABLE) this long in
    // a row gives up, UNAVAILABLE, whatever its own deadline: a restart or a
    // rescheduled pod is back well within it, a coordinator gone for good is
    // not waited for (a day, by default). Must be > 0.
    absl::Duration watch_reconnect_limit = absl::Minutes(10);
    // A stopped or cut-off coordinator ends a watch or an upload this soon
    // (UNAVAILABLE; a watch then reconnects within watch_reconnect_limit).
    Keepalive keepalive;
  };

  // `address` is HOST:PORT; INVALID_ARGUMENT if malformed. Connects lazily:
  // an unreachable coordinator shows up as UNAVAILABLE on the first call.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(const std::string& address,
                                                                   Options options);
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(const std::string& address) {
    return Create(address, Options());
  }

  absl::StatusOr<std::vector<v1::Worker>> ListWorkers(bool include_lost);
  // `status`: what the worker runs now (RegisterWorkerRequest.status).
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(const v1::WorkerInfo& info,
                                                            const v1::WorkerStatus& status = v1::WorkerStatus());
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const std::string& worker_id,
                                                  const v1::WorkerStatus& status);
  absl::StatusOr<v1::Job> SubmitJob(const v1::JobSpec& spec, const std::string& request_id = "");
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  // Jobs in submission order; only `states` if non-empty. Follows ListJobs'
  // pages to the last; summaries (no model config, mesh groups and ranks, or
  // attempt failure texts) unless `view` is FULL.
  absl::StatusOr<std::vector<v1::Job>> ListJobs(const std::vector<v1::JobState>& states = {},
                                                v1::JobView view = v1::JOB_VIEW_SUMMARY);
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id, const std::string& reason = "");
  // Forgets an ended job (DeleteJob).
  absl::Status DeleteJob(const std::string& job_id);
  // The job's mesh, with its state and generation (the last attempt's mesh
  // once that ended); FAILED_PRECONDITION before the job's ranks are
  // assigned.
  absl::StatusOr<v1::GetMeshResponse> GetMesh(const std::string& job_id);
  // Streams the job's events from `from_sequence` to `on_event` until the
  // job ends (OK), `on_event` returns false (CANCELLED), or `timeout` passes
  // (DEADLINE_EXCEEDED: a watch is long, so it has its own deadline). A
  // dropped connection is resumed from the next sequence while the deadline
  // allows, so no event is lost or repeated, unless the coordinator stays
  // unreachable for Options::watch_reconnect_limit (UNAVAILABLE).
  absl::Status WatchJob(const std::string& job_id, int64_t from_sequence, absl::Duration timeout,
                        const std::function<bool(const v1::JobEvent&)>& on_event);

  // Streams the model files of `dir` (config.json, *.safetensors,
  // model.safetensors.index.json) to the coordinator in 1 MiB chunks, under
  // a deadline of `timeout`. NOT_FOUND naming the directory when it holds no
  // .safetensors file.
  absl::StatusOr<v1::UploadModelResponse> UploadModel(const std::string& dir, absl::Duration timeout);

  // The TensorService of a TENSOR job's ColoTensors (served by the
  // coordinator, which runs each call on every rank).
  absl::StatusOr<v1::TensorLayout> CreateTensor(const v1::CreateTensorRequest& request);
  absl::StatusOr<v1::TensorLayout> SetDistSpec(const std::string& job_id, const std::string& name,
                                               const v1::DistSpec& spec);
  absl::StatusOr<v1::GetShardResponse> GetShard(const std::string& job_id, const std::string& name, int rank);
  absl::StatusOr<v1::TensorValue> GetGlobal(const std::string& job_id, const std::string& name);
  absl::StatusOr<std::vector<v1::TensorLayout>> ListTensors(const std::string& job_id);
  absl::Status DeleteTensor(const std::string& job_id, const std::string& name);

  const std::string& address() const { return address_; }
  v1::CoordinatorService::Stub& stub() { return *stub_; }

 private:
  CoordinatorClient(std::string address, Options options, std::shared_ptr<grpc::Channel> channel);
  void SetDeadline(grpc::ClientContext& ctx) const;
  void SetTensorDeadline(grpc::ClientContext& ctx) const;

  const std::string address_;
  const Options options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  const std::unique_ptr<v1::TensorService::Stub> tensors_;
};

}  // namespace colod

#endif  // COLOD_CLIENT_COORDINATOR_CLIENT_H_
