// SentencePiece through colod-sentencepiece: a hand-built BPE model whose
// encodings are worked out by hand, models trained by libsentencepiece
// itself (LLaMA's and T5's layouts), and a helper that dies, stops or is
// missing.
#include "worker/train/sentencepiece_tokenizer.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/train/tokenizer.h"
#include "worker/train/tokenizer_testing.h"

namespace colod::train {
namespace {

std::string Dir(const std::string& name) { return testing::EmptyDir(name); }
void Write(const std::string& path, const std::string& text) { testing::WriteFile(path, text); }

std::string HandBuiltDir() {
  const std::string dir = Dir("hand_built");
  Write(dir + "/tokenizer.model", testing::HandBuiltBpeModel());
  return dir;
}

TEST(SentencePiece, AHandBuiltBpeModelEncodesAsWorkedOut) {
  auto tok = LoadTokenizer(HandBuiltDir());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->kind(), "sentencepiece");
  EXPECT_EQ((*tok)->vocab_size(), 11);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  // "abc ab" is ▁abc▁ab: ▁ a b c ▁ a b. ▁a (-1) merges at 0, then at 4;
  // then ▁a+b = ▁ab (-3) at 0 and at 3; bc (-4) is no longer a pair.
  EXPECT_EQ(*(*tok)->Encode("abc ab"), (std::vector<int64_t>{9, 6, 9}));
  // "ba z": ▁ b a ▁ z; no pair is a piece, z is <unk>; a document is
  // <s> ... </s> (LLaMA's add_bos_token defaults to true).
  EXPECT_EQ(*(*tok)->EncodeDocument("ba z"), (std::vector<int64_t>{1, 3, 5, 4, 3, 0, 2}));
  EXPECT_EQ(*(*tok)->Decode({9, 6, 9}), "abc ab");
  EXPECT_EQ((*tok)->Decode({11}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*tok)->Decode({-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*(*tok)->Encode(""), std::vector<int64_t>{});
}

TEST(SentencePiece, ATrainedLlamaStyleModelRoundTripsAndFramesDocuments) {
  const std::string dir = Dir("llama_like");
  std::string corpus;
  for (int i = 0; i < 200; ++i) corpus += absl::StrCat("the quick brown fox number ", i, " jumps over the lazy dog\n");
  // LLaMA's layout: <unk> 0, <s> 1, </s> 2, BPE without normalization,
  // bytes as a fallback.
  ASSERT_EQ(testing::TrainSentencePiece(dir + "/tokenizer", corpus,
                                        "--vocab_size=400 --model_type=bpe --byte_fallback=true "
                                        "--normalization_rule_name=identity --remove_extra_whitespaces=false"),
            "");
  ASSERT_TRUE(HasTokenizer(dir));
  auto tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 400);
  for (const std::string text : {"the lazy fox 17 jumps", "Ünïcödé and bytes \x01\x02 the", ""}) {
    auto ids = (*tok)->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    for (int64_t id : *ids) EXPECT_TRUE(id >= 0 && id < 400) << id;
    EXPECT_EQ(*(*tok)->Decode(*ids), text);
    auto doc = (*tok)->EncodeDocument(text);
    ASSERT_TRUE(doc.ok());
    ASSERT_EQ(doc->size(), ids->size() + 2);
    EXPECT_EQ(doc->front(), 1);
    EXPECT_EQ(doc->back(), 2);
  }
  // Frequent words became pieces: far fewer ids than bytes.
  EXPECT_LT((*tok)->Encode("the quick brown fox jumps over the lazy dog")->size(), 20u);
  Write(dir + "/tokenizer_config.json", R"({"add_bos_token": false})");
  tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok());
  EXPECT_FALSE((*tok)->add_bos());
  EXPECT_EQ((*tok)->EncodeDocument("the")->size(), (*tok)->Encode("the")->size() + 1);
  // A tokenizer.json beside it (LLaMA ships both) does not take over.
  Write(dir + "/tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}");
  EXPECT_EQ((*LoadTokenizer(dir))->kind(), "sentencepiece");
}

TEST(SentencePiece, AT5StyleSpieceModelEndsDocumentsWithoutBos) {
  const std::string dir = Dir("t5_like");
  std::string corpus;
  for (int i = 0; i < 100; ++i) corpus += absl::StrCat("translate English to German: house number ", i, "\n");
  // T5's layout: <pad> 0, </s> 1, <unk> 2, no <s>.
  ASSERT_EQ(testing::TrainSentencePiece(dir + "/spiece", corpus,
                                        "--vocab_size=40 --model_type=unigram --pad_id=0 --eos_id=1 --unk_id=2 "
                                        "--bos_id=-1"),
            "");
  auto tok = LoadTokenizer(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_FALSE((*tok)->bos_id().has_value());
  EXPECT_EQ((*tok)->eos_id(), 1);
  auto doc = (*tok)->EncodeDocument("house number 7");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->back(), 1);
  EXPECT_EQ(*(*tok)->Decode(*(*tok)->Encode("house number 7")), "house number 7");
}

TEST(SentencePiece, ADamagedModelIsRefusedNamingTheFile) {
  const std::string dir = Dir("damaged");
  Write(dir + "/tokenizer.model", "\xFF\xFF not a model");
  auto s = LoadTokenizer(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(dir + "/tokenizer.model"), std::string::npos) << s;
  std::filesystem::remove(dir + "/tokenizer.model");
  std::filesystem::create_directory(dir + "/tokenizer.model");  // not a regular file: not a tokenizer
  EXPECT_EQ(LoadTokenizer(dir).status().code(), absl::StatusCode::kNotFound);
}

TEST(SentencePiece, AMissingHelperIsAFailedPreconditionSayingWhatToInstall) {
  SentencePieceTokenizer::Options o;
  o.helper = "/nonexistent/colod-sentencepiece";
  auto t = SentencePieceTokenizer::Load(HandBuiltDir() + "/tokenizer.model", o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_NE(t.status().message().find("colod-sentencepiece"), std::string::npos);
}

TEST(SentencePiece, AKilledHelperFailsOneCallAndTheNextStartsAnother) {
  auto t = SentencePieceTokenizer::Load(HandBuiltDir() + "/tokenizer.model", {});
  ASSERT_TRUE(t.ok()) << t.status();
  const pid_t first = (*t)->helper_pid();
  ASSERT_GT(first, 0);
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  auto ids = (*t)->Encode("abc ab");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kUnavailable) << ids.status();
  EXPECT_NE(ids.status().message().find(absl::StrCat("pid ", first)), std::string::npos) << ids.status();
  EXPECT_EQ((*t)->helper_pid(), 0);  // reaped
  ids = (*t)->Encode("abc ab");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int64_t>{9, 6, 9}));
  EXPECT_NE((*t)->helper_pid(), first);
}

TEST(SentencePiece, AStoppedHelperIsKilledAtTheDeadline) {
  SentencePieceTokenizer::Options o;
  o.timeout = absl::Milliseconds(500);
  auto t = SentencePieceTokenizer::Load(HandBuiltDir() + "/tokenizer.model", o);
  ASSERT_TRUE(t.ok()) << t.status();
  const pid_t pid = (*t)->helper_pid();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const absl::Time start = absl::Now();
  auto ids = (*t)->Encode("abc ab");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kDeadlineExceeded) << ids.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(::kill(pid, 0), -1);  // killed and reaped
  EXPECT_EQ(*(*t)->Encode("abc ab"), (std::vector<int64_t>{9, 6, 9}));
}

TEST(SentencePiece, ThreadsShareOneTokenizer) {
  auto tok = LoadTokenizer(HandBuiltDir());
  ASSERT_TRUE(tok.ok());
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto ids = (*tok)->Encode("abc ab");
        if (!ids.ok() || *ids != std::vector<int64_t>{9, 6, 9}) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
}  // namespace colod::train
