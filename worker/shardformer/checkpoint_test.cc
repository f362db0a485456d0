// Sharded checkpoints: saved at one layout, consolidated into a Hugging Face
// directory whose tensors are the model's, and loaded again at other layouts
// with the unsharded reference's logits, loss and gradients; damaged
// checkpoints are refused with what is wrong.
#include "worker/shardformer/checkpoint.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

ShardConfig Layout(int tp, int dp, v1::TensorParallelMode mode, bool sp = false) {
  ShardConfig s;
  s.layout.set_tensor_parallel_size(tp);
  s.layout.set_data_parallel_size(dp);
  s.layout.set_tensor_parallel_mode(mode);
  s.layout.set_sequence_parallel(sp);
  return s;
}

// Loads `dir` at `shard` and saves it to `checkpoint`, every rank.
void Save(const std::string& dir, const ShardConfig& shard, const std::string& checkpoint) {
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto model = ShardFormer(shard, &pg).Load(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    const absl::Status saved = SaveShardedCheckpoint(**model, checkpoint);
    ASSERT_TRUE(saved.ok()) << saved;
  });
}

// The consolidated directory holds exactly the original tensors.
void ExpectSameTensors(const std::string& dir, const testing::TinyModel& original) {
  auto files = ModelFiles::Open(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ((*files)->Names().size(), original.tensors.size());
  for (const auto& [name, t] : original.tensors) {
    auto got = (*files)->Read(name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(got->shape(), t.shape()) << name;
    EXPECT_EQ(got->ToFloats(), t.ToFloats()) << name;
  }
}

nlohmann::json Index(const std::string& checkpoint) {
  std::ifstream in(checkpoint + "/" + kCheckpointIndex);
  return nlohmann::json::parse(in);
}

TEST(Checkpoint, Gpt2SavedAt1dWithDpReloadsAtOtherLayouts) {
  auto model = testing::WriteTinyGpt2(TempPath("ck_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string checkpoint = TempPath("ck_gpt2_sharded"), out = TempPath("ck_gpt2_hf");
  Save(model->dir, Layout(2, 2, v1::TENSOR_PARALLEL_MODE_1D), checkpoint);
  // One file per rank; a replicated tensor once, a tp-split one in two blocks
  // (written by the dp = 0 ranks).
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::filesystem::exists(checkpoint + "/rank-0000" + std::to_string(r) + "-of-00004.safetensors"));
  }
  const nlohmann::json index = Index(checkpoint);
  EXPECT_EQ(index["world_size"], 4);
  const auto& wpe = index["tensors"]["transformer.wpe.weight"];
  EXPECT_EQ(wpe["blocks"].size(), 1u);
  EXPECT_EQ(wpe["dist_spec"], "{}");
  const auto& qkv = index["tensors"]["transformer.h.0.attn.c_attn.weight"];
  EXPECT_EQ(qkv["global_shape"], nlohmann::json::array({3, 64, 64}));
  EXPECT_EQ(qkv["dist_spec"], "{tp:S(1|2)}");
  ASSERT_EQ(qkv["blocks"].size(), 2u);
  EXPECT_EQ(qkv["blocks"][1]["file"], "rank-00001-of-00004.safetensors");
  EXPECT_EQ(qkv["blocks"][1]["starts"], nlohmann::json::array({0, 32, 0}));

  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, out).ok());
  ExpectSameTensors(out, *model);
  testing::TinyModel reloaded = *model;
  reloaded.dir = out;
  const Tensor ids = testing::TokenIds(4, 8, model->config.vocab_size, 2);
  auto ref = testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_1D), ids, 2e-4);
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D), ids, 2e-4);
}

