#include "worker/daemon/job_runner.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "worker/colo/mesh.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/shardformer/run_forward.h"
#include "worker/tensor/npy.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"
#ifdef COLOD_WITH_CUDA
#include "worker/colo/nccl_process_group.h"
#endif

namespace colod {
namespace {

namespace fs = std::filesystem;

// DIR/config.json from the spec and links to the weights (at `weights`, the
// spec's path or the downloaded upload), so that the model loads like any
// Hugging Face directory.
absl::Status MaterializeModel(const v1::ModelSpec& model, const std::string& weights_path, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", model.config_json()));
  const fs::path weights = fs::absolute(weights_path, ec);
  if (ec || !fs::exists(weights, ec)) {
    return absl::NotFoundError(
        absl::StrCat("spec.model.weights_path: '", weights_path, "' does not exist on this worker"));
  }
  std::vector<fs::path> files;
  if (fs::is_directory(weights, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(weights, ec)) {
      const std::string name = e.path().filename().string();
      if (absl::EndsWith(name, ".safetensors") || name == "model.safetensors.index.json") files.push_back(e.path());
    }
    if (files.empty()) {
      return absl::NotFoundError(absl::StrCat("spec.model.weights_path: '", weights_path,
                                              "' holds no .safetensors file"));
    }
  }
  if (files.empty()) {
    fs::create_symlink(weights, fs::path(dir) / "model.safetensors", ec);
  } else {
    for (const fs::path& f : files) {
      fs::create_symlink(f, fs::path(dir) / f.filename(), ec);
      if (ec) break;
    }
  }
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot link the weights into '", dir, "': ", ec.message()));
  return absl::OkStatus();
}

v1::ReportProgressRequest Phase(v1::RankPhase phase, const std::string& message = "") {
  v1::ReportProgressRequest r;
  r.mutable_status()->set_phase(phase);
  r.mutable_status()->set_message(message);
  return r;
}

// The `kind` label of colod_rank_running.
std::string KindName(v1::JobKind kind) {
  switch (kind) {
    case v1::JOB_KIND_TRAIN:
      return "train";
    case v1::JOB_KIND_FORWARD:
      return "forward";
    case v1::JOB_KIND_TENSOR:
      return "tensor";
    default:
      return "unknown";
  }
}

}  // namespace

JobRunner::JobRunner(Options options) : options_(std::move(options)) {}

JobRunner::~JobRunner() {
  std::thread t;
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    active = active_;
    t = std::move(thread_);
  }
  if (active) Stop(*active, "the worker is shutting down");
  if (t.joinable()) t.join();
}

absl::Status JobRunner::Assign(const v1::AssignJobRequest& req) {
  if (req.job_id().empty()) return absl::InvalidArgumentError("job_id: required");
  if (req.spec().kind() != v1::JOB_KIND_TRAIN && req.spec().kind() != v1::JOB_KIND_FORWARD &&
      req.spec().kind() != v1::JOB_KIND_TENSOR) {
    return absl::InvalidArgumentError(absl::StrCat("spec.kind: this worker runs TRAIN, FORWARD and TENSOR jobs, not ",
                                                   v1::JobKind_Name(req.spec().kind())));
  }
  if (req.rendezvous_scope().empty()) return absl::InvalidArgumentError("rendezvous_scope: required");
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(req.spec().shard()));
  if (req.rank() < 0 || req.rank() >= mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", req.rank(), " is outside the mesh of ", mesh.world_size(), " ranks"));
  }
  if (req.mesh().world_size() != mesh.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh.world_size: ", req.mesh().world_size(),
                                                   " does not match the shard config's ", mesh.world_size()));
  }
  absl::MutexLock lock(&mu_);
  if (active_) {
    const v1::AssignJobRequest& now = active_->request;
    if (now.job_id() == req.job_id() && now.generation() == req.generation() && now.rank() == req.rank()) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat("this worker runs rank ", now.rank(), " of job '",
                                                      now.job_id(), "' (generation ", now.generation(), ")"));
  }
  if (thread_.joinable()) thread_.join();  // the previous rank's thread has ended (active_ is cleared last)
  auto active = std::make_shared<Active>();
  active->request = req;
  active_ = active;
  thread_ = std::thread([this, active] { Run(active); });
  return absl::OkStatus();
}

