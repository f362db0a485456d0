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
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"

namespace colod {

// The token in `path` (surrounding whitespace trimmed). NOT_FOUND for a
// missing file, INVALID_ARGUMENT for an empty one.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

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

}  // namespace colod

#endif  // COLOD_COMMON_AUTH_H_
