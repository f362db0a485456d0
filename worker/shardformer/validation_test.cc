// Every validation error of ShardFormer::Load, as a user meets it: the
// layout against the config, the model type, and the checkpoint's tensors.
// Each is found before any rank communicates (2D layers excepted), so one
// rank's view suffices.
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/raw_safetensors.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

// Loads `dir` as rank 0 of `shard`'s mesh; any collective would fail.
absl::Status LoadAsRank0(const std::string& dir, const ShardConfig& shard) {
  auto mesh = DeviceMesh::FromShardConfig(shard.layout);
  if (!mesh.ok()) return mesh.status();
  auto pg = ProcessGroup::Create(*mesh, 0, [](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    return absl::InternalError("validation must not communicate");
  });
  if (!pg.ok()) return pg.status();
  return ShardFormer(shard, pg->get()).Load(dir).status();
}

ShardConfig Layout(int tp, v1::TensorParallelMode mode, bool sequence_parallel = false) {
  ShardConfig s;
  s.layout.set_tensor_parallel_size(tp);
  s.layout.set_data_parallel_size(1);
  s.layout.set_tensor_parallel_mode(mode);
  s.layout.set_sequence_parallel(sequence_parallel);
  return s;
}

void ExpectInvalid(const absl::Status& s, const std::string& names) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(names), std::string::npos) << "'" << names << "' not in: " << s;
}

// Rewrites `dir`'s checkpoint with `edit` applied to its tensors.
void EditTensors(const testing::TinyModel& m, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  std::map<std::string, Tensor> tensors = m.tensors;
  edit(tensors);
  std::vector<std::pair<std::string, Tensor>> list(tensors.begin(), tensors.end());
  ASSERT_TRUE(WriteSafetensors(m.dir + "/model.safetensors", list).ok());
}

TEST(Validation, LayoutsTheModelCannotTake) {
  auto gpt2 = testing::WriteTinyGpt2(TempPath("v_gpt2"));  // 4 heads, hidden 64
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  ExpectInvalid(LoadAsRank0(gpt2->dir, Layout(3, v1::TENSOR_PARALLEL_MODE_1D)), "4 attention heads");
  ExpectInvalid(LoadAsRank0(gpt2->dir, Layout(9, v1::TENSOR_PARALLEL_MODE_2D)), "hidden_size 64");
  ExpectInvalid(LoadAsRank0(gpt2->dir, Layout(8, v1::TENSOR_PARALLEL_MODE_3D, /*sp=*/true)), "1d only");
  testing::TinyOptions narrow;
  narrow.hidden = 70;  // q = 2 divides it and its 2 heads, but a 3D weight splits outputs q*q = 4 ways
  narrow.heads = 2;
  auto gpt2_70 = testing::WriteTinyGpt2(TempPath("v_gpt2_70"), narrow);
  ASSERT_TRUE(gpt2_70.ok()) << gpt2_70.status();
  ExpectInvalid(LoadAsRank0(gpt2_70->dir, Layout(8, v1::TENSOR_PARALLEL_MODE_3D)), "q*q = 4 ways");
  testing::TinyOptions o;
  o.hidden = 48;  // 6 query heads of 8, 3 key/value heads: tp = 2 (and q = 2) divide the former only
  o.heads = 6;
  o.kv_heads = 3;
  auto llama = testing::WriteTinyLlama(TempPath("v_llama"), o);
  ASSERT_TRUE(llama.ok()) << llama.status();
  ExpectInvalid(LoadAsRank0(llama->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D)), "3 key/value heads");
  ExpectInvalid(LoadAsRank0(llama->dir, Layout(4, v1::TENSOR_PARALLEL_MODE_2D)), "3 key/value heads");
  ExpectInvalid(LoadAsRank0(llama->dir, Layout(8, v1::TENSOR_PARALLEL_MODE_3D)), "3 key/value heads");
}