void JobRunner::Stop(Active& active, const std::string& reason) {
  active.stop = true;
  std::shared_ptr<ProcessGroup> pg;
  {
    absl::MutexLock lock(&active.mu);
    if (active.stop_reason.empty()) active.stop_reason = reason;
    pg = active.pg;
  }
  // Outside every lock (an abort may meet a rendezvous in progress): fails
  // the rank's next collective at once and ends one in flight, or a
  // communicator being made.
  if (pg != nullptr) pg->Abort(absl::AbortedError(reason));
}

absl::Status JobRunner::Abort(const v1::AbortJobRequest& req) {
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    if (!active_ || active_->request.job_id() != req.job_id()) {
      return absl::NotFoundError(absl::StrCat("this worker does not run job '", req.job_id(), "'"));
    }
    if (req.generation() < active_->request.generation()) {
      return absl::AbortedError(absl::StrCat("generation ", req.generation(), " is older than the running ",
                                             active_->request.generation()));
    }
    active = active_;
  }
  Stop(*active, req.reason().empty() ? "aborted by the coordinator" : req.reason());
  return absl::OkStatus();
}

v1::WorkerStatus JobRunner::Status() const {
  absl::MutexLock lock(&mu_);
  v1::WorkerStatus s;
  s.set_last_error(last_error_);
  if (!active_) {
    s.set_state(v1::WORKER_STATE_IDLE);
    return s;
  }
  s.set_state(v1::WORKER_STATE_BUSY);
  s.set_job_id(active_->request.job_id());
  s.set_rank(active_->request.rank());
  s.set_generation(active_->request.generation());
  for (v1::CollectiveProgress& p : active_->recorder->Progress(absl::Now())) *s.add_collectives() = std::move(p);
  return s;
}

bool JobRunner::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == nullptr; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

bool JobRunner::Report(const v1::AssignJobRequest& request, const v1::ReportProgressRequest& report) {
  v1::ReportProgressRequest req = report;
  req.set_job_id(request.job_id());
  req.set_generation(request.generation());
  req.set_rank(request.rank());
  req.set_worker_id(options_.worker_id ? options_.worker_id() : "");
  const bool final = req.has_result();
  for (int attempt = 0; attempt < (final ? 5 : 2); ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AddAuthToken(ctx, options_.auth_token);
    v1::ReportProgressResponse resp;
    const grpc::Status s = options_.coordinator->ReportProgress(&ctx, req, &resp);
    if (s.ok()) return resp.stop();
    // The job is gone or moved on: nothing to tell, and nothing to run for.
    if (s.error_code() == grpc::StatusCode::ABORTED || s.error_code() == grpc::StatusCode::NOT_FOUND ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      return true;
    }
    COLOD_LOG(WARNING) << "job " << request.job_id() << ": progress report failed: " << FromGrpcStatus(s);
    absl::SleepFor(absl::Milliseconds(200) * (attempt + 1));
  }
  return false;
}

