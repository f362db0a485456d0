// Hang blame from hand-made rank reports: who waits, who has not entered,
// who is silent.
#include "server/hang_detector.h"

#include "common/proto_time.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

v1::CollectiveProgress Progress(const std::string& group, int64_t entered, int64_t pending, absl::Duration age) {
  v1::CollectiveProgress p;
  p.set_group(group);
  p.set_entered(entered);
  if (pending > 0) {
    p.set_pending_sequence(pending);
    p.set_pending_op("all_reduce");
    *p.mutable_pending_for() = ToProtoDuration(age);
  }
  return p;
}

RankReport Rank(int r, absl::Duration silent, std::vector<v1::CollectiveProgress> c) {
  RankReport out;
  out.rank = r;
  out.name = "rank " + std::to_string(r) + " (worker w" + std::to_string(r) + ")";
  out.silent_for = silent;
  out.collectives = std::move(c);
  return out;
}

TEST(FindHangs, NamesTheRankThatHasNotEnteredAndTheSilentOne) {
  const absl::Duration t = absl::Seconds(5);
  // tp/0_1 and tp/2_3, dp/0_2 and dp/1_3: rank 3 stopped (silent 7 s) after
  // entering #40 of tp/2_3 and #10 of dp/1_3; rank 2 waits in tp/2_3 #41,
  // rank 1 in dp/1_3 #11. Ranks 0 and 1's tp group is fine.
  const std::vector<RankReport> ranks = {
      Rank(0, absl::Milliseconds(200), {Progress("tp/0_1", 41, 0, {}), Progress("dp/0_2", 11, 0, {})}),
      Rank(1, absl::Milliseconds(200), {Progress("tp/0_1", 41, 0, {}), Progress("dp/1_3", 11, 11, absl::Seconds(6))}),
      Rank(2, absl::Milliseconds(200), {Progress("tp/2_3", 41, 41, absl::Seconds(7)), Progress("dp/0_2", 11, 0, {})}),
      Rank(3, absl::Seconds(7), {Progress("tp/2_3", 40, 0, {}), Progress("dp/1_3", 10, 0, {})}),
  };
  const std::vector<v1::HangReport> hangs = FindHangs(ranks, t);
  ASSERT_EQ(hangs.size(), 2u);  // by group name: dp/1_3, tp/2_3
  EXPECT_EQ(hangs[0].group(), "dp/1_3");
  EXPECT_EQ(hangs[0].sequence(), 11);
  EXPECT_EQ(std::vector<int>(hangs[0].waiting_ranks().begin(), hangs[0].waiting_ranks().end()), std::vector<int>{1});
  EXPECT_EQ(std::vector<int>(hangs[0].missing_ranks().begin(), hangs[0].missing_ranks().end()), std::vector<int>{3});
  EXPECT_EQ(std::vector<int>(hangs[0].silent_ranks().begin(), hangs[0].silent_ranks().end()), std::vector<int>{3});
  EXPECT_EQ(hangs[1].group(), "tp/2_3");
  EXPECT_EQ(hangs[1].sequence(), 41);
  EXPECT_EQ(hangs[1].message(),
            "collective #41 (all_reduce) of group tp/2_3 pending for 7s on ranks 2; not entered by rank 3 (worker w3) "
            "(entered #40); rank 3 (worker w3) has not reported for 7s");
  // Rank 1 waits in dp/1_3 for rank 3; had rank 3 entered dp #10 only and
  // been waiting in tp/2_3 #40, it would be named as waiting itself.
  std::vector<RankReport> chained = ranks;
  chained[3].collectives = {Progress("tp/2_3", 41, 41, absl::Seconds(6)), Progress("dp/1_3", 10, 0, {})};
  chained[3].silent_for = absl::Milliseconds(200);
  const std::vector<v1::HangReport> victims = FindHangs(chained, t);
  ASSERT_EQ(victims.size(), 2u);
  EXPECT_NE(victims[0].message().find("not entered by rank 3 (worker w3) (entered #10; itself waiting in tp/2_3 #41)"),
            std::string::npos)
      << victims[0].message();
  // Below the threshold: nothing.
  EXPECT_TRUE(FindHangs(ranks, absl::Seconds(8)).empty());
}

TEST(FindHangs, EveryRankEnteredAndAMemberNeverReported) {
  // Both ranks wait in #3: a stall in the transport, not a missing rank.
  std::vector<RankReport> ranks = {Rank(0, absl::ZeroDuration(), {Progress("dp/0_1", 3, 3, absl::Seconds(9))}),
                                   Rank(1, absl::ZeroDuration(), {Progress("dp/0_1", 3, 3, absl::Seconds(8))})};
  std::vector<v1::HangReport> hangs = FindHangs(ranks, absl::Seconds(5));
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_TRUE(hangs[0].missing_ranks().empty());
  EXPECT_EQ(hangs[0].waiting_ranks_size(), 2);
  EXPECT_NE(hangs[0].message().find("every rank of the group entered it"), std::string::npos) << hangs[0].message();
  // A member the coordinator has no report of (its worker runs another job
  // or was lost) has entered nothing.
  ranks.pop_back();
  hangs = FindHangs(ranks, absl::Seconds(5));
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_EQ(std::vector<int>(hangs[0].missing_ranks().begin(), hangs[0].missing_ranks().end()), std::vector<int>{1});
  EXPECT_EQ(std::vector<int>(hangs[0].silent_ranks().begin(), hangs[0].silent_ranks().end()), std::vector<int>{1});
  EXPECT_NE(hangs[0].message().find("rank 1 (entered #0)"), std::string::npos) << hangs[0].message();
}

}  // namespace
}  // namespace colod
