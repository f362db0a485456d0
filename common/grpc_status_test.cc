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

}  // namespace
}  // namespace colod
