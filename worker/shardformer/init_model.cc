#include "worker/shardformer/init_model.h"

#include <cmath>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "spec/model_config.h"
#include "worker/shardformer/safetensors.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer {
namespace {

// A new model's tensors, in order, each from its own seeded Philox stream.
class Tensors {
 public:
  explicit Tensors(uint64_t seed) : stream_(seed * 1000003) {}

  absl::Status Normal(const std::string& name, const Shape& shape, float std) {
    ASSIGN_OR_RETURN(Tensor t, Tensor::RandomNormal(shape, ++stream_));
    ASSIGN_OR_RETURN(t, Scale(t, std));
    tensors_.emplace_back(name, std::move(t));
    return absl::OkStatus();
  }

  absl::Status Constant(const std::string& name, const Shape& shape, float value) {
    ASSIGN_OR_RETURN(Tensor t, Tensor::FromFloats(shape, std::vector<float>(NumElements(shape), value)));
    tensors_.emplace_back(name, std::move(t));
    return absl::OkStatus();
  }

  // DIR/model.safetensors, then DIR/config.json (`config`), each atomically.
  absl::Status Write(const std::string& dir, const std::string& config) const {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
    // {"format": "pt"}, as consolidation writes: transformers' loader of
    // some releases reads the metadata's format without a check for none.
    RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors_, {{"format", "pt"}}));
    return WriteFileAtomically(dir + "/config.json", config + "\n");
  }

 private:
  uint64_t stream_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

}  // namespace

absl::Status WriteInitializedGpt2(const std::string& dir, const Gpt2Shape& s, uint64_t seed) {
  for (const char* name : {"/model.safetensors", "/config.json"}) RETURN_IF_ERROR(CheckReplaceable(dir + name));
  const nlohmann::json config = {{"model_type", "gpt2"},
                                 {"architectures", {"GPT2LMHeadModel"}},
                                 {"vocab_size", s.vocab_size},
                                 {"n_embd", s.hidden_size},
                                 {"n_layer", s.num_layers},
                                 {"n_head", s.num_heads},
                                 {"n_positions", s.max_positions},
                                 {"layer_norm_epsilon", 1e-5},
                                 {"activation_function", "gelu_new"},
                                 {"initializer_range", 0.02},
                                 {"tie_word_embeddings", true}};
  const std::string text = config.dump(2);
  RETURN_IF_ERROR(ParseModelConfig(text).status());  // names the field that does not fit
  if (s.num_layers < 1 || s.max_positions < 1 || s.vocab_size < 1) {
    return absl::InvalidArgumentError("vocab_size, n_layer and n_positions must be >= 1");
  }
  Tensors t(seed);
  const float residual = 0.02f / std::sqrt(2.0f * static_cast<float>(s.num_layers));
  auto normal = [&](const std::string& name, const Shape& shape, float std) { return t.Normal(name, shape, std); };
  auto constant = [&](const std::string& name, const Shape& shape, float v) { return t.Constant(name, shape, v); };
  const int64_t h = s.hidden_size, f = 4 * s.hidden_size;
  RETURN_IF_ERROR(normal("transformer.wte.weight", {s.vocab_size, h}, 0.02f));
  RETURN_IF_ERROR(normal("transformer.wpe.weight", {s.max_positions, h}, 0.02f));
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string b = absl::StrCat("transformer.h.", i, ".");
    RETURN_IF_ERROR(constant(b + "ln_1.weight", {h}, 1.0f));
    RETURN_IF_ERROR(constant(b + "ln_1.bias", {h}, 0.0f));
    RETURN_IF_ERROR(normal(b + "attn.c_attn.weight", {h, 3 * h}, 0.02f));  // Conv1D: [in, out]
    RETURN_IF_ERROR(constant(b + "attn.c_attn.bias", {3 * h}, 0.0f));
    RETURN_IF_ERROR(normal(b + "attn.c_proj.weight", {h, h}, residual));
    RETURN_IF_ERROR(constant(b + "attn.c_proj.bias", {h}, 0.0f));
    RETURN_IF_ERROR(constant(b + "ln_2.weight", {h}, 1.0f));
    RETURN_IF_ERROR(constant(b + "ln_2.bias", {h}, 0.0f));
    RETURN_IF_ERROR(normal(b + "mlp.c_fc.weight", {h, f}, 0.02f));
    RETURN_IF_ERROR(constant(b + "mlp.c_fc.bias", {f}, 0.0f));
    RETURN_IF_ERROR(normal(b + "mlp.c_proj.weight", {f, h}, residual));
    RETURN_IF_ERROR(constant(b + "mlp.c_proj.bias", {h}, 0.0f));
  }
  RETURN_IF_ERROR(constant("transformer.ln_f.weight", {h}, 1.0f));
  RETURN_IF_ERROR(constant("transformer.ln_f.bias", {h}, 0.0f));
  return t.Write(dir, text);
}

