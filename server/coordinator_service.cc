#include "server/coordinator_service.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "server/rpc_metrics.h"
#include "spec/job_validation.h"

namespace colod {
namespace {

// Whether a call carries a worker's key (Scheduler::CarriesKey).
struct CallCarries {
  const grpc::ServerContext& ctx;
  bool operator()(absl::string_view key) const { return CarriesWorkerKey(ctx, key); }
};

// ListJobs pages.
constexpr int kDefaultJobsPage = 100;
constexpr int kMaxJobsPage = 1000;
// ListWorkers pages: workers, and bytes (a page ends after the worker that
// reaches them).
constexpr int kMaxWorkersPage = 1000;
constexpr size_t kWorkersPageBytes = size_t{1} << 20;
// ListJobs pages end after the job that brings them to this many bytes (a
// job's config_json alone may take 1 MiB in the FULL view; its checkpoint
// list half of that in either).
constexpr size_t kJobsPageBytes = size_t{1} << 20;

// A CancelJob's or DeregisterWorker's reason, recorded in a job's history
// (which every full read of the job carries): at most 1024 bytes.
absl::Status CheckReason(const std::string& reason) {
  if (reason.size() > 1024) return absl::InvalidArgumentError("reason: longer than 1024 bytes");
  return absl::OkStatus();
}

// The key after which a page starts: "" for the first page, else what
// `token` ("after:KEY", from a next_page_token of `rpc`) names.
absl::StatusOr<std::string> PageAfter(const std::string& token, absl::string_view rpc) {
  if (token.empty()) return std::string();
  constexpr absl::string_view kAfter = "after:";
  if (!absl::StartsWith(token, kAfter) || token.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("page_token: not a token from ", rpc, "' next_page_token"));
  }
  return token.substr(kAfter.size());
}
// The events a watch copies out of the job manager at a time (under its
// lock): a long run's history holds one a step.
constexpr size_t kWatchBatch = 1024;
// The wait a DownloadModel refused at --max-concurrent-downloads suggests
// (SetRetryAfter): a download takes seconds at least.
constexpr absl::Duration kDownloadRetryAfter = absl::Seconds(1);

absl::Status RequireId(absl::string_view field, absl::string_view value) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  return absl::OkStatus();
}

// 128 random bits, hex: a coordinator process's incarnation.
std::string NewIncarnation() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

}  // namespace

CoordinatorServiceImpl::CoordinatorServiceImpl(WorkerRegistry* workers, JobManager* jobs,
                                               RendezvousStore* store,
                                               prometheus::Registry* metrics, TokenAuth auth,
                                               Scheduler* scheduler, UploadStore* uploads, int max_watches,
                                               StallWatchdog* stalls)
    : workers_(workers),
      jobs_(jobs),
      store_(store),
      rpc_duration_(&RpcDurationFamily(*metrics)),
      auth_(std::move(auth)),
      scheduler_(scheduler),
      uploads_(uploads),
      incarnation_(NewIncarnation()),
      max_watches_(max_watches),
      stalls_(stalls) {}

template <typename Fn>
grpc::Status CoordinatorServiceImpl::Instrument(grpc::ServerContext* ctx, const char* method, CallerRole role,
                                               Fn&& fn) {
  const absl::Time start = absl::Now();
  absl::Status status = auth_.Check(*ctx, role);
  if (!status.ok()) LogRefused(*ctx, method, status);
  if (status.ok()) status = fn();
  ObserveRpc(*rpc_duration_, method, status, absl::Now() - start);
  MarkAnswered(*ctx);
  return ToGrpcStatus(status);
}

absl::Status CoordinatorServiceImpl::CheckCaller(const grpc::ServerContext& ctx, const char* method,
                                                 const std::string& worker_id) {
  const std::string key = workers_->KeyOf(worker_id);
  if (key.empty() || CarriesWorkerKey(ctx, key)) return absl::OkStatus();
  absl::Status refused = absl::PermissionDeniedError(absl::StrCat(
      "this call names worker ", worker_id, " without the key it registered with: only that worker may make it"));
  LogRefused(ctx, method, refused);
  return refused;
}

