#include "client/coordinator_client.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/model_layout.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace colod {
namespace {

// Prefixes the coordinator's address to transport errors so that "connection
// refused" says which address was refused.
absl::Status Annotate(const grpc::Status& s, const grpc::ClientContext& ctx, const std::string& address,
                      absl::string_view rpc) {
  absl::Status st = FromGrpcStatus(s);
  if (st.ok()) return st;
  // gRPC's word for a request protobuf would not serialize: a string field
  // that is not UTF-8 (an argument or a path with other bytes).
  if (st.code() == absl::StatusCode::kInternal && st.message().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(rpc, ": the request could not be encoded: one of its texts (a name, ",
                                                   "an id, a path, a reason) is not valid UTF-8"));
  }
  if (st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded) {
    // Unreachable unless the coordinator answered so (it passes a worker's on).
    return MarkUnreachableUnlessAnswered(
        absl::Status(st.code(), absl::StrCat(rpc, " to coordinator ", address, ": ", st.message())), ctx);
  }
  return st;
}

// What a page of a List RPC holds.
const google::protobuf::RepeatedPtrField<v1::Worker>& Items(const v1::ListWorkersResponse& r) { return r.workers(); }
const google::protobuf::RepeatedPtrField<v1::Job>& Items(const v1::ListJobsResponse& r) { return r.jobs(); }

// Calls a paged List RPC for every page, each call with its own deadline,
// and appends each page's items to `out`. A token that does not move on (a
// broken server) would page for ever: DATA_LOSS.
template <typename Request, typename Response, typename Item, typename Call>
absl::Status AllPages(Request req, const char* rpc, const std::string& address, const Call& call,
                      std::vector<Item>* out, const std::function<void(grpc::ClientContext&)>& set_deadline) {
  do {
    grpc::ClientContext ctx;
    set_deadline(ctx);
    Response resp;
    RETURN_IF_ERROR(Annotate(call(&ctx, req, &resp), ctx, address, rpc));
    const auto& items = Items(resp);
    out->insert(out->end(), items.begin(), items.end());
    if (!resp.next_page_token().empty() && resp.next_page_token() == req.page_token()) {
      return absl::DataLossError(absl::StrCat(rpc, " on ", address, ": the coordinator sent page token '",
                                              resp.next_page_token(), "' again"));
    }
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  return absl::OkStatus();
}

}  // namespace

CoordinatorClient::CoordinatorClient(std::string address, Options options, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      options_(options),
      channel_(std::move(channel)),
      stub_(v1::CoordinatorService::NewStub(channel_)),
      tensors_(v1::TensorService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(const std::string& address,
                                                                            Options options) {
  RETURN_IF_ERROR(ParseHostPort(address, "coordinator address", /*allow_zero_port=*/false).status());
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout (the deadline of each call, --timeout): must be > 0");
  }
  if (options.tensor_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tensor_timeout (the deadline of each tensor call): must be > 0");
  }
  if (options.watch_reconnect_limit <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("watch_reconnect_limit: must be > 0");
  }
  if (absl::Status s = CheckAuthToken(options.auth_token.Sent()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("auth_token (--auth-token-file): ", s.message()));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, MakeChannelCredentials(options.tls));
  if (options.keepalive.time < kMinKeepaliveTime || options.keepalive.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("keepalive: time must be >= ", absl::FormatDuration(kMinKeepaliveTime),
                                                   " and timeout > 0"));
  }
  // HOST:PORT goes through DNS, whatever HOST is (gRPC would take "unix:7070"
  // for a local socket); another target (a scheme of gRPC's) as it is.
  const std::string target =
      ParseHostPort(address, "address", /*allow_zero_port=*/false).ok() ? DialTarget(address) : address;
  std::shared_ptr<grpc::Channel> channel = CreateKeepaliveChannel(target, credentials, options.keepalive);
  return std::unique_ptr<CoordinatorClient>(new CoordinatorClient(address, options, std::move(channel)));
}

void CoordinatorClient::SetDeadline(grpc::ClientContext& ctx) const {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  AddAuthToken(ctx, options_.auth_token);
}

void CoordinatorClient::SetTensorDeadline(grpc::ClientContext& ctx) const {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.tensor_timeout));
  AddAuthToken(ctx, options_.auth_token);
}

