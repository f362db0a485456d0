#include "tests/testing/promql_refs.h"

#include <map>

#include "gtest/gtest.h"

namespace colod::testing {
namespace {

using Set = std::set<std::string>;

// Metrics as a scrape would show them (target labels included).
LabelLookup Lookup() {
  static const auto* known = new std::map<std::string, Set>{
      {"colod_loss", {"instance", "job", "job_id", "rank"}},
      {"colod_tokens_total", {"instance", "job", "job_id", "rank"}},
      {"colod_step_duration_seconds_bucket", {"instance", "job", "job_id", "rank", "le"}},
      {"colod_collective_duration_seconds_sum", {"instance", "job", "job_id", "rank", "op", "group"}},
      {"colod_collective_duration_seconds_count", {"instance", "job", "job_id", "rank", "op", "group"}},
      {"colod_workers", {"instance", "job", "state"}},
      {"colod:rank_mean", {"job_id", "rank", "group"}},
  };
  return [](const std::string& name) -> std::optional<Set> {
    auto it = known->find(name);
    if (it == known->end()) return std::nullopt;
    return it->second;
  };
}

PromqlRefs Read(const std::string& expr) { return ReadPromql(expr, Lookup()); }

TEST(ReadPromql, NamesTheMetricsAndTheResultsLabels) {
  PromqlRefs r = Read("sum by (job_id) (rate(colod_tokens_total{rank=~\"0|1\"}[5m] offset 1m))");
  EXPECT_TRUE(r.problems.empty()) << r.problems[0];
  EXPECT_EQ(r.names, Set{"colod_tokens_total"});
  EXPECT_EQ(r.output_labels, Set{"job_id"});

  r = Read("histogram_quantile(0.99, sum by (job_id, le) (rate(colod_step_duration_seconds_bucket[$__rate])))");
  EXPECT_TRUE(r.problems.empty()) << r.problems[0];
  EXPECT_EQ(r.output_labels, Set{"job_id"});  // le is gone

  r = Read("count by (job_id) (colod_loss != colod_loss or abs(colod_loss) == +Inf) > 0");
  EXPECT_TRUE(r.problems.empty()) << r.problems[0];
  EXPECT_EQ(r.output_labels, Set{"job_id"});

  r = Read("max by (job_id) (time() - colod_loss) > 600 # a comment naming colod_nothing\n");
  EXPECT_TRUE(r.problems.empty()) << r.problems[0];
  EXPECT_EQ(r.names, Set{"colod_loss"});

  // A recording rule's name, and one-to-many matching on its labels.
  r = Read(
      "(sum by (job_id, group) (colod:rank_mean) - on (job_id, group) group_right colod:rank_mean)"
      " / on (job_id, group) group_left () (count by (job_id, group) (colod:rank_mean) - 1)");
  EXPECT_TRUE(r.problems.empty()) << r.problems[0];
  EXPECT_EQ(r.output_labels, (Set{"job_id", "rank", "group"}));
}

TEST(ReadPromql, FindsNamesThatAreNotExported) {
  PromqlRefs r = Read("rate(colod_tokens{job_id=\"a\"}[5m]) + colod_tokens");
  ASSERT_EQ(r.problems.size(), 1u);  // once per name
  EXPECT_EQ(r.problems[0], "colod_tokens is not exported");
  EXPECT_EQ(r.names, Set{"colod_tokens"});
}

TEST(ReadPromql, FindsLabelsAMetricLacks) {
  // In a matcher.
  PromqlRefs r = Read("colod_workers{status=\"lost\"} > 0");
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0], "colod_workers has no label 'status' (matcher)");
  // In by: each series aggregated needs it.
  r = Read("sum by (job_id) (colod_loss + colod_workers)");
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0], "colod_workers has no label 'job_id' (sum by (job_id))");
  // An outer aggregation cannot use what an inner one aggregated away.
  r = Read("max by (rank) (sum by (job_id) (colod_loss))");
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0], "an aggregation by (job_id) has no label 'rank' (max by (rank))");
  // Nor use le after histogram_quantile.
  r = Read("sum by (le) (histogram_quantile(0.5, sum by (job_id, le) (colod_step_duration_seconds_bucket)))");
  ASSERT_EQ(r.problems.size(), 1u);
  // on() needs the label on both sides; group_left's on one at least.
  r = Read("colod_loss / on (job_id, state) colod_tokens_total");
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_EQ(r.problems[0], "colod_loss has no label 'state' (on (job_id, state))");
  r = Read("colod_loss * on (job_id) group_left (op) colod_tokens_total");
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0], "no operand has the label 'op' (group_left (op))");
  // without drops labels too.
  r = Read("sum by (rank) (sum without (rank) (colod_loss))");
  ASSERT_EQ(r.problems.size(), 1u);
}

TEST(ReadPromql, SaysWhatItCannotRead) {
  EXPECT_FALSE(Read("sum(colod_loss").problems.empty());
  EXPECT_FALSE(Read("colod_loss{job_id=\"a}").problems.empty());
  EXPECT_FALSE(Read("colod_loss[5m").problems.empty());
  EXPECT_FALSE(Read("{job_id=~\".+\"}").problems.empty());  // no metric name to check
}

}  // namespace
}  // namespace colod::testing