absl::Status WriteInitializedLlama(const std::string& dir, const LlamaShape& s, uint64_t seed) {
  const nlohmann::json config = {{"model_type", "llama"},
                                 {"architectures", {"LlamaForCausalLM"}},
                                 {"vocab_size", s.vocab_size},
                                 {"hidden_size", s.hidden_size},
                                 {"num_hidden_layers", s.num_layers},
                                 {"num_attention_heads", s.num_heads},
                                 {"num_key_value_heads", s.num_kv_heads},
                                 {"intermediate_size", s.intermediate_size},
                                 {"max_position_embeddings", s.max_positions},
                                 {"rms_norm_eps", 1e-6},
                                 {"rope_theta", 10000.0},
                                 {"hidden_act", "silu"},
                                 {"initializer_range", 0.02},
                                 {"tie_word_embeddings", false}};
  const std::string text = config.dump(2);
  RETURN_IF_ERROR(ParseModelConfig(text).status());  // names the field that does not fit
  if (s.num_layers < 1 || s.max_positions < 1 || s.vocab_size < 1 || s.intermediate_size < 1 ||
      s.num_kv_heads < 1 || s.num_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        "vocab_size, num_hidden_layers, intermediate_size and max_position_embeddings must be >= 1, and "
        "num_attention_heads a multiple of num_key_value_heads");
  }
  Tensors t(seed);
  const int64_t h = s.hidden_size, kv = s.num_kv_heads * (h / s.num_heads), f = s.intermediate_size;
  RETURN_IF_ERROR(t.Normal("model.embed_tokens.weight", {s.vocab_size, h}, 0.02f));
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string b = absl::StrCat("model.layers.", i, ".");
    RETURN_IF_ERROR(t.Constant(b + "input_layernorm.weight", {h}, 1.0f));
    RETURN_IF_ERROR(t.Normal(b + "self_attn.q_proj.weight", {h, h}, 0.02f));  // Linear: [out, in]
    RETURN_IF_ERROR(t.Normal(b + "self_attn.k_proj.weight", {kv, h}, 0.02f));
    RETURN_IF_ERROR(t.Normal(b + "self_attn.v_proj.weight", {kv, h}, 0.02f));
    RETURN_IF_ERROR(t.Normal(b + "self_attn.o_proj.weight", {h, h}, 0.02f));
    RETURN_IF_ERROR(t.Constant(b + "post_attention_layernorm.weight", {h}, 1.0f));
    RETURN_IF_ERROR(t.Normal(b + "mlp.gate_proj.weight", {f, h}, 0.02f));
    RETURN_IF_ERROR(t.Normal(b + "mlp.up_proj.weight", {f, h}, 0.02f));
    RETURN_IF_ERROR(t.Normal(b + "mlp.down_proj.weight", {h, f}, 0.02f));
  }
  RETURN_IF_ERROR(t.Constant("model.norm.weight", {h}, 1.0f));
  RETURN_IF_ERROR(t.Normal("lm_head.weight", {s.vocab_size, h}, 0.02f));
  return t.Write(dir, text);
}

}  // namespace colod::shardformer
