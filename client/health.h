// The grpc.health.v1 check of a colod daemon (or any gRPC server), as
// `coloctl health`, container HEALTHCHECKs and tests call it. The health
// service is never behind the bearer token, so no token is sent; TLS daemons
// need a TLS probe.
#ifndef COLOD_CLIENT_HEALTH_H_
#define COLOD_CLIENT_HEALTH_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"

namespace colod {

// grpc.health.v1.HealthCheckResponse.ServingStatus values.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", or "UNKNOWN" (for any other value).
absl::string_view ServingStatusName(ServingStatus status);

struct HealthCheckOptions {
  // Deadline of the call, connecting included: a probe must not hang on an
  // address that accepts connections but never answers.
  absl::Duration timeout = absl::Seconds(5);
  // nullptr: plaintext. For a TLS daemon, MakeChannelCredentials (common/auth.h)
  // of its CA, and of our cert + key where it requires mutual TLS.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

// Calls grpc.health.v1.Health/Check on `address` (HOST:PORT) for `service`
// ("" = the whole server; colod.v1.CoordinatorService and
// colod.v1.WorkerService are SERVING only while the daemon is ready for
// work). A service the server does not know is NOT_FOUND, as the protocol
// says. INVALID_ARGUMENT for a malformed address or a timeout <= 0;
// UNAVAILABLE and DEADLINE_EXCEEDED name the address.
absl::StatusOr<ServingStatus> CheckHealth(const std::string& address, const std::string& service,
                                          const HealthCheckOptions& options = {});

}  // namespace colod

#endif  // COLOD_CLIENT_HEALTH_H_
