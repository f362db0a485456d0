#include "server/coordinator.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <system_error>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "server/worker_client.h"

namespace colod {
namespace {

constexpr char kServiceName[] = "colod.v1.CoordinatorService";

}  // namespace

Coordinator::Coordinator(Options options) : options_(std::move(options)) {}

int Coordinator::ServerThreadsFor(const Options& options) {
  return options.max_server_threads > 0 ? options.max_server_threads : DerivedServerThreads(options);
}

int Coordinator::DerivedServerThreads(const Options& options) {
  const int64_t sum = int64_t{options.max_store_waits} + options.max_watch_streams + options.max_concurrent_uploads +
                      options.max_concurrent_downloads + options.key_proofs.max + kServerThreadsForShortCalls;
  return static_cast<int>(std::min<int64_t>(sum, std::numeric_limits<int>::max()));
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(Options options) {
  if (options.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--heartbeat-interval: must be > 0");
  }
  if (options.lease_duration <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lease-duration (", absl::FormatDuration(options.lease_duration),
        ") must be longer than --heartbeat-interval (",
        absl::FormatDuration(options.heartbeat_interval), ")"));
  }
  if (options.max_watch_streams < 1) return absl::InvalidArgumentError("--max-watch-streams: must be >= 1");
  if (!options.worker_token.empty()) {
    for (const std::string& token : options.worker_token.All()) RETURN_IF_ERROR(CheckAuthToken(token));
    if (options.auth_token.empty()) {
      return absl::InvalidArgumentError(
          "--worker-token-file needs --auth-token-file: without a clients' token, anyone (the workers' token too) "
          "could submit, cancel and read jobs");
    }
    if (options.worker_token.SharesATokenWith(options.auth_token)) {
      return absl::InvalidArgumentError(
          "--worker-token-file holds a token of --auth-token-file: the workers' tokens must differ from the "
          "clients', or a client could call what only workers may");
    }
    // So must the files read again later (a read that would share one is refused, the tokens before stay).
    options.worker_token.KeepApartFrom(options.auth_token);
    options.auth_token.KeepApartFrom(options.worker_token);
  }
  if (options.max_workers < 1) return absl::InvalidArgumentError("--max-workers: must be >= 1");
  if (const KeyProofGate::Options& k = options.key_proofs; k.max < 1 || k.max_per_peer < 1 ||
                                                           k.deadline <= absl::ZeroDuration() ||
                                                           k.unreachable_for < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "key_proofs: max and max_per_peer must be >= 1, deadline > 0, unreachable_for >= 0");
  }
  if (options.max_store_waits < 1 || options.store_quota_bytes < 1) {
    return absl::InvalidArgumentError("--max-store-waits and --store-quota must be >= 1");
  }
  if (options.upload_quota_bytes < 0 || options.max_uploads < 1 || options.max_concurrent_uploads < 1 ||
      options.max_concurrent_downloads < 1) {
    return absl::InvalidArgumentError(
        "--upload-quota must be >= 0, and --max-uploads, --max-concurrent-uploads and --max-concurrent-downloads "
        ">= 1");
  }
  if (options.max_server_threads < 0 || options.max_server_threads == 1) {
    // One thread polls for calls and hands each to another: with one, every call but health checks is refused.
    return absl::InvalidArgumentError(
        "--max-server-threads: must be 0 (the long calls' bounds and 512) or at least 2 (one thread polls for calls)");
  }
  const int server_threads = ServerThreadsFor(options);
  if (const int derived = DerivedServerThreads(options); server_threads < derived) {
    COLOD_LOG(WARNING) << "--max-server-threads=" << server_threads << " is below the " << derived
                       << " that the long calls' bounds (store waits, watches, uploads, downloads, checks of "
                        "registrations) and "
                       << kServerThreadsForShortCalls
                       << " more need: heartbeats and job calls may be refused while the long calls hold the rest";
  }
  if (options.upload_grace <= absl::ZeroDuration()) return absl::InvalidArgumentError("upload grace: must be > 0");
  if (options.stream_stall_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--stream-stall-timeout: must be >= 0 (0: never)");
  }
  if (options.stop_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--stop-grace: must be >= 0 (0 waits for every rank's end)");
  }
  if (options.worker_rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--worker-rpc-timeout: must be > 0");
  }
  if (options.max_ended_jobs < 0) {
    return absl::InvalidArgumentError("--max-ended-jobs: must be >= 0 (0 keeps however many)");
  }
  if (options.job_retention < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--job-retention: must be >= 0 (0 keeps every job)");
  }
  if (options.max_active_jobs < 1) return absl::InvalidArgumentError("--max-active-jobs: must be >= 1");
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  ASSIGN_OR_RETURN(c->lock_fd_, LockDirectory(options.data_dir, "--data-dir", "coordinator", &c->made_data_dir_));
  if (options.data_dir_reserve_bytes > 0) {
    ASSIGN_OR_RETURN(c->reserve_, DiskReserve::Create(options.data_dir + "/disk-reserve", options.data_dir_reserve_bytes));
  } else {
    std::error_code ec;
    std::filesystem::remove(options.data_dir + "/disk-reserve", ec);  // an earlier start's, now not wanted
  }

  c->registry_ = std::make_shared<prometheus::Registry>();
  AddBuildInfo(*c->registry_, "coordinator");
  c->workers_gauge_ = &prometheus::BuildGauge()
                           .Name("colod_workers")
                           .Help("Registered workers by state.")
                           .Register(*c->registry_);
  c->jobs_gauge_ = &prometheus::BuildGauge()
                        .Name("colod_jobs")
                        .Help("Jobs known to the coordinator, by state.")
                        .Register(*c->registry_);
  c->heartbeat_age_ = &prometheus::BuildGauge()
                           .Name("colod_worker_heartbeat_age_seconds")
                           .Help("Seconds since each registered worker's last heartbeat (updated every --heartbeat-interval, at least 4 times a second).")
                           .Register(*c->registry_);
  c->hangs_ = &prometheus::BuildCounter()
                    .Name("colod_collective_hangs_total")
                    .Help("Hang reports since the coordinator started: a collective that ranks of a job waited in "
                          "for longer than --hang-threshold (the job's events name the ranks that had not entered "
                          "it).")
                    .Register(*c->registry_)
                    .Add({});
  if (c->reserve_ != nullptr) {  // no series without a reserve: 0 means a full disk
    c->reserve_gauge_ = &prometheus::BuildGauge()
                             .Name("colod_data_dir_reserve_bytes")
                             .Help("Room the coordinator holds on its --data-dir for the job records "
                                   "(--data-dir-reserve); 0 while it is given up to a full disk, when no new job is "
                                   "accepted. Absent with --data-dir-reserve 0.")
                             .Register(*c->registry_)
                             .Add({});
  }
  c->jobs_finished_ = &prometheus::BuildCounter()
                           .Name("colod_jobs_finished_total")
                           .Help("Jobs that ended since the coordinator started, by final state (succeeded, failed, "
                                 "cancelled); a job that spent its max_restarts (on lost workers, refusals or "
                                 "coordinator restarts) counts as failed.")
                           .Register(*c->registry_);

  WorkerRegistry::Options wo;
  wo.heartbeat_interval = options.heartbeat_interval;
  wo.lease_duration = options.lease_duration;
  wo.max_workers = options.max_workers;
  wo.clock = options.clock;
  // Ids unique to this start: after a restart, a worker still heartbeating
  // with its old id must be told NOT_FOUND (and register again), never be
  // taken for another worker that happens to get the same number.
  absl::BitGen bits;
  wo.id_prefix = absl::StrFormat("worker-%06x-", absl::Uniform<uint32_t>(bits, 0, 1u << 24));
  c->workers_ = std::make_unique<WorkerRegistry>(wo);
  ASSIGN_OR_RETURN(c->jobs_, JobManager::Open(options.data_dir + "/jobs", options.clock));
  c->jobs_->SetMaxActiveJobs(options.max_active_jobs);
  RendezvousStoreLimits store_limits;
  store_limits.max_waiters = options.max_store_waits;
  store_limits.max_bytes = options.store_quota_bytes;
  store_limits.placed_scopes_only = !options.store_any_scope;
  c->store_ = std::make_unique<RendezvousStore>(store_limits);
  Scheduler::Options so;
  so.period = options.schedule_period;
  so.hang_threshold = options.hang_threshold;
  so.stop_grace = options.stop_grace;
  so.rpc_timeout = options.worker_rpc_timeout;
  so.clock = options.clock;
  // The workers hold the worker token where there is one.
  const AuthToken& to_workers = options.worker_token.empty() ? options.auth_token : options.worker_token;
  so.auth_token = to_workers;
  ASSIGN_OR_RETURN(so.credentials, MakeChannelCredentials(options.tls));
  c->scheduler_ = std::make_unique<Scheduler>(c->jobs_.get(), c->workers_.get(), c->store_.get(), so);
  UploadStore::Limits upload_limits;
  upload_limits.quota_bytes = options.upload_quota_bytes;
  upload_limits.max_uploads = options.max_uploads;
  upload_limits.max_concurrent_uploads = options.max_concurrent_uploads;
  upload_limits.max_concurrent_downloads = options.max_concurrent_downloads;
  ASSIGN_OR_RETURN(c->uploads_, UploadStore::Open(options.data_dir + "/uploads", upload_limits, options.clock));
  // The room kept for the job records: before the first write of a running
  // job's record or of an upload (the scheduler starts below).
  if (c->reserve_ != nullptr) {
    DiskReserve* reserve = c->reserve_.get();
    JobManager::RoomHooks room;
    // Any write that fails while the reserve is not held is tried again:
    // another write may have just given it up, or a refill be under way.
    room.make_room = [reserve] {
      if (reserve->Release()) {
        COLOD_LOG(ERROR) << "the data dir is full: its " << (reserve->bytes() >> 20) << " MiB reserve was given up "
                         << "to the job records; no new job or upload is accepted until it is taken back";
        return true;
      }
      return !reserve->held();
    };
    room.admit = [reserve] { return reserve->Admits(); };
    c->jobs_->SetRoomHooks(room);
    c->uploads_->SetAdmit([reserve](int64_t bytes) { return reserve->LeavesRoomAfter(bytes); });
  }
  // A request id repeated for another model is not a retry.
  UploadStore* uploads = c->uploads_.get();
  c->jobs_->SetUploadsDiffer([uploads](const std::string& a, const std::string& b) { return uploads->Differ(a, b); });
  c->stalls_ = std::make_unique<StallWatchdog>(options.stream_stall_timeout);
  c->service_ = std::make_unique<CoordinatorServiceImpl>(c->workers_.get(), c->jobs_.get(), c->store_.get(),
                                                          c->registry_.get(),
                                                          TokenAuth(options.auth_token, options.worker_token),
                                                          c->scheduler_.get(), c->uploads_.get(),
                                                          options.max_watch_streams, c->stalls_.get());
  c->UpdateGauges();

  ASSIGN_OR_RETURN(c->metrics_, MetricsServer::Start(options.metrics_listen, c->registry_));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, MakeServerCredentials(options.tls));
  TensorProxy::Options to;
  to.auth_token = options.auth_token;
  to.worker_token = options.worker_token;
  to.worker_key_to_call = [workers = c->workers_.get()](const std::string& id) { return workers->KeyToCall(id); };
  to.credentials = so.credentials;
  c->tensors_ = std::make_unique<TensorProxy>(c->jobs_.get(), c->registry_.get(), to);
  // A worker registering with a key proves it holds it where it listens:
  // the workers' token alone cannot take a registered worker's address, and
  // a daemon restarted on its port replaces its dead self at once.
  KeyProofGate::Options proofs = options.key_proofs;
  proofs.clock = options.clock;
  c->service_->SetProveKey(
      [credentials = so.credentials, to_workers](const std::string& a, const std::string& k, absl::Time deadline,
                                                 const grpc::ServerContext& caller) {
        return ProveWorkerKey(credentials, to_workers, a, k, deadline, &caller);
      },
      proofs);
  // A worker registered anew at an address (a daemon restarted on its
  // port) is called on a new connection: the old one may still be backing
  // off from the dead daemon's refusals, and the first assignment, placed at
  // once, would fail and hold the job in the placement cooloff.
  c->service_->SetOnRegister([scheduler = c->scheduler_.get(), tensors = c->tensors_.get()](const std::string& a) {
    scheduler->ForgetConnection(a);
    tensors->ForgetConnection(a);
  });
  WarnIfOpenWithoutAuth("colod-coordinator", options.listen, !options.auth_token.empty());
  ASSIGN_OR_RETURN(c->grpc_,
                   StartGrpcServer(options.listen, {c->service_.get(), c->tensors_.get()}, credentials, server_threads));
  SetServing(*c->grpc_.server, kServiceName, true);
  c->sweeper_ = std::thread([raw = c.get()] { raw->SweepLoop(); });
  c->scheduler_->Start();
  COLOD_LOG(INFO) << "coordinator serving gRPC on " << c->address() << ", metrics on http://"
                  << c->metrics_address() << "/metrics, data dir " << options.data_dir;
  return c;
}

