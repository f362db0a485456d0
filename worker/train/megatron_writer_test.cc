// MegatronWriter: what it writes reads back through TokenCorpus's Megatron
// reader (itself checked against hand-built files in data_test.cc) with the
// documents kept, the token width follows the vocabulary, bad ids are
// refused, and a full disk, wherever it strikes, leaves the earlier dataset
// as it was and no temporary file behind.
#include "worker/train/megatron_writer.h"

#include <filesystem>
#include <fstream>

#include "common/little_endian.h"
#include "gtest/gtest.h"
#include "tests/testing/full_disk.h"
#include "tests/testing/temp_dir.h"
#include "worker/train/data.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

absl::Status Write(const std::string& prefix, int64_t vocab, const std::vector<std::vector<int64_t>>& docs) {
  auto w = MegatronWriter::Create(prefix, vocab);
  if (!w.ok()) return w.status();
  for (const auto& d : docs) {
    if (absl::Status s = (*w)->AddDocument(d); !s.ok()) return s;
  }
  return (*w)->Finish();
}

std::vector<int64_t> Tokens(const std::string& prefix) {
  auto c = TokenCorpus::Open(prefix, DataFormat::kMegatron);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return {};
  return (*c)->Window(0, (*c)->size())->ToInt64s();
}

// Files in `dir` other than the ones named.
std::vector<std::string> Others(const std::string& dir, const std::vector<std::string>& known) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (std::find(known.begin(), known.end(), name) == known.end()) out.push_back(name);
  }
  return out;
}

TEST(MegatronWriter, WritesWhatTheReaderReadsWithItsDocuments) {
  const std::string prefix = TempPath("mw_docs");
  ASSERT_TRUE(Write(prefix, 100, {{1, 2, 3}, {}, {99}, {4, 5}}).ok());
  auto c = TokenCorpus::Open(prefix, DataFormat::kMegatron);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->Window(0, 6)->ToInt64s(), (std::vector<int64_t>{1, 2, 3, 99, 4, 5}));
  // The empty document is in the index (five boundaries over four
  // sequences); the reader keeps its start once (it adds no cut).
  {
    std::ifstream idx(prefix + ".idx", std::ios::binary);
    unsigned char count[8];
    idx.seekg(26);
    idx.read(reinterpret_cast<char*>(count), 8);
    EXPECT_EQ(LoadLittleEndian(count, 8), 5u);
  }
  EXPECT_EQ((*c)->documents(), (std::vector<int64_t>{0, 3, 4}));
  // uint16 below 65500 ids, int32 from there (Megatron's best_fitting_dtype).
  ASSERT_TRUE(Write(TempPath("mw_narrow"), 65499, {{65498, 0}}).ok());
  ASSERT_TRUE(Write(TempPath("mw_wide"), 65500, {{65499, 0}}).ok());
  EXPECT_EQ(std::filesystem::file_size(TempPath("mw_narrow.bin")), 4u);
  EXPECT_EQ(std::filesystem::file_size(TempPath("mw_wide.bin")), 8u);
  EXPECT_EQ(Tokens(TempPath("mw_wide")), (std::vector<int64_t>{65499, 0}));
}

TEST(MegatronWriter, RefusesIdsOutsideTheVocabularyAndLeavesNothing) {
  const std::string dir = TempPath("mw_refuse");
  std::filesystem::create_directories(dir);
  EXPECT_EQ(Write(dir + "/d", 10, {{1, 10}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Write(dir + "/d", 10, {{-1}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Write(dir + "/d", 0, {{0}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Others(dir, {}), std::vector<std::string>{});
}

// A full disk during the tokens, and during the index alone (a file size
// limit above the .bin's size and below the .idx's): either way the earlier
// dataset under the same prefix reads as before, and nothing else is left.
TEST(MegatronWriter, AFullDiskLeavesTheEarlierDatasetAndNoTemporaryFile) {
  const std::string dir = TempPath("mw_full");
  std::filesystem::create_directories(dir);
  const std::string prefix = dir + "/corpus";
  ASSERT_TRUE(Write(prefix, 50, {{7, 8, 9}}).ok());
  // 2 MiB of tokens: the 1 MiB buffer flushes into a 64 KiB limit.
  const std::vector<int64_t> big(1 << 20, 3);
  // 200 one-token documents: a 400-byte .bin, an index of over 4 KiB.
  const std::vector<std::vector<int64_t>> many(200, std::vector<int64_t>{4});
  for (const auto& [limit, docs] : std::vector<std::pair<int64_t, std::vector<std::vector<int64_t>>>>{
           {64 << 10, {big}}, {1000, many}}) {
    absl::Status s;
    {
      ::colod::testing::FullDisk full(limit);
      s = Write(prefix, 50, docs);
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << limit << ": " << s;
    EXPECT_EQ(Tokens(prefix), (std::vector<int64_t>{7, 8, 9})) << limit;
    EXPECT_EQ(Others(dir, {"corpus.bin", "corpus.idx"}), std::vector<std::string>{}) << limit;
  }
  // With room again, the new dataset replaces the old.
  ASSERT_TRUE(Write(prefix, 50, many).ok());
  EXPECT_EQ(Tokens(prefix), std::vector<int64_t>(200, 4));
}

}  // namespace
}  // namespace colod::train
