// colod-coordinator: registers workers, runs jobs, serves the rendezvous store.
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/security_flags.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/logging.h"
#include "common/serve.h"
#include "server/coordinator.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070",
          "HOST:PORT for the gRPC API (CoordinatorService, health, reflection). Port 0 picks a "
          "free port; the chosen port is logged.");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9470",
          "HOST:PORT for Prometheus /metrics. Port 0 picks a free port.");
ABSL_FLAG(std::string, data_dir, "",
          "Directory for the coordinator's state (required). Created if missing; locked so that "
          "two coordinators never share it.");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(2),
          "How often workers are told to heartbeat, e.g. 2s or 500ms.");
ABSL_FLAG(absl::Duration, lease_duration, absl::Seconds(10),
          "A worker without a heartbeat for this long is marked lost.");
ABSL_FLAG(absl::Duration, tls_refresh_interval, absl::Minutes(1), colod::kTlsRefreshIntervalHelp);
ABSL_FLAG(absl::Duration, auth_token_refresh_interval, absl::Minutes(1), colod::kAuthTokenRefreshIntervalHelp);
ABSL_FLAG(int, max_workers, colod::WorkerRegistry::kDefaultMaxWorkers,
          "Workers registered at once, lost ones included (they are listed for 10 minutes): a registration past "
          "it forgets the worker lost longest, and is refused RESOURCE_EXHAUSTED where none is lost.");
ABSL_FLAG(absl::Duration, hang_threshold, absl::Seconds(30),
          "Ranks that wait in a collective this long are reported: a job event and the job's 'stalled' field "
          "name the group, the collective and the ranks that have not entered it. Keep it below the workers' "
          "--comm-timeout; 0 turns it off.");
ABSL_FLAG(absl::Duration, stop_grace, absl::Minutes(2),
          "A job's ranks are aborted when it ends or restarts, and it is released (or placed again) once they "
          "ended; a rank still running this long after its abort, its worker heartbeating, is given up on "
          "(logged) and its worker gets no other rank until it reports idle. 0 waits for every rank.");
ABSL_FLAG(absl::Duration, worker_rpc_timeout, absl::Seconds(10),
          "Deadline of the coordinator's calls that start ranks on the workers (AssignJob; the calls that stop "
          "them, AbortJob, get at most 3s of it). A worker that does not answer an assignment within it has "
          "refused it: the job is placed again without that worker. Raise it where workers are far away or "
          "heavily loaded.");
ABSL_FLAG(absl::Duration, job_retention, absl::Hours(7 * 24),
          "Jobs that ended longer ago than this are forgotten: their records, events and request ids "
          "(coloctl delete JOB does it at once). 0 keeps every job.");
ABSL_FLAG(int64_t, max_ended_jobs, colod::JobManager::kDefaultMaxEndedJobs,
          "Ended jobs kept at most: past it the oldest ended are forgotten (as after --job-retention), checked "
          "about once a minute, so that a coordinator that runs many short jobs keeps bounded memory. 0 keeps "
          "however many.");
ABSL_FLAG(int64_t, max_active_jobs, colod::JobManager::kDefaultMaxActiveJobs,
          "Jobs not ended (queued, placed, running, restarting) at once; a submit past it is refused "
          "RESOURCE_EXHAUSTED (every queued job is looked at on each scheduling pass).");
ABSL_FLAG(int, max_watch_streams, 256,
          "WatchJob streams served at once (each holds a server thread); more are refused RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_store_waits, 8192,
          "Rendezvous waits (KvWait, Barrier) blocked at once, each holding a server thread; more are refused "
          "UNAVAILABLE, which workers ask again within their deadline. Every rank of a job may wait at once: keep "
          "it above the largest job's ranks.");
ABSL_FLAG(std::string, store_quota, "1GiB",
          "Bytes the rendezvous store holds (keys, values, barriers); a KvSet past it is refused UNAVAILABLE, "
          "which workers ask again within their deadline. A job generation's keys are dropped when it ends.");
