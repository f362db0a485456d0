// Generic gRPC probes that need no generated code, as any generic gRPC client
// (grpcurl, a Kubernetes probe) would call them: the grpc.health.v1 check
// (the client library's, client/health.h) and the server-reflection service
// list.
#ifndef COLOD_TESTS_TESTING_GRPC_PROBE_H_
#define COLOD_TESTS_TESTING_GRPC_PROBE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
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

// Polls HealthCheck until `service` says SERVING or `timeout` passes; returns
// the last answer. A worker's WorkerService turns SERVING just after the
// coordinator accepted its registration, so a test that saw the registration
// on the coordinator's side waits for it here rather than racing it.
inline absl::StatusOr<ServingStatus> WaitServing(const std::string& address, const std::string& service,
                                                 absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<ServingStatus> s = HealthCheck(address, service);
    if ((s.ok() && *s == ServingStatus::kServing) || absl::Now() >= deadline) return s;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Lists service names through grpc.reflection.v1alpha.ServerReflection.
absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    const std::string& address, absl::Duration timeout = absl::Seconds(5));

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_GRPC_PROBE_H_
