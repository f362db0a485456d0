// One contract, three Stores: in-memory, file and the coordinator's KV over
// gRPC. Ranks are threads.
#include "worker/comm/store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rendezvous_store.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "tests/testing/temp_dir.h"
#include "worker/comm/coordinator_store.h"

namespace colod {
namespace {

// Makes stores that all see the same keys (one per rank).
class StoreFactory {
 public:
  virtual ~StoreFactory() = default;
  virtual std::unique_ptr<Store> Make() = 0;
};

class InMemoryFactory : public StoreFactory {
 public:
  std::unique_ptr<Store> Make() override { return std::make_unique<InMemoryStore>(shared_, "job-1/gen-1"); }

 private:
  std::shared_ptr<RendezvousStore> shared_ = std::make_shared<RendezvousStore>();
};

class FileFactory : public StoreFactory {
 public:
  FileFactory() {
    static int n = 0;
    dir_ = testing::TempPath("filestore" + std::to_string(n++));
  }
  std::unique_ptr<Store> Make() override { return *FileStore::Open(dir_); }

 private:
  std::string dir_;
};

class CoordinatorFactory : public StoreFactory {
 public:
  CoordinatorFactory() {
    static int n = 0;
    Coordinator::Options o;
    o.data_dir = testing::TempPath("coord" + std::to_string(n++));
    o.store_any_scope = true;  // the store's contract alone: no job is placed, its scope is the test's
    coordinator_ = *Coordinator::Start(o);
  }
  std::unique_ptr<Store> Make() override {
    std::shared_ptr<v1::CoordinatorService::StubInterface> stub = v1::CoordinatorService::NewStub(
        grpc::CreateChannel(coordinator_->address(), grpc::InsecureChannelCredentials()));
    return std::make_unique<CoordinatorStore>(stub, "job-1/gen-1");
  }

