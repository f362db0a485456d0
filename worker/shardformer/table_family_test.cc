// GPT-2, LLaMA, OPT, BLOOM, BERT and ViT state their layers once
// (spec/plan.cc's tables): the module trees and the policies are made from
// them. Held here against ShardFormer's policies as written out by hand (the
// replacements each mode makes, by the class of the module they are set on),
// and against the module trees' checkpoint names, sizes and order. The
// forwards are held against independent references in each family's test.
#include <set>
#include <string>
#include <tuple>

#include "gtest/gtest.h"
#include "spec/model_config.h"
#include "worker/shardformer/shardformer.h"

namespace colod::shardformer {
namespace {

// "suffix->Target[n_fused=3,swap=1]" per replacement, per class.
using Replacements = std::map<std::string, std::set<std::string>>;

Replacements Describe(const std::map<std::string, ModulePolicyDescription>& policy) {
  Replacements out;
  for (const auto& [cls, d] : policy) {
    if (d.sub_module_replacement.empty()) continue;
    std::set<std::string>& r = out[cls];
    for (const SubModuleReplacementDescription& s : d.sub_module_replacement) {
      std::string kw;
      for (const auto& [k, v] : s.kwargs) kw += (kw.empty() ? "" : ",") + k + "=" + std::to_string(static_cast<int>(v));
      r.insert(s.suffix + "->" + s.target_module + (kw.empty() ? "" : "[" + kw + "]"));
    }
  }
  return out;
}

// `want` without its classes of no replacement.
Replacements NonEmpty(Replacements want) {
  for (auto it = want.begin(); it != want.end();) it = it->second.empty() ? want.erase(it) : std::next(it);
  return want;
}

ShardConfig Layout(v1::TensorParallelMode mode, int tp, bool sp = false) {
  ShardConfig s;
  s.layout.set_tensor_parallel_size(tp);
  s.layout.set_tensor_parallel_mode(mode);
  s.layout.set_sequence_parallel(sp);
  if (mode == v1::TENSOR_PARALLEL_MODE_2P5D) s.layout.set_depth(2);
  return s;
}

ModelConfig Config(const std::string& json) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(json);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

const char kGpt2[] =
    R"({"model_type":"gpt2","vocab_size":512,"n_embd":64,"n_layer":2,"n_head":8,"n_positions":128})";

std::map<std::string, ModulePolicyDescription> PolicyOf(const std::string& type, const ModelConfig& c,
                                                        const ShardConfig& s) {
  absl::StatusOr<ModelFamily> f = ModelRegistry::Global().Get(type);
  EXPECT_TRUE(f.ok());
  absl::StatusOr<std::map<std::string, ModulePolicyDescription>> p = f->policy()->ModulePolicy(c, s);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : std::map<std::string, ModulePolicyDescription>{};
}

struct PolicyCase {
  const char* name;
  ShardConfig shard;
  Replacements want;
};

// `type`'s policy in each case: its replacements; each of `head_attrs` of
// `layer_class` set to its count / head_split; with `base_class`, the base
// model's forward replaced exactly under sequence parallelism.
void ExpectPolicies(const std::string& type, const ModelConfig& c, const std::vector<PolicyCase>& cases,
                    const std::string& layer_class, const std::map<std::string, int>& head_attrs,
                    const std::string& base_class = "") {
  for (const PolicyCase& k : cases) {
    SCOPED_TRACE(type + " " + k.name);
    const std::map<std::string, ModulePolicyDescription> policy = PolicyOf(type, c, k.shard);
    EXPECT_EQ(Describe(policy), NonEmpty(k.want));
    ASSERT_TRUE(policy.count(layer_class));
    for (const auto& [attr, heads] : head_attrs) {
      EXPECT_EQ(policy.at(layer_class).attribute_replacement.at(attr), heads / k.shard.head_split()) << attr;
    }
    if (!base_class.empty()) {
      auto it = policy.find(base_class);
      EXPECT_EQ(it != policy.end() && static_cast<bool>(it->second.method_replacement), k.shard.sequence_parallel());
    }
  }
}

TEST(TableFamily, Gpt2sPolicyIsShardFormersInEveryMode) {
  const ModelConfig c = Config(kGpt2);
  const std::vector<PolicyCase> cases = {
      {"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2),
       {{"GPT2Model", {"wte->VocabParallelEmbedding1D"}},
        {"GPT2Block",
         {"attn.c_attn->Linear1D_Col[n_fused=3]", "attn.c_proj->Linear1D_Row", "mlp.c_fc->Linear1D_Col",
          "mlp.c_proj->Linear1D_Row"}}}},
      {"1d sp", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2, true),
       {{"GPT2Model", {"wte->VocabParallelEmbedding1D", "ln_f->Norm1D"}},
        {"GPT2Block",
         {"ln_1->Norm1D", "attn.c_attn->Linear1D_Col[n_fused=3]", "attn.c_proj->Linear1D_Row", "ln_2->Norm1D",
          "mlp.c_fc->Linear1D_Col", "mlp.c_proj->Linear1D_Row"}}}},
      {"2d", Layout(v1::TENSOR_PARALLEL_MODE_2D, 4),
       {{"GPT2Model", {"wte->Embedding2D", "wpe->Embedding2D", "ln_f->LayerNorm2D"}},
        {"GPT2Block",
         {"ln_1->LayerNorm2D", "attn.c_attn->Linear2D[n_fused=3]", "attn.c_proj->Linear2D", "ln_2->LayerNorm2D",
          "mlp.c_fc->Linear2D", "mlp.c_proj->Linear2D"}}}},
      {"3d", Layout(v1::TENSOR_PARALLEL_MODE_3D, 8),
       {{"GPT2Model", {"wte->Embedding3D", "wpe->Embedding3D", "ln_f->LayerNorm3D"}},
        {"GPT2Block",
         {"ln_1->LayerNorm3D", "attn.c_attn->Linear3D[n_fused=3]", "attn.c_proj->Linear3D[swap=1]",
          "ln_2->LayerNorm3D", "mlp.c_fc->Linear3D", "mlp.c_proj->Linear3D[swap=1]"}}}},
  };
  ExpectPolicies("gpt2", c, cases, "GPT2Block", {{"attn.num_heads", 8}}, "GPT2Model");
}

std::string LlamaJson(bool tied) {
  return std::string(R"({"model_type":"llama","vocab_size":512,"hidden_size":64,"num_hidden_layers":2,)") +
         R"("num_attention_heads":8,"num_key_value_heads":4,"intermediate_size":96,"tie_word_embeddings":)" +
         (tied ? "true" : "false") + "}";
}

TEST(TableFamily, LlamasPolicyIsShardFormersInEveryModeTiedOrNot) {
  const std::set<std::string> linears_1d = {
      "self_attn.q_proj->Linear1D_Col", "self_attn.k_proj->Linear1D_Col", "self_attn.v_proj->Linear1D_Col",
      "self_attn.o_proj->Linear1D_Row", "mlp.gate_proj->Linear1D_Col",    "mlp.up_proj->Linear1D_Col",
      "mlp.down_proj->Linear1D_Row"};
  std::set<std::string> linears_sp = linears_1d;
  linears_sp.insert({"input_layernorm->Norm1D", "post_attention_layernorm->Norm1D"});
  const std::set<std::string> layer_2d = {
      "input_layernorm->RMSNorm2D", "post_attention_layernorm->RMSNorm2D", "self_attn.q_proj->Linear2D",
      "self_attn.k_proj->Linear2D", "self_attn.v_proj->Linear2D",           "self_attn.o_proj->Linear2D",
      "mlp.gate_proj->Linear2D",    "mlp.up_proj->Linear2D",                "mlp.down_proj->Linear2D"};
  const std::set<std::string> layer_3d = {"input_layernorm->RMSNorm3D",
                                          "post_attention_layernorm->RMSNorm3D",
                                          "self_attn.q_proj->Linear3D",
                                          "self_attn.k_proj->Linear3D",
                                          "self_attn.v_proj->Linear3D",
                                          "self_attn.o_proj->Linear3D[swap=1]",
                                          "mlp.gate_proj->Linear3D",
                                          "mlp.up_proj->Linear3D",
                                          "mlp.down_proj->Linear3D[swap=1]"};
  for (bool tied : {false, true}) {
    const ModelConfig c = Config(LlamaJson(tied));
    auto head = [tied](const std::string& layer) {
      return tied ? std::set<std::string>{} : std::set<std::string>{"lm_head->" + layer};
    };
    const std::vector<PolicyCase> cases = {
        {"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2),
         {{"LlamaForCausalLM", head("VocabParallelLMHead1D")},
          {"LlamaModel", {"embed_tokens->VocabParallelEmbedding1D"}},
          {"LlamaDecoderLayer", linears_1d}}},
        {"1d sp", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2, true),
         {{"LlamaForCausalLM", head("VocabParallelLMHead1D")},
          {"LlamaModel", {"embed_tokens->VocabParallelEmbedding1D", "norm->Norm1D"}},
          {"LlamaDecoderLayer", linears_sp}}},
        {"2.5d", Layout(v1::TENSOR_PARALLEL_MODE_2P5D, 8),
         {{"LlamaForCausalLM", head("LMHead2D")},
          {"LlamaModel", {"embed_tokens->Embedding2D", "norm->RMSNorm2D"}},
          {"LlamaDecoderLayer", layer_2d}}},
        {"3d", Layout(v1::TENSOR_PARALLEL_MODE_3D, 8),
         {{"LlamaForCausalLM", head("LMHead3D")},
          {"LlamaModel", {"embed_tokens->Embedding3D", "norm->RMSNorm3D"}},
          {"LlamaDecoderLayer", layer_3d}}},
    };
    SCOPED_TRACE(tied ? "tied" : "untied");
    ExpectPolicies("llama", c, cases, "LlamaDecoderLayer",
                   {{"self_attn.num_heads", 8}, {"self_attn.num_key_value_heads", 4}}, "LlamaModel");
  }
}

