// Token corpora in each format and the sampler's batches.
#include "worker/train/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/npy_header.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/tensor/npy.h"
#include "worker/train/megatron_testing.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

TEST(TokenCorpus, EveryFormat) {
  // uint16 and uint32 .bin, little-endian.
  const std::string u16 = TempPath("tokens.bin"), u32 = TempPath("tokens32.bin");
  {
    std::ofstream(u16, std::ios::binary).write("\x01\x00\x34\x12\xff\xff", 6);
    std::ofstream(u32, std::ios::binary).write("\x01\x00\x00\x00\x78\x56\x34\x12", 8);
  }
  auto a = TokenCorpus::Open(u16);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->size(), 3);
  EXPECT_EQ((*a)->Window(0, 3)->ToInt64s(), (std::vector<int64_t>{1, 0x1234, 0xffff}));
  auto b = TokenCorpus::Open(u32, DataFormat::kU32);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Window(0, 2)->ToInt64s(), (std::vector<int64_t>{1, 0x12345678}));
  EXPECT_EQ(TokenCorpus::Open(u16, DataFormat::kU32).status().code(), absl::StatusCode::kInvalidArgument);  // 6 bytes
  // .npy of any integer type.
  ASSERT_TRUE(WriteNpy(TempPath("tokens.npy"), *Tensor::FromInt64s({2, 2}, std::vector<int64_t>{5, 6, 7, 8})).ok());
  auto c = TokenCorpus::Open(TempPath("tokens.npy"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->Window(1, 3)->ToInt64s(), (std::vector<int64_t>{6, 7, 8}));
  ASSERT_TRUE(WriteNpy(TempPath("floats.npy"), *Tensor::Zeros({3}, DType::kF32)).ok());
  EXPECT_EQ(TokenCorpus::Open(TempPath("floats.npy")).status().code(), absl::StatusCode::kInvalidArgument);
  // Text: bytes, then <|endoftext|>.
  std::ofstream(TempPath("text.txt")) << "h\xc3\xa9";
  auto d = TokenCorpus::Open(TempPath("text.txt"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->Window(0, 4)->ToInt64s(), (std::vector<int64_t>{'h', 0xc3, 0xa9, kEndOfText}));
  EXPECT_EQ(TokenCorpus::Open(TempPath("missing.bin")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*d)->Window(2, 5).status().code(), absl::StatusCode::kOutOfRange);
}

// Opened with the model's vocab_size, a corpus refuses ids outside it,
// naming the file, the token's offset in the corpus and its id: the tokens
// held in memory (.npy, text) at once, all of them; a file's (.bin,
// Megatron) as they are read, so that a batch never carries one into the
// embedding (where it would be a bare "id at position" of a step).
TEST(TokenCorpus, AnIdOutsideTheModelsVocabularyIsRefusedNamingWhereItIs) {
  ASSERT_TRUE(
      WriteNpy(TempPath("oov.npy"), *Tensor::FromInt64s({2, 3}, std::vector<int64_t>{1, 2, 3, 4, 50257, 6})).ok());
  EXPECT_TRUE(TokenCorpus::Open(TempPath("oov.npy"), DataFormat::kAuto, nullptr, {}, 50258).ok());
  absl::Status s = TokenCorpus::Open(TempPath("oov.npy"), DataFormat::kAuto, nullptr, {}, 50257).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "oov.npy: token 4 of the corpus is id 50257, outside the model's "
                                "vocabulary [0, 50257) (config.json's vocab_size)"))
      << s;
  ASSERT_TRUE(WriteNpy(TempPath("negative.npy"), *Tensor::FromInt64s({2}, std::vector<int64_t>{7, -1})).ok());
  s = TokenCorpus::Open(TempPath("negative.npy"), DataFormat::kAuto, nullptr, {}, 50257).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "token 1 of the corpus is id -1")) << s;
  // Without a vocabulary (0) nothing is checked; a negative one is refused.
  EXPECT_TRUE(TokenCorpus::Open(TempPath("oov.npy")).ok());
  EXPECT_EQ(TokenCorpus::Open(TempPath("oov.npy"), DataFormat::kAuto, nullptr, {}, -1).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A uint16 .bin with 60000 at token 5: the reads before it are whole,
  // the one over it is refused, naming it.
  const std::string bin = TempPath("oov.bin");
  {
    std::string bytes;
    for (const uint64_t id : {1, 2, 3, 4, 5, 60000, 7, 8}) bytes += testing::LittleEndian(id, 2);
    std::ofstream(bin, std::ios::binary) << bytes;
  }
  auto corpus = TokenCorpus::Open(bin, DataFormat::kAuto, nullptr, {}, 50257);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->Window(0, 5)->ToInt64s(), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  s = (*corpus)->Window(3, 4).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "oov.bin: token 5 of the corpus is id 60000, outside")) << s;
  // The sampler's batches read through it: a batch over the token fails.
  auto sampler = BatchSampler::Create((*corpus)->size(), 7, 1, 1, 0);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Tensor inputs, labels;
  s = sampler->Batch(**corpus, 0, 0, &inputs, &labels);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // Megatron's int32 tokens: a negative id.
  testing::MegatronDataset m;
  m.code = 4;
  m.width = 4;
  m.sequences = {{1, 2}, {3, -4}};
  m.doc_bounds = {0, 1, 2};
  testing::WriteMegatronDataset(TempPath("oov_megatron"), m);
  auto megatron = TokenCorpus::Open(TempPath("oov_megatron"), DataFormat::kAuto, nullptr, {}, 100);
  ASSERT_TRUE(megatron.ok()) << megatron.status();
  EXPECT_TRUE((*megatron)->Window(0, 3).ok());
  s = (*megatron)->Window(0, 4).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "oov_megatron.bin: token 3 of the corpus is id -4")) << s;
}