void JobRunner::Run(std::shared_ptr<Active> active) {
  const v1::AssignJobRequest& req = active->request;
  COLOD_LOG(INFO) << "job " << req.job_id() << " generation " << req.generation() << ": running rank " << req.rank()
                  << " of " << req.mesh().world_size();
  if (options_.metrics != nullptr) {
    // Assign checked the mesh; the tensor-parallel ranks of a replica share its tokens.
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::FromShardConfig(req.spec().shard());
    const int replica_ranks = mesh.ok() ? mesh->AxisSize("tp").value_or(1) : 1;
    active->metrics = options_.metrics->StartRank(req.job_id(), req.rank(), KindName(req.spec().kind()), replica_ranks);
  }
  absl::Status s = RunRank(*active);
  // Every communicator is gone with RunRank's process group: the rank's
  // series end here, before the coordinator hears of the end.
  active->metrics.reset();
  if (active->stop) {
    absl::MutexLock lock(&active->mu);
    s = absl::AbortedError(active->stop_reason);
  }
  v1::ReportProgressRequest result;
  result.mutable_result()->set_code(static_cast<int>(s.code()));
  result.mutable_result()->set_message(std::string(s.message()));
  if (s.ok() && active->forward) *result.mutable_result()->mutable_forward() = *active->forward;
  if (!s.ok()) DumpFlightRecorder(*active);
  Report(req, result);
  if (s.ok()) {
    COLOD_LOG(INFO) << "job " << req.job_id() << ": rank " << req.rank() << " finished";
  } else {
    COLOD_LOG(WARNING) << "job " << req.job_id() << ": rank " << req.rank() << " ended: " << s;
  }
  absl::MutexLock lock(&mu_);
  if (!s.ok()) last_error_ = absl::StrCat(req.job_id(), " rank ", req.rank(), ": ", s.ToString());
  active_.reset();
}

