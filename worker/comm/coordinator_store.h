// The Store of worker daemons: the coordinator's rendezvous KV over gRPC,
// scoped to one job generation.
#ifndef COLOD_WORKER_COMM_COORDINATOR_STORE_H_
#define COLOD_WORKER_COMM_COORDINATOR_STORE_H_

#include <functional>
#include <memory>
#include <string>

#include "colod/v1/coordinator.grpc.pb.h"
#include "common/auth.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/store.h"

namespace colod {

// Thread-safe (gRPC stubs are).
class CoordinatorStore final : public Store {
 public:
  // `scope` is the job generation's rendezvous scope (AssignJobRequest.
  // rendezvous_scope). Each Set/Get carries `rpc_timeout`; a Wait carries its
  // own timeout plus `rpc_timeout` of slack for the transport. Within that
  // deadline a call waits for the coordinator to be reachable and is made
  // again where it fails UNAVAILABLE (a lost connection, a store full for
  // now).
  // `auth_token` (if not empty) is sent as the bearer token of every call,
  // `worker_key` (if not empty) as the worker's key (common/auth.h): the
  // coordinator takes a placed job's scope only from its workers.
  // `abort` (if set: the rank's, ProcessGroup::Abort fires it) cancels the
  // calls in flight when it fires, and fails later ones at once, with its
  // reason: a rank aborted in its rendezvous (a worker shutting down, a
  // peer's failure) need not wait out the coordinator's answer.
  CoordinatorStore(std::shared_ptr<v1::CoordinatorService::StubInterface> stub, std::string scope,
                   absl::Duration rpc_timeout = absl::Seconds(10), AuthToken auth_token = {},
                   std::string worker_key = "", std::shared_ptr<AbortSignal> abort = nullptr);

  absl::Status Set(absl::string_view key, std::string value) override;
  absl::StatusOr<std::string> Get(absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>& keys,
                                                absl::Duration timeout) override;

 private:
  // `call` on a context with `deadline`, the token and key, cancelled if
  // the abort fires; the abort's reason where it fired. Made again while it
  // fails UNAVAILABLE and the deadline allows, after kFirstRetryWait,
  // doubling up to kMaxRetryWait (an abort ends the wait).
  absl::Status Call(absl::Time deadline, const std::function<grpc::Status(grpc::ClientContext*)>& call);
  static constexpr absl::Duration kFirstRetryWait = absl::Milliseconds(50);
  static constexpr absl::Duration kMaxRetryWait = absl::Seconds(2);

  const std::shared_ptr<v1::CoordinatorService::StubInterface> stub_;
  const std::string scope_;
  const absl::Duration rpc_timeout_;
  const AuthToken auth_token_;
  const std::string worker_key_;
  const std::shared_ptr<AbortSignal> abort_;
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_COORDINATOR_STORE_H_
