// Starting a daemon's gRPC server the same way everywhere: health, reflection,
// port 0, and shutdown on SIGTERM/SIGINT.
#ifndef COLOD_COMMON_GRPC_SERVER_H_
#define COLOD_COMMON_GRPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/impl/codegen/service_type.h"

namespace colod {

struct StartedGrpcServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  // HOST:PORT with the bound port.
  std::string address;
};

// Builds and starts a server on `listen` (HOST:PORT; port 0 picks a free
// port) with `services`, the grpc.health.v1 service and server reflection.
// The overall health ("") is SERVING; each named service starts NOT_SERVING
// until the caller marks it ready with SetServing. Insecure transport.
// `credentials` null means plaintext (MakeServerCredentials builds TLS ones).
// `max_threads` > 0 bounds the threads that run calls (and poll for them) at
// once: a call that finds none free is refused RESOURCE_EXHAUSTED ("Server
// Threadpool Exhausted") instead of starting another thread; 0: unbounded.
absl::StatusOr<StartedGrpcServer> StartGrpcServer(absl::string_view listen,
                                                  const std::vector<grpc::Service*>& services,
                                                  std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
                                                  int max_threads = 0);

// The keepalive of the project's channels: while a call is open, a channel
// that read nothing for `time` pings its peer, and closes the connection
// (its calls end UNAVAILABLE) when no answer comes within `timeout`. A peer
// stopped (SIGSTOP) or cut off without a reset then ends a watch stream or a
// long upload in `time` + `timeout`, rather than at the call's deadline (a
// day, for a watch). Servers started by StartGrpcServer accept a ping a
// second (gRPC's default refuses more than one in 5 minutes without data,
// and ends the connection); `time` must be at least 1 s.
struct Keepalive {
  absl::Duration time = absl::Seconds(20);
  absl::Duration timeout = absl::Seconds(10);
};
inline constexpr absl::Duration kMinKeepaliveTime = absl::Seconds(1);

// A channel to `address` with `credentials` (null: plaintext) and
// `keepalive`. Connects lazily.
std::shared_ptr<grpc::Channel> CreateKeepaliveChannel(const std::string& address,
                                                      std::shared_ptr<grpc::ChannelCredentials> credentials,
                                                      const Keepalive& keepalive = {});

// Sets the health status of `service` (a full name like "colod.v1.WorkerService").
void SetServing(grpc::Server& server, absl::string_view service, bool serving);

// Marks every service NOT_SERVING, then stops the server: in-flight calls get
// up to `grace` to finish and are cancelled after it. Returns once stopped.
void StopGrpcServer(grpc::Server& server, absl::Duration grace);

// Takes SIGTERM, SIGINT and SIGHUP (SIGHUP only when it was not ignored
// when the process started: under nohup it stays ignored; SIGTERM and
// SIGINT even where ignored) for WaitForShutdownSignal: a handler queues
// each one, on whichever thread it runs, and they are blocked in the calling
// thread and every thread it starts afterwards, so that no call of theirs
// is interrupted (EINTR). Threads started before the call, as libraries
// start theirs before main (OpenBLAS's pool), do not block them: the
// handler may run there, and a call of theirs that SA_RESTART does not
// restart may see EINTR; before the handler, such a signal ended the
// process. Call first thing in main; a child forked afterwards calls
// RestoreShutdownSignalActionsInChild before it unblocks them.
void BlockShutdownSignals();

// For a child between fork and exec, before it unblocks the signals: the
// actions BlockShutdownSignals replaced come back (an ignored signal stays
// ignored), so that none that comes before the exec runs the parent's
// handler (which would queue it for the parent's wait). Async-signal-safe.
void RestoreShutdownSignalActionsInChild();

// Waits for SIGTERM, SIGINT or SIGHUP (BlockShutdownSignals beforehand) and
// returns its number. Each signal is returned once, to one waiter.
int WaitForShutdownSignal();

// The same for at most `timeout`: the signal's number, or 0 if none came
// (without BlockShutdownSignals' handler, 0 too where another signal's
// handler interrupted the wait).
int WaitForShutdownSignalFor(absl::Duration timeout);

}  // namespace colod

#endif  // COLOD_COMMON_GRPC_SERVER_H_