void Coordinator::UpdateGauges() {
  if (reserve_gauge_ != nullptr) reserve_gauge_->Set(reserve_->held() ? static_cast<double>(reserve_->bytes()) : 0);
  for (const auto& [state, n] : workers_->CountByState()) {
    workers_gauge_->Add({{"state", state}}).Set(n);
  }
  const absl::Time now = options_.clock->Now();
  std::map<std::string, prometheus::Gauge*> ages;
  for (const v1::Worker& w : workers_->List(/*include_lost=*/true)) {
    // A worker that left cleanly sends no more heartbeats by design: its
    // age would page ColodWorkerHeartbeatLate for as long as it is listed.
    if (absl::StartsWith(w.lost_reason(), WorkerRegistry::kLeftPrefix)) continue;
    const absl::Time last = absl::FromUnixSeconds(w.last_heartbeat_time().seconds()) +
                            absl::Nanoseconds(w.last_heartbeat_time().nanos());
    prometheus::Gauge* g = &heartbeat_age_->Add({{"worker", w.info().worker_id()}});
    g->Set(absl::ToDoubleSeconds(now - last));
    ages[w.info().worker_id()] = g;
  }
  for (auto& [id, g] : heartbeat_ages_) {
    if (!ages.count(id)) heartbeat_age_->Remove(g);  // forgotten workers leave no series
  }
  heartbeat_ages_ = std::move(ages);
  for (const auto& [state, n] : jobs_->CountByState()) {
    jobs_gauge_->Add({{"state", state}}).Set(n);
  }
  // Only this thread (and Start, before it) moves the counters.
  const double hangs = static_cast<double>(jobs_->HangCount());
  if (hangs > hangs_->Value()) hangs_->Increment(hangs - hangs_->Value());
  for (const auto& [state, n] : jobs_->FinishedCounts()) {
    prometheus::Counter& c = jobs_finished_->Add({{"state", state}});
    if (static_cast<double>(n) > c.Value()) c.Increment(static_cast<double>(n) - c.Value());
  }
}

