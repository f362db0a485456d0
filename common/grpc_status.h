// The one place where absl::Status and grpc::Status are converted.
#ifndef COLOD_COMMON_GRPC_STATUS_H_
#define COLOD_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace colod {

// Maps the canonical code one to one and keeps the message.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace colod

#endif  // COLOD_COMMON_GRPC_STATUS_H_