using Megatron = testing::MegatronDataset;
using testing::WriteMegatronDataset;

std::string Le(uint64_t v, int bytes) { return testing::LittleEndian(v, bytes); }
void WriteMegatron(const std::string& prefix, const Megatron& m) { WriteMegatronDataset(prefix, m); }

TEST(TokenCorpus, MegatronIndexedDatasetsReadInOrderWithTheirDocuments) {
  // Three documents: the first of two sequences (as a document split into
  // sentences), then one each; uint16 tokens up to 65535.
  Megatron m;
  m.sequences = {{10, 11, 12}, {13, 65535}, {20}, {30, 31, 32, 33}};
  m.doc_bounds = {0, 2, 3, 4};
  const std::string prefix = TempPath("megatron_text_document");
  WriteMegatron(prefix, m);
  const std::vector<int64_t> all = {10, 11, 12, 13, 65535, 20, 30, 31, 32, 33};
  // Named by its prefix, its .bin (an .idx beside it: not nanoGPT's uint16)
  // or its .idx; or the format said outright.
  for (const auto& [path, format] : std::vector<std::pair<std::string, DataFormat>>{
           {prefix, DataFormat::kAuto}, {prefix + ".bin", DataFormat::kAuto},
           {prefix + ".idx", DataFormat::kAuto}, {prefix, DataFormat::kMegatron}}) {
    auto c = TokenCorpus::Open(path, format);
    ASSERT_TRUE(c.ok()) << path << ": " << c.status();
    EXPECT_EQ((*c)->format(), DataFormat::kMegatron) << path;
    EXPECT_EQ((*c)->size(), 10);
    EXPECT_EQ((*c)->Window(0, 10)->ToInt64s(), all);
    EXPECT_EQ((*c)->documents(), (std::vector<int64_t>{0, 5, 6})) << path;
  }
  // Signed and wider token types: int32 with a negative value reads as
  // such; int64; uint8.
  Megatron wide;
  wide.code = 4;
  wide.width = 4;
  wide.sequences = {{70000, -1}, {5}};
  wide.doc_bounds = {0, 1, 2};
  WriteMegatron(TempPath("wide"), wide);
  auto w = TokenCorpus::Open(TempPath("wide"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->Window(0, 3)->ToInt64s(), (std::vector<int64_t>{70000, -1, 5}));
  wide.code = 5;
  wide.width = 8;
  WriteMegatron(TempPath("wide64"), wide);
  EXPECT_EQ((*TokenCorpus::Open(TempPath("wide64")))->Window(0, 3)->ToInt64s(),
            (std::vector<int64_t>{70000, -1, 5}));
  Megatron bytes;
  bytes.code = 1;
  bytes.width = 1;
  bytes.sequences = {{255, 0, 7}};
  bytes.doc_bounds = {0, 1};
  WriteMegatron(TempPath("bytes"), bytes);
  EXPECT_EQ((*TokenCorpus::Open(TempPath("bytes")))->Window(0, 3)->ToInt64s(), (std::vector<int64_t>{255, 0, 7}));
  // A sampler's batches over it are windows of the concatenation.
  auto c = TokenCorpus::Open(prefix);
  auto sampler = BatchSampler::Create((*c)->size(), 3, 2, 1, 5);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Tensor inputs, labels;
  ASSERT_TRUE(sampler->Batch(**c, 0, 0, &inputs, &labels).ok());
  const std::vector<int64_t> starts = sampler->Starts(0), in = inputs.ToInt64s();
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < 3; ++j) EXPECT_EQ(in[r * 3 + j], all[starts[r] + j]);
  }
}

// An index of more sequences and documents than one read window holds (1
// MiB: 87,381 sequences' lengths and pointers, 131,072 boundaries) is read
// in pieces, in order; its documents are where each one's first sequence
// starts (an empty one starts no new place: kept once).
TEST(TokenCorpus, AMegatronIndexLargerThanAReadWindowGivesEveryDocument) {
  Megatron m;
  std::vector<int64_t> tokens, want = {0};
  m.doc_bounds = {0};
  for (int64_t i = 0; i < 200000; ++i) {
    const int64_t len = 1 + i % 3;
    m.sequences.push_back(std::vector<int64_t>(len, i % 50000));
    tokens.insert(tokens.end(), len, i % 50000);
    // Documents of 1, 2 or 3 sequences, and an empty one now and then.
    const int64_t at = static_cast<int64_t>(tokens.size());
    if (i % 7 == 0 || i % 5 == 1) {
      m.doc_bounds.push_back(i + 1);
      want.push_back(at);
    }
    if (i % 101 == 0) {  // a boundary, and an empty document where one was just made
      m.doc_bounds.push_back(i + 1);
      if (want.back() != at) want.push_back(at);
    }
  }
  if (m.doc_bounds.back() != 200000) {
    m.doc_bounds.push_back(200000);
  } else {
    want.pop_back();  // the last boundary is the end, not a document
  }
  const std::string prefix = TempPath("megatron_large");
  WriteMegatron(prefix, m);
  auto c = TokenCorpus::Open(prefix, DataFormat::kMegatron);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->size(), static_cast<int64_t>(tokens.size()));
  EXPECT_EQ((*c)->documents(), want);
  std::vector<int64_t> tail(1000);
  ASSERT_TRUE((*c)->Read((*c)->size() - 1000, 1000, tail.data()).ok());
  EXPECT_EQ(tail, std::vector<int64_t>(tokens.end() - 1000, tokens.end()));
}