TEST(Checkpoint, FusedAndTwoDimensionalLayoutsConsolidateExactly) {
  auto gpt2 = testing::WriteTinyGpt2(TempPath("ck2_gpt2"));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  Save(gpt2->dir, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D), TempPath("ck2_gpt2_sharded"));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck2_gpt2_sharded"), TempPath("ck2_gpt2_hf")).ok());
  ExpectSameTensors(TempPath("ck2_gpt2_hf"), *gpt2);

  auto llama = testing::WriteTinyLlama(TempPath("ck2_llama"));
  ASSERT_TRUE(llama.ok()) << llama.status();
  Save(llama->dir, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D), TempPath("ck2_llama_sharded"));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck2_llama_sharded"), TempPath("ck2_llama_hf")).ok());
  ExpectSameTensors(TempPath("ck2_llama_hf"), *llama);
  // BERT's decoder bias is padded and split like the vocabulary.
  auto bert = testing::WriteTinyBert(TempPath("ck2_bert"));
  ASSERT_TRUE(bert.ok()) << bert.status();
  Save(bert->dir, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_1D), TempPath("ck2_bert_sharded"));
  EXPECT_EQ(Index(TempPath("ck2_bert_sharded"))["tensors"]["cls.predictions.bias.bias"]["global_shape"],
            nlohmann::json::array({256}));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck2_bert_sharded"), TempPath("ck2_bert_hf")).ok());
  ExpectSameTensors(TempPath("ck2_bert_hf"), *bert);
  // ... and the 2D LLaMA checkpoint runs again as 1D with sequence parallelism.
  testing::TinyModel reloaded = *llama;
  reloaded.dir = TempPath("ck2_llama_hf");
  const Tensor ids = testing::TokenIds(2, 8, llama->config.vocab_size, 4);
  auto ref = testing::ReferenceLlama(*llama, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D, true), ids, 2e-4);
}

// 3D on 8 ranks: the weights' [q, out/q, in] blocks, the fused q|k|v parts
// and the untied LLaMA head consolidate to exactly the checkpoint's
// tensors, and the 3D checkpoint runs again at 1D.
TEST(Checkpoint, ThreeDimensionalLayoutsConsolidateExactly) {
  auto gpt2 = testing::WriteTinyGpt2(TempPath("ck3_gpt2"));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  Save(gpt2->dir, Layout(8, 1, v1::TENSOR_PARALLEL_MODE_3D), TempPath("ck3_gpt2_sharded"));
  const nlohmann::json index = Index(TempPath("ck3_gpt2_sharded"));
  const auto& qkv = index["tensors"]["transformer.h.0.attn.c_attn.weight[1]"];
  EXPECT_EQ(qkv["global_shape"], nlohmann::json::array({2, 32, 64})) << qkv;
  EXPECT_EQ(qkv["blocks"].size(), 8u) << "a 1/8 of the k projection on each rank";
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck3_gpt2_sharded"), TempPath("ck3_gpt2_hf")).ok());
  ExpectSameTensors(TempPath("ck3_gpt2_hf"), *gpt2);

  testing::TinyOptions untied;
  untied.tie = false;
  auto llama = testing::WriteTinyLlama(TempPath("ck3_llama"), untied);
  ASSERT_TRUE(llama.ok()) << llama.status();
  Save(llama->dir, Layout(8, 1, v1::TENSOR_PARALLEL_MODE_3D), TempPath("ck3_llama_sharded"));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck3_llama_sharded"), TempPath("ck3_llama_hf")).ok());
  ExpectSameTensors(TempPath("ck3_llama_hf"), *llama);
  testing::TinyModel reloaded = *llama;
  reloaded.dir = TempPath("ck3_llama_hf");
  const Tensor ids = testing::TokenIds(4, 8, llama->config.vocab_size, 6);
  auto ref = testing::ReferenceLlama(*llama, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), ids, 2e-4);
}

