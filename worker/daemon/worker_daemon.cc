#include "worker/daemon/worker_daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/host_memory.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/device.h"

namespace colod {
namespace {

constexpr char kServiceName[] = "colod.v1.WorkerService";

bool IsWildcard(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "*";
}

// Fills device fields of `info` from --device / --device-ordinal.
absl::Status DescribeDevice(const WorkerDaemon::Options& o, v1::WorkerInfo& info) {
  if (o.device_ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device-ordinal: must be >= 0, got ", o.device_ordinal));
  }
  bool use_cuda;
  if (o.device == "cpu") {
    use_cuda = false;
  } else if (o.device == "cuda") {
    if (!kernels::BuiltWithCuda()) {
      return absl::InvalidArgumentError("--device=cuda: this colod build has no CUDA support");
    }
    use_cuda = true;
  } else if (o.device == "auto") {
    // GPUs here, and an ordinal past them, is a mistake (a pod given fewer
    // GPUs than it was numbered for), not a CPU worker with the host's memory.
    const int gpus = kernels::CudaDeviceCount();
    if (gpus > 0 && o.device_ordinal >= gpus) {
      return absl::InvalidArgumentError(absl::StrCat("--device-ordinal: ", o.device_ordinal, ", and this machine has ",
                                                     gpus, " CUDA devices (0 to ", gpus - 1,
                                                     "); give --device=cpu for a CPU worker"));
    }
    use_cuda = gpus > o.device_ordinal;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: '", o.device, "' is not one of auto, cpu, cuda"));
  }
  info.set_device_ordinal(o.device_ordinal);
  if (use_cuda) {
    ASSIGN_OR_RETURN(kernels::CudaDeviceInfo dev, kernels::GetCudaDeviceInfo(o.device_ordinal));
    info.set_device_kind(v1::DEVICE_KIND_CUDA);
    info.set_device_name(dev.name);
    info.set_memory_bytes(WorkerDaemon::DefaultRankMemory(dev.memory_bytes));
  } else {
    info.set_device_kind(v1::DEVICE_KIND_CPU);
    info.set_device_name("cpu");
    info.set_memory_bytes(WorkerDaemon::DefaultRankMemory(HostMemoryBytes()));
  }
  if (o.memory_limit_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--memory-limit: must be >= 0, got ", o.memory_limit_bytes));
  }
  if (o.memory_limit_bytes > 0) info.set_memory_bytes(o.memory_limit_bytes);
  // Beyond 1e6 TFLOP/s (a thousand times the largest GPU's) or below 1e-6
  // is a unit mistake; the coordinator refuses such a peak too.
  if (!(o.peak_tflops == 0 || (o.peak_tflops >= 1e-6 && o.peak_tflops <= 1e6))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peak-tflops: must be 0 (the datasheet's) or in [1e-6, 1e6] TFLOP/s, got ", o.peak_tflops));
  }
  v1::DevicePeak& peak = *info.mutable_peak();
  if (o.peak_tflops > 0) {
    const double flops = o.peak_tflops * 1e12;
    peak.set_f32(flops);
    peak.set_tf32(flops);
    peak.set_bf16(flops);
    peak.set_f16(flops);
    peak.set_source("--peak-tflops");
  } else if (use_cuda) {
    const kernels::DevicePeakFlops known = kernels::KnownCudaPeak(info.device_name());
    peak.set_f32(known.f32);
    peak.set_tf32(known.tf32);
    peak.set_bf16(known.bf16);
    peak.set_f16(known.f16);
    peak.set_source(known.source);
  }
  if (o.max_server_threads < 2) {
    // One thread polls for calls and hands each to another: with one, every call but health checks is refused.
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-server-threads: must be at least 2 (one thread polls for calls), got ", o.max_server_threads));
  }
  // Every job's rendezvous and collectives wait this long at most: 0 would
  // fail them all, and Gloo's clock arithmetic overflows far past a day.
  if (o.comm_timeout < absl::Seconds(1) || o.comm_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--comm-timeout: must be in [1s, 24h], got ", absl::FormatDuration(o.comm_timeout)));
  }
  if (o.drain_timeout < absl::ZeroDuration() || o.drain_timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--drain-timeout: must be in [0, 24h], got ", absl::FormatDuration(o.drain_timeout)));
  }
  if (o.upload_cache_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--upload-cache-ttl: must be >= 0");
  }
  return absl::OkStatus();
}

}  // namespace

WorkerDaemon::WorkerDaemon(Options options) : options_(std::move(options)) {}

int64_t WorkerDaemon::DefaultRankMemory(int64_t device_bytes) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  if (device_bytes < 2 * kGiB) return device_bytes / 2;
  return device_bytes - std::max(kGiB, device_bytes / 10);
}

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Start(Options options) {
  ASSIGN_OR_RETURN(HostPort listen, ParseHostPort(options.listen, "--listen", true));
  ASSIGN_OR_RETURN(PathPolicy paths, PathPolicy::Create(options.allow_paths));
  if (paths.unrestricted()) {
    COLOD_LOG(WARNING) << "no --allow-path: jobs may read and write any path this worker's user can";
  }
  WarnIfOpenWithoutAuth("colod-worker", options.listen, !options.auth_token.empty());
  if (!options.coordinator.empty()) {
    RETURN_IF_ERROR(ParseHostPort(options.coordinator, "--coordinator", false).status());
  }
  std::unique_ptr<WorkerDaemon> w(new WorkerDaemon(options));
  RETURN_IF_ERROR(DescribeDevice(options, w->info_));

  w->registry_ = std::make_shared<prometheus::Registry>();
  AddBuildInfo(*w->registry_, "worker");
  // Bounded: each rank that ended holds its series that long, and a worker
  // up for months runs thousands of ranks.
  if (options.metrics_linger < absl::ZeroDuration() || options.metrics_linger > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-linger: must be 0 to 24h, got ", absl::FormatDuration(options.metrics_linger)));
  }
  w->job_metrics_ = std::make_unique<WorkerMetrics>(*w->registry_, options.metrics_linger);
  ASSIGN_OR_RETURN(w->metrics_, MetricsServer::Start(options.metrics_listen, w->registry_));
  WorkerDaemon* raw = w.get();
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server_credentials, MakeServerCredentials(options.tls));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> channel_credentials,
                   MakeChannelCredentials(options.tls));

  HostPort advertise = listen;
  // The coordinator refuses a registration whose address is longer: the
  // worker would retry it for good.
  if (options.advertise_host.size() + 6 > kMaxWorkerText) {
    return absl::InvalidArgumentError(absl::StrCat("--advertise-host: ", options.advertise_host.size(),
                                                   " bytes; a host name has at most 253"));
  }
  if (!options.advertise_host.empty()) {
    advertise.host = options.advertise_host;
  } else if (IsWildcard(listen.host)) {
    advertise.host = LocalHostName();
  }
  if (!options.coordinator.empty()) {
    // (Through DNS whatever the host is called: gRPC takes "unix:7070" for
    // a local socket.)
    w->coordinator_ =
        v1::CoordinatorService::NewStub(CreateKeepaliveChannel(DialTarget(options.coordinator), channel_credentials));
    w->work_dir_ = options.work_dir;
    if (w->work_dir_.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      const std::string root = tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp";
      // Those of workers killed before they removed theirs (a SIGKILL, an
      // OOM kill: their cached uploads, gigabytes, would stay for good).
      if (const int removed = RemoveAbandonedWorkDirs(root); removed > 0) {
        COLOD_LOG(INFO) << "removed " << removed << " work directories under " << root
                        << " of workers that ended without removing them";
      }
      std::string pattern = absl::StrCat(root, "/colod-worker.XXXXXX");
      if (::mkdtemp(pattern.data()) == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("cannot create a work directory ", pattern, ": ",
                                                          std::strerror(errno)));
      }
      w->work_dir_ = pattern;
      w->own_work_dir_ = true;
    }
    // One worker a work directory: its rank directories, download cache and
    // their leftovers (any .tmp) are this worker's alone.
    ASSIGN_OR_RETURN(w->work_dir_lock_, LockDirectory(w->work_dir_, "--work-dir", "worker", &w->made_work_dir_));
    JobRunner::Options ro;
    ro.work_dir = w->work_dir_;
    ro.host = advertise.host;
    ro.cuda = w->info_.device_kind() == v1::DEVICE_KIND_CUDA;
    ro.device_ordinal = options.device_ordinal;
    ro.coordinator = w->coordinator_;
    ro.auth_token = options.auth_token;
    ro.worker_key = w->key_->key();
    ro.rpc_timeout = options.rpc_timeout;
    ro.comm_timeout = options.comm_timeout;
    ro.worker_id = [raw] { return raw->worker_id(); };
    ro.metrics = w->job_metrics_.get();
    ro.memory_bytes = w->info_.memory_bytes();
    // No job may name the work dir, whatever --allow-path holds (a job's
    // output over a cached upload would be the next job's model).
    RETURN_IF_ERROR(paths.Reserve(w->work_dir_));
    ro.paths = paths;
    ro.upload_cache_ttl = options.upload_cache_ttl;
    ro.min_free_work_dir_bytes = options.min_free_work_dir_bytes;
    ro.on_device_lost = [raw](const absl::Status& why) {
      bool leaving = false;
      {
        absl::MutexLock lock(&raw->mu_);
        raw->device_lost_ = why;
        leaving = raw->leaving_;
      }
      if (raw->options_.on_device_lost) {
        raw->options_.on_device_lost(why);
      } else if (!leaving) {
        // main takes it (WaitForShutdownSignal) and shuts down. Not once the
        // worker shuts down already (a rank stopped by the drain's timeout
        // or by Shutdown finds its device lost): main exits kExitDeviceLost
        // anyway, and a signal now would end the process at once
        // (ExitOnNextShutdownSignal), without its cleanup, exiting 143.
        kill(getpid(), SIGTERM);
      }
    };
    w->runner_ = std::make_unique<JobRunner>(ro);
  }
  w->service_ = std::make_unique<WorkerServiceImpl>([raw] { return raw->Info(); }, [raw] { return raw->Status(); },
                                                    w->runner_.get(), TokenAuth(options.auth_token, "", w->key_));
  w->tensor_service_ =
      std::make_unique<WorkerTensorService>(w->runner_.get(), TokenAuth(options.auth_token, "", w->key_));
  ASSIGN_OR_RETURN(w->grpc_, StartGrpcServer(options.listen, {w->service_.get(), w->tensor_service_.get()},
                                             server_credentials, options.max_server_threads));

  advertise.port = w->grpc_.port;
  HostPort metrics_advertise = advertise;
  metrics_advertise.port = w->metrics_->port();
  w->info_.set_address(advertise.ToString());
  w->info_.set_metrics_address(metrics_advertise.ToString());
  w->info_.set_host(LocalHostName());
  w->info_.set_version(kVersion);
  w->info_.set_downloads_carry_key(true);  // ModelCache::Options::worker_key
  w->info_.set_agrees_on_resume(true);     // AssignJobRequest.agree_on_resume
  w->info_.set_drains(true);               // JobRunner::Drain, RankHooks::drain
  w->info_.set_trains_masked_lm(true);     // TrainConfig.mask_token_id
  w->info_.set_scales_fp16_loss(true);     // TrainConfig.loss_scale
  for (const auto& [k, v] : options.labels) (*w->info_.mutable_labels())[k] = v;

  if (options.coordinator.empty()) {
    SetServing(*w->grpc_.server, kServiceName, true);
    COLOD_LOG(INFO) << "worker serving on " << w->address() << " (standalone, no --coordinator)";
  } else {
    // Not ready for work until registered; say so rather than "unknown service".
    SetServing(*w->grpc_.server, kServiceName, false);
    w->loop_ = std::thread([raw] { raw->CoordinatorLoop(); });
    COLOD_LOG(INFO) << "worker serving on " << w->address() << ", registering with "
                    << options.coordinator;
  }
  COLOD_LOG(INFO) << "worker device " << w->info_.device_name() << " (ordinal "
                  << w->info_.device_ordinal() << "), metrics on http://" << w->metrics_address()
                  << "/metrics";
  return w;
}