absl::Status JobRunner::RunRank(Active& active) {
  const v1::AssignJobRequest& req = active.request;
  const std::string dir = absl::StrFormat("%s/%s-gen-%d-rank-%d", options_.work_dir, req.job_id(), req.generation(),
                                          req.rank());
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};
  {
    // Left behind by a worker killed mid-job (the cleanup never ran), under a
    // coordinator that numbers its jobs from 1 again: not this rank's.
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  const bool training = req.spec().kind() == v1::JOB_KIND_TRAIN;
  std::shared_ptr<const train::PreparedTrain> run;
  shardformer::ShardConfig shard;
  shard.layout = req.spec().shard();
  if (req.spec().kind() != v1::JOB_KIND_TENSOR) {  // TRAIN and FORWARD jobs load a model
    if (Report(req, Phase(v1::RANK_PHASE_LOADING, "opening the model and the data"))) {
      return absl::AbortedError("the job no longer runs");
    }
    ASSIGN_OR_RETURN(std::string weights, Weights(req.spec().model()));
    RETURN_IF_ERROR(MaterializeModel(req.spec().model(), weights, dir + "/model"));
  }
  if (training) {
    ASSIGN_OR_RETURN(train::TrainOptions options,
                     train::TrainOptionsFromSpec(req.spec(), dir + "/model", options_.cuda));
    ASSIGN_OR_RETURN(run, train::PrepareTrain(options));
    shard = options.shard;
  }
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(req.spec().shard()));

  if (Report(req, Phase(v1::RANK_PHASE_RENDEZVOUS, "connecting to the other ranks"))) {
    return absl::AbortedError("the job no longer runs");
  }
  CoordinatorStore store(options_.coordinator, req.rendezvous_scope(), options_.rpc_timeout, options_.auth_token);
  ProcessGroup::CommFactory inner;
  auto abort_signal = std::make_shared<AbortSignal>();  // ProcessGroup::Abort reaches NCCL init and splits
  if (options_.cuda) {
#ifdef COLOD_WITH_CUDA
    NcclCommunicator::Options o;
    o.device = options_.device_ordinal;
    o.timeout = options_.comm_timeout;
    o.abort_signal = abort_signal;
    inner = NcclFactory(&store, o, req.rank(), mesh.world_size());
    shard.device = Device::Cuda(options_.device_ordinal);
#else
    return absl::FailedPreconditionError("this worker was built without CUDA");
#endif
  } else {
    GlooCommunicator::Options o;
    o.hostname = options_.host;
    o.timeout = options_.comm_timeout;
    o.abort_signal = abort_signal;  // ProcessGroup::Abort reaches a rendezvous waiting for a dead peer
    inner = ProcessGroup::GlooFactory(&store, o);
  }
  // Outlives `pg` (Run ends it after this returns), so its observers outlive the communicators.
  WorkerMetrics::Rank* metrics = active.metrics.get();
  ProcessGroup::CommFactory factory = [inner, metrics, recorder = active.recorder](const ProcessGroup::GroupInfo& g)
      -> absl::StatusOr<std::unique_ptr<Communicator>> {
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, inner(g));
    return std::unique_ptr<Communicator>(new InstrumentedCommunicator(
        std::move(c), metrics != nullptr ? metrics->CollectiveObserver(g.axis) : nullptr, recorder, g.prefix));
  };
  ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroup> pg,
                   ProcessGroup::Create(mesh, req.rank(), factory, options_.comm_timeout, abort_signal));
  {
    absl::MutexLock lock(&active.mu);
    active.pg = pg;
  }
  if (active.stop) pg->Abort(absl::AbortedError("the job no longer runs"));  // stopped before the group existed
  struct Detach {
    Active& active;
    ~Detach() {
      absl::MutexLock lock(&active.mu);
      active.pg = nullptr;
    }
  } detach{active};
  if (options_.cuda) RETURN_IF_ERROR(pg->InitAxes());
  if (req.spec().kind() == v1::JOB_KIND_FORWARD) return RunForward(active, *pg, shard, dir + "/model");
  if (!training) return ServeTensors(active, *pg);

  train::RankHooks hooks;
  hooks.stop = [&active] { return active.stop.load(); };
  hooks.on_start = [&] {
    if (metrics != nullptr) metrics->TrainingStarted();
    if (Report(req, Phase(v1::RANK_PHASE_TRAINING))) active.stop = true;
  };
  hooks.on_step = [&](const train::StepStats& st) {
    if (metrics != nullptr) {
      metrics->ObserveStep(st.seconds, st.rank_tokens, st.loss, st.param_bytes, st.grad_bytes, st.optimizer_bytes);
      if (st.cuda) metrics->ObserveDevicePool(st.pool_reserved_bytes, st.pool_used_bytes);
    }
    if (req.rank() != 0) return;
    v1::ReportProgressRequest r;
    v1::StepProgress& p = *r.mutable_step();
    p.set_step(st.step);
    p.set_loss(st.loss);
    p.set_learning_rate(st.lr);
    p.set_grad_norm(st.grad_norm);
    p.set_tokens_per_second(st.tokens_per_second);
    *p.mutable_step_duration() = ToProtoDuration(absl::Seconds(st.seconds));
    p.set_param_bytes(st.param_bytes);
    p.set_grad_bytes(st.grad_bytes);
    p.set_optimizer_bytes(st.optimizer_bytes);
    p.set_checkpoint(st.checkpoint);
    if (Report(req, r)) active.stop = true;
  };
  return train::RunTrainRank(*run, req.rank(), *pg, shard, hooks);
}

void JobRunner::DumpFlightRecorder(const Active& active) {
  const v1::AssignJobRequest& req = active.request;
  const std::string dir = options_.work_dir + "/flight-recorder";
  const std::string path = absl::StrFormat("%s/%s-gen-%d-rank-%d.json", dir, req.job_id(), req.generation(), req.rank());
  std::error_code ec;
  fs::create_directories(dir, ec);
  const absl::Status s = WriteFileAtomically(path, active.recorder->ToJson());
  if (s.ok()) {
    COLOD_LOG(INFO) << "job " << req.job_id() << ": rank " << req.rank() << "'s last collectives are in " << path;
  } else {
    COLOD_LOG(WARNING) << "job " << req.job_id() << ": cannot dump the flight recorder: " << s;
  }
}

