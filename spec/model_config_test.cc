// config.json of each family as Hugging Face writes it, and every error.
#include "spec/model_config.h"
#include "spec/plan.h"

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

TEST(ModelConfig, ParsesGpt2LlamaAndBert) {
  auto gpt2 = ParseModelConfig(R"({"model_type":"gpt2","vocab_size":50257,"n_positions":1024,"n_embd":768,
      "n_layer":12,"n_head":12,"n_inner":null,"layer_norm_epsilon":1e-05,"activation_function":"gelu_new",
      "scale_attn_weights":true,"scale_attn_by_inverse_layer_idx":false,"tie_word_embeddings":true})");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ(gpt2->hidden_size, 768);
  EXPECT_EQ(gpt2->intermediate_size, 3072);  // n_inner null: 4 * n_embd
  EXPECT_EQ(gpt2->head_dim(), 64);
  EXPECT_TRUE(gpt2->tie_word_embeddings);
  auto llama = ParseModelConfig(R"({"model_type":"llama","vocab_size":32000,"hidden_size":4096,
      "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
      "rms_norm_eps":1e-05,"rope_theta":500000.0,"tie_word_embeddings":false,"hidden_act":"silu",
      "rope_scaling":null,"attention_bias":false,"mlp_bias":false,"head_dim":128})");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->num_kv_heads, 8);
  EXPECT_EQ(llama->rope_theta, 500000.0);
  EXPECT_FALSE(llama->tie_word_embeddings);
  // Scalings that compute what unscaled rotary embeddings compute, up to
  // max_position_embeddings (no sequence of colod's goes past it), and
  // transformers 5's rope_parameters, which holds rope_theta.
  for (const char* scaling :
       {R"("rope_scaling":{"type":"dynamic","factor":2.0})", R"("rope_scaling":{"rope_type":"linear","factor":1.0})",
        R"("rope_scaling":{"rope_type":"default"})",
        R"("rope_parameters":{"rope_type":"default","rope_theta":500000.0})"}) {
    auto scaled = ParseModelConfig(absl::StrCat(R"({"model_type":"llama","vocab_size":32000,"hidden_size":4096,
        "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,)",
                                                scaling, "}"));
    ASSERT_TRUE(scaled.ok()) << scaling << ": " << scaled.status();
    EXPECT_EQ(scaled->rope_theta, absl::StrContains(scaling, "500000") ? 500000.0 : 10000.0) << scaling;
  }
  auto bert = ParseModelConfig(R"({"model_type":"bert","vocab_size":30522,"hidden_size":768,
      "num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"type_vocab_size":2,
      "position_embedding_type":"absolute","tie_word_embeddings":true})");
  ASSERT_TRUE(bert.ok()) << bert.status();
  EXPECT_EQ(bert->norm_eps, 1e-12);
  // BERT sees every position: a masked language model; the causal LMs not.
  EXPECT_TRUE(bert->masked_lm());
  EXPECT_FALSE(llama->masked_lm());
}

