#include "common/net.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(ParseHostPort, AcceptsNamesV4AndBracketedV6) {
  auto a = ParseHostPort("localhost:50051", "x", false);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "localhost");
  EXPECT_EQ(a->port, 50051);
  auto b = ParseHostPort("127.0.0.1:0", "x", true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->port, 0);
  auto c = ParseHostPort("[::1]:65535", "x", false);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(c->ToString(), "[::1]:65535");
}

TEST(ParseHostPort, RejectsMalformedWithTheFieldName) {
  for (const char* bad : {"", "localhost", ":80", "host:", "host:http", "host:65536", "host:-1",
                          "::1:80", "[::1]80", "ho st:1", "host:0000080"}) {
    auto r = ParseHostPort(bad, "worker.address", false);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("worker.address"), absl::string_view::npos) << bad;
  }
  EXPECT_FALSE(ParseHostPort("host:0", "x", /*allow_zero_port=*/false).ok());
  EXPECT_TRUE(ParseHostPort("host:0", "x", /*allow_zero_port=*/true).ok());
}

}  // namespace
}  // namespace colod