absl::StatusOr<std::string> JobRunner::Weights(const v1::ModelSpec& model) {
  if (model.upload_id().empty()) return model.weights_path();
  // Downloaded once per worker into WORK_DIR/uploads/ID (via ID.tmp, so a
  // broken download is never mistaken for a whole one).
  const std::string dir = absl::StrCat(options_.work_dir, "/uploads/", model.upload_id());
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return dir;
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.download_timeout));
  AddAuthToken(ctx, options_.auth_token);
  v1::DownloadModelRequest req;
  req.set_upload_id(model.upload_id());
  std::unique_ptr<grpc::ClientReaderInterface<v1::ModelChunk>> reader = options_.coordinator->DownloadModel(&ctx, req);
  v1::ModelChunk chunk;
  std::ofstream out;
  std::string file;
  while (reader->Read(&chunk)) {
    if (!IsPlainFileName(chunk.file())) {
      return absl::InternalError(absl::StrCat("the coordinator sent a bad file name '", chunk.file(), "'"));
    }
    if (chunk.file() != file) {
      out.close();
      file = chunk.file();
      out.open(tmp + "/" + file, std::ios::binary | std::ios::trunc);
    }
    out.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp, "/", file));
  }
  out.close();
  const grpc::Status s = reader->Finish();
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("downloading upload '", model.upload_id(), "': ", s.error_message()));
  }
  fs::rename(tmp, dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename '", tmp, "': ", ec.message()));
  return dir;
}

absl::Status JobRunner::RunForward(Active& active, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                                   const std::string& model_dir) {
  const v1::ForwardConfig& f = active.request.spec().forward();
  shardformer::ForwardRequest request;
  request.model_dir = model_dir;
  request.shard = shard;
  absl::StatusOr<Tensor> ids = ReadNpy(f.input_path());
  if (!ids.ok()) return absl::Status(ids.status().code(), absl::StrCat("spec.forward.input_path: ", ids.status().message()));
  request.ids = *ids;
  RETURN_IF_ERROR(shardformer::CheckForward(request).status());
  if (Report(active.request, Phase(v1::RANK_PHASE_RUNNING, "forward pass"))) return absl::AbortedError("the job no longer runs");
  ASSIGN_OR_RETURN(shardformer::ForwardResult out, shardformer::ForwardRank(request, pg, shard));
  if (pg.rank() != 0) return absl::OkStatus();
  v1::ForwardResult result;
  result.set_loss(out.loss);
  result.set_tokens(out.tokens);
  for (int64_t d : out.logits.shape()) result.add_logits_shape(d);
  if (!f.logits_path().empty()) {
    RETURN_IF_ERROR(WriteNpy(f.logits_path(), out.logits));
    result.set_logits_path(f.logits_path());
  }
  active.forward = result;
  return absl::OkStatus();
}

absl::Status JobRunner::ServeTensors(Active& active, ProcessGroup& pg) {
  auto host = std::make_shared<TensorHost>(&pg, options_.cuda ? Device::Cuda(options_.device_ordinal) : Device::Cpu());
  {
    absl::MutexLock lock(&active.mu);
    active.tensors = host;
  }
  if (Report(active.request, Phase(v1::RANK_PHASE_SERVING, "hosting ColoTensors"))) active.stop = true;
  while (!active.stop) absl::SleepFor(absl::Milliseconds(20));
  {
    absl::MutexLock lock(&active.mu);
    active.tensors.reset();
  }
  host->Close();  // waits for a call in progress: the group must outlive it
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<TensorHost>> JobRunner::Tensors(const std::string& job_id) const {
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    active = active_;
  }
  if (!active || active->request.job_id() != job_id) {
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' does not run on this worker"));
  }
  if (active->request.spec().kind() != v1::JOB_KIND_TENSOR) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' is not a TENSOR job"));
  }
  absl::MutexLock lock(&active->mu);
  if (!active->tensors) return absl::UnavailableError(absl::StrCat("job '", job_id, "' is still connecting"));
  return active->tensors;
}

}  // namespace colod