// Parameter counts against the published ones (transformers'
// model.num_parameters() of the hub checkpoints).
TEST(ModelConfig, ParameterCountsMatchThePublishedModels) {
  auto gpt2 = ParseModelConfig(R"({"model_type":"gpt2","vocab_size":50257,"n_positions":1024,"n_embd":768,
      "n_layer":12,"n_head":12})");
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ(*ParameterCount(*gpt2), 124439808);  // gpt2
  auto llama = ParseModelConfig(R"({"model_type":"llama","vocab_size":32000,"hidden_size":4096,
      "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,"tie_word_embeddings":false})");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(*ParameterCount(*llama), 6738415616);  // meta-llama/Llama-2-7b-hf
  auto bert = ParseModelConfig(R"({"model_type":"bert","vocab_size":30522,"hidden_size":768,
      "num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"type_vocab_size":2,
      "max_position_embeddings":512})");
  ASSERT_TRUE(bert.ok()) << bert.status();
  EXPECT_EQ(*ParameterCount(*bert), 109514298);  // bert-base-uncased as BertForMaskedLM
  // facebook/opt-125m and facebook/opt-350m (post-norm, 512-wide embeddings
  // projected in and out, no final LayerNorm), their config.json as published.
  auto opt125 = ParseModelConfig(R"({"model_type":"opt","vocab_size":50272,"hidden_size":768,"ffn_dim":3072,
      "num_hidden_layers":12,"num_attention_heads":12,"max_position_embeddings":2048,"do_layer_norm_before":true,
      "word_embed_proj_dim":768,"activation_function":"relu","enable_bias":true,"_remove_final_layer_norm":false})");
  ASSERT_TRUE(opt125.ok()) << opt125.status();
  EXPECT_EQ(*ParameterCount(*opt125), 125239296);
  auto opt350 = ParseModelConfig(R"({"model_type":"opt","vocab_size":50272,"hidden_size":1024,"ffn_dim":4096,
      "num_hidden_layers":24,"num_attention_heads":16,"max_position_embeddings":2048,"do_layer_norm_before":false,
      "word_embed_proj_dim":512,"activation_function":"relu"})");
  ASSERT_TRUE(opt350.ok()) << opt350.status();
  EXPECT_EQ(*ParameterCount(*opt350), 331196416);
  EXPECT_FALSE(opt350->norm_before);
  EXPECT_FALSE(opt350->final_norm);
  EXPECT_EQ(opt350->embed_dim, 512);
  EXPECT_EQ(opt350->position_offset, 2);
  EXPECT_TRUE(opt350->tie_word_embeddings);
  // bigscience/bloom-560m's config.json (n_embed, n_head, n_layer as published).
  auto bloom = ParseModelConfig(R"({"apply_residual_connection_post_layernorm":false,"attention_dropout":0.0,
      "bos_token_id":1,"eos_token_id":2,"hidden_dropout":0.0,"initializer_range":0.02,"layer_norm_epsilon":1e-05,
      "model_type":"bloom","n_embed":1024,"n_head":16,"n_inner":null,"n_layer":24,"offset_alibi":100,
      "pad_token_id":3,"pretraining_tp":1,"skip_bias_add":true,"skip_bias_add_qkv":false,"slow_but_exact":false,
      "unk_token_id":0,"use_cache":true,"vocab_size":250880})");
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  EXPECT_EQ(*ParameterCount(*bloom), 559214592);
  EXPECT_EQ(bloom->hidden_size, 1024);
  EXPECT_EQ(bloom->intermediate_size, 4096);
  EXPECT_EQ(bloom->num_heads, 16);
  EXPECT_TRUE(bloom->tie_word_embeddings);
  // google/vit-base-patch16-224: 1000 ImageNet labels (its id2label, abridged
  // here to num_labels).
  auto vit = ParseModelConfig(R"({"model_type":"vit","hidden_size":768,"num_hidden_layers":12,
      "num_attention_heads":12,"intermediate_size":3072,"hidden_act":"gelu","layer_norm_eps":1e-12,
      "image_size":224,"patch_size":16,"num_channels":3,"qkv_bias":true,"num_labels":1000})");
  ASSERT_TRUE(vit.ok()) << vit.status();
  EXPECT_EQ(*ParameterCount(*vit), 86567656);
  EXPECT_EQ(vit->max_positions, 197);
  EXPECT_TRUE(vit->takes_images());
  auto labelled = ParseModelConfig(R"({"model_type":"vit","hidden_size":64,"num_hidden_layers":1,
      "num_attention_heads":4,"intermediate_size":96,"id2label":{"0":"cat","1":"dog","2":"bird"}})");
  ASSERT_TRUE(labelled.ok()) << labelled.status();
  EXPECT_EQ(labelled->vocab_size, 3);  // the labels id2label names
  // t5-small (v1.0: relu, tied) and google/flan-t5-small (gated-gelu,
  // untied, 6 heads of 64: inner 384 of d_model 512), as published.
  auto t5 = ParseModelConfig(R"({"model_type":"t5","vocab_size":32128,"d_model":512,"d_kv":64,"d_ff":2048,
      "num_layers":6,"num_heads":8,"relative_attention_num_buckets":32,"feed_forward_proj":"relu"})");
  ASSERT_TRUE(t5.ok()) << t5.status();
  EXPECT_EQ(*ParameterCount(*t5), 60506624);
  EXPECT_TRUE(t5->is_encoder_decoder());
  EXPECT_EQ(t5->num_decoder_layers, 6);
  EXPECT_EQ(t5->pad_token_id, 0);  // the published configs' 0, absent here
  EXPECT_EQ(t5->decoder_start_token_id, 0);
  auto started = ParseModelConfig(R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,
      "num_layers":1,"num_heads":4,"pad_token_id":3,"decoder_start_token_id":9})");
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->pad_token_id, 3);
  EXPECT_EQ(started->decoder_start_token_id, 9);
  auto flan = ParseModelConfig(R"({"model_type":"t5","vocab_size":32128,"d_model":512,"d_kv":64,"d_ff":1024,
      "num_layers":8,"num_decoder_layers":8,"num_heads":6,"relative_attention_max_distance":128,
      "feed_forward_proj":"gated-gelu","tie_word_embeddings":false})");
  ASSERT_TRUE(flan.ok()) << flan.status();
  EXPECT_EQ(*ParameterCount(*flan), 76961152);
  EXPECT_EQ(flan->head_dim(), 64);
}

