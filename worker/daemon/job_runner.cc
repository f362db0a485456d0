#include "worker/daemon/job_runner.h"

#include <malloc.h>

#include <exception>
#include <filesystem>
#include <memory>
#include <new>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/grpc_status.h"
#include "common/host_memory.h"
#include "common/int_math.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "kernels/device.h"
#include "spec/job_validation.h"
#include "spec/mesh.h"
#include "spec/model_config.h"
#include "worker/colo/rank_group.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/shardformer/run_forward.h"
#include "worker/tensor/npy.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

namespace colod {
namespace {

// How long an assignment waits for the teardown of a rank whose end was
// reported (well within the coordinator's call's deadline).
constexpr absl::Duration kEndedRankTeardownWait = absl::Seconds(3);

// What a rank ends with where a report's answer said the job no longer
// runs: the coordinator's reason where it gave one.
absl::Status NoLongerRuns(const ProgressReporter& reporter) {
  const std::string why = reporter.StopReason();
  return absl::AbortedError(why.empty() ? "the job no longer runs" : why);
}

namespace fs = std::filesystem;

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

// RESOURCE_EXHAUSTED when one rank of the job needs more memory than
// `memory_bytes` at least (0: unchecked): the floor the coordinator sent
// (computed once, at submit), or from an older coordinator that sends none,
// the spec's. A family this config parser does not know (a user policy's)
// is checked by its own loader instead.
// The rank's memory floor: the coordinator's, or from the spec (an older
// coordinator sends none).
RankMemoryFloor RankFloor(const v1::AssignJobRequest& req) {
  return MemoryFloorFromProto(req.has_memory_floor() ? req.memory_floor() : JobMemoryFloor(req.spec()));
}

absl::Status AdmitModel(const v1::AssignJobRequest& req, int64_t memory_bytes) {
  if (memory_bytes <= 0) return absl::OkStatus();
  const RankMemoryFloor floor = RankFloor(req);
  if (floor.total_bytes <= memory_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the model needs ", DescribeMemoryFloor(floor),
      "; this worker has ", GiB(memory_bytes)));
}

// A forward's logits, [batch, seq, vocab] in f32 (an image classifier's
// [batch, labels]), are gathered whole on every rank and copied to the host
// when they are written (logits_path); otherwise each rank holds only its
// replica's rows. With the model, they must fit the worker's memory, or the
// rank would fail at an allocation (or a CPU worker be killed for it) after
// minutes of work. The input's size is known only here, once it is read. An
// estimate that refuses what cannot fit: two copies of what the rank holds
// (the gathered logits and their host copy; or its rows' logits and the
// loss's softmax of them) and the model's floor against the worker's one
// budget (on a GPU the host copy is in host memory; when gathered, the
// replica's own rows and the tp shards come on top).
absl::Status AdmitForwardLogits(const v1::AssignJobRequest& req, const shardformer::ForwardRequest& forward,
                                const ModelConfig& config, int64_t memory_bytes) {
  if (memory_bytes <= 0) return absl::OkStatus();
  const Shape logits = shardformer::ForwardLogitsShape(forward, config);
  Shape held = logits;
  const int dp = std::max(1, forward.shard.layout.data_parallel_size());
  if (!forward.gather_logits) held[0] /= dp;  // CheckForward: dp divides the batch
  const std::optional<int64_t> one = CheckedBytes(held, static_cast<int64_t>(sizeof(float)));
  const RankMemoryFloor floor = RankFloor(req);
  const std::optional<int64_t> two = one.has_value() ? CheckedMul(*one, 2) : std::nullopt;
  const std::optional<int64_t> need = two.has_value() ? CheckedAdd(*two, floor.total_bytes) : std::nullopt;
  if (need.has_value() && *need <= memory_bytes) return absl::OkStatus();
  const std::string size = one.has_value() ? GiB(*one) : "over 8 EiB";
  return absl::ResourceExhaustedError(absl::StrCat(
      "the forward's logits ", ShapeToString(logits), " take ",
      forward.gather_logits ? absl::StrCat(size, " (twice: gathered on every rank to be written, and copied to "
                                           "the host)")
                            : absl::StrCat(size, " of a rank's ", held[0], " sequences (twice: and the loss's "
                                           "softmax)"),
      ", with the model's ", GiB(floor.total_bytes), "; this worker has ", GiB(memory_bytes),
      ": split the input into smaller batches"));
}

}  // namespace