TEST(TableFamily, OptsPolicyIsShardFormersWithAndWithoutProjections) {
  for (bool projected : {false, true}) {
    const ModelConfig c = Config(std::string(R"({"model_type":"opt","vocab_size":512,"hidden_size":64,)") +
                                 R"("num_hidden_layers":2,"num_attention_heads":8,"ffn_dim":128,)" +
                                 R"("max_position_embeddings":64,"word_embed_proj_dim":)" + (projected ? "32" : "64") +
                                 "}");
    std::set<std::string> decoder_2d = {"embed_tokens->Embedding2D", "embed_positions->Embedding2D",
                                        "final_layer_norm->LayerNorm2D"};
    if (projected) decoder_2d.insert({"project_in->Linear2D", "project_out->Linear2D"});
    const std::vector<PolicyCase> cases = {
        {"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2),
         {{"OPTDecoder", {"embed_tokens->VocabParallelEmbedding1D"}},
          {"OPTDecoderLayer",
           {"self_attn.q_proj->Linear1D_Col", "self_attn.k_proj->Linear1D_Col", "self_attn.v_proj->Linear1D_Col",
            "self_attn.out_proj->Linear1D_Row", "fc1->Linear1D_Col", "fc2->Linear1D_Row"}}}},
        {"1d sp", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2, true),
         {{"OPTDecoder", {"embed_tokens->VocabParallelEmbedding1D", "final_layer_norm->Norm1D"}},
          {"OPTDecoderLayer",
           {"self_attn.q_proj->Linear1D_Col", "self_attn.k_proj->Linear1D_Col", "self_attn.v_proj->Linear1D_Col",
            "self_attn.out_proj->Linear1D_Row", "fc1->Linear1D_Col", "fc2->Linear1D_Row",
            "self_attn_layer_norm->Norm1D", "final_layer_norm->Norm1D"}}}},
        {"2d", Layout(v1::TENSOR_PARALLEL_MODE_2D, 4),
         {{"OPTDecoder", decoder_2d},
          {"OPTDecoderLayer",
           {"self_attn.q_proj->Linear2D", "self_attn.k_proj->Linear2D", "self_attn.v_proj->Linear2D",
            "self_attn.out_proj->Linear2D", "fc1->Linear2D", "fc2->Linear2D", "self_attn_layer_norm->LayerNorm2D",
            "final_layer_norm->LayerNorm2D"}}}},
    };
    SCOPED_TRACE(projected ? "projected" : "not projected");
    ExpectPolicies("opt", c, cases, "OPTDecoderLayer", {{"self_attn.num_heads", 8}}, "OPTDecoder");
  }
}

