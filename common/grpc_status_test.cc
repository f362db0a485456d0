#include "common/grpc_status.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(GrpcStatus, RoundTripsEveryCanonicalCode) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status s(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    absl::Status back = FromGrpcStatus(g);
    EXPECT_EQ(back.code(), s.code());
    EXPECT_EQ(back.message(), s.message());
  }
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("job-1")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("job-1")).error_message(), "job-1");
}

TEST(GrpcStatus, AMessageIsCutToWhatTheTrailersCarry) {
  const std::string fits(kMaxEncodedStatusMessage, 'a');
  EXPECT_EQ(StatusMessageForTheWire(fits), fits);
  const std::string longer = fits + "b";
  const std::string cut = StatusMessageForTheWire(longer);
  EXPECT_EQ(cut.size(), kMaxEncodedStatusMessage);
  EXPECT_EQ(cut.substr(cut.size() - 3), "...");
  // Bytes past printable ASCII take three each on the wire (%XX): a third
  // of them fit, whole characters only, and what is not UTF-8 is replaced.
  const auto encoded = [](const std::string& m) {
    size_t n = 0;
    for (char c : m) n += c >= 0x20 && c <= 0x7E && c != '%' ? 1 : 3;
    return n;
  };
  std::string accents;
  for (int i = 0; i < 2000; ++i) accents += "\xC3\xA9";  // 4000 bytes, 12000 encoded
  const std::string e = StatusMessageForTheWire(accents + "\xFF");
  EXPECT_LE(encoded(e), kMaxEncodedStatusMessage);
  EXPECT_GT(encoded(e), kMaxEncodedStatusMessage - 9);
  EXPECT_EQ(e.substr(e.size() - 3), "...");
  EXPECT_EQ(e.substr(0, e.size() - 3), accents.substr(0, e.size() - 3));
  EXPECT_EQ((e.size() - 3) % 2, 0u);  // not inside a character
  // Just past the bound by a character at the end: cut, within the bound.
  const std::string edge = std::string(kMaxEncodedStatusMessage - 3, 'a') + "\xC3\xA9";
  EXPECT_EQ(encoded(edge), kMaxEncodedStatusMessage + 3);
  EXPECT_LE(encoded(StatusMessageForTheWire(edge)), kMaxEncodedStatusMessage);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError(longer)).error_message(), cut);
}

TEST(GrpcStatus, UnreachableIsMarkedOnlyForUnavailableAndDeadlineExceeded) {
  const absl::Status down = MarkUnreachable(absl::UnavailableError("connection refused"));
  EXPECT_TRUE(IsUnreachable(down));
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(down.message(), "connection refused");
  EXPECT_TRUE(IsUnreachable(MarkUnreachable(absl::DeadlineExceededError("no answer"))));
  // The coordinator's own answers stay what they are.
  for (const absl::Status& answer : {absl::NotFoundError("job-000001"), absl::InvalidArgumentError("spec"),
                                     absl::ResourceExhaustedError("quota"), absl::OkStatus()}) {
    const absl::Status marked = MarkUnreachable(answer);
    EXPECT_FALSE(IsUnreachable(marked)) << answer;
    EXPECT_EQ(marked, answer);
  }
  // Not marked unless said: the code alone does not make it.
  EXPECT_FALSE(IsUnreachable(absl::UnavailableError("a job's own failure")));
  // Kept when the status is passed on (copied, returned).
  const absl::Status copy = down;
  EXPECT_TRUE(IsUnreachable(copy));
}

TEST(GrpcStatus, AWorkersFaultIsMarkedOnAnErrorAndKeptWithIt) {
  const absl::Status full = MarkWorkerFault(absl::ResourceExhaustedError("No space left on device"));
  EXPECT_TRUE(IsWorkerFault(full));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "No space left on device");
  const absl::Status copy = full;
  EXPECT_TRUE(IsWorkerFault(copy));
  EXPECT_FALSE(IsWorkerFault(absl::ResourceExhaustedError("No space left on device")));
  EXPECT_FALSE(IsUnreachable(full));
  EXPECT_FALSE(IsWorkerFault(MarkUnreachable(absl::UnavailableError("down"))));
  // OK carries no payload.
  EXPECT_TRUE(MarkWorkerFault(absl::OkStatus()).ok());
  EXPECT_FALSE(IsWorkerFault(MarkWorkerFault(absl::OkStatus())));
}

TEST(GrpcStatus, ADrainIsMarkedOnAnErrorAndKeptWithIt) {
  const absl::Status drained = MarkDrained(absl::AbortedError("stopped after step 5"));
  EXPECT_TRUE(IsDrained(drained));
  EXPECT_EQ(drained.code(), absl::StatusCode::kAborted);
  const absl::Status copy = drained;
  EXPECT_TRUE(IsDrained(copy));
  EXPECT_FALSE(IsWorkerFault(drained));
  EXPECT_FALSE(IsDrained(MarkWorkerFault(absl::AbortedError("stopped after step 5"))));
  EXPECT_FALSE(IsDrained(absl::AbortedError("stopped after step 5")));
  EXPECT_FALSE(IsDrained(MarkDrained(absl::OkStatus())));
}

TEST(GrpcStatus, APeerCausedFailureIsMarkedOnAnErrorAndKeptWithIt) {
  const absl::Status caused = MarkPeerCaused(absl::AbortedError("rank 1 could not write its part"));
  EXPECT_TRUE(IsPeerCaused(caused));
  EXPECT_EQ(caused.code(), absl::StatusCode::kAborted);
  const absl::Status copy = caused;
  EXPECT_TRUE(IsPeerCaused(copy));
  EXPECT_FALSE(IsDrained(caused));
  EXPECT_FALSE(IsWorkerFault(caused));
  EXPECT_FALSE(IsPeerCaused(MarkDrained(absl::AbortedError("stopped"))));
  EXPECT_FALSE(IsPeerCaused(absl::AbortedError("stopped")));
  EXPECT_FALSE(IsPeerCaused(MarkPeerCaused(absl::OkStatus())));
}

TEST(GrpcStatus, WithMessageWordsAnErrorAgainKeepingItsCodeAndMarks) {
  const absl::Status worded =
      WithMessage(MarkPeerCaused(MarkWorkerFault(MarkDrained(absl::AbortedError("stopped")))), "stage 1: stopped");
  EXPECT_EQ(worded.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(worded.message(), "stage 1: stopped");
  EXPECT_TRUE(IsDrained(worded));
  EXPECT_TRUE(IsWorkerFault(worded));
  EXPECT_TRUE(IsPeerCaused(worded));
  const absl::Status plain = WithMessage(absl::NotFoundError("no such file"), "no model.safetensors");
  EXPECT_EQ(plain.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plain.message(), "no model.safetensors");
  EXPECT_FALSE(IsDrained(plain));
  EXPECT_FALSE(IsWorkerFault(plain));
  EXPECT_FALSE(IsPeerCaused(plain));
  EXPECT_TRUE(WithMessage(absl::OkStatus(), "a message").ok());  // an OK status has none
}

}  // namespace
}  // namespace colod
