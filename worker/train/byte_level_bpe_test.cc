// Byte-level BPE on worked examples: GPT-2's pre-tokenization pattern, the
// byte-to-unicode map, and merges by rank on a small vocabulary, each
// expectation worked out by hand from the published algorithm.
#include "worker/train/byte_level_bpe.h"

#include <random>

#include "gtest/gtest.h"

namespace colod::train {
namespace {

std::vector<std::string> Words(absl::string_view text) {
  std::vector<std::string> out;
  for (absl::string_view w : ByteLevelBpe::PreTokenize(text)) out.emplace_back(w);
  return out;
}

TEST(ByteLevelBpe, PreTokenizesAsGpt2sPattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(Words("Hello world"), (V{"Hello", " world"}));
  // Contractions (lower case only), white space before a word keeps its
  // last character for the word, white space at the end stays whole.
  EXPECT_EQ(Words("I'm  here!!\n\nok   "), (V{"I", "'m", " ", " here", "!!", "\n", "\n", "ok", "   "}));
  EXPECT_EQ(Words("they'll've'S"), (V{"they", "'ll", "'ve", "'", "S"}));
  // Unicode letters and numbers (Arabic-Indic digits are numbers), a run of
  // punctuation, CJK letters.
  EXPECT_EQ(Words("x 2024 café ١٢ ... 你好"), (V{"x", " 2024", " café", " ١٢", " ...", " 你好"}));
  EXPECT_EQ(Words("a1b"), (V{"a", "1", "b"}));
  // Bytes that are not UTF-8 are kept, as neither letters nor numbers nor space.
  EXPECT_EQ(Words("a\xff\xfe b\xc3"), (V{"a", "\xff\xfe", " b", "\xc3"}));
  EXPECT_EQ(Words(""), V{});
  EXPECT_EQ(Words(" "), V{" "});
}

TEST(ByteLevelBpe, ByteSymbolsAreGpt2s) {
  EXPECT_EQ(ByteLevelBpe::ByteSymbol('!'), "!");
  EXPECT_EQ(ByteLevelBpe::ByteSymbol('a'), "a");
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(0), "\u0100");     // Ā: the first unprintable byte
  EXPECT_EQ(ByteLevelBpe::ByteSymbol('\n'), "\u010A");  // Ċ
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(' '), "\u0120");   // Ġ
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(0x7F), "\u0121");  // ġ: after the 33 bytes 0..32
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(0xA1), "\u00A1");  // ¡ stands for itself
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(0xAD), "\u0143");  // Ń: the last of the 68
  EXPECT_EQ(ByteLevelBpe::ByteSymbol(0xFF), "\u00FF");
}

// Byte symbols at ids 0..255 (id = byte), then each merge's result.
struct SmallVocab {
  absl::flat_hash_map<std::string, int64_t> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  int64_t Add(const std::string& a, const std::string& b) {
    merges.emplace_back(a, b);
    const int64_t id = static_cast<int64_t>(vocab.size());
    vocab.emplace(a + b, id);
    return id;
  }
  SmallVocab() {
    for (int b = 0; b < 256; ++b) vocab.emplace(ByteLevelBpe::ByteSymbol(static_cast<uint8_t>(b)), b);
  }
};