// Pipeline stages: each stage writes its own layers (the last stage's
// mirror of the tied table is left to the first), the index joins the
// stages', and it consolidates to exactly the checkpoint's tensors.
TEST(Checkpoint, PipelineStagesConsolidateExactly) {
  testing::TinyOptions o;
  o.layers = 4;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("ckpp_gpt2"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  ShardConfig layout = Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D);
  layout.layout.set_pipeline_parallel_size(2);
  layout.layout.add_pipeline_stage_layers(3);
  layout.layout.add_pipeline_stage_layers(1);
  Save(gpt2->dir, layout, TempPath("ckpp_gpt2_sharded"));
  const nlohmann::json index = Index(TempPath("ckpp_gpt2_sharded"));
  // wte: written once, by the first stage's two tp ranks (ranks 0 and 1).
  const auto& wte = index["tensors"]["transformer.wte.weight"];
  ASSERT_EQ(wte["blocks"].size(), 2u) << wte;
  EXPECT_EQ(wte["blocks"][1]["file"], "rank-00001-of-00004.safetensors");
  // Layer 3 is the second stage's (ranks 2 and 3).
  EXPECT_EQ(index["tensors"]["transformer.h.3.mlp.c_fc.weight"]["blocks"][0]["file"],
            "rank-00002-of-00004.safetensors");
  EXPECT_FALSE(std::filesystem::exists(TempPath("ckpp_gpt2_sharded") + "/index-stage-00001.json"));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ckpp_gpt2_sharded"), TempPath("ckpp_gpt2_hf")).ok());
  ExpectSameTensors(TempPath("ckpp_gpt2_hf"), *gpt2);

  o.layers = 3;
  o.tie = true;
  auto llama = testing::WriteTinyLlama(TempPath("ckpp_llama"), o);
  ASSERT_TRUE(llama.ok()) << llama.status();
  ShardConfig three = Layout(1, 2, v1::TENSOR_PARALLEL_MODE_1D);
  three.layout.set_pipeline_parallel_size(3);
  Save(llama->dir, three, TempPath("ckpp_llama_sharded"));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ckpp_llama_sharded"), TempPath("ckpp_llama_hf")).ok());
  ExpectSameTensors(TempPath("ckpp_llama_hf"), *llama);
}

// OPT (opt-350m's shape: post-norm, project_in/out, untied here) saved at
// 1D with sequence parallelism and at 2D, consolidated to exactly its
// tensors, and run again at the other layout.
TEST(Checkpoint, OptConsolidatesAndReloadsAtAnotherLayout) {
  testing::TinyOptions o;
  o.pre_norm = false;
  o.embed_dim = 32;
  o.tie = false;
  auto opt = testing::WriteTinyOpt(TempPath("ck_opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  const Tensor ids = testing::TokenIds(2, 8, opt->config.vocab_size, 6);
  auto ref = testing::ReferenceOpt(*opt, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const ShardConfig one_d = Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D, /*sp=*/true);
  const ShardConfig two_d = Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D);
  for (const auto& [saved, reload, name] :
       {std::make_tuple(one_d, two_d, "1d"), std::make_tuple(two_d, one_d, "2d")}) {
    const std::string checkpoint = TempPath(std::string("ck_opt_sharded_") + name);
    const std::string out = TempPath(std::string("ck_opt_hf_") + name);
    Save(opt->dir, saved, checkpoint);
    EXPECT_EQ(Index(checkpoint)["model_type"], "opt");
    ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, out).ok());
    ExpectSameTensors(out, *opt);
    testing::TinyModel reloaded = *opt;
    reloaded.dir = out;
    testing::ExpectShardedMatchesReference(reloaded, *ref, reload, ids, 2e-4);
  }
}

// BLOOM with 6 heads and an untied head, saved at tp = 2 with sequence
// parallelism, consolidated, and run again unsharded.
TEST(Checkpoint, BloomConsolidatesAndReloadsAtAnotherLayout) {
  testing::TinyOptions o;
  o.heads = 6;
  o.hidden = 48;
  o.tie = false;
  auto bloom = testing::WriteTinyBloom(TempPath("ck_bloom"), o);
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  Save(bloom->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D, /*sp=*/true), TempPath("ck_bloom_sharded"));
  EXPECT_EQ(Index(TempPath("ck_bloom_sharded"))["model_type"], "bloom");
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck_bloom_sharded"), TempPath("ck_bloom_hf")).ok());
  ExpectSameTensors(TempPath("ck_bloom_hf"), *bloom);
  testing::TinyModel reloaded = *bloom;
  reloaded.dir = TempPath("ck_bloom_hf");
  const Tensor ids = testing::TokenIds(2, 8, bloom->config.vocab_size, 8);
  auto ref = testing::ReferenceBloom(*bloom, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(1, 1, v1::TENSOR_PARALLEL_MODE_1D), ids, 2e-4);
}