JobRunner::JobRunner(Options options)
    : options_(std::move(options)),
      models_(ModelCache::Options{options_.work_dir, options_.coordinator, options_.auth_token, options_.worker_key,
                                  options_.download_timeout, options_.upload_cache_ttl}) {}

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

namespace {
// Close's and Drain's reason where the caller gave none.
std::string ClosedReason(const std::string& reason) { return reason.empty() ? "the worker is shutting down" : reason; }
}  // namespace

void JobRunner::Close(const std::string& reason) {
  const std::string why = ClosedReason(reason);
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    if (closed_.empty()) closed_ = why;
    active = active_;
  }
  if (active) Stop(*active, why);
}

bool JobRunner::Drain(const std::string& reason, bool save) {
  absl::MutexLock lock(&mu_);
  if (closed_.empty()) closed_ = ClosedReason(reason);
  if (!save || !active_ || active_->request.spec().kind() != v1::JOB_KIND_TRAIN || !active_->request.drain())
    return false;
  active_->drain = true;
  return true;
}

namespace {

// A job's id and uid as a rank may carry them (INVALID_ARGUMENT otherwise).
absl::Status CheckJobIds(const std::string& job_id, const std::string& job_uid) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  // It names the rank's directory (WORK_DIR/JOB-gen-G-rank-R, removed
  // whole) and its flight recorder's dump: a plain name, never a path
  // ("../..", or a NUL that would cut the path short).
  constexpr size_t kMaxJobIdBytes = 128;
  if (job_id.size() > kMaxJobIdBytes || !absl::c_all_of(job_id, [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
      })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id: at most ", kMaxJobIdBytes, " letters, digits, '-' and '_', not '", EscapedPrefix(job_id, 40), "'"));
  }
  // Job.uid: lowercase hex (it joins the job id in the checkpoints' writer,
  // and a '_' in it could make two jobs' writers one).
  if (job_uid.size() > 32 || job_uid.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_uid: at most 32 lowercase hex digits, not '", EscapedPrefix(job_uid, 40), "'"));
  }
  return absl::OkStatus();
}

// Whether two uids of one job id name different jobs: both known and not
// the same (an empty one, from an older coordinator, names any).
bool OtherJob(const std::string& a, const std::string& b) { return !a.empty() && !b.empty() && a != b; }

}  // namespace

