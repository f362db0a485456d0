#include "common/rendezvous_store.h"

#include <atomic>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(RendezvousStore, SetGetAndScopes) {
  RendezvousStore s;
  ASSERT_TRUE(s.Set("job-1/gen-1", "addr/0", "10.0.0.1:1234").ok());
  EXPECT_EQ(*s.Get("job-1/gen-1", "addr/0"), "10.0.0.1:1234");
  EXPECT_EQ(s.Get("job-1/gen-2", "addr/0").status().code(), absl::StatusCode::kNotFound);
  s.DeleteScope("job-1/gen-1");
  EXPECT_EQ(s.Get("job-1/gen-1", "addr/0").status().code(), absl::StatusCode::kCancelled);  // ended
  EXPECT_EQ(s.Set("", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Set("s", "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Set("s", "k", std::string(RendezvousStore::kMaxValueBytes + 1, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RendezvousStore, WaitReturnsOnceAnotherThreadSetsEveryKey) {
  RendezvousStore s;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(s.Set("sc", "b", "2").ok());
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(s.Set("sc", "a", "1").ok());
  });
  auto values = s.Wait("sc", {"a", "b"}, absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{"1", "2"}));
}

// Keys set in any order, one at a time, while the wait looks up only the
// first still missing: every value arrives, in the order asked for.
TEST(RendezvousStore, AWaitForManyKeysSetInAnyOrderGetsThemAll) {
  RendezvousStore s;
  std::vector<std::string> keys;
  for (int i = 0; i < 2000; ++i) keys.push_back(absl::StrCat("k", i));
  std::thread setter([&] {
    for (int i = 1999; i >= 0; i -= 2) ASSERT_TRUE(s.Set("sc", keys[i], absl::StrCat("v", i)).ok());
    for (int i = 0; i < 2000; i += 2) ASSERT_TRUE(s.Set("sc", keys[i], absl::StrCat("v", i)).ok());
  });
  auto values = s.Wait("sc", keys, absl::Seconds(60));
  setter.join();
  ASSERT_TRUE(values.ok()) << values.status();
  ASSERT_EQ(values->size(), 2000u);
  for (int i = 0; i < 2000; ++i) EXPECT_EQ((*values)[i], absl::StrCat("v", i));
}

// A caller that goes away (its gRPC call cancelled) gives its thread and
// its waiter slot back within a slice, not at its timeout (up to 30 min).
TEST(RendezvousStore, ACallerThatWentAwayStopsWaiting) {
  RendezvousStore s;
  std::atomic<bool> gone{false};
  const auto is_gone = [&] { return gone.load(); };
  std::thread stop([&] {
    absl::SleepFor(absl::Milliseconds(100));
    gone = true;
  });
  const absl::Time start = absl::Now();
  auto waited = s.Wait("sc", {"never"}, absl::Minutes(30), is_gone);
  const absl::Status barrier = s.Barrier("sc", "b", 0, 2, absl::Minutes(30), is_gone);
  stop.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kCancelled) << waited.status();
  EXPECT_NE(waited.status().message().find("its caller went away"), absl::string_view::npos) << waited.status();
  EXPECT_EQ(barrier.code(), absl::StatusCode::kCancelled) << barrier;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(s.waiters(), 0);
  // A caller still there waits on, and gets what it waited for.
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(450));
    ASSERT_TRUE(s.Set("sc", "late", "1").ok());
  });
  auto late = s.Wait("sc", {"late"}, absl::Seconds(30), [] { return false; });
  setter.join();
  EXPECT_TRUE(late.ok()) << late.status();
}