TEST(Validation, OptsLayoutsAndTensors) {
  testing::TinyOptions o;
  o.embed_dim = 40;  // project_in/out; q = 2 divides it, 3 does not divide 64
  o.tie = true;
  auto opt = testing::WriteTinyOpt(TempPath("v_opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  EditTensors(*opt, [](auto& t) { t.erase("model.decoder.project_in.weight"); });
  ExpectInvalid(LoadAsRank0(opt->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D)), "model.decoder.project_in.weight");
  // A table without OPT's two extra rows.
  EditTensors(*opt, [](auto& t) { t["model.decoder.embed_positions.weight"] = *Tensor::Zeros({16, 64}, DType::kF32); });
  const absl::Status s = LoadAsRank0(opt->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D));
  ExpectInvalid(s, "model.decoder.embed_positions.weight");
  ExpectInvalid(s, "[18, 64]");
  o.embed_dim = 33;  // 2D's q = 2 does not divide it
  auto odd = testing::WriteTinyOpt(TempPath("v_opt_odd"), o);
  ASSERT_TRUE(odd.ok()) << odd.status();
  ExpectInvalid(LoadAsRank0(odd->dir, Layout(4, v1::TENSOR_PARALLEL_MODE_2D)), "word_embed_proj_dim 33");
}

TEST(Validation, BloomsLayoutsAndTensors) {
  testing::TinyOptions o;
  o.heads = 6;  // hidden 48: tp = 4 does not divide the heads
  o.hidden = 48;
  o.tie = true;
  auto bloom = testing::WriteTinyBloom(TempPath("v_bloom"), o);
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  ExpectInvalid(LoadAsRank0(bloom->dir, Layout(4, v1::TENSOR_PARALLEL_MODE_1D)), "6 attention heads");
  // 2D at tp = 16: q = 4 does not divide the heads (ALiBi's slopes go with whole heads).
  ExpectInvalid(LoadAsRank0(bloom->dir, Layout(16, v1::TENSOR_PARALLEL_MODE_2D)), "the 6 heads");
  // q | k | v laid out as GPT-2's [3, heads * head_dim] would be the same size: only a wrong shape is caught.
  EditTensors(*bloom, [](auto& t) { t["transformer.h.1.self_attention.query_key_value.weight"] =
                                        *Tensor::Zeros({48, 48}, DType::kF32); });
  const absl::Status s = LoadAsRank0(bloom->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D));
  ExpectInvalid(s, "transformer.h.1.self_attention.query_key_value.weight");
  ExpectInvalid(s, "[144, 48]");
}

TEST(Validation, AnUnknownModelType) {
  auto gpt2 = testing::WriteTinyGpt2(TempPath("v_mamba"));
  ASSERT_TRUE(gpt2.ok());
  std::ofstream(gpt2->dir + "/config.json") << R"({"model_type": "mamba", "vocab_size": 50, "d_model": 64})";
  const absl::Status s = LoadAsRank0(gpt2->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D));
  ExpectInvalid(s, "'mamba'");
  ExpectInvalid(s, "model_type");
  ExpectInvalid(s, "known: bert, bloom, gpt2, llama, opt, t5, vit");
}

TEST(Validation, MissingAndMisshapedTensorsAreNamed) {
  for (int tp : {1, 2}) {
    auto gpt2 = testing::WriteTinyGpt2(TempPath("v_missing_" + std::to_string(tp)));
    ASSERT_TRUE(gpt2.ok());
    EditTensors(*gpt2, [](auto& t) { t.erase("transformer.h.1.mlp.c_fc.bias"); });
    ExpectInvalid(LoadAsRank0(gpt2->dir, Layout(tp, v1::TENSOR_PARALLEL_MODE_1D)), "transformer.h.1.mlp.c_fc.bias");
    EditTensors(*gpt2, [](auto& t) { t["transformer.h.0.attn.c_attn.weight"] = *Tensor::Zeros({64, 64}, DType::kF32); });
    const absl::Status s = LoadAsRank0(gpt2->dir, Layout(tp, v1::TENSOR_PARALLEL_MODE_1D));
    ExpectInvalid(s, "transformer.h.0.attn.c_attn.weight");
    ExpectInvalid(s, "[64, 192]");  // what config.json implies
  }
  auto llama = testing::WriteTinyLlama(TempPath("v_llama_head"));
  ASSERT_TRUE(llama.ok());
  EditTensors(*llama, [](auto& t) { t.erase("lm_head.weight"); });  // untied: the head is required
  ExpectInvalid(LoadAsRank0(llama->dir, Layout(2, v1::TENSOR_PARALLEL_MODE_1D)), "lm_head.weight");
  // 2D layers build their communicators while loading: every rank runs.
  const ShardConfig two_d = Layout(4, v1::TENSOR_PARALLEL_MODE_2D);
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(two_d.layout), [&](int, ProcessGroup& pg) {
    ExpectInvalid(ShardFormer(two_d, &pg).Load(llama->dir).status(), "lm_head.weight");
  });
}