TEST(TableFamily, BloomsPolicyIsShardFormersInEveryModeAndLeavesTheEmbeddingNormWholeIn1D) {
  const ModelConfig c = Config(
      R"({"model_type":"bloom","vocab_size":512,"hidden_size":64,"n_layer":2,"n_head":8,"tie_word_embeddings":false})");
  const std::set<std::string> layer_1d = {"self_attention.query_key_value->Linear1D_Col",
                                          "self_attention.dense->Linear1D_Row", "mlp.dense_h_to_4h->Linear1D_Col",
                                          "mlp.dense_4h_to_h->Linear1D_Row"};
  std::set<std::string> layer_sp = layer_1d;
  layer_sp.insert({"input_layernorm->Norm1D", "post_attention_layernorm->Norm1D"});
  const std::vector<PolicyCase> cases = {
      {"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2),
       {{"BloomForCausalLM", {"lm_head->VocabParallelLMHead1D"}},
        {"BloomModel", {"word_embeddings->VocabParallelEmbedding1D"}},
        {"BloomBlock", layer_1d}}},
      {"1d sp", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2, true),
       {{"BloomForCausalLM", {"lm_head->VocabParallelLMHead1D"}},
        {"BloomModel", {"word_embeddings->VocabParallelEmbedding1D", "ln_f->Norm1D"}},
        {"BloomBlock", layer_sp}}},
      // In 2D and 3D the embeddings' LayerNorm is the stream's, as every norm.
      {"2d", Layout(v1::TENSOR_PARALLEL_MODE_2D, 4),
       {{"BloomForCausalLM", {"lm_head->LMHead2D"}},
        {"BloomModel",
         {"word_embeddings->Embedding2D", "word_embeddings_layernorm->LayerNorm2D", "ln_f->LayerNorm2D"}},
        {"BloomBlock",
         {"input_layernorm->LayerNorm2D", "self_attention.query_key_value->Linear2D",
          "self_attention.dense->Linear2D", "post_attention_layernorm->LayerNorm2D", "mlp.dense_h_to_4h->Linear2D",
          "mlp.dense_4h_to_h->Linear2D"}}}},
      {"3d", Layout(v1::TENSOR_PARALLEL_MODE_3D, 8),
       {{"BloomForCausalLM", {"lm_head->LMHead3D"}},
        {"BloomModel",
         {"word_embeddings->Embedding3D", "word_embeddings_layernorm->LayerNorm3D", "ln_f->LayerNorm3D"}},
        {"BloomBlock",
         {"input_layernorm->LayerNorm3D", "self_attention.query_key_value->Linear3D",
          "self_attention.dense->Linear3D[swap=1]", "post_attention_layernorm->LayerNorm3D",
          "mlp.dense_h_to_4h->Linear3D", "mlp.dense_4h_to_h->Linear3D[swap=1]"}}}},
  };
  ExpectPolicies("bloom", c, cases, "BloomBlock", {{"self_attention.num_heads", 8}}, "BloomModel");
}

