#include "server/stub_cache.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "colod/v1/worker.grpc.pb.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// Answers GetStatus with its worker id.
class StatusWorker final : public v1::WorkerService::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*, v1::GetStatusResponse* resp) override {
    resp->mutable_info()->set_worker_id("w");
    return grpc::Status::OK;
  }
};

// A server of `worker` on `address` ("127.0.0.1:0": a free port), and the
// port it took.
std::unique_ptr<grpc::Server> Serve(StatusWorker& worker, const std::string& address, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  b.RegisterService(&worker);
  return b.BuildAndStart();
}

// A coordinator that outlives its workers' addresses (pods restarted with new
// ones) keeps a channel only for those asked for in the last `idle`; a stub
// still held by a caller goes on working after the cache dropped it.
TEST(StubCache, DropsTheStubsOfAddressesNotAskedForDuringIdle) {
  StatusWorker worker;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(worker, "127.0.0.1:0", &port);
  ASSERT_NE(server, nullptr);
  const std::string live = absl::StrCat("127.0.0.1:", port);

  FakeClock clock;
  StubCache<v1::WorkerService> cache(nullptr, absl::Minutes(10), &clock);
  const std::shared_ptr<v1::WorkerService::Stub> a = cache.Get(live);
  EXPECT_EQ(cache.Get(live), a) << "one stub per address";
  cache.Get("127.0.0.1:2");
  EXPECT_EQ(cache.size(), 2u);
  clock.Advance(absl::Minutes(6));
  cache.Get("127.0.0.1:2");  // keeps :2 in use
  EXPECT_EQ(cache.size(), 2u) << "nothing is idle for 10 minutes yet";
  clock.Advance(absl::Minutes(6));
  cache.Get("127.0.0.1:3");
  EXPECT_EQ(cache.size(), 2u) << "the live address was not asked for in 12 minutes; :2 was 6 minutes ago";
  EXPECT_NE(cache.Get(live), a) << "a dropped address gets a new channel";

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::GetStatusResponse resp;
  const grpc::Status s = a->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.info().worker_id(), "w");

  clock.Advance(absl::Hours(1));
  cache.Get("127.0.0.1:4");
  EXPECT_EQ(cache.size(), 1u);
  server->Shutdown();
}

// A daemon restarted on its port: the old channel, refused while it was
// down, backs off before it connects again and fails calls at once
// meanwhile; a forgotten address gets a new channel, which reaches the new
// daemon on the first call.
TEST(StubCache, AForgottenAddressReachesADaemonRestartedThereAtOnce) {
  StatusWorker worker;
  int port = 0;
  std::unique_ptr<grpc::Server> server = Serve(worker, "127.0.0.1:0", &port);
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  StubCache<v1::WorkerService> cache(nullptr);
  // A call that fails fast (no wait for ready), as the scheduler's are.
  const auto status = [&](const std::shared_ptr<v1::WorkerService::Stub>& stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetStatusResponse resp;
    return stub->GetStatus(&ctx, v1::GetStatusRequest(), &resp);
  };
  const std::shared_ptr<v1::WorkerService::Stub> old = cache.Get(address);
  ASSERT_TRUE(status(old).ok());
  server->Shutdown();
  server.reset();
  EXPECT_EQ(status(old).error_code(), grpc::StatusCode::UNAVAILABLE);  // refused: the channel backs off

  int same = 0;
  server = Serve(worker, address, &same);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(same, port);
  cache.Forget(address);
  cache.Forget("127.0.0.1:9");  // never asked for: nothing to drop
  const std::shared_ptr<v1::WorkerService::Stub> fresh = cache.Get(address);
  EXPECT_NE(fresh, old);
  const grpc::Status reached = status(fresh);
  EXPECT_TRUE(reached.ok()) << reached.error_message();
  EXPECT_EQ(cache.size(), 1u);
  server->Shutdown();
}

}  // namespace
}  // namespace colod
