#include "server/tensor_proxy.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/channel.h"
#include "grpcpp/create_channel.h"
#include "server/rpc_metrics.h"
#include "server/worker_client.h"

namespace colod {

TensorProxy::TensorProxy(JobManager* jobs, prometheus::Registry* metrics, Options options)
    : jobs_(jobs),
      rpc_duration_(&RpcDurationFamily(*metrics)),
      options_(std::move(options)),
      auth_(options_.auth_token, options_.worker_token),
      stubs_(options_.credentials) {}

absl::StatusOr<v1::Job> TensorProxy::RunningTensorJob(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
  if (!job.ok()) return job.status();
  if (job->spec().kind() != v1::JOB_KIND_TENSOR) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' is a ", v1::JobKind_Name(job->spec().kind()),
                                                      " job; tensors live in TENSOR jobs"));
  }
  if (job->state() != v1::JOB_STATE_RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' is ", JobStateName(job->state()), ", not running"));
  }
  return job;
}

absl::Status TensorProxy::AwaitTurn(const std::string& job_id, grpc::ServerContext* ctx, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // Map nodes stay put; a job's is erased only once no call waits on it.
  JobQueue& q = queues_[job_id];
  const int64_t ticket = q.next_ticket++;
  const auto my_turn = [&q, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return q.serving == ticket; };
  // mu_ is released while it waits; the caller's going away wakes nobody,
  // so it is looked at every slice.
  constexpr absl::Duration kSlice = absl::Milliseconds(100);
  while (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), kSlice)) {
    absl::Status gone;  // (a passed deadline cancels the call too: it is looked at first)
    // The caller's side reaches the deadline first (ours, from its
    // grpc-timeout, starts when the call arrives) and cancels the call: a
    // cancel this close to the deadline is the deadline's.
    constexpr absl::Duration kCallerAhead = absl::Milliseconds(100);
    if (absl::Now() >= deadline || (ctx->IsCancelled() && absl::Now() + kCallerAhead >= deadline)) {
      gone = absl::DeadlineExceededError("the deadline passed while the call waited for the job's earlier tensor "
                                         "calls");
    } else if (ctx->IsCancelled()) {
      gone = absl::CancelledError("the call was cancelled while it waited for the job's earlier tensor calls");
    } else {
      continue;
    }
    q.abandoned.insert(ticket);
    return gone;
  }
  return absl::OkStatus();
}

void TensorProxy::AdvanceLocked(JobQueue& q) {
  ++q.serving;
  while (q.abandoned.erase(q.serving) > 0) ++q.serving;
}

size_t TensorProxy::QueuedJobs() const {
  absl::MutexLock lock(&mu_);
  return queues_.size();
}

int64_t TensorProxy::CallsWaiting(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(job_id);
  if (it == queues_.end()) return 0;
  const JobQueue& q = it->second;
  return std::max<int64_t>(0, q.next_ticket - q.serving - 1 - static_cast<int64_t>(q.abandoned.size()));
}

void TensorProxy::EndTurn(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(job_id);
  if (it == queues_.end()) return;  // (never: this call's turn keeps it)
  AdvanceLocked(it->second);
  // Every ticket given out was served or abandoned: no call waits, nor holds
  // a reference to the queue (a waiter's ticket is never passed before its
  // own EndTurn or abandonment).
  if (it->second.serving == it->second.next_ticket) queues_.erase(it);
}

namespace {

const char* ConnectivityStateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "idle";
    case GRPC_CHANNEL_CONNECTING:
      return "connecting";
    case GRPC_CHANNEL_READY:
      return "connected";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "its connection refused or failed";
    case GRPC_CHANNEL_SHUTDOWN:
      return "shut down";
  }
  return "unknown state";
}

}  // namespace

void TensorProxy::ForgetConnection(const std::string& address) {
  stubs_.Forget(address);
  absl::MutexLock lock(&mu_);
  not_connected_since_.erase(address);
}

