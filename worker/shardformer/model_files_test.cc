// Model directories (one file, or an index with shards) and per-rank shard
// reads checked against slicing the full tensors.
#include "worker/shardformer/model_files.h"

#include <sys/stat.h>

#include <fstream>

#include "gtest/gtest.h"
#include "tests/testing/raw_safetensors.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

std::string Dir(const std::string& name) {
  const std::string d = TempPath(name);
  ::mkdir(d.c_str(), 0755);
  return d;
}

TEST(ModelFiles, ShardedDirectoryThroughItsIndex) {
  const std::string dir = Dir("sharded");
  const Tensor a = *Tensor::RandomNormal({8, 6}, 1), b = *Tensor::RandomNormal({6}, 2), c = *Tensor::RandomNormal({4, 2}, 3);
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", {{"a", a}, {"b", b}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", {{"c", c}}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{"total_size":264},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
      << R"("b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})";
  auto m = ModelFiles::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->Names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ((*m)->Read("c")->ToFloats(), c.ToFloats());
  EXPECT_EQ((*m)->Read("zz").status().code(), absl::StatusCode::kNotFound);
  // Each rank of tp=2 x dp=2 reads its block of `a`: rows over tp, columns over dp.
  ::colod::testing::RunMesh(::colod::testing::TpDpMesh(2, 2), [&](int rank, ProcessGroup& pg) {
    DistSpec spec = DistSpec().Set("tp", Placement::Shard({0}, {2})).Set("dp", Placement::Shard({1}, {2}));
    auto shard = (*m)->ReadShard("a", spec, &pg);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->global_shape(), (Shape{8, 6}));
    EXPECT_EQ(shard->local().ToFloats(), a.Narrow(0, 4 * (rank % 2), 4)->Narrow(1, 3 * (rank / 2), 3)->ToFloats());
    EXPECT_TRUE(shard->variable().requires_grad());
    auto odd = (*m)->ReadShard("b", DistSpec().Set("tp", Placement::Shard({0}, {4})), &pg);
    EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  });
}

TEST(ModelFiles, SingleFileMissingDirectoryAndBrokenIndex) {
  const std::string one = Dir("single");
  const Tensor w = *Tensor::RandomNormal({3, 3}, 4);
  ASSERT_TRUE(WriteSafetensors(one + "/model.safetensors", {{"w", w}}).ok());
  auto m = ModelFiles::Open(one);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->Read("w")->ToFloats(), w.ToFloats());
  EXPECT_EQ(ModelFiles::Open(Dir("empty")).status().code(), absl::StatusCode::kNotFound);
  const std::string broken = Dir("broken");
  ASSERT_TRUE(WriteSafetensors(broken + "/part.safetensors", {{"w", w}}).ok());
  std::ofstream(broken + "/model.safetensors.index.json") << R"({"weight_map":{"v":"part.safetensors"}})";
  auto bad = ModelFiles::Open(broken);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("has no tensor v"), absl::string_view::npos) << bad.status();
}

// A tensor of a dtype colod does not read (a bool mask buffer) is part of
// the directory, in one file or through an index: the others read, it is
// unread until asked for, and asking for it names its dtype.
TEST(ModelFiles, TensorsOfDTypesColodDoesNotReadAreUnreadNotFatal) {
  const std::string header =
      R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"m":{"dtype":"BOOL","shape":[4],"data_offsets":[4,8]}})";
  const std::string bytes = ::colod::testing::RawSafetensors(header, std::string("\0\0\x80\x3f\1\0\1\1", 8));
  const std::string single = Dir("unread_single"), indexed = Dir("unread_index");
  std::ofstream(single + "/model.safetensors", std::ios::binary) << bytes;
  std::ofstream(indexed + "/part.safetensors", std::ios::binary) << bytes;
  std::ofstream(indexed + "/model.safetensors.index.json")
      << R"({"weight_map":{"w":"part.safetensors","m":"part.safetensors"}})";
  for (const std::string& dir : {single, indexed}) {
    auto m = ModelFiles::Open(dir);
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status();
    EXPECT_EQ((*m)->Names(), (std::vector<std::string>{"m", "w"})) << dir;
    EXPECT_TRUE((*m)->Has("m"));
    EXPECT_EQ((*m)->Read("w")->ToFloats(), std::vector<float>{1.0f}) << dir;
    EXPECT_EQ((*m)->Unread(), std::vector<std::string>{"m"}) << dir;
    const absl::Status s = (*m)->Read("m").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("tensor m is BOOL, a dtype colod does not read"), absl::string_view::npos) << s;
  }
}

// A FIFO where a weights file or the index should be is refused at once: it
// blocked the rank in open() (no writer), where no abort reaches it, and the
// worker stayed busy with the job until it was restarted.
TEST(ModelFiles, AFifoInPlaceOfAFileIsRefusedNotWaitedOn) {
  const std::string single = Dir("fifo_single");
  ASSERT_EQ(::mkfifo((single + "/model.safetensors").c_str(), 0600), 0);
  auto m = ModelFiles::Open(single);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("not a regular file"), absl::string_view::npos) << m.status();

  const std::string index = Dir("fifo_index");
  ASSERT_EQ(::mkfifo((index + "/model.safetensors.index.json").c_str(), 0600), 0);
  m = ModelFiles::Open(index);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("model.safetensors.index.json is not a regular file"), absl::string_view::npos)
      << m.status();

  const std::string shard = Dir("fifo_shard");
  ASSERT_EQ(::mkfifo((shard + "/part.safetensors").c_str(), 0600), 0);
  std::ofstream(shard + "/model.safetensors.index.json") << R"({"weight_map":{"w":"part.safetensors"}})";
  m = ModelFiles::Open(shard);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(m.status().message().find("part.safetensors is a FIFO, not a regular file"),
            absl::string_view::npos)
      << m.status();
}

}  // namespace
}  // namespace colod::shardformer