TEST(ModelConfig, ParameterCountsMatchTheTensorsOfWrittenModels) {
  // Grouped-query attention and a tied head, which the published models above lack.
  for (bool tie : {false, true}) {
    testing::TinyOptions o;
    o.tie = tie;
    auto m = testing::WriteTinyLlama(::colod::testing::TempPath(tie ? "count_llama_tied" : "count_llama"), o);
    ASSERT_TRUE(m.ok()) << m.status();
    int64_t written = 0;
    for (const auto& [name, t] : m->tensors) written += t.numel();
    EXPECT_EQ(*ParameterCount(m->config), written) << "tie " << tie;
  }
  for (bool pre_norm : {false, true}) {
    for (bool tie : {false, true}) {
      testing::TinyOptions o;
      o.tie = tie;
      o.pre_norm = pre_norm;
      o.embed_dim = pre_norm ? 0 : 32;
      auto m = testing::WriteTinyOpt(
          ::colod::testing::TempPath(absl::StrCat("count_opt_", pre_norm, "_", tie)), o);
      ASSERT_TRUE(m.ok()) << m.status();
      int64_t written = 0;
      for (const auto& [name, t] : m->tensors) written += t.numel();
      EXPECT_EQ(*ParameterCount(m->config), written) << "pre_norm " << pre_norm << " tie " << tie;
    }
  }
  for (bool gated : {false, true}) {
    testing::TinyOptions o;
    o.gated = gated;
    o.tie = !gated;
    o.kv_dim = gated ? 8 : 0;
    auto m = testing::WriteTinyT5(::colod::testing::TempPath(absl::StrCat("count_t5_", gated)), o);
    ASSERT_TRUE(m.ok()) << m.status();
    int64_t written = 0;
    for (const auto& [name, t] : m->tensors) written += t.numel();
    EXPECT_EQ(*ParameterCount(m->config), written) << "t5 gated " << gated;
  }
  {
    auto m = testing::WriteTinyVit(::colod::testing::TempPath("count_vit"));
    ASSERT_TRUE(m.ok()) << m.status();
    int64_t written = 0;
    for (const auto& [name, t] : m->tensors) written += t.numel();
    EXPECT_EQ(*ParameterCount(m->config), written) << "vit";
  }
  for (bool tie : {false, true}) {
    testing::TinyOptions o;
    o.tie = tie;
    auto m = testing::WriteTinyBloom(::colod::testing::TempPath(absl::StrCat("count_bloom_", tie)), o);
    ASSERT_TRUE(m.ok()) << m.status();
    int64_t written = 0;
    for (const auto& [name, t] : m->tensors) written += t.numel();
    EXPECT_EQ(*ParameterCount(m->config), written) << "bloom tie " << tie;
  }
}

