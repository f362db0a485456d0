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
#include "worker/shardformer/model_config.h"
#include "worker/shardformer/safetensors.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer {

absl::Status WriteInitializedGpt2(const std::string& dir, const Gpt2Shape& s, uint64_t seed) {
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
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t stream = seed * 1000003;
  const float residual = 0.02f / std::sqrt(2.0f * static_cast<float>(s.num_layers));
  auto normal = [&](const std::string& name, const Shape& shape, float std) -> absl::Status {
    ASSIGN_OR_RETURN(Tensor t, Tensor::RandomNormal(shape, ++stream));
    ASSIGN_OR_RETURN(t, Scale(t, std));
    tensors.emplace_back(name, std::move(t));
    return absl::OkStatus();
  };
  auto constant = [&](const std::string& name, const Shape& shape, float value) -> absl::Status {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    ASSIGN_OR_RETURN(Tensor t, Tensor::FromFloats(shape, std::vector<float>(n, value)));
    tensors.emplace_back(name, std::move(t));
    return absl::OkStatus();
  };
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
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  RETURN_IF_ERROR(WriteSafetensors(dir + "/model.safetensors", tensors));
  return WriteFileAtomically(dir + "/config.json", text + "\n");
}

}  // namespace colod::shardformer
