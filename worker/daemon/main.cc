// colod-worker: one per GPU (or CPU slot). Hosts ColoTensors and runs ranks.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/security_flags.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/serve.h"
#include "kernels/cpu/layer_ops.h"
#include "worker/daemon/worker_daemon.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7071",
          "HOST:PORT for the worker's gRPC API (WorkerService, health, reflection). Port 0 picks a "
          "free port; the chosen port is logged and registered.");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9471",
          "HOST:PORT for Prometheus /metrics. Port 0 picks a free port.");
ABSL_FLAG(std::string, coordinator, "",
          "Coordinator HOST:PORT to register with and heartbeat. Empty runs standalone.");
ABSL_FLAG(std::string, advertise_host, "",
          "Host the coordinator and peers use to reach this worker. Default: the --listen host, "
          "or this machine's host name when --listen is a wildcard (0.0.0.0 or [::]).");
ABSL_FLAG(std::string, device, "auto",
          "auto (CUDA when built with CUDA and the GPU exists, else CPU), cpu, or cuda.");
ABSL_FLAG(int, device_ordinal, 0, "GPU index this worker uses (one worker per GPU).");
ABSL_FLAG(std::string, labels, "",
          "Labels registered with the worker and listed by the coordinator, e.g. zone=a,rack=r12 (at most 64; "
          "keys up to 128 bytes, values up to 1024).");
ABSL_FLAG(std::string, work_dir, "",
          "Scratch directory for job ranks (each gets a subdirectory, removed when it ends) and the downloaded "
          "uploads. No job may name a path in it (PERMISSION_DENIED); keep it outside the --allow-path roots of "
          "every other worker on the machine too. Default: a fresh directory under $TMPDIR (or /tmp), removed at "
          "exit.");
ABSL_FLAG(absl::Duration, tls_refresh_interval, absl::Minutes(1), colod::kTlsRefreshIntervalHelp);
ABSL_FLAG(absl::Duration, auth_token_refresh_interval, absl::Minutes(1), colod::kAuthTokenRefreshIntervalHelp);
ABSL_FLAG(absl::Duration, comm_timeout, absl::Minutes(2),
          "How long a job rank waits for its peers to connect and for each collective before it fails (1s to 24h).");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Minutes(1),
          "On SIGTERM, SIGINT or SIGHUP while a training rank runs whose job saves checkpoints "
          "(checkpoint_dir): how long to wait for every rank of the job to save a checkpoint after the same step "
          "and stop, so that the coordinator places the job again from it and no step is lost (a rolling update, "
          "a preempted node). Heartbeats go on meanwhile; a second signal ends the wait. Give the container a "
          "grace period longer than this plus a step and a checkpoint's save. 0: no drain, the rank stops at "
          "once and its job restarts from its last checkpoint. 0 to 24h.");
ABSL_FLAG(absl::Duration, metrics_linger, absl::Minutes(1),
          "How long a job rank's metrics (step times, tokens, loss, collectives) stay on /metrics after the "
          "rank ended, so that a scrape sees its final values; then they are removed. 0 to 24h.");
ABSL_FLAG(std::vector<std::string>, allow_path, {},
          "A directory jobs may read and write (model weights, data, checkpoints, outputs); repeat it or separate "
          "with commas. A job naming a path outside every one, or in --work-dir (however it reaches it, through "
          "links too), fails PERMISSION_DENIED; a root in --work-dir allows nothing and is dropped with a warning "
          "(the worker does not start where every root is one). Default: none, which allows every path this "
          "worker's user can open but --work-dir (logged at start).");
ABSL_FLAG(std::string, memory_limit, "",
          "Memory a job rank may use, e.g. 8GiB or 512MiB; reported to the coordinator, which places no rank "
          "here whose model needs more (parameters, gradients, optimizer state, and a training rank's "
          "activations), and checked again before a rank "
          "allocates. Default: the GPU's memory, or the host's (its cgroup's limit in a container), less a "
          "tenth (at least 1 GiB) for the process itself: the CUDA context, NCCL's and gRPC's buffers.");
ABSL_FLAG(double, peak_tflops, 0,
          "The device's dense peak in TFLOP/s for the dtype its jobs train in, for the jobs' MFU (coloctl "
          "status). Default: a GPU's datasheet figures where its name is known (A100, A10, L4, L40(S), "
          "H100, H200, B200), none for a CPU, whose jobs then report no MFU.");