// Found by model_config_fuzz: a boolean field given as a number threw out
// of the parser (and so out of the coordinator's SubmitJob).
TEST(ModelConfig, BooleanFieldsMustBeBooleans) {
  auto c = ParseModelConfig(R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
      "num_hidden_layers": 1, "num_attention_heads": 4, "tie_word_embeddings": 32})");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("tie_word_embeddings"), std::string::npos) << c.status();
}

TEST(ModelConfig, HugeModelsAreRefusedBeforeAnythingIsBuilt) {
  // The issue's config: a billion layers beside tiny weights.
  auto deep = ParseModelConfig(R"({"model_type":"gpt2","vocab_size":50,"n_positions":16,"n_embd":16,
      "n_layer":1000000000,"n_head":4})");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("at most 4096"), std::string::npos) << deep.status();
  // Sizes whose products overflow int64.
  for (const char* json : {
           R"({"model_type":"gpt2","vocab_size":50,"n_positions":16,"n_embd":4611686018427387904,"n_layer":1,"n_head":1})",
           R"({"model_type":"gpt2","vocab_size":9223372036854775807,"n_positions":16,"n_embd":16,"n_layer":1,"n_head":1})",
           R"({"model_type":"llama","vocab_size":50,"hidden_size":4294967296,"intermediate_size":4294967296,
               "num_hidden_layers":4096,"num_attention_heads":1})",
           R"({"model_type":"bert","vocab_size":50,"hidden_size":16,"num_hidden_layers":1,"num_attention_heads":1,
               "intermediate_size":9223372036854775807})",
       }) {
    auto c = ParseModelConfig(json);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_TRUE(absl::StrContains(c.status().message(), "too large") ||
                absl::StrContains(c.status().message(), "overflows"))
        << c.status();
  }
}

TEST(ModelConfig, TheMemoryFloorPerRank) {
  auto llama = ParseModelConfig(R"({"model_type":"llama","vocab_size":32000,"hidden_size":4096,
      "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,"tie_word_embeddings":false})");
  ASSERT_TRUE(llama.ok());
  const int64_t p = 6738415616;
  // At tp = 4 each rank holds a quarter of the matrices and tables (32000
  // rows: no padding) and all 65 RMSNorms' 4096 weights.
  const int64_t norms = 65 * 4096, r = (p - norms) / 4 + norms;
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  spec.mutable_shard()->set_tensor_parallel_size(4);
  spec.mutable_shard()->set_data_parallel_size(2);
  auto adam = MemoryFloorPerRank(*llama, spec);  // unspecified precision: bf16 (2 + 2 + 4 + 4 + 4 bytes)
  ASSERT_TRUE(adam.ok());
  EXPECT_EQ(adam->parameters, p);
  EXPECT_EQ(adam->rank_parameters, r);
  EXPECT_EQ(adam->param_bytes, r * 2);
  // A training step's activations on top: the plan's, in bf16 (8 sequences
  // of 64 tokens, 4 a replica), for CUDA workers, whose fused attention
  // keeps fewer than the CPU's (the job may run on either).
  v1::JobSpec bf16 = spec;
  bf16.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
  auto plan = PlanJob(*llama, bf16, PlanDevice::kCuda);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto cpu = PlanJob(*llama, bf16, PlanDevice::kCpu);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(plan->activation_bytes, 0);
  EXPECT_LT(plan->activation_bytes, cpu->activation_bytes);
  EXPECT_EQ(adam->activation_bytes, plan->activation_bytes);
  EXPECT_EQ(adam->total_bytes, r * 16 + plan->activation_bytes);
  spec.mutable_train()->set_precision(v1::PRECISION_FP32);  // 4 + 4 + 4 + 4
  auto f32 = MemoryFloorPerRank(*llama, spec);
  EXPECT_EQ(f32->total_bytes, r * 16 + PlanJob(*llama, spec, PlanDevice::kCuda)->activation_bytes);
  EXPECT_GT(f32->activation_bytes, adam->activation_bytes);
  spec.mutable_train()->set_optimizer(v1::OPTIMIZER_SGD);  // 4 + 4 + 4
  EXPECT_EQ(MemoryFloorPerRank(*llama, spec)->total_bytes, r * 12 + f32->activation_bytes);
  v1::JobSpec uneven = spec;  // a batch the plan refuses: validation's to report; no activations
  uneven.mutable_train()->set_batch_size(3);
  EXPECT_EQ(MemoryFloorPerRank(*llama, uneven)->activation_bytes, 0);
  // ZeRO over dp = 2: the state (stage 2: and the gradients) of half the
  // parameters; recomputation fewer activations.
  v1::JobSpec zero = spec;
  zero.mutable_train()->set_optimizer(v1::OPTIMIZER_ADAMW);
  zero.mutable_train()->set_zero_stage(1);
  EXPECT_EQ(MemoryFloorPerRank(*llama, zero)->optimizer_bytes, r / 2 * 8);
  EXPECT_EQ(MemoryFloorPerRank(*llama, zero)->grad_bytes, r * 4);
  zero.mutable_train()->set_zero_stage(2);
  EXPECT_EQ(MemoryFloorPerRank(*llama, zero)->grad_bytes, r / 2 * 4);
  zero.mutable_train()->set_recompute(v1::RECOMPUTE_FULL);
  EXPECT_LT(3 * MemoryFloorPerRank(*llama, zero)->activation_bytes, f32->activation_bytes);
  spec.set_kind(v1::JOB_KIND_FORWARD);  // f32 parameters only
  EXPECT_EQ(MemoryFloorPerRank(*llama, spec)->total_bytes, r * 4);
  EXPECT_EQ(DescribeMemoryFloor(*MemoryFloorPerRank(*llama, spec)),
            "at least 6.28 GiB per rank (6738415616 parameters, 1684803584 on the fullest rank: 6.28 GiB of "
            "parameters)");
  spec.set_kind(v1::JOB_KIND_TENSOR);
  EXPECT_EQ(MemoryFloorPerRank(*llama, spec)->total_bytes, 0);
  // A share that does not divide rounds up.
  spec.set_kind(v1::JOB_KIND_FORWARD);
  spec.mutable_shard()->set_tensor_parallel_size(3);
  EXPECT_GE(MemoryFloorPerRank(*llama, spec)->param_bytes, (p + 2) / 3 * 4);
}