absl::Status TensorProxy::AwaitConnected(grpc::ServerContext* ctx, absl::Time deadline, const v1::MeshSpec& mesh,
                                         const std::vector<int>& ranks,
                                         const std::vector<std::shared_ptr<grpc::Channel>>& channels) {
  if (options_.connect_timeout <= absl::ZeroDuration()) return absl::OkStatus();
  // The channels not connected yet, and since when a call found each so.
  struct Waiting {
    size_t i;
    absl::Time since;
    grpc_connectivity_state state;
  };
  std::vector<Waiting> waiting;
  // Looks at the channels of `waiting` (all of them the first time).
  bool first = true;
  const auto look = [&](absl::Time now) {
    std::vector<std::pair<size_t, grpc_connectivity_state>> states;
    for (size_t i = 0; i < channels.size(); ++i) {
      if (!first && absl::c_none_of(waiting, [i](const Waiting& w) { return w.i == i; })) continue;
      states.emplace_back(i, channels[i]->GetState(/*try_to_connect=*/true));  // (connects an idle one)
    }
    first = false;
    std::vector<Waiting> still;
    absl::MutexLock lock(&mu_);
    for (const auto& [i, state] : states) {
      const std::string& address = mesh.ranks(ranks[i]).worker_address();
      if (state == GRPC_CHANNEL_READY) {
        not_connected_since_.erase(address);
        continue;
      }
      if (not_connected_since_.size() >= kMaxNotConnectedKept) {
        // Addresses no call has looked at in a long time (workers gone for good).
        for (auto it = not_connected_since_.begin(); it != not_connected_since_.end();) {
          it = now - it->second.seen > options_.connect_timeout + absl::Minutes(10) ? not_connected_since_.erase(it)
                                                                                    : std::next(it);
        }
      }
      NotConnected& nc = not_connected_since_.emplace(address, NotConnected{now, now}).first->second;
      // Not looked at for longer than connect_timeout: what it was then says
      // nothing of now (a drop of the moment after a long while connected,
      // which no call saw), and it gets its whole connect_timeout again.
      if (now - nc.seen > options_.connect_timeout) nc.since = now;
      nc.seen = now;
      still.push_back(Waiting{i, nc.since, state});
    }
    waiting = std::move(still);
  };
  look(absl::Now());
  constexpr absl::Duration kSlice = absl::Milliseconds(100);
  while (!waiting.empty()) {
    const absl::Time now = absl::Now();
    // A worker gets connect_timeout from when a call first found it not
    // connected: one that stays away costs the calls after that none.
    for (const Waiting& w : waiting) {
      if (now < w.since + options_.connect_timeout) continue;
      const v1::RankAssignment& a = mesh.ranks(ranks[w.i]);
      return absl::UnavailableError(absl::StrCat(
          "rank ", a.rank(), " (worker ", a.worker_id(), " at ", a.worker_address(), ") is not connected (",
          ConnectivityStateName(w.state), ") and has not been for ",
          absl::FormatDuration(absl::Trunc(now - w.since, absl::Milliseconds(1))),
          waiting.size() > 1 ? absl::StrCat(" (nor are ", waiting.size() - 1, " more ranks' workers)") : "",
          "; the call was sent to no rank"));
    }
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          "the deadline passed while the call waited for the ranks' workers to connect; it was sent to no rank");
    }
    if (ctx->IsCancelled()) {
      return absl::CancelledError(
          "the call was cancelled while it waited for the ranks' workers to connect; it was sent to no rank");
    }
    channels[waiting[0].i]->WaitForStateChange(waiting[0].state, absl::ToChronoTime(std::min(now + kSlice, deadline)));
    look(absl::Now());
  }
  return absl::OkStatus();
}

template <typename Req, typename Resp>
grpc::Status TensorProxy::FanOut(grpc::ServerContext* ctx, const char* method, const std::string& job_id,
                                 const Req& req, Resp* resp, Call<Req, Resp> call, int only_rank, Settle settle) {
  const absl::Time start = absl::Now();
  absl::Status status = auth_.Check(*ctx, CallerRole::kClient);
  if (status.ok()) status = FanOutToRanks(ctx, job_id, req, resp, call, only_rank, settle);
  ObserveRpc(*rpc_duration_, method, status, absl::Now() - start);
  MarkAnswered(*ctx);  // a worker's UNAVAILABLE passed on is the coordinator's answer
  return ToGrpcStatus(status);
}