absl::StatusOr<std::vector<v1::Worker>> CoordinatorClient::ListWorkers(bool include_lost) {
  v1::ListWorkersRequest req;
  req.set_include_lost(include_lost);
  std::vector<v1::Worker> workers;
  const absl::Status listed = AllPages<v1::ListWorkersRequest, v1::ListWorkersResponse>(
      req, "ListWorkers", address_,
      [this](grpc::ClientContext* ctx, const v1::ListWorkersRequest& r, v1::ListWorkersResponse* resp) {
        return stub_->ListWorkers(ctx, r, resp);
      },
      &workers, [this](grpc::ClientContext& ctx) { SetDeadline(ctx); });
  if (!listed.ok()) return listed;
  return workers;
}

absl::StatusOr<v1::RegisterWorkerResponse> CoordinatorClient::RegisterWorker(const v1::WorkerInfo& info,
                                                                         const v1::WorkerStatus& status) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::RegisterWorkerRequest req;
  *req.mutable_worker() = info;
  *req.mutable_status() = status;
  v1::RegisterWorkerResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->RegisterWorker(&ctx, req, &resp), ctx, address_, "RegisterWorker"));
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(const std::string& worker_id,
                                                                   const v1::WorkerStatus& status) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id);
  *req.mutable_status() = status;
  v1::HeartbeatResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->Heartbeat(&ctx, req, &resp), ctx, address_, "Heartbeat"));
  return resp;
}

absl::StatusOr<v1::Job> CoordinatorClient::SubmitJob(const v1::JobSpec& spec,
                                                     const std::string& request_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;
  req.set_request_id(request_id);
  v1::SubmitJobResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->SubmitJob(&ctx, req, &resp), ctx, address_, "SubmitJob"));
  return resp.job();
}

absl::StatusOr<v1::Job> CoordinatorClient::GetJob(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  v1::GetJobResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->GetJob(&ctx, req, &resp), ctx, address_, "GetJob"));
  return resp.job();
}

absl::StatusOr<std::vector<v1::Job>> CoordinatorClient::ListJobs(const std::vector<v1::JobState>& states,
                                                                  v1::JobView view) {
  v1::ListJobsRequest req;
  for (v1::JobState s : states) req.add_states(s);
  req.set_view(view);
  std::vector<v1::Job> jobs;
  const absl::Status listed = AllPages<v1::ListJobsRequest, v1::ListJobsResponse>(
      req, "ListJobs", address_,
      [this](grpc::ClientContext* ctx, const v1::ListJobsRequest& r, v1::ListJobsResponse* resp) {
        return stub_->ListJobs(ctx, r, resp);
      },
      &jobs, [this](grpc::ClientContext& ctx) { SetDeadline(ctx); });
  if (!listed.ok()) return listed;
  return jobs;
}

absl::StatusOr<v1::Job> CoordinatorClient::CancelJob(const std::string& job_id, const std::string& reason) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::CancelJobRequest req;
  req.set_job_id(job_id);
  req.set_reason(reason);
  v1::CancelJobResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->CancelJob(&ctx, req, &resp), ctx, address_, "CancelJob"));
  return resp.job();
}

absl::Status CoordinatorClient::DeleteJob(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::DeleteJobRequest req;
  req.set_job_id(job_id);
  v1::DeleteJobResponse resp;
  return Annotate(stub_->DeleteJob(&ctx, req, &resp), ctx, address_, "DeleteJob");
}

absl::StatusOr<v1::GetMeshResponse> CoordinatorClient::GetMesh(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  v1::GetMeshRequest req;
  req.set_job_id(job_id);
  v1::GetMeshResponse resp;
  RETURN_IF_ERROR(Annotate(stub_->GetMesh(&ctx, req, &resp), ctx, address_, "GetMesh"));
  return resp;
}

