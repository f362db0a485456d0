// Bearer-token authentication of colod's gRPC services. Every colod service
// call carries "authorization: Bearer <token>" when the daemons were started
// with --auth-token-file; health checks and reflection stay open (they are
// separate services), so probes work without the token.
//
// Thread-safety: TokenAuth is immutable.
#ifndef COLOD_COMMON_AUTH_H_
#define COLOD_COMMON_AUTH_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace colod {

// The token in `path` (surrounding whitespace trimmed). NOT_FOUND for a
// missing file, INVALID_ARGUMENT for an empty one or one CheckAuthToken
// refuses.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);
// OK when `token` can travel in the authorization header: printable ASCII
// only (0x20 to 0x7e; RFC 6750's tokens are a part of it). INVALID_ARGUMENT
// naming the first other byte and where it is: a line break, a tab or a
// byte of UTF-8 (which gRPC would abort the process on, sending it).
absl::Status CheckAuthToken(absl::string_view token);

class TokenAuth {
 public:
  // An empty token accepts every call.
  explicit TokenAuth(std::string token = "") : token_(std::move(token)) {}
  bool enabled() const { return !token_.empty(); }
  // UNAUTHENTICATED unless the call carries the token (compared in constant time).
  absl::Status Check(const grpc::ServerContext& ctx) const;

 private:
  std::string token_;
};

// Adds the token (if any) to an outgoing call.
void AddAuthToken(grpc::ClientContext& ctx, const std::string& token);

// TLS files (PEM) of a daemon or client: --tls-cert, --tls-key, --tls-ca.
// All empty: plaintext. cert + key: the server side of TLS. With ca too, a
// server requires and verifies client certificates signed by it (mutual
// TLS), and a client verifies the server against it and presents its own
// cert + key when given.
struct TlsFiles {
  std::string cert, key, ca;
  // How often the files are read again (a renewed certificate, a rotated
  // CA), with --tls-ca given: a server then presents the new certificate and
  // trusts the new CA from the next handshake on, and a channel does as a
  // client; connections already up stay. Zero reads them once, here (so
  // does a client without a CA, which trusts the system's). The files must
  // be replaced at once (the kubelet swaps a directory behind a symbolic
  // link): an unreadable or empty file keeps the last good ones, but a key
  // that does not match its certificate, or a file that does not parse,
  // fails every new handshake until it is fixed (gRPC's
  // FileWatcherCertificateProvider).
  absl::Duration refresh = absl::ZeroDuration();
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
// The help of the daemons' --tls-refresh-interval (TlsFiles::refresh).
inline constexpr char kTlsRefreshIntervalHelp[] =
    "With --tls-ca: how often the TLS files are read again, so that a renewed certificate or a rotated "
    "CA (a Kubernetes Secret updated in place) is served and trusted from the next connection on, with no "
    "restart. Replace the files at once (as the kubelet does): an unreadable or empty file keeps the last "
    "good ones, but a key that does not match its certificate fails new connections until fixed. 0 reads "
    "them once, at start.";
// INVALID_ARGUMENT naming the flag for a cert without a key (or the other
// way round) or a file that holds no PEM block; NOT_FOUND for a file that
// cannot be read. (The files are checked here; a later read is as `refresh`
// says.)
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& tls);

}  // namespace colod

#endif  // COLOD_COMMON_AUTH_H_
