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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/worker.grpc.pb.h"
#include "grpcpp/security/credentials.h"
#include "server/stub_cache.h"

namespace colod {

// Runs `n` asynchronous gRPC calls at once, on no thread of their own:
// start(i, ctx, done) starts call i on `ctx` (its deadline and auth token
// set) through a stub's async() interface, which calls done(status) once it
// ends. Returns when every call ended, with their statuses in order. Thread-
// safe; the caller's thread waits.
std::vector<absl::Status> RunAsyncCalls(
    size_t n, absl::Time deadline, const std::string& auth_token,
    const std::function<void(size_t, grpc::ClientContext*, std::function<void(grpc::Status)>)>& start);

// Implementations are thread-safe. Each method returns once every call of
// the batch ended (answered, failed or past `deadline`), with their statuses
// in the order of the batch.
class WorkerClient {
 public:
  template <typename Request>
  struct Call {
    std::string address;
    Request request;
  };

  virtual ~WorkerClient() = default;
  virtual std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls,
                                           absl::Duration deadline) = 0;
  virtual std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls,
                                          absl::Duration deadline) = 0;
  // GetStatus of each address: OK when the worker answers.
  virtual std::vector<absl::Status> Probe(const std::vector<std::string>& addresses, absl::Duration deadline) = 0;
  // A worker registered at `address` anew (a restarted daemon): the next
  // call there connects afresh (StubCache::Forget).
  virtual void Forget(const std::string& address) {}
};

// Whether the daemon at `address` holds `key`, the key a worker registers
// with: a GetStatus carrying it and `auth_token`, on a connection of its own
// (never one backing off from a daemon that listened there before), within
// `deadline`. A daemon refuses a call carrying another process's key
// (WorkerKey::CheckNotOther), so an answer proves that the registration
// comes from the daemon listening at its address. OK then; PERMISSION_DENIED
// when the daemon there refuses the key or the token; UNAVAILABLE when
// nothing answers there in time; FAILED_PRECONDITION for any other answer.
// Each names the address. `key` must pass CheckWorkerKey.
absl::Status ProveWorkerKey(const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                            const std::string& auth_token, const std::string& address, const std::string& key,
                            absl::Duration deadline);

// The key of the worker at an address (WorkerRegistry::KeyAt; "" none).
using WorkerKeyAt = std::function<std::string(const std::string& address)>;

// Over gRPC's callback API, with a channel per address (TLS or plaintext;
// StubCache's: one unused for 10 minutes is closed by a later call), the
// bearer token on every call, and the key of the worker called (`key_at`,
// where given).
class GrpcWorkerClient final : public WorkerClient {
 public:
  GrpcWorkerClient(std::shared_ptr<grpc::ChannelCredentials> credentials, std::string auth_token,
                   WorkerKeyAt key_at = nullptr);

  std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls,
                                   absl::Duration deadline) override;
  std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls,
                                  absl::Duration deadline) override;
  std::vector<absl::Status> Probe(const std::vector<std::string>& addresses, absl::Duration deadline) override;
  void Forget(const std::string& address) override { stubs_.Forget(address); }

 private:
  // AddWorkerKey of the worker at `address`.
  void AddKey(grpc::ClientContext* ctx, const std::string& address) const;

  const std::string auth_token_;
  const WorkerKeyAt key_at_;
  StubCache<v1::WorkerService> stubs_;
};

}  // namespace colod

#endif  // COLOD_SERVER_WORKER_CLIENT_H_