// ViT's tensors of more than two dims (the Conv2d weight, cls_token,
// position_embeddings) through a tp = 2 checkpoint and consolidation.
TEST(Checkpoint, VitConsolidatesWithItsFourDimensionalWeights) {
  testing::TinyOptions o;
  auto vit = testing::WriteTinyVit(TempPath("ck_vit"), o);
  ASSERT_TRUE(vit.ok()) << vit.status();
  Save(vit->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), TempPath("ck_vit_sharded"));
  const nlohmann::json index = Index(TempPath("ck_vit_sharded"));
  EXPECT_EQ(index["tensors"]["vit.embeddings.patch_embeddings.projection.weight"]["global_shape"],
            nlohmann::json::array({64, 3, 4, 4}));
  EXPECT_EQ(index["tensors"]["vit.embeddings.cls_token"]["global_shape"], nlohmann::json::array({1, 1, 64}));
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck_vit_sharded"), TempPath("ck_vit_hf")).ok());
  ExpectSameTensors(TempPath("ck_vit_hf"), *vit);
}

// T5 (flan-t5's shape) saved at tp = 2, consolidated to exactly its tensors
// (the relative bias tables included), and run again unsharded.
TEST(Checkpoint, T5ConsolidatesAndReloadsUnsharded) {
  const testing::TinyOptions o = testing::TinyFlanT5();
  auto t5 = testing::WriteTinyT5(TempPath("ck_t5"), o);
  ASSERT_TRUE(t5.ok()) << t5.status();
  Save(t5->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), TempPath("ck_t5_sharded"));
  EXPECT_EQ(Index(TempPath("ck_t5_sharded"))["model_type"], "t5");
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck_t5_sharded"), TempPath("ck_t5_hf")).ok());
  ExpectSameTensors(TempPath("ck_t5_hf"), *t5);
  testing::TinyModel reloaded = *t5;
  reloaded.dir = TempPath("ck_t5_hf");
  const Tensor ids = testing::TokenIds(2, 6, t5->config.vocab_size, 3);
  const Tensor decoder = testing::TokenIds(2, 4, t5->config.vocab_size, 5);
  auto ref = testing::ReferenceT5(*t5, ids, decoder, testing::MaskedLabels(decoder));
  ASSERT_TRUE(ref.ok()) << ref.status();
  testing::ExpectShardedMatchesReference(reloaded, *ref, Layout(1, 1, v1::TENSOR_PARALLEL_MODE_1D), ids, 2e-4);
}

TEST(Checkpoint, SavesTheCurrentValuesNotTheSource) {
  auto model = testing::WriteTinyGpt2(TempPath("ck3_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  const ShardConfig shard = Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto sharded = ShardFormer(shard, &pg).Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    for (NamedParam& p : (*sharded)->Parameters()) {  // as an optimizer step would
      if (p.name != "transformer.ln_f.bias") continue;
      Tensor local = p.bound.param.local();
      for (int64_t i = 0; i < local.numel(); ++i) local.data<float>()[i] += 1.0f;
    }
    ASSERT_TRUE(SaveShardedCheckpoint(**sharded, TempPath("ck3_sharded")).ok());
  });
  ASSERT_TRUE(ConsolidateCheckpoint(TempPath("ck3_sharded"), TempPath("ck3_hf")).ok());
  auto files = ModelFiles::Open(TempPath("ck3_hf"));
  ASSERT_TRUE(files.ok());
  std::vector<float> want = model->tensors.at("transformer.ln_f.bias").ToFloats();
  for (float& v : want) v += 1.0f;
  EXPECT_EQ((*files)->Read("transformer.ln_f.bias")->ToFloats(), want);
  EXPECT_EQ((*files)->Read("transformer.ln_f.weight")->ToFloats(),
            model->tensors.at("transformer.ln_f.weight").ToFloats());
}

