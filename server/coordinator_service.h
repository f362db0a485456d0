// The thin gRPC adaptor of the coordinator: request validation that is about
// the wire (missing ids, durations), status conversion, and RPC metrics. The
// logic lives in WorkerRegistry, JobManager and RendezvousStore.
#ifndef COLOD_SERVER_COORDINATOR_SERVICE_H_
#define COLOD_SERVER_COORDINATOR_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "colod/v1/coordinator.grpc.pb.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/job_manager.h"
#include "server/key_proof_gate.h"
#include "common/rendezvous_store.h"
#include "server/scheduler.h"
#include "server/stall_watchdog.h"
#include "server/upload_store.h"
#include "server/worker_registry.h"

namespace colod {

// Thread-safe: gRPC calls the handlers concurrently; every member it touches
// is thread-safe. The pointed-to objects must outlive the service.
class CoordinatorServiceImpl final : public v1::CoordinatorService::Service {
 public:
  // Every call is checked against `auth` first, as a worker's (RegisterWorker,
  // Heartbeat, DeregisterWorker, ReportProgress, DownloadModel, the store's
  // Kv* and Barrier) or a client's (the others): UNAUTHENTICATED, or
  // PERMISSION_DENIED for the other role's token.
  // `scheduler` may be null (no job runs: jobs stay PENDING), and so may
  // `uploads` (UploadModel is then UNIMPLEMENTED).
  // At most `max_watches` WatchJob streams run at once (each holds a server
  // thread); more are RESOURCE_EXHAUSTED. `stalls`, where not null, cancels
  // the upload and download streams that stop moving.
  CoordinatorServiceImpl(WorkerRegistry* workers, JobManager* jobs, RendezvousStore* store,
                         prometheus::Registry* metrics, TokenAuth auth = TokenAuth(),
                         Scheduler* scheduler = nullptr, UploadStore* uploads = nullptr, int max_watches = 256,
                         StallWatchdog* stalls = nullptr);

  // Called with the address of each worker that registers, before it is
  // registered (the coordinator drops its old connections there, before
  // the scheduler can place anything on it). Set before the service serves.
  void SetOnRegister(std::function<void(const std::string& address)> on_register) {
    on_register_ = std::move(on_register);
  }

  // Checks that a worker registering with a key holds it where it
  // listens: prove_key(address, key, deadline) calls the address
  // (ProveWorkerKey), true where the daemon there says it holds the key,
  // false where it answers without saying (an older worker). A failed check
  // refuses the registration with its status. Proven, the worker replaces
  // any other registered at that address (WorkerRegistry::AtAddress::
  // kProven); unproven (no key, an older worker, unset in tests), the
  // address rule of WorkerRegistry::CheckAddress holds. Each check runs
  // until `gate`'s deadline, or the caller's if sooner, on the call's
  // server thread, and ends when the caller cancels (`caller`, the
  // registration's call); `gate` bounds them (KeyProofGate: UNAVAILABLE
  // past its bounds, which a worker tries again). Set before the service
  // serves.
  using KeyProver = std::function<absl::StatusOr<bool>(const std::string& address, const std::string& key,
                                                       absl::Time deadline, const grpc::ServerContext& caller)>;
  void SetProveKey(KeyProver prove_key, KeyProofGate::Options gate = KeyProofGate::Options()) {
    prove_key_ = std::move(prove_key);
    proof_gate_ = std::make_unique<KeyProofGate>(gate);
  }

  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                              v1::RegisterWorkerResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status DeregisterWorker(grpc::ServerContext*, const v1::DeregisterWorkerRequest*,
                                v1::DeregisterWorkerResponse*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override;
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*,
                         v1::SubmitJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::GetJobResponse*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*,
                         v1::CancelJobResponse*) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest*, v1::DeleteJobResponse*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*,
                        grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status GetMesh(grpc::ServerContext*, const v1::GetMeshRequest*,
                       v1::GetMeshResponse*) override;
  grpc::Status UploadModel(grpc::ServerContext*, grpc::ServerReader<v1::UploadModelRequest>*,
                           v1::UploadModelResponse*) override;
  grpc::Status DownloadModel(grpc::ServerContext*, const v1::DownloadModelRequest*,
                             grpc::ServerWriter<v1::ModelChunk>*) override;
  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest*,
                              v1::ReportProgressResponse*) override;
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest*, v1::KvSetResponse*) override;
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest*, v1::KvGetResponse*) override;
  grpc::Status KvWait(grpc::ServerContext*, const v1::KvWaitRequest*, v1::KvWaitResponse*) override;
  grpc::Status Barrier(grpc::ServerContext*, const v1::BarrierRequest*,
                       v1::BarrierResponse*) override;

 private:
  // Checks the token of `role`, runs `fn`, converts its status and records
  // colod_rpc_duration_seconds.
  template <typename Fn>
  grpc::Status Instrument(grpc::ServerContext* ctx, const char* method, CallerRole role, Fn&& fn);

  WorkerRegistry* const workers_;
  JobManager* const jobs_;
  RendezvousStore* const store_;
  prometheus::Family<prometheus::Histogram>* const rpc_duration_;
  const TokenAuth auth_;
  Scheduler* const scheduler_;
  UploadStore* const uploads_;
  std::function<void(const std::string& address)> on_register_;  // SetOnRegister's
  KeyProver prove_key_;                       // SetProveKey's
  std::unique_ptr<KeyProofGate> proof_gate_;  // SetProveKey's
  // ReportProgressResponse.coordinator_incarnation: random per process.
  const std::string incarnation_;
  const int max_watches_;
  StallWatchdog* const stalls_;  // may be null
  // OK unless `worker_id` registered with a key (RegisterWorkerRequest.
  // worker_key) that the call does not carry: PERMISSION_DENIED (the
  // workers' token is every worker's; the key is one worker's), logged as
  // LogRefused.
  absl::Status CheckCaller(const grpc::ServerContext& ctx, const char* method, const std::string& worker_id);
  // Whether the daemon at `address` holds `key` (SetProveKey's check,
  // admitted by its gate, logged where refused).
  absl::StatusOr<bool> ProveKey(const grpc::ServerContext& ctx, const std::string& address, const std::string& key);
  // OK unless the store's `scope` belongs to a placement whose workers all
  // hold keys and the call carries none of them (Scheduler::CheckScopeCaller),
  // logged as LogRefused.
  absl::Status CheckScopeCaller(const grpc::ServerContext& ctx, const char* method, const std::string& scope);
  // Calls refused for their token or a worker's key, and registrations at a
  // live worker's address, are logged at most once every 10 s (a worker
  // with the wrong token retries without end), with a count of those not
  // logged.
  void LogRefused(const grpc::ServerContext& ctx, const char* method, const absl::Status& status);
  absl::Mutex refused_mu_;
  absl::Time next_refusal_log_ ABSL_GUARDED_BY(refused_mu_) = absl::InfinitePast();
  int64_t refusals_not_logged_ ABSL_GUARDED_BY(refused_mu_) = 0;
  std::atomic<int> watches_{0};  // WatchJob streams running
};

}  // namespace colod

#endif  // COLOD_SERVER_COORDINATOR_SERVICE_H_
