#include "common/grpc_status.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace colod {
namespace {

// The longest wait a refusal may suggest: a day.
constexpr int64_t kMaxRetryAfterMs = 86'400'000;

}  // namespace

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
  // RetryAfter's range: 1 ms to a day.
  const int64_t ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(wait), 1, kMaxRetryAfterMs);
  ctx.AddTrailingMetadata(kRetryAfterMetadata, std::to_string(ms));
}

std::optional<absl::Duration> RetryAfter(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  const auto it = trailers.find(kRetryAfterMetadata);
  if (it == trailers.end()) return std::nullopt;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &ms) || ms < 1 ||
      ms > kMaxRetryAfterMs) {
    return std::nullopt;
  }
  return absl::Milliseconds(ms);
}

}  // namespace colod
