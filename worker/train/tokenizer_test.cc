// Loading a model directory's tokenizer: byte-level BPE from vocab.json +
// merges.txt and from tokenizer.json, the document framing, and the
// refusals.
#include "worker/train/tokenizer.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "worker/train/byte_level_bpe.h"
#include "worker/train/tokenizer_testing.h"

namespace colod::train {
namespace {

using Json = nlohmann::json;

std::string Dir(const std::string& name) { return testing::EmptyDir(name); }
void Write(const std::string& path, const std::string& text) { testing::WriteFile(path, text); }
Json SmallVocab() { return testing::SmallGpt2Vocab(); }
const char* const kMerges = testing::kSmallGpt2Merges;

TEST(LoadTokenizer, VocabJsonAndMergesTxt) {
  const std::string dir = Dir("gpt2_files");
  Write(dir + "/vocab.json", SmallVocab().dump());
  Write(dir + "/merges.txt", kMerges);
  ASSERT_TRUE(HasTokenizer(dir));
  auto tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->kind(), "byte-level BPE");
  EXPECT_EQ((*tok)->vocab_size(), 260);
  EXPECT_EQ((*tok)->eos_id(), 259);  // <|endoftext|>, GPT-2's end of document
  EXPECT_FALSE((*tok)->add_bos());
  EXPECT_EQ(*(*tok)->EncodeDocument("the the"), (std::vector<int64_t>{'t', 257, 258, 259}));
  // OPT's tokenizer_config puts </s> in front of each document.
  Json vocab = SmallVocab();
  vocab.erase("<|endoftext|>");
  vocab["</s>"] = 259;
  Write(dir + "/vocab.json", vocab.dump());
  Write(dir + "/tokenizer_config.json", R"({"add_bos_token": true, "bos_token": {"content": "</s>"}, "eos_token": "</s>"})");
  tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->EncodeDocument(" the"), (std::vector<int64_t>{259, 258, 259}));
}

TEST(LoadTokenizer, TokenizerJsonWithEitherMergeLayout) {
  for (bool pairs : {false, true}) {
    const std::string dir = Dir("gpt2_json");
    Json merges = pairs ? Json::parse(R"([["Ġ","t"],["h","e"],["Ġt","he"]])") : Json::parse(R"(["Ġ t","h e","Ġt he"])");
    Json vocab = SmallVocab();
    vocab.erase("<|endoftext|>");
    Json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"dropout", nullptr}}},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}},
              {"added_tokens", Json::array({{{"id", 259}, {"content", "<|endoftext|>"}, {"special", true}}})}};
    Write(dir + "/tokenizer.json", j.dump());
    auto tok = LoadTokenizer(dir);
    ASSERT_TRUE(tok.ok()) << tok.status();
    // add_prefix_space: "the" is encoded as " the".
    EXPECT_EQ(*(*tok)->EncodeDocument("the"), (std::vector<int64_t>{258, 259}));
    EXPECT_EQ(*(*tok)->Decode({258, 259}), " the<|endoftext|>");
  }
}

TEST(LoadTokenizer, RefusesWhatItDoesNotImplementNamingIt) {
  const std::string dir = Dir("refused");
  auto expect_refused = [&](const Json& j, const std::string& what) {
    Write(dir + "/tokenizer.json", j.dump());
    auto s = LoadTokenizer(dir).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  Json byte_level = {{"type", "ByteLevel"}};
  expect_refused({{"model", {{"type", "WordPiece"}, {"vocab", Json::object()}}}, {"pre_tokenizer", byte_level}},
                 "model.type is \"WordPiece\"");
  expect_refused({{"model", {{"type", "BPE"}, {"vocab", SmallVocab()}}},
                  {"normalizer", {{"type", "NFC"}}},
                  {"pre_tokenizer", byte_level}},
                 "a normalizer");
  expect_refused({{"model", {{"type", "BPE"}, {"vocab", SmallVocab()}}}, {"pre_tokenizer", {{"type", "Whitespace"}}}},
                 "pre_tokenizer");
  expect_refused({{"model", {{"type", "BPE"}, {"vocab", SmallVocab()}, {"merges", {"x yz"}}}}, {"pre_tokenizer", byte_level}},
                 "'yz' is not in the vocabulary");
  expect_refused({{"model", {{"type", "BPE"}, {"vocab", SmallVocab()}, {"merges", {"xyz"}}}}, {"pre_tokenizer", byte_level}},
                 "two symbols and one space");
  Write(dir + "/tokenizer.json", "{not json");
  EXPECT_EQ(LoadTokenizer(dir).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(dir + "/tokenizer.json");
  EXPECT_EQ(LoadTokenizer(dir).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(HasTokenizer(dir));
  Write(dir + "/vocab.json", SmallVocab().dump());
  EXPECT_NE(LoadTokenizer(dir).status().message().find("without merges.txt"), std::string::npos);
  Write(dir + "/merges.txt", "#version: 0.2\na b c\n");
  EXPECT_NE(LoadTokenizer(dir).status().message().find("merges.txt:2"), std::string::npos);
  Write(dir + "/tokenizer_config.json", R"({"add_bos_token": "yes"})");
  EXPECT_NE(LoadTokenizer(dir).status().message().find("add_bos_token"), std::string::npos);
}

// Fields of the wrong type are refused naming them, never thrown on (which
// would end the worker daemon the job runs on), and deep nesting is refused
// before anything recurses over it.
TEST(LoadTokenizer, RefusesFieldsOfTheWrongTypeAndDeepNestingWithoutThrowing) {
  const std::string dir = Dir("hostile");
  auto expect_refused = [&](const std::string& text, const std::string& what) {
    Write(dir + "/tokenizer.json", text);
    const absl::Status s = LoadTokenizer(dir).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  const auto with = [](const Json& pre_tokenizer, const Json& normalizer = nullptr) {
    Json j = {{"model", {{"type", "BPE"}, {"vocab", SmallVocab()}}}, {"pre_tokenizer", pre_tokenizer}};
    if (!normalizer.is_null()) j["normalizer"] = normalizer;
    return j.dump();
  };
  expect_refused(R"({"model": {"type": 1}})", "model.type is 1");
  expect_refused(R"({"model": {"type": ["BPE"]}})", "model.type is an array of 1");
  expect_refused(with({{"type", 1}}), "pre_tokenizer 1");
  expect_refused(with({{"type", "ByteLevel"}, {"use_regex", "yes"}}), "pre_tokenizer.use_regex must be true or false, not \"yes\"");
  expect_refused(with({{"type", "ByteLevel"}, {"add_prefix_space", 3}}), "pre_tokenizer.add_prefix_space must be true or false, not 3");
  expect_refused(with({{"type", "ByteLevel"}}, Json::array({1, 2})), "a normalizer (an array of 2)");
  // A normalizer nested 10,000 deep (dump(128) of it was ~6 GB) and a file
  // nested a million deep: refused as not JSON, nothing recursed over.
  std::string deep = std::string(10000, '[') + std::string(10000, ']');
  expect_refused(R"({"model": {"type": "BPE"}, "normalizer": )" + deep + "}", "is not a JSON object");
  expect_refused(std::string(1000000, '['), "is not a JSON object");
  // A string longer than a message: cut.
  Write(dir + "/tokenizer.json", R"({"model": {"type": ")" + std::string(100000, 'W') + R"("}})");
  EXPECT_LT(LoadTokenizer(dir).status().message().size(), 1000u);
}

}  // namespace
}  // namespace colod::train
