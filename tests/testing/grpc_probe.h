// Generic gRPC probes that need no generated code, as any generic gRPC client
// (grpcurl, a Kubernetes probe) would call them: the grpc.health.v1 check
// (the client library's, client/health.h) and the server-reflection service
// list.
#ifndef COLOD_TESTS_TESTING_GRPC_PROBE_H_
#define COLOD_TESTS_TESTING_GRPC_PROBE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/health.h"

namespace colod::testing {

using ServingStatus = ::colod::ServingStatus;

// CheckHealth in plaintext, the tests' daemons being plaintext: for `service`
// ("" = the whole server); NOT_FOUND for a service the server does not know.
inline absl::StatusOr<ServingStatus> HealthCheck(const std::string& address, const std::string& service,
                                                 absl::Duration timeout = absl::Seconds(5)) {
  HealthCheckOptions options;
  options.timeout = timeout;
  return CheckHealth(address, service, options);
}

// Lists service names through grpc.reflection.v1alpha.ServerReflection.
absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    const std::string& address, absl::Duration timeout = absl::Seconds(5));

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_GRPC_PROBE_H_