// Without config.json, NOT_FOUND saying so; with one that cannot be read
// (here a directory in its place), why, not "no config.json".
TEST(ModelConfig, AConfigThatCannotBeReadIsNotCalledMissing) {
  const std::string dir = ::colod::testing::TempPath("config_unreadable");
  std::filesystem::create_directories(dir);
  auto missing = ReadModelConfig(dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_EQ(missing.status().message(), absl::StrCat("no config.json in ", dir));
  std::filesystem::create_directories(dir + "/config.json");
  auto unreadable = ReadModelConfig(dir);
  EXPECT_EQ(unreadable.status().code(), absl::StatusCode::kFailedPrecondition) << unreadable.status();
  EXPECT_TRUE(absl::StrContains(unreadable.status().message(), "cannot read '" + dir + "/config.json'"))
      << unreadable.status();
}

TEST(ModelConfig, ErrorsNameTheField) {
  struct Case {
    const char* json;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {"[]", "not a JSON object"},
           {R"({"vocab_size":3})", "model_type is missing"},
           {R"({"model_type":"mamba"})", "'mamba' is not one of gpt2, llama, bert, opt, bloom, vit, t5"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,"num_layers":2,"num_heads":4,
               "feed_forward_proj":"gated-silu"})",
            "feed_forward_proj \"gated-silu\" is not relu or gated-gelu"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_ff":32,"num_layers":2,"num_heads":4})",
            "d_kv is missing"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4611686018427387904,"d_ff":32,"num_layers":2,
               "num_heads":4})",
            "d_kv times num_heads 4 overflows"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,"num_layers":2,"num_heads":4,
               "relative_attention_num_buckets":32,"relative_attention_max_distance":16})",
            "relative_attention_max_distance must exceed the decoder's exact buckets"},
           // What transformers reads and colod does not compute: refused, not ignored.
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"rope_scaling":{"rope_type":"llama3","factor":8.0}})",
            "rope_scaling {\"factor\":8.0,\"rope_type\":\"llama3\"} is not supported: rotary embeddings are computed "
            "unscaled"},
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"rope_scaling":{"type":"linear","factor":2.0}})",
            "rope_scaling {\"factor\":2.0,\"type\":\"linear\"} is not supported"},
           // transformers 5's form
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"rope_parameters":{"rope_type":"yarn","factor":4.0,"rope_theta":1e6}})",
            "rope_parameters {\"factor\":4.0,\"rope_theta\":1000000.0,\"rope_type\":\"yarn\"} is not supported"},
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"attention_bias":true})",
            "attention_bias true is not supported"},
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"mlp_bias":true})",
            "mlp_bias true is not supported"},
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"head_dim":8})",
            "head_dim 8 is not supported: a head is hidden_size / num_attention_heads wide (16 / 4)"},
           {R"({"model_type":"gpt2","vocab_size":10,"n_positions":8,"n_embd":16,"n_layer":2,"n_head":4,
               "tie_word_embeddings":false})",
            "tie_word_embeddings false is not supported"},
           {R"({"model_type":"gpt2","vocab_size":10,"n_positions":8,"n_embd":16,"n_layer":2,"n_head":4,
               "scale_attn_by_inverse_layer_idx":true})",
            "scale_attn_by_inverse_layer_idx true is not supported"},
           {R"({"model_type":"bert","vocab_size":10,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
               "num_attention_heads":4,"position_embedding_type":"relative_key"})",
            "position_embedding_type \"relative_key\" is not supported"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,"num_layers":2,"num_heads":4,
               "decoder_start_token_id":10})",
            "decoder_start_token_id must be a token id in [0, vocab_size 10)"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,"num_layers":2,"num_heads":4,
               "pad_token_id":18446744073709551615})",
            "pad_token_id must be a token id in [0, vocab_size 10)"},
           {R"({"model_type":"t5","vocab_size":10,"d_model":16,"d_kv":4,"d_ff":32,"num_layers":2,"num_heads":4,
               "pad_token_id":-1})",
            "pad_token_id must be a token id in [0, vocab_size 10)"},
           {R"({"model_type":"gpt2","vocab_size":10,"n_positions":8,"n_embd":16,"n_layer":2})", "n_head is missing"},
           {R"({"model_type":"gpt2","vocab_size":10,"n_positions":8,"n_embd":16,"n_layer":"2","n_head":4})",
            "n_layer must be a positive integer"},
           {R"({"model_type":"gpt2","vocab_size":10,"n_positions":8,"n_embd":18,"n_layer":2,"n_head":4})",
            "hidden size 18 is not divisible by the 4 attention heads"},
           {R"({"model_type":"llama","vocab_size":10,"hidden_size":16,"intermediate_size":32,
               "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":3})",
            "not divisible by num_key_value_heads 3"},
           {R"({"model_type":"opt","vocab_size":10,"hidden_size":16,"num_hidden_layers":2,"num_attention_heads":4})",
            "ffn_dim is missing"},
           {R"({"model_type":"bloom","vocab_size":10,"n_embed":16,"n_layer":2})", "n_head is missing"},
           {R"({"model_type":"vit","hidden_size":16,"num_hidden_layers":1,"num_attention_heads":4,
               "intermediate_size":32,"image_size":30,"patch_size":16})",
            "image_size 30 is not a multiple of patch_size 16"},
           {R"({"model_type":"vit","hidden_size":16,"num_hidden_layers":1,"num_attention_heads":4,
               "intermediate_size":32,"image_size":[224, 224]})",
            "image_size must be a positive integer"},
           {R"({"model_type":"bloom","vocab_size":10,"n_embed":16,"n_layer":2,"n_head":4,
               "apply_residual_connection_post_layernorm":"no"})",
            "apply_residual_connection_post_layernorm must be true or false"},
           {R"({"model_type":"opt","vocab_size":10,"hidden_size":16,"ffn_dim":32,"num_hidden_layers":2,
               "num_attention_heads":4,"word_embed_proj_dim":0})",
            "word_embed_proj_dim must be a positive integer"},
           {R"({"model_type":"opt","vocab_size":10,"hidden_size":16,"ffn_dim":32,"num_hidden_layers":2,
               "num_attention_heads":4,"layer_norm_elementwise_affine":false})",
            "layer_norm_elementwise_affine false (LayerNorms without weights) is not supported"},
           {R"({"model_type":"opt","vocab_size":10,"hidden_size":16,"ffn_dim":32,"num_hidden_layers":2,
               "num_attention_heads":4,"do_layer_norm_before":1})",
            "do_layer_norm_before must be true or false"},
           {R"({"model_type":"opt","vocab_size":10,"hidden_size":16,"ffn_dim":32,"num_hidden_layers":2,
               "num_attention_heads":4,"max_position_embeddings":9223372036854775807})",
            "max_position_embeddings must be at most"},
       }) {
    auto r = ParseModelConfig(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(r.status().message().find(c.message), absl::string_view::npos) << r.status();
  }
}

