#include "worker/shardformer/checkpoint_index.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/types.h"
#include "nlohmann/json.hpp"

namespace colod::shardformer {
namespace {

using Json = nlohmann::json;

// A two-rank index of one [8, 4] parameter split in two row blocks, bound
// to a transposed [4, 8] checkpoint tensor.
Json Good() {
  return Json::parse(R"({
    "format": "colod-sharded-checkpoint/1", "model_type": "gpt2", "world_size": 2,
    "tensors": {"h.0.mlp.c_fc.weight": {
      "global_shape": [8, 4], "dtype": "F32", "dist_spec": "tp:S(0)/2",
      "hf": {"name": "h.0.mlp.c_fc.weight", "shape": [4, 8], "transpose": true,
             "narrow_dim": -1, "narrow_start": 0, "valid_rows": -1},
      "blocks": [{"file": "rank-00000-of-00002.safetensors", "starts": [0, 0], "lengths": [4, 4]},
                 {"file": "rank-00001-of-00002.safetensors", "starts": [4, 0], "lengths": [4, 4]}]}}})");
}

Json& Tensor0(Json& j) { return j["tensors"]["h.0.mlp.c_fc.weight"]; }

void ExpectRefused(const Json& j, const std::string& says) {
  auto r = ParseCheckpointIndex(j.dump(), "dir/colod_checkpoint.json");
  ASSERT_FALSE(r.ok()) << j.dump();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("dir/colod_checkpoint.json: "), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status();
}

TEST(ParseCheckpointIndex, ReadsWhatSaveWrites) {
  auto r = ParseCheckpointIndex(Good().dump(), "x");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->world_size, 2);
  EXPECT_EQ(r->model_type, "gpt2");
  ASSERT_EQ(r->tensors.size(), 1u);
  const CheckpointTensor& t = r->tensors.at("h.0.mlp.c_fc.weight");
  EXPECT_EQ(t.global_shape, (Shape{8, 4}));
  EXPECT_EQ(t.dtype, "F32");
  EXPECT_EQ(t.hf.shape, (Shape{4, 8}));
  EXPECT_TRUE(t.hf.transpose);
  ASSERT_EQ(t.blocks.size(), 2u);
  EXPECT_EQ(t.blocks[1].file, "rank-00001-of-00002.safetensors");
  EXPECT_EQ(t.blocks[1].starts, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(t.blocks[1].lengths, (std::vector<int64_t>{4, 4}));
}

// The mesh the checkpoint was written at: its axes in order, which must
// make world_size ranks; an index from before the field has none.
TEST(ParseCheckpointIndex, TheMeshIsAxesThatMakeTheWorld) {
  Json j = Good();
  j["mesh"] = Json::parse(R"([{"name": "dp", "size": 1}, {"name": "tp", "size": 2}])");
  auto r = ParseCheckpointIndex(j.dump(), "x");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mesh, (std::vector<std::pair<std::string, int>>{{"dp", 1}, {"tp", 2}}));
  EXPECT_TRUE(ParseCheckpointIndex(Good().dump(), "x")->mesh.empty());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"([{"name": "tp", "size": 4}])", "has size 4, outside [1, 2]"},
      {R"([{"name": "tp", "size": 1}])", "the mesh's axes make 1 ranks, not world_size 2"},
      {R"([{"name": "tp", "size": 2}, {"name": "dp", "size": 2}])", "make more than 4 ranks"},
      {R"([{"name": "tp", "size": 0}])", "has size 0"},
      {R"([{"name": "", "size": 2}])", "is not a name"},
      {R"([{"name": 3, "size": 2}])", "a mesh axis.name is not a string"},
      {R"([{"name": "tp", "size": "2"}])", "a mesh axis.size is not an integer"},
      {R"([{"name": "tp", "size": 18446744073709551615}])", "a mesh axis.size is out of range"},
      {R"([["tp", 2]])", "a mesh axis has no name"},
      {R"({"tp": 2})", "mesh is not a list"},
  };
  for (const auto& [mesh, says] : bad) {
    j["mesh"] = Json::parse(mesh);
    ExpectRefused(j, says);
  }
  j["mesh"] = Json::array({{{"name", "tp"}, {"size", 2}}});
  for (int i = 0; i < kernels::kMaxDims; ++i) j["mesh"].push_back({{"name", "a" + std::to_string(i)}, {"size", 1}});
  ExpectRefused(j, "mesh is not a list of at most 16 axes");
}

TEST(ParseCheckpointIndex, FilesOutsideTheDirectoryAreRefused) {
  for (const char* file : {"../secret.safetensors", "/etc/passwd", "sub/rank.safetensors", "..", ".", ""}) {
    Json j = Good();
    Tensor0(j)["blocks"][0]["file"] = file;
    ExpectRefused(j, "block files must sit beside the index");
  }
}