ABSL_FLAG(absl::Duration, upload_cache_ttl, absl::Hours(1),
          "Uploaded models this worker downloaded (WORK_DIR/uploads) and no rank used for this long (counted "
          "from the end of the last rank that used one) are removed before the next download (inf: never).");
ABSL_FLAG(std::string, min_free_work_dir, "64MiB",
          "A rank that loads a model (TRAIN, FORWARD) is refused while the file system of --work-dir has less "
          "room than this, or no free inode: the coordinator places the job on other workers and tries this one "
          "again later. A rank that fills the disk all the same fails as the worker's fault, and the job restarts "
          "elsewhere. 0 turns the check off.");
ABSL_FLAG(int, blas_threads, 0,
          "Threads a CPU rank's GEMMs (OpenBLAS) and large elementwise loops use. 0: $OPENBLAS_NUM_THREADS when "
          "set (the Kubernetes CPU overlay sets it to the CPU limit), else 1, a core per worker. More threads than "
          "the worker's cores make OpenBLAS's helpers spin against each other.");
ABSL_FLAG(int, max_server_threads, 256,
          "Threads the gRPC server runs calls on at once (the coordinator's job and tensor calls); a call past "
          "them is refused RESOURCE_EXHAUSTED. At least 2: one thread polls for calls.");
ABSL_FLAG(std::string, ready_file, "",
          "If set, once serving, write 'grpc=HOST:PORT' and 'metrics=HOST:PORT' lines to this "
          "file (atomically), for scripts that start the daemon with port 0.");

namespace {

constexpr char kUsage[] =
    "colod-worker: a colod worker daemon, one per GPU (or CPU slot).\n"
    "\n"
    "Serves WorkerService, grpc.health.v1 and server reflection on --listen and Prometheus\n"
    "metrics on --metrics-listen. With --coordinator it registers, heartbeats, and\n"
    "re-registers if the coordinator forgets it; colod.v1.WorkerService reports SERVING\n"
    "while registered (NOT_SERVING before, and while it registers again). Runs the\n"
    "ranks of jobs the coordinator assigns (AssignJob): builds its communicators\n"
    "through the coordinator's rendezvous store, loads its shard of the model, trains,\n"
    "reports progress, and goes back to idle; AbortJob stops it.\n"
    "Computes with CUDA + NCCL on a GPU, OpenBLAS + Gloo on a CPU.\n"
    "Stops cleanly on SIGTERM, SIGINT or SIGHUP.\n"
    "\n"
    "Usage:\n"
    "  colod-worker --coordinator HOST:PORT [--listen HOST:PORT] [--metrics-listen HOST:PORT]\n"
    "\n"
    "Example (loopback, free ports):\n"
    "  colod-worker --coordinator 127.0.0.1:7070 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0\n"
    "\n"
    "Exit status: 0 after a clean stop, 1 when it cannot start or write --ready-file, 2 for a\n"
    "usage error; 70 when its CUDA device faulted and 71 when an exception escaped every handler\n"
    "(as Gloo's own thread can throw when a peer resets a connection mid-handshake): both logged,\n"
    "and both ask its supervisor to start it again (coloctl local does, up to 3 times).\n";

}  // namespace

