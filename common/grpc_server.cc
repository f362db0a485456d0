#include "common/grpc_server.h"

#include <signal.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace colod {

absl::StatusOr<StartedGrpcServer> StartGrpcServer(absl::string_view listen,
                                                  const std::vector<grpc::Service*>& services,
                                                  std::shared_ptr<grpc::ServerCredentials> credentials,
                                                  int max_threads) {
  if (max_threads < 0) return absl::InvalidArgumentError("the server's thread bound must be >= 0");
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen, "--listen", /*allow_zero_port=*/true));
  // Both are process-wide switches that must be set before a builder is made.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(hp.ToString(), credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
                           &port);
  for (grpc::Service* service : services) builder.RegisterService(service);
  // A port another server holds is refused, not shared: gRPC sets
  // SO_REUSEPORT by default, so a second daemon on the same --listen would
  // start and take half of the first one's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // The pings of CreateKeepaliveChannel's clients (one a second at most).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(kMinKeepaliveTime)));
  if (max_threads > 0) {
    // The sync server asks the quota for a thread before it starts one, and
    // answers RESOURCE_EXHAUSTED where the quota has none.
    grpc::ResourceQuota quota("colod-server");
    quota.SetMaxThreads(max_threads);
    builder.SetResourceQuota(quota);
  }
  StartedGrpcServer out;
  out.server = builder.BuildAndStart();
  if (out.server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", hp.ToString(),
                                               " (address in use or not local?)"));
  }
  out.port = port;
  hp.port = port;
  out.address = hp.ToString();
  return out;
}

std::shared_ptr<grpc::Channel> CreateKeepaliveChannel(const std::string& address,
                                                      std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                      const Keepalive& keepalive) {
  grpc::ChannelArguments args;
  const auto ms = [](absl::Duration d) {
    return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, std::numeric_limits<int>::max()));
  };
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms(std::max(keepalive.time, kMinKeepaliveTime)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(keepalive.timeout));
  // Pings only while a call is open, and however long it reads nothing (a
  // watch of a queued job): gRPC's default stops after two without data.
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return grpc::CreateCustomChannel(address, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(),
                                   args);
}

void SetServing(grpc::Server& server, absl::string_view service, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health != nullptr) health->SetServingStatus(std::string(service), serving);
}

void StopGrpcServer(grpc::Server& server, absl::Duration grace) {
  // The health service's own pending calls would otherwise hold Shutdown()
  // until the grace period ends.
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health != nullptr) health->Shutdown();
  server.Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server.Wait();
}

namespace {
sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  // The terminal went away; unless the process was started to outlive it
  // (nohup: SIGHUP ignored from the start, as looked at on the first call).
  static const bool hup_ignored = [] {
    struct sigaction current {};
    return ::sigaction(SIGHUP, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
  }();
  if (!hup_ignored) sigaddset(&set, SIGHUP);
  return set;
}
}  // namespace

void BlockShutdownSignals() {
  sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal() {
  sigset_t set = ShutdownSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

int WaitForShutdownSignalFor(absl::Duration timeout) {
  const sigset_t set = ShutdownSignals();
  const timespec slice = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  const int sig = ::sigtimedwait(&set, nullptr, &slice);
  return sig > 0 ? sig : 0;
}

}  // namespace colod
