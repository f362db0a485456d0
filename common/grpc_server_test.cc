#include "common/grpc_server.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

// gRPC would share a port between two servers (SO_REUSEPORT) and split
// the connections between them: a second daemon on a taken --listen must
// fail to start instead.
TEST(GrpcServer, APortInUseIsRefusedNotShared) {
  auto first = StartGrpcServer("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = StartGrpcServer(first->address, {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << first->address;
  EXPECT_NE(second.status().message().find("cannot listen on " + first->address), std::string::npos)
      << second.status();
  StopGrpcServer(*first->server, absl::Seconds(1));
  first->server.reset();
  // Free again once the first has stopped.
  auto third = StartGrpcServer(first->address, {});
  ASSERT_TRUE(third.ok()) << third.status();
  StopGrpcServer(*third->server, absl::Seconds(1));
}

}  // namespace
}  // namespace colod
