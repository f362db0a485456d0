#include "common/grpc_status.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace colod {

// absl::StatusCode and grpc::StatusCode share the canonical numbering (0..16).
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void SetRetryAfter(grpc::ServerContext& ctx, absl::Duration wait) {
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(wait));
  ctx.AddTrailingMetadata(kRetryAfterMetadata, std::to_string(ms));
}

std::optional<absl::Duration> RetryAfter(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  const auto it = trailers.find(kRetryAfterMetadata);
  if (it == trailers.end()) return std::nullopt;
  int64_t ms = 0;
  // A day at most: a wait the server could mean.
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &ms) || ms < 1 ||
      ms > int64_t{86'400'000}) {
    return std::nullopt;
  }
  return absl::Milliseconds(ms);
}

}  // namespace colod