TEST(RendezvousStore, WaitTimesOutNamingTheMissingKeys) {
  RendezvousStore s;
  ASSERT_TRUE(s.Set("sc", "a", "1").ok());
  auto r = s.Wait("sc", {"a", "nccl_id", "addr/3"}, absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("nccl_id, addr/3"), absl::string_view::npos) << r.status();
  EXPECT_EQ(s.Wait("sc", {}, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Wait("sc", {"a"}, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RendezvousStore, BarrierReleasesAllRanksTogether) {
  RendezvousStore s;
  constexpr int kWorld = 4;
  std::vector<absl::Status> results(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] { results[r] = s.Barrier("sc", "init", r, kWorld, absl::Seconds(10)); });
  }
  for (auto& t : ranks) t.join();
  for (const auto& st : results) EXPECT_TRUE(st.ok()) << st;
  // Single-use: a late arrival returns at once.
  EXPECT_TRUE(s.Barrier("sc", "init", 2, kWorld, absl::Milliseconds(1)).ok());
}

TEST(RendezvousStore, BarrierTimesOutNamingTheMissingRanks) {
  RendezvousStore s;
  std::thread r0([&] { (void)s.Barrier("sc", "b", 0, 3, absl::Milliseconds(200)); });
  absl::Status st = s.Barrier("sc", "b", 2, 3, absl::Milliseconds(100));
  r0.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("ranks still missing: 1"), absl::string_view::npos) << st;
  EXPECT_EQ(s.Barrier("sc", "c", 3, 3, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.Barrier("sc", "d", 0, 1, absl::Seconds(1)).ok());
  EXPECT_EQ(s.Barrier("sc", "d", 0, 2, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RendezvousStore, CloseWakesWaiters) {
  RendezvousStore s;
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(30));
    s.Close();
  });
  const absl::Time start = absl::Now();
  auto r = s.Wait("sc", {"never"}, absl::Seconds(30));
  closer.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// An aborted generation's scope wakes its key waiters and barrier waiters
// with CANCELLED at once and refuses later use; other scopes go on; after
// DeleteScope it stays closed.
TEST(RendezvousStore, CancelScopeWakesItsWaitersOnly) {
  RendezvousStore s;
  ASSERT_TRUE(s.Set("other", "k", "v").ok());
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    s.CancelScope("job/gen-1");
  });
  const absl::Time start = absl::Now();
  absl::Status barrier;
  std::thread in_barrier([&] { barrier = s.Barrier("job/gen-1", "init", 0, 2, absl::Seconds(30)); });
  auto r = s.Wait("job/gen-1", {"rank-1"}, absl::Seconds(30));
  in_barrier.join();
  canceller.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_NE(r.status().message().find("job/gen-1"), absl::string_view::npos) << r.status();
  EXPECT_EQ(barrier.code(), absl::StatusCode::kCancelled) << barrier;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(s.Set("job/gen-1", "k", "v").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s.Wait("job/gen-1", {"k"}, absl::Seconds(1)).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s.Get("job/gen-1", "rank-1").status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(*s.Get("other", "k"), "v");
  EXPECT_EQ((*s.Wait("other", {"k"}, absl::Seconds(1)))[0], "v");
  s.DeleteScope("job/gen-1");
  EXPECT_EQ(s.Set("job/gen-1", "k", "v").code(), absl::StatusCode::kCancelled);
}