absl::Status JobRunner::Assign(const v1::AssignJobRequest& req) {
  RETURN_IF_ERROR(CheckJobIds(req.job_id(), req.job_uid()));
  if (req.spec().kind() != v1::JOB_KIND_TRAIN && req.spec().kind() != v1::JOB_KIND_FORWARD &&
      req.spec().kind() != v1::JOB_KIND_TENSOR) {
    return absl::InvalidArgumentError(absl::StrCat("spec.kind: this worker runs TRAIN, FORWARD and TENSOR jobs, not ",
                                                   v1::JobKind_Name(req.spec().kind())));
  }
  if (req.rendezvous_scope().empty()) return absl::InvalidArgumentError("rendezvous_scope: required");
  // The mesh is the one the coordinator sends; it must be the shard
  // config's.
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromProto(req.mesh()));
  ASSIGN_OR_RETURN(DeviceMesh of_shard, DeviceMesh::FromShardConfig(req.spec().shard()));
  if (mesh.axes() != of_shard.axes()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh.axes: ", req.mesh().axes_size(),
                                                   " axes that are not spec.shard's mesh (",
                                                   of_shard.ToProto().ShortDebugString(), ")"));
  }
  if (req.rank() < 0 || req.rank() >= mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", req.rank(), " is outside the mesh of ", mesh.world_size(), " ranks"));
  }
  // A file system call: made unlocked, and said once the rank is known to
  // be a new one (the same assignment again is its running rank's).
  const absl::Status room =
      req.spec().kind() != v1::JOB_KIND_TENSOR ? CheckWorkDirRoom(req.spec().model().upload_id()) : absl::OkStatus();
  // The same assignment again (a duplicate delivery) is the running rank's,
  // or the ended one's, whose end was reported: never started twice. Its
  // job's uid too: a coordinator whose data dir was lost numbers its jobs
  // from job-000001 again.
  const auto key = [](const v1::AssignJobRequest& r) {
    return std::make_tuple(r.job_id(), r.job_uid(), r.generation(), r.rank());
  };
  const auto same = [&](const v1::AssignJobRequest& now) { return key(now) == key(req); };
  // The previous rank's thread, joined once mu_ is released (declared
  // before the lock, so destroyed after it): it has ended or is ending (Run
  // clears active_ as its last act under mu_), but a join is a wait.
  struct JoinAfterUnlock {
    std::thread thread;
    ~JoinAfterUnlock() {
      if (thread.joinable()) thread.join();
    }
  } previous;
  absl::MutexLock lock(&mu_);
  if (active_ && active_->end_reported && !same(active_->request)) {
    // The coordinator heard of its end and may place the next rank here at
    // once: the rank's teardown (its communicators, a failed rank's after
    // its report) is waited for, not refused (a refusal would make the
    // coordinator pass this worker over for its cool-off).
    const auto torn_down = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == nullptr; };
    mu_.AwaitWithTimeout(absl::Condition(&torn_down), kEndedRankTeardownWait);
  }
  if (!closed_.empty()) return absl::UnavailableError(absl::StrCat("this worker takes no rank: ", closed_));
  if (!device_lost_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this worker takes no rank: ", device_lost_.message(), "; it is restarting"));
  }
  if (!active_ && last_ended_ == key(req)) return absl::OkStatus();  // it ran here and ended
  if (active_ && same(active_->request)) return absl::OkStatus();
  if (const std::optional<std::string> later = LaterGenerationLocked(req); later.has_value()) {
    return absl::AbortedError(absl::StrCat("generation ", req.generation(), " of job '", req.job_id(),
                                           "' no longer runs: this worker ", *later));
  }
  if (active_) {
    const v1::AssignJobRequest& now = active_->request;
    return absl::FailedPreconditionError(absl::StrCat("this worker runs rank ", now.rank(), " of job '",
                                                      now.job_id(), "' (generation ", now.generation(), ")"));
  }
  RETURN_IF_ERROR(room);
  previous.thread = std::move(thread_);
  ProgressReporter::Options reporting{options_.coordinator, options_.auth_token, options_.rpc_timeout,
                                      options_.worker_id, options_.worker_key};
  std::shared_ptr<Active> active;
  // The threads first (the reporter's, then the rank's): a worker that
  // cannot start them stays idle, not busy with a rank that never runs. Run
  // takes mu_ before it touches active_.
  try {
    active = std::make_shared<Active>(req, std::move(reporting));
    thread_ = std::thread([this, active] { Run(active); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot start the rank's threads: ", e.what()));
  }
  active_ = active;
  return absl::OkStatus();
}

namespace {

// `s` with `scratch` (the rank's copy of its model: links and config.json
// under the work dir, removed when the rank ends) in its message replaced
// by what the job's spec named: its config_json, its weights_path (the
// file, where it names one), or the upload. Not an error of the worker's
// own (its disk), which is about the scratch copy itself.
absl::Status NameTheModel(const absl::Status& s, const std::string& scratch, const v1::ModelSpec& model) {
  if (s.ok() || IsWorkerFault(s) || !absl::StrContains(s.message(), scratch)) return s;
  const std::string named = model.upload_id().empty() ? model.weights_path()
                                                      : absl::StrCat("the uploaded model (", model.upload_id(), ")");
  std::vector<std::pair<std::string, std::string>> names = {{scratch + "/config.json", "spec.model.config_json"}};
  std::error_code ec;
  if (model.upload_id().empty() && std::filesystem::is_regular_file(model.weights_path(), ec)) {
    names.emplace_back(scratch + "/model.safetensors", model.weights_path());  // the one file, linked under that name
  }
  names.emplace_back(scratch, named);  // the longer names first: StrReplaceAll takes the longest match
  return WithMessage(s, absl::StrReplaceAll(s.message(), names));  // still marked
}

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

std::string JobRunner::RankDir(const v1::AssignJobRequest& req) const {
  return absl::StrFormat("%s/%s-gen-%d-rank-%d", options_.work_dir, req.job_id(), req.generation(), req.rank());
}

absl::Status JobRunner::CheckWorkDirRoom(const std::string& keep_upload) {
  if (options_.min_free_work_dir_bytes <= 0) return absl::OkStatus();
  absl::StatusOr<DiskSpace> room = FreeDiskSpace(options_.work_dir);
  if (!room.ok()) {
    return absl::UnavailableError(absl::StrCat("this worker takes no rank: ", room.status().message()));
  }
  const auto short_of_room = [&] {
    return room->free_bytes < options_.min_free_work_dir_bytes || room->free_inodes == 0;
  };
  if (short_of_room()) {
    // Uploads no rank used for --upload-cache-ttl go first (before, only a
    // rank's download removed them, and a worker refusing every rank for
    // want of room never got to one). Only while no rank runs: its upload
    // is in use.
    bool idle = false;
    {
      absl::MutexLock lock(&mu_);
      idle = active_ == nullptr;
    }
    if (idle && models_.PruneIfIdle(keep_upload)) {
      room = FreeDiskSpace(options_.work_dir);
      if (!room.ok()) {
        return absl::UnavailableError(absl::StrCat("this worker takes no rank: ", room.status().message()));
      }
    }
  }
  if (short_of_room()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this worker takes no rank that loads a model: its --work-dir '", options_.work_dir, "' has ",
        room->free_inodes == 0 ? "no free inode" : absl::StrCat(MiB(room->free_bytes), " free"), ", under the ",
        MiB(options_.min_free_work_dir_bytes), " of --min-free-work-dir"));
  }
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
  // Outside every lock. The signal ends a download or a communicator being
  // made; the group's abort fails the rank's next collective at once and
  // ends one in flight.
  active.abort->Abort(absl::AbortedError(reason));
  if (pg != nullptr) pg->Abort(absl::AbortedError(reason));
}