// What of the files no parameter took, as ShardFormer::Load leaves it on the
// model (rank 0 of `shard`'s mesh, tp = 1 here: no collective).
std::vector<std::string> UnreadAsRank0(const std::string& dir) {
  const ShardConfig shard = Layout(1, v1::TENSOR_PARALLEL_MODE_1D);
  auto pg = ProcessGroup::Create(*DeviceMesh::FromShardConfig(shard.layout), 0,
                                 [](const ProcessGroup::GroupInfo&) -> absl::StatusOr<std::unique_ptr<Communicator>> {
                                   return absl::InternalError("validation must not communicate");
                                 });
  EXPECT_TRUE(pg.ok()) << pg.status();
  if (!pg.ok()) return {"(no process group)"};
  auto model = ShardFormer(shard, pg->get()).Load(dir);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {"(not loaded)"};
  return (*model)->unread_tensors();
}

// Every family's checkpoint is read whole, tied or not, with the buffers
// Hugging Face files carry beside the parameters (which no model reads);
// a config.json of fewer layers than the weights, or a tensor of another
// model, leaves tensors unread, and the model names them.
TEST(Validation, TensorsNoParameterTookAreNamed) {
  testing::TinyOptions tied;
  tied.tie = true;
  const std::vector<std::pair<std::string, absl::StatusOr<testing::TinyModel>>> families = {
      {"gpt2", testing::WriteTinyGpt2(TempPath("u_gpt2"))},
      {"gpt2 bare", testing::WriteTinyGpt2(TempPath("u_gpt2_bare"), {.prefixed = false})},
      {"llama", testing::WriteTinyLlama(TempPath("u_llama"))},
      {"llama tied", testing::WriteTinyLlama(TempPath("u_llama_tied"), tied)},
      {"bert", testing::WriteTinyBert(TempPath("u_bert"))},
      {"opt", testing::WriteTinyOpt(TempPath("u_opt"), tied)},
      {"bloom", testing::WriteTinyBloom(TempPath("u_bloom"))},
      {"t5", testing::WriteTinyT5(TempPath("u_t5"), tied)},
      {"flan-t5", testing::WriteTinyT5(TempPath("u_flan"), testing::TinyFlanT5())},
      {"vit", testing::WriteTinyVit(TempPath("u_vit"))},
  };
  for (const auto& [name, m] : families) {
    ASSERT_TRUE(m.ok()) << name << ": " << m.status();
    EXPECT_EQ(UnreadAsRank0(m->dir), std::vector<std::string>{}) << name;
  }
  // GPT-2's hub files carry each block's causal mask (attn.bias,
  // attn.masked_bias); a tied head's copy may be there too.
  const testing::TinyModel& gpt2 = *families[0].second;
  EditTensors(gpt2, [](auto& t) {
    t["transformer.h.0.attn.bias"] = *Tensor::Zeros({1, 1, 16, 16}, DType::kF32);
    t["transformer.h.1.attn.masked_bias"] = *Tensor::Zeros({1}, DType::kF32);
    t["lm_head.weight"] = t.at("transformer.wte.weight");
  });
  EXPECT_EQ(UnreadAsRank0(gpt2.dir), std::vector<std::string>{});
  const testing::TinyModel& bert = *families[4].second;  // older files store its MLM decoder's tied copies
  EditTensors(bert, [](auto& t) {
    t["cls.predictions.decoder.weight"] = t.at("bert.embeddings.word_embeddings.weight");
    t["cls.predictions.decoder.bias"] = t.at("cls.predictions.bias");
  });
  EXPECT_EQ(UnreadAsRank0(bert.dir), std::vector<std::string>{});
  // bert-base-uncased's files are BertForPreTraining's: a pooler and the
  // next-sentence head, which Hugging Face's BertForMaskedLM ignores too.
  EditTensors(bert, [](auto& t) {
    t["bert.pooler.dense.weight"] = *Tensor::Zeros({64, 64}, DType::kF32);
    t["bert.pooler.dense.bias"] = *Tensor::Zeros({64}, DType::kF32);
    t["cls.seq_relationship.weight"] = *Tensor::Zeros({2, 64}, DType::kF32);
    t["cls.seq_relationship.bias"] = *Tensor::Zeros({2}, DType::kF32);
  });
  EXPECT_EQ(UnreadAsRank0(bert.dir), std::vector<std::string>{});
  // T5 v1.0's files carry a relative bias on the decoder's cross-attention,
  // which no T5 uses.
  const testing::TinyModel& t5 = *families[7].second;
  EditTensors(t5, [](auto& t) {
    t["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = *Tensor::Zeros({8, 4}, DType::kF32);
  });
  EXPECT_EQ(UnreadAsRank0(t5.dir), std::vector<std::string>{});
  // A config.json of one layer on weights of two: the second's tensors,
  // and one of another model's head.
  EditTensors(gpt2, [](auto& t) { t["score.weight"] = *Tensor::Zeros({2, 64}, DType::kF32); });
  std::ofstream(gpt2.dir + "/config.json")
      << R"({"model_type": "gpt2", "vocab_size": 50, "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 16})";
  std::vector<std::string> want = {"score.weight"};
  for (const auto& [tensor, value] : gpt2.tensors) {
    if (absl::StartsWith(tensor, "transformer.h.1.")) want.push_back(tensor);
  }
  std::sort(want.begin(), want.end());
  EXPECT_GT(want.size(), 10u);
  EXPECT_EQ(UnreadAsRank0(gpt2.dir), want);
}