int main(int argc, char** argv) {
  colod::ExitOnUncaughtExceptions("colod-worker");
  colod::kernels::cpu::PreferAvx512Blas(argv);
  colod::BlockShutdownSignals();
  colod::RaiseOpenFileLimit();
  std::vector<std::string> args = colod::ParseFlags(argc, argv, kUsage, {"allow_path"});
  if (!args.empty()) {
    COLOD_LOG(ERROR) << "unexpected argument '" << args[0] << "' (see --help)";
    return 2;
  }
  colod::WorkerDaemon::Options options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  options.device = absl::GetFlag(FLAGS_device);
  options.allow_paths = absl::GetFlag(FLAGS_allow_path);
  options.upload_cache_ttl = absl::GetFlag(FLAGS_upload_cache_ttl);
  options.max_server_threads = absl::GetFlag(FLAGS_max_server_threads);
  int blas_threads = absl::GetFlag(FLAGS_blas_threads);
  if (blas_threads == 0) {
    const char* env = std::getenv("OPENBLAS_NUM_THREADS");
    if (env == nullptr || !absl::SimpleAtoi(env, &blas_threads) || blas_threads < 1) blas_threads = 1;
  }
  if (blas_threads < 1 || blas_threads > 1024) {
    COLOD_LOG(ERROR) << "--blas-threads must be in [0, 1024], not " << blas_threads;
    return 2;
  }
  colod::kernels::cpu::SetBlasThreads(blas_threads);
  if (const std::string limit = absl::GetFlag(FLAGS_memory_limit); !limit.empty()) {
    absl::StatusOr<int64_t> bytes = colod::ParseByteSize(limit);
    if (!bytes.ok()) {
      COLOD_LOG(ERROR) << "--memory-limit: " << bytes.status().message();
      return 2;
    }
    options.memory_limit_bytes = *bytes;
  }
  {
    absl::StatusOr<int64_t> bytes = colod::ParseByteSize(absl::GetFlag(FLAGS_min_free_work_dir));
    if (!bytes.ok()) {
      COLOD_LOG(ERROR) << "--min-free-work-dir: " << bytes.status().message();
      return 2;
    }
    options.min_free_work_dir_bytes = *bytes;
  }
  options.peak_tflops = absl::GetFlag(FLAGS_peak_tflops);
  options.device_ordinal = absl::GetFlag(FLAGS_device_ordinal);
  options.work_dir = absl::GetFlag(FLAGS_work_dir);
  for (absl::string_view pair : absl::StrSplit(absl::GetFlag(FLAGS_labels), ',', absl::SkipWhitespace())) {
    const size_t eq = pair.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      COLOD_LOG(ERROR) << "--labels: '" << pair << "' is not KEY=VALUE";
      return 2;
    }
    if (eq > colod::kMaxLabelKeyBytes || pair.size() - eq - 1 > colod::kMaxLabelValueBytes) {
      COLOD_LOG(ERROR) << "--labels: keys take 1 to " << colod::kMaxLabelKeyBytes << " bytes and values at most "
                       << colod::kMaxLabelValueBytes;
      return 2;
    }
    options.labels[std::string(pair.substr(0, eq))] = std::string(pair.substr(eq + 1));
  }
  if (options.labels.size() > static_cast<size_t>(colod::kMaxLabels)) {
    COLOD_LOG(ERROR) << "--labels: " << options.labels.size() << " labels, more than " << colod::kMaxLabels;
    return 2;
  }
  options.comm_timeout = absl::GetFlag(FLAGS_comm_timeout);
  options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  options.metrics_linger = absl::GetFlag(FLAGS_metrics_linger);
  auto security = colod::SecurityFromFlags(/*token_from_env=*/false, absl::GetFlag(FLAGS_auth_token_refresh_interval));
  if (!security.ok()) {
    COLOD_LOG(ERROR) << security.status().message();
    return 2;
  }
  options.tls = security->tls;
  options.tls.refresh = absl::GetFlag(FLAGS_tls_refresh_interval);  // checked by MakeServerCredentials
  options.auth_token = security->auth_token;
  auto worker = colod::WorkerDaemon::Start(options);
  if (!worker.ok()) {
    COLOD_LOG(ERROR) << "cannot start: " << worker.status().message();
    // A flag's value that cannot be (--max-workers 0, no --data-dir) is a
    // usage error, as the usage says; a start that failed otherwise (a port
    // taken, a data dir another daemon holds) is not.
    return absl::IsInvalidArgument(worker.status()) ? 2 : 1;
  }
  auto& daemon = **worker;
  const int code = colod::ServeUntilSignal(
      "worker", absl::GetFlag(FLAGS_ready_file), daemon.address(), daemon.metrics_address(), [&daemon] {
        // A second signal ends a drain early; one after the drain, the process.
        daemon.Drain([] { return colod::WaitForShutdownSignalFor(absl::ZeroDuration()) > 0; });
        colod::ExitOnNextShutdownSignal("worker");
        daemon.Shutdown();
      });
  if (const absl::Status lost = daemon.device_lost(); !lost.ok()) {
    COLOD_LOG(ERROR) << "exiting " << colod::WorkerDaemon::kExitDeviceLost << " for a restart: " << lost.message();
    return colod::WorkerDaemon::kExitDeviceLost;
  }
  return code;
}