void Coordinator::SweepLoop() {
  // Often enough that a job's last step waits little past
  // JobManager::kStepWriteInterval to be written (FlushStale).
  const absl::Duration period = std::min(options_.heartbeat_interval, absl::Milliseconds(250));
  // Expiring ended jobs and collecting uploads walk every job: at most once
  // a minute, or a tenth of the retention or upload grace when shorter.
  const absl::Duration retention =
      options_.job_retention > absl::ZeroDuration() ? options_.job_retention : absl::InfiniteDuration();
  const absl::Duration expire_period = std::min({absl::Minutes(1), retention / 10, options_.upload_grace / 10});
  absl::Time next_expiry = absl::Now();
  absl::Time next_refill = absl::Now();  // a reserve given up is taken back at most every 10 s
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    if (stopping_) break;
    mu_.Unlock();
    try {
      for (const std::string& id : workers_->Sweep()) {
        COLOD_LOG(WARNING) << "worker " << id << " lost: no heartbeat within "
                           << absl::FormatDuration(options_.lease_duration);
      }
      if (absl::Now() >= next_expiry) {
        next_expiry = absl::Now() + expire_period;
        // Uploads no job names (after their grace), then old ended jobs.
        for (const std::string& id : uploads_->CollectGarbage(jobs_->UploadIdsInUse(), options_.upload_grace)) {
          COLOD_LOG(INFO) << "upload " << id << " removed: no job names it";
        }
        const std::vector<std::string> expired =
            jobs_->Expire(options_.job_retention, options_.max_ended_jobs);  // 0: none
        if (!expired.empty()) {
          COLOD_LOG(INFO) << expired.size() << " ended jobs deleted, past --job-retention "
                          << absl::FormatDuration(options_.job_retention) << " or the oldest past --max-ended-jobs "
                          << options_.max_ended_jobs << " (" << expired.front()
                          << (expired.size() > 1 ? absl::StrCat(" ... ", expired.back()) : "") << ")";
        }
      }
      jobs_->FlushStale();  // a job's last steps, which watchers see once written
      if (reserve_ != nullptr && !reserve_->held() && absl::Now() >= next_refill) {
        next_refill = absl::Now() + absl::Seconds(10);
        if (reserve_->Refill()) {
          COLOD_LOG(INFO) << "the data dir has room again: its " << (reserve_->bytes() >> 20)
                          << " MiB reserve is held again, and new jobs are accepted";
        }
      }
      UpdateGauges();
    } catch (const std::exception& e) {
      // A backstop (colod's code returns statuses): the next sweep tries again.
      COLOD_LOG(ERROR) << "a sweep threw: " << e.what();
    }
    mu_.Lock();
  }
}

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stopping_ = true;
  }
  COLOD_LOG(INFO) << "coordinator shutting down";
  // No lease expires and no job changes state while the server drains:
  // heartbeats stop arriving now, and that is the coordinator's doing, not
  // the workers'. Jobs still running are failed by the next start.
  if (sweeper_.joinable()) sweeper_.join();
  scheduler_->Stop();
  store_->Close();  // wakes KvWait/Barrier handlers
  StopGrpcServer(*grpc_.server, absl::Seconds(2));
  jobs_->Flush();  // the steps of the last second: a clean stop loses none
  metrics_.reset();
  if (lock_fd_ >= 0) {
    ::flock(lock_fd_, LOCK_UN);
    ::close(lock_fd_);
    lock_fd_ = -1;
  }
}

Coordinator::~Coordinator() {
  bool started = grpc_.server != nullptr;
  if (started) {
    Shutdown();
  } else {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    // A start that failed (its port taken) leaves no directory it made:
    // nothing was accepted into it. One that was there stays.
    if (!made_data_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(made_data_dir_, ec);
    }
  }
}

}  // namespace colod