// GPT-2 files saved by transformers of 2022-23 hold each block's causal mask
// as U8 (later BOOL), a dtype colod does not read: the model loads, the
// masks count as read (no model reads them), another unreadable tensor is
// named as unread, and a parameter of such a dtype is refused naming it.
TEST(Validation, TensorsOfDTypesColodDoesNotReadLoadUnlessAParameterIsOne) {
  auto gpt2 = testing::WriteTinyGpt2(TempPath("u8_gpt2"));
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  // The parameters in one file, written by colod; the buffers in a second,
  // built by hand (colod's writer has no U8), both through an index.
  std::vector<std::pair<std::string, Tensor>> list(gpt2->tensors.begin(), gpt2->tensors.end());
  ASSERT_TRUE(WriteSafetensors(gpt2->dir + "/model-00001-of-00002.safetensors", list).ok());
  ASSERT_EQ(::unlink((gpt2->dir + "/model.safetensors").c_str()), 0);
  const auto write = [&](const std::string& wte_file) {
    std::ofstream(gpt2->dir + "/model-00002-of-00002.safetensors", std::ios::binary)
        << ::colod::testing::RawSafetensors(
               R"({"transformer.h.0.attn.bias":{"dtype":"U8","shape":[1,1,16,16],"data_offsets":[0,256]},)"
               R"("transformer.h.1.attn.bias":{"dtype":"BOOL","shape":[1,1,16,16],"data_offsets":[256,512]},)"
               R"("transformer.wte.weight":{"dtype":"U8","shape":[50,64],"data_offsets":[512,3712]},)"
               R"("extra.mask":{"dtype":"BOOL","shape":[3],"data_offsets":[3712,3715]}})",
               std::string(3715, '\1'));
    std::string index = R"({"weight_map":{)";
    for (const auto& [name, t] : gpt2->tensors) {
      const bool second = name == "transformer.wte.weight" && wte_file == "2";
      index += absl::StrCat("\"", name, "\":\"model-0000", second ? "2" : "1", "-of-00002.safetensors\",");
    }
    index += R"("transformer.h.0.attn.bias":"model-00002-of-00002.safetensors",)"
             R"("transformer.h.1.attn.bias":"model-00002-of-00002.safetensors",)"
             R"("extra.mask":"model-00002-of-00002.safetensors"}})";
    std::ofstream(gpt2->dir + "/model.safetensors.index.json") << index;
  };
  write("1");
  EXPECT_EQ(UnreadAsRank0(gpt2->dir), std::vector<std::string>{"extra.mask"});
  write("2");
  const absl::Status s = LoadAsRank0(gpt2->dir, Layout(1, v1::TENSOR_PARALLEL_MODE_1D));
  ExpectInvalid(s, "tensor transformer.wte.weight is U8, a dtype colod does not read");
}

}  // namespace
}  // namespace colod::shardformer