TEST(ParseCheckpointIndex, SizesAreCheckedBeforeUse) {
  Json j = Good();
  // (2^62, 16): its bytes overflow int64 (the .npy crash of the issue).
  Tensor0(j)["global_shape"] = {int64_t{1} << 62, 16};
  ExpectRefused(j, "is too large");
  j = Good();
  Tensor0(j)["hf"]["shape"] = {int64_t{1} << 62, 16};
  ExpectRefused(j, "is too large");
  j = Good();
  Tensor0(j)["global_shape"] = {8, -4};
  ExpectRefused(j, "non-negative integer");
  j = Good();
  Tensor0(j)["global_shape"] = Json::array({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  ExpectRefused(j, "at most 16 integers");
  // A start near INT64_MAX: start + length overflows.
  j = Good();
  Tensor0(j)["blocks"][1]["starts"] = {INT64_MAX - 1, 0};
  ExpectRefused(j, "lies outside its shape");
  j = Good();
  Tensor0(j)["blocks"][1]["starts"] = {5, 0};
  ExpectRefused(j, "lies outside its shape");
  j = Good();
  Tensor0(j)["blocks"][1]["lengths"] = {4};
  ExpectRefused(j, "does not have its 2 dims");
}

TEST(ParseCheckpointIndex, BlocksHoldExactlyTheTensor) {
  Json j = Good();
  Tensor0(j)["blocks"].erase(1);
  ExpectRefused(j, "hold 16 of its 32 elements");
  j = Good();
  Tensor0(j)["blocks"].push_back(Tensor0(j)["blocks"][0]);
  ExpectRefused(j, "hold more than its 32 elements");
  j = Good();
  Tensor0(j)["blocks"] = Json::array();
  ExpectRefused(j, "is not a list of 1 to 65536 blocks");
  // Blocks whose sizes add up to the tensor's but overlap: rows 6 and 7
  // would be in no block, and consolidated as zeros.
  j = Good();
  Tensor0(j)["blocks"][1]["starts"] = {2, 0};
  ExpectRefused(j, "do not tile its shape [8, 4]: along dim 0 one starts at 2 where another runs to 4");
  // A gap, then a block past it.
  j = Good();
  Tensor0(j)["blocks"][0]["lengths"] = {2, 4};
  Tensor0(j)["blocks"].push_back(
      Json::parse(R"({"file": "rank-00001-of-00002.safetensors", "starts": [6, 0], "lengths": [2, 4]})"));
  ExpectRefused(j, "along dim 0 one starts at 4 where the ones before end at 2");
  // A 2 x 2 grid of [4, 2] blocks with one cell twice and another in none:
  // the dims are partitioned, the cells are not.
  j = Good();
  Tensor0(j)["blocks"] = Json::parse(R"([
    {"file": "rank-00000-of-00002.safetensors", "starts": [0, 0], "lengths": [4, 2]},
    {"file": "rank-00001-of-00002.safetensors", "starts": [0, 0], "lengths": [4, 2]},
    {"file": "rank-00000-of-00002.safetensors", "starts": [0, 2], "lengths": [4, 2]},
    {"file": "rank-00001-of-00002.safetensors", "starts": [4, 2], "lengths": [4, 2]}])");
  ExpectRefused(j, "two blocks of tensor h.0.mlp.c_fc.weight hold the same part of it");
  // The same grid whole is a tiling, in any order.
  Tensor0(j)["blocks"][1]["starts"] = {4, 0};
  std::swap(Tensor0(j)["blocks"][0], Tensor0(j)["blocks"][3]);
  auto grid = ParseCheckpointIndex(j.dump(), "x");
  EXPECT_TRUE(grid.ok()) << grid.status();
}

TEST(ParseCheckpointIndex, WrongTypesAndValuesAreErrorsNotExceptions) {
  ExpectRefused(Json::parse("[1, 2]"), "not a JSON object");
  Json j = Good();
  j["format"] = "something-else/1";
  ExpectRefused(j, "not a colod-sharded-checkpoint/1 index");
  j = Good();
  j["world_size"] = 0;
  ExpectRefused(j, "world_size 0 is outside [1, 65536]");
  j = Good();
  j["world_size"] = "2";
  ExpectRefused(j, "world_size is not an integer");
  j = Good();
  Tensor0(j)["hf"]["transpose"] = 1;
  ExpectRefused(j, "transpose is not a boolean");
  j = Good();
  Tensor0(j)["hf"]["narrow_dim"] = 2;
  ExpectRefused(j, "does not fit the shape [4, 8]");
  j = Good();
  Tensor0(j)["global_shape"] = "8,4";
  ExpectRefused(j, "global_shape is not a list");
  j = Good();
  Tensor0(j).erase("blocks");
  ExpectRefused(j, "has no blocks");
  j = Good();
  j["tensors"] = Json::array();
  ExpectRefused(j, "tensors is not an object");
  EXPECT_FALSE(ParseCheckpointIndex("{\"format\": \"colod-sharded", "x").ok());
}

// A tensor name colod never writes (a control byte, a terminal's escape,
// a stray byte, none, or one past 1024 bytes) is a damaged index: refused,
// the name escaped in the error.
TEST(ParseCheckpointIndex, NamesColodNeverWritesAreRefusedEscaped) {
  for (const std::string& name :
       {std::string("h.0\x1b[2J"), std::string("w\xff"), std::string("a\nb"), std::string(), std::string(1025, 'w')}) {
    Json j = Good();
    Json t = Tensor0(j);
    j["tensors"] = Json::object();
    j["tensors"][name] = t;
    auto r = ParseCheckpointIndex(j.dump(-1, ' ', false, Json::error_handler_t::replace), "x");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("is not a tensor name colod writes"), std::string::npos) << r.status();
    for (char c : r.status().message()) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << r.status();
    j = Good();
    Tensor0(j)["hf"]["name"] = name;
    r = ParseCheckpointIndex(j.dump(-1, ' ', false, Json::error_handler_t::replace), "x");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(".hf.name: "), std::string::npos) << r.status();
    for (char c : r.status().message()) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << r.status();
  }
}

TEST(ParseWeightMap, NamesFilesBesideTheIndexOnly) {
  auto ok = ParseWeightMap(R"({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})", "i");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->at("b"), "model-2.safetensors");
  for (const char* bad : {R"({"weight_map": {"a": "../x.safetensors"}})", R"({"weight_map": {"a": ".."}})",
                          R"({"weight_map": {"a": 3}})", R"({"weight_map": []})", R"([])", "not json"}) {
    auto r = ParseWeightMap(bad, "dir/model.safetensors.index.json");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("dir/model.safetensors.index.json: "), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace colod::shardformer
