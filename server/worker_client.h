// How the scheduler talks to worker daemons: assignments, aborts and status
// probes, each batch sent to every worker at once (asynchronously, each call
// with its own deadline), so that one unreachable or stopped worker never
// delays the calls to the others. GrpcWorkerClient is the real one; tests
// give the scheduler a fake.
#ifndef COLOD_SERVER_WORKER_CLIENT_H_
#define COLOD_SERVER_WORKER_CLIENT_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/auth.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_context.h"
#include "server/stub_cache.h"

namespace colod {

// Runs `n` asynchronous gRPC calls at once, on no thread of their own:
// start(i, ctx, done) starts call i on `ctx` (its deadline and auth token
// set) through a stub's async() interface, which calls done(status) once it
// ends. Returns when every call ended, with their statuses in order. Thread-
// safe; the caller's thread waits.
std::vector<absl::Status> RunAsyncCalls(
    size_t n, absl::Time deadline, const AuthToken& auth_token,
    const std::function<void(size_t, grpc::ClientContext*, std::function<void(grpc::Status)>)>& start);

// The key a call meant for a worker carries (WorkerRegistry::KeyToCall).
using WorkerKeyToCall = std::function<std::string(const std::string& worker_id)>;

// Implementations are thread-safe. Each method returns once every call of
// the batch ended (answered, failed or past `deadline`), with their statuses
// in the order of the batch.
class WorkerClient {
 public:
  // A call to the worker at `address`, carrying `key` as its
  // colod-worker-key ("" none): the key of the worker the call is meant for
  // (WorkerRegistry::KeyToCall), so that another daemon listening there now
  // (a worker restarted on its port) refuses it.
  template <typename Request>
  struct Call {
    std::string address;
    std::string key;
    Request request;
  };

  virtual ~WorkerClient() = default;
  virtual std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls,
                                           absl::Duration deadline) = 0;
  virtual std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls,
                                          absl::Duration deadline) = 0;
  // GetStatus of each worker: OK when it answers.
  virtual std::vector<absl::Status> Probe(const std::vector<Call<v1::GetStatusRequest>>& calls,
                                          absl::Duration deadline) = 0;
  // A worker registered at `address` anew (a restarted daemon): the next
  // call there connects afresh (StubCache::Forget).
  virtual void Forget(const std::string& address) {}
};

// Whether the daemon at `address` holds `key`, the key a worker registers
// with: a GetStatus carrying it and `auth_token`, on a connection of its own
// (never one backing off from a daemon that listened there before), until
// `deadline`. true where the daemon says the call carried its own key
// (GetStatusResponse.worker_key_held): the registration comes from the
// daemon listening at its address. false where it answers without saying
// so (a worker older than that field). PERMISSION_DENIED where the daemon
// there refuses the key (WorkerKey::CheckNotOther) or the token;
// UNAVAILABLE where nothing answers there in time; FAILED_PRECONDITION for
// any other answer. Each names the address; what the daemon there said
// (or gRPC's reason a connection failed) travels only in the payload
// kProofAnswerPayload, escaped, which absl::Status's text shows in the
// coordinator's log and ToGrpcStatus never sends. `key` must pass
// CheckWorkerKey. With `caller` (the registration's server call, or null)
// the check ends, CANCELLED, as soon as that call is cancelled or its
// client goes away, rather than at `deadline`.
inline constexpr char kProofAnswerPayload[] = "colod/proof-answer";
absl::StatusOr<bool> ProveWorkerKey(const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                                    const AuthToken& auth_token, const std::string& address, const std::string& key,
                                    absl::Time deadline, const grpc::ServerContextBase* caller = nullptr);

// Over gRPC's callback API, with a channel per address (TLS or plaintext;
// StubCache's: one unused for 10 minutes is closed by a later call), the
// bearer token on every call, and each call's key.
class GrpcWorkerClient final : public WorkerClient {
 public:
  GrpcWorkerClient(std::shared_ptr<grpc::ChannelCredentials> credentials, AuthToken auth_token);

  std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls,
                                   absl::Duration deadline) override;
  std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls,
                                  absl::Duration deadline) override;
  std::vector<absl::Status> Probe(const std::vector<Call<v1::GetStatusRequest>>& calls,
                                  absl::Duration deadline) override;
  void Forget(const std::string& address) override { stubs_.Forget(address); }

 private:
  const AuthToken auth_token_;
  StubCache<v1::WorkerService> stubs_;
};

}  // namespace colod

#endif  // COLOD_SERVER_WORKER_CLIENT_H_
