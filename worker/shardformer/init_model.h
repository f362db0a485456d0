// New models from scratch: a Hugging Face directory (config.json +
// model.safetensors) with the family's published initialization, for
// training from scratch and for the demo (`coloctl init-model`).
#ifndef COLOD_WORKER_SHARDFORMER_INIT_MODEL_H_
#define COLOD_WORKER_SHARDFORMER_INIT_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace colod::shardformer {

struct Gpt2Shape {
  int64_t vocab_size = 257;  // byte-level text plus one
  int64_t hidden_size = 64;  // n_embd
  int64_t num_layers = 2;    // n_layer
  int64_t num_heads = 4;     // n_head
  int64_t max_positions = 64;
};

// Writes DIR/config.json and DIR/model.safetensors of a GPT2LMHeadModel
// initialized as transformers' GPT2PreTrainedModel._init_weights does:
// weights N(0, 0.02), the residual projections (attn.c_proj, mlp.c_proj)
// N(0, 0.02 / sqrt(2 * n_layer)), biases 0, LayerNorm weight 1 and bias 0;
// the values come from the seeded Philox streams, so a seed gives the same
// model everywhere. INVALID_ARGUMENT for sizes that do not fit (hidden not
// divisible by heads, a size < 1); the directory is created if missing.
absl::Status WriteInitializedGpt2(const std::string& dir, const Gpt2Shape& shape, uint64_t seed);

struct LlamaShape {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 2048;
  int64_t num_layers = 16;
  int64_t num_heads = 16;
  int64_t num_kv_heads = 16;  // fewer: grouped-query attention
  int64_t intermediate_size = 5632;
  int64_t max_positions = 2048;
};

// The same for a LlamaForCausalLM (untied head, rope_theta 10000): every
// Linear and the embedding N(0, 0.02), the RMSNorm weights 1, as
// transformers' LlamaPreTrainedModel._init_weights does. INVALID_ARGUMENT
// for sizes that do not fit (as ParseModelConfig names them).
absl::Status WriteInitializedLlama(const std::string& dir, const LlamaShape& shape, uint64_t seed);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_INIT_MODEL_H_