TEST(ModelConfig, ShardabilityNamesTheNumbers) {
  auto c = ParseModelConfig(R"({"model_type":"llama","vocab_size":64,"hidden_size":64,"intermediate_size":96,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2})");
  ASSERT_TRUE(c.ok());
  v1::ShardConfig s;
  s.set_tensor_parallel_size(2);
  EXPECT_TRUE(CheckShardable(*c, s).ok());
  s.set_tensor_parallel_size(4);  // 2 kv heads cannot split 4 ways
  auto bad = CheckShardable(*c, s);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("2 key/value heads"), absl::string_view::npos) << bad;
  s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);  // q = 2 divides 64, 96 and 4 heads
  EXPECT_TRUE(CheckShardable(*c, s).ok());
  auto opt = ParseModelConfig(R"({"model_type":"opt","vocab_size":64,"hidden_size":64,"ffn_dim":96,
      "num_hidden_layers":2,"num_attention_heads":4,"word_embed_proj_dim":33})");
  ASSERT_TRUE(opt.ok()) << opt.status();
  bad = CheckShardable(*opt, s);
  EXPECT_NE(bad.message().find("word_embed_proj_dim 33 must be divisible by q = 2"), absl::string_view::npos) << bad;
  auto bloom = ParseModelConfig(R"({"model_type":"bloom","vocab_size":64,"n_embed":64,"n_layer":2,"n_head":4})");
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  EXPECT_TRUE(CheckShardable(*bloom, s).ok()) << "ALiBi's slopes go with the heads in every mode";
  auto t5 = ParseModelConfig(R"({"model_type":"t5","vocab_size":64,"d_model":64,"d_kv":16,"d_ff":128,
      "num_layers":2,"num_heads":4})");
  ASSERT_TRUE(t5.ok()) << t5.status();
  EXPECT_TRUE(CheckShardable(*t5, s).ok()) << "every family takes 2d";
  v1::ShardConfig stages;
  stages.set_tensor_parallel_size(1);
  stages.set_pipeline_parallel_size(2);
  EXPECT_TRUE(CheckShardable(*t5, stages).ok()) << "t5 has pipeline stages";
  // 3D splits every linear's outputs q^2 ways, OPT's projections too.
  auto opt_3d = ParseModelConfig(R"({"model_type":"opt","vocab_size":64,"hidden_size":64,"ffn_dim":128,
      "num_hidden_layers":2,"num_attention_heads":4,"word_embed_proj_dim":34})");
  ASSERT_TRUE(opt_3d.ok()) << opt_3d.status();
  v1::ShardConfig three_d;
  three_d.set_tensor_parallel_size(8);
  three_d.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  bad = CheckShardable(*opt_3d, three_d);
  EXPECT_NE(bad.message().find("q*q = 4 ways: word_embed_proj_dim 34 must be divisible by it"),
            absl::string_view::npos)
      << bad;
}

