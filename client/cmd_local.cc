// Commands that need no coordinator: local (an embedded cluster in the
// foreground), health (a daemon's gRPC health, the containers' HEALTHCHECK)
// and version.
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "client/commands.h"
#include "client/health.h"
#include "client/job_flags.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "common/json.h"
#include "common/security_flags.h"
#include "common/version.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, workers, 2, "local: workers to start (with --device cuda, one per CUDA device: 0 .. N-1).");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "local: the coordinator's gRPC address (port 0 picks one).");
ABSL_FLAG(std::string, data_dir, "",
          "local: coordinator state and worker logs (default: a temporary directory removed on exit).");
ABSL_FLAG(std::string, service, "",
          "health: the service to check: empty for the whole server, colod.v1.CoordinatorService or "
          "colod.v1.WorkerService for a daemon that is ready for work.");

namespace colod::cli {
namespace {

int RunLocal(const std::vector<std::string>&) {
  BlockShutdownSignals();       // before any thread starts; the children unblock
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not skip the cleanup
  if (absl::GetFlag(FLAGS_workers) < 1 || absl::GetFlag(FLAGS_workers) > LocalCluster::kMaxWorkers) {
    return Usage(absl::StrCat("local: --workers must be 1 to ", LocalCluster::kMaxWorkers));
  }
  const absl::StatusOr<bool> cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(absl::StrCat("local: ", cuda.status().message()));
  int interrupted = 0;
  auto cluster = StartLocalCluster(absl::GetFlag(FLAGS_workers), absl::GetFlag(FLAGS_listen),
                                   absl::GetFlag(FLAGS_data_dir), *cuda ? "cuda" : "cpu", &interrupted);
  if (!cluster.ok() && interrupted != 0) {
    std::fprintf(stderr, "coloctl: %s: the local cluster's start was stopped\n", ::strsignal(interrupted));
    return 0;
  }
  if (!cluster.ok() && absl::IsInvalidArgument(cluster.status())) {
    return Usage(absl::StrCat("local: ", cluster.status().message()));
  }
  if (!cluster.ok()) return Fail(cluster.status());
  const auto listed = (*cluster)->workers();
  if (!listed.ok()) return Fail(listed.status());
  const std::vector<v1::Worker>& workers = *listed;
  if (JsonOutput()) {
    // One line, once every worker registered: what a script waits for.
    nlohmann::json ready = {{"coordinator", (*cluster)->address()},
                            {"metrics", absl::StrCat("http://", (*cluster)->metrics_address(), "/metrics")},
                            {"data_dir", (*cluster)->data_dir()},
                            {"workers", nlohmann::json::array()}};
    for (const v1::Worker& w : workers) {
      ready["workers"].push_back({{"worker_id", w.info().worker_id()},
                                  {"address", w.info().address()},
                                  {"metrics", absl::StrCat("http://", w.info().metrics_address(), "/metrics")}});
    }
    std::printf("%s\n", JsonText(ready).c_str());
  } else {
    std::printf("coordinator %s (metrics http://%s/metrics), data dir %s\n", (*cluster)->address().c_str(),
                (*cluster)->metrics_address().c_str(), (*cluster)->data_dir().c_str());
    for (const v1::Worker& w : workers) {
      std::printf("worker %s at %s (metrics http://%s/metrics)\n", w.info().worker_id().c_str(),
                  w.info().address().c_str(), w.info().metrics_address().c_str());
    }
    std::printf("ready: %zu workers registered; export COLOD_COORDINATOR=%s; Ctrl-C stops the cluster\n",
                workers.size(), (*cluster)->address().c_str());
  }
  std::fflush(stdout);
  const int sig = WaitForShutdownSignal();
  std::fprintf(stderr, "coloctl: %s: stopping the local cluster (again: at once)\n", ::strsignal(sig));
  (*cluster)->StopOnSignal();
  return 0;
}

// Exit 0 only for SERVING, so that it can be a container's HEALTHCHECK as it is.
int RunHealth(const std::vector<std::string>& operands) {
  const std::string& address = operands[0];
  const std::string service = absl::GetFlag(FLAGS_service);
  // TLS daemons need a TLS probe; the health service never wants the token,
  // so $COLOD_AUTH_TOKEN_FILE is not read.
  auto security = SecurityFromFlags(/*token_from_env=*/false);
  if (!security.ok()) return Usage(std::string(security.status().message()));
  auto credentials = MakeChannelCredentials(security->tls);
  if (!credentials.ok()) return Usage(std::string(credentials.status().message()));
  HealthCheckOptions options;
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.credentials = *credentials;
  auto checked = CheckHealth(address, service, options);
  if (!checked.ok() && absl::IsInvalidArgument(checked.status())) {
    return Usage(absl::StrCat("health: ", checked.status().message()));
  }
  // NOT_FOUND is how the health protocol says the server does not know the service.
  if (!checked.ok() && !absl::IsNotFound(checked.status())) return Fail(checked.status());
  const ServingStatus status = checked.ok() ? *checked : ServingStatus::kServiceUnknown;
  const std::string name(ServingStatusName(status));
  if (JsonOutput()) {
    std::printf("%s\n", JsonText({{"address", address}, {"service", service}, {"status", name}}).c_str());
  } else {
    std::printf("%s\n", name.c_str());
  }
  return status == ServingStatus::kServing ? 0 : 1;
}

int RunVersion(const std::vector<std::string>&) {
  if (JsonOutput()) {
    std::printf("%s\n", JsonText({{"version", kVersion}}).c_str());
    return 0;
  }
  std::printf("colod %s\n", kVersion);
  return 0;
}

constexpr Command kCommands[] = {
    {"local", "", "workers listen data_dir device",
     "  local       Run an embedded cluster on this machine: a coordinator on --listen\n"
     "              (127.0.0.1:7070) and --workers N workers as child processes on\n"
     "              loopback: CPU ones, or with --device cuda one per CUDA device (worker i\n"
     "              on device i, over NCCL between the processes). Prints the coordinator's\n"
     "              address once every worker has registered, stays in the foreground, and\n"
     "              stops everything on Ctrl-C, SIGTERM or SIGHUP (a second one during the\n"
     "              stop kills what still runs at once). --data-dir keeps the coordinator's\n"
     "              state, the worker logs and their scratch directories (worker-I.work);\n"
     "              with it, a running job that saves checkpoints is drained at the stop (a\n"
     "              checkpoint after the same step on every rank, within 6 s) and goes on\n"
     "              from it at the next start.\n"
     "              A worker that asks for a new process (exit 70: a CUDA device that\n"
     "              faulted; 71: an exception that escaped every handler) is started again,\n"
     "              up to 3 times; a worker that exits otherwise is said on stderr.\n"
     "              --output json: one line once ready, {\"coordinator\", \"metrics\",\n"
     "              \"data_dir\", \"workers\": [{\"worker_id\", \"address\", \"metrics\"}]}.\n",
     RunLocal},
    {"health", "ADDR", "service",
     "  health ADDR Check the gRPC health (grpc.health.v1) of the daemon at HOST:PORT within\n"
     "              --timeout and print SERVING, NOT_SERVING or SERVICE_UNKNOWN (--output\n"
     "              json: address, service, status); exits 0 only when SERVING, 69 when\n"
     "              the daemon cannot be reached or does not answer in time. --service\n"
     "              NAME: colod.v1.CoordinatorService or colod.v1.WorkerService (SERVING once\n"
     "              the daemon is ready for work); default \"\", the whole server. Needs no\n"
     "              coordinator and no token; a TLS daemon needs --tls-ca (and --tls-cert\n"
     "              --tls-key for mutual TLS).\n",
     RunHealth},
    {"version", "", "", "  version     Print the colod version (--output json: {\"version\": ...}).\n", RunVersion},
};

}  // namespace

CommandGroup LocalCommands() { return {"Commands on this machine:", kCommands}; }

}  // namespace colod::cli