absl::Status CoordinatorServiceImpl::CheckScopeCaller(const grpc::ServerContext& ctx, const char* method,
                                                      const std::string& scope) {
  if (scheduler_ == nullptr) return absl::OkStatus();
  absl::Status s =
      scheduler_->CheckScopeCaller(scope, CallCarries{ctx});
  if (!s.ok()) LogRefused(ctx, method, s);
  return s;
}

absl::StatusOr<bool> CoordinatorServiceImpl::ProveKey(const grpc::ServerContext& ctx, const std::string& address,
                                                      const std::string& key) {
  const std::string peer = PeerHost(ctx.peer());
  if (absl::Status admitted = proof_gate_->Enter(peer, address); !admitted.ok()) {
    LogRefused(ctx, "RegisterWorker", admitted);
    return admitted;
  }
  bool unreachable = false;
  const absl::Cleanup leave = [&] { proof_gate_->Leave(peer, address, unreachable); };
  const absl::Time own = absl::Now() + proof_gate_->options().deadline;
  const absl::Time caller = absl::FromChrono(ctx.deadline());
  absl::StatusOr<bool> held = prove_key_(address, key, std::min(own, caller), ctx);
  if (!held.ok()) {
    // Remembered only where the check held its thread for its whole time:
    // a refused connection costs nothing, and a caller's shorter deadline
    // says nothing of the address.
    unreachable = absl::IsUnavailable(held.status()) && caller >= own && absl::Now() >= own;
    LogRefused(ctx, "RegisterWorker", held.status());
  }
  return held;
}

void CoordinatorServiceImpl::LogRefused(const grpc::ServerContext& ctx, const char* method,
                                        const absl::Status& status) {
  const absl::Time now = absl::Now();
  int64_t quiet = 0;
  {
    absl::MutexLock lock(&refused_mu_);
    if (now < next_refusal_log_) {
      ++refusals_not_logged_;
      return;
    }
    next_refusal_log_ = now + absl::Seconds(10);
    quiet = std::exchange(refusals_not_logged_, 0);
  }
  COLOD_LOG(WARNING) << "refused " << method << " from " << ctx.peer() << ": " << status
                     << (quiet > 0 ? absl::StrCat(" (and ", quiet, " other calls refused so since the last such line)")
                                   : "");
}