v1::WorkerInfo WorkerDaemon::Info() const {
  v1::WorkerInfo info = info_;
  info.set_worker_id(worker_id());
  return info;
}

v1::WorkerStatus WorkerDaemon::Status() const {
  if (runner_ != nullptr) return runner_->Status();
  v1::WorkerStatus s;
  s.set_state(v1::WORKER_STATE_IDLE);
  return s;
}

absl::Status WorkerDaemon::device_lost() const {
  absl::MutexLock lock(&mu_);
  return device_lost_;
}

std::string WorkerDaemon::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

int64_t WorkerDaemon::heartbeats_acked() const {
  absl::MutexLock lock(&mu_);
  return heartbeats_acked_;
}

bool WorkerDaemon::WaitRegistered(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto registered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_ && !worker_id_.empty();
  };
  return mu_.AwaitWithTimeout(absl::Condition(&registered), timeout);
}

int WorkerDaemon::RemoveAbandonedWorkDirs(const std::string& root, absl::Duration unlocked_for) {
  int removed = 0;
  const auto now = std::filesystem::file_time_type::clock::now();
  for (const std::string& name : ListDirectory(root).value_or(std::vector<std::string>{})) {
    if (!absl::StartsWith(name, "colod-worker.")) continue;
    const std::string dir = absl::StrCat(root, "/", name);
    struct stat st;
    // This user's directories only (a shared /tmp), never through a link.
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    // No LOCK: a worker between making its directory and locking it.
    const int fd = ::open((dir + "/LOCK").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    std::error_code ec;
    const auto locked_at = std::filesystem::last_write_time(dir + "/LOCK", ec);
    // The lock ends with its process; one unlocked and not written lately
    // (a worker writes its pid there as it takes it) is no live worker's.
    if (!ec &&
        now - locked_at > std::chrono::duration_cast<std::filesystem::file_time_type::duration>(
                              absl::ToChronoSeconds(unlocked_for)) &&
        ::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      std::filesystem::remove_all(dir, ec);
      if (!ec) ++removed;
    }
    ::close(fd);
  }
  return removed;
}

absl::Duration WorkerDaemon::HeartbeatInterval(const v1::RegisterWorkerResponse& resp) {
  // What the coordinator asks, within sense: none (or a malformed one) is
  // 2 s, not a heartbeat at every wake; never under 10 ms, and at most a
  // third of the lease (or a minute without one), not a sleep that lets it
  // expire.
  const absl::Duration asked = IsValidProtoDuration(resp.heartbeat_interval())
                                   ? FromProtoDuration(resp.heartbeat_interval())
                                   : absl::ZeroDuration();
  const absl::Duration lease =
      IsValidProtoDuration(resp.lease_duration()) ? FromProtoDuration(resp.lease_duration()) : absl::ZeroDuration();
  const absl::Duration most =
      lease > absl::ZeroDuration() ? std::max(lease / 3, absl::Milliseconds(10)) : absl::Minutes(1);
  return std::clamp(asked > absl::ZeroDuration() ? asked : absl::Seconds(2), absl::Milliseconds(10), most);
}

absl::Status WorkerDaemon::RegisterOnce() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  AddAuthToken(ctx, options_.auth_token);
  v1::RegisterWorkerRequest req;
  *req.mutable_worker() = info_;
  *req.mutable_status() = Status();  // BUSY if a rank outlived the coordinator it registered with
  req.set_worker_key(key_->key());
  v1::RegisterWorkerResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->RegisterWorker(&ctx, req, &resp)));
  if (resp.worker_id().empty() || resp.worker_id().size() > 256) {
    return absl::InternalError(absl::StrCat("the coordinator answered the registration with a worker id of ",
                                            resp.worker_id().size(), " bytes"));
  }
  // From now on only calls carrying the key, where the coordinator sends it.
  key_->SetTaken(resp.worker_key_taken());
  absl::MutexLock lock(&mu_);
  worker_id_ = resp.worker_id();
  heartbeat_interval_ = HeartbeatInterval(resp);
  if (IsValidProtoDuration(resp.heartbeat_interval()) &&
      FromProtoDuration(resp.heartbeat_interval()) > absl::ZeroDuration() &&
      heartbeat_interval_ != FromProtoDuration(resp.heartbeat_interval())) {
    COLOD_LOG(WARNING) << "the coordinator asks for a heartbeat every "
                       << absl::FormatDuration(FromProtoDuration(resp.heartbeat_interval())) << " (a lease of "
                       << absl::FormatDuration(FromProtoDuration(resp.lease_duration())) << "): heartbeating every "
                       << absl::FormatDuration(heartbeat_interval_);
  }
  return absl::OkStatus();
}

