#include "common/grpc_status.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "common/text.h"

namespace colod {
namespace {

// The longest wait a refusal may suggest: a day.
constexpr int64_t kMaxRetryAfterMs = 86'400'000;

// MarkUnreachable's payload (its type URL; the value is empty).
constexpr char kUnreachablePayload[] = "type.colod.dev/unreachable";
// MarkWorkerFault's.
constexpr char kWorkerFaultPayload[] = "type.colod.dev/worker-fault";
// MarkDrained's.
constexpr char kDrainedPayload[] = "type.colod.dev/drained";
// MarkPeerCaused's.
constexpr char kPeerCausedPayload[] = "type.colod.dev/peer-caused";

}  // namespace

std::string StatusMessageForTheWire(absl::string_view message) {
  // Printable ASCII travels as itself, every other byte as %XX.
  const auto cost = [](char c) { return c >= 0x20 && c <= 0x7E && c != '%' ? 1 : 3; };
  size_t encoded = 0;
  for (char c : message) encoded += cost(c);
  if (encoded <= kMaxEncodedStatusMessage) return std::string(message);
  const std::string valid = ValidUtf8(message);
  size_t keep = 0, used = 0;
  while (keep < valid.size() && used + cost(valid[keep]) <= kMaxEncodedStatusMessage - 3) used += cost(valid[keep++]);
  while (keep > 0 && (static_cast<unsigned char>(valid[keep]) & 0xC0) == 0x80) --keep;  // a character's start
  return valid.substr(0, keep) + "...";  // cut: `valid` costs more than the bound
}

// absl::StatusCode and grpc::StatusCode share the canonical numbering (0..16).
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), StatusMessageForTheWire(status.message()));
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

bool IsBusyRefusal(const grpc::Status& status, const grpc::ClientContext& ctx) {
  return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         (RetryAfter(ctx).has_value() || absl::StrContains(status.error_message(), "Threadpool Exhausted"));
}

absl::Status MarkUnreachable(absl::Status status) {
  if (status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kDeadlineExceeded) {
    status.SetPayload(kUnreachablePayload, absl::Cord());
  }
  return status;
}

bool IsUnreachable(const absl::Status& status) { return status.GetPayload(kUnreachablePayload).has_value(); }

absl::Status MarkWorkerFault(absl::Status status) {
  if (!status.ok()) status.SetPayload(kWorkerFaultPayload, absl::Cord());
  return status;
}

bool IsWorkerFault(const absl::Status& status) { return status.GetPayload(kWorkerFaultPayload).has_value(); }

absl::Status MarkDrained(absl::Status status) {
  if (!status.ok()) status.SetPayload(kDrainedPayload, absl::Cord());
  return status;
}

bool IsDrained(const absl::Status& status) { return status.GetPayload(kDrainedPayload).has_value(); }

absl::Status MarkPeerCaused(absl::Status status) {
  if (!status.ok()) status.SetPayload(kPeerCausedPayload, absl::Cord());
  return status;
}

bool IsPeerCaused(const absl::Status& status) { return status.GetPayload(kPeerCausedPayload).has_value(); }

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  if (status.ok()) return status;
  absl::Status out(status.code(), message);
  status.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

void MarkAnswered(grpc::ServerContext& ctx) { ctx.AddTrailingMetadata(kAnsweredMetadata, "1"); }

absl::Status MarkUnreachableUnlessAnswered(absl::Status status, const grpc::ClientContext& ctx) {
  if (ctx.GetServerTrailingMetadata().count(kAnsweredMetadata) > 0) return status;
  return MarkUnreachable(std::move(status));
}

}  // namespace colod
