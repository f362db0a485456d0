// KeyProofGate on a fake clock: how many checks of registrations at their
// addresses run at once, from one host and of one address, and how long an
// address found unreachable is answered so without a call.
#include "server/key_proof_gate.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(PeerHost, IsThePeerWithoutItsPort) {
  EXPECT_EQ(PeerHost("ipv4:10.0.0.7:51234"), "ipv4:10.0.0.7");
  // IPv6 by its /64: one host may hold many of its addresses.
  EXPECT_EQ(PeerHost("ipv6:[::1]:5000"), "ipv6:[::]/64");
  EXPECT_EQ(PeerHost("ipv6:[2001:db8:1:2:a:b:c:d]:5000"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(PeerHost("ipv6:%5B2001:db8:1:2::7%5D:5000"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(PeerHost("ipv6:%5Bfe80::1%25eth0%5D:5000"), "ipv6:[fe80::]/64");
  EXPECT_EQ(PeerHost("ipv6:[not-an-address]:5000"), "ipv6:[not-an-address]");
  EXPECT_EQ(PeerHost("unix:/run/colod.sock"), "unix:/run/colod.sock");
  EXPECT_EQ(PeerHost("unix-abstract:colod"), "unix-abstract:colod");
  EXPECT_EQ(PeerHost("unix:"), "unix:");
  EXPECT_EQ(PeerHost("ipv4:10.0.0.7:"), "ipv4:10.0.0.7:");
  EXPECT_EQ(PeerHost(""), "");
}

class KeyProofGateTest : public ::testing::Test {
 protected:
  KeyProofGate::Options Options() {
    KeyProofGate::Options o;
    o.max = 6;
    o.max_per_peer = 2;
    o.unreachable_for = absl::Seconds(15);
    o.max_remembered = 3;
    o.clock = &clock_;
    return o;
  }
  static std::string Host(int i) { return absl::StrCat("ipv4:10.0.0.", i); }
  static std::string Address(int i) { return absl::StrCat("10.1.0.", i, ":7070"); }

  FakeClock clock_;
};

TEST_F(KeyProofGateTest, BoundsChecksInAllFromOneHostAndOfOneAddress) {
  KeyProofGate gate(Options());
  // Two from one host, then that host waits; others go on.
  ASSERT_TRUE(gate.Enter(Host(1), Address(1)).ok());
  ASSERT_TRUE(gate.Enter(Host(1), Address(2)).ok());
  const absl::Status third = gate.Enter(Host(1), Address(3));
  EXPECT_EQ(third.code(), absl::StatusCode::kUnavailable) << third;
  EXPECT_TRUE(absl::StrContains(third.message(), "checking 2 other registrations from this host")) << third;
  // One check of an address at a time from a host; another host's check
  // of it is not held up (a caller checking a worker's address over and
  // over must not keep the worker's own registration out).
  gate.Leave(Host(1), Address(2), false);
  const absl::Status same = gate.Enter(Host(1), Address(1));
  EXPECT_EQ(same.code(), absl::StatusCode::kUnavailable) << same;
  EXPECT_TRUE(absl::StrContains(same.message(), "checking another registration at " + Address(1) + " from this host"))
      << same;
  ASSERT_TRUE(gate.Enter(Host(2), Address(1)).ok());
  ASSERT_TRUE(gate.Enter(Host(1), Address(2)).ok());
  // Six in all.
  for (int i = 3; i <= 5; ++i) ASSERT_TRUE(gate.Enter(Host(i), Address(i)).ok()) << i;
  const absl::Status seventh = gate.Enter(Host(7), Address(7));
  EXPECT_EQ(seventh.code(), absl::StatusCode::kUnavailable) << seventh;
  EXPECT_TRUE(absl::StrContains(seventh.message(), "checking 6 other registrations")) << seventh;
  // A check that ends frees its place, its host's and its address's.
  gate.Leave(Host(1), Address(1), /*unreachable=*/false);
  EXPECT_TRUE(gate.Enter(Host(1), Address(1)).ok());
  gate.Leave(Host(1), Address(1), false);
  gate.Leave(Host(1), Address(2), false);
  gate.Leave(Host(2), Address(1), false);
  for (int i = 3; i <= 5; ++i) gate.Leave(Host(i), Address(i), false);
  // Every place is free again: six hosts at once.
  for (int i = 1; i <= 6; ++i) EXPECT_TRUE(gate.Enter(Host(10 + i), Address(i)).ok()) << i;
}

TEST_F(KeyProofGateTest, AnUnreachableAddressIsAnsweredSoForAWhileAndFewAreRemembered) {
  KeyProofGate gate(Options());
  ASSERT_TRUE(gate.Enter(Host(1), Address(1)).ok());
  gate.Leave(Host(1), Address(1), /*unreachable=*/true);
  clock_.Advance(absl::Seconds(4));
  const absl::Status again = gate.Enter(Host(2), Address(1));  // from anyone
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "could not reach " + Address(1))) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "4s ago")) << again;
  EXPECT_TRUE(absl::StrContains(again.message(), "--advertise-host")) << again;
  // Another address is not held up by it.
  ASSERT_TRUE(gate.Enter(Host(1), Address(2)).ok());
  gate.Leave(Host(1), Address(2), false);
  // Once unreachable_for passed, it is called again.
  clock_.Advance(absl::Seconds(11));
  ASSERT_TRUE(gate.Enter(Host(1), Address(1)).ok());
  gate.Leave(Host(1), Address(1), false);
  EXPECT_TRUE(gate.Enter(Host(1), Address(1)).ok());  // reached: not remembered
  gate.Leave(Host(1), Address(1), false);
  // At most max_remembered (3) addresses: the oldest goes first.
  for (int i = 10; i < 14; ++i) {
    ASSERT_TRUE(gate.Enter(Host(i), Address(i)).ok()) << i;
    gate.Leave(Host(i), Address(i), true);
    clock_.Advance(absl::Seconds(1));
  }
  EXPECT_TRUE(gate.Enter(Host(1), Address(10)).ok());  // forgotten
  gate.Leave(Host(1), Address(10), false);
  for (int i = 11; i < 14; ++i) {
    EXPECT_EQ(gate.Enter(Host(1), Address(i)).code(), absl::StatusCode::kUnavailable) << i;
  }
}

}  // namespace
}  // namespace colod