TEST(Checkpoint, DamagedCheckpointsAreRefusedNamingWhatIsWrong) {
  auto model = testing::WriteTinyGpt2(TempPath("ck4_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string checkpoint = TempPath("ck4_sharded");
  Save(model->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), checkpoint);
  EXPECT_EQ(ConsolidateCheckpoint(TempPath("ck4_nowhere"), TempPath("ck4_out")).code(), absl::StatusCode::kNotFound);
  // A rank file cut short (as by a crash while copying it).
  const std::string rank1 = checkpoint + "/rank-00001-of-00002.safetensors";
  std::filesystem::resize_file(rank1, std::filesystem::file_size(rank1) / 2);
  absl::Status s = ConsolidateCheckpoint(checkpoint, TempPath("ck4_out"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank-00001-of-00002"), std::string::npos) << s;
  // A missing rank file.
  std::filesystem::remove(rank1);
  s = ConsolidateCheckpoint(checkpoint, TempPath("ck4_out"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank-00001-of-00002"), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck4_out") + "/model.safetensors"));
}

// An index is input: one edited to read outside its directory, or to make
// consolidation allocate far more than the rank files hold, is refused
// before any such file is opened or anything allocated.
TEST(Checkpoint, AHostileIndexIsRefusedBeforeItIsActedOn) {
  auto model = testing::WriteTinyGpt2(TempPath("ck5_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string checkpoint = TempPath("ck5_sharded");
  Save(model->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), checkpoint);
  const nlohmann::json good = Index(checkpoint);
  const std::string name = good["tensors"].begin().key();
  auto consolidate_with = [&](const nlohmann::json& index) {
    std::ofstream(checkpoint + "/" + kCheckpointIndex) << index.dump();
    return ConsolidateCheckpoint(checkpoint, TempPath("ck5_out"));
  };
  // A block in a file outside the checkpoint.
  nlohmann::json bad = good;
  bad["tensors"][name]["blocks"][0]["file"] = "../ck5_gpt2/model.safetensors";
  absl::Status s = consolidate_with(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("must sit beside the index"), std::string::npos) << s;
  // A tensor said to be 2^30 x 2^20 elements whose blocks say so too: the
  // rank files' headers disagree, so nothing is allocated.
  bad = good;
  bad["tensors"][name]["global_shape"] = {int64_t{1} << 30, int64_t{1} << 20};
  bad["tensors"][name]["blocks"] = {
      {{"file", "rank-00000-of-00002.safetensors"}, {"starts", {0, 0}}, {"lengths", {int64_t{1} << 30, int64_t{1} << 20}}}};
  s = consolidate_with(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("the index says [1073741824, 1048576]"), std::string::npos) << s;
  // A checkpoint tensor far larger than the parameters that fill it.
  bad = good;
  bad["tensors"][name]["hf"]["shape"] = {int64_t{1} << 30, int64_t{1} << 20};
  s = consolidate_with(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("more than the"), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck5_out") + "/model.safetensors"));
  // A tensor twice the size of a rank's block, both its halves that one
  // block: the blocks tile the shape, but one file's bytes would back both
  // (65536 such blocks would make a 2 MB file a 256 GiB tensor).
  bad = good;
  std::string split;  // a tensor the two ranks hold halves of
  for (const auto& [n, t] : good["tensors"].items()) {
    if (t["blocks"].size() == 2) split = n;
  }
  ASSERT_FALSE(split.empty());
  nlohmann::json twice = bad["tensors"][split]["blocks"][0];
  twice["starts"] = std::vector<int64_t>(twice["lengths"].size(), 0);
  const int64_t rows = twice["lengths"][0].get<int64_t>();
  bad["tensors"][split]["global_shape"] = twice["lengths"];
  bad["tensors"][split]["global_shape"][0] = 2 * rows;
  bad["tensors"][split]["blocks"] = {twice, twice};
  bad["tensors"][split]["blocks"][1]["starts"][0] = rows;
  s = consolidate_with(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(absl::StrCat("two blocks of ", split, " name rank-00000-of-00002.safetensors")),
            std::string::npos)
      << s;
  // The index put back: it consolidates.
  EXPECT_TRUE(consolidate_with(good).ok());
  ExpectSameTensors(TempPath("ck5_out"), *model);
}

// Values written in place of the parameters' (PartValues: a bf16 model's
// f32 weights) are what the rank files hold and the index says. `of` runs
// for every parameter on every rank, collective over dp here; a part that
// one rank cannot take (not finite, on the rank that writes it) fails the
// save only after every value was made, so its dp peer, still making the
// next ones, is never left in a collective the failed rank skipped.
TEST(Checkpoint, PartValuesAreWrittenAndOneRanksBadPartLeavesNoPeerWaiting) {
  auto model = testing::WriteTinyGpt2(TempPath("ckv_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  ShardConfig shard = Layout(1, 2, v1::TENSOR_PARALLEL_MODE_1D);
  shard.param_dtype = DType::kBF16;
  for (const bool poison : {false, true}) {
    const std::string checkpoint = TempPath(poison ? "ckv_poisoned" : "ckv_sharded");
    std::vector<absl::Status> saved(2);
    std::vector<int> calls(2, 0);
    std::string poisoned;
    RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int rank, ProcessGroup& pg) {
      auto sharded = ShardFormer(shard, &pg).Load(model->dir);
      ASSERT_TRUE(sharded.ok()) << sharded.status();
      if (rank == 0) poisoned = (*sharded)->Parameters().front().name;  // rank 0 writes it (dp replicas)
      PartValues values;
      values.of = [&](const NamedParam& p, bool) -> absl::StatusOr<Tensor> {
        ++calls[rank];
        ASSIGN_OR_RETURN(Tensor ones, Tensor::FromFloats({4}, {1, 1, 1, 1}));
        ASSIGN_OR_RETURN(Communicator * dp, pg.Comm("dp"));
        RETURN_IF_ERROR(dp->AllReduce(ones.raw_data(), 4, DType::kF32, ReduceOp::kSum)->Wait(pg.timeout()));
        ASSIGN_OR_RETURN(Tensor f32, p.bound.param.local().ToDType(DType::kF32));
        ASSIGN_OR_RETURN(f32, f32.TryClone());
        if (poison && rank == 0 && p.name == poisoned) f32.data<float>()[0] = std::nanf("");
        return f32;
      };
      saved[rank] = SaveShardedCheckpoint(std::vector<ShardedModel*>{sharded->get()}, checkpoint, &values);
    });
    EXPECT_EQ(calls[0], calls[1]) << "every rank made every value";
    EXPECT_GT(calls[0], 1);
    if (poison) {
      EXPECT_EQ(saved[0].code(), absl::StatusCode::kFailedPrecondition) << saved[0];
      EXPECT_NE(saved[0].message().find(absl::StrCat("parameter ", poisoned)), std::string::npos) << saved[0];
      EXPECT_EQ(saved[1].code(), absl::StatusCode::kAborted) << saved[1];
      EXPECT_FALSE(std::filesystem::exists(checkpoint + "/" + kCheckpointIndex));
      continue;
    }
    ASSERT_TRUE(saved[0].ok() && saved[1].ok()) << saved[0] << " / " << saved[1];
    for (const auto& [name, t] : Index(checkpoint)["tensors"].items()) EXPECT_EQ(t["dtype"], "F32") << name;
    const std::string out = TempPath("ckv_hf");
    ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, out).ok());
    auto files = ModelFiles::Open(out);
    ASSERT_TRUE(files.ok()) << files.status();
    for (const auto& [name, t] : model->tensors) {
      auto got = (*files)->Read(name);
      ASSERT_TRUE(got.ok()) << name << ": " << got.status();
      EXPECT_EQ(got->dtype(), DType::kF32) << name;  // written as the values were
      EXPECT_EQ(got->ToFloats(), t.ToDType(DType::kBF16)->ToFloats()) << name;
    }
  }
}

// A bf16 run's parameters consolidate into a bf16 model: the same values
// (bf16 widens to F32 exactly) in half the bytes, loading at any layout; a
// checkpoint tensor whose parts were saved in two dtypes is written F32, and
// a model of F32 and bf16 tensors is loaded as F32.
TEST(Checkpoint, ABf16ModelConsolidatesInBf16) {
  auto model = testing::WriteTinyGpt2(TempPath("ckb_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  ShardConfig bf16 = Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D);
  bf16.param_dtype = DType::kBF16;
  const std::string checkpoint = TempPath("ckb_sharded"), out = TempPath("ckb_hf");
  Save(model->dir, bf16, checkpoint);
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, out).ok());
  auto files = ModelFiles::Open(out);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ((*files)->Names().size(), model->tensors.size());
  for (const auto& [name, t] : model->tensors) {
    auto got = (*files)->Read(name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(got->dtype(), DType::kBF16) << name;
    EXPECT_EQ(got->shape(), t.shape()) << name;
    EXPECT_EQ(got->ToFloats(), t.ToDType(DType::kBF16)->ToFloats()) << name;  // the values the run held
  }
  // config.json says so, its other keys as they were and in their order.
  const auto config_of = [](const std::string& dir) {
    std::ifstream in(dir + "/config.json");
    return nlohmann::ordered_json::parse(in);
  };
  nlohmann::ordered_json config = config_of(out), original = config_of(model->dir);
  EXPECT_EQ(config["torch_dtype"], "bfloat16");
  config.erase("torch_dtype");
  original.erase("torch_dtype");
  EXPECT_EQ(config.dump(), original.dump());
  // A config of newer transformers says "dtype", which they prefer: it says
  // so too.
  {
    nlohmann::ordered_json with_dtype = config_of(checkpoint);
    with_dtype["dtype"] = "float32";
    std::ofstream(checkpoint + "/config.json", std::ios::trunc) << with_dtype.dump();
  }
  const std::string newer = TempPath("ckb_newer_hf");
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, newer).ok());
  EXPECT_EQ(config_of(newer)["dtype"], "bfloat16");
  EXPECT_EQ(config_of(newer)["torch_dtype"], "bfloat16");
  // It loads (at another layout than it was saved at) as the bf16 model.
  ShardConfig two_d = Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D);
  RunMesh(*DeviceMesh::FromShardConfig(two_d.layout), [&](int, ProcessGroup& pg) {
    auto loaded = ShardFormer(two_d, &pg).Load(out);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ((*loaded)->unread_tensors(), std::vector<std::string>{});
  });
  // Asked for F32: the same values, widened, and config.json says float32.
  const std::string wide = TempPath("ckb_wide_hf");
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, wide, DType::kF32).ok());
  auto wide_files = ModelFiles::Open(wide);
  ASSERT_TRUE(wide_files.ok()) << wide_files.status();
  for (const auto& [name, t] : model->tensors) {
    auto got = (*wide_files)->Read(name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(got->dtype(), DType::kF32) << name;
    EXPECT_EQ(got->ToFloats(), t.ToDType(DType::kBF16)->ToFloats()) << name;
  }
  EXPECT_EQ(config_of(wide)["torch_dtype"], "float32");
  EXPECT_EQ(ConsolidateCheckpoint(checkpoint, TempPath("ckb_i64"), DType::kI64).code(),
            absl::StatusCode::kInvalidArgument);
  // An F32 consolidation of the same holds twice the bytes.
  const std::string f32 = TempPath("ckb_f32_sharded"), f32_out = TempPath("ckb_f32_hf");
  Save(model->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), f32);
  ASSERT_TRUE(ConsolidateCheckpoint(f32, f32_out).ok());
  const auto size = [](const std::string& dir) { return std::filesystem::file_size(dir + "/model.safetensors"); };
  EXPECT_LT(size(out), size(f32_out) * 6 / 10);
  // One tp half of a split tensor saved F32, the other bf16 (rank 1's file
  // from the bf16 save beside rank 0's from the F32 one): written F32.
  std::filesystem::copy_file(f32 + "/rank-00000-of-00002.safetensors", checkpoint + "/rank-00000-of-00002.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  {  // a config that says bf16: it would load the F32 tensors rounded
    nlohmann::ordered_json says_bf16 = config_of(checkpoint);
    says_bf16["torch_dtype"] = "bfloat16";
    says_bf16["dtype"] = "bfloat16";
    std::ofstream(checkpoint + "/config.json", std::ios::trunc) << says_bf16.dump();
  }
  const std::string mixed = TempPath("ckb_mixed_hf");
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, mixed).ok());
  auto mixed_files = ModelFiles::Open(mixed);
  ASSERT_TRUE(mixed_files.ok()) << mixed_files.status();
  const nlohmann::json index = Index(checkpoint);
  int split = 0;
  for (const auto& [name, t] : index["tensors"].items()) {
    if (t["blocks"].size() < 2) continue;  // wholly in one rank's file: one dtype
    ++split;
    auto got = (*mixed_files)->Read(t["hf"]["name"].get<std::string>());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->dtype(), DType::kF32) << name;
  }
  EXPECT_GT(split, 0);
  // Its tensors are in two dtypes: it loads as F32, which rounds none.
  EXPECT_EQ(config_of(mixed)["torch_dtype"], "float32");
  EXPECT_EQ(config_of(mixed)["dtype"], "float32");
}

