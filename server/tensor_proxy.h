// The coordinator's TensorService: the one endpoint clients use for a
// TENSOR job's ColoTensors. Each call goes to every rank's worker at once
// (GetShard only to the rank asked for), because creating and converting a
// ColoTensor is collective; calls on one job are serialized, so every rank
// sees them in the same order. The answer is rank 0's (layouts are global);
// a rank's error comes back prefixed with the rank and its worker.
#ifndef COLOD_SERVER_TENSOR_PROXY_H_
#define COLOD_SERVER_TENSOR_PROXY_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/tensor.grpc.pb.h"
#include "common/auth.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/job_manager.h"
#include "server/stub_cache.h"
#include "server/worker_client.h"

namespace colod {

// Thread-safe. `jobs` must outlive it.
class TensorProxy final : public v1::TensorService::Service {
 public:
  struct Options {
    // Checked on every call, a client's (TokenAuth: the workers' token is
    // PERMISSION_DENIED where it is a separate one).
    AuthToken auth_token;
    // The workers' token (the coordinator's --worker-token-file), sent to
    // the workers; empty: auth_token plays both roles, and is sent.
    AuthToken worker_token;
    std::shared_ptr<grpc::ChannelCredentials> credentials;  // to the workers
    // The key each call to a rank's worker carries, by its worker id
    // (WorkerRegistry::KeyToCall); null: none.
    WorkerKeyToCall worker_key_to_call;
    // Deadline of each call to a worker, unless the client's is sooner.
    absl::Duration rpc_timeout = absl::Seconds(60);
    // How long a worker that is not connected (its connection refused or
    // reset) is waited for before a call goes to any rank: from the moment
    // a call first found it so, calls waiting side by side before their
    // turn; past it, UNAVAILABLE and sent to no rank. <= 0: calls are sent
    // without the wait.
    absl::Duration connect_timeout = absl::Seconds(5);
  };
  // RPCs are recorded in `metrics`' colod_rpc_duration_seconds.
  TensorProxy(JobManager* jobs, prometheus::Registry* metrics, Options options);

  grpc::Status CreateTensor(grpc::ServerContext*, const v1::CreateTensorRequest*, v1::CreateTensorResponse*) override;
  grpc::Status SetDistSpec(grpc::ServerContext*, const v1::SetDistSpecRequest*, v1::SetDistSpecResponse*) override;
  grpc::Status GetShard(grpc::ServerContext*, const v1::GetShardRequest*, v1::GetShardResponse*) override;
  grpc::Status GetGlobal(grpc::ServerContext*, const v1::GetGlobalRequest*, v1::GetGlobalResponse*) override;
  grpc::Status DescribeTensor(grpc::ServerContext*, const v1::DescribeTensorRequest*,
                              v1::DescribeTensorResponse*) override;
  grpc::Status ListTensors(grpc::ServerContext*, const v1::ListTensorsRequest*, v1::ListTensorsResponse*) override;
  grpc::Status DeleteTensor(grpc::ServerContext*, const v1::DeleteTensorRequest*, v1::DeleteTensorResponse*) override;

  // How many jobs have a tensor call waiting or running: what the proxy
  // holds for them, nothing once their calls ended.
  size_t QueuedJobs() const ABSL_LOCKS_EXCLUDED(mu_);
  // The calls on `job_id` waiting for their turn behind the one that runs.
  int64_t CallsWaiting(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // A worker registered at `address` anew: the next call there connects
  // afresh (StubCache::Forget).
  void ForgetConnection(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Stub = v1::TensorService::Stub;
  template <typename Req, typename Resp>
  using Call = void (Stub::async::*)(grpc::ClientContext*, const Req*, Resp*, std::function<void(grpc::Status)>);

  // The job, which must be a RUNNING TENSOR job: NOT_FOUND, or
  // FAILED_PRECONDITION naming its kind or state.
  absl::StatusOr<v1::Job> RunningTensorJob(const std::string& job_id);
  // How a fan-out's answers make its outcome, beyond "every rank OK".
  enum class Settle {
    kPlain,
    // A create that some ranks made and others refused is deleted again
    // where it was made: the ranks keep holding the same tensors.
    kCreate,
    // A delete that found the tensor on some ranks and not others (an
    // earlier delete that reached only some) is done.
    kDelete,
  };
  // `req` to every rank (or only `only_rank` if >= 0); rank 0's (or that
  // rank's) response. Where ranks fail, the error is the first rank's
  // whose code is not one that follows from another's failure
  // (DEADLINE_EXCEEDED, ABORTED, CANCELLED: a peer waiting in a collective),
  // or else the first rank's.
  template <typename Req, typename Resp>
  grpc::Status FanOut(grpc::ServerContext* ctx, const char* method, const std::string& job_id, const Req& req,
                      Resp* resp, Call<Req, Resp> call, int only_rank = -1, Settle settle = Settle::kPlain);
  template <typename Req, typename Resp>
  absl::Status FanOutToRanks(grpc::ServerContext* ctx, const std::string& job_id, const Req& req, Resp* resp,
                             Call<Req, Resp> call, int only_rank, Settle settle);
  // OK once every channel of `ranks` is connected: each worker is waited
  // for until connect_timeout after a call first found it not connected
  // (UNAVAILABLE naming it past that), within `deadline`
  // (DEADLINE_EXCEEDED) and while the caller stays (CANCELLED).
  absl::Status AwaitConnected(grpc::ServerContext* ctx, absl::Time deadline, const v1::MeshSpec& mesh,
                              const std::vector<int>& ranks,
                              const std::vector<std::shared_ptr<grpc::Channel>>& channels) ABSL_LOCKS_EXCLUDED(mu_);
  // A job's fan-outs run one at a time, in the order they arrive (a ticket
  // each): AwaitTurn returns when this call's turn has come, EndTurn hands
  // it to the next. Neither holds a lock after it returns. A caller that
  // goes away (cancelled, or past `deadline`) while it waits gives up its
  // turn (CANCELLED / DEADLINE_EXCEEDED; no EndTurn then): the calls after
  // it need not wait for it.
  absl::Status AwaitTurn(const std::string& job_id, grpc::ServerContext* ctx, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndTurn(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  JobManager* const jobs_;
  prometheus::Family<prometheus::Histogram>* const rpc_duration_;
  const Options options_;
  const TokenAuth auth_;
  StubCache<v1::TensorService> stubs_;
  mutable absl::Mutex mu_;
  struct JobQueue {
    int64_t next_ticket = 0;  // the next arriving call's
    int64_t serving = 0;      // the ticket whose fan-out may run
    std::set<int64_t> abandoned;  // tickets whose callers went away before their turn
  };
  // Hands the turn on past `q`'s abandoned tickets.
  static void AdvanceLocked(JobQueue& q);
  // A job's queue while it has a call waiting or running; erased once idle.
  std::map<std::string, JobQueue> queues_ ABSL_GUARDED_BY(mu_);
  absl::BitGen bits_ ABSL_GUARDED_BY(mu_);  // CreateTensorRequest.creation_id
  // Since when calls found each worker address not connected, and when one
  // last looked (erased once one finds it connected, or its worker
  // registers anew).
  struct NotConnected {
    absl::Time since, seen;
  };
  static constexpr size_t kMaxNotConnectedKept = 1024;
  std::map<std::string, NotConnected> not_connected_since_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_SERVER_TENSOR_PROXY_H_