ABSL_FLAG(std::string, upload_quota, "256GiB",
          "Bytes of all uploaded models together, 4 KiB a file besides its bytes (UploadModel past it is "
          "RESOURCE_EXHAUSTED); identical uploads "
          "are stored once, and an upload no job names is removed an hour after it was made or last named.");
ABSL_FLAG(std::string, data_dir_reserve, "64MiB",
          "Room kept on --data-dir for the job records (the file DATA_DIR/disk-reserve): given up when a record "
          "cannot be written for want of room, so that no job event a watcher saw is lost in a crash; no new job "
          "or upload is accepted until the file system has room for it twice over and it is taken back "
          "(colod_data_dir_reserve_bytes is 0 meanwhile). At most half the file system. 0: none.");
ABSL_FLAG(int, max_uploads, 1000, "Uploaded models stored at once.");
ABSL_FLAG(int, max_concurrent_uploads, 16,
          "UploadModel streams in progress at once (each holds a server thread while it lasts); more are refused "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_concurrent_downloads, 64,
          "DownloadModel streams in progress at once (workers fetching a job's uploaded model, each holding a server "
          "thread); more are refused RESOURCE_EXHAUSTED, and workers retry until their download deadline.");
ABSL_FLAG(absl::Duration, stream_stall_timeout, absl::Minutes(2),
          "An UploadModel or DownloadModel stream that moves no chunk this long (its client stopped sending or "
          "reading), or a WatchJob stream whose client reads no event this long, is cancelled, freeing its place "
          "and server thread. 0: never.");
ABSL_FLAG(int, max_server_threads, 0,
          "Threads the gRPC server runs calls on at once; a call past them is refused RESOURCE_EXHAUSTED. 0: the "
          "sum of --max-store-waits, --max-watch-streams, --max-concurrent-uploads and --max-concurrent-downloads, "
          "16 for the checks of registrations at their addresses, and 512 for short calls (heartbeats, job calls). Else at least 2: one thread polls for calls.");
ABSL_FLAG(std::string, worker_token_file, "",
          "File holding the workers' bearer token: the calls only workers make (registration, heartbeats, "
          "progress reports, the rendezvous store, model downloads) must carry it, the coordinator's calls to "
          "the workers carry it, and the workers take it as their --auth-token-file. It must differ from "
          "--auth-token-file (which it needs), which then admits the clients' calls only. Empty: "
          "--auth-token-file's token plays both roles.");
ABSL_FLAG(std::string, ready_file, "",
          "If set, once serving, write 'grpc=HOST:PORT' and 'metrics=HOST:PORT' lines to this "
          "file (atomically), for scripts that start the daemon with port 0.");

namespace {

constexpr char kUsage[] =
    "colod-coordinator: the colod control plane.\n"
    "\n"
    "Registers worker daemons and watches their heartbeats, validates and queues jobs,\n"
    "builds process-group meshes, and serves the rendezvous store that Gloo and NCCL\n"
    "use to connect. Serves grpc.health.v1 and server reflection on --listen and\n"
    "Prometheus metrics on --metrics-listen. Stops cleanly on SIGTERM, SIGINT or SIGHUP.\n"
    "\n"
    "Usage:\n"
    "  colod-coordinator --data-dir DIR [--listen HOST:PORT] [--metrics-listen HOST:PORT]\n"
    "\n"
    "Example (loopback, free ports):\n"
    "  colod-coordinator --data-dir /tmp/colod --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0\n"
    "\n"
    "Exit status: 0 after a clean stop, 1 when it cannot start or write --ready-file, 2 for a\n"
    "usage error, 71 when an exception escaped every handler (logged; start it again).\n";

}  // namespace