absl::Status CoordinatorClient::WatchJob(const std::string& job_id, int64_t from_sequence, absl::Duration timeout,
                                         const std::function<bool(const v1::JobEvent&)>& on_event) {
  const absl::Time deadline = absl::Now() + timeout;
  int64_t next = std::max<int64_t>(from_sequence, 1);
  absl::Time unreachable_since = absl::InfiniteFuture();  // of the UNAVAILABLE answers in a row
  const auto unreachable = [&](absl::string_view last_error) {
    const absl::Duration for_ = absl::Now() - unreachable_since;
    return MarkUnreachable(absl::UnavailableError(absl::StrCat("WatchJob to coordinator ", address_,
                                                               ": unreachable for ", absl::FormatDuration(for_),
                                                               " while watching (the last error: ", last_error, ")")));
  };
  // The watch's own timeout: the job did not end within it, an answer of
  // sorts (exit 1), not an unreachable coordinator.
  const auto timed_out = [&] {
    return absl::DeadlineExceededError(absl::StrCat("WatchJob to coordinator ", address_,
                                                    ": the job did not end within the watch's ",
                                                    absl::FormatDuration(timeout)));
  };
  bool reached = false;  // the coordinator answered at least once
  while (true) {
    // The channel must connect within the limit (at once where it is
    // connected). A stream opened without waiting for it would wait as long
    // as gRPC's connect timeout (20 s) where the coordinator's host accepts
    // the connection but its process does not answer (stopped), past the
    // limit.
    const absl::Time since = std::min(unreachable_since, absl::Now());
    if (!channel_->WaitForConnected(absl::ToChronoTime(std::min(deadline, since + options_.watch_reconnect_limit)))) {
      unreachable_since = since;
      // The job's own timeout only where the coordinator was reached: one
      // never reached is unreachable (exit 69), whatever the timeout.
      if (reached && absl::Now() >= deadline) return timed_out();
      // Why: a call that fails at once where the channel knows (refused, a
      // TLS handshake, a name that does not resolve); else it connects no
      // further within its short deadline (a process that answers nothing).
      grpc::ClientContext probe;
      probe.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(200)));
      AddAuthToken(probe, options_.auth_token);
      v1::GetJobRequest get;
      get.set_job_id(job_id);
      v1::GetJobResponse got;
      const grpc::Status why = stub_->GetJob(&probe, get, &got);
      return unreachable(why.error_code() == grpc::StatusCode::UNAVAILABLE
                             ? why.error_message()
                             : "no connection within the limit (the host accepts connections; nothing answers)");
    }
    reached = true;  // connected: the coordinator's process answered
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    AddAuthToken(ctx, options_.auth_token);
    v1::WatchJobRequest req;
    req.set_job_id(job_id);
    req.set_from_sequence(next);
    std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader = stub_->WatchJob(&ctx, req);
    v1::JobEvent ev;
    while (reader->Read(&ev)) {
      unreachable_since = absl::InfiniteFuture();
      next = ev.sequence() + 1;
      if (!on_event(ev)) {
        ctx.TryCancel();
        reader->Finish();
        return absl::CancelledError("watch stopped");
      }
    }
    const grpc::Status s = reader->Finish();
    if (s.ok()) return absl::OkStatus();
    // A coordinator that restarted or a connection that broke: resume, but
    // not for ever. So too a stream the coordinator cancelled (this side
    // never cancels one it goes on reading): it ends a watch whose reader
    // fell behind for --stream-stall-timeout (a paged `coloctl watch |
    // less`), which goes on from its next event.
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::CANCELLED) {
      const absl::Time now = absl::Now();
      unreachable_since = std::min(unreachable_since, now);
      if (now - unreachable_since >= options_.watch_reconnect_limit) return unreachable(s.error_message());
      if (now + absl::Milliseconds(500) < deadline) {
        absl::SleepFor(absl::Milliseconds(500));
        continue;
      }
    }
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && absl::Now() >= deadline) return timed_out();
    return Annotate(s, ctx, address_, "WatchJob");
  }
}

absl::StatusOr<v1::TensorLayout> CoordinatorClient::CreateTensor(const v1::CreateTensorRequest& req) {
  grpc::ClientContext ctx;
  SetTensorDeadline(ctx);
  v1::CreateTensorResponse resp;
  RETURN_IF_ERROR(Annotate(tensors_->CreateTensor(&ctx, req, &resp), ctx, address_, "CreateTensor"));
  return resp.layout();
}

absl::StatusOr<v1::TensorLayout> CoordinatorClient::SetDistSpec(const std::string& job_id, const std::string& name,
                                                                const v1::DistSpec& spec) {
  grpc::ClientContext ctx;
  SetTensorDeadline(ctx);
  v1::SetDistSpecRequest req;
  req.set_job_id(job_id);
  req.set_name(name);
  *req.mutable_dist_spec() = spec;
  v1::SetDistSpecResponse resp;
  RETURN_IF_ERROR(Annotate(tensors_->SetDistSpec(&ctx, req, &resp), ctx, address_, "SetDistSpec"));
  return resp.layout();
}