// An index whose counts only its apparent size backs (a sparse file: 128
// MiB of 2^24 document boundaries, all but the last at sequence 0, for a
// few KiB on disk) is read without holding a start per boundary (a 2^34
// such made the worker allocate 128 GiB), and a stop ends its read.
TEST(TokenCorpus, ASparseMegatronIndexHoldsNoStartPerBoundaryAndAStopEndsIt) {
  const std::string prefix = TempPath("sparse");
  constexpr int64_t kBounds = int64_t{1} << 24;
  {
    std::ofstream bin(prefix + ".bin", std::ios::binary);
    bin << Le(7, 2);
    std::ofstream idx(prefix + ".idx", std::ios::binary);
    idx << "MMIDIDX" << std::string(2, '\0') << Le(1, 8) << Le(8, 1) << Le(1, 8) << Le(kBounds, 8)  // uint16
        << Le(1, 4) << Le(0, 8);  // one sequence of one token at byte 0
    idx.seekp(static_cast<std::streamoff>(34 + 12 + 8 * (kBounds - 1)));
    idx << Le(1, 8);  // the last boundary: sequence 1
  }
  auto c = TokenCorpus::Open(prefix, DataFormat::kMegatron);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->size(), 1);
  EXPECT_EQ((*c)->documents(), std::vector<int64_t>{0}) << "one start for 2^24 empty documents";
  int polls = 0;
  auto stopped = TokenCorpus::Open(prefix, DataFormat::kMegatron, nullptr, [&] { return ++polls > 2; });
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_GT(polls, 2);
}