// Each blocked Wait or Barrier holds a server thread: past max_waiters a
// caller that would block is refused at once (and one that would not is
// served), and the slots come back when the waits end.
TEST(RendezvousStore, BlockedCallersAreBounded) {
  RendezvousStoreLimits limits;
  limits.max_waiters = 2;
  RendezvousStore s(limits);
  std::vector<absl::Status> got(2);
  std::thread w0([&] { got[0] = s.Wait("sc", {"k"}, absl::Seconds(30)).status(); });
  std::thread w1([&] { got[1] = s.Barrier("sc", "b", 0, 2, absl::Seconds(30)); });
  for (int i = 0; i < 3000 && s.waiters() < 2; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(s.waiters(), 2);
  const absl::Status third = s.Wait("sc", {"other"}, absl::Seconds(30)).status();
  EXPECT_EQ(third.code(), absl::StatusCode::kUnavailable) << third;
  EXPECT_NE(third.message().find("--max-store-waits"), absl::string_view::npos) << third;
  // A barrier arrival that would wait is refused without counting as arrived.
  EXPECT_EQ(s.Barrier("sc", "c", 0, 2, absl::Seconds(30)).code(), absl::StatusCode::kUnavailable);
  // Calls that need not block still go through: the barrier's last rank,
  // and a wait for a key that is set.
  ASSERT_TRUE(s.Set("sc", "k", "v").ok());
  EXPECT_TRUE(s.Barrier("sc", "b", 1, 2, absl::Seconds(30)).ok());
  w0.join();
  w1.join();
  EXPECT_TRUE(got[0].ok()) << got[0];
  EXPECT_TRUE(got[1].ok()) << got[1];
  EXPECT_EQ(s.waiters(), 0);
  EXPECT_TRUE(s.Wait("sc", {"k"}, absl::Seconds(1)).ok());
  // Rank 0 of barrier "c" was refused, not recorded: the barrier still
  // needs both ranks.
  EXPECT_EQ(s.Barrier("sc", "c", 1, 2, absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
}

// Keys, values and barriers count against max_bytes; a Set past it is
// refused, replacing a value counts the difference, and deleting the scope
// gives the bytes back.
TEST(RendezvousStore, HeldBytesAreBoundedAndGivenBack) {
  RendezvousStoreLimits limits;
  limits.max_bytes = 10000;
  RendezvousStore s(limits);
  ASSERT_TRUE(s.Set("job/1", "a", std::string(6000, 'x')).ok());
  const int64_t after_a = s.bytes();
  const int64_t overhead = RendezvousStore::kEntryOverheadBytes;
  EXPECT_EQ(after_a, overhead + 6000 + 5 + 1);
  const absl::Status full = s.Set("job/1", "b", std::string(6000, 'y'));
  EXPECT_EQ(full.code(), absl::StatusCode::kUnavailable) << full;
  EXPECT_NE(full.message().find("--store-quota"), absl::string_view::npos) << full;
  EXPECT_EQ(s.bytes(), after_a);
  ASSERT_TRUE(s.Set("job/1", "a", std::string(1000, 'x')).ok());  // replaced: smaller
  ASSERT_TRUE(s.Set("job/2", "b", std::string(6000, 'y')).ok());
  ASSERT_TRUE(s.Barrier("job/1", "init", 0, 1, absl::Seconds(1)).ok());
  EXPECT_GT(s.bytes(), 7000 + 10);
  s.DeleteScope("job/1");
  EXPECT_EQ(s.bytes(), overhead + 6000 + 5 + 1);
  s.DeleteScope("job/2");
  EXPECT_EQ(s.bytes(), 0);
}

// Each key counts its bookkeeping too, so that a flood of one-byte keys
// meets the quota long before it has taken the machine's memory.
TEST(RendezvousStore, TinyKeysCountTheirBookkeeping) {
  RendezvousStoreLimits limits;
  limits.max_bytes = 100 * (RendezvousStore::kEntryOverheadBytes + 8);
  RendezvousStore s(limits);
  int stored = 0;
  absl::Status st;
  for (int i = 0; i < 10000 && (st = s.Set("s", std::to_string(i), "")).ok(); ++i) ++stored;
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_GE(stored, 100);
  EXPECT_LE(stored, 110);
}

// One wait names a bounded number of distinct keys, and its reply is
// bounded: asking for the same 4 MiB value many times would otherwise copy
// it that many times while holding the store's lock.
TEST(RendezvousStore, AWaitIsBoundedInKeysAndReplyBytes) {
  RendezvousStore s;
  ASSERT_TRUE(s.Set("sc", "big", std::string(RendezvousStore::kMaxValueBytes, 'x')).ok());
  ASSERT_TRUE(s.Set("sc", "big2", std::string(RendezvousStore::kMaxValueBytes, 'y')).ok());
  ASSERT_TRUE(s.Set("sc", "small", "1").ok());
  const absl::Duration t = absl::Seconds(1);
  absl::StatusOr<std::vector<std::string>> r = s.Wait("sc", {"big", "small", "big"}, t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("'big' is named twice"), absl::string_view::npos) << r.status();
  std::vector<std::string> many;
  for (size_t i = 0; i <= RendezvousStore::kMaxWaitKeys; ++i) many.push_back(std::to_string(i));
  r = s.Wait("sc", many, t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  // Keys of 1 KiB, 300 of them: over the bytes one wait may name.
  std::vector<std::string> long_keys;
  for (int i = 0; i < 300; ++i) long_keys.push_back(absl::StrCat(i, std::string(1000, 'k')));
  r = s.Wait("sc", long_keys, t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("bytes of keys is over the limit"), absl::string_view::npos) << r.status();
  r = s.Wait("sc", {"big", "small"}, t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("wait for fewer keys"), absl::string_view::npos) << r.status();
  r = s.Wait("sc", {"big"}, t);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0], std::string(RendezvousStore::kMaxValueBytes, 'x'));
  r = s.Wait("sc", {"small", "big2"}, t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  // A timeout over many missing keys names a few and counts the rest.
  many.resize(RendezvousStore::kMaxWaitKeys);
  r = s.Wait("sc", many, absl::Milliseconds(10));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find(absl::StrCat("and ", RendezvousStore::kMaxWaitKeys - 32, " more")),
            absl::string_view::npos)
      << r.status();
}

// A world_size past kMaxWorldSize is refused (a timed-out barrier of 2^31
// ranks would otherwise list them all); a long list of missing ranks is cut.
TEST(RendezvousStore, BarrierWorldSizesAreBoundedAndMissingRanksListedBriefly) {
  RendezvousStore s;
  EXPECT_EQ(s.Barrier("sc", "huge", 0, 1 << 30, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status st = s.Barrier("sc", "wide", 0, 1000, absl::Milliseconds(10));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st.message().find("ranks still missing: 1, 2, 3"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("32 and 967 more"), absl::string_view::npos) << st;
}

// Deleting a scope wakes the callers still blocked in its barriers, and the
// last one out removes the barrier (no entry or bytes left behind).
TEST(RendezvousStore, DeleteScopeWakesBarrierWaitersAndLeavesNothing) {
  RendezvousStore s;
  absl::Status st;
  std::thread waiter([&] { st = s.Barrier("job/3", "init", 0, 2, absl::Seconds(30)); });
  for (int i = 0; i < 3000 && s.waiters() < 1; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(s.waiters(), 1);
  const absl::Time start = absl::Now();
  s.DeleteScope("job/3");
  waiter.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(s.bytes(), 0);
  // The scope stays closed.
  const absl::Status again = s.Barrier("job/3", "init", 0, 1, absl::Seconds(1));
  EXPECT_EQ(again.code(), absl::StatusCode::kCancelled) << again;
}

// A deleted scope stays closed: a rank that outlived its generation (its
// worker was counted lost, its job went on without it) cannot set keys
// there again, which nobody would delete. Cancelled scopes end closed too.
// Only the newest kMaxEndedScopes are remembered.
TEST(RendezvousStore, ADeletedScopeStaysClosedToLateRanks) {
  RendezvousStore s;
  ASSERT_TRUE(s.Set("job-1/gen-1", "addr/0", "a").ok());
  s.DeleteScope("job-1/gen-1");
  const absl::Status late = s.Set("job-1/gen-1", "addr/0", "a");
  EXPECT_EQ(late.code(), absl::StatusCode::kCancelled) << late;
  EXPECT_NE(late.message().find("ended"), absl::string_view::npos) << late;
  EXPECT_EQ(s.Wait("job-1/gen-1", {"addr/0"}, absl::Seconds(5)).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s.bytes(), 0);
  s.CancelScope("job-1/gen-2");
  s.DeleteScope("job-1/gen-2");
  EXPECT_EQ(s.Set("job-1/gen-2", "k", "v").code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(s.Set("job-1/gen-3", "k", "v").ok());
  for (size_t i = 0; i < RendezvousStore::kMaxEndedScopes - 2; ++i) s.DeleteScope(absl::StrCat("other/", i));
  EXPECT_EQ(s.Set("job-1/gen-1", "k", "v").code(), absl::StatusCode::kCancelled);  // still remembered
  s.DeleteScope("one-more");
  EXPECT_TRUE(s.Set("job-1/gen-1", "k", "v").ok());  // forgotten: the oldest
  EXPECT_EQ(s.Set("job-1/gen-2", "k", "v").code(), absl::StatusCode::kCancelled);
}

// Placed scopes only (the coordinator's store): a scope never opened takes
// no set, wait or barrier, and says so at once; an opened one does until it
// is deleted, when its waiters wake CANCELLED; a deleted one forgotten
// (past kMaxEndedScopes) is not open again.
TEST(RendezvousStore, PlacedScopesOnlyRefusesAScopeNeverOpened) {
  RendezvousStoreLimits limits;
  limits.placed_scopes_only = true;
  RendezvousStore s(limits);
  const absl::Time start = absl::Now();
  const absl::Status set = s.Set("mine", "k", std::string(1 << 20, 'x'));
  EXPECT_EQ(set.code(), absl::StatusCode::kFailedPrecondition) << set;
  EXPECT_NE(set.message().find("no placed job generation"), absl::string_view::npos) << set;
  EXPECT_EQ(s.Wait("mine", {"k"}, absl::Seconds(20)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Barrier("mine", "b", 0, 2, absl::Seconds(20)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(s.bytes(), 0);
  EXPECT_EQ(s.waiters(), 0);

  s.OpenScope("job-1/gen-1");
  ASSERT_TRUE(s.Set("job-1/gen-1", "addr/0", "a").ok());
  EXPECT_EQ(*s.Get("job-1/gen-1", "addr/0"), "a");
  absl::Status waited;
  std::thread waiter([&] { waited = s.Wait("job-1/gen-1", {"addr/1"}, absl::Seconds(20)).status(); });
  for (int i = 0; i < 10000 && s.waiters() == 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(s.waiters(), 1);
  s.DeleteScope("job-1/gen-1");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
  EXPECT_EQ(s.bytes(), 0);
  for (size_t i = 0; i < RendezvousStore::kMaxEndedScopes; ++i) s.DeleteScope(absl::StrCat("other/", i));
  EXPECT_EQ(s.Set("job-1/gen-1", "k", "v").code(), absl::StatusCode::kFailedPrecondition);  // forgotten, not open
}

}  // namespace
}  // namespace colod
