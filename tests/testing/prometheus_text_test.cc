#include "tests/testing/prometheus_text.h"

#include "gtest/gtest.h"

namespace colod::testing {
namespace {

TEST(ParsePrometheusText, ParsesFamiliesLabelsAndHistograms) {
  const std::string text =
      "# HELP colod_build_info Build.\n"
      "# TYPE colod_build_info gauge\n"
      "colod_build_info{component=\"worker\",version=\"0.1.0\"} 1\n"
      "# TYPE rpc_seconds histogram\n"
      "rpc_seconds_bucket{le=\"0.1\"} 2\n"
      "rpc_seconds_bucket{le=\"+Inf\"} 3\n"
      "rpc_seconds_sum 0.25\n"
      "rpc_seconds_count 3\n"
      "# TYPE odd gauge\n"
      "odd{path=\"a\\\"b\\\\c\\n\"} NaN 1700000000000\n";
  auto parsed = ParsePrometheusText(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const MetricFamily& info = parsed->at("colod_build_info");
  EXPECT_EQ(info.type, "gauge");
  ASSERT_EQ(info.samples.size(), 1u);
  EXPECT_EQ(info.samples[0].labels.at("version"), "0.1.0");
  EXPECT_EQ(info.samples[0].value, 1);
  EXPECT_EQ(parsed->at("rpc_seconds").samples.size(), 4u);
  EXPECT_EQ(parsed->at("odd").samples[0].labels.at("path"), "a\"b\\c\n");
}

TEST(ParsePrometheusText, RejectsMalformedLines) {
  for (const char* bad : {
           "# TYPE x gauge\nx{a=\"1\"}1\n",          // no space before value
           "# TYPE x gauge\nx{a=1} 1\n",            // unquoted label value
           "# TYPE x gauge\nx{a=\"1\" 1\n",         // unterminated label set
           "# TYPE x gauge\nx one\n",               // value not a number
           "# TYPE x gauge\n# TYPE x gauge\n",      // declared twice
           "# TYPE x gauge\ny 1\n",                 // sample outside its block
           "# TYPE x wobble\n",                     // unknown type
           "# TYPE x gauge\nx{0a=\"1\"} 1\n",       // bad label name
           "# TYPE x gauge\nx{a=\"1\",a=\"2\"} 1\n",  // repeated label
       }) {
    EXPECT_FALSE(ParsePrometheusText(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace colod::testing