absl::StatusOr<v1::GetShardResponse> CoordinatorClient::GetShard(const std::string& job_id, const std::string& name,
                                                                 int rank) {
  grpc::ClientContext ctx;
  SetTensorDeadline(ctx);
  v1::GetShardRequest req;
  req.set_job_id(job_id);
  req.set_name(name);
  req.set_rank(rank);
  v1::GetShardResponse resp;
  RETURN_IF_ERROR(Annotate(tensors_->GetShard(&ctx, req, &resp), ctx, address_, "GetShard"));
  return resp;
}

absl::StatusOr<v1::TensorValue> CoordinatorClient::GetGlobal(const std::string& job_id, const std::string& name) {
  grpc::ClientContext ctx;
  SetTensorDeadline(ctx);
  v1::GetGlobalRequest req;
  req.set_job_id(job_id);
  req.set_name(name);
  v1::GetGlobalResponse resp;
  RETURN_IF_ERROR(Annotate(tensors_->GetGlobal(&ctx, req, &resp), ctx, address_, "GetGlobal"));
  return resp.value();
}

absl::StatusOr<std::vector<v1::TensorLayout>> CoordinatorClient::ListTensors(const std::string& job_id) {
  std::vector<v1::TensorLayout> all;
  v1::ListTensorsRequest req;
  req.set_job_id(job_id);
  do {
    grpc::ClientContext ctx;
    SetTensorDeadline(ctx);
    v1::ListTensorsResponse resp;
    RETURN_IF_ERROR(Annotate(tensors_->ListTensors(&ctx, req, &resp), ctx, address_, "ListTensors"));
    // A page that names no tensor after the token would never end.
    if (!resp.next_page_token().empty() && resp.next_page_token() <= req.page_token()) {
      return absl::InternalError("ListTensors: a page token that does not advance");
    }
    all.insert(all.end(), resp.tensors().begin(), resp.tensors().end());
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  return all;
}

absl::Status CoordinatorClient::DeleteTensor(const std::string& job_id, const std::string& name) {
  grpc::ClientContext ctx;
  SetTensorDeadline(ctx);
  v1::DeleteTensorRequest req;
  req.set_job_id(job_id);
  req.set_name(name);
  v1::DeleteTensorResponse resp;
  return Annotate(tensors_->DeleteTensor(&ctx, req, &resp), ctx, address_, "DeleteTensor");
}

absl::StatusOr<v1::UploadModelResponse> CoordinatorClient::UploadModel(const std::string& dir, absl::Duration timeout) {
  std::vector<std::string> files;
  bool weights = false;
  ASSIGN_OR_RETURN(const std::vector<std::string> names, ListDirectory(dir));
  for (const std::string& name : names) {
    const bool tensors = absl::EndsWith(name, ".safetensors");
    if (IsRegularFile(dir + "/" + name) && (IsWeightsFile(name) || IsTokenizerFile(name) || name == "config.json")) {
      files.push_back(name);
      weights = weights || tensors;
    }
  }
  if (!weights) return absl::NotFoundError(absl::StrCat("'", dir, "' holds no .safetensors file"));
  std::sort(files.begin(), files.end());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  AddAuthToken(ctx, options_.auth_token);
  v1::UploadModelResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::UploadModelRequest>> writer = stub_->UploadModel(&ctx, &resp);
  std::string buffer(1 << 20, '\0');
  bool sent = true;
  for (const std::string& f : files) {
    std::ifstream in(dir + "/" + f, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", dir, "/", f, "'"));
    int64_t offset = 0;
    do {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      v1::UploadModelRequest req;
      req.mutable_chunk()->set_file(f);
      req.mutable_chunk()->set_offset(offset);
      req.mutable_chunk()->set_data(buffer.data(), static_cast<size_t>(in.gcount()));
      offset += in.gcount();
      sent = writer->Write(req);
    } while (in && sent);
    if (!sent) break;  // the stream broke: Finish says why
    if (in.bad()) {
      // Nothing of a part is stored: the call ends cancelled, the coordinator
      // drops what it received.
      ctx.TryCancel();
      (void)writer->Finish();
      return absl::DataLossError(absl::StrCat("reading '", dir, "/", f, "' failed midway"));
    }
  }
  writer->WritesDone();
  RETURN_IF_ERROR(Annotate(writer->Finish(), ctx, address_, "UploadModel"));
  return resp;
}

}  // namespace colod