TEST(TableFamily, BertsPolicyIsShardFormersIn1D2DAnd3D) {
  const ModelConfig c = Config(R"({"model_type":"bert","vocab_size":512,"hidden_size":64,"num_hidden_layers":2,)"
                               R"("num_attention_heads":8,"intermediate_size":128,"max_position_embeddings":64})");
  const std::vector<PolicyCase> cases = {
      {"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2),
       {{"BertEmbeddings", {"word_embeddings->VocabParallelEmbedding1D"}},
        {"BertLayer",
         {"attention.self.query->Linear1D_Col", "attention.self.key->Linear1D_Col",
          "attention.self.value->Linear1D_Col", "attention.output.dense->Linear1D_Row",
          "intermediate.dense->Linear1D_Col", "output.dense->Linear1D_Row"}},
        {"BertLMPredictionHead", {"bias->VocabParallelBias1D"}}}},
      // ShardFormer's sets transform.dense and transform.LayerNorm on
      // BertLMPredictionHead; here they are set on its transform, the same
      // modules.
      {"3d", Layout(v1::TENSOR_PARALLEL_MODE_3D, 8),
       {{"BertEmbeddings",
         {"word_embeddings->Embedding3D", "position_embeddings->Embedding3D", "token_type_embeddings->Embedding3D",
          "LayerNorm->LayerNorm3D"}},
        {"BertLayer",
         {"attention.self.query->Linear3D", "attention.self.key->Linear3D", "attention.self.value->Linear3D",
          "attention.output.dense->Linear3D[swap=1]", "attention.output.LayerNorm->LayerNorm3D",
          "intermediate.dense->Linear3D", "output.dense->Linear3D[swap=1]", "output.LayerNorm->LayerNorm3D"}},
        {"BertPredictionHeadTransform", {"dense->Linear3D", "LayerNorm->LayerNorm3D"}},
        {"BertLMPredictionHead", {"bias->Bias3D"}}}},
      {"2d", Layout(v1::TENSOR_PARALLEL_MODE_2D, 4),
       {{"BertEmbeddings",
         {"word_embeddings->Embedding2D", "position_embeddings->Embedding2D", "token_type_embeddings->Embedding2D",
          "LayerNorm->LayerNorm2D"}},
        {"BertLayer",
         {"attention.self.query->Linear2D", "attention.self.key->Linear2D", "attention.self.value->Linear2D",
          "attention.output.dense->Linear2D", "attention.output.LayerNorm->LayerNorm2D", "intermediate.dense->Linear2D",
          "output.dense->Linear2D", "output.LayerNorm->LayerNorm2D"}},
        {"BertPredictionHeadTransform", {"dense->Linear2D", "LayerNorm->LayerNorm2D"}},
        {"BertLMPredictionHead", {"bias->Bias2D"}}}},
  };
  ExpectPolicies("bert", c, cases, "BertLayer", {{"attention.self.num_attention_heads", 8}});
}

