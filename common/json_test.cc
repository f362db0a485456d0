#include "common/json.h"

#include <string>

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(ParseJson, ParsesAsNlohmannDoes) {
  const nlohmann::json j = ParseJson(R"({"a": [1, {"b": "x]}[{\"y"}], "c": null})");
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["a"][1]["b"], "x]}[{\"y");  // brackets and escaped quotes in strings are not nesting
  EXPECT_TRUE(ParseJson("{\"a\": ").is_discarded());
  EXPECT_TRUE(ParseJson("").is_discarded());
  EXPECT_TRUE(ParseJson("\"\\\xff\"").is_discarded());
}

TEST(ParseJson, RefusesNestingDeeperThanItsBoundWithoutRecursing) {
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_FALSE(ParseJson(nested(kMaxJsonDepth)).is_discarded());
  EXPECT_TRUE(ParseJson(nested(kMaxJsonDepth + 1)).is_discarded());
  EXPECT_TRUE(ParseJson(nested(3), 2).is_discarded());
  // A million levels: refused, where a dump or a copy of it would overflow
  // the stack.
  EXPECT_TRUE(ParseJson(nested(1000000)).is_discarded());
  EXPECT_TRUE(ParseJson(std::string(1000000, '{')).is_discarded());
}

TEST(DescribeJson, IsShortForAnyValue) {
  EXPECT_EQ(DescribeJson(nlohmann::json(1.5)), "1.5");
  EXPECT_EQ(DescribeJson(nlohmann::json(true)), "true");
  EXPECT_EQ(DescribeJson(nlohmann::json(nullptr)), "null");
  EXPECT_EQ(DescribeJson(nlohmann::json("BPE")), "\"BPE\"");
  EXPECT_EQ(DescribeJson(nlohmann::json::array({1, 2, 3})), "an array of 3");
  EXPECT_EQ(DescribeJson(ParseJson(R"({"a": {"b": [1]}})")), "an object of 1 keys");
  const std::string long_text = DescribeJson(nlohmann::json(std::string(100000, 'x')));
  EXPECT_LE(long_text.size(), 90u);
  EXPECT_EQ(long_text.substr(long_text.size() - 3), "...");
  // A cut through a UTF-8 sequence (79 bytes, then a 2-byte letter) is
  // replaced, not thrown on.
  const std::string cut = DescribeJson(nlohmann::json(std::string(79, 'x') + "\xc3\xa9" + "tail"));
  EXPECT_EQ(cut.substr(cut.size() - 3), "...");
}

TEST(JsonText, ReplacesBytesThatAreNotUtf8RatherThanThrowing) {
  const nlohmann::json j = {{"out", std::string("logits-\xff.npy")}};
  EXPECT_EQ(JsonText(j), "{\"out\":\"logits-\xef\xbf\xbd.npy\"}");  // U+FFFD
  EXPECT_EQ(JsonText(nlohmann::json::array({1, 2}), 1), "[\n 1,\n 2\n]");
}

}  // namespace
}  // namespace colod