template <typename Req, typename Resp>
absl::Status TensorProxy::FanOutToRanks(grpc::ServerContext* ctx, const std::string& job_id, const Req& req, Resp* resp,
                                        Call<Req, Resp> call, int only_rank, Settle settle) {
  absl::StatusOr<v1::Job> job = RunningTensorJob(job_id);
  if (!job.ok()) return job.status();
  const v1::MeshSpec& mesh = job->mesh();
  if (only_rank >= mesh.ranks_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", only_rank, " is outside the job's ", mesh.ranks_size(), " ranks"));
  }
  // The turn is awaited within the client's deadline; once it is taken the
  // calls go to every rank within the coordinator's own: a client that
  // gives up (a short deadline, a cancel) must not cut a call off after it
  // reached some ranks and before others, whose tensors would then differ.
  const absl::Time client = absl::FromChrono(ctx->deadline());
  std::vector<int> ranks;
  for (int r = 0; r < mesh.ranks_size(); ++r) {
    if (only_rank < 0 || r == only_rank) ranks.push_back(r);
  }
  std::vector<Resp> responses(ranks.size());
  std::vector<std::shared_ptr<Stub>> stubs(ranks.size());  // held until every call ended
  const auto rank_at = [&](size_t i) {
    const v1::RankAssignment& a = mesh.ranks(ranks[i]);
    return absl::StrCat("rank ", a.rank(), " (worker ", a.worker_id(), " at ", a.worker_address(), ")");
  };
  // Every rank's worker is connected before a call goes to any: a worker
  // that is not (its connection refused or reset for a moment) would fail
  // its call at once, while its peers waited for it in their collective
  // until the group's timeout, which breaks the job's group. The wait comes
  // before the turn, so that the job's calls wait for a worker side by side,
  // not one after another.
  std::vector<std::shared_ptr<grpc::Channel>> channels(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    StubCache<v1::TensorService>::StubAndChannel handle = stubs_.GetWithChannel(mesh.ranks(ranks[i]).worker_address());
    stubs[i] = std::move(handle.stub);
    channels[i] = std::move(handle.channel);
  }
  // Where a rank's error follows from the job's end or new placement under
  // the call, the answer is the job's state, as for a call after it.
  const auto stopped_under = [&](const std::string& where) -> std::optional<absl::Status> {
    absl::StatusOr<v1::Job> now = jobs_->Get(job_id);
    if (!now.ok()) {
      return absl::Status(now.status().code(), absl::StrCat(now.status().message(), "; the call met ", where));
    }
    if (now->state() != v1::JOB_STATE_RUNNING) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' is ", JobStateName(now->state()),
                                                        ", no longer running: its ranks stopped while the call ran (",
                                                        where, ")"));
    }
    if (now->generation() != job->generation()) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' was placed again while the call ran: ",
                                                        "its new ranks hold none of its tensors (", where, ")"));
    }
    return std::nullopt;
  };
  if (absl::Status connected =
          AwaitConnected(ctx, std::min(client, absl::Now() + options_.rpc_timeout), mesh, ranks, channels);
      !connected.ok()) {
    if (absl::IsUnavailable(connected)) {
      if (std::optional<absl::Status> state = stopped_under(std::string(connected.message()))) return *state;
    }
    return connected;
  }
  // Every rank sees this job's calls in one order: the calls of one fan-out
  // run at once (asynchronously, on no thread of their own), and the job's
  // next fan-out, in the order they arrived, starts once they all ended
  // (each within `deadline`). No lock is held meanwhile.
  RETURN_IF_ERROR(AwaitTurn(job_id, ctx, std::min(client, absl::Now() + options_.rpc_timeout)));
  {
    // The job as it is now that the turn came: one that ended, or was
    // placed again, while the call waited is answered as a call after that
    // (the ranks it was meant for hold its tensors no more), not sent to
    // workers that run it no longer.
    const absl::StatusOr<v1::Job> now = RunningTensorJob(job_id);
    if (!now.ok() || now->generation() != job->generation()) {
      EndTurn(job_id);
      if (!now.ok()) return now.status();
      return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' was placed again while the call waited ",
                                                        "for its turn: its new ranks hold none of its tensors"));
    }
  }
  if (options_.connect_timeout > absl::ZeroDuration()) {
    // A connection lost while the call waited for its turn: sent nowhere.
    // One being made again (idle, connecting: a GOAWAY, an idle timeout) is
    // given a moment; one that failed is not waited for with the turn held.
    const absl::Time reconnect_by = absl::Now() + std::min(options_.connect_timeout, absl::Seconds(1));
    for (size_t i = 0; i < ranks.size(); ++i) {
      grpc_connectivity_state state = channels[i]->GetState(/*try_to_connect=*/true);
      // (Until it connects, fails, or the second passes.)
      while ((state == GRPC_CHANNEL_IDLE || state == GRPC_CHANNEL_CONNECTING) && absl::Now() < reconnect_by) {
        channels[i]->WaitForStateChange(state, absl::ToChronoTime(reconnect_by));
        state = channels[i]->GetState(/*try_to_connect=*/true);
      }
      if (state == GRPC_CHANNEL_READY) continue;
      EndTurn(job_id);
      const std::string where = absl::StrCat(rank_at(i), " lost its connection (", ConnectivityStateName(state),
                                             ") while the call waited for its turn; the call was sent to no rank");
      if (std::optional<absl::Status> state_now = stopped_under(where)) return *state_now;
      return absl::UnavailableError(where);
    }
  }
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  const AuthToken& token = options_.worker_token.empty() ? options_.auth_token : options_.worker_token;
  const auto connect = [&](size_t i, grpc::ClientContext* c) {
    const v1::RankAssignment& a = mesh.ranks(ranks[i]);
    if (options_.worker_key_to_call) AddWorkerKey(*c, options_.worker_key_to_call(a.worker_id()));
    // The worker refuses a call meant for another generation than the one
    // it runs: a placement made since the job was looked at above.
    AddJobGeneration(*c, job->generation(), job->uid());
  };
  const auto start = [&](size_t i, grpc::ClientContext* c, std::function<void(grpc::Status)> done) {
    connect(i, c);
    (stubs[i]->async()->*call)(c, &req, &responses[i], std::move(done));
  };
  std::vector<absl::Status> statuses = RunAsyncCalls(ranks.size(), deadline, token, start);
  const size_t made = static_cast<size_t>(absl::c_count_if(statuses, [](const absl::Status& s) { return s.ok(); }));
  std::string undone;
  if constexpr (std::is_same_v<Req, v1::CreateTensorRequest>) {
    if (settle == Settle::kCreate && made > 0 && made < statuses.size()) {
      // Within the turn: the next call on the job finds the ranks alike.
      v1::DeleteTensorRequest del;
      del.set_job_id(req.job_id());
      del.set_name(req.name());
      std::vector<size_t> at;
      for (size_t i = 0; i < statuses.size(); ++i) {
        if (statuses[i].ok()) at.push_back(i);
      }
      std::vector<v1::DeleteTensorResponse> deleted(at.size());
      const std::vector<absl::Status> deletes =
          RunAsyncCalls(at.size(), absl::Now() + options_.rpc_timeout, token,
                        [&](size_t k, grpc::ClientContext* c, std::function<void(grpc::Status)> done) {
                          connect(at[k], c);
                          stubs[at[k]]->async()->DeleteTensor(c, &del, &deleted[k], std::move(done));
                        });
      // (ABORTED: the rank runs another generation now, and held the
      // tensor with the one that ended.)
      const size_t gone = static_cast<size_t>(
          absl::c_count_if(deletes, [](const absl::Status& s) { return s.ok() || absl::IsAborted(s); }));
      // A rank whose answer did not come (past the deadline, its connection
      // lost) may have made it all the same: its ranks then differ, which
      // their collectives refuse (the creation id), never mix.
      const bool unknown = absl::c_any_of(statuses, [](const absl::Status& s) {
        return absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s) || absl::IsCancelled(s) || absl::IsUnknown(s);
      });
      undone = absl::StrCat(gone == at.size() ? absl::StrCat("; the ", gone, " ranks that made it deleted it again")
                                              : absl::StrCat("; of the ", at.size(), " ranks that made it, ",
                                                             at.size() - gone, " could not delete it again"),
                            gone < at.size() || unknown ? ": delete it to be sure no rank holds it" : "");
    }
  }
  EndTurn(job_id);
  if (settle == Settle::kDelete && made > 0) {
    for (absl::Status& s : statuses) {
      if (absl::IsNotFound(s)) s = absl::OkStatus();  // an earlier delete reached that rank
    }
  }
  // The rank whose failure is its own, not one that followed from a peer's.
  std::vector<size_t> order(ranks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&statuses](size_t i) {
    return !absl::IsDeadlineExceeded(statuses[i]) && !absl::IsAborted(statuses[i]) && !absl::IsCancelled(statuses[i]);
  });
  for (const size_t i : order) {
    if (statuses[i].ok()) continue;
    const absl::Status& s = statuses[i];
    const std::string where = absl::StrCat(rank_at(i), ": ", s.message(), undone);
    // A job cancelled or placed again while the call ran aborts its ranks
    // (ABORTED, UNAVAILABLE, CANCELLED from the workers; DEADLINE_EXCEEDED
    // from one that stopped answering): the answer is the
    // job's state, as for a call that came after it. A rank's own error
    // (the collective's, where the call broke the group) is passed on.
    if (!absl::IsAborted(s) && !absl::IsUnavailable(s) && !absl::IsCancelled(s) && !absl::IsDeadlineExceeded(s)) {
      return absl::Status(s.code(), where);
    }
    if (std::optional<absl::Status> state = stopped_under(where)) return *state;
    return absl::Status(s.code(), where);
  }
  // Rank 0's (the answer carrying a gather's value), or the one rank's.
  size_t answer = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (mesh.ranks(ranks[i]).rank() == 0) answer = i;
  }
  *resp = std::move(responses[answer]);
  return absl::OkStatus();
}