int main(int argc, char** argv) {
  colod::ExitOnUncaughtExceptions("colod-coordinator");
  colod::BlockShutdownSignals();
  colod::RaiseOpenFileLimit();
  std::vector<std::string> args = colod::ParseFlags(argc, argv, kUsage);
  if (!args.empty()) {
    COLOD_LOG(ERROR) << "unexpected argument '" << args[0] << "' (see --help)";
    return 2;
  }
  colod::Coordinator::Options options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.lease_duration = absl::GetFlag(FLAGS_lease_duration);
  options.max_workers = absl::GetFlag(FLAGS_max_workers);
  options.hang_threshold = absl::GetFlag(FLAGS_hang_threshold);
  options.stop_grace = absl::GetFlag(FLAGS_stop_grace);
  options.worker_rpc_timeout = absl::GetFlag(FLAGS_worker_rpc_timeout);
  options.job_retention = absl::GetFlag(FLAGS_job_retention);
  options.max_ended_jobs = absl::GetFlag(FLAGS_max_ended_jobs);
  options.max_active_jobs = absl::GetFlag(FLAGS_max_active_jobs);
  options.max_watch_streams = absl::GetFlag(FLAGS_max_watch_streams);
  options.max_uploads = absl::GetFlag(FLAGS_max_uploads);
  options.max_concurrent_uploads = absl::GetFlag(FLAGS_max_concurrent_uploads);
  options.max_store_waits = absl::GetFlag(FLAGS_max_store_waits);
  options.max_concurrent_downloads = absl::GetFlag(FLAGS_max_concurrent_downloads);
  options.max_server_threads = absl::GetFlag(FLAGS_max_server_threads);
  options.stream_stall_timeout = absl::GetFlag(FLAGS_stream_stall_timeout);
  // A byte-size flag's value (e.g. 256GiB); false, having said why, if it is not one.
  auto byte_size = [](const char* flag, const std::string& value, int64_t* out) {
    absl::StatusOr<int64_t> bytes = colod::ParseByteSize(value);
    if (!bytes.ok()) {
      COLOD_LOG(ERROR) << flag << ": " << bytes.status().message();
      return false;
    }
    *out = *bytes;
    return true;
  };
  if (!byte_size("--store-quota", absl::GetFlag(FLAGS_store_quota), &options.store_quota_bytes) ||
      !byte_size("--upload-quota", absl::GetFlag(FLAGS_upload_quota), &options.upload_quota_bytes) ||
      !byte_size("--data-dir-reserve", absl::GetFlag(FLAGS_data_dir_reserve), &options.data_dir_reserve_bytes)) {
    return 2;
  }
  auto security = colod::SecurityFromFlags(/*token_from_env=*/false, absl::GetFlag(FLAGS_auth_token_refresh_interval));
  if (!security.ok()) {
    COLOD_LOG(ERROR) << security.status().message();
    return 2;
  }
  options.tls = security->tls;
  options.tls.refresh = absl::GetFlag(FLAGS_tls_refresh_interval);  // checked by MakeServerCredentials
  options.auth_token = security->auth_token;
  if (const std::string path = absl::GetFlag(FLAGS_worker_token_file); !path.empty()) {
    auto token =
        colod::AuthToken::FromFile(path, "--worker-token-file", absl::GetFlag(FLAGS_auth_token_refresh_interval));
    if (!token.ok()) {
      COLOD_LOG(ERROR) << token.status().message();
      return 2;
    }
    options.worker_token = *std::move(token);
  }
  auto coordinator = colod::Coordinator::Start(options);
  if (!coordinator.ok()) {
    COLOD_LOG(ERROR) << "cannot start: " << coordinator.status().message();
    // A flag's value that cannot be (--max-workers 0, no --data-dir) is a
    // usage error, as the usage says; a start that failed otherwise (a port
    // taken, a data dir another daemon holds) is not.
    return absl::IsInvalidArgument(coordinator.status()) ? 2 : 1;
  }
  auto& daemon = **coordinator;
  return colod::ServeUntilSignal("coordinator", absl::GetFlag(FLAGS_ready_file), daemon.address(),
                                 daemon.metrics_address(), [&daemon] {
                                   colod::ExitOnNextShutdownSignal("coordinator");  // a second signal
                                   daemon.Shutdown();
                                 });
}