grpc::Status CoordinatorServiceImpl::RegisterWorker(grpc::ServerContext* ctx,
                                                    const v1::RegisterWorkerRequest* req,
                                                    v1::RegisterWorkerResponse* resp) {
  return Instrument(ctx, "RegisterWorker", CallerRole::kWorker, [&]() -> absl::Status {
    if (!req->has_worker()) return absl::InvalidArgumentError("worker: required");
    const std::string& address = req->worker().address();
    const std::string& key = req->worker_key();
    // All of it is checked before anything is sent to its address.
    RETURN_IF_ERROR(WorkerRegistry::Validate(req->worker(), key));
    // Refused before the live worker's connection is dropped below.
    WorkerRegistry::AtAddress at = WorkerRegistry::AtAddress::kClaimed;
    if (!key.empty() && prove_key_) {
      ASSIGN_OR_RETURN(const bool held, ProveKey(*ctx, address, key));
      if (held) at = WorkerRegistry::AtAddress::kProven;
    }
    if (at == WorkerRegistry::AtAddress::kClaimed) {
      if (absl::Status taken = workers_->CheckAddress(address, key); !taken.ok()) {
        LogRefused(*ctx, "RegisterWorker", taken);
        return taken;
      }
    }
    // The old connection goes before the worker can be placed: a tick
    // between the two would assign it on the connection still backing off.
    if (on_register_) on_register_(address);
    ASSIGN_OR_RETURN(WorkerRegistry::Registration reg, workers_->Register(req->worker(), req->status(), key, at));
    if (!reg.replaced.empty()) {
      COLOD_LOG(WARNING) << "worker " << reg.replaced << " at " << address << " was replaced by " << reg.worker_id
                         << ": the daemon listening there now holds another key (the worker process restarted)";
    }
    resp->set_worker_id(reg.worker_id);
    resp->set_worker_key_taken(!req->worker_key().empty());
    *resp->mutable_heartbeat_interval() = ToProtoDuration(reg.heartbeat_interval);
    *resp->mutable_lease_duration() = ToProtoDuration(reg.lease_duration);
    if (scheduler_ != nullptr) scheduler_->Wake();
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                               v1::HeartbeatResponse* resp) {
  return Instrument(ctx, "Heartbeat", CallerRole::kWorker, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("worker_id", req->worker_id()));
    RETURN_IF_ERROR(CheckCaller(*ctx, "Heartbeat", req->worker_id()));
    ASSIGN_OR_RETURN(absl::Time expiry, workers_->Heartbeat(req->worker_id(), req->status()));
    *resp->mutable_lease_expire_time() = ToProtoTimestamp(expiry);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::DeregisterWorker(grpc::ServerContext* ctx,
                                                      const v1::DeregisterWorkerRequest* req,
                                                      v1::DeregisterWorkerResponse*) {
  return Instrument(ctx, "DeregisterWorker", CallerRole::kWorker, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("worker_id", req->worker_id()));
    RETURN_IF_ERROR(CheckReason(req->reason()));
    RETURN_IF_ERROR(CheckCaller(*ctx, "DeregisterWorker", req->worker_id()));
    RETURN_IF_ERROR(workers_->Deregister(req->worker_id(), req->reason()));
    COLOD_LOG(INFO) << "worker " << req->worker_id() << " left"
                    << (req->reason().empty() ? "" : absl::StrCat(": ", req->reason()));
    if (scheduler_ != nullptr) scheduler_->Wake();  // its job ends now, not at the next sweep
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::ListWorkers(grpc::ServerContext* ctx,
                                                 const v1::ListWorkersRequest* req,
                                                 v1::ListWorkersResponse* resp) {
  return Instrument(ctx, "ListWorkers", CallerRole::kClient, [&]() -> absl::Status {
    if (req->page_size() < 0) return absl::InvalidArgumentError("page_size: must be >= 0");
    const int limit = req->page_size() == 0 ? kMaxWorkersPage : std::min(req->page_size(), kMaxWorkersPage);
    ASSIGN_OR_RETURN(const std::string after, PageAfter(req->page_token(), "ListWorkers"));
    WorkerRegistry::Page page = workers_->ListPage(req->include_lost(), after, limit, kWorkersPageBytes);
    for (v1::Worker& w : page.workers) *resp->add_workers() = std::move(w);
    if (page.more) resp->set_next_page_token(absl::StrCat("after:", resp->workers().rbegin()->info().worker_id()));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                               v1::SubmitJobResponse* resp) {
  return Instrument(ctx, "SubmitJob", CallerRole::kClient, [&]() -> absl::Status {
    if (!req->has_spec()) return absl::InvalidArgumentError("spec: required");
    if (req->request_id().size() > kMaxRequestIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("request_id: at most ", kMaxRequestIdBytes, " bytes"));
    }
    RETURN_IF_ERROR(ValidateJobSpec(req->spec()));
    // A job no registered worker has the memory for is refused now, not
    // left pending or failed on a worker that ran out. The floor is computed
    // here, once, and stored with the job.
    const v1::MemoryFloor floor = JobMemoryFloor(req->spec());
    RETURN_IF_ERROR(CheckMemoryFits(floor, workers_->List(/*include_lost=*/false)));
    // Last: finding the upload keeps it from collection for its grace again,
    // which a submit that is refused must not do.
    const std::string& upload = req->spec().model().upload_id();
    if (!upload.empty() && (uploads_ == nullptr || !uploads_->Exists(upload))) {
      return absl::InvalidArgumentError(absl::StrCat("spec.model.upload_id: no upload '", upload, "'"));
    }
    ASSIGN_OR_RETURN(*resp->mutable_job(), jobs_->Submit(req->spec(), req->request_id(), floor));
    if (scheduler_ != nullptr) scheduler_->Wake();
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                            v1::GetJobResponse* resp) {
  return Instrument(ctx, "GetJob", CallerRole::kClient, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    ASSIGN_OR_RETURN(*resp->mutable_job(), jobs_->Get(req->job_id()));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                              v1::ListJobsResponse* resp) {
  return Instrument(ctx, "ListJobs", CallerRole::kClient, [&]() -> absl::Status {
    std::vector<v1::JobState> states;
    for (int s : req->states()) {
      if (!v1::JobState_IsValid(s)) return absl::InvalidArgumentError(absl::StrCat("states: unknown value ", s));
      states.push_back(static_cast<v1::JobState>(s));
    }
    if (!v1::JobView_IsValid(req->view())) {
      return absl::InvalidArgumentError(absl::StrCat("view: unknown value ", static_cast<int>(req->view())));
    }
    if (req->page_size() < 0) return absl::InvalidArgumentError("page_size: must be >= 0");
    const int limit = req->page_size() == 0 ? kDefaultJobsPage : std::min(req->page_size(), kMaxJobsPage);
    ASSIGN_OR_RETURN(const std::string after, PageAfter(req->page_token(), "ListJobs"));
    // A job's id, as its tokens name: jobs are ordered by their ids'
    // numbers, which another key has none of.
    if (!after.empty() && !JobManager::IsJobId(after)) {
      return absl::InvalidArgumentError("page_token: not a token from ListJobs' next_page_token");
    }
    const bool full = req->view() == v1::JOB_VIEW_FULL;
    JobManager::Page page = jobs_->ListPage(
        states, after, limit,
        [full](v1::Job& j) {
          if (full) return;
          j.mutable_spec()->mutable_model()->clear_config_json();
          j.mutable_mesh()->clear_groups();
          j.mutable_mesh()->clear_ranks();
          j.clear_attempt_failures();
          j.mutable_forward_result()->clear_unread_tensors();  // (their count stays)
        },
        kJobsPageBytes);
    for (v1::Job& j : page.jobs) *resp->add_jobs() = std::move(j);
    if (page.more) resp->set_next_page_token(absl::StrCat("after:", resp->jobs(resp->jobs_size() - 1).job_id()));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                                               v1::DeleteJobResponse*) {
  return Instrument(ctx, "DeleteJob", CallerRole::kClient, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    return jobs_->Delete(req->job_id());
  });
}

grpc::Status CoordinatorServiceImpl::CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                               v1::CancelJobResponse* resp) {
  return Instrument(ctx, "CancelJob", CallerRole::kClient, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    RETURN_IF_ERROR(CheckReason(req->reason()));
    if (scheduler_ != nullptr) {
      ASSIGN_OR_RETURN(*resp->mutable_job(), scheduler_->Cancel(req->job_id(), req->reason()));
    } else {
      ASSIGN_OR_RETURN(*resp->mutable_job(), jobs_->Cancel(req->job_id(), req->reason()));
    }
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                              grpc::ServerWriter<v1::JobEvent>* writer) {
  return Instrument(ctx, "WatchJob", CallerRole::kClient, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    if (watches_.fetch_add(1) >= max_watches_) {
      watches_.fetch_sub(1);
      return absl::ResourceExhaustedError(
          absl::StrCat(max_watches_, " WatchJob streams run already (the coordinator's --max-watch-streams); "
                       "retry later or poll GetJob"));
    }
    struct Release {
      std::atomic<int>& n;
      ~Release() { n.fetch_sub(1); }
    } release{watches_};
    int64_t next = std::max<int64_t>(req->from_sequence(), 1);
    // A client that stops reading blocks a Write (flow control) and would
    // hold this thread and its watch slot for ever: the stall watchdog ends
    // it. Waiting for events is no stall.
    const std::unique_ptr<StallWatchdog::Watch> watch =
        stalls_ != nullptr ? stalls_->Start(ctx, absl::StrCat("WatchJob of ", req->job_id(), " to ", ctx->peer()))
                           : nullptr;
    // Poll in short waits so that a cancelled client or a server shutdown
    // ends the stream promptly.
    while (!ctx->IsCancelled()) {
      ASSIGN_OR_RETURN(JobManager::Events batch,
                       jobs_->WaitForEvents(req->job_id(), next, absl::Milliseconds(250), kWatchBatch));
      if (watch != nullptr) watch->Progress();
      for (const v1::JobEvent& ev : batch.events) {
        if (!writer->Write(ev)) {
          if (watch != nullptr && watch->stalled()) {
            return absl::DeadlineExceededError("the client read nothing for --stream-stall-timeout: cancelled");
          }
          return absl::CancelledError("client went away");
        }
        if (watch != nullptr) watch->Progress();
        next = ev.sequence() + 1;
      }
      if (batch.finished) return absl::OkStatus();
    }
    return absl::CancelledError("watch cancelled");
  });
}

grpc::Status CoordinatorServiceImpl::GetMesh(grpc::ServerContext* ctx, const v1::GetMeshRequest* req,
                                             v1::GetMeshResponse* resp) {
  return Instrument(ctx, "GetMesh", CallerRole::kClient, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(req->job_id()));
    if (job.mesh().ranks_size() == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", req->job_id(), "' has no ranks assigned yet (state ",
                       JobStateName(job.state()), ")"));
    }
    *resp->mutable_mesh() = job.mesh();
    resp->set_state(job.state());
    resp->set_generation(job.generation());
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::UploadModel(grpc::ServerContext* ctx,
                                                 grpc::ServerReader<v1::UploadModelRequest>* reader,
                                                 v1::UploadModelResponse* resp) {
  return Instrument(ctx, "UploadModel", CallerRole::kClient, [&]() -> absl::Status {
    if (uploads_ == nullptr) return absl::UnimplementedError("this coordinator stores no uploads");
    ASSIGN_OR_RETURN(std::unique_ptr<UploadStore::Writer> writer, uploads_->Begin());
    std::unique_ptr<StallWatchdog::Watch> watch =
        stalls_ != nullptr ? stalls_->Start(ctx, absl::StrCat("UploadModel from ", ctx->peer())) : nullptr;
    v1::UploadModelRequest req;
    while (reader->Read(&req)) {
      // Only bytes move an upload: chunks without data would hold its place
      // (and one of --max-concurrent-uploads) for ever.
      if (watch != nullptr && !req.chunk().data().empty()) watch->Progress();
      RETURN_IF_ERROR(writer->Add(req.chunk()));
    }
    // The watch ends before Finish, which syncs every file (minutes on a
    // slow disk): a cancel then would reach a client whose upload is stored.
    const bool stalled = watch != nullptr && watch->stalled();
    watch.reset();
    if (stalled) {
      return absl::DeadlineExceededError("no chunk came for --stream-stall-timeout: the upload was cancelled");
    }
    if (ctx->IsCancelled()) return absl::CancelledError("the upload was cancelled");
    ASSIGN_OR_RETURN(*resp, writer->Finish());
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::DownloadModel(grpc::ServerContext* ctx, const v1::DownloadModelRequest* req,
                                                   grpc::ServerWriter<v1::ModelChunk>* writer) {
  return Instrument(ctx, "DownloadModel", CallerRole::kWorker, [&]() -> absl::Status {
    if (uploads_ == nullptr) return absl::UnimplementedError("this coordinator stores no uploads");
    RETURN_IF_ERROR(RequireId("upload_id", req->upload_id()));
    // Only for a worker placed in a job that uses the upload, checked before
    // it takes a place.
    if (scheduler_ != nullptr) {
      absl::Status placed = scheduler_->CheckDownloadCaller(req->upload_id(), CallCarries{*ctx});
      if (!placed.ok()) {
        LogRefused(*ctx, "DownloadModel", placed);
        return placed;
      }
    }
    // Holds one of --max-concurrent-downloads, and keeps the upload from
    // being collected, until the stream ends.
    absl::StatusOr<std::unique_ptr<UploadStore::Reading>> began = uploads_->BeginReading(req->upload_id());
    // At the bound the refusal is one to ask again after: marked so.
    if (absl::IsResourceExhausted(began.status())) SetRetryAfter(*ctx, kDownloadRetryAfter);
    RETURN_IF_ERROR(began.status());
    const std::unique_ptr<UploadStore::Reading> reading = *std::move(began);
    const std::string& dir = reading->path();
    constexpr size_t kChunk = 1 << 20;
    // A listing or a read that fails sends an error, never a part of the model
    // (UNAVAILABLE midway).
    ASSIGN_OR_RETURN(std::vector<std::string> files, ListDirectory(dir));
    std::sort(files.begin(), files.end());
    const std::string what = absl::StrCat("DownloadModel of ", req->upload_id(), " to ", ctx->peer());
    const std::unique_ptr<StallWatchdog::Watch> watch = stalls_ != nullptr ? stalls_->Start(ctx, what) : nullptr;
    std::string buffer(kChunk, '\0');
    for (const std::string& f : files) {
      std::ifstream in(dir + "/" + f, std::ios::binary);
      if (!in) return absl::InternalError(absl::StrCat("cannot read ", dir, "/", f));
      int64_t offset = 0;
      do {
        in.read(buffer.data(), static_cast<std::streamsize>(kChunk));
        v1::ModelChunk chunk;
        chunk.set_file(f);
        chunk.set_offset(offset);
        chunk.set_data(buffer.data(), static_cast<size_t>(in.gcount()));
        offset += in.gcount();
        if (!writer->Write(chunk)) {
          if (watch != nullptr && watch->stalled()) {
            return absl::DeadlineExceededError("the client read nothing for --stream-stall-timeout: cancelled");
          }
          return absl::CancelledError("the client went away");
        }
        if (watch != nullptr) watch->Progress();
      } while (in && !ctx->IsCancelled());
      if (in.bad()) return absl::InternalError(absl::StrCat("reading ", dir, "/", f, " failed midway"));
    }
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::ReportProgress(grpc::ServerContext* ctx, const v1::ReportProgressRequest* req,
                                                    v1::ReportProgressResponse* resp) {
  return Instrument(ctx, "ReportProgress", CallerRole::kWorker, [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireId("job_id", req->job_id()));
    RETURN_IF_ERROR(RequireId("worker_id", req->worker_id()));
    RETURN_IF_ERROR(CheckCaller(*ctx, "ReportProgress", req->worker_id()));
    if (scheduler_ == nullptr) return absl::FailedPreconditionError("this coordinator runs no jobs");
    absl::StatusOr<bool> stop =
        scheduler_->Report(*req, CallCarries{*ctx});
    if (absl::IsPermissionDenied(stop.status())) LogRefused(*ctx, "ReportProgress", stop.status());
    if (!stop.ok()) return stop.status();
    resp->set_stop(*stop);
    resp->set_coordinator_incarnation(incarnation_);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* req,
                                           v1::KvSetResponse*) {
  return Instrument(ctx, "KvSet", CallerRole::kWorker, [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckScopeCaller(*ctx, "KvSet", req->scope()));
    return store_->Set(req->scope(), req->key(), req->value());
  });
}

grpc::Status CoordinatorServiceImpl::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                                           v1::KvGetResponse* resp) {
  return Instrument(ctx, "KvGet", CallerRole::kWorker, [&]() -> absl::Status {
    RETURN_IF_ERROR(CheckScopeCaller(*ctx, "KvGet", req->scope()));
    ASSIGN_OR_RETURN(*resp->mutable_value(), store_->Get(req->scope(), req->key()));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::KvWait(grpc::ServerContext* ctx, const v1::KvWaitRequest* req,
                                            v1::KvWaitResponse* resp) {
  return Instrument(ctx, "KvWait", CallerRole::kWorker, [&]() -> absl::Status {
    if (!req->has_timeout()) return absl::InvalidArgumentError("timeout: required");
    RETURN_IF_ERROR(CheckScopeCaller(*ctx, "KvWait", req->scope()));
    if (!IsValidProtoDuration(req->timeout())) return absl::InvalidArgumentError("timeout: not a valid Duration");
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    ASSIGN_OR_RETURN(std::vector<std::string> values,
                     store_->Wait(req->scope(), keys, FromProtoDuration(req->timeout()),
                                  [ctx] { return ctx->IsCancelled(); }));
    for (std::string& v : values) resp->add_values(std::move(v));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::Barrier(grpc::ServerContext* ctx, const v1::BarrierRequest* req,
                                             v1::BarrierResponse*) {
  return Instrument(ctx, "Barrier", CallerRole::kWorker, [&]() -> absl::Status {
    if (!req->has_timeout()) return absl::InvalidArgumentError("timeout: required");
    RETURN_IF_ERROR(CheckScopeCaller(*ctx, "Barrier", req->scope()));
    if (!IsValidProtoDuration(req->timeout())) return absl::InvalidArgumentError("timeout: not a valid Duration");
    return store_->Barrier(req->scope(), req->name(), req->rank(), req->world_size(),
                           FromProtoDuration(req->timeout()), [ctx] { return ctx->IsCancelled(); });
  });
}

}  // namespace colod
