#include "server/stub_cache.h"

#include "colod/v1/worker.grpc.pb.h"
#include "common/clock.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// A coordinator that outlives its workers' addresses (pods restarted with new
// ones) keeps a channel only for those asked for in the last `idle`; a stub
// still held by a call in flight stays usable after it is dropped.
TEST(StubCache, DropsTheStubsOfAddressesNotAskedForDuringIdle) {
  FakeClock clock;
  StubCache<v1::WorkerService> cache(nullptr, absl::Minutes(10), &clock);
  const std::shared_ptr<v1::WorkerService::Stub> a = cache.Get("127.0.0.1:1");
  EXPECT_EQ(cache.Get("127.0.0.1:1"), a) << "one stub per address";
  cache.Get("127.0.0.1:2");
  EXPECT_EQ(cache.size(), 2u);
  clock.Advance(absl::Minutes(6));
  cache.Get("127.0.0.1:2");  // keeps :2 in use
  EXPECT_EQ(cache.size(), 2u) << "nothing is idle for 10 minutes yet";
  clock.Advance(absl::Minutes(6));
  cache.Get("127.0.0.1:3");
  EXPECT_EQ(cache.size(), 2u) << ":1 was not asked for in 12 minutes; :2 was 6 minutes ago";
  const std::shared_ptr<v1::WorkerService::Stub> again = cache.Get("127.0.0.1:1");
  EXPECT_NE(again, a) << "a dropped address gets a new channel";
  EXPECT_NE(a->async(), nullptr) << "the caller's stub stays alive";
  clock.Advance(absl::Hours(1));
  cache.Get("127.0.0.1:4");
  EXPECT_EQ(cache.size(), 1u);
}

}  // namespace
}  // namespace colod