TEST(TableFamily, VitsPolicyIsShardFormersAndLeavesTheEmbeddingsAndClassifierWhole) {
  const ModelConfig c = Config(R"({"model_type":"vit","hidden_size":64,"num_hidden_layers":2,)"
                               R"("num_attention_heads":8,"intermediate_size":128,"image_size":32,"patch_size":8,)"
                               R"("num_labels":10})");
  const std::map<std::string, ModulePolicyDescription> policy =
      PolicyOf("vit", c, Layout(v1::TENSOR_PARALLEL_MODE_1D, 2));
  EXPECT_EQ(Describe(policy), (Replacements{{"ViTLayer",
                                             {"attention.attention.query->Linear1D_Col",
                                              "attention.attention.key->Linear1D_Col",
                                              "attention.attention.value->Linear1D_Col",
                                              "attention.output.dense->Linear1D_Row",
                                              "intermediate.dense->Linear1D_Col", "output.dense->Linear1D_Row"}}}));
  EXPECT_EQ(policy.at("ViTLayer").attribute_replacement.at("attention.attention.num_attention_heads"), 4);
}

TEST(TableFamily, T5sPolicyIsShardFormersOnItsAttentionsAndFeedForwards) {
  for (bool gated : {false, true}) {
    const ModelConfig c = Config(std::string(R"({"model_type":"t5","vocab_size":512,"d_model":64,"d_kv":8,)") +
                                 R"("d_ff":128,"num_layers":2,"num_decoder_layers":3,"num_heads":8,)" +
                                 R"("tie_word_embeddings":false,"feed_forward_proj":)" +
                                 (gated ? R"("gated-gelu"})" : R"("relu"})"));
    const Replacements dense =
        gated ? Replacements{{"T5DenseGatedActDense",
                              {"wi_0->Linear1D_Col", "wi_1->Linear1D_Col", "wo->Linear1D_Row"}}}
              : Replacements{{"T5DenseActDense", {"wi->Linear1D_Col", "wo->Linear1D_Row"}}};
    Replacements want = {
        {"T5ForConditionalGeneration", {"shared->VocabParallelEmbedding1D", "lm_head->VocabParallelLMHead1D"}},
        {"T5Attention", {"q->Linear1D_Col", "k->Linear1D_Col", "v->Linear1D_Col", "o->Linear1D_Row"}}};
    want.insert(dense.begin(), dense.end());
    SCOPED_TRACE(gated ? "gated" : "relu");
    ExpectPolicies("t5", c, {{"1d", Layout(v1::TENSOR_PARALLEL_MODE_1D, 2), want}}, "T5Attention", {{"n_heads", 8}});
  }
}

