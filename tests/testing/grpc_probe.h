// Generic gRPC probes that need no generated code: the grpc.health.v1 check
// and the server-reflection service list, as any generic gRPC client (grpcurl,
// a Kubernetes probe) would call them. Debian ships neither .proto, and the
// reflection messages' C++ classes already live inside libgrpc++_reflection,
// so the few fields needed are encoded and decoded by hand.
#ifndef COLOD_TESTS_TESTING_GRPC_PROBE_H_
#define COLOD_TESTS_TESTING_GRPC_PROBE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace colod::testing {

// grpc.health.v1.HealthCheckResponse.ServingStatus values.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// Calls grpc.health.v1.Health/Check for `service` ("" = the whole server).
// A service the server does not know is NOT_FOUND, as the protocol says.
absl::StatusOr<ServingStatus> HealthCheck(const std::string& address, const std::string& service,
                                          absl::Duration timeout = absl::Seconds(5));

// Lists service names through grpc.reflection.v1alpha.ServerReflection.
absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    const std::string& address, absl::Duration timeout = absl::Seconds(5));

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_GRPC_PROBE_H_