absl::Status WorkerDaemon::HeartbeatOnce() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  AddAuthToken(ctx, options_.auth_token);
  AddWorkerKey(ctx, key_->key());
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id());
  *req.mutable_status() = Status();
  v1::HeartbeatResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(coordinator_->Heartbeat(&ctx, req, &resp)));
  absl::MutexLock lock(&mu_);
  ++heartbeats_acked_;
  return absl::OkStatus();
}

absl::Status WorkerDaemon::DeregisterOnce(const std::string& id) {
  grpc::ClientContext ctx;
  // Shutting down: a coordinator that does not answer soon expires the lease anyway.
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + std::min(options_.rpc_timeout, absl::Seconds(2))));
  AddAuthToken(ctx, options_.auth_token);
  AddWorkerKey(ctx, key_->key());
  v1::DeregisterWorkerRequest req;
  req.set_worker_id(id);
  const absl::Status lost = device_lost();
  req.set_reason(lost.ok() ? std::string("the worker is shutting down")
                           : absl::StrCat(lost.message(), "; the worker restarts"));
  v1::DeregisterWorkerResponse resp;
  return FromGrpcStatus(coordinator_->DeregisterWorker(&ctx, req, &resp));
}

void WorkerDaemon::CoordinatorLoop() {
  absl::Duration backoff = options_.initial_backoff;
  int failures = 0;
  absl::BitGen jitter;
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const bool registered = !worker_id_.empty();
    mu_.Unlock();
    absl::Status s = registered ? HeartbeatOnce() : RegisterOnce();
    job_metrics_->RemoveExpired();  // ended ranks' series, once they lingered
    mu_.Lock();
    if (stopping_) break;
    absl::Duration wait;
    if (s.ok()) {
      if (!registered) {
        COLOD_LOG(INFO) << "registered with coordinator " << options_.coordinator << " as "
                        << worker_id_;
        mu_.Unlock();
        SetServing(*grpc_.server, kServiceName, true);
        mu_.Lock();
        serving_ = true;
      }
      failures = 0;
      backoff = options_.initial_backoff;
      wait = heartbeat_interval_;
    } else if (registered && s.code() == absl::StatusCode::kNotFound) {
      // The coordinator forgot us (restart or lost lease): register afresh,
      // not ready for work until it takes us again (a readiness probe).
      COLOD_LOG(WARNING) << "coordinator: " << s.message();
      worker_id_.clear();
      serving_ = false;
      mu_.Unlock();
      SetServing(*grpc_.server, kServiceName, false);
      mu_.Lock();
      wait = absl::ZeroDuration();
    } else {
      // Log the first failure and then every tenth, so a down coordinator
      // does not flood the log; a refusal that asking again cannot mend (a
      // bad address, a token the coordinator does not take) every time.
      const bool will_not_mend = s.code() == absl::StatusCode::kInvalidArgument ||
                                 s.code() == absl::StatusCode::kPermissionDenied ||
                                 s.code() == absl::StatusCode::kUnauthenticated;
      if (failures++ % 10 == 0 || will_not_mend) {
        COLOD_LOG(WARNING) << (registered ? "heartbeat" : "registration") << " to "
                           << options_.coordinator << " failed: " << s;
      }
      // Jittered: workers refused together (a coordinator restarting, its
      // checks of registrations full) do not all come back together.
      wait = registered ? heartbeat_interval_ : backoff * absl::Uniform(jitter, 0.5, 1.0);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
  }
}

