#include "worker/shardformer/testing.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/safetensors.h"

namespace colod::shardformer::testing {
namespace {

absl::StatusOr<Tensor> Random(const Shape& shape, uint64_t seed, float scale, float mean = 0) {
  ASSIGN_OR_RETURN(Tensor t, Tensor::RandomNormal(shape, seed));
  std::vector<float> v = t.ToFloats();
  for (float& x : v) x = mean + scale * x;
  return Tensor::FromFloats(shape, v);
}

absl::StatusOr<Tensor> Transposed(const Tensor& t) {
  ASSIGN_OR_RETURN(Tensor v, t.Transpose(0, 1));
  return v.Contiguous();
}

absl::Status WriteDir(const std::string& dir, const std::string& config,
                      const std::vector<std::pair<std::string, Tensor>>& tensors) {
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/config.json") << config;
  return WriteSafetensors(dir + "/model.safetensors", tensors);
}

}  // namespace

Tensor TokenIds(int64_t batch, int64_t seq, int64_t vocab, uint64_t salt) {
  std::vector<int64_t> v(batch * seq);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7 + salt * 13 + i * i * 3) % vocab);
  return *Tensor::FromInt64s({batch, seq}, v);
}

absl::StatusOr<TinyModel> WriteTinyGpt2(const std::string& dir, const TinyOptions& o) {
  TinyModel m;
  m.dir = dir;
  const std::string config = absl::StrCat(
      R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": )", o.vocab,
      R"(, "n_embd": )", o.hidden, R"(, "n_layer": )", o.layers, R"(, "n_head": )", o.heads,
      R"(, "n_positions": )", o.positions, R"(, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"})");
  ASSIGN_OR_RETURN(m.config, ParseModelConfig(config));
  const std::string p = o.prefixed ? "transformer." : "";
  const int64_t h = o.hidden, f = 4 * o.hidden;
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t seed = o.seed * 1000;
  auto add = [&](const std::string& name, const Shape& shape, float scale, float mean = 0) -> absl::Status {
    ASSIGN_OR_RETURN(Tensor t, Random(shape, ++seed, scale, mean));
    tensors.emplace_back(name, t);
    m.tensors[name] = t;
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(add(p + "wte.weight", {o.vocab, h}, 0.5f));
  RETURN_IF_ERROR(add(p + "wpe.weight", {o.positions, h}, 0.1f));
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string b = absl::StrCat(p, "h.", i, ".");
    RETURN_IF_ERROR(add(b + "ln_1.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "ln_1.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_attn.weight", {h, 3 * h}, 0.15f));
    RETURN_IF_ERROR(add(b + "attn.c_attn.bias", {3 * h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_proj.weight", {h, h}, 0.1f));
    RETURN_IF_ERROR(add(b + "attn.c_proj.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "ln_2.weight", {h}, 0.1f, 1.0f));
    RETURN_IF_ERROR(add(b + "ln_2.bias", {h}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_fc.weight", {h, f}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_fc.bias", {f}, 0.1f));
    RETURN_IF_ERROR(add(b + "mlp.c_proj.weight", {f, h}, 0.05f));
    RETURN_IF_ERROR(add(b + "mlp.c_proj.bias", {h}, 0.1f));
  }
  RETURN_IF_ERROR(add(p + "ln_f.weight", {h}, 0.1f, 1.0f));
  RETURN_IF_ERROR(add(p + "ln_f.bias", {h}, 0.1f));
  RETURN_IF_ERROR(WriteDir(dir, config, tensors));
  return m;
}

absl::StatusOr<Reference> ReferenceGpt2(const TinyModel& m, const Tensor& ids) {
  const ModelConfig& c = m.config;
  // Checkpoint names with or without the "transformer." prefix.
  const std::string p = m.tensors.count("wte.weight") ? "" : "transformer.";
  std::map<std::string, Variable> leaves;
  std::set<std::string> conv1d;  // held transposed: x @ W = Linear(x, W^T)
  auto leaf = [&](const std::string& name) -> absl::StatusOr<Variable> {
    auto it = leaves.find(name);
    if (it != leaves.end()) return it->second;
    auto t = m.tensors.find(name);
    if (t == m.tensors.end()) return absl::NotFoundError(name);
    Tensor value = t->second;
    if (conv1d.count(name)) {
      ASSIGN_OR_RETURN(value, Transposed(value));
    }
    return leaves.emplace(name, Variable(value, true)).first->second;
  };
  auto conv = [&](const Variable& x, const std::string& name) -> absl::StatusOr<Variable> {
    conv1d.insert(name + ".weight");
    ASSIGN_OR_RETURN(Variable w, leaf(name + ".weight"));
    ASSIGN_OR_RETURN(Variable b, leaf(name + ".bias"));
    return nn::Linear(x, w, b);
  };
  auto norm = [&](const Variable& x, const std::string& name) -> absl::StatusOr<Variable> {
    ASSIGN_OR_RETURN(Variable g, leaf(name + ".weight"));
    ASSIGN_OR_RETURN(Variable b, leaf(name + ".bias"));
    return nn::LayerNorm(x, g, b, static_cast<float>(c.norm_eps));
  };
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1], h = c.hidden_size, nh = c.num_heads,
                d = c.head_dim();
  std::vector<int64_t> pos(batch * seq);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i) % seq;
  ASSIGN_OR_RETURN(Tensor positions, Tensor::FromInt64s({batch, seq}, pos));
  ASSIGN_OR_RETURN(Variable wte, leaf(p + "wte.weight"));
  ASSIGN_OR_RETURN(Variable wpe, leaf(p + "wpe.weight"));
  ASSIGN_OR_RETURN(Variable tok, nn::Embedding(wte, ids));
  ASSIGN_OR_RETURN(Variable where, nn::Embedding(wpe, positions));
  ASSIGN_OR_RETURN(Variable x, Add(tok, where));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string b = absl::StrCat(p, "h.", l, ".");
    ASSIGN_OR_RETURN(Variable hn, norm(x, b + "ln_1"));
    ASSIGN_OR_RETURN(Variable qkv, conv(hn, b + "attn.c_attn"));  // [B, S, 3H]: q | k | v
    Variable parts[3];
    for (int i = 0; i < 3; ++i) {
      ASSIGN_OR_RETURN(Variable part, nn::Narrow(qkv, 2, i * h, h));
      ASSIGN_OR_RETURN(parts[i], nn::Reshape(part, {batch, seq, nh, d}));
    }
    ASSIGN_OR_RETURN(Variable att, nn::CausalAttention(parts[0], parts[1], parts[2], 1.0f / std::sqrt(float(d))));
    ASSIGN_OR_RETURN(att, nn::Reshape(att, {batch, seq, h}));
    ASSIGN_OR_RETURN(Variable a, conv(att, b + "attn.c_proj"));
    ASSIGN_OR_RETURN(x, Add(x, a));
    ASSIGN_OR_RETURN(Variable hn2, norm(x, b + "ln_2"));
    ASSIGN_OR_RETURN(Variable fc, conv(hn2, b + "mlp.c_fc"));
    ASSIGN_OR_RETURN(Variable g, nn::Gelu(fc, kernels::GeluApprox::kTanh));
    ASSIGN_OR_RETURN(Variable mo, conv(g, b + "mlp.c_proj"));
    ASSIGN_OR_RETURN(x, Add(x, mo));
  }
  ASSIGN_OR_RETURN(x, norm(x, p + "ln_f"));
  ASSIGN_OR_RETURN(Variable logits, nn::Linear(x, wte, std::nullopt));  // tied head
  // Mean next-token loss: positions 0..S-2 predict ids 1..S-1.
  ASSIGN_OR_RETURN(Variable shifted, nn::Narrow(logits, 1, 0, seq - 1));
  ASSIGN_OR_RETURN(shifted, nn::Reshape(shifted, {batch * (seq - 1), c.vocab_size}));
  ASSIGN_OR_RETURN(Tensor next, ids.Narrow(1, 1, seq - 1));
  ASSIGN_OR_RETURN(Tensor labels, next.Contiguous().Reshape({batch * (seq - 1)}));
  ASSIGN_OR_RETURN(Variable ce, nn::CrossEntropy(shifted, labels));
  ASSIGN_OR_RETURN(Variable total, Sum(ce));
  ASSIGN_OR_RETURN(Variable loss, Scale(total, 1.0f / static_cast<float>(batch * (seq - 1))));
  RETURN_IF_ERROR(Backward(loss));
  Reference r;
  r.logits = logits.value();
  r.loss = loss.value().ToFloats()[0];
  for (const auto& [name, v] : leaves) {
    if (!v.grad().has_value()) return absl::InternalError(absl::StrCat(name, " got no gradient"));
    Tensor g = *v.grad();
    if (conv1d.count(name)) {
      ASSIGN_OR_RETURN(g, Transposed(g));
    }
    r.grads[name] = g;
  }
  return r;
}

}  // namespace colod::shardformer::testing