grpc::Status TensorProxy::CreateTensor(grpc::ServerContext* ctx, const v1::CreateTensorRequest* req,
                                       v1::CreateTensorResponse* resp) {
  v1::CreateTensorRequest each = *req;
  {
    absl::MutexLock lock(&mu_);
    each.set_creation_id(absl::Uniform<uint64_t>(bits_));
  }
  return FanOut(ctx, "CreateTensor", req->job_id(), each, resp, &Stub::async::CreateTensor, -1, Settle::kCreate);
}

grpc::Status TensorProxy::SetDistSpec(grpc::ServerContext* ctx, const v1::SetDistSpecRequest* req,
                                      v1::SetDistSpecResponse* resp) {
  return FanOut(ctx, "SetDistSpec", req->job_id(), *req, resp, &Stub::async::SetDistSpec);
}

grpc::Status TensorProxy::GetShard(grpc::ServerContext* ctx, const v1::GetShardRequest* req,
                                   v1::GetShardResponse* resp) {
  if (req->rank() < 0) return ToGrpcStatus(absl::InvalidArgumentError("rank: must be >= 0"));
  return FanOut(ctx, "GetShard", req->job_id(), *req, resp, &Stub::async::GetShard, req->rank());
}

grpc::Status TensorProxy::GetGlobal(grpc::ServerContext* ctx, const v1::GetGlobalRequest* req,
                                    v1::GetGlobalResponse* resp) {
  // Every rank gathers; rank 0's answer is passed on, and only it carries
  // the value (up to 4 MiB: one copy here, not one a rank).
  v1::GetGlobalRequest each = *req;
  each.set_value_on_rank_zero_only(true);
  return FanOut(ctx, "GetGlobal", req->job_id(), each, resp, &Stub::async::GetGlobal);
}

grpc::Status TensorProxy::DescribeTensor(grpc::ServerContext* ctx, const v1::DescribeTensorRequest* req,
                                         v1::DescribeTensorResponse* resp) {
  return FanOut(ctx, "DescribeTensor", req->job_id(), *req, resp, &Stub::async::DescribeTensor, 0);
}

grpc::Status TensorProxy::ListTensors(grpc::ServerContext* ctx, const v1::ListTensorsRequest* req,
                                      v1::ListTensorsResponse* resp) {
  return FanOut(ctx, "ListTensors", req->job_id(), *req, resp, &Stub::async::ListTensors, 0);
}

grpc::Status TensorProxy::DeleteTensor(grpc::ServerContext* ctx, const v1::DeleteTensorRequest* req,
                                       v1::DeleteTensorResponse* resp) {
  return FanOut(ctx, "DeleteTensor", req->job_id(), *req, resp, &Stub::async::DeleteTensor, -1, Settle::kDelete);
}

}  // namespace colod