TEST(ByteLevelBpe, MergesByRankOnAWorkedExample) {
  SmallVocab v;
  const std::string G = ByteLevelBpe::ByteSymbol(' ');
  const int64_t gt = v.Add(G, "t");         // rank 0
  const int64_t he = v.Add("h", "e");       // rank 1
  const int64_t the = v.Add(G + "t", "he"); // rank 2
  const int64_t ll = v.Add("l", "l");       // rank 3
  const int64_t hell = v.Add("he", "ll");   // rank 4
  const int64_t eot = static_cast<int64_t>(v.vocab.size());
  v.vocab.emplace("<|endoftext|>", eot);
  ByteLevelBpe::Options o;
  o.eos = eot;
  auto bpe = ByteLevelBpe::Create(v.vocab, v.merges, o);
  ASSERT_TRUE(bpe.ok()) << bpe.status();
  // " the": Ġ t h e -> (Ġ,t) rank 0 -> Ġt h e -> (h,e) rank 1 -> Ġt he -> rank 2 -> Ġthe.
  // " hello": Ġ h e l l o -> he (1) -> ll (3) -> hell (4); nothing merges Ġ or o.
  // " tell": Ġ t e l l -> Ġt (0) -> ll (3); nothing merges Ġt with e.
  EXPECT_EQ(*(*bpe)->Encode(" the hello tell"), (std::vector<int64_t>{the, ' ', hell, 'o', gt, 'e', ll}));
  EXPECT_EQ(*(*bpe)->EncodeDocument("the"), (std::vector<int64_t>{'t', he, eot}));
  EXPECT_EQ((*bpe)->vocab_size(), eot + 1);
  EXPECT_EQ(*(*bpe)->Decode({the, ' ', hell, 'o', eot}), " the hello<|endoftext|>");
  EXPECT_FALSE((*bpe)->Decode({eot + 1}).ok());
  EXPECT_FALSE((*bpe)->Decode({-1}).ok());
}

TEST(ByteLevelBpe, TheLowestRankMergesFirstAndEachOccurrenceLeftToRight) {
  for (bool bc_first : {true, false}) {
    SmallVocab v;
    int64_t ab, bc;
    if (bc_first) {
      bc = v.Add("b", "c");
      ab = v.Add("a", "b");
    } else {
      ab = v.Add("a", "b");
      bc = v.Add("b", "c");
    }
    auto bpe = ByteLevelBpe::Create(v.vocab, v.merges, {});
    ASSERT_TRUE(bpe.ok()) << bpe.status();
    EXPECT_EQ(*(*bpe)->Encode("abc"), bc_first ? (std::vector<int64_t>{'a', bc}) : (std::vector<int64_t>{ab, 'c'}));
  }
  SmallVocab v;
  const int64_t aa = v.Add("a", "a");
  auto bpe = ByteLevelBpe::Create(v.vocab, v.merges, {});
  ASSERT_TRUE(bpe.ok());
  EXPECT_EQ(*(*bpe)->Encode("aaa"), (std::vector<int64_t>{aa, 'a'}));
  EXPECT_EQ(*(*bpe)->Encode("aaaa"), (std::vector<int64_t>{aa, aa}));
  EXPECT_EQ(*(*bpe)->Encode("aaaaa"), (std::vector<int64_t>{aa, aa, 'a'}));
}

TEST(ByteLevelBpe, AnyBytesRoundTrip) {
  SmallVocab v;
  v.Add("a", "a");
  v.Add(ByteLevelBpe::ByteSymbol(' '), "a");
  auto bpe = ByteLevelBpe::Create(v.vocab, v.merges, {});
  ASSERT_TRUE(bpe.ok());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text(rng() % 300, '\0');
    for (char& c : text) c = static_cast<char>(rng() % 4 == 0 ? 'a' : rng() % 4 == 0 ? ' ' : rng());
    auto ids = (*bpe)->Encode(text);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*(*bpe)->Decode(*ids), text);
  }
  // A long word without a space merges in O(n log n): 4 MiB of one letter.
  const std::string long_word(4 << 20, 'a');
  auto ids = (*bpe)->Encode(long_word);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), size_t{2} << 20);
  // Past kMaxWordBytes a word merges in pieces: "b" and 2^20 "a"s is "b",
  // 2^19 - 1 "aa"s and an "a" from the first piece, the last "a" alone in
  // the second; merged whole it would end in 2^19 "aa"s.
  const std::string odd = "b" + std::string(ByteLevelBpe::kMaxWordBytes, 'a');
  ids = (*bpe)->Encode(odd);
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), ByteLevelBpe::kMaxWordBytes / 2 + 2);
  EXPECT_EQ((*ids)[0], 'b');
  EXPECT_EQ(ids->end()[-3], (*ids)[1]);  // "aa"
  EXPECT_EQ(ids->end()[-2], 'a');
  EXPECT_EQ(ids->end()[-1], 'a');
  EXPECT_EQ(*(*bpe)->Decode(*ids), odd);
}