// An index that does not describe its .bin is refused naming the .idx,
// before any token is read; so is a float dataset.
TEST(TokenCorpus, ADamagedMegatronIndexIsRefused) {
  Megatron m;
  m.sequences = {{1, 2, 3}, {4}};
  m.doc_bounds = {0, 2};
  const std::string prefix = TempPath("damaged");
  auto refused = [&](const std::string& says) {
    auto c = TokenCorpus::Open(prefix, DataFormat::kMegatron);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
    EXPECT_NE(c.status().message().find(says), std::string::npos) << c.status();
  };
  auto edit_idx = [&](size_t at, const std::string& bytes) {
    WriteMegatron(prefix, m);
    std::fstream f(prefix + ".idx", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  edit_idx(0, "XXIDIDX");
  refused("no MMIDIDX header");
  edit_idx(9, Le(2, 8));
  refused("index version 2");
  edit_idx(17, Le(7, 1));  // float32
  refused("not an integer type");
  edit_idx(18, Le(uint64_t{1} << 62, 8));  // a sequence count that overflows
  refused("larger than the file");
  edit_idx(18, Le(5, 8));
  refused("cannot hold 5 sequences");
  edit_idx(34, Le(1000, 4));  // the first sequence runs past the .bin
  refused("runs past the .bin");
  edit_idx(34 + 8, Le(uint64_t{INT64_MAX}, 8));  // a pointer whose end overflows
  refused("runs past the .bin");
  edit_idx(34 + 8 + 8, Le(2, 8));  // the second sequence overlaps the first
  refused("only contiguous datasets");
  edit_idx(34 + 8 + 16, Le(1, 8));  // documents start at sequence 1
  refused("document boundaries");
  // A .bin cut short.
  WriteMegatron(prefix, m);
  std::filesystem::resize_file(prefix + ".bin", 4);
  refused("runs past the .bin");
  // No .idx: by its prefix it is not found.
  std::filesystem::remove(prefix + ".idx");
  EXPECT_EQ(TokenCorpus::Open(prefix, DataFormat::kMegatron).status().code(), absl::StatusCode::kNotFound);
}

// A FIFO (nobody writing), a device that never ends, a directory and an
// empty file are refused at once in every format, naming what they are; a
// FIFO never blocks the rank in open or read.
TEST(TokenCorpus, OnlyNonEmptyRegularFiles) {
  const std::string fifo = TempPath("fifo.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::ofstream(TempPath("empty.txt")).flush();
  // Not empty as a file, but an array of no tokens (found by data_fuzz).
  ASSERT_TRUE(WriteNpy(TempPath("empty.npy"), *Tensor::FromInt64s({0}, {})).ok());
  auto empty_array = TokenCorpus::Open(TempPath("empty.npy"), DataFormat::kNpy);
  EXPECT_EQ(empty_array.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty_array.status().message().find("holds no tokens"), absl::string_view::npos) << empty_array.status();
  const struct {
    std::string path;
    std::string says;
  } cases[] = {{fifo, "is a FIFO"},
               {"/dev/zero", "is a character device"},
               {::testing::TempDir(), "is a directory"},
               {TempPath("empty.txt"), "is empty"}};
  for (const auto& c : cases) {
    for (DataFormat f : {DataFormat::kAuto, DataFormat::kText, DataFormat::kU16, DataFormat::kNpy}) {
      const absl::Time start = absl::Now();
      absl::Status s = TokenCorpus::Open(c.path, f).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.path << ": " << s;
      EXPECT_NE(s.message().find(c.says), absl::string_view::npos) << s;
      EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    }
  }
}

// A corpus held in memory that would not fit there is refused before a
// byte of it is read (sparse files: their size costs no disk), naming the
// Megatron dataset that is read from disk instead.
TEST(TokenCorpus, ACorpusLargerThanTheMemoryIsRefusedBeforeItIsRead) {
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  // An eighth of the memory as text is 8 bytes a token or more; as <u2
  // tokens (a header, then the sparse array) 4 times that.
  const int64_t tokens = physical / 8 + 1;
  for (const char* name : {"huge.txt", "huge.jsonl", "huge.npy"}) {
    const std::string path = TempPath(name);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    int64_t size = tokens;
    if (absl::EndsWith(name, ".npy")) {
      const std::string header = NpyHeader("<u2", {tokens});
      ASSERT_EQ(::write(fd, header.data(), header.size()), static_cast<ssize_t>(header.size()));
      size = static_cast<int64_t>(header.size()) + 2 * tokens;
    }
    ASSERT_EQ(::ftruncate(fd, size), 0) << std::strerror(errno);
    ::close(fd);
    const absl::Time start = absl::Now();
    const absl::Status s = TokenCorpus::Open(path, DataFormat::kAuto).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << name << ": " << s;
    EXPECT_NE(s.message().find("coloctl tokenize"), absl::string_view::npos) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << name << ": read before it was refused?";
    ::unlink(path.c_str());
  }
}

// What reading an integer .npy into int64 values holds: the tensor ReadNpy
// returns, the vector of values and, for a tensor narrower than int64, the
// widened copy made before the vector (<u2 is read into an int64 tensor).
TEST(NpyFootprint, ReadingIntegersHoldsTheTensorAndEightOrSixteenBytesAValue) {
  const std::vector<int64_t> values(1000, 7);
  ASSERT_TRUE(WriteNpy(TempPath("i8.npy"), *Tensor::FromInt64s({1000}, values)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("i4.npy"), *Tensor::FromInt64s({1000}, values, DType::kI32)).ok());
  {
    std::ofstream u2(TempPath("u2.npy"), std::ios::binary);
    u2 << NpyHeader("<u2", {1000}) << std::string(2000, '\0');
  }
  const struct {
    const char* name;
    int64_t tensor, with_values;
  } cases[] = {{"i8.npy", 8000, 16000}, {"i4.npy", 4000, 20000}, {"u2.npy", 8000, 16000}};
  for (const auto& c : cases) {
    const absl::StatusOr<NpyFootprint> f = NpyFootprintOf(TempPath(c.name));
    ASSERT_TRUE(f.ok()) << c.name << ": " << f.status();
    EXPECT_EQ(f->elements, 1000) << c.name;
    EXPECT_EQ(f->tensor, c.tensor) << c.name;
    EXPECT_EQ(f->TensorAndInt64s(), c.with_values) << c.name;
    // What is read back is what was counted.
    const absl::StatusOr<Tensor> t = ReadNpy(TempPath(c.name));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(static_cast<int64_t>(t->nbytes()), c.tensor) << c.name;
  }
}

// A tokenizer whose ids are worked out by hand: id = byte, bos 300,
// eos 301; it refuses a text holding '!'.
class ByteTokenizer final : public Tokenizer {
 public:
  std::string kind() const override { return "test"; }
  int64_t vocab_size() const override { return 302; }
  std::optional<int64_t> bos_id() const override { return 300; }
  std::optional<int64_t> eos_id() const override { return 301; }
  bool add_bos() const override { return true; }
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text) const override {
    if (absl::StrContains(text, "!")) return absl::InvalidArgumentError("no '!' here");
    std::vector<int64_t> ids;
    for (unsigned char b : text) ids.push_back(b);
    return ids;
  }
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t>) const override { return ""; }
};

std::vector<int64_t> Tokens(const TokenCorpus& c) { return c.Window(0, c.size())->ToInt64s(); }

TEST(TokenCorpus, TextWithATokenizerIsOneDocumentPerParagraph) {
  const std::string path = TempPath("paragraphs.txt");
  std::ofstream(path, std::ios::binary) << "\n\nab\nc\n \t\nd\n\n\n";
  ByteTokenizer tok;
  auto c = TokenCorpus::Open(path, DataFormat::kAuto, &tok);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Tokens(**c), (std::vector<int64_t>{300, 'a', 'b', '\n', 'c', 301, 300, 'd', 301}));
  EXPECT_EQ((*c)->documents(), (std::vector<int64_t>{0, 6}));
  // Without a tokenizer: the whole file, byte for byte, then <|endoftext|>.
  c = TokenCorpus::Open(path);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->size(), 15);  // 14 bytes
  EXPECT_EQ(Tokens(**c).back(), kEndOfText);
  EXPECT_EQ((*c)->documents(), std::vector<int64_t>{0});
  // CRLF lines (a line of only "\r" is blank; the others keep theirs) and a
  // last paragraph without a line break.
  std::ofstream(path, std::ios::binary) << "x\r\ny\r\n\r\nz";
  c = TokenCorpus::Open(path, DataFormat::kText, &tok);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Tokens(**c), (std::vector<int64_t>{300, 'x', '\r', '\n', 'y', '\r', 301, 300, 'z', 301}));
  // Only blank lines: no document.
  std::ofstream(path, std::ios::binary) << "\n \n";
  EXPECT_EQ(TokenCorpus::Open(path, DataFormat::kText, &tok).status().code(), absl::StatusCode::kInvalidArgument);
  // What the tokenizer refuses is refused, naming the file.
  std::ofstream(path, std::ios::binary) << "fine\n\nnot fine!\n";
  auto s = TokenCorpus::Open(path, DataFormat::kText, &tok).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(path), std::string::npos) << s;
}