 private:
  std::unique_ptr<Coordinator> coordinator_;
};

template <typename F>
class StoreContract : public ::testing::Test {
 protected:
  F factory_;
};

using Factories = ::testing::Types<InMemoryFactory, FileFactory, CoordinatorFactory>;
TYPED_TEST_SUITE(StoreContract, Factories);

TYPED_TEST(StoreContract, SetGetOverwriteAndBinaryValues) {
  auto store = this->factory_.Make();
  const std::string id("\x00nccl\xff\x01", 7);
  ASSERT_TRUE(store->Set("nccl/unique_id", id).ok());
  EXPECT_EQ(*store->Get("nccl/unique_id"), id);
  ASSERT_TRUE(store->Set("nccl/unique_id", "second").ok());
  EXPECT_EQ(*store->Get("nccl/unique_id"), "second");
  EXPECT_EQ(store->Get("absent").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  // Another handle (another rank) sees the same keys.
  EXPECT_EQ(*this->factory_.Make()->Get("nccl/unique_id"), "second");
}

TYPED_TEST(StoreContract, RanksExchangeAddressesThroughWait) {
  constexpr int kRanks = 4;
  std::vector<std::vector<std::string>> seen(kRanks);
  std::vector<absl::Status> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto store = this->factory_.Make();
      absl::SleepFor(absl::Milliseconds(10 * (kRanks - r)));  // arrive out of order
      errors[r] = store->Set("addr/" + std::to_string(r), "127.0.0." + std::to_string(r + 1));
      std::vector<std::string> keys;
      for (int i = 0; i < kRanks; ++i) keys.push_back("addr/" + std::to_string(i));
      auto values = store->Wait(keys, absl::Seconds(20));
      if (!values.ok()) {
        errors[r] = values.status();
        return;
      }
      seen[r] = *values;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(errors[r].ok()) << errors[r];
    EXPECT_EQ(seen[r], (std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"}));
  }
}

TYPED_TEST(StoreContract, AMissingRankIsDeadlineExceededWithinTheTimeout) {
  auto store = this->factory_.Make();
  ASSERT_TRUE(store->Set("addr/0", "x").ok());
  const absl::Duration timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto r = store->Wait({"addr/0", "addr/1"}, timeout);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("addr/1"), absl::string_view::npos) << r.status();
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + absl::Seconds(1));
}

// A rank aborted in its rendezvous (its worker shuts down, a peer failed)
// does not wait out the coordinator's answer: the abort cancels the wait in
// flight, and a call after it fails at once, both with the abort's reason.
TEST(CoordinatorStore, AnAbortEndsAWaitInFlightAtOnce) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord_abort");
  o.store_any_scope = true;
  auto coordinator = Coordinator::Start(o);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  std::shared_ptr<v1::CoordinatorService::StubInterface> stub = v1::CoordinatorService::NewStub(
      grpc::CreateChannel((*coordinator)->address(), grpc::InsecureChannelCredentials()));
  auto abort = std::make_shared<AbortSignal>();
  CoordinatorStore store(stub, "job-1/gen-1", absl::Seconds(10), {}, "", abort);
  ASSERT_TRUE(store.Set("k", "v").ok());  // calls work until the abort
  absl::StatusOr<std::vector<std::string>> waited;
  absl::Time ended;
  std::thread waiter([&] {
    waited = store.Wait({"never"}, absl::Seconds(60));
    ended = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time fired = absl::Now();
  abort->Abort(absl::AbortedError("rank 1 failed: connection closed"));
  waiter.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kAborted) << waited.status();
  EXPECT_NE(waited.status().message().find("rank 1 failed"), std::string::npos) << waited.status();
  EXPECT_LT(ended - fired, absl::Seconds(5));
  const absl::Time before = absl::Now();
  EXPECT_EQ(store.Get("k").status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store.Wait({"k"}, absl::Seconds(60)).status().code(), absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - before, absl::Seconds(5));
  // Another store of the scope without that signal still reads it.
  CoordinatorStore other(stub, "job-1/gen-1");
  auto got = other.Get("k");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
}

// A free loopback port, as bound and let go now.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A coordinator not reachable for a moment (restarting, a network blip)
// does not fail the rank's rendezvous: the call waits for it within its
// deadline. Before, the first refused connection failed the call, and with
// it the job's generation.
TEST(CoordinatorStore, ACoordinatorThatComesBackWithinTheDeadlineIsWaitedFor) {
  const std::string address = absl::StrCat("127.0.0.1:", FreePort());
  std::shared_ptr<v1::CoordinatorService::StubInterface> stub =
      v1::CoordinatorService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  CoordinatorStore store(stub, "job-1/gen-1", absl::Seconds(30));
  absl::Status set;
  std::thread rank([&] { set = store.Set("k", "v"); });
  absl::SleepFor(absl::Seconds(1));
  Coordinator::Options o;
  o.listen = address;
  o.data_dir = testing::TempPath("coord_late");
  o.store_any_scope = true;
  auto coordinator = Coordinator::Start(o);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  rank.join();
  EXPECT_TRUE(set.ok()) << set;
  auto got = store.Get("k");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
}

// A store full for now (other jobs' keys, freed as their generations end)
// is asked again within the deadline: one job's rendezvous cannot fail
// another's for good. Past the deadline the call fails UNAVAILABLE, which
// restarts the job.
TEST(CoordinatorStore, AFullStoreIsAskedAgainUntilThereIsRoom) {
  Coordinator::Options o;
  o.data_dir = testing::TempPath("coord_full");
  o.store_any_scope = true;
  o.store_quota_bytes = 100000;
  auto coordinator = Coordinator::Start(o);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  std::shared_ptr<v1::CoordinatorService::StubInterface> stub = v1::CoordinatorService::NewStub(
      grpc::CreateChannel((*coordinator)->address(), grpc::InsecureChannelCredentials()));
  CoordinatorStore other_job(stub, "job-2/gen-1", absl::Seconds(30));
  ASSERT_TRUE(other_job.Set("big", std::string(80000, 'x')).ok());
  CoordinatorStore quick(stub, "job-1/gen-1", absl::Milliseconds(500));
  const absl::Status full = quick.Set("k", std::string(50000, 'y'));
  EXPECT_EQ(full.code(), absl::StatusCode::kUnavailable) << full;
  EXPECT_TRUE(absl::StrContains(full.message(), "--store-quota")) << full;
  CoordinatorStore store(stub, "job-1/gen-1", absl::Seconds(30));
  absl::Status set;
  std::thread rank([&] { set = store.Set("k", std::string(50000, 'y')); });
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE(other_job.Set("big", "small now").ok());  // room again
  rank.join();
  EXPECT_TRUE(set.ok()) << set;
}

// Keys as long as a store takes (Gloo's name a group's ranks: 30 ranks'
// pass 115 bytes, whose hex and a temporary's suffix would pass NAME_MAX)
// are set, read and waited for, each its own.
TEST(FileStore, KeysAsLongAsAStoreTakesAreTheirOwn) {
  auto store = FileStore::Open(testing::TempPath("filestore-long"));
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string a(RendezvousStore::kMaxKeyBytes, 'a');
  std::string b = a;
  b.back() = 'b';
  const std::string mid(120, '/');
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{{a, "A"}, {b, "B"}, {mid, "M"}}) {
    ASSERT_TRUE((*store)->Set(key, value).ok()) << key.size();
  }
  EXPECT_EQ(*(*store)->Get(a), "A");
  EXPECT_EQ(*(*store)->Get(b), "B");
  EXPECT_EQ(*(*store)->Get(mid), "M");
  auto waited = (*store)->Wait({a, b}, absl::Seconds(5));
  EXPECT_TRUE(waited.ok()) << waited.status();
}

TEST(FileStore, RefusesAnUncreatableDirectory) {
  EXPECT_EQ(FileStore::Open("/proc/colod-cannot-create").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A key whose file is there but cannot be read (here a directory in its
// place; EIO, ESTALE on a shared file system) is an error at once, saying
// so, not a key that never came after the whole timeout.
TEST(FileStore, AKeyThatCannotBeReadIsAnErrorAtOnceNotAMissingKey) {
  const std::string dir = testing::TempPath("filestore-unreadable");
  auto store = FileStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("addr/0", "x").ok());
  std::string path;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) path = entry.path().string();
  }
  ASSERT_FALSE(path.empty());
  std::filesystem::remove(path);
  std::filesystem::create_directory(path);
  const absl::Time start = absl::Now();
  auto r = (*store)->Wait({"addr/0"}, absl::Seconds(20));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("file store: "), absl::string_view::npos) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace colod