// f16 holds up to 65504: a model with a larger weight is not written in f16
// (it would hold inf), and the write says which tensor; in f32 it is.
TEST(Checkpoint, AWeightPastF16sRangeFailsAnF16Write) {
  auto model = testing::WriteTinyGpt2(TempPath("ckh_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  std::map<std::string, Tensor> tensors = model->tensors;
  std::vector<float> bias = tensors.at("transformer.ln_f.bias").ToFloats();
  bias[3] = 1e5f;
  tensors["transformer.ln_f.bias"] = *Tensor::FromFloats({static_cast<int64_t>(bias.size())}, bias);
  ASSERT_TRUE(WriteSafetensors(model->dir + "/model.safetensors", {tensors.begin(), tensors.end()}).ok());
  const std::string checkpoint = TempPath("ckh_sharded");
  Save(model->dir, Layout(2, 1, v1::TENSOR_PARALLEL_MODE_1D), checkpoint);
  const absl::Status s = ConsolidateCheckpoint(checkpoint, TempPath("ckh_f16"), DType::kF16);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("transformer.ln_f.bias does not fit F16: element 3 is 100000"), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(TempPath("ckh_f16")));
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, TempPath("ckh_f32"), DType::kF32).ok());
  auto files = ModelFiles::Open(TempPath("ckh_f32"));
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_EQ((*files)->Read("transformer.ln_f.bias")->ToFloats()[3], 1e5f);
}