TEST(ByteLevelBpe, AddPrefixSpaceAndIgnoreMerges) {
  SmallVocab v;
  const std::string G = ByteLevelBpe::ByteSymbol(' ');
  const int64_t ga = v.Add(G, "a");
  const int64_t whole = static_cast<int64_t>(v.vocab.size());
  v.vocab.emplace("xyz", whole);  // no merges lead to it
  ByteLevelBpe::Options o;
  o.add_prefix_space = true;
  auto bpe = ByteLevelBpe::Create(v.vocab, v.merges, o);
  ASSERT_TRUE(bpe.ok());
  EXPECT_EQ(*(*bpe)->Encode("a"), (std::vector<int64_t>{ga}));
  EXPECT_EQ(*(*bpe)->Encode(" a"), (std::vector<int64_t>{ga}));
  EXPECT_EQ(*(*bpe)->Encode("xyz"), (std::vector<int64_t>{' ', 'x', 'y', 'z'}));
  o.add_prefix_space = false;
  o.ignore_merges = true;
  bpe = ByteLevelBpe::Create(v.vocab, v.merges, o);
  ASSERT_TRUE(bpe.ok());
  EXPECT_EQ(*(*bpe)->Encode("xyz"), (std::vector<int64_t>{whole}));
}

TEST(ByteLevelBpe, RefusesVocabulariesItCannotEncodeWith) {
  SmallVocab v;
  v.Add("a", "b");
  auto missing_byte = v.vocab;
  missing_byte.erase(ByteLevelBpe::ByteSymbol(' '));
  auto s = ByteLevelBpe::Create(missing_byte, v.merges, {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("byte 32"), std::string::npos) << s;
  auto merges = v.merges;
  merges.emplace_back("q", "r");  // "qr" is not in the vocabulary
  s = ByteLevelBpe::Create(v.vocab, merges, {}).status();
  EXPECT_NE(s.message().find("'qr' is not in the vocabulary"), std::string::npos) << s;
  auto negative = v.vocab;
  negative["zz"] = -4;
  EXPECT_FALSE(ByteLevelBpe::Create(negative, v.merges, {}).ok());
  auto sparse = v.vocab;
  sparse["zz"] = int64_t{1} << 30;  // would make the id tables a gigabyte
  s = ByteLevelBpe::Create(sparse, v.merges, {}).status();
  EXPECT_NE(s.message().find("dense"), std::string::npos) << s;
  auto twice = v.vocab;
  twice["zz"] = 3;
  EXPECT_FALSE(ByteLevelBpe::Create(twice, v.merges, {}).ok());
  ByteLevelBpe::Options o;
  o.eos = 100000;
  EXPECT_FALSE(ByteLevelBpe::Create(v.vocab, v.merges, o).ok());
  // An added token on an id the vocabulary (or another added token) holds: "ab" would decode as "<|x|>".
  ByteLevelBpe::Options clash;
  clash.added = {{v.vocab.at("ab"), "<|x|>"}};
  s = ByteLevelBpe::Create(v.vocab, v.merges, clash).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("taken by 'ab'"), std::string::npos) << s;
  const int64_t next = static_cast<int64_t>(v.vocab.size());
  clash.added = {{next, "<|x|>"}, {next, "<|y|>"}};
  s = ByteLevelBpe::Create(v.vocab, v.merges, clash).status();
  EXPECT_NE(s.message().find("taken by '<|x|>'"), std::string::npos) << s;
}

}  // namespace
}  // namespace colod::train