TEST(TokenCorpus, JsonLinesAreDocuments) {
  const std::string path = TempPath("docs.jsonl");
  std::ofstream(path, std::ios::binary) << "{\"text\": \"ab\", \"id\": 1}\n\n{\"text\": \"\\u00e9\"}\n";
  ASSERT_EQ(ResolveDataFormat(path, DataFormat::kAuto), DataFormat::kJsonl);
  ByteTokenizer tok;
  auto c = TokenCorpus::Open(path, DataFormat::kAuto, &tok);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Tokens(**c), (std::vector<int64_t>{300, 'a', 'b', 301, 300, 0xC3, 0xA9, 301}));
  EXPECT_EQ((*c)->documents(), (std::vector<int64_t>{0, 4}));
  // Byte-level: each document's bytes and <|endoftext|>.
  c = TokenCorpus::Open(path);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(Tokens(**c), (std::vector<int64_t>{'a', 'b', kEndOfText, 0xC3, 0xA9, kEndOfText}));
  EXPECT_EQ((*c)->documents(), (std::vector<int64_t>{0, 3}));
  // Lines across the 1 MiB blocks the file is read in: whole, in order,
  // the last without its line break too.
  {
    const std::string long_text(1536 * 1024 + 7, 'x');
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << "{\"text\": \"" << long_text << "\"}\n{\"text\": \"yz\"}\n"
        << std::string(1 << 20, ' ').substr(12) << "\n{\"text\": \"end\"}";
    auto lines = TokenCorpus::Open(path);
    ASSERT_TRUE(lines.ok()) << lines.status();
    const int64_t first = static_cast<int64_t>(long_text.size()) + 1;
    EXPECT_EQ((*lines)->documents(), (std::vector<int64_t>{0, first, first + 3}));
    EXPECT_EQ((*lines)->size(), first + 3 + 4);
    EXPECT_EQ((*lines)->Window(first, 7)->ToInt64s(),
              (std::vector<int64_t>{'y', 'z', kEndOfText, 'e', 'n', 'd', kEndOfText}));
  }
  // Each bad line is named.
  for (const std::string bad : {"[1, 2]", "{\"text\": 5}", "{\"txt\": \"a\"}", "{broken", "{\"text\": \"!\"}"}) {
    std::ofstream(path, std::ios::binary) << "{\"text\": \"ok\"}\n" << bad << "\n";
    auto s = TokenCorpus::Open(path, DataFormat::kJsonl, &tok).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(path + ":2"), std::string::npos) << s;
  }
}

// A .bin cut short while a job trains on it (rewritten in place, or the
// storage failing) is an error of the read, naming the file; a map of it
// would have ended the worker with SIGBUS.
TEST(TokenCorpus, ABinCutShortWhileInUseIsAnErrorOfTheRead) {
  const std::string path = TempPath("cut-short.bin");
  {
    std::ofstream out(path, std::ios::binary);
    for (uint16_t t = 0; t < 4096; ++t) out.write(reinterpret_cast<const char*>(&t), 2);
  }
  auto c = TokenCorpus::Open(path, DataFormat::kU16);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<int64_t> got(8);
  ASSERT_TRUE((*c)->Read(4000, 8, got.data()).ok());
  EXPECT_EQ(got, (std::vector<int64_t>{4000, 4001, 4002, 4003, 4004, 4005, 4006, 4007}));
  ASSERT_EQ(::truncate(path.c_str(), 1024), 0) << std::strerror(errno);
  const absl::Status cut = (*c)->Read(4000, 8, got.data());
  EXPECT_EQ(cut.code(), absl::StatusCode::kDataLoss) << cut;
  EXPECT_NE(cut.message().find(path), std::string::npos) << cut;
  auto sampler = BatchSampler::Create((*c)->size(), 16, 4, 1, 7);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  Tensor inputs, labels;
  EXPECT_EQ(sampler->Batch(**c, 1, 0, &inputs, &labels).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE((*c)->Read(0, 8, got.data()).ok());  // what is left still reads
  EXPECT_EQ((*c)->Read(4090, 8, got.data()).code(), absl::StatusCode::kOutOfRange);
}

// A stop (a worker's abort or shutdown) ends the read of a text corpus
// between documents: the documents after it are not tokenized.
TEST(TokenCorpus, AStopEndsTheReadBetweenDocuments) {
  const std::string path = TempPath("many-docs.jsonl");
  {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 1000; ++i) out << "{\"text\": \"document " << i << "\"}\n";
  }
  ByteTokenizer tok;
  int polls = 0;
  const absl::Status s =
      TokenCorpus::Open(path, DataFormat::kJsonl, &tok, [&] { return ++polls > 10; }).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_NE(s.message().find(path + ":11"), std::string::npos) << s;  // where it stopped
  EXPECT_EQ(polls, 11);
  auto whole = TokenCorpus::Open(path, DataFormat::kJsonl, &tok, [] { return false; });
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*whole)->documents().size(), 1000u);
}