// Every leaf of the built tree, depth first: "path prefix kind in out
// [bias] [tied TABLE]".
std::vector<std::string> Leaves(Module& root) {
  std::vector<std::string> out;
  for (const auto& [path, m] : root.Modules()) {
    if (!m->decl().has_value()) continue;
    const LayerDecl& d = *m->decl();
    out.push_back(path + " " + d.prefix + " " + KindName(d.kind) + " " + std::to_string(d.in) + " " +
                  std::to_string(d.out) + (d.bias ? " bias" : "") + (d.tied_to.empty() ? "" : " tied " + d.tied_to));
  }
  return out;
}

TEST(TableFamily, BuildsTheCheckpointsLayersInOrder) {
  absl::StatusOr<ModelFamily> f = ModelRegistry::Global().Get("gpt2");
  ASSERT_TRUE(f.ok());
  absl::StatusOr<std::unique_ptr<Module>> m = f->build(Config(kGpt2));
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<std::string> leaves = Leaves(**m);
  std::vector<std::string> want = {"transformer.wte transformer.wte Embedding 512 64",
                                   "transformer.wpe transformer.wpe Embedding 128 64"};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "transformer.h." + std::to_string(i);
    for (const std::string& l : {p + ".ln_1 " + p + ".ln_1 LayerNorm 0 64 bias",
                                 p + ".attn.c_attn " + p + ".attn.c_attn Conv1D 64 192 bias",
                                 p + ".attn.c_proj " + p + ".attn.c_proj Conv1D 64 64 bias",
                                 p + ".ln_2 " + p + ".ln_2 LayerNorm 0 64 bias",
                                 p + ".mlp.c_fc " + p + ".mlp.c_fc Conv1D 64 256 bias",
                                 p + ".mlp.c_proj " + p + ".mlp.c_proj Conv1D 256 64 bias"}) {
      want.push_back(l);
    }
  }
  want.push_back("transformer.ln_f transformer.ln_f LayerNorm 0 64 bias");
  want.push_back("lm_head lm_head Linear 64 512 tied transformer.wte");
  EXPECT_EQ(leaves, want);
  // OPT's decoder sits under model; its projections around the layers, its
  // head tied to the table under the decoder.
  absl::StatusOr<ModelFamily> opt = ModelRegistry::Global().Get("opt");
  ASSERT_TRUE(opt.ok());
  absl::StatusOr<std::unique_ptr<Module>> o = opt->build(Config(
      R"({"model_type":"opt","vocab_size":512,"hidden_size":64,"num_hidden_layers":1,"num_attention_heads":8,)"
      R"("ffn_dim":128,"max_position_embeddings":64,"word_embed_proj_dim":32})"));
  ASSERT_TRUE(o.ok()) << o.status();
  const std::string l = "model.decoder.layers.0";
  EXPECT_EQ(Leaves(**o), (std::vector<std::string>{
                             "model.decoder.embed_tokens model.decoder.embed_tokens Embedding 512 32",
                             "model.decoder.embed_positions model.decoder.embed_positions Embedding 66 64",
                             "model.decoder.project_in model.decoder.project_in Linear 32 64",
                             l + ".self_attn.q_proj " + l + ".self_attn.q_proj Linear 64 64 bias",
                             l + ".self_attn.k_proj " + l + ".self_attn.k_proj Linear 64 64 bias",
                             l + ".self_attn.v_proj " + l + ".self_attn.v_proj Linear 64 64 bias",
                             l + ".self_attn.out_proj " + l + ".self_attn.out_proj Linear 64 64 bias",
                             l + ".self_attn_layer_norm " + l + ".self_attn_layer_norm LayerNorm 0 64 bias",
                             l + ".fc1 " + l + ".fc1 Linear 64 128 bias",
                             l + ".fc2 " + l + ".fc2 Linear 128 64 bias",
                             l + ".final_layer_norm " + l + ".final_layer_norm LayerNorm 0 64 bias",
                             "model.decoder.final_layer_norm model.decoder.final_layer_norm LayerNorm 0 64 bias",
                             "model.decoder.project_out model.decoder.project_out Linear 64 32",
                             "lm_head lm_head Linear 32 512 tied model.decoder.embed_tokens"}));
  EXPECT_EQ((*o)->Find("model")->cls(), "OPTModel");
  // BERT's MLM head under cls, its bias named by its owner; ViT's bare
  // tensors and patch Conv2d with their shapes.
  absl::StatusOr<ModelFamily> bert = ModelRegistry::Global().Get("bert");
  ASSERT_TRUE(bert.ok());
  absl::StatusOr<std::unique_ptr<Module>> bm =
      bert->build(Config(R"({"model_type":"bert","vocab_size":512,"hidden_size":64,"num_hidden_layers":1,)"
                         R"("num_attention_heads":8,"intermediate_size":128,"max_position_embeddings":64})"));
  ASSERT_TRUE(bm.ok()) << bm.status();
  const std::vector<std::string> bl = Leaves(**bm);
  ASSERT_EQ(bl.size(), 16u);
  EXPECT_EQ(bl.front(), "bert.embeddings.word_embeddings bert.embeddings.word_embeddings Embedding 512 64");
  EXPECT_EQ(bl[4], "bert.encoder.layer.0.attention.self.query bert.encoder.layer.0.attention.self.query Linear 64 64 "
                   "bias");
  EXPECT_EQ(bl[12], "cls.predictions.transform.dense cls.predictions.transform.dense Linear 64 64 bias");
  EXPECT_EQ(bl[14], "cls.predictions.decoder cls.predictions.decoder Linear 64 512 tied bert.embeddings.word_embeddings");
  EXPECT_EQ(bl[15], "cls.predictions.bias cls.predictions Bias 0 512");
  EXPECT_EQ((*bm)->Find("cls.predictions")->cls(), "BertLMPredictionHead");
  EXPECT_EQ((*bm)->Find("bert.encoder.layer.0.attention.self")->IntAttr("num_attention_heads").value_or(-1), 8);
  absl::StatusOr<ModelFamily> vit = ModelRegistry::Global().Get("vit");
  ASSERT_TRUE(vit.ok());
  absl::StatusOr<std::unique_ptr<Module>> vm =
      vit->build(Config(R"({"model_type":"vit","hidden_size":64,"num_hidden_layers":1,"num_attention_heads":8,)"
                        R"("intermediate_size":128,"image_size":32,"patch_size":8,"num_labels":10})"));
  ASSERT_TRUE(vm.ok()) << vm.status();
  Module* pos = (*vm)->Find("vit.embeddings.position_embeddings");
  ASSERT_NE(pos, nullptr);
  EXPECT_EQ(pos->decl()->shape, (Shape{1, 17, 64}));  // 16 patches and the CLS token
  Module* patches = (*vm)->Find("vit.embeddings.patch_embeddings.projection");
  ASSERT_NE(patches, nullptr);
  EXPECT_EQ(patches->decl()->shape, (Shape{64, 3, 8, 8}));
  EXPECT_EQ(patches->decl()->in, 192);
  EXPECT_TRUE(patches->decl()->bias);
  const std::vector<std::string> vl = Leaves(**vm);
  EXPECT_EQ(vl.back(), "classifier classifier Linear 64 10 bias");
  // T5's two stacks: the encoder's blocks of two sublayers, the decoder's of
  // three, block 0's position bias after its o, no base model.
  absl::StatusOr<ModelFamily> t5 = ModelRegistry::Global().Get("t5");
  ASSERT_TRUE(t5.ok());
  absl::StatusOr<std::unique_ptr<Module>> tm = t5->build(Config(
      R"({"model_type":"t5","vocab_size":512,"d_model":64,"d_kv":8,"d_ff":128,"num_layers":1,"num_decoder_layers":1,)"
      R"("num_heads":8})"));
  ASSERT_TRUE(tm.ok()) << tm.status();
  const std::vector<std::string> tl = Leaves(**tm);
  ASSERT_EQ(tl.size(), 27u);  // shared; 8 + bias + norm; 13 + bias + norm; the tied head
  EXPECT_EQ(tl[0], "shared shared Embedding 512 64");
  EXPECT_EQ(tl[5], "encoder.block.0.layer.0.SelfAttention.relative_attention_bias "
                   "encoder.block.0.layer.0.SelfAttention.relative_attention_bias Embedding 32 8");
  EXPECT_EQ(tl[8], "encoder.block.0.layer.1.DenseReluDense.wo encoder.block.0.layer.1.DenseReluDense.wo Linear 128 64");
  EXPECT_EQ(tl[10], "encoder.final_layer_norm encoder.final_layer_norm RMSNorm 0 64");
  EXPECT_EQ(tl[17], "decoder.block.0.layer.1.EncDecAttention.q decoder.block.0.layer.1.EncDecAttention.q Linear 64 64");
  EXPECT_EQ(tl.back(), "lm_head lm_head Linear 64 512 tied shared");
  EXPECT_EQ((*tm)->Find("decoder.block.0.layer.2")->cls(), "T5LayerFF");
  EXPECT_EQ((*tm)->Find("decoder.block.0.layer.0.SelfAttention")->IntAttr("relative_attention_num_buckets").value_or(0),
            32);
  EXPECT_EQ((*o)->Find("model.decoder")->IntAttr("position_offset").value_or(-1), 2);
  Module* attn = (*m)->Find("transformer.h.1.attn");
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(attn->cls(), "GPT2Attention");
  EXPECT_EQ(attn->IntAttr("num_heads").value_or(-1), 8);
  EXPECT_EQ(attn->IntAttr("head_dim").value_or(-1), 8);
}

}  // namespace
}  // namespace colod::shardformer