std::optional<std::string> JobRunner::LaterGenerationLocked(const v1::AssignJobRequest& req) const {
  // Only a job with a uid is known to be the same job: a coordinator whose
  // data dir was lost numbers its jobs and their generations from 1 again.
  if (req.job_uid().empty()) return std::nullopt;
  const auto of_job = [&req](const std::string& job_id, const std::string& uid) {
    return job_id == req.job_id() && uid == req.job_uid();
  };
  if (active_ && of_job(active_->request.job_id(), active_->request.job_uid()) &&
      active_->request.generation() > req.generation()) {
    return absl::StrCat("runs its generation ", active_->request.generation());
  }
  if (last_ended_.has_value() && of_job(std::get<0>(*last_ended_), std::get<1>(*last_ended_)) &&
      std::get<2>(*last_ended_) > req.generation()) {
    return absl::StrCat("ran its generation ", std::get<2>(*last_ended_));
  }
  for (const Gone& g : gone_) {
    if (of_job(g.job_id, g.uid) && g.generation >= req.generation()) {
      return g.ran ? absl::StrCat("ran its generation ", g.generation)
                   : absl::StrCat("was told to abort its generation ", g.generation, " before this assignment arrived");
    }
  }
  return std::nullopt;
}

void JobRunner::RememberGoneLocked(Gone gone) {
  if (gone.uid.empty()) return;  // (a job of an older coordinator: see LaterGenerationLocked)
  gone_.push_back(std::move(gone));
  if (gone_.size() > kMaxGoneKept) gone_.pop_front();
}

