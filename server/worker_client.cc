#include "server/worker_client.h"

#include <functional>

#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/net.h"
#include "common/text.h"
#include "grpcpp/create_channel.h"

namespace colod {
std::vector<absl::Status> RunAsyncCalls(
    size_t n, absl::Time deadline, const AuthToken& auth_token,
    const std::function<void(size_t, grpc::ClientContext*, std::function<void(grpc::Status)>)>& start) {
  std::vector<absl::Status> out(n);
  if (n == 0) return out;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
  absl::Mutex mu;
  size_t left = n;
  const auto when = absl::ToChronoTime(deadline);
  for (size_t i = 0; i < n; ++i) {
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(when);
    AddAuthToken(*contexts[i], auth_token);
    start(i, contexts[i].get(), [&, i](grpc::Status s) {
      absl::MutexLock lock(&mu);
      out[i] = FromGrpcStatus(s);
      --left;
    });
  }
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(+[](size_t* l) { return *l == 0; }, &left));
  return out;
}

GrpcWorkerClient::GrpcWorkerClient(std::shared_ptr<grpc::ChannelCredentials> credentials, AuthToken auth_token)
    : auth_token_(std::move(auth_token)), stubs_(std::move(credentials)) {}

std::vector<absl::Status> GrpcWorkerClient::Assign(const std::vector<Call<v1::AssignJobRequest>>& calls,
                                                   absl::Duration deadline) {
  std::vector<v1::AssignJobResponse> responses(calls.size());
  std::vector<std::shared_ptr<v1::WorkerService::Stub>> stubs(calls.size());  // held until every call ended
  const auto start = [&](size_t i, grpc::ClientContext* ctx, auto done) {
    AddWorkerKey(*ctx, calls[i].key);
    (stubs[i] = stubs_.Get(calls[i].address))->async()->AssignJob(ctx, &calls[i].request, &responses[i], std::move(done));
  };
  return RunAsyncCalls(calls.size(), absl::Now() + deadline, auth_token_, start);
}

std::vector<absl::Status> GrpcWorkerClient::Abort(const std::vector<Call<v1::AbortJobRequest>>& calls,
                                                  absl::Duration deadline) {
  std::vector<v1::AbortJobResponse> responses(calls.size());
  std::vector<std::shared_ptr<v1::WorkerService::Stub>> stubs(calls.size());
  const auto start = [&](size_t i, grpc::ClientContext* ctx, auto done) {
    AddWorkerKey(*ctx, calls[i].key);
    (stubs[i] = stubs_.Get(calls[i].address))->async()->AbortJob(ctx, &calls[i].request, &responses[i], std::move(done));
  };
  return RunAsyncCalls(calls.size(), absl::Now() + deadline, auth_token_, start);
}

std::vector<absl::Status> GrpcWorkerClient::Probe(const std::vector<Call<v1::GetStatusRequest>>& calls,
                                                  absl::Duration deadline) {
  std::vector<v1::GetStatusResponse> responses(calls.size());
  std::vector<std::shared_ptr<v1::WorkerService::Stub>> stubs(calls.size());
  const auto start = [&](size_t i, grpc::ClientContext* ctx, auto done) {
    AddWorkerKey(*ctx, calls[i].key);
    stubs[i] = stubs_.Get(calls[i].address);
    stubs[i]->async()->GetStatus(ctx, &calls[i].request, &responses[i], std::move(done));
  };
  return RunAsyncCalls(calls.size(), absl::Now() + deadline, auth_token_, start);
}

absl::StatusOr<bool> ProveWorkerKey(const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                                    const AuthToken& auth_token, const std::string& address, const std::string& key,
                                    absl::Time deadline, const grpc::ServerContextBase* caller) {
  grpc::ChannelArguments args;
  // A subchannel of its own: the process-wide pool may hold one to the
  // address still backing off from a daemon that died there.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto stub = v1::WorkerService::NewStub(grpc::CreateCustomChannel(
      DialTarget(address), credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(), args));
  // A child of the registration's call where there is one: gRPC cancels it
  // with its parent, so a caller that gives up frees the check's place in
  // the gate (KeyProofGate) at once.
  std::unique_ptr<grpc::ClientContext> owned =
      caller != nullptr ? grpc::ClientContext::FromServerContext(*caller) : std::make_unique<grpc::ClientContext>();
  grpc::ClientContext& ctx = *owned;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  // Fails fast (UNAVAILABLE) where the first connection attempt is refused;
  // one that hangs is bounded by the deadline.
  AddAuthToken(ctx, auth_token);
  AddWorkerKey(ctx, key);
  v1::GetStatusResponse resp;
  const absl::Status s = FromGrpcStatus(stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp));
  if (s.ok()) return resp.worker_key_held();
  // Whatever answers there is not trusted: its words are not passed on to
  // the caller, only kept (bounded, escaped) for the coordinator's log.
  absl::Status out;
  switch (s.code()) {
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      out = absl::PermissionDeniedError(
          absl::StrCat("the daemon at ", address, " does not hold the key this registration carries (it answered ",
                       absl::StatusCodeToString(s.code()),
                       "): a worker registers from the daemon that listens at its address, with its own key"));
      break;
    case absl::StatusCode::kCancelled:
      if (caller != nullptr && caller->IsCancelled()) {
        out = absl::CancelledError(absl::StrCat("the registration at ", address,
                                                " was cancelled by its caller before the daemon there answered"));
        break;
      }
      [[fallthrough]];
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      out = absl::UnavailableError(absl::StrCat(
          "the coordinator cannot reach ", address, ", the address this worker registers (",
          absl::StatusCodeToString(s.code()),
          "): it calls its workers there (a worker's --advertise-host names the host it is reached at)"));
      break;
    default:
      out = absl::FailedPreconditionError(absl::StrCat("the daemon at ", address,
                                                       " answered the check of its key with ",
                                                       absl::StatusCodeToString(s.code()),
                                                       ": is a colod worker listening there?"));
  }
  out.SetPayload(kProofAnswerPayload, absl::Cord(absl::CHexEscape(Utf8Prefix(s.message(), 512))));
  return out;
}

}  // namespace colod
