#include "common/grpc_server.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
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
// The shutdown signals; what ShutdownSignals() takes of them.
constexpr int kHandledSignals[] = {SIGTERM, SIGINT, SIGHUP};
constexpr int kHandledCount = sizeof(kHandledSignals) / sizeof(kHandledSignals[0]);

sigset_t ShutdownSignals() {
  // SIGHUP: the terminal went away; unless the process was started to
  // outlive it (nohup: SIGHUP ignored from the start, as looked at on the
  // first call).
  static const bool hup_ignored = [] {
    struct sigaction current {};
    return ::sigaction(SIGHUP, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
  }();
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : kHandledSignals) {
    if (sig != SIGHUP || !hup_ignored) sigaddset(&set, sig);
  }
  return set;
}
}  // namespace

// The shutdown signals reach the waiters through a pipe: a handler writes
// each one's number there, on whichever thread the kernel ran it. Blocking
// them is not enough: threads a library started before main (OpenBLAS's
// pool, at load) do not block them, and a signal that came while no thread
// waited for it in sigwait went to one of those and ended the process (a
// daemon's second SIGTERM during its drain or shutdown, exit 143).
namespace {
std::atomic<int> signal_pipe_write{-1};  // lock-free: read by the handler
std::atomic<int> signal_pipe_read{-1};
static_assert(std::atomic<int>::is_always_lock_free);
// The actions the handler replaced (of kHandledSignals), for a child to
// get back before its exec. Written once, before the handler is installed.
struct sigaction replaced_actions[kHandledCount];

void OnShutdownSignal(int sig) {
  const int saved = errno;
  const unsigned char number = static_cast<unsigned char>(sig);
  const int fd = signal_pipe_write.load(std::memory_order_relaxed);
  if (fd >= 0) (void)!::write(fd, &number, 1);  // non-blocking: a full pipe loses the signal, it holds 64 KiB
  errno = saved;
}
}  // namespace

void BlockShutdownSignals() {
  const sigset_t set = ShutdownSignals();
  static std::once_flag once;
  std::call_once(once, [&set] {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      // Left to sigwait: a signal that comes while no thread waits may end
      // the process (see above).
      COLOD_LOG(ERROR) << "cannot make the shutdown signals' pipe (" << std::strerror(errno)
                       << "): a signal while none is awaited may end the process";
      return;
    }
    signal_pipe_read.store(fds[0]);
    signal_pipe_write.store(fds[1]);
    struct sigaction action {};
    action.sa_handler = OnShutdownSignal;
    action.sa_mask = set;  // one handler at a time
    action.sa_flags = SA_RESTART;
    for (int i = 0; i < kHandledCount; ++i) {
      const int sig = kHandledSignals[i];
      if (sigismember(&set, sig) == 1) ::sigaction(sig, &action, &replaced_actions[i]);
    }
  });
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void RestoreShutdownSignalActionsInChild() {
  for (int i = 0; i < kHandledCount; ++i) {
    struct sigaction current {};
    if (::sigaction(kHandledSignals[i], nullptr, &current) == 0 && current.sa_handler == OnShutdownSignal) {
      ::sigaction(kHandledSignals[i], &replaced_actions[i], nullptr);
    }
  }
}

int WaitForShutdownSignal() {
  for (;;) {
    if (const int sig = WaitForShutdownSignalFor(absl::InfiniteDuration()); sig != 0) return sig;
  }
}

int WaitForShutdownSignalFor(absl::Duration timeout) {
  const sigset_t set = ShutdownSignals();
  const int fd = signal_pipe_read.load();
  if (fd < 0) {  // BlockShutdownSignals did not install the handler: blocked signals are pending
    // (0 too where another handler interrupted the wait.)
    const timespec slice = absl::ToTimespec(std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24)));
    const int sig = ::sigtimedwait(&set, nullptr, &slice);
    return sig > 0 ? sig : 0;
  }
  // The wait unblocks them (ppoll), so that one pending or sent to this
  // thread runs the handler here: it is never left pending while a thread
  // waits.
  sigset_t unblocked;
  pthread_sigmask(SIG_SETMASK, nullptr, &unblocked);
  for (const int sig : kHandledSignals) {
    if (sigismember(&set, sig) == 1) sigdelset(&unblocked, sig);
  }
  const absl::Time deadline = timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + std::max(timeout, absl::ZeroDuration());
  for (bool last = false;;) {
    unsigned char number = 0;
    if (::read(fd, &number, 1) == 1) return number;
    if (last) return 0;
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    last = left == absl::ZeroDuration();
    const timespec slice = absl::ToTimespec(std::min(left, absl::Hours(24)));
    pollfd readable{fd, POLLIN, 0};
    (void)::ppoll(&readable, 1, &slice, &unblocked);  // EINTR: a handler ran, perhaps ours
  }
}

}  // namespace colod
