// Network address parsing shared by flags and RPC validation.
#ifndef COLOD_COMMON_NET_H_
#define COLOD_COMMON_NET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace colod {

struct HostPort {
  std::string host;  // name, IPv4 literal, or IPv6 literal without brackets
  int port = 0;
  // "host:port", with brackets around an IPv6 literal.
  std::string ToString() const;
};

// Parses "HOST:PORT" or "[V6]:PORT". INVALID_ARGUMENT, naming `what`, for an
// empty host, a missing or non-numeric port, or a port outside
// [allow_zero_port ? 0 : 1, 65535].
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view what,
                                       bool allow_zero_port);

// The gRPC target that reaches `host_port` (a HOST:PORT that ParseHostPort
// takes) by name or address literal: "dns:///HOST:PORT". Given as it is, a
// host that reads as a gRPC scheme ("unix:9", "ipv4:7") would pick that
// resolver: a worker registering at such an address would make the
// coordinator dial a local socket.
std::string DialTarget(absl::string_view host_port);

// This machine's host name (gethostname), or "localhost" if it has none.
std::string LocalHostName();

// Whether `host` names only this machine: "localhost", 127.0.0.0/8 or ::1.
bool IsLoopbackHost(absl::string_view host);

// Logs a warning when a daemon serves `listen` beyond this machine without
// a token: anyone who reaches the port may call it.
void WarnIfOpenWithoutAuth(absl::string_view daemon, absl::string_view listen, bool has_token);

}  // namespace colod

#endif  // COLOD_COMMON_NET_H_