void WorkerDaemon::Drain(const std::function<bool()>& interrupted) {
  {
    absl::MutexLock lock(&mu_);
    leaving_ = true;
  }
  if (!runner_) return;
  // From here on no rank is taken (UNAVAILABLE), whether or not the
  // running one drains: the coordinator may place one here until Shutdown
  // deregisters.
  const bool saves = options_.drain_timeout > absl::ZeroDuration() && !worker_id().empty();
  if (!runner_->Drain("the worker is shutting down", saves)) return;
  COLOD_LOG(INFO) << "worker shutting down: draining its job (every rank saves a checkpoint after the same step and "
                     "stops) for at most "
                  << absl::FormatDuration(options_.drain_timeout);
  const absl::Time deadline = absl::Now() + options_.drain_timeout;
  while (!runner_->WaitIdle(std::min(absl::Milliseconds(100), deadline - absl::Now()))) {
    if (absl::Now() >= deadline) {
      COLOD_LOG(WARNING) << "the drain did not end within --drain-timeout ("
                         << absl::FormatDuration(options_.drain_timeout) << "): the rank is stopped";
      return;
    }
    if (interrupted && interrupted()) {
      COLOD_LOG(WARNING) << "the drain was interrupted (a second signal): the rank is stopped";
      return;
    }
  }
  COLOD_LOG(INFO) << "drained: the job's rank here ended";
}

void WorkerDaemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stopping_ = true;
    leaving_ = true;
  }
  COLOD_LOG(INFO) << "worker shutting down";
  if (loop_.joinable()) loop_.join();
  // Leave the registry now, so no job is placed here meanwhile and a job
  // running here ends at once, naming this worker.
  if (const std::string id = worker_id(); !id.empty()) {
    if (absl::Status s = DeregisterOnce(id); !s.ok()) {
      COLOD_LOG(WARNING) << "could not deregister from " << options_.coordinator << ": " << s;
    }
  }
  // A running rank is aborted before the server stops: a tensor call in one
  // of its collectives (a peer SIGSTOPped) would hold the drain until the
  // communicator's timeout.
  if (runner_) runner_->Close("the worker is shutting down");
  StopGrpcServer(*grpc_.server, absl::Seconds(2));
  runner_.reset();  // waits for the rank
  metrics_.reset();
  ReleaseWorkDir();
}

void WorkerDaemon::ReleaseWorkDir() {
  if (own_work_dir_) {
    std::error_code ec;
    std::filesystem::remove_all(work_dir_, ec);
    own_work_dir_ = false;
  }
  if (work_dir_lock_ >= 0) {
    ::close(work_dir_lock_);
    work_dir_lock_ = -1;
  }
}

WorkerDaemon::~WorkerDaemon() {
  if (grpc_.server != nullptr) {
    Shutdown();
  } else {
    // A start that failed (its port taken) leaves no directory behind: its
    // own temporary one, or a --work-dir it made (one that was there stays).
    ReleaseWorkDir();
    if (!made_work_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(made_work_dir_, ec);
    }
  }
}

}  // namespace colod
