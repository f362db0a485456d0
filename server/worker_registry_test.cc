#include "server/worker_registry.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/limits.h"
#include "common/text.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

v1::WorkerInfo Info(const std::string& address) {
  v1::WorkerInfo i;
  i.set_address(address);
  i.set_device_kind(v1::DEVICE_KIND_CPU);
  return i;
}

class WorkerRegistryTest : public ::testing::Test {
 protected:
  WorkerRegistryTest() : registry_(Opts(&clock_)) {}
  static WorkerRegistry::Options Opts(FakeClock* clock) {
    WorkerRegistry::Options o;
    o.heartbeat_interval = absl::Seconds(1);
    o.lease_duration = absl::Seconds(5);
    o.forget_after = absl::Seconds(60);
    o.clock = clock;
    return o;
  }
  FakeClock clock_;
  WorkerRegistry registry_;
};

TEST_F(WorkerRegistryTest, RegistersAndListsSortedWithLease) {
  auto a = registry_.Register(Info("10.0.0.2:7071"));
  auto b = registry_.Register(Info("10.0.0.1:7071"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->worker_id, b->worker_id);
  EXPECT_EQ(a->lease_duration, absl::Seconds(5));
  auto list = registry_.List(false);
  ASSERT_EQ(list.size(), 2u);
  EXPECT_LT(list[0].info().worker_id(), list[1].info().worker_id());
  EXPECT_EQ(list[0].info().address(), "10.0.0.2:7071");
  EXPECT_EQ(list[0].info().host(), "10.0.0.2");  // defaulted from the address
  EXPECT_EQ(list[0].state(), v1::WORKER_STATE_IDLE);
}

// A worker's key is kept by id and by address, never listed; a new
// registration at the address replaces it where it proves nothing else (the
// same key, a lost worker, an older worker with none) and where the daemon
// at the address proved it holds the new key, a forgotten worker takes it
// along; a key that could not travel as metadata, or too short to guess, is
// refused.
TEST_F(WorkerRegistryTest, KeysAreKeptByIdAndGoWithTheirWorker) {
  const std::string key(32, 'k'), other(32, 'o');
  auto a = registry_.Register(Info("10.0.0.1:7071"), v1::WorkerStatus(), key);
  auto b = registry_.Register(Info("10.0.0.2:7071"));  // an older worker: no key
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(registry_.KeyOf(a->worker_id), key);
  EXPECT_EQ(registry_.KeyToCall(a->worker_id), key);
  EXPECT_EQ(registry_.KeyOf(b->worker_id), "");
  EXPECT_EQ(registry_.KeyToCall(b->worker_id), "");  // an older worker: calls carry none
  EXPECT_EQ(registry_.KeyOf("worker-999999"), "");
  // A call meant for an unknown worker carries a key nobody holds, a new one
  // each time: whatever listens at its old address refuses it.
  const std::string nobodys = registry_.KeyToCall("worker-999999");
  EXPECT_TRUE(CheckWorkerKey(nobodys).ok()) << nobodys;
  EXPECT_NE(nobodys, registry_.KeyToCall("worker-999999"));
  for (const v1::Worker& w : registry_.List(true)) EXPECT_EQ(w.DebugString().find(key), std::string::npos);
  // Another key at the live worker's address is refused, saying when the
  // address frees (the workers' token alone takes no live worker's place),
  // and no key neither; the same key is the daemon again, under a new id.
  clock_.Advance(absl::Seconds(2));
  const absl::StatusOr<WorkerRegistry::Registration> taken =
      registry_.Register(Info("10.0.0.1:7071"), v1::WorkerStatus(), other);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists) << taken.status();
  EXPECT_NE(taken.status().message().find(a->worker_id + " is registered at 10.0.0.1:7071 with another key"),
            std::string::npos)
      << taken.status();
  EXPECT_NE(taken.status().message().find("lease runs another 3s"), std::string::npos) << taken.status();
  EXPECT_EQ(registry_.CheckAddress("10.0.0.1:7071", other).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry_.Register(Info("10.0.0.1:7071")).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry_.KeyOf(a->worker_id), key);
  EXPECT_TRUE(registry_.CheckAddress("10.0.0.1:7071", key).ok());
  auto same = registry_.Register(Info("10.0.0.1:7071"), v1::WorkerStatus(), key);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_NE(same->worker_id, a->worker_id);
  EXPECT_EQ(registry_.KeyOf(a->worker_id), "");
  EXPECT_EQ(registry_.List(true).size(), 2u);
  // An older worker (no key) proves nothing: a registration at its address
  // replaces it, keyed or not.
  const std::string third(32, 't');
  auto over_b = registry_.Register(Info("10.0.0.2:7071"), v1::WorkerStatus(), third);
  ASSERT_TRUE(over_b.ok()) << over_b.status();
  EXPECT_EQ(registry_.KeyToCall(over_b->worker_id), third);
  EXPECT_NE(registry_.KeyToCall(b->worker_id), "");  // replaced: a key no process holds
  EXPECT_EQ(over_b->replaced, b->worker_id);
  EXPECT_EQ(same->replaced, "");  // the same daemon again
  // A registration proven at its address (the daemon there answered a call
  // carrying its key) replaces a live worker there with another key at
  // once, saying which: a process holds one key, so that one is gone. A
  // proven registration has a key.
  const std::string fourth(32, 'f');
  auto proven =
      registry_.Register(Info("10.0.0.2:7071"), v1::WorkerStatus(), fourth, WorkerRegistry::AtAddress::kProven);
  ASSERT_TRUE(proven.ok()) << proven.status();
  EXPECT_EQ(proven->replaced, over_b->worker_id);
  EXPECT_EQ(registry_.KeyToCall(proven->worker_id), fourth);
  EXPECT_EQ(registry_.KeyOf(over_b->worker_id), "");
  EXPECT_NE(registry_.KeyToCall(over_b->worker_id), third);
  EXPECT_EQ(registry_.List(true).size(), 2u);
  EXPECT_EQ(registry_.Register(Info("10.0.0.4:7071"), v1::WorkerStatus(), "", WorkerRegistry::AtAddress::kProven)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Once the lease ends, a daemon restarted there takes the address with
  // its new key.
  clock_.Advance(absl::Seconds(6));
  EXPECT_TRUE(registry_.CheckAddress("10.0.0.1:7071", other).ok());
  auto again = registry_.Register(Info("10.0.0.1:7071"), v1::WorkerStatus(), other);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(registry_.KeyOf(same->worker_id), "");
  EXPECT_EQ(registry_.KeyOf(again->worker_id), other);
  EXPECT_EQ(registry_.KeyToCall(again->worker_id), other);
  // Lost, then forgotten: the key goes with it.
  clock_.Advance(absl::Seconds(6) + absl::Seconds(61));
  registry_.Sweep();
  clock_.Advance(absl::Seconds(1));
  registry_.Sweep();
  EXPECT_EQ(registry_.KeyOf(again->worker_id), "");
  EXPECT_NE(registry_.KeyToCall(again->worker_id), other);
  EXPECT_EQ(registry_.Register(Info("10.0.0.3:7071"), v1::WorkerStatus(), "short").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Register(Info("10.0.0.3:7071"), v1::WorkerStatus(), std::string(32, '\n')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Register(Info("10.0.0.3:7071"), v1::WorkerStatus(), std::string(257, 'k')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(WorkerRegistryTest, RejectsMalformedRegistrationsNamingTheField) {
  struct Case {
    v1::WorkerInfo info;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({Info(""), "worker.address"});
  cases.push_back({Info("host"), "worker.address"});
  cases.push_back({Info("host:0"), "worker.address"});
  cases.push_back({Info("host:70000"), "worker.address"});
  cases.push_back({Info("host:port"), "worker.address"});
  // Hosts that would dial elsewhere than they read, or spell one address
  // twice.
  for (const char* bad : {"h?:7070", "h#x:7070", "%31%30.0.0.5:7070", "u@h:7070", "a/b:7070", "[::1%25lo]:7070",
                          "[fe80::g]:7070", "h\x01:7070"}) {
    cases.push_back({Info(bad), "worker.address"});
  }
  v1::WorkerInfo odd_metrics = Info("h:1");
  odd_metrics.set_metrics_address("m?:9090");
  cases.push_back({odd_metrics, "worker.metrics_address"});
  v1::WorkerInfo with_id = Info("h:1");
  with_id.set_worker_id("mine");
  cases.push_back({with_id, "worker.worker_id"});
  v1::WorkerInfo neg = Info("h:1");
  neg.set_device_ordinal(-1);
  cases.push_back({neg, "worker.device_ordinal"});
  v1::WorkerInfo metrics = Info("h:1");
  metrics.set_metrics_address("h:");
  cases.push_back({metrics, "worker.metrics_address"});
  const std::string long_text(kMaxWorkerText + 1, 'x');
  v1::WorkerInfo long_host = Info("h:1");
  long_host.set_host(long_text);
  cases.push_back({long_host, "worker.host"});
  cases.push_back({Info(long_text + ":1"), "worker.address"});
  v1::WorkerInfo long_name = Info("h:1");
  long_name.set_device_name(long_text);
  cases.push_back({long_name, "worker.device_name"});
  v1::WorkerInfo long_version = Info("h:1");
  long_version.set_version(long_text);
  cases.push_back({long_version, "worker.version"});
  v1::WorkerInfo long_source = Info("h:1");
  long_source.mutable_peak()->set_source(long_text);
  cases.push_back({long_source, "worker.peak.source"});
  v1::WorkerInfo long_label = Info("h:1");
  (*long_label.mutable_labels())["zone"] = std::string(kMaxLabelValueBytes + 1, 'v');
  cases.push_back({long_label, "worker.labels"});
  v1::WorkerInfo empty_key = Info("h:1");
  (*empty_key.mutable_labels())[""] = "a";
  cases.push_back({empty_key, "worker.labels"});
  v1::WorkerInfo many_labels = Info("h:1");
  for (int i = 0; i <= kMaxLabels; ++i) (*many_labels.mutable_labels())["k" + std::to_string(i)] = "v";
  cases.push_back({many_labels, "worker.labels"});
  for (const Case& c : cases) {
    auto r = registry_.Register(c.info);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.info.ShortDebugString();
    EXPECT_NE(r.status().message().find(c.field), absl::string_view::npos) << r.status();
  }
  EXPECT_TRUE(registry_.List(true).empty());
  // At the bounds, accepted.
  v1::WorkerInfo full = Info("h:1");
  const std::string at_bound(kMaxWorkerText, 'y');
  full.set_host(at_bound);
  full.set_device_name(at_bound);
  for (int i = 0; i < kMaxLabels; ++i) {
    (*full.mutable_labels())[std::to_string(i) + std::string(kMaxLabelKeyBytes - 2, 'k')] =
        std::string(kMaxLabelValueBytes, 'v');
  }
  EXPECT_TRUE(registry_.Register(full).ok());
  for (const char* good : {"worker-0.colod.svc.cluster.local:7070", "my_host:7070", "192.168.1.20:7070",
                           "[2001:db8::7]:7070", "[::ffff:10.0.0.1]:7070"}) {
    EXPECT_TRUE(registry_.Register(Info(good)).ok()) << good;
  }
}

// A worker's status is bounded as it is kept, whatever it sends: three
// heartbeats with a 3 MiB last_error made ListWorkers too large for anyone.
TEST_F(WorkerRegistryTest, AHeartbeatsStatusIsBoundedAsItIsKept) {
  auto a = registry_.Register(Info("h:1"));
  ASSERT_TRUE(a.ok());
  v1::WorkerStatus status;
  status.set_state(v1::WORKER_STATE_BUSY);
  status.set_last_error(std::string(3 << 20, 'e'));
  status.set_job_id(std::string(100000, 'j'));
  for (int i = 0; i < 1000; ++i) {
    v1::CollectiveProgress* c = status.add_collectives();
    c->set_group(std::string(2000, 'g'));
    c->set_pending_op("all_reduce");
  }
  ASSERT_TRUE(registry_.Heartbeat(a->worker_id, status).ok());
  const std::vector<v1::Worker> listed = registry_.List(false);
  ASSERT_EQ(listed.size(), 1u);
  const v1::WorkerStatus& kept = listed[0].status();
  EXPECT_LE(kept.last_error().size(), kMaxReportedMessageBytes);
  EXPECT_EQ(kept.last_error().substr(0, 100), std::string(100, 'e'));
  EXPECT_LE(kept.job_id().size(), kMaxWorkerText);
  EXPECT_EQ(kept.collectives_size(), 64);
  EXPECT_LE(kept.collectives(0).group().size(), kMaxWorkerText);
  EXPECT_EQ(kept.collectives(0).pending_op(), "all_reduce");
  EXPECT_LT(listed[0].ByteSizeLong(), size_t{64} << 10);
}

TEST_F(WorkerRegistryTest, LeaseExpiryMarksLostAndForcesReRegistration) {
  auto a = registry_.Register(Info("h:1"));
  ASSERT_TRUE(a.ok());
  clock_.Advance(absl::Seconds(4));
  auto expiry = registry_.Heartbeat(a->worker_id, v1::WorkerStatus());
  ASSERT_TRUE(expiry.ok());
  EXPECT_EQ(*expiry, clock_.Now() + absl::Seconds(5));
  clock_.Advance(absl::Seconds(4));
  EXPECT_EQ(registry_.List(false).size(), 1u);  // renewed lease still valid
  clock_.Advance(absl::Seconds(2));             // 6s since the heartbeat
  EXPECT_EQ(registry_.Sweep(), std::vector<std::string>{a->worker_id});
  EXPECT_TRUE(registry_.List(false).empty());
  auto all = registry_.List(true);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(registry_.CountByState()["lost"], 1);
  auto late = registry_.Heartbeat(a->worker_id, v1::WorkerStatus());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_.List(true).empty());  // dropped: it must register again
}

// A worker that deregisters is LOST at once, with the reason it gave, and
// stays so (a later sweep does not change its reason); the lease-expired
// reason says how long the lease was. Unknown ids are NOT_FOUND.
TEST_F(WorkerRegistryTest, DeregisteredWorkersAreLostAtOnceWithTheirReason) {
  auto a = registry_.Register(Info("h:1"));
  auto b = registry_.Register(Info("h:2"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(registry_.Deregister(a->worker_id, "shutting down").ok());
  const std::vector<v1::Worker> live = registry_.List(false);
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].info().worker_id(), b->worker_id);
  EXPECT_EQ(registry_.LostReason(a->worker_id), "left: shutting down");
  // A clean stop is counted apart: ColodWorkerLost pages for lost workers only.
  EXPECT_EQ(registry_.CountByState(), (std::map<std::string, int>{{"idle", 1}, {"busy", 0}, {"lost", 0}, {"left", 1}}));
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(registry_.Sweep(), std::vector<std::string>{b->worker_id});  // a was already lost
  EXPECT_EQ(registry_.CountByState(), (std::map<std::string, int>{{"idle", 0}, {"busy", 0}, {"lost", 1}, {"left", 1}}));
  EXPECT_EQ(registry_.LostReason(a->worker_id), "left: shutting down");
  EXPECT_EQ(registry_.LostReason(b->worker_id), "no heartbeat within 5s");
  for (const v1::Worker& w : registry_.List(true)) {
    EXPECT_EQ(w.lost_reason(), registry_.LostReason(w.info().worker_id()));
  }
  EXPECT_EQ(registry_.Deregister("worker-999", "").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_.LostReason("worker-999"), "no longer registered");
  EXPECT_EQ(registry_.Heartbeat(a->worker_id, v1::WorkerStatus()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(WorkerRegistryTest, LostWorkersAreForgottenEventually) {
  ASSERT_TRUE(registry_.Register(Info("h:1")).ok());
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(registry_.List(true).size(), 1u);
  clock_.Advance(absl::Seconds(60));
  EXPECT_TRUE(registry_.List(true).empty());
}

TEST_F(WorkerRegistryTest, UnknownHeartbeatIsNotFound) {
  EXPECT_EQ(registry_.Heartbeat("worker-999", v1::WorkerStatus()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(WorkerRegistryTest, ReRegistrationFromTheSameAddressReplacesTheOldEntry) {
  auto a = registry_.Register(Info("h:1"));
  auto b = registry_.Register(Info("h:1"));
  ASSERT_TRUE(a.ok() && b.ok());
  auto list = registry_.List(true);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].info().worker_id(), b->worker_id);
  EXPECT_EQ(registry_.Heartbeat(a->worker_id, v1::WorkerStatus()).status().code(),
            absl::StatusCode::kNotFound);
}

// The registry holds max_workers at most: past it, a registration forgets
// the worker lost longest, and is RESOURCE_EXHAUSTED where every worker is
// live; a worker registering again under its own address always may.
TEST_F(WorkerRegistryTest, WorkersAreBoundedAndTheLongestLostMakesRoom) {
  WorkerRegistry::Options o = Opts(&clock_);
  o.max_workers = 3;
  WorkerRegistry r(o);
  auto a = r.Register(Info("h:1"));
  clock_.Advance(absl::Seconds(1));
  auto b = r.Register(Info("h:2"));
  auto c = r.Register(Info("h:3"));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const auto full = r.Register(Info("h:4"));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_NE(full.status().message().find("--max-workers (3)"), std::string::npos) << full.status();
  EXPECT_TRUE(r.Register(Info("h:3")).ok());  // itself again: replaced, not one more
  ASSERT_EQ(r.List(true).size(), 3u);
  // a and b are lost (a longer ago), the new h:3 is not: h:4 takes a's room.
  clock_.Advance(absl::Seconds(5));
  ASSERT_TRUE(r.Heartbeat(r.List(false).back().info().worker_id(), v1::WorkerStatus()).ok());
  clock_.Advance(absl::Seconds(1));
  r.Sweep();
  ASSERT_EQ(r.CountByState()["lost"], 2);
  ASSERT_TRUE(r.Register(Info("h:4")).ok());
  std::vector<std::string> addresses;
  for (const v1::Worker& w : r.List(true)) addresses.push_back(w.info().address());
  EXPECT_EQ(addresses, (std::vector<std::string>{"h:2", "h:3", "h:4"}));
  ASSERT_TRUE(r.Register(Info("h:5")).ok());  // b's room
  EXPECT_EQ(r.Register(Info("h:6")).status().code(), absl::StatusCode::kResourceExhausted);
}

// Pages follow List's order from after the given id, skip lost workers
// unless asked, end at the count or once past the bytes, and say whether
// more follow.
TEST_F(WorkerRegistryTest, PagesFollowListsOrderAndEndAtTheCountOrTheBytes) {
  for (int i = 1; i <= 5; ++i) ASSERT_TRUE(registry_.Register(Info(absl::StrCat("h:", i))).ok());
  const std::vector<v1::Worker> all = registry_.List(true);
  ASSERT_TRUE(registry_.Deregister(all[1].info().worker_id(), "gone").ok());
  auto ids = [](const WorkerRegistry::Page& p) {
    std::vector<std::string> out;
    for (const v1::Worker& w : p.workers) out.push_back(w.info().worker_id());
    return out;
  };
  WorkerRegistry::Page p = registry_.ListPage(false, "", 2, size_t{1} << 20);
  EXPECT_EQ(ids(p), (std::vector<std::string>{all[0].info().worker_id(), all[2].info().worker_id()}));
  EXPECT_TRUE(p.more);
  p = registry_.ListPage(false, all[2].info().worker_id(), 2, size_t{1} << 20);
  EXPECT_EQ(ids(p), (std::vector<std::string>{all[3].info().worker_id(), all[4].info().worker_id()}));
  EXPECT_FALSE(p.more);
  p = registry_.ListPage(true, all[0].info().worker_id(), 1000, 1);  // one a page: the first passes the bytes
  EXPECT_EQ(ids(p), std::vector<std::string>{all[1].info().worker_id()});
  EXPECT_TRUE(p.more);
  p = registry_.ListPage(true, all[4].info().worker_id(), 1000, 1);
  EXPECT_TRUE(p.workers.empty());
  EXPECT_FALSE(p.more);
}

TEST_F(WorkerRegistryTest, HeartbeatStatusIsReported) {
  auto a = registry_.Register(Info("h:1"));
  ASSERT_TRUE(a.ok());
  v1::WorkerStatus busy;
  busy.set_state(v1::WORKER_STATE_BUSY);
  busy.set_job_id("job-000001");
  ASSERT_TRUE(registry_.Heartbeat(a->worker_id, busy).ok());
  auto list = registry_.List(false);
  EXPECT_EQ(list[0].state(), v1::WORKER_STATE_BUSY);
  EXPECT_EQ(list[0].status().job_id(), "job-000001");
  EXPECT_EQ(registry_.CountByState()["busy"], 1);
  // A worker that registers again while a rank of the old coordinator's
  // still runs is BUSY from its registration on, not from its next heartbeat.
  auto again = registry_.Register(Info("h:2"), busy);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(registry_.CountByState()["busy"], 2);
  auto fresh = registry_.Register(Info("h:3"));
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(registry_.CountByState()["idle"], 1);
}

}  // namespace
}  // namespace colod
