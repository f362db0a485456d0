#include "worker/comm/coordinator_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/proto_time.h"
#include "common/status_macros.h"

namespace colod {

CoordinatorStore::CoordinatorStore(std::shared_ptr<v1::CoordinatorService::StubInterface> stub, std::string scope,
                                   absl::Duration rpc_timeout, AuthToken auth_token, std::string worker_key,
                                   std::shared_ptr<AbortSignal> abort)
    : stub_(std::move(stub)),
      scope_(std::move(scope)),
      rpc_timeout_(rpc_timeout),
      auth_token_(std::move(auth_token)),
      worker_key_(std::move(worker_key)),
      abort_(std::move(abort)) {}

absl::Status CoordinatorStore::Call(absl::Time deadline,
                                    const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  absl::Duration backoff = kFirstRetryWait;
  absl::Status unavailable;  // the last refusal, which a last ask cut short by the deadline must not hide
  for (;;) {
    absl::Status s;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      // A coordinator not reachable this moment (a blip, a restart) is
      // waited for within the deadline, not failed at once: every rank of
      // the generation would fail with it.
      ctx.set_wait_for_ready(true);
      AddAuthToken(ctx, auth_token_);
      AddWorkerKey(ctx, worker_key_);
      // (Runs at once where the abort fired already: the call fails CANCELLED.)
      std::unique_ptr<AbortSignal::Registration> cancel =
          abort_ != nullptr ? abort_->OnAbort([&ctx] { ctx.TryCancel(); }) : nullptr;
      s = FromGrpcStatus(call(&ctx));
      cancel.reset();  // before ctx goes
    }
    if (!s.ok() && abort_ != nullptr && abort_->fired()) return abort_->Check();
    // (The call's own deadline: a Wait's keys that never came are answered
    // DEADLINE_EXCEEDED by the coordinator before it, and say so.)
    if (absl::IsDeadlineExceeded(s) && !unavailable.ok() && absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat(unavailable.message(), " (asked again until the call's deadline: ", s.message(), ")"));
    }
    // UNAVAILABLE: a connection lost in the call, a coordinator shutting
    // down, or a store full for now (other jobs' scopes are freed as their
    // generations end). Every call here may be made again: a Set writes the
    // same value, a Get or a Wait reads.
    const absl::Duration left = deadline - absl::Now();
    if (!absl::IsUnavailable(s) || left <= absl::ZeroDuration()) return s;
    unavailable = s;
    const absl::Duration wait = std::min(backoff, left);
    if (abort_ != nullptr) {
      absl::Notification woken;
      const std::unique_ptr<AbortSignal::Registration> wake = abort_->OnAbort([&woken] { woken.Notify(); });
      woken.WaitForNotificationWithTimeout(wait);
      RETURN_IF_ERROR(abort_->Check());
    } else {
      absl::SleepFor(wait);
    }
    if (absl::Now() >= deadline) return unavailable;
    backoff = std::min(backoff * 2, kMaxRetryWait);
  }
}

absl::Status CoordinatorStore::Set(absl::string_view key, std::string value) {
  v1::KvSetRequest req;
  req.set_scope(scope_);
  req.set_key(std::string(key));
  req.set_value(std::move(value));
  v1::KvSetResponse resp;
  return Call(absl::Now() + rpc_timeout_, [&](grpc::ClientContext* ctx) { return stub_->KvSet(ctx, req, &resp); });
}

absl::StatusOr<std::string> CoordinatorStore::Get(absl::string_view key) {
  v1::KvGetRequest req;
  req.set_scope(scope_);
  req.set_key(std::string(key));
  v1::KvGetResponse resp;
  RETURN_IF_ERROR(
      Call(absl::Now() + rpc_timeout_, [&](grpc::ClientContext* ctx) { return stub_->KvGet(ctx, req, &resp); }));
  return std::move(*resp.mutable_value());
}

absl::StatusOr<std::vector<std::string>> CoordinatorStore::Wait(const std::vector<std::string>& keys,
                                                                absl::Duration timeout) {
  v1::KvWaitRequest req;
  req.set_scope(scope_);
  for (const std::string& k : keys) req.add_keys(k);
  v1::KvWaitResponse resp;
  const absl::Time until = absl::Now() + timeout;
  RETURN_IF_ERROR(Call(until + rpc_timeout_, [&](grpc::ClientContext* ctx) {
    // Asked again after a failure: for what is left of the wait.
    *req.mutable_timeout() = ToProtoDuration(std::max(until - absl::Now(), absl::Milliseconds(1)));
    return stub_->KvWait(ctx, req, &resp);
  }));
  if (static_cast<size_t>(resp.values_size()) != keys.size()) {
    return absl::DataLossError(absl::StrCat("the coordinator answered a wait for ", keys.size(), " keys with ",
                                            resp.values_size(), " values"));
  }
  return std::vector<std::string>(resp.values().begin(), resp.values().end());
}

}  // namespace colod