TEST(BatchSampler, SeededDisjointReplicasAndNextTokenLabels) {
  std::vector<int64_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(i);
  ASSERT_TRUE(WriteNpy(TempPath("count.npy"), *Tensor::FromInt64s({1000}, tokens)).ok());
  auto corpus = TokenCorpus::Open(TempPath("count.npy"));
  ASSERT_TRUE(corpus.ok());
  auto s = BatchSampler::Create(1000, 16, 8, 2, 42);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<int64_t> starts = s->Starts(3);
  EXPECT_EQ(starts, s->Starts(3));                              // a function of (seed, step)
  EXPECT_NE(starts, s->Starts(4));                              // another step, other windows
  EXPECT_NE(starts, BatchSampler::Create(1000, 16, 8, 2, 43)->Starts(3));  // another seed
  for (int64_t st : starts) EXPECT_LE(st + 17, 1000);
  // Replica d takes rows [4d, 4d + 4); labels are the inputs shifted by one.
  for (int replica = 0; replica < 2; ++replica) {
    Tensor in, out;
    ASSERT_TRUE(s->Batch(**corpus, 3, replica, &in, &out).ok());
    ASSERT_EQ(in.shape(), (Shape{4, 16}));
    const std::vector<int64_t> x = in.ToInt64s(), y = out.ToInt64s();
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(x[r * 16], starts[replica * 4 + r]);
      for (int j = 0; j < 16; ++j) EXPECT_EQ(y[r * 16 + j], x[r * 16 + j] + 1);
    }
  }
  // A range of a replica's rows (an accumulation pass): those rows alone.
  Tensor in, out, part, part_out;
  ASSERT_TRUE(s->Batch(**corpus, 3, 1, &in, &out).ok());
  ASSERT_TRUE(s->Batch(**corpus, 3, 1, &part, &part_out, 1, 2).ok());
  EXPECT_EQ(part.shape(), (Shape{2, 16}));
  EXPECT_EQ(part.ToInt64s(), in.Narrow(0, 1, 2)->Contiguous().ToInt64s());
  EXPECT_EQ(part_out.ToInt64s(), out.Narrow(0, 1, 2)->Contiguous().ToInt64s());
  for (const auto& [first, count] : std::vector<std::pair<int64_t, int64_t>>{{-1, 2}, {3, 2}, {0, 5}, {4, 1}}) {
    EXPECT_EQ(s->Batch(**corpus, 3, 1, &part, &part_out, first, count).code(), absl::StatusCode::kInvalidArgument)
        << first << " + " << count;
  }
  EXPECT_EQ(s->Batch(**corpus, 3, 2, &part, &part_out).code(), absl::StatusCode::kInvalidArgument);  // no replica 2
  EXPECT_EQ(s->Batch(**corpus, 3, -1, &part, &part_out).code(), absl::StatusCode::kInvalidArgument);
  // A pass's rows alone (a pass reads only them): the same as the whole
  // step's, seeded and sequential, and clamped to the batch.
  auto seq = BatchSampler::Create(1000, 16, 8, 2, 0, SampleRange{.begin = 500, .sequential = true});
  ASSERT_TRUE(seq.ok()) << seq.status();
  for (const BatchSampler* sampler : {&*s, &*seq}) {
    for (int64_t step : {0, 3, 1000}) {
      const std::vector<int64_t> whole = sampler->Starts(step);
      for (int64_t first = 0; first <= 8; ++first) {
        for (int64_t count = 0; first + count <= 8; ++count) {
          EXPECT_EQ(sampler->Starts(step, first, count),
                    std::vector<int64_t>(whole.begin() + first, whole.begin() + first + count))
              << "step " << step << " rows " << first << " + " << count;
        }
      }
      EXPECT_EQ(sampler->Starts(step, 6, 5), std::vector<int64_t>(whole.begin() + 6, whole.end()));
      EXPECT_TRUE(sampler->Starts(step, 9, 2).empty());
      EXPECT_TRUE(sampler->Starts(step, 2, -1).empty());
    }
  }
  EXPECT_EQ(BatchSampler::Create(1000, 16, 7, 2, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BatchSampler::Create(10, 16, 8, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// A masked language model's batch (BERT): the windows' own tokens (not
// shifted), about 15 % of the positions labelled with their token and the
// rest -100; of the labelled ones about 80 % read as [MASK], 10 % as
// another id, 10 % as themselves. The draws are a function of (seed, step,
// global row, position): a replica's or a pass's rows mask as in the whole
// batch, MaskedPositions counts the labels without reading the data, and
// another step or seed draws other positions.
TEST(BatchSampler, AMaskedLanguageModelsBatchMasksFifteenPercentOfPositions) {
  constexpr int64_t kVocab = 1000, kMask = 999, kSeq = 64;
  std::vector<int64_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(i % 997);  // never kMask
  ASSERT_TRUE(WriteNpy(TempPath("mlm.npy"), *Tensor::FromInt64s({20000}, tokens)).ok());
  auto corpus = TokenCorpus::Open(TempPath("mlm.npy"));
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const MaskedLm mlm{.mask_token_id = kMask, .vocab_size = kVocab};
  auto s = BatchSampler::Create(20000, kSeq, 64, 2, 42);
  ASSERT_TRUE(s.ok()) << s.status();
  int64_t labelled = 0, as_mask = 0, as_other = 0, as_itself = 0;
  std::vector<int64_t> whole_in, whole_out;
  for (int replica = 0; replica < 2; ++replica) {
    Tensor in, out;
    ASSERT_TRUE(s->Batch(**corpus, 5, replica, &in, &out, 0, -1, &mlm).ok());
    ASSERT_EQ(in.shape(), (Shape{32, kSeq}));
    ASSERT_EQ(out.shape(), (Shape{32, kSeq}));
    const std::vector<int64_t> x = in.ToInt64s(), y = out.ToInt64s();
    const std::vector<int64_t> starts = s->Starts(5, replica * 32, 32);
    for (int64_t r = 0; r < 32; ++r) {
      for (int64_t p = 0; p < kSeq; ++p) {
        const int64_t token = tokens[starts[r] + p], read = x[r * kSeq + p], label = y[r * kSeq + p];
        if (label == -100) {
          EXPECT_EQ(read, token) << "an unlabelled position reads its own token";
          continue;
        }
        EXPECT_EQ(label, token) << "a labelled position predicts its own token, not the next";
        ++labelled;
        if (read == kMask) {
          ++as_mask;
        } else if (read == token) {
          ++as_itself;
        } else {
          ++as_other;
          EXPECT_GE(read, 0);
          EXPECT_LT(read, kVocab);
        }
      }
    }
    whole_in.insert(whole_in.end(), x.begin(), x.end());
    whole_out.insert(whole_out.end(), y.begin(), y.end());
  }
  // 4096 positions: 15 % is 614, and 4 sigma (about 23 each way) bounds it.
  EXPECT_NEAR(static_cast<double>(labelled), 0.15 * 4096, 100) << labelled;
  EXPECT_EQ(s->MaskedPositions(5, 0, 64), labelled);
  EXPECT_NEAR(static_cast<double>(as_mask) / static_cast<double>(labelled), 0.8, 0.08);
  EXPECT_NEAR(static_cast<double>(as_other) / static_cast<double>(labelled), 0.1, 0.05);
  EXPECT_NEAR(static_cast<double>(as_itself) / static_cast<double>(labelled), 0.1, 0.05);
  // A pass's rows alone: as in the whole batch.
  Tensor part, part_out;
  ASSERT_TRUE(s->Batch(**corpus, 5, 1, &part, &part_out, 3, 4, &mlm).ok());
  EXPECT_EQ(part.ToInt64s(), std::vector<int64_t>(whole_in.begin() + 35 * kSeq, whole_in.begin() + 39 * kSeq));
  EXPECT_EQ(part_out.ToInt64s(), std::vector<int64_t>(whole_out.begin() + 35 * kSeq, whole_out.begin() + 39 * kSeq));
  int64_t in_part = 0;
  for (int64_t v : part_out.ToInt64s()) in_part += v != -100 ? 1 : 0;
  EXPECT_EQ(s->MaskedPositions(5, 35, 4), in_part);
  // The same rows split over 4 replicas: the same masks.
  auto four = BatchSampler::Create(20000, kSeq, 64, 4, 42);
  ASSERT_TRUE(four.ok());
  Tensor q_in, q_out;
  ASSERT_TRUE(four->Batch(**corpus, 5, 1, &q_in, &q_out, 0, -1, &mlm).ok());  // rows 16 .. 31
  EXPECT_EQ(q_out.ToInt64s(), std::vector<int64_t>(whole_out.begin() + 16 * kSeq, whole_out.begin() + 32 * kSeq));
  // Another step or seed: other positions.
  const auto masked_at = [&](const BatchSampler& sampler, int64_t step) {
    Tensor i, o;
    EXPECT_TRUE(sampler.Batch(**corpus, step, 0, &i, &o, 0, -1, &mlm).ok());
    std::vector<bool> at;
    for (int64_t v : o.ToInt64s()) at.push_back(v != -100);
    return at;
  };
  const std::vector<bool> here = masked_at(*s, 5);
  EXPECT_EQ(here, masked_at(*BatchSampler::Create(20000, kSeq, 64, 2, 42), 5));  // (seed, step) decide
  EXPECT_NE(here, masked_at(*s, 6));
  EXPECT_NE(here, masked_at(*BatchSampler::Create(20000, kSeq, 64, 2, 43), 5));
  // A [MASK] outside the vocabulary is refused.
  const MaskedLm outside{.mask_token_id = kVocab, .vocab_size = kVocab};
  EXPECT_EQ(s->Batch(**corpus, 5, 0, &part, &part_out, 0, -1, &outside).code(), absl::StatusCode::kInvalidArgument);
}

// The held-out split (eval_split): at the document boundary nearest to the
// fraction where the corpus has documents, at the token otherwise; refused
// when a side would be shorter than a window or the fraction is out of (0, 1).
TEST(HeldOut, TheTrailingDocumentsOrTokens) {
  Megatron m;  // documents of 40, 30, 20 and 10 tokens: boundaries at 40, 70, 90
  for (const int64_t len : {40, 30, 20, 10}) m.sequences.push_back(std::vector<int64_t>(len, 7));
  m.doc_bounds = {0, 1, 2, 3, 4};
  WriteMegatron(TempPath("held_docs"), m);
  auto docs = TokenCorpus::Open(TempPath("held_docs"), DataFormat::kMegatron);
  ASSERT_TRUE(docs.ok()) << docs.status();
  EXPECT_EQ(*HeldOutStart(**docs, 0.1, 5), 90);   // target 90
  EXPECT_EQ(*HeldOutStart(**docs, 0.25, 5), 70);  // target 75: 70 is nearer than 90
  EXPECT_EQ(*HeldOutStart(**docs, 0.5, 5), 40);   // target 50
  EXPECT_EQ(*HeldOutStart(**docs, 0.1, 20), 70);  // 90 would leave 10 tokens, under a window of 20
  EXPECT_EQ(HeldOutStart(**docs, 0.5, 61).status().code(), absl::StatusCode::kInvalidArgument);
  // One document (a .npy): the token.
  std::vector<int64_t> tokens(1000, 3);
  ASSERT_TRUE(WriteNpy(TempPath("held_flat.npy"), *Tensor::FromInt64s({1000}, tokens)).ok());
  auto flat = TokenCorpus::Open(TempPath("held_flat.npy"));
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(*HeldOutStart(**flat, 0.1, 17), 900);
  EXPECT_EQ(*HeldOutStart(**flat, 0.0123, 5), 988);
  EXPECT_EQ(HeldOutStart(**flat, 0.001, 17).status().code(), absl::StatusCode::kInvalidArgument);  // 1 token held out
  for (const double bad : {0.0, 1.0, -0.5, 1.5, std::nan("")}) {
    const absl::Status s = HeldOutStart(**flat, bad, 17).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("eval_split"), std::string::npos) << s;
  }
  // Examples: the trailing round(fraction x N), at least one, leaving one.
  EXPECT_EQ(*HeldOutStart(24, 0.25), 18);
  EXPECT_EQ(*HeldOutStart(24, 0.01), 23);
  EXPECT_EQ(HeldOutStart(1, 0.5).status().code(), absl::StatusCode::kInvalidArgument);
}

// A sampler over a range: training draws only windows wholly before the
// held-out start; an evaluation's reads the held-out windows in order, the
// same for every evaluation, wrapping at the end.
TEST(BatchSampler, RangesAndTheSequentialEvaluationOrder) {
  const SampleRange train{.begin = 0, .end = 900};
  auto s = BatchSampler::Create(1000, 16, 8, 2, 42, train);
  ASSERT_TRUE(s.ok()) << s.status();
  for (int64_t step = 0; step < 200; ++step) {
    for (const int64_t st : s->Starts(step)) {
      EXPECT_GE(st, 0);
      EXPECT_LE(st + 17, 900) << "step " << step;
    }
  }
  // The held-out 100 tokens: (100 - 1) / 16 = 6 windows at 900, 916, ..., 980.
  auto e = BatchSampler::Create(1000, 16, 4, 2, 0, SampleRange{.begin = 900, .sequential = true});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->windows(), 6);
  EXPECT_EQ(e->Starts(0), (std::vector<int64_t>{900, 916, 932, 948}));
  EXPECT_EQ(e->Starts(1), (std::vector<int64_t>{964, 980, 900, 916}));
  std::vector<int64_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(i);
  ASSERT_TRUE(WriteNpy(TempPath("range.npy"), *Tensor::FromInt64s({1000}, tokens)).ok());
  auto corpus = TokenCorpus::Open(TempPath("range.npy"));
  ASSERT_TRUE(corpus.ok());
  Tensor in, out;
  ASSERT_TRUE(e->Batch(**corpus, 1, 0, &in, &out).ok());  // replica 0: rows 0 and 1 of step 1
  EXPECT_EQ(in.ToInt64s()[0], 964);
  EXPECT_EQ(out.ToInt64s()[16 + 15], 996);  // the last window's last label: token 996 (980 + 16)
  // Examples: their indices in order.
  auto x = BatchSampler::ForExamples(24, 4, 1, 0, SampleRange{.begin = 18, .sequential = true});
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->Starts(1), (std::vector<int64_t>{22, 23, 18, 19}));
  // A range too short for a window, or outside the corpus.
  EXPECT_EQ(BatchSampler::Create(1000, 16, 8, 1, 1, SampleRange{.begin = 990}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BatchSampler::Create(1000, 16, 8, 1, 1, SampleRange{.begin = 0, .end = 1001}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BatchSampler::ForExamples(24, 4, 1, 0, SampleRange{.begin = 24}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod::train