// Two configs of one model have no differences; each field that changes
// the parameters or the computation is named, with both values.
TEST(ModelConfig, ArchitectureDifferencesNameEachFieldThatDiffers) {
  ModelConfig a;
  a.model_type = "gpt2";
  a.hidden_size = 64;
  a.num_layers = 2;
  a.tie_word_embeddings = true;
  a.json = "{}";
  ModelConfig b = a;
  b.json = "{ }";  // the text is not compared
  EXPECT_TRUE(ArchitectureDifferences(a, b).empty());
  b.activation = "gelu";  // the computation, not the parameters
  b.norm_eps = 1e-6;
  EXPECT_TRUE(ArchitectureDifferences(a, b).empty());
  b.num_layers = 1;
  b.tie_word_embeddings = false;
  b.max_positions = 2048;  // a table of positions: parameters
  EXPECT_EQ(ArchitectureDifferences(a, b),
            (std::vector<std::string>{"num_layers 2, not 1", "max_positions 0, not 2048",
                                      "tie_word_embeddings true, not false"}));
  ModelConfig llama = a;
  llama.model_type = "llama";
  ModelConfig longer = llama;
  longer.max_positions = 8192;  // rotary: no table
  longer.rope_theta = 500000;
  EXPECT_TRUE(ArchitectureDifferences(llama, longer).empty());
}

}  // namespace
// An encoder-decoder's stages: the encoder's layers, then the decoder's,
// never one stage across both; by default the stages split between the
// stacks in proportion to their layers.
TEST(PipelineStageLayers, AnEncoderDecodersStagesHoldOneStackEach) {
  auto t5 = ParseModelConfig(R"({"model_type":"t5","vocab_size":64,"d_model":64,"d_kv":16,"d_ff":128,
      "num_layers":6,"num_decoder_layers":3,"num_heads":4})");
  ASSERT_TRUE(t5.ok()) << t5.status();
  auto cut = [&](int pp, int v, std::vector<int> layers = {}) {
    v1::ShardConfig s;
    s.set_tensor_parallel_size(1);
    s.set_pipeline_parallel_size(pp);
    s.set_virtual_stages(v);
    for (int n : layers) s.add_pipeline_stage_layers(n);
    return PipelineStageLayers(*t5, s);
  };
  EXPECT_EQ(*cut(1, 0), (std::vector<int64_t>{9}));
  EXPECT_EQ(*cut(2, 0), (std::vector<int64_t>{6, 3}));        // not 5 and 4: no stage across the stacks
  EXPECT_EQ(*cut(3, 0), (std::vector<int64_t>{3, 3, 3}));     // 2 encoder stages of 3 (6 of 9 layers)
  EXPECT_EQ(*cut(4, 0), (std::vector<int64_t>{2, 2, 2, 3}));   // 3 encoder stages: round(4 * 6 / 9)
  EXPECT_EQ(*cut(2, 2), (std::vector<int64_t>{2, 2, 2, 3}));   // pp * V virtual stages, cut alike
  EXPECT_EQ(*cut(3, 3), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(cut(2, 0, {4, 2, 3}).status().code(), absl::StatusCode::kInvalidArgument);  // 3 stages for pp 2
  EXPECT_EQ(*cut(3, 0, {4, 2, 3}), (std::vector<int64_t>{4, 2, 3}));
  auto across = cut(2, 0, {5, 4});
  ASSERT_EQ(across.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(across.status().message().find("stage 1 (layers 5 to 8) holds both the encoder's and the decoder's"),
            absl::string_view::npos)
      << across.status();
  across = cut(3, 0, {4, 4, 1});
  EXPECT_NE(across.status().message().find("stage 1 (layers 4 to 7)"), absl::string_view::npos) << across.status();
  auto sum = cut(2, 0, {6, 2});
  EXPECT_NE(sum.status().message().find("sum to 8 layers, not the model's 9 (the encoder's 6 and the decoder's 3)"),
            absl::string_view::npos)
      << sum.status();
  EXPECT_EQ(cut(10, 0).status().code(), absl::StatusCode::kInvalidArgument);  // 10 stages, 9 layers
}

}  // namespace colod::shardformer