absl::Status JobRunner::Abort(const v1::AbortJobRequest& req) {
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    // An abort of a generation that does not run here may have overtaken
    // its assignment (the coordinator sends both at once when a placement
    // stops as it starts): that assignment, arriving later, is refused.
    // (An abort carrying another uid is another job's, of a coordinator
    // that numbers its jobs from 1 again.)
    const bool of_job =
        active_ && active_->request.job_id() == req.job_id() && !OtherJob(active_->request.job_uid(), req.job_uid());
    const bool runs_it = of_job && active_->request.generation() == req.generation();
    if (!runs_it && CheckJobIds(req.job_id(), req.job_uid()).ok()) {
      RememberGoneLocked(Gone{req.job_id(), req.job_uid(), req.generation(), /*ran=*/false});
    }
    if (!of_job) {
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
  if (last_ended_.has_value()) {
    s.set_ended_job_id(std::get<0>(*last_ended_));
    s.set_ended_generation(std::get<2>(*last_ended_));
    s.set_ended_rank(std::get<3>(*last_ended_));
    s.set_ended_code(static_cast<int32_t>(last_ended_code_));
  }
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

void JobRunner::Run(std::shared_ptr<Active> active) {
  const v1::AssignJobRequest& req = active->request;
  COLOD_LOG(INFO) << "job " << req.job_id() << " generation " << req.generation() << ": running rank " << req.rank()
                  << " of " << req.mesh().world_size();
  if (options_.metrics != nullptr) {
    // Assign checked the mesh; the tensor-parallel ranks of a replica share its tokens.
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::FromProto(req.mesh());
    const int replica_ranks = mesh.ok() ? mesh->AxisSize("tp").value_or(1) : 1;
    active->metrics = options_.metrics->StartRank(req.job_id(), req.rank(), KindName(req.spec().kind()), replica_ranks);
  }
  absl::Status s;
  try {
    s = NameTheModel(RunRank(*active), RankDir(req) + "/model", req.spec().model());
  } catch (const std::bad_alloc& e) {
    // The host's memory (or the worker's limit on it) is what the rank
    // needs more of: RESOURCE_EXHAUSTED, which no restart retries.
    s = absl::ResourceExhaustedError(absl::StrCat("the rank ran out of host memory (", e.what(), ")"));
  } catch (const std::exception& e) {
    // A backstop: colod's code returns statuses, but a library may throw
    // (no thread or memory to be had); the rank fails, the worker lives on.
    s = absl::InternalError(absl::StrCat("the rank threw: ", e.what()));
  }
  // The rank's process group (its communicators, whose observers feed the
  // rank's series) ends, then its series. A rank that succeeded ends them
  // before the coordinator hears of its end, so that the job's end finds
  // them gone. One that failed ends them after: its peers, waiting on its
  // connections, would otherwise fail at once ("connection closed by
  // peer") and might be heard first, their consequence taken for its cause,
  // whose code decides whether the job restarts and which rank the job's
  // reason names.
  // A drained rank ended on its own, as its peers do: it ends as one that
  // succeeded (its peers may still be in the drain's save's last agreement).
  const bool succeeded = s.ok() || IsDrained(s);
  const auto end_rank = [&active, succeeded] {
    std::shared_ptr<ProcessGroup> pg;
    {
      absl::MutexLock lock(&active->mu);
      pg = std::move(active->pg);
    }
    if (pg != nullptr) {
      // A failed rank's communicators are aborted together, not finished
      // one by one as the group is destroyed: work of one may wait for work
      // of another that its lost peers never complete.
      if (!succeeded) pg->Abort(absl::AbortedError("the rank ended"));
      // Destroyed here, before the series its communicators feed: Stop may
      // hold a copy a moment longer (its abort never waits), and none can
      // be taken now.
      while (pg.use_count() > 1) absl::SleepFor(absl::Milliseconds(1));
      pg.reset();
    }
    active->metrics.reset();
  };
  if (succeeded) end_rank();
  // A drained rank saved its checkpoint and ended on its own; a FORWARD
  // rank that returned OK did its whole pass (its result is whole), the stop
  // came too late to cut it short. Any other rank that was stopped ended
  // for the stop (a TRAIN or TENSOR rank returns OK when it stops early).
  const bool finished_forward = s.ok() && req.spec().kind() == v1::JOB_KIND_FORWARD;
  if (active->stop && !IsDrained(s) && !finished_forward) {
    std::string reason;
    {
      absl::MutexLock lock(&active->mu);
      reason = active->stop_reason;
    }
    if (reason.empty()) reason = active->reporter.StopReason();
    if (reason.empty()) reason = "the coordinator says the job no longer runs on this worker";
    s = absl::AbortedError(reason);
  }
  if (!s.ok()) DumpFlightRecorder(*active);
  // A rank that failed may have broken the device for good (an illegal
  // address, an Xid): the job then hears so, and this worker takes no
  // other rank (it restarts: a new process gets a new context).
  absl::Status device = absl::OkStatus();
  if (!s.ok() && options_.cuda) {
    device = kernels::CudaDeviceUsable(options_.device_ordinal);
    if (!device.ok()) {
      s = MarkWorkerFault(absl::Status(s.code(), absl::StrCat(s.message(), " (", device.message(),
                                                              ": the worker stops taking ranks and restarts)")));
    }
  }
  active->reporter.End(s, active->forward, /*worker_leaving=*/active->drain.load());
  active->end_reported = true;
  if (!succeeded) end_rank();
  if (s.ok()) {
    COLOD_LOG(INFO) << "job " << req.job_id() << ": rank " << req.rank() << " finished";
  } else {
    COLOD_LOG(WARNING) << "job " << req.job_id() << ": rank " << req.rank() << " ended: " << s;
  }
  // The rank's model, data and communicators are freed: hand the memory
  // back to the system, not only to the allocator's arenas (a failed rank
  // would otherwise leave the worker tens or hundreds of MiB larger).
  ::malloc_trim(0);
  {
    absl::MutexLock lock(&mu_);
    // Sent in every heartbeat: valid UTF-8 (an error may quote a file's
    // bytes; a message that is not would fail every heartbeat) and bounded.
    if (!s.ok()) {
      last_error_ = Utf8Prefix(absl::StrCat(req.job_id(), " rank ", req.rank(), ": ", s.ToString()),
                               kMaxReportedMessageBytes);
    }
    if (!device.ok()) device_lost_ = device;
    last_ended_ = std::make_tuple(req.job_id(), req.job_uid(), req.generation(), req.rank());
    last_ended_code_ = s.code();
    // Past the next rank, last_ended_ no longer says it ran: a very late
    // repeat of its assignment must not start it again.
    RememberGoneLocked(Gone{req.job_id(), req.job_uid(), req.generation(), /*ran=*/true});
    active_.reset();
  }
  if (!device.ok()) {
    COLOD_LOG(ERROR) << device.message() << ": this worker takes no other rank";
    if (options_.on_device_lost) options_.on_device_lost(device);
  }
}

absl::Status JobRunner::RunRank(Active& active) {
  const v1::AssignJobRequest& req = active.request;
  const ProgressReporter& reporter = active.reporter;
  const std::string dir = RankDir(req);
  struct Cleanup {
    std::string dir;
    ModelCache* models = nullptr;  // set once the model is in place
    const v1::ModelSpec* model = nullptr;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
      // Its upload was in use until now: the cache's TTL counts from here.
      if (models != nullptr) models->Used(*model);
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
  if (options_.cuda) shard.device = Device::Cuda(options_.device_ordinal);
  RETURN_IF_ERROR(options_.paths.CheckJob(req.spec()));
  if (req.spec().kind() != v1::JOB_KIND_TENSOR) {  // TRAIN and FORWARD jobs load a model
    RETURN_IF_ERROR(AdmitModel(req, options_.memory_bytes));
    if (reporter.Phase(v1::RANK_PHASE_LOADING, "opening the model and the data")) {
      return NoLongerRuns(reporter);
    }
    RETURN_IF_ERROR(models_.Materialize(req.spec().model(), dir + "/model", *active.abort, options_.paths));
    cleanup.models = &models_;
    cleanup.model = &req.spec().model();
  }
  if (training) {
    ASSIGN_OR_RETURN(train::TrainOptions options,
                     train::TrainOptionsFromSpec(req.spec(), dir + "/model", options_.cuda));
    // The writer checkpoints record: the job id with its uid, unique beyond
    // this coordinator's numbering (v1::Job.uid).
    options.job = req.job_uid().empty() ? req.job_id() : absl::StrCat(req.job_id(), "_", req.job_uid());
    options.generation = req.generation();
    // A restart resumes from the job's own checkpoints: this writer's, or
    // the bare id's that a worker from before the uid wrote (a rolling
    // upgrade).
    if (req.resume_own_checkpoints()) options.resume_writers = std::vector<std::string>{options.job, req.job_id()};
    if (!options_.paths.unrestricted() || !options_.paths.reserved().empty()) {
      options.check_path = [paths = options_.paths](const std::string& path) {
        return paths.Check("spec.train: a checkpoint of resume_from or checkpoint_dir", path);
      };
    }
    // (Every rank of the placement gets the same: its workers all agree, or not.)
    options.agree_on_resume = req.agree_on_resume();
    // An abort or a shutdown ends the tokenizing of a large text corpus.
    options.stopped = [&active] { return active.stop.load() || active.abort->fired(); };
    ASSIGN_OR_RETURN(run, train::PrepareTrain(options));
    options.shard.device = shard.device;
    shard = options.shard;
  }
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromProto(req.mesh()));  // checked by Assign

  if (reporter.Phase(v1::RANK_PHASE_RENDEZVOUS, "connecting to the other ranks")) {
    return NoLongerRuns(reporter);
  }
  active.store = std::make_unique<CoordinatorStore>(options_.coordinator, req.rendezvous_scope(), options_.rpc_timeout,
                                                    options_.auth_token, options_.worker_key, active.abort);
  // Outlives `pg` (Run ends it after this returns), so its observers outlive the communicators.
  WorkerMetrics::Rank* metrics = active.metrics.get();
  RankGroupOptions group;
  group.device = shard.device;
  group.host = options_.host;
  group.timeout = options_.comm_timeout;
  group.abort_signal = active.abort;
  // A TENSOR job's reshards are one-off and may be gigabytes: their scratch
  // is not kept past 64 MiB (a training step's buckets reuse theirs).
  if (req.spec().kind() == v1::JOB_KIND_TENSOR) group.kept_scratch_bytes = size_t{64} << 20;
  group.wrap = [metrics, recorder = active.recorder](std::unique_ptr<Communicator> c,
                                                     const ProcessGroup::GroupInfo& g) {
    return std::unique_ptr<Communicator>(new InstrumentedCommunicator(
        std::move(c), metrics != nullptr ? metrics->CollectiveObserver(g.axis) : nullptr, recorder, g.prefix));
  };
  ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroup> pg,
                   CreateRankGroup(mesh, req.rank(), active.store.get(), std::move(group)));
  {
    // Kept there past this call: Run ends it (after the coordinator heard
    // of a failure).
    absl::MutexLock lock(&active.mu);
    active.pg = pg;
  }
  if (active.stop) pg->Abort(absl::AbortedError("the job no longer runs"));  // stopped before the group existed
  if (shard.device.is_cuda()) RETURN_IF_ERROR(pg->InitAxes());
  if (req.spec().kind() == v1::JOB_KIND_FORWARD) return RunForward(active, *pg, shard, dir + "/model");
  if (!training) return ServeTensors(active, *pg);

  train::RankHooks hooks;
  hooks.stop = [&active] { return active.stop.load(); };
  if (active.request.drain()) hooks.drain = [&active] { return active.drain.load(); };
  hooks.on_start = [&](const train::RankStart& start) {
    if (metrics != nullptr) metrics->TrainingStarted();
    if (metrics != nullptr && start.param_dtype == DType::kF16 && !req.spec().train().eval_only()) {
      metrics->LossScalingStarted();  // (its skipped updates from 0)
    }
    const std::string message = TrainingStartMessage(start.checkpoint, start.step, start.skipped, start.unread_tensors);
    if (reporter.Phase(v1::RANK_PHASE_TRAINING, message, start.step, start.checkpoint,
                       train::PrecisionOf(start.param_dtype))) {
      active.stop = true;
    }
    // Its step's report may have died with the worker that wrote it (no
    // metric: this worker did not train it).
    if (req.rank() == 0 && start.checkpoint_step.has_value() && reporter.Step(*start.checkpoint_step)) {
      active.stop = true;
    }
  };
  hooks.on_step = [&](const train::StepStats& st) {
    if (metrics != nullptr && st.trained) {
      metrics->ObserveStep(st.seconds, st.rank_tokens, st.loss, st.param_bytes, st.grad_bytes, st.optimizer_bytes);
      if (st.cuda) metrics->ObserveDevicePool(st.pool_reserved_bytes, st.pool_used_bytes);
      if (st.dp_bucket_bytes > 0) metrics->ObserveGradSync(st.dp_bucket_bytes, st.dp_overlapped_bytes);
      if (st.loss_scale > 0) metrics->ObserveLossScale(st.loss_scale, st.update_skipped);
    }
    if (metrics != nullptr && st.eval.has_value()) metrics->ObserveEval(st.eval->loss);
    if (req.rank() == 0 && reporter.Step(st)) active.stop = true;
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
  // Every failed, cancelled or restarted rank dumps: the newest are kept.
  RemoveOldestFiles(dir, kMaxFlightRecorderDumps);
  if (s.ok()) {
    COLOD_LOG(INFO) << "job " << req.job_id() << ": rank " << req.rank() << "'s last collectives are in " << path;
  } else {
    COLOD_LOG(WARNING) << "job " << req.job_id() << ": cannot dump the flight recorder: " << s;
  }
}

absl::Status JobRunner::RunForward(Active& active, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                                   const std::string& model_dir) {
  const v1::ForwardConfig& f = active.request.spec().forward();
  shardformer::ForwardRequest request;
  request.model_dir = model_dir;
  request.shard = shard;
  absl::StatusOr<Tensor> input = ReadNpy(f.input_path());
  if (!input.ok()) {
    return absl::Status(input.status().code(), absl::StrCat("spec.forward.input_path: ", input.status().message()));
  }
  request.input = *input;
  request.gather_logits = !f.logits_path().empty();  // else rank 0 reports the loss and the shape only
  if (!f.labels_path().empty()) {
    absl::StatusOr<Tensor> labels = ReadNpy(f.labels_path());
    if (!labels.ok()) {
      return absl::Status(labels.status().code(), absl::StrCat("spec.forward.labels_path: ", labels.status().message()));
    }
    request.labels = *labels;
  }
  if (!f.decoder_input_path().empty()) {
    absl::StatusOr<Tensor> decoder = ReadNpy(f.decoder_input_path());
    if (!decoder.ok()) {
      return absl::Status(decoder.status().code(),
                          absl::StrCat("spec.forward.decoder_input_path: ", decoder.status().message()));
    }
    request.decoder_input = *decoder;
  }
  ASSIGN_OR_RETURN(const ModelConfig config, shardformer::CheckForward(request));
  RETURN_IF_ERROR(AdmitForwardLogits(active.request, request, config, options_.memory_bytes));
  if (active.reporter.Phase(v1::RANK_PHASE_RUNNING, "forward pass")) return NoLongerRuns(active.reporter);
  ASSIGN_OR_RETURN(shardformer::ForwardResult out, shardformer::ForwardRank(request, pg, shard));
  if (pg.rank() != 0) return absl::OkStatus();
  v1::ForwardResult result;
  result.set_loss(out.loss);
  result.set_tokens(out.tokens);
  for (int64_t d : out.logits_shape) result.add_logits_shape(d);
  shardformer::SetUnreadTensors(out.unread_tensors, result);
  if (!f.logits_path().empty()) {
    RETURN_IF_ERROR(WriteNpy(f.logits_path(), out.logits));
    result.set_logits_path(f.logits_path());
  }
  active.forward = result;
  return absl::OkStatus();
}

absl::Status JobRunner::ServeTensors(Active& active, ProcessGroup& pg) {
  // The worker's memory, or else the host's memory available now.
  const int64_t budget = options_.memory_bytes > 0 ? options_.memory_bytes : AvailableHostMemoryBytes();
  auto host = std::make_shared<TensorHost>(
      &pg, options_.cuda ? Device::Cuda(options_.device_ordinal) : Device::Cpu(), budget);
  {
    absl::MutexLock lock(&active.mu);
    active.tensors = host;
  }
  if (active.reporter.Phase(v1::RANK_PHASE_SERVING, "hosting ColoTensors")) active.stop = true;
  // Serves until stopped, or until a collective broke the group (a lost
  // peer, a timeout): its errors are sticky, so every later redistribution
  // or gather would fail, and the ranks may disagree on the layout of the
  // tensor it was redistributing. The rank fails, and with it the job,
  // which its restart policy may start again.
  absl::Status broken;
  while (!active.stop) {
    if (absl::Status s = pg.AsyncError(); !s.ok() && !active.stop) {
      broken = s;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  {
    absl::MutexLock lock(&active.mu);
    active.tensors.reset();
  }
  host->Close();  // waits for a call in progress: the group must outlive it
  if (!broken.ok()) {
    return absl::Status(broken.code(), absl::StrCat("the rank's process group failed, so its tensors can no longer "
                                                    "be redistributed or gathered: ",
                                                    broken.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<TensorHost>> JobRunner::Tensors(const std::string& job_id,
                                                               const std::optional<CallGeneration>& call) const {
  std::shared_ptr<Active> active;
  {
    absl::MutexLock lock(&mu_);
    active = active_;
  }
  if (!active || active->request.job_id() != job_id) {
    // A coordinator's call for a generation of the job placed here (it
    // carries one): the rank ended under it, as an abort ends one (ABORTED;
    // not NOT_FOUND, which a delete takes for a tensor gone already).
    if (call.has_value()) {
      return absl::AbortedError(absl::StrCat("generation ", call->generation, " of job '", job_id,
                                             "' does not run on this worker (its rank ended)"));
    }
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' does not run on this worker"));
  }
  if (active->request.spec().kind() != v1::JOB_KIND_TENSOR) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' is not a TENSOR job"));
  }
  if (call.has_value() && OtherJob(call->job_uid, active->request.job_uid())) {
    // (Not NOT_FOUND: a delete takes a rank's NOT_FOUND for a tensor that
    // is gone already.)
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' of uid ", call->job_uid,
                                                      " does not run on this worker (another of that id does)"));
  }
  if (call.has_value() && call->generation != active->request.generation()) {
    return absl::AbortedError(absl::StrCat("the call is meant for generation ", call->generation, " of job '", job_id,
                                           "'; generation ", active->request.generation(), " runs on this worker"));
  }
  absl::MutexLock lock(&active->mu);
  if (!active->tensors) return absl::UnavailableError(absl::StrCat("job '", job_id, "' is still connecting"));
  return active->tensors;
}

}  // namespace colod