// Two fused parts (2D's c_attn, "weight[0]" and "weight[1]") placed over
// one range of their Hugging Face tensor, the elements still adding up:
// refused, not a third of the tensor left zero.
TEST(Checkpoint, PiecesThatOverlapInTheirHuggingFaceTensorAreRefused) {
  auto model = testing::WriteTinyGpt2(TempPath("ck6_gpt2"));
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string checkpoint = TempPath("ck6_sharded");
  Save(model->dir, Layout(4, 1, v1::TENSOR_PARALLEL_MODE_2D), checkpoint);
  const nlohmann::json good = Index(checkpoint);
  std::string first_part, second_part;
  for (const auto& [n, t] : good["tensors"].items()) {
    if (!first_part.empty() || t["hf"]["narrow_dim"].get<int64_t>() < 0) continue;
    for (const auto& [m, u] : good["tensors"].items()) {
      if (m != n && u["hf"]["name"] == t["hf"]["name"] && first_part.empty()) {
        first_part = n;
        second_part = m;
      }
    }
  }
  ASSERT_FALSE(first_part.empty()) << good.dump();
  nlohmann::json bad = good;
  bad["tensors"][second_part]["hf"]["narrow_start"] = good["tensors"][first_part]["hf"]["narrow_start"];
  std::ofstream(checkpoint + "/" + kCheckpointIndex) << bad.dump();
  const absl::Status s = ConsolidateCheckpoint(checkpoint, TempPath("ck6_out") + "/a/b/");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(" overlaps another's"), std::string::npos) << s;
  // Found while the model was being written: nothing is left, not even
  // the directories it made, and none that was there already (a path
  // through "..": its directories are those of the path made normal).
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck6_out"))) << "left behind";
  std::filesystem::create_directories(TempPath("ck6_there"));
  EXPECT_FALSE(ConsolidateCheckpoint(checkpoint, TempPath("ck6_gone") + "/../ck6_there/new").ok());
  EXPECT_TRUE(std::filesystem::exists(TempPath("ck6_there")));
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck6_there") + "/new"));
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck6_gone")));
  std::ofstream(checkpoint + "/" + kCheckpointIndex, std::ios::trunc) << good.dump();
  ASSERT_TRUE(ConsolidateCheckpoint(checkpoint, TempPath("ck6_out")).ok());
  ExpectSameTensors(TempPath("ck6_out"), *model);
}

}  // namespace
}  // namespace colod::shardformer
