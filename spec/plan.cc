#include "spec/plan.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/int_math.h"
#include "common/status_macros.h"
#include "spec/mesh.h"

namespace colod {
namespace {

using Role = LeafRole;


int64_t CeilDiv(int64_t a, int64_t b) { return b <= 1 ? a : a / b + (a % b != 0 ? 1 : 0); }

// The families' leaves, as their Build functions make them and their
// policies replace them.
class Leaves {
 public:
  explicit Leaves(int64_t layers) : layers_(layers) {}
  // A leaf once in the model.
  Leaves& Model(std::string name, Role role, int64_t in, int64_t out, bool bias = false) {
    return Add(std::move(name), role, 1, in, out, bias);
  }
  // A leaf in every layer.
  Leaves& Layer(std::string name, Role role, int64_t in, int64_t out, bool bias = false) {
    return Add(std::move(name), role, layers_, in, out, bias);
  }
  Leaves& Add(std::string name, Role role, int64_t count, int64_t in, int64_t out, bool bias) {
    PlanLeaf l;
    l.name = std::move(name);
    l.role = role;
    l.count = count;
    l.in = in;
    l.out = out;
    l.bias = bias;
    leaves_.push_back(std::move(l));
    return *this;
  }
  // A native tensor of `elements` (a product the caller computed checked).
  Leaves& Whole(std::string name, int64_t count, std::initializer_list<int64_t> shape) {
    PlanLeaf l;
    l.name = std::move(name);
    l.role = Role::kWhole;
    l.count = count;
    const std::optional<int64_t> e = CheckedProduct(shape);
    if (!e.has_value()) overflow_ = true;
    l.elements_each = e.value_or(0);
    l.shape = shape;
    leaves_.push_back(std::move(l));
    return *this;
  }
  PlanLeaf& back() { return leaves_.back(); }
  // The last leaf's module kind.
  Leaves& As(LeafKind kind) {
    leaves_.back().kind = kind;
    return *this;
  }
  // The last leaf is a child of the root's tree, not of the base model's
  // (BERT's MLM head).
  Leaves& OnRoot() {
    leaves_.back().on_root = true;
    return *this;
  }
  // An LM head, a child of the root; tied to the table at `tied_to` (a path
  // under the base model) for kTiedHead.
  Leaves& Head(std::string name, Role role, int64_t in, int64_t out, std::string tied_to = "") {
    Add(std::move(name), role, 1, in, out, false);
    leaves_.back().on_root = true;
    leaves_.back().tied_to = std::move(tied_to);
    return As(LeafKind::kLinear);
  }
  // Checked arithmetic on the config's sizes; an overflow fails Done().
  int64_t Mul(std::initializer_list<int64_t> factors) {
    const std::optional<int64_t> p = CheckedProduct(factors);
    if (!p.has_value()) overflow_ = true;
    return p.value_or(0);
  }
  int64_t Plus(int64_t a, int64_t b) {
    const std::optional<int64_t> s = CheckedAdd(a, b);
    if (!s.has_value()) overflow_ = true;
    return s.value_or(0);
  }
  absl::StatusOr<std::vector<PlanLeaf>> Done(const std::string& model_type) {
    if (overflow_) return absl::InvalidArgumentError(absl::StrCat("the ", model_type, " model's sizes overflow"));
    return std::move(leaves_);
  }

 private:
  int64_t layers_;
  bool overflow_ = false;
  std::vector<PlanLeaf> leaves_;
};

}  // namespace

namespace {

// gpt2's leaves, as its policy shards them.
void Gpt2Leaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size, p = c.max_positions;
  m.Model("wte", Role::kVocabTable, v, h).As(K::kEmbedding);
  m.Model("wpe", Role::kPositions, p, h).As(K::kEmbedding);
  m.Layer("h.*.ln_1", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("h.*.attn.c_attn", Role::kColumn, h, m.Mul({3, h}), true).As(K::kConv1D);
  m.back().fused = 3;  // q|k|v: three Linear2D in 2D
  m.Layer("h.*.attn.c_proj", Role::kRow, h, h, true).As(K::kConv1D);
  m.Layer("h.*.ln_2", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("h.*.mlp.c_fc", Role::kColumn, h, f, true).As(K::kConv1D);
  m.Layer("h.*.mlp.c_proj", Role::kRow, f, h, true).As(K::kConv1D);
  m.Model("ln_f", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Head("lm_head", Role::kTiedHead, h, v, "wte");
}

// llama's leaves, as its policy shards them.
void LlamaLeaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size;
  const int64_t kv = m.Mul({c.num_kv_heads, c.head_dim()});
  m.Model("embed_tokens", Role::kVocabTable, v, h).As(K::kEmbedding);
  m.Layer("layers.*.input_layernorm", Role::kNorm, 0, h).As(K::kRmsNorm);
  m.Layer("layers.*.self_attn.q_proj", Role::kColumn, h, h).As(K::kLinear);
  m.Layer("layers.*.self_attn.k_proj", Role::kColumn, h, kv).As(K::kLinear);
  m.Layer("layers.*.self_attn.v_proj", Role::kColumn, h, kv).As(K::kLinear);
  m.Layer("layers.*.self_attn.o_proj", Role::kRow, h, h).As(K::kLinear);
  m.Layer("layers.*.post_attention_layernorm", Role::kNorm, 0, h).As(K::kRmsNorm);
  m.Layer("layers.*.mlp.gate_proj", Role::kColumn, h, f).As(K::kLinear);
  m.Layer("layers.*.mlp.up_proj", Role::kColumn, h, f).As(K::kLinear);
  m.Layer("layers.*.mlp.down_proj", Role::kRow, f, h).As(K::kLinear);
  m.Model("norm", Role::kNorm, 0, h).As(K::kRmsNorm);
  if (c.tie_word_embeddings) {
    m.Head("lm_head", Role::kTiedHead, h, v, "embed_tokens");
  } else {
    m.Head("lm_head", Role::kVocabHead, h, v);
  }
}

// bert's leaves, as its policy shards them.
void BertLeaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size, p = c.max_positions;
  m.Model("embeddings.word_embeddings", Role::kVocabTable, v, h).As(K::kEmbedding);
  m.Model("embeddings.position_embeddings", Role::kPositions, p, h).As(K::kEmbedding);
  m.Model("embeddings.token_type_embeddings", Role::kPositions, c.type_vocab_size, h).As(K::kEmbedding);
  m.Model("embeddings.LayerNorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.back().sequence_split = false;  // the embeddings stay whole under sequence parallelism
  for (const char* proj : {"query", "key", "value"}) {
    m.Layer(absl::StrCat("encoder.layer.*.attention.self.", proj), Role::kColumn, h, h, true).As(K::kLinear);
  }
  m.Layer("encoder.layer.*.attention.output.dense", Role::kRow, h, h, true).As(K::kLinear);
  m.Layer("encoder.layer.*.attention.output.LayerNorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("encoder.layer.*.intermediate.dense", Role::kColumn, h, f, true).As(K::kLinear);
  m.Layer("encoder.layer.*.output.dense", Role::kRow, f, h, true).As(K::kLinear);
  m.Layer("encoder.layer.*.output.LayerNorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Model("cls.predictions.transform.dense", Role::kProjection, h, h, true).As(K::kLinear).OnRoot();
  m.Model("cls.predictions.transform.LayerNorm", Role::kNorm, 0, h, true).As(K::kLayerNorm).OnRoot();
  m.back().sequence_split = false;  // the MLM transform runs on the whole sequence
  m.Head("cls.predictions.decoder", Role::kTiedHead, h, v, "embeddings.word_embeddings");
  m.Model("cls.predictions.bias", Role::kVocabBias, 0, v).As(K::kBias).OnRoot();
}

// opt's leaves, as its policy shards them.
void OptLeaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size, p = c.max_positions;
  const int64_t e = c.embed_dim;
  const bool b = c.linear_bias;
  m.Model("embed_tokens", Role::kVocabTable, v, e).As(K::kEmbedding);
  m.Model("embed_positions", Role::kPositions, m.Plus(p, c.position_offset), h).As(K::kEmbedding);
  if (e != h) m.Model("project_in", Role::kProjection, e, h).As(K::kLinear);
  for (const char* proj : {"q_proj", "k_proj", "v_proj"}) {
    m.Layer(absl::StrCat("layers.*.self_attn.", proj), Role::kColumn, h, h, b).As(K::kLinear);
  }
  m.Layer("layers.*.self_attn.out_proj", Role::kRow, h, h, b).As(K::kLinear);
  m.Layer("layers.*.self_attn_layer_norm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("layers.*.fc1", Role::kColumn, h, f, b).As(K::kLinear);
  m.Layer("layers.*.fc2", Role::kRow, f, h, b).As(K::kLinear);
  m.Layer("layers.*.final_layer_norm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  if (c.final_norm) m.Model("final_layer_norm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  if (e != h) m.Model("project_out", Role::kProjection, h, e).As(K::kLinear);
  if (c.tie_word_embeddings) {
    m.Head("lm_head", Role::kTiedHead, e, v, "embed_tokens");
  } else {
    m.Head("lm_head", Role::kVocabHead, e, v);
  }
}

// bloom's leaves, as its policy shards them.
void BloomLeaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size;
  m.Model("word_embeddings", Role::kVocabTable, v, h).As(K::kEmbedding);
  m.Model("word_embeddings_layernorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.back().sequence_split = false;  // normalizes the embeddings before the split
  m.Layer("h.*.input_layernorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  // q|k|v laid out per head: column-parallel as it is (no n_fused).
  m.Layer("h.*.self_attention.query_key_value", Role::kColumn, h, m.Mul({3, h}), true).As(K::kLinear);
  m.Layer("h.*.self_attention.dense", Role::kRow, h, h, true).As(K::kLinear);
  m.Layer("h.*.post_attention_layernorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("h.*.mlp.dense_h_to_4h", Role::kColumn, h, f, true).As(K::kLinear);
  m.Layer("h.*.mlp.dense_4h_to_h", Role::kRow, f, h, true).As(K::kLinear);
  m.Model("ln_f", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  if (c.tie_word_embeddings) {
    m.Head("lm_head", Role::kTiedHead, h, v, "word_embeddings");
  } else {
    m.Head("lm_head", Role::kVocabHead, h, v);
  }
}

// vit's leaves, as its policy shards them.
void VitLeaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size, p = c.max_positions;
  const int64_t ch = c.num_channels, patch = c.patch_size;
  const bool b = c.linear_bias;
  m.Whole("embeddings.cls_token", 1, {1, 1, h}).As(K::kParameter);
  m.Whole("embeddings.position_embeddings", 1, {1, p, h}).As(K::kParameter);
  // The patches' Conv2d: weight [h, channels, patch, patch] and a bias.
  const int64_t pixels = m.Mul({ch, patch, patch});
  m.Whole("embeddings.patch_embeddings.projection", 1, {h, m.Plus(pixels, 1)}).As(K::kPatchEmbedding);
  m.back().shape = {h, ch, patch, patch};
  m.back().in = pixels;
  m.back().out = h;
  m.back().bias = true;
  m.Layer("encoder.layer.*.layernorm_before", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  for (const char* proj : {"query", "key", "value"}) {
    m.Layer(absl::StrCat("encoder.layer.*.attention.attention.", proj), Role::kColumn, h, h, b).As(K::kLinear);
  }
  m.Layer("encoder.layer.*.attention.output.dense", Role::kRow, h, h, true).As(K::kLinear);
  m.Layer("encoder.layer.*.layernorm_after", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  m.Layer("encoder.layer.*.intermediate.dense", Role::kColumn, h, f, true).As(K::kLinear);
  m.Layer("encoder.layer.*.output.dense", Role::kRow, f, h, true).As(K::kLinear);
  m.Model("layernorm", Role::kNorm, 0, h, true).As(K::kLayerNorm);
  // The classifier, replicated: [labels, h] and its bias.
  m.Whole("classifier", 1, {v, m.Plus(h, 1)}).As(K::kLinear).OnRoot();
  m.back().in = h;
  m.back().out = v;
  m.back().bias = true;
}

// t5's leaves, as its policy shards them.
void T5Leaves(const ModelConfig& c, Leaves& m) {
  using K = LeafKind;
  const int64_t h = c.hidden_size, f = c.intermediate_size, v = c.vocab_size;
  const int64_t inner = m.Mul({c.num_heads, c.kv_dim});
  const bool gated = c.activation == "gated-gelu";
  m.Model("shared", Role::kVocabTable, v, h).As(K::kEmbedding);
  m.back().lookups = 2;  // the encoder's and the decoder's inputs
  for (const bool decoder : {false, true}) {
    const std::string stack = decoder ? "decoder" : "encoder";
    const int64_t n = decoder ? c.num_decoder_layers : c.num_layers;  // each at most kMaxLayers
    auto layer = [&](const std::string& name, Role role, int64_t in, int64_t out, K kind) {
      m.Add(absl::StrCat(stack, ".block.*.layer.", name), role, n, in, out, false).As(kind);
    };
    // Self-attention in every block, cross-attention in the decoder's, then
    // the feed-forward; each sublayer's norm after it.
    std::vector<std::string> attentions = {"0.SelfAttention"};
    if (decoder) attentions.push_back("1.EncDecAttention");
    for (size_t a = 0; a < attentions.size(); ++a) {
      for (const char* proj : {"q", "k", "v"}) layer(attentions[a] + "." + proj, Role::kColumn, h, inner, K::kLinear);
      layer(attentions[a] + ".o", Role::kRow, inner, h, K::kLinear);
      layer(absl::StrCat(a, ".layer_norm"), Role::kNorm, 0, h, K::kRmsNorm);
    }
    const std::string ff = absl::StrCat(attentions.size(), ".");
    for (const char* wi : gated ? std::vector<const char*>{"wi_0", "wi_1"} : std::vector<const char*>{"wi"}) {
      layer(ff + "DenseReluDense." + wi, Role::kColumn, h, f, K::kLinear);
    }
    layer(ff + "DenseReluDense.wo", Role::kRow, f, h, K::kLinear);
    layer(ff + "layer_norm", Role::kNorm, 0, h, K::kRmsNorm);
    // Block 0's relative position bias table [buckets, heads], replicated.
    m.Whole(stack + ".block.0.layer.0.SelfAttention.relative_attention_bias", 1, {c.relative_buckets, c.num_heads})
        .As(K::kEmbedding);
    m.back().in = c.relative_buckets;
    m.back().out = c.num_heads;
    m.Model(stack + ".final_layer_norm", Role::kNorm, 0, h).As(K::kRmsNorm);
  }
  if (c.tie_word_embeddings) {
    m.Head("lm_head", Role::kTiedHead, h, v, "shared");
  } else {
    m.Head("lm_head", Role::kVocabHead, h, v);
  }
}

// Each built-in family's layers, in its checkpoint's names.
struct LeafTable {
  const char* model_type;
  void (*leaves)(const ModelConfig& c, Leaves& m);
};
constexpr LeafTable kLeafTables[] = {
    {"gpt2", Gpt2Leaves},
    {"llama", LlamaLeaves},
    {"bert", BertLeaves},
    {"opt", OptLeaves},
    {"bloom", BloomLeaves},
    {"vit", VitLeaves},
    {"t5", T5Leaves},
};

}  // namespace

absl::StatusOr<std::vector<PlanLeaf>> PlanLeaves(const ModelConfig& c) {
  Leaves m(c.num_layers);
  for (const LeafTable& t : kLeafTables) {
    if (c.model_type != t.model_type) continue;
    t.leaves(c, m);
    return m.Done(c.model_type);
  }
  return absl::InvalidArgumentError(absl::StrCat("no plan for model_type '", c.model_type, "'"));
}

absl::StatusOr<double> TrainFlopsPerToken(const ModelConfig& c, int64_t seq_len) {
  if (c.model_type == "t5") {
    return absl::UnimplementedError("no FLOPs per token for an encoder-decoder (t5): its inputs and targets differ");
  }
  if (seq_len < 1) return absl::InvalidArgumentError(absl::StrCat("seq_len must be >= 1, got ", seq_len));
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(c));
  const bool vit = c.model_type == "vit";
  const double s = static_cast<double>(vit ? c.max_positions : seq_len);
  // A matrix's FLOPs per token are 2 per weight (and 1 per bias, counted
  // as a weight as PaLM's N does); training 3x that (forward, input and
  // weight gradients).
  double per_token = 0, per_patch = 0, per_image = 0;
  for (const PlanLeaf& l : leaves) {
    const double weights = static_cast<double>(l.in) * static_cast<double>(l.out) + (l.bias ? l.out : 0);
    switch (l.role) {
      case LeafRole::kColumn:
      case LeafRole::kRow:
      case LeafRole::kVocabHead:
      case LeafRole::kProjection:
      case LeafRole::kTiedHead:
        per_token += 6 * weights * static_cast<double>(l.count);
        break;
      case LeafRole::kWhole:
        if (l.kind == LeafKind::kPatchEmbedding) per_patch += 6 * weights;
        if (l.kind == LeafKind::kLinear) per_image += 6 * weights;  // ViT's classifier, on the CLS token
        break;
      default:
        break;  // lookups, norms, biases added to the vocabulary
    }
  }
  const double width = static_cast<double>(c.num_heads) * static_cast<double>(c.head_dim());
  per_token += 12 * static_cast<double>(c.num_layers) * s * width;
  if (!vit) return per_token;
  return s * per_token + (s - 1) * per_patch + per_image;
}

double PeakFlopsOf(const v1::JobSpec& spec, const std::vector<v1::WorkerInfo>& devices) {
  return PeakFlopsOf(spec.train().precision(), spec.train().allow_tf32(), devices);
}

double PeakFlopsOf(v1::Precision precision, bool tf32, const std::vector<v1::WorkerInfo>& devices) {
  double sum = 0;
  for (const v1::WorkerInfo& d : devices) {
    const v1::DevicePeak& p = d.peak();
    double peak = 0;
    switch (precision) {
      case v1::PRECISION_BF16_MIXED:
        peak = p.bf16();
        break;
      case v1::PRECISION_FP16_MIXED:
        peak = p.f16();
        break;
      case v1::PRECISION_FP32:
        peak = tf32 ? p.tf32() : p.f32();
        break;
      default:  // the trainer's default: bf16 on a GPU, f32 on a CPU
        peak = d.device_kind() == v1::DEVICE_KIND_CUDA ? p.bf16() : tf32 ? p.tf32() : p.f32();
        break;
    }
    if (!(peak > 0) || !std::isfinite(peak)) return 0;
    sum += peak;
  }
  return std::isfinite(sum) ? sum : 0;
}

namespace {

// How the layout splits: 1D over t ranks (with the vocabulary padded to
// pad * t rows), 2D/2.5D blocks of q x q, or 3D (worker/nn/linear3d.h):
// weights in q^3 blocks, activations' rows q^2 ways and features q ways.
struct Split {
  bool two_d = false;
  bool three_d = false;
  int64_t t = 1;    // 1D: tp
  int64_t q = 1;    // 2D/2.5D/3D
  int64_t depth = 1;  // 2.5D: the activations' rows split depth ways more
  int64_t pad = 64;   // make_vocab_size_divisible_by (ShardConfig's)
  bool blocks() const { return two_d || three_d; }
  bool sharded() const { return blocks() ? q > 1 : t > 1; }
  // The padded vocabulary's rows on one rank (1D).
  int64_t VocabRows(int64_t vocab) const {
    if (!sharded() || blocks()) return vocab;
    const int64_t multiple = pad * t;
    return CeilDiv(vocab, multiple) * pad;  // ceil(vocab / (pad t)) * pad t rows, a 1/t of them
  }
};

// The elements of one leaf on one rank.
absl::StatusOr<int64_t> RankElements(const PlanLeaf& l, const Split& s) {
  CheckedSum n;
  const int64_t bias = l.bias ? 1 : 0;
  const int64_t t = s.sharded() && !s.blocks() ? s.t : 1;
  const int64_t q = s.sharded() && s.blocks() ? s.q : 1;
  switch (l.role) {
    case Role::kWhole:
      n.Add({l.elements_each});
      break;
    case Role::kNorm:
      n.Add({1 + bias, CeilDiv(l.out, q)});
      break;
    case Role::kColumn:
    case Role::kRow:
    case Role::kProjection:
      if (s.three_d) {
        // Each part [q, o/q, in] in blocks [1, o/q^2, in/q]; its bias [q, o/q] split over K.
        n.Add({l.fused, CeilDiv(l.out / l.fused, q * q), CeilDiv(l.in, q)});
        n.Add({bias, l.fused, CeilDiv(l.out / l.fused, q)});
        break;
      }
      if (l.role != Role::kColumn) {
        if (s.two_d) {
          n.Add({CeilDiv(l.in, q), CeilDiv(l.out, q)});
          n.Add({bias, CeilDiv(l.out, q)});
        } else {
          n.Add({l.role == Role::kRow ? CeilDiv(l.in, t) : l.in, l.out});
          n.Add({bias, l.out});
        }
        break;
      }
      if (s.two_d) {
        n.Add({CeilDiv(l.in, q), CeilDiv(l.out, q)});
        n.Add({bias, CeilDiv(l.out, q)});
      } else {
        n.Add({l.in, CeilDiv(l.out, t)});
        n.Add({bias, CeilDiv(l.out, t)});
      }
      break;
    case Role::kVocabTable:
    case Role::kPositions:
      if (s.blocks()) {
        n.Add({l.in, CeilDiv(l.out, q)});
      } else {
        n.Add({l.role == Role::kVocabTable ? s.VocabRows(l.in) : l.in, l.out});
      }
      break;
    case Role::kVocabHead:
      n.Add({s.blocks() ? l.out : s.VocabRows(l.out), s.blocks() ? CeilDiv(l.in, q) : l.in});
      break;
    case Role::kVocabBias:
      n.Add({s.VocabRows(l.out)});
      break;
    case Role::kTiedHead:
      break;
  }
  ASSIGN_OR_RETURN(int64_t each, n.Total(l.name));
  const std::optional<int64_t> all = CheckedMul(each, l.count);
  if (!all.has_value()) return absl::InvalidArgumentError(absl::StrCat(l.name, ": its elements overflow"));
  return *all;
}

}  // namespace

absl::StatusOr<int64_t> LeafElements(const PlanLeaf& leaf) { return RankElements(leaf, Split{}); }

namespace {

absl::StatusOr<Split> SplitOf(const v1::ShardConfig& layout) {
  Split split;
  const int tp = std::max(1, layout.tensor_parallel_size());
  const v1::TensorParallelMode mode = layout.tensor_parallel_mode();
  split.two_d = mode == v1::TENSOR_PARALLEL_MODE_2D || mode == v1::TENSOR_PARALLEL_MODE_2P5D;
  split.three_d = mode == v1::TENSOR_PARALLEL_MODE_3D;
  if (!split.blocks()) {
    split.t = tp;
    return split;
  }
  v1::ShardConfig tp_only = layout;
  tp_only.set_data_parallel_size(1);
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(tp_only));
  ASSIGN_OR_RETURN(int q, mesh.AxisSize(split.three_d ? "tp_weight" : "tp_row"));
  if (split.three_d) {
    split.q = q;
    return split;
  }
  split.q = q;
  split.depth = std::max(1, tp / (q * q));
  return split;
}

absl::StatusOr<int64_t> SumRankElements(const std::vector<PlanLeaf>& leaves, const Split& split) {
  CheckedSum total;
  for (const PlanLeaf& l : leaves) {
    ASSIGN_OR_RETURN(int64_t n, RankElements(l, split));
    total.Add({n});
  }
  return total.Total("the parameters per rank");
}

}  // namespace

namespace {

// The parameter tensors a leaf declares, over its count (a tied head's
// table is its embedding's): in 2D, 2.5D and 3D (`blocks`) a fused
// projection's parts are parameters of their own (Linear2D's and
// Linear3D's weight[k], bias[k]).
int64_t ParamTensors(const PlanLeaf& l, bool blocks) {
  if (l.role == Role::kTiedHead) return 0;
  int64_t each = 1;
  switch (l.kind) {
    case LeafKind::kLinear:
    case LeafKind::kConv1D:
    case LeafKind::kLayerNorm:
      each += l.bias ? 1 : 0;
      break;
    case LeafKind::kPatchEmbedding:
      each = 2;
      break;
    default:
      break;
  }
  return each * (blocks && l.fused > 1 ? l.fused : 1) * l.count;
}

// Where stage `s`'s layers begin among the model's.
int64_t StageBegin(const std::vector<int64_t>& stages, size_t s) {
  int64_t begin = 0;
  for (size_t k = 0; k < s; ++k) begin += stages[k];
  return begin;
}

// An encoder-decoder's first decoder stage: the one whose layers begin at
// the encoder's end (spec's PipelineStageLayers puts one there); -1 when
// none does.
int FirstDecoderStage(const ModelConfig& config, const std::vector<int64_t>& stages) {
  for (size_t s = 1; s < stages.size(); ++s) {
    if (StageBegin(stages, s) == config.num_layers) return static_cast<int>(s);
  }
  return -1;
}

// The leaves pipeline stage `s` holds, from their places in the family's
// table (a single stack's: the leaves before its layers', the layers',
// the rest): the layers' leaves for its share of the layers, the leaves
// before them (the embeddings) on the first stage, the leaves after them
// (the final norm, the heads) on the last, which also holds a tied head's
// table (its mirror of the first stage's). An encoder-decoder's stage
// (t5.cc) holds one stack's layers and that stack's position bias table
// (its mirror, but on the stack's first stage), the stack's final norm on
// its last stage, the shared embedding on the first stage and the first
// decoder stage (each embedding its stack's ids) and, tied to the head, on
// the last, and the head on the last.
std::vector<PlanLeaf> StageLeaves(const ModelConfig& config, const std::vector<PlanLeaf>& leaves,
                                  const std::vector<int64_t>& stages, size_t s) {
  const bool first = s == 0, last = s + 1 == stages.size();
  std::string tied_table;  // a tied head's table, under the base model
  for (const PlanLeaf& l : leaves) {
    if (l.role == Role::kTiedHead) tied_table = l.tied_to;
  }
  std::vector<PlanLeaf> out;
  if (config.is_encoder_decoder()) {
    const int64_t begin = StageBegin(stages, s), end = begin + stages[s];
    const bool encoder = end <= config.num_layers;
    const bool first_decoder = static_cast<int>(s) == FirstDecoderStage(config, stages);
    const std::string stack = encoder ? "encoder." : "decoder.";
    for (const PlanLeaf& l : leaves) {
      PlanLeaf mine = l;
      if (l.name.find('*') != std::string::npos) {
        if (!absl::StartsWith(l.name, stack)) continue;
        mine.count = stages[s];
      } else if (l.role == Role::kVocabTable) {
        if (!first && !first_decoder && !(last && l.name == tied_table)) continue;
        mine.lookups = first || first_decoder ? 1 : 0;  // its stack's ids; the last stage's mirror serves the head
      } else if (absl::StartsWith(l.name, stack)) {
        // The stack's position bias on each of its stages; its final norm on its last.
        if (l.role == Role::kNorm && !(encoder ? end == config.num_layers : last)) continue;
      } else if (absl::StartsWith(l.name, "encoder.") || absl::StartsWith(l.name, "decoder.") || !last) {
        continue;  // the other stack's; the head
      }
      out.push_back(mine);
    }
    return out;
  }
  bool after_layers = false;
  for (const PlanLeaf& l : leaves) {
    const bool layer = l.name.find('*') != std::string::npos;
    after_layers = after_layers || layer;
    if (layer) {
      PlanLeaf mine = l;
      mine.count = stages[s];
      out.push_back(mine);
    } else if (!after_layers) {
      if (first || (last && !l.on_root && l.name == tied_table)) {
        PlanLeaf mine = l;
        if (!first) mine.lookups = 0;  // the mirror only serves the head
        out.push_back(mine);
      }
    } else if (last) {
      out.push_back(l);
    }
  }
  return out;
}

// What pipeline rank `rank` of `pp` holds: its stage's leaves, or under
// interleaving (stages lists pp * V virtual stages) those of each of its
// virtual stages rank, pp + rank, ... (a layer list once per chunk).
std::vector<PlanLeaf> RankStageLeaves(const ModelConfig& config, const std::vector<PlanLeaf>& leaves,
                                      const std::vector<int64_t>& stages, int pp, int rank) {
  std::vector<PlanLeaf> out;
  for (size_t vs = static_cast<size_t>(rank); vs < stages.size(); vs += static_cast<size_t>(pp)) {
    std::vector<PlanLeaf> part = StageLeaves(config, leaves, stages, vs);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

// The tables several (virtual) stages hold (the worker's TiedTable), each
// with its holders, ascending: a tied head's table on the first and last
// stage; an encoder-decoder's shared embedding on the first stage, the
// first decoder stage and (tied) the last, and each stack's position bias
// table on each of the stack's stages (when it has more than one).
std::vector<std::pair<std::string, std::vector<int>>> TiedTables(const ModelConfig& config,
                                                                const std::vector<PlanLeaf>& leaves,
                                                                const std::vector<int64_t>& stages) {
  std::vector<std::pair<std::string, std::vector<int>>> out;
  const int count = static_cast<int>(stages.size());
  if (count < 2) return out;
  std::string tied_table;
  for (const PlanLeaf& l : leaves) {
    if (l.role == Role::kTiedHead) tied_table = l.tied_to;
  }
  if (!config.is_encoder_decoder()) {
    if (!tied_table.empty()) out.push_back({tied_table, {0, count - 1}});
    return out;
  }
  const int first_decoder = FirstDecoderStage(config, stages);
  if (first_decoder < 1) return out;
  for (const PlanLeaf& l : leaves) {
    if (l.role == Role::kVocabTable) {
      std::vector<int> holders = {0, first_decoder};
      if (l.name == tied_table && count - 1 != first_decoder) holders.push_back(count - 1);
      out.push_back({l.name, holders});
    } else if (l.name.find("relative_attention_bias") != std::string::npos) {
      const bool encoder = absl::StartsWith(l.name, "encoder.");
      const int from = encoder ? 0 : first_decoder, to = encoder ? first_decoder : count;
      if (to - from < 2) continue;
      std::vector<int> holders;
      for (int h = from; h < to; ++h) holders.push_back(h);
      out.push_back({l.name, holders});
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<int64_t> RankParameters(const ModelConfig& config, const v1::ShardConfig& layout) {
  ASSIGN_OR_RETURN(Split split, SplitOf(layout));
  ASSIGN_OR_RETURN(std::vector<PlanLeaf> leaves, PlanLeaves(config));
  const int pp = layout.pipeline_parallel_size();
  if (pp <= 1) return SumRankElements(leaves, split);
  // Pipeline stages: the fullest pipeline rank's (its virtual stages').
  ASSIGN_OR_RETURN(std::vector<int64_t> stages, PipelineStageLayers(config, layout));
  int64_t fullest = 0;
  for (int r = 0; r < pp; ++r) {
    ASSIGN_OR_RETURN(int64_t held, SumRankElements(RankStageLeaves(config, leaves, stages, pp, r), split));
    fullest = std::max(fullest, held);
  }
  return fullest;
}

namespace {

// The collectives of a step, accumulated by (group, op).
class CommSum {
 public:
  // The product of `elements` of `width` bytes, the product of `calls` times
  // (products of sizes from the config: checked).
  void Add(const std::string& group, const std::string& op, std::initializer_list<int64_t> calls_factors,
           std::initializer_list<int64_t> elements, int64_t width, int p) {
    const std::optional<int64_t> calls_n = CheckedProduct(calls_factors);
    const std::optional<int64_t> n = CheckedProduct(elements);
    const std::optional<int64_t> each = n.has_value() ? CheckedMul(*n, width) : std::nullopt;
    const std::optional<int64_t> bytes =
        calls_n.has_value() && each.has_value() ? CheckedMul(*calls_n, *each) : std::nullopt;
    if (!bytes.has_value()) {
      overflow_ = true;
      return;
    }
    const int64_t calls = *calls_n;
    if (p <= 1 || calls <= 0) return;
    // What one rank sends: ring all-reduce 2(p-1)/p n, reduce-scatter of a
    // whole input (p-1)/p n, all-gather of a piece (p-1) n, a broadcast
    // from one root (p-1)/p n on average.
    double wire = static_cast<double>(*bytes);
    if (op == "recv") wire = 0;  // what a rank puts on the wire is its sends
    if (op == "all_reduce") wire *= 2.0 * (p - 1) / p;
    if (op == "reduce_scatter" || op == "broadcast") wire *= static_cast<double>(p - 1) / p;
    if (op == "all_gather") wire *= p - 1;
    PlanComm& c = sums_[{group, op}];
    c.group = group;
    c.op = op;
    const std::optional<int64_t> total = CheckedAdd(c.bytes, *bytes);
    const std::optional<int64_t> count = CheckedAdd(c.calls, calls);
    if (!total.has_value() || !count.has_value() || wire > 9e18) {
      overflow_ = true;
      return;
    }
    c.bytes = *total;
    c.calls = *count;
    c.wire_bytes += static_cast<int64_t>(wire);
  }
  absl::StatusOr<std::vector<PlanComm>> Done() const {
    if (overflow_) return absl::InvalidArgumentError("the step's communication overflows a 64-bit count");
    std::vector<PlanComm> out;
    for (const auto& [key, c] : sums_) out.push_back(c);
    return out;
  }

 private:
  std::map<std::pair<std::string, std::string>, PlanComm> sums_;
  bool overflow_ = false;
};

int64_t ParamWidth(const v1::JobSpec& spec) {
  if (spec.kind() != v1::JOB_KIND_TRAIN) return 4;
  const v1::Precision precision = spec.train().precision();
  return precision == v1::PRECISION_BF16_MIXED || precision == v1::PRECISION_FP16_MIXED ? 2 : 4;
}

}  // namespace

namespace {

// What the parts of one rank's plan share: the spec's numbers, the split of
// the layout, this stage's leaves and the batch one rank computes.
struct StageContext {
  const ModelConfig& config;
  const v1::JobSpec& spec;
  int stage = -1;  // -1: no pipeline
  int pp = 1, dp = 1;
  bool train = false, sp = false;
  Split split;
  std::vector<PlanLeaf> leaves;   // this stage's
  std::vector<int64_t> stages;    // the layers of each (virtual) stage
  int v = 1;                      // model chunks a pipeline rank holds (interleaved 1F1B: virtual stages)
  int64_t stage_layers = 0;       // the layers this pipeline rank holds, over its chunks
  // The tables several stages hold (TiedTables), with their holders.
  std::vector<std::pair<std::string, std::vector<int>>> tied;
  // The floats the gradient norm reduces: 1, or with stages one a
  // parameter tensor of the model (worker/train's NormOrder).
  int64_t norm_slots = 1;
  // ZeRO over dp (TRAIN, dp > 1): its stage, and the elements per rank it
  // keeps whole (a table tied across stages: summed between them).
  int zero = 0;
  int64_t zero_whole = 0;
  int64_t width = 4, act = 4;     // bytes of a parameter and of an activation
  int64_t tokens = 0;             // of one micro-batch on a rank
  int64_t b = 0;                  // one micro-batch's sequences on a rank
  int64_t micro = 1;              // micro-batches a step (over every accumulation pass)
  int64_t grad_accum = 1;         // accumulation passes a step
  // 2D: each rank holds a 1/q of the rows and a 1/q of the features of an
  // activation (3D: a 1/q^2 of the rows); 1D: the features of a split
  // layer's output, or (with sequence parallelism) a 1/t of the rows
  // between them.
  int64_t rows_2d = 1, rows_div = 1, feat_div = 1;
  int64_t col_rows = 0, col_div = 1;  // a column-parallel output's rows, and its features' split
  int64_t stream_rows = 0;            // the residual stream's rows on a rank
  PlanDevice device = PlanDevice::kCpu;
  // Whether this rank computes the loss (and reduces it): the last stage's.
  bool loss() const { return stage < 0 || stage == pp - 1; }
  // The f32s of the loss's all-reduce: a training step without pipeline
  // stages leaves the loss's sum on the device and reduces it alone (its
  // denominator is the step's label count: ShardedModel::
  // set_loss_read_deferred); otherwise the sum and the labelled tokens.
  int64_t loss_elements() const { return train && pp == 1 ? 1 : 2; }
};

// The layout's checks the planner makes beyond CheckShardable (which
// refuses what the family's policy does not take).
absl::Status CheckPlannable(const ModelConfig&, const v1::ShardConfig& layout, const Split& split) {
  const bool sp = layout.sequence_parallel();
  if (split.blocks() && sp) {
    return absl::InvalidArgumentError("sequence_parallel applies to tensor_parallel_mode 1d only");
  }
  return absl::OkStatus();
}

// The parameters, gradients and optimizer state of the rank holding the
// most of this stage's leaves.
absl::Status PlanModelMemory(const StageContext& c, JobPlan& plan) {
  ASSIGN_OR_RETURN(plan.parameters, ParameterCount(c.config));
  ASSIGN_OR_RETURN(plan.rank_parameters, SumRankElements(c.leaves, c.split));
  const bool adam = c.spec.train().optimizer() != v1::OPTIMIZER_SGD;
  const int64_t state = 4 + (adam ? 4 : 0) + (c.width == 2 ? 4 : 0);  // momentum, second moment, f32 master copy
  CheckedSum params, grads, optimizer;
  params.Add({plan.rank_parameters, c.width});
  // ZeRO: each dp rank keeps the state (stage 2: and the reduced gradients)
  // of 1/dp of what it partitions; what stays whole, all of it.
  const int64_t partitioned = plan.rank_parameters - c.zero_whole;
  const int64_t share = c.zero > 0 ? CeilDiv(partitioned, c.dp) + c.zero_whole : plan.rank_parameters;
  if (c.train) {
    grads.Add({c.zero == 2 ? share : plan.rank_parameters, c.width});
    optimizer.Add({share, state});
  }
  ASSIGN_OR_RETURN(plan.param_bytes, params.Total("the parameter bytes per rank"));
  ASSIGN_OR_RETURN(plan.grad_bytes, grads.Total("the gradient bytes per rank"));
  ASSIGN_OR_RETURN(plan.optimizer_bytes, optimizer.Total("the optimizer bytes per rank"));
  if (c.spec.kind() == v1::JOB_KIND_FORWARD) {
    plan.notes.push_back("a forward job's batch is its input's: the plan takes the batch and length given "
                         "(one sequence of the model's max positions otherwise)");
  }
  return absl::OkStatus();
}

// The batch one rank computes (each dp replica's rows, in micro-batches)
// into `plan`, and the context's sizes that follow from it.
absl::Status PlanBatch(StageContext& c, JobPlan& plan) {
  const ModelConfig& config = c.config;
  const v1::TrainConfig& t = c.spec.train();
  plan.batch_size = t.batch_size() > 0 ? t.batch_size() : (c.train ? 8 : c.dp);
  plan.seq_len = t.seq_len() > 0 ? t.seq_len() : (c.train ? 64 : config.max_positions);
  if (config.takes_images()) plan.seq_len = config.max_positions;  // the patches and the CLS token
  if (config.is_encoder_decoder()) {
    plan.notes.push_back("an encoder-decoder's inputs and targets are both taken to be seq_len long");
  }
  plan.micro_batches = c.train && t.micro_batches() > 1 ? t.micro_batches() : 1;
  if (plan.batch_size % c.dp != 0 || (plan.batch_size / c.dp) % plan.micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size ", plan.batch_size, " does not split over dp = ",
                                                   c.dp, " and ", plan.micro_batches, " micro-batches"));
  }
  if (plan.seq_len > config.max_positions && !config.is_encoder_decoder()) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len ", plan.seq_len, " exceeds the model's ",
                                                   config.max_positions, " positions"));
  }
  // Gradient accumulation runs the micro-batches of each of its passes: the
  // per-micro-batch collectives come that many times more a step (the dp
  // sync's buckets are reduced once, ZeRO 2's every micro-batch);
  // activations are a micro-batch's, as without it.
  plan.grad_accum = c.train && t.grad_accum() > 1 ? t.grad_accum() : 1;
  const std::optional<int64_t> passes = CheckedMul(plan.micro_batches, plan.grad_accum);
  if (!passes.has_value()) return absl::InvalidArgumentError("micro_batches * grad_accum overflows");
  c.micro = *passes;
  c.grad_accum = plan.grad_accum;
  c.b = plan.batch_size / c.dp / plan.micro_batches;
  const std::optional<int64_t> tokens = CheckedMul(c.b, plan.seq_len);
  if (!tokens.has_value()) return absl::InvalidArgumentError("batch_size * seq_len overflows");
  c.tokens = *tokens;
  const Split& split = c.split;
  c.rows_2d = split.three_d ? split.q * split.q : split.q * split.depth;
  c.rows_div = split.blocks() ? c.rows_2d : c.sp ? split.t : 1;
  c.feat_div = split.blocks() ? split.q : 1;
  c.col_rows = CeilDiv(c.tokens, split.blocks() ? c.rows_2d : 1);
  c.col_div = split.blocks() ? split.q : split.t;
  c.stream_rows = CeilDiv(c.tokens, c.rows_div);
  return absl::OkStatus();
}

// The chunk forwards whose activations pipeline rank c.stage holds at the
// peak of a step: 1F1B's min(p - s, m) micro-batches, or the interleaved
// schedule's warm-up (InterleavedSchedule) and one more, at most V m.
int64_t InFlight(const StageContext& c, const JobPlan& plan) {
  const int64_t p = c.pp, s = c.stage, v = c.v, m = plan.micro_batches;
  if (v == 1) return std::min<int64_t>(p - s, m);
  return std::min<int64_t>(2 * (p - s - 1) + (v - 1) * p + 1, v * m);
}

// The stream blocks virtual stage `vs` sends the next (and gets its
// gradient back in): 1, or 2 from an encoder-decoder's decoder stage, the
// decoder's stream and the encoder's output joined (t5.cc).
int64_t BlocksSent(const StageContext& c, int64_t vs) {
  const int first_decoder = c.config.is_encoder_decoder() ? FirstDecoderStage(c.config, c.stages) : -1;
  return first_decoder > 0 && vs >= first_decoder ? 2 : 1;
}

// The activations one micro-batch leaves on one rank (a training step's
// tape; a forward pass's one block) through the context's leaves and
// c.stage_layers blocks (with stages: one chunk's).
absl::StatusOr<int64_t> MicroBatchActivations(const StageContext& c, const JobPlan& plan) {
  const ModelConfig& config = c.config;
  const Split& split = c.split;
  const bool sp = c.sp, train = c.train;
  const int stage = c.stage;
  const int64_t width = c.width, act = c.act, tokens = c.tokens, b = c.b;
  const int64_t rows_2d = c.rows_2d, feat_div = c.feat_div, col_rows = c.col_rows, col_div = c.col_div,
                stream_rows = c.stream_rows;
  const int64_t heads = config.num_heads;
  const int64_t head_split = split.blocks() ? split.q : split.t;
  const std::vector<PlanLeaf>& leaves = c.leaves;
  // The autograd tape keeps every op's output until the
  // backward passes it (a node holds its inputs), so a training forward
  // holds each layer's outputs: the column-parallel outputs (split by
  // features; all rows, as the column-parallel layers gather them under
  // sequence parallelism, whose gathered inputs are kept too), the
  // row-parallel outputs, norms and residual sums on the stream (whole in
  // 1D, split by rows under sequence parallelism, by rows and features in
  // 2D), the tokens' and positions' lookups and their sum, each
  // attention's heads-first q, k, v, its probabilities [b, heads, s, s] and
  // output (the merged heads are a view of it; a fused projection's q, k
  // and v are views of its output), the rotated q and k where the family
  // rotates them, the MLP's activation (GELU's input; a gated MLP's
  // act(gate) and product), and the logits.
  //
  // Activation recomputation (TrainConfig.recompute) changes what the
  // blocks keep: full keeps each block's input (and the last one's output)
  // on the stream instead of everything inside them, selective everything
  // but the probabilities.
  const bool gated = config.activation == "silu" || config.activation == "gated-gelu";
  CheckedSum outside, inside;  // the embeddings', the final norm's and the head's; the blocks'
  // Tokens' and positions' lookups summed (whole under sequence
  // parallelism, and then split) into the first block's input.
  // One sum for each positions' table (BERT's token types too).
  const int64_t sums = std::count_if(leaves.begin(), leaves.end(), [](const PlanLeaf& l) {
    return l.role == Role::kPositions;
  });
  if (sums > 0) {
    outside.Add({sums, sp ? tokens : stream_rows, CeilDiv(config.hidden_size, sp ? 1 : feat_div), act});
    if (sp) outside.Add({stream_rows, CeilDiv(config.hidden_size, feat_div), act});
  }
  for (const PlanLeaf& l : leaves) {
    CheckedSum& a = l.name.find('*') != std::string::npos ? inside : outside;
    if (l.kind == LeafKind::kPatchEmbedding) {
      // ViT's embeddings, whole on every rank: the unfolded patches the
      // projection keeps, its output, the CLS rows, and [CLS; patches],
      // the positions repeated over the batch and their sum.
      a.Add({tokens - b, l.in, act});
      a.Add({tokens - b, l.out, act});
      a.Add({b, l.out, act});
      a.Add({3, tokens, l.out, act});
      continue;
    }
    switch (l.role) {
      case Role::kColumn:
        a.Add({l.count, col_rows, CeilDiv(l.out, col_div), act});
        if (split.blocks()) {
          // SUMMA's (or the 3D) product before the bias, and a fused leaf's parts before they are joined.
          if (l.bias) a.Add({l.count, col_rows, CeilDiv(l.out, col_div), act});
          if (l.fused > 1) a.Add({l.count, col_rows, CeilDiv(l.out, col_div), act});
        }
        if (split.three_d) {
          // The 3D product keeps its gathered input [r q, in/q] and weight [o/q, in/q] for the backward.
          a.Add({l.count, col_rows * split.q, CeilDiv(l.in, split.q), act});
          a.Add({l.count, CeilDiv(l.out, split.q), CeilDiv(l.in, split.q), width});
        }
        break;
      case Role::kRow:
      case Role::kProjection:
        a.Add({l.count, stream_rows, CeilDiv(l.out, feat_div), act});
        if (split.blocks() && l.bias) a.Add({l.count, stream_rows, CeilDiv(l.out, feat_div), act});  // before the bias
        if (split.three_d) {
          a.Add({l.count, stream_rows * split.q, CeilDiv(l.in, split.q), act});
          a.Add({l.count, CeilDiv(l.out, split.q), CeilDiv(l.in, split.q), width});
        }
        if (l.role == Role::kRow && !split.blocks() && split.t > 1 && sp && l.bias) {
          // The scattered sum before the bias (nn::ScatteredLinear keeps no
          // partial product). Without sequence parallelism the partial
          // product is summed and biased in its own buffer
          // (nn::SumPartialAddBias): that is the output counted above.
          a.Add({l.count, stream_rows, l.out, act});
        }
        break;
      case Role::kNorm:
        a.Add({l.count, stream_rows, CeilDiv(l.out, feat_div), act});
        break;
      case Role::kVocabTable:
      case Role::kPositions:
        // Under sequence parallelism the embeddings are whole, split after.
        a.Add({l.lookups, sp ? tokens : stream_rows, CeilDiv(l.out, feat_div), act});
        if (l.role == Role::kVocabTable && !split.blocks() && split.t > 1) {
          a.Add({l.lookups, tokens, l.out, act});  // the partial lookup before its reduction
        }
        break;
      case Role::kTiedHead:
      case Role::kVocabHead:
      case Role::kVocabBias:  // the biased logits (BERT's MLM head)
        // The logits: whole rows in 3D; 2D's are a 1/q of the vocabulary.
        a.Add({col_rows, split.two_d ? CeilDiv(l.out, split.q) : split.VocabRows(l.out), act});
        break;
      default:
        break;
    }
  }
  // An encoder-decoder's blocks, each stack's, from its leaves (a
  // pipeline stage holds one stack's): a decoder block has two attentions.
  int64_t encoder_blocks = 0, decoder_blocks = 0;
  for (const PlanLeaf& l : leaves) {
    if (l.name == "encoder.block.*.layer.0.layer_norm") encoder_blocks = l.count;
    if (l.name == "decoder.block.*.layer.0.layer_norm") decoder_blocks = l.count;
  }
  const int64_t blocks = config.is_encoder_decoder() ? encoder_blocks + decoder_blocks
                         : stage >= 0                ? c.stage_layers
                                                     : config.num_layers;
  const int64_t attentions = config.is_encoder_decoder() ? encoder_blocks + 2 * decoder_blocks : blocks;
  // What each attention keeps a row, in bytes: its output (the merged
  // heads are a view of it), the rotated q and k where the family rotates
  // them, and the kernel's operands: the per-head GEMMs' heads-first f32 q,
  // k and v, or the fused kernel's contiguous copies of strided ones (a
  // packed projection's views whose rows are not 16-byte aligned:
  // ops::AttentionReadsInPlace; the kernels read aligned views, and
  // contiguous operands, as they are) and each query row's log-sum-exp
  // (below).
  const int64_t hd = config.head_dim(), kv_heads = config.num_kv_heads;
  const int64_t rotated = config.rotary() ? 1 : 0;
  const bool fused = c.device == PlanDevice::kCuda && hd <= kPlanMaxFusedHeadDim;
  const bool copied = config.packed_qkv() && hd * act % 16 != 0;  // the slices' rows and starts
  CheckedSum attention_row;
  attention_row.Add({1 + rotated, heads, hd, act});
  attention_row.Add({rotated, kv_heads, hd, act});
  if (!fused || copied) {
    const int64_t bytes = fused ? act : 4;
    attention_row.Add({heads, hd, bytes});
    attention_row.Add({2, kv_heads, hd, bytes});
  }
  ASSIGN_OR_RETURN(const int64_t attention_row_bytes, attention_row.Total("the attention's width"));
  inside.Add({blocks, 2, stream_rows, CeilDiv(config.hidden_size, feat_div), act});  // the residual sums
  inside.Add({attentions, col_rows, CeilDiv(attention_row_bytes, col_div)});
  inside.Add({blocks, gated ? 2 : 1, col_rows, CeilDiv(config.intermediate_size, col_div), act});
  if (config.relative_buckets > 0) {
    // T5's position bias, once a stack: the looked-up table [s, s, heads],
    // each local head's copy and their concatenation [heads, s, s]; a
    // decoder block's third residual sum (after the cross-attention).
    const int64_t stacks = config.is_encoder_decoder() ? (encoder_blocks > 0) + (decoder_blocks > 0) : 1;
    outside.Add({stacks, plan.seq_len, plan.seq_len, heads, act});
    outside.Add({stacks, 2, CeilDiv(heads, head_split), plan.seq_len, plan.seq_len, act});
    inside.Add({decoder_blocks, stream_rows, CeilDiv(config.hidden_size, feat_div), act});
  }
  const bool head = std::any_of(leaves.begin(), leaves.end(), [](const PlanLeaf& l) {
    return l.role == Role::kTiedHead || l.role == Role::kVocabHead;
  });
  if (config.is_encoder_decoder() && config.tie_word_embeddings && head) {
    outside.Add({stream_rows, CeilDiv(config.hidden_size, feat_div), act});  // the decoder's output scaled for the tied head
  }
  if (config.is_encoder_decoder() && stage >= 0 && decoder_blocks > 0) {
    // A decoder stage's stream and the encoder's output: taken apart from
    // the joined input (but on the first decoder stage), joined for the
    // next stage (but on the last).
    const bool takes_joined = !std::any_of(leaves.begin(), leaves.end(), [](const PlanLeaf& l) {
      return l.role == Role::kVocabTable && l.lookups > 0;
    });
    outside.Add({(takes_joined ? 2 : 0) + (head ? 0 : 2), stream_rows, CeilDiv(config.hidden_size, feat_div), act});
  }
  CheckedSum probs;  // the per-head GEMMs' probabilities, f32
  const int64_t attention_batch = CeilDiv(b, split.blocks() ? rows_2d : 1);
  if (fused) {
    inside.Add({attentions, attention_batch, CeilDiv(heads, head_split), plan.seq_len, 4});  // the log-sum-exps
  } else {
    probs.Add({attentions, attention_batch, CeilDiv(heads, head_split), plan.seq_len, plan.seq_len, 4});
  }
  const v1::Recompute recompute = train ? c.spec.train().recompute() : v1::RECOMPUTE_NONE;
  if (recompute == v1::RECOMPUTE_FULL) {
    // Each block's output (the next one's input); the first block's input
    // is the embeddings' last output, counted above.
    CheckedSum kept;
    kept.Add({blocks, stream_rows, CeilDiv(config.hidden_size, feat_div), act});
    ASSIGN_OR_RETURN(const int64_t inputs, kept.Total("the blocks' inputs"));
    outside.Add({inputs});
  } else {
    ASSIGN_OR_RETURN(const int64_t in_blocks, inside.Total("the blocks' activations"));
    outside.Add({in_blocks});
    if (recompute != v1::RECOMPUTE_SELECTIVE) {
      ASSIGN_OR_RETURN(const int64_t p, probs.Total("attention's probabilities"));
      outside.Add({p});
    }
  }
  ASSIGN_OR_RETURN(int64_t activations, outside.Total("the activations per rank"));
  if (!train) {
    // Nothing is kept for a backward: about one block's working set.
    activations = config.num_layers + config.num_decoder_layers > 0
                      ? activations / (config.num_layers + config.num_decoder_layers)
                      : activations;
  }
  return activations;
}

// The activations one rank holds at the peak of a step. Without stages,
// one micro-batch's. 1F1B keeps min(p - s, m) micro-batches' alive on
// stage s. The interleaved schedule keeps its warm-up's chunk forwards and
// one more (InFlight), forward k running chunk (k mod p V) / p
// (InterleavedSchedule, Megatron-LM's order): each counted as its chunk's
// (the embeddings on the first virtual stage's, the head on the last's).
absl::StatusOr<int64_t> PlanActivations(const StageContext& c, const JobPlan& plan) {
  if (c.stage < 0) return MicroBatchActivations(c, plan);
  const int64_t forwards = InFlight(c, plan);
  CheckedSum held;
  if (c.v == 1) {
    ASSIGN_OR_RETURN(const int64_t one, MicroBatchActivations(c, plan));
    held.Add({one, forwards});
  } else {
    ASSIGN_OR_RETURN(const std::vector<PlanLeaf> all, PlanLeaves(c.config));
    const int64_t p = c.pp, group = p * c.v;
    for (int64_t chunk = 0; chunk < c.v; ++chunk) {
      // Of the first `forwards`: whole rounds of p V, then what is left of
      // the last, p a chunk in order.
      const int64_t count =
          forwards / group * p + std::min(p, std::max<int64_t>(0, forwards % group - chunk * p));
      if (count == 0) continue;
      StageContext mine = c;
      const size_t vs = static_cast<size_t>(chunk * p + c.stage);
      mine.leaves = StageLeaves(c.config, all, c.stages, vs);
      mine.stage_layers = c.stages[vs];
      ASSIGN_OR_RETURN(const int64_t one, MicroBatchActivations(mine, plan));
      held.Add({one, count});
    }
  }
  // The receives posted ahead of the tasks that read them
  // (worker/train/pipeline.cc, on Gloo; NCCL posts them when needed, and
  // the plan counts them all the same): a block of the stream from the
  // previous stage, and in training its gradient from the next, one each
  // at a time (a T5 decoder stage's is two blocks: the stream and the
  // encoder's output).
  const int64_t count = c.pp * c.v;
  int64_t from_prev = 0, from_next = 0;
  for (int64_t chunk = 0; chunk < c.v; ++chunk) {
    const int64_t vs = chunk * c.pp + c.stage;
    if (vs > 0) from_prev = std::max(from_prev, BlocksSent(c, vs - 1));
    if (c.train && vs + 1 < count) from_next = std::max(from_next, BlocksSent(c, vs));
  }
  const int64_t features = CeilDiv(c.config.hidden_size, c.feat_div);
  held.Add({c.stream_rows, features, from_prev + from_next, c.act});
  return held.Total("the activations per rank");
}

// T5's position bias [s, s, heads], looked up whole once a stack (a
// stage holding it) and micro-batch, each rank reading its heads' rows
// (for its rows of the batch): its gradient summed over the whole tp group
// in the backward, in every mode.
void PlanPositionBiasGradient(const StageContext& c, CommSum& comm, int tp_size) {
  if (!c.train || c.b <= 0) return;
  for (const PlanLeaf& l : c.leaves) {
    if (l.name.find("relative_attention_bias") == std::string::npos) continue;
    const int64_t seq = c.tokens / c.b;
    comm.Add("tp", "all_reduce", {c.micro}, {seq, seq, l.out}, c.act, tp_size);
  }
}

// The tensor-parallel group's collectives of 1D (and sequence parallelism).
void PlanComm1D(const StageContext& c, CommSum& comm) {
  const int tp_size = c.split.t;
  const bool sp = c.sp, train = c.train;
  const int64_t micro = c.micro, tokens = c.tokens, act = c.act, width = c.width;
  const std::vector<PlanLeaf>& leaves = c.leaves;
  const std::string g = "tp";
  const int64_t piece = CeilDiv(tokens, tp_size);  // a sequence-parallel rank's rows
  bool after_layers = false;  // the leaves in table order: those after the layers' (OPT's project_out)
  for (const PlanLeaf& l : leaves) {
    const bool layer = l.name.find('*') != std::string::npos;
    after_layers = after_layers || layer;
    switch (l.role) {
      case Role::kVocabTable:
        // The partial lookups summed; under sequence parallelism each
        // rank then takes its rows, whose gradients the backward gathers.
        comm.Add(g, "all_reduce", {micro, l.lookups}, {tokens, l.out}, act, tp_size);
        if (sp && train) comm.Add(g, "all_gather", {micro, l.lookups}, {piece, l.out}, act, tp_size);
        break;
      case Role::kColumn:
      case Role::kTiedHead:
      case Role::kVocabHead:
        if (sp) {
          comm.Add(g, "all_gather", {micro, l.count}, {piece, l.in}, act, tp_size);  // forward
          if (train) {
            comm.Add(g, "reduce_scatter", {micro, l.count}, {tokens, l.in}, act, tp_size);
            // A column-parallel linear (the vocabulary-parallel head too)
            // keeps only its input's shard and gathers it again for the
            // weight's gradient (nn::GatheredLinear).
            comm.Add(g, "all_gather", {micro, l.count}, {piece, l.in}, act, tp_size);
          }
        } else if (train) {
          comm.Add(g, "all_reduce", {micro, l.count}, {tokens, l.in}, act, tp_size);  // the input's gradient
        }
        break;
      case Role::kRow:
        if (sp) {
          comm.Add(g, "reduce_scatter", {micro, l.count}, {tokens, l.out}, act, tp_size);
          if (train) {
            comm.Add(g, "all_gather", {micro, l.count}, {piece, l.out}, act, tp_size);
            // The bias, added to each rank's rows, has part of its gradient on each.
            if (l.bias) comm.Add(g, "all_reduce", {l.count}, {l.out}, width, tp_size);
          }
        } else {
          comm.Add(g, "all_reduce", {micro, l.count}, {tokens, l.out}, act, tp_size);
        }
        break;
      case Role::kNorm:
        // Under sequence parallelism each rank's weight gradient covers its
        // rows only (not a norm left whole, on the whole sequence).
        if (sp && train && l.sequence_split) {
          comm.Add(g, "all_reduce", {l.bias ? 2 : 1, l.count}, {l.out}, width, tp_size);
        }
        break;
      case Role::kProjection:
        // BERT's MLM transform and OPT's project_out, replicated, on the
        // whole sequence: the stream gathered before it, and its output
        // split again for the head, whose gradient the backward gathers.
        // (OPT's project_in runs before the embeddings are split.)
        if (sp && (l.on_root || (after_layers && !layer))) {
          comm.Add(g, "all_gather", {micro, l.count}, {piece, l.in}, act, tp_size);
          if (train) comm.Add(g, "all_gather", {micro, l.count}, {piece, l.out}, act, tp_size);
        }
        break;
      default:
        break;
    }
  }
  // The vocabulary-parallel cross-entropy: one all-gather of each rank's
  // row max, sum of exponentials, target logit and smoothing term, f32.
  const bool vocab_loss = std::any_of(leaves.begin(), leaves.end(), [](const PlanLeaf& l) {
    return l.role == Role::kTiedHead || l.role == Role::kVocabHead;
  });
  if (vocab_loss) comm.Add(g, "all_gather", {micro}, {4, tokens}, 4, tp_size);
  PlanPositionBiasGradient(c, comm, tp_size);
  if (train) comm.Add(g, "all_reduce", {1}, {c.norm_slots}, 4, tp_size);  // the gradient norm's sum of squares
}

// Data parallelism: the loss, and the gradients in buckets.
void PlanCommDataParallel(const StageContext& c, const JobPlan& plan, CommSum& comm) {
  const int dp = c.dp;
  const int64_t micro = c.micro;
  if (c.loss()) comm.Add("dp", "all_reduce", {micro}, {c.loss_elements()}, 4, dp);  // the loss's sum (and tokens)
  if (!c.train) return;
  const int64_t bucket = c.spec.train().bucket_bytes() > 0 ? c.spec.train().bucket_bytes() : int64_t{25} << 20;
  auto buckets_of = [&](int64_t elements) { return std::max<int64_t>(1, CeilDiv(elements * c.width, bucket)); };
  if (c.zero == 0) {
    // The gradients, every rank's whole share, in buckets.
    const int64_t buckets = buckets_of(plan.rank_parameters);
    comm.Add("dp", "all_reduce", {buckets}, {CeilDiv(plan.rank_parameters, buckets)}, c.width, dp);
    return;
  }
  // ZeRO (worker/train/data_parallel.h): what stays whole is all-reduced;
  // the rest reduce-scattered in buckets (stage 2: every micro-batch), the
  // updated weights all-gathered, and the gradient norm summed over dp.
  if (c.zero_whole > 0) {
    const int64_t buckets = buckets_of(c.zero_whole);
    comm.Add("dp", "all_reduce", {buckets}, {CeilDiv(c.zero_whole, buckets)}, c.width, dp);
  }
  const int64_t partitioned = plan.rank_parameters - c.zero_whole;
  const int64_t buckets = buckets_of(partitioned);
  comm.Add("dp", "reduce_scatter", {buckets, c.zero == 2 ? micro : 1}, {CeilDiv(partitioned, buckets)}, c.width, dp);
  comm.Add("dp", "all_gather", {buckets}, {CeilDiv(partitioned, buckets * dp)}, c.width, dp);
  comm.Add("dp", "all_reduce", {1}, {c.norm_slots}, 4, dp);
}

// An image classifier (ViT) in the block modes (worker/shardformer/vit.cc):
// its embeddings, computed whole on the first stage, are cut to the
// stream's block (a local slice, whose backward gathers the gradient back),
// and the last stage gathers the CLS rows whole for its replicated
// classifier (whose backward is a slice). ColoTensor::Redistribute gathers
// the features over `feature_axis` first, then the rows over `row_axes`,
// innermost first, each piece the rows gathered so far.
void PlanWholeEnds(const StageContext& c, CommSum& comm, const std::string& feature_axis, int q,
                   const std::vector<std::pair<std::string, int>>& row_axes) {
  if (!c.config.takes_images()) return;
  const int64_t h = c.config.hidden_size;
  auto gather = [&](int64_t rows) {
    int64_t local = CeilDiv(rows, c.rows_2d);
    comm.Add(feature_axis, "all_gather", {c.micro}, {local, CeilDiv(h, q)}, c.act, q);
    for (const auto& [axis, n] : row_axes) {
      comm.Add(axis, "all_gather", {c.micro}, {local, h}, c.act, n);
      local *= std::max(1, n);
    }
  };
  if (c.loss()) gather(c.b);                                 // the CLS rows
  if (c.train && (c.stage < 0 || c.stage == 0)) gather(c.tokens);  // the embeddings' gradient
}

// 2D and 2.5D's collectives (SUMMA over tp_row and tp_col, replicas over tp_dep).
void PlanComm2D(const StageContext& c, CommSum& comm) {
  const Split& split = c.split;
  const bool train = c.train;
  const int64_t micro = c.micro, tokens = c.tokens, act = c.act, width = c.width, rows_2d = c.rows_2d;
  const v1::ShardConfig& layout = c.spec.shard();
  const std::vector<PlanLeaf>& leaves = c.leaves;
  // 2D and 2.5D (worker/nn/linear2d.h, embedding2d.h): a rank holds r
  // rows and a 1/q of the features of an activation, and a q x q block
  // of each weight (replicated over depth).
  const int q = static_cast<int>(split.q), depth = static_cast<int>(split.depth);
  const int64_t r = CeilDiv(tokens, rows_2d);
  // Gradients of what is replicated over tp_col (and depth) are summed there.
  auto replicas = [&](std::initializer_list<int64_t> calls, std::initializer_list<int64_t> n) {
    if (!train) return;
    comm.Add("tp_col", "all_reduce", calls, n, width, q);
    comm.Add("tp_dep", "all_reduce", calls, n, width, depth);
  };
  auto linear = [&](int64_t leaves, int64_t parts, int64_t in, int64_t out, bool bias) {
    const int64_t count = leaves * parts;  // each at most kMaxLayers * 3
    const int64_t in_l = CeilDiv(in, q), out_l = CeilDiv(out, q);
    // SUMMA: q broadcasts of the input's block along the row and of the
    // weight's block along the column, again in the backward, which then
    // reduce-scatters the input's and the weight's gradients.
    const int64_t passes = train ? 2 : 1;
    comm.Add("tp_row", "broadcast", {micro, count, q, passes}, {r, in_l}, act, q);
    comm.Add("tp_col", "broadcast", {micro, count, q, passes}, {in_l, out_l}, width, q);
    if (train) {
      comm.Add("tp_row", "reduce_scatter", {micro, count}, {r, in}, act, q);
      comm.Add("tp_col", "reduce_scatter", {micro, count}, {q, in_l, out_l}, width, q);
      comm.Add("tp_dep", "all_reduce", {micro, count}, {in_l, out_l}, width, depth);  // the weight, over depth
    }
    if (bias) replicas({micro, count}, {out_l});
  };
  for (const PlanLeaf& l : leaves) {
    switch (l.role) {
      case Role::kColumn:
      case Role::kRow:
      case Role::kProjection:
        linear(l.count, l.fused, l.in, l.out / l.fused, l.bias);  // a fused q|k|v is one Linear2D each
        break;
      case Role::kNorm:
        // The rows' statistics over the row group (a LayerNorm's mean
        // and variance, an RMSNorm's mean square), the backward's two
        // row sums; gamma (and beta) summed over the replicas.
        comm.Add("tp_row", "all_reduce", {micro, l.count, l.bias ? 2 : 1}, {r}, 4, q);
        if (train) comm.Add("tp_row", "all_reduce", {micro, l.count}, {2, r}, 4, q);
        replicas({micro, l.count}, {l.bias ? 2 : 1, CeilDiv(l.out, q)});
        break;
      case Role::kVocabTable:
      case Role::kPositions:
        replicas({micro, l.lookups}, {l.in, CeilDiv(l.out, q)});
        break;
      case Role::kTiedHead:
      case Role::kVocabHead:
        // h E^T: partial logits summed over the row group; the table's
        // gradient (the tied one's second use) over the replicas.
        comm.Add("tp_row", "all_reduce", {micro}, {r, l.out}, act, q);
        replicas({micro}, {l.out, CeilDiv(l.in, q)});
        break;
      case Role::kVocabBias:
        replicas({micro}, {l.out});  // replicated, its rows' terms summed (Bias2D)
        break;
      default:
        break;
    }
  }
  PlanWholeEnds(c, comm, "tp_row", q, {{"tp_col", q}, {"tp_dep", depth}});
  // The loss's sum and tokens over the ranks holding other rows (on the
  // stage that computes it; a classifier's logits are whole on every rank,
  // its loss summed over dp only); the gradient norm's sum of squares over
  // the tensor-parallel ranks.
  if (c.loss() && !c.config.takes_images()) {
    comm.Add("tp_col", "all_reduce", {micro}, {c.loss_elements()}, 4, q);
    comm.Add("tp_dep", "all_reduce", {micro}, {c.loss_elements()}, 4, depth);
  }
  PlanPositionBiasGradient(c, comm, std::max(1, layout.tensor_parallel_size()));
  if (train) comm.Add("tp", "all_reduce", {1}, {c.norm_slots}, 4, std::max(1, layout.tensor_parallel_size()));
}

// 3D's collectives (over tp_input, tp_weight and tp_output).
void PlanComm3D(const StageContext& c, CommSum& comm) {
  const Split& split = c.split;
  const bool train = c.train;
  const int64_t micro = c.micro, tokens = c.tokens, act = c.act, width = c.width, rows_2d = c.rows_2d;
  const v1::ShardConfig& layout = c.spec.shard();
  const std::vector<PlanLeaf>& leaves = c.leaves;
  // 3D (worker/nn/linear3d.h, embedding3d.h): a rank holds r rows and a
  // 1/q of the features of an activation and a 1/q^3 of each weight. A
  // pair's first linear (column-parallel role) has K = tp_input and C =
  // tp_weight, its second (row-parallel role) the two swapped; the
  // residual stream's norms reduce over tp_weight and their parameters'
  // gradients over tp_output and tp_input.
  const int q = static_cast<int>(split.q);
  const int64_t r = CeilDiv(tokens, rows_2d);
  const std::string out_axis = "tp_output", stream_k = "tp_input", stream_c = "tp_weight";
  auto linear = [&](int64_t count, int64_t in, int64_t out, bool bias, bool swap) {
    const std::string& k = swap ? stream_c : stream_k;
    const std::string& c = swap ? stream_k : stream_c;
    const int64_t in_l = CeilDiv(in, q), out_l = CeilDiv(out, q);
    // Forward: the input's rows gathered over K, the weight's over R,
    // the product reduce-scattered over C. Backward: the output's
    // gradient gathered over C, the input's and the weight's gradients
    // reduce-scattered over K and R; the bias's summed over R and C.
    comm.Add(k, "all_gather", {micro, count}, {r, in_l}, act, q);
    comm.Add(out_axis, "all_gather", {micro, count}, {CeilDiv(out_l, q), in_l}, width, q);
    comm.Add(c, "reduce_scatter", {micro, count}, {r, q, out_l}, act, q);
    if (train) {
      comm.Add(c, "all_gather", {micro, count}, {r, out_l}, act, q);
      comm.Add(k, "reduce_scatter", {micro, count}, {r, q, in_l}, act, q);
      comm.Add(out_axis, "reduce_scatter", {micro, count}, {out_l, in_l}, act, q);
      if (bias) {
        comm.Add(out_axis, "all_reduce", {micro, count}, {out_l}, width, q);
        comm.Add(c, "all_reduce", {micro, count}, {out_l}, width, q);
      }
    }
  };
  auto replicas = [&](std::initializer_list<int64_t> calls, std::initializer_list<int64_t> n) {
    if (!train) return;
    comm.Add(out_axis, "all_reduce", calls, n, width, q);
    comm.Add(stream_k, "all_reduce", calls, n, width, q);
  };
  for (const PlanLeaf& l : leaves) {
    switch (l.role) {
      case Role::kColumn:
      case Role::kRow:
        // A fused q|k|v is one Linear3D each.
        linear(l.count * l.fused, l.in, l.out / l.fused, l.bias, l.role == Role::kRow);
        break;
      case Role::kProjection: {
        // A lone linear (BERT's MLM transform): its output, in the swapped
        // spec, goes back to the stream's (ColoTensor::Redistribute: the
        // rows gathered over tp_weight, then the features over tp_input,
        // and this rank's block kept), and its gradient back the same way.
        linear(l.count, l.in, l.out, l.bias, false);
        const int64_t out_l = CeilDiv(l.out, q), passes = train ? 2 : 1;
        comm.Add(stream_c, "all_gather", {micro, l.count, passes}, {r, out_l}, act, q);
        comm.Add(stream_k, "all_gather", {micro, l.count, passes}, {q, r, out_l}, act, q);
        break;
      }
      case Role::kVocabBias:
        replicas({micro}, {l.out});  // replicated, its rows' terms summed (Bias3D)
        break;
      case Role::kNorm:
        comm.Add(stream_c, "all_reduce", {micro, l.count, l.bias ? 2 : 1}, {r}, 4, q);
        if (train) comm.Add(stream_c, "all_reduce", {micro, l.count}, {2, r}, 4, q);
        replicas({micro, l.count}, {l.bias ? 2 : 1, CeilDiv(l.out, q)});  // [dgamma | dbeta], one call
        break;
      case Role::kVocabTable:
      case Role::kPositions:
        replicas({micro, l.lookups}, {l.in, CeilDiv(l.out, q)});
        break;
      case Role::kTiedHead:
      case Role::kVocabHead:
        // h E^T: partial logits summed over tp_weight; the table's
        // gradient over the replicas.
        comm.Add(stream_c, "all_reduce", {micro}, {r, l.out}, act, q);
        replicas({micro}, {l.out, CeilDiv(l.in, q)});
        break;
      default:
        break;
    }
  }
  PlanWholeEnds(c, comm, stream_c, q, {{stream_k, q}, {out_axis, q}});
  // The loss's sum and tokens over the ranks holding other rows (on the
  // stage that computes it; a classifier's, over dp only, as in 2D); the
  // gradient norm's sum of squares over the tensor-parallel ranks.
  if (c.loss() && !c.config.takes_images()) {
    comm.Add(out_axis, "all_reduce", {micro}, {c.loss_elements()}, 4, q);
    comm.Add(stream_k, "all_reduce", {micro}, {c.loss_elements()}, 4, q);
  }
  PlanPositionBiasGradient(c, comm, std::max(1, layout.tensor_parallel_size()));
  if (train) comm.Add("tp", "all_reduce", {1}, {c.norm_slots}, 4, std::max(1, layout.tensor_parallel_size()));
}

// A pipeline rank's sends and receives, and the tied tables' exchanges.
absl::Status PlanCommPipeline(const StageContext& c, CommSum& comm) {
  const int stage = c.stage, pp = c.pp;
  const int64_t micro = c.micro, act = c.act, width = c.width, stream_rows = c.stream_rows, feat_div = c.feat_div;
  const ModelConfig& config = c.config;
  const Split& split = c.split;
  // Pipeline stages (worker/train/pipeline.h): per micro-batch, the
  // stream's local block [rows, hidden] to the next stage and its gradient
  // back, each direction on the channel of the sending stage's parity;
  // the loss and the gradient norm's sum over pp. An encoder-decoder's
  // decoder stage (t5.cc) sends the decoder's stream and the encoder's
  // output joined, twice the block.
  auto channel = [](bool forward, int from) { return absl::StrCat("pp#", forward ? "f" : "b", from % 2); };
  const int64_t features = CeilDiv(config.hidden_size, feat_div);
  // Interleaved (V chunks a rank): each chunk's forward sends to the next
  // virtual stage (the last rank's to the first rank's next chunk, on the
  // wrap channels pp#fw and pp#bw) but the last virtual stage's, and each
  // chunk receives but the first virtual stage's.
  const int v = c.v, count = pp * v;
  // Calls of one block and of two, over this rank's chunks.
  int64_t sends[3] = {0, 0, 0}, recvs[3] = {0, 0, 0};
  for (int chunk = 0; chunk < v; ++chunk) {
    const int vs = chunk * pp + stage;
    if (vs + 1 < count) ++sends[BlocksSent(c, vs)];
    if (vs > 0) ++recvs[BlocksSent(c, vs - 1)];
  }
  for (int64_t b : {1, 2}) {
    if (sends[b] > 0) {
      const std::string fwd = stage + 1 < pp ? channel(true, stage) : "pp#fw";
      const std::string back = stage + 1 < pp ? channel(false, stage + 1) : "pp#bw";
      comm.Add(fwd, "send", {micro, sends[b]}, {stream_rows, features, b}, act, pp);
      comm.Add(back, "recv", {micro, sends[b]}, {stream_rows, features, b}, act, pp);
    }
    if (recvs[b] > 0) {
      const std::string fwd = stage > 0 ? channel(true, stage - 1) : "pp#fw";
      const std::string back = stage > 0 ? channel(false, stage) : "pp#bw";
      comm.Add(fwd, "recv", {micro, recvs[b]}, {stream_rows, features, b}, act, pp);
      comm.Add(back, "send", {micro, recvs[b]}, {stream_rows, features, b}, act, pp);
    }
  }
  // The loss and the stages' busy times over pp once a pass (each accumulation
  // pass's pipeline step), the norm's slots once a step (NormOrder's all-gather
  // of the names, once a run, is not a step's).
  comm.Add("pp", "all_reduce", {c.grad_accum}, {2}, 4, pp);
  comm.Add("pp", "all_reduce", {1}, {c.norm_slots}, 4, pp);
  // Each tied table's gradients summed once a step (SumTiedGradients): a
  // holder on another rank than the owner's sends its copy's over pp#f0
  // and receives the sum over pp#b1; the owner's rank takes each and sends
  // the sum back. Copies on the owner's rank move nothing.
  for (const auto& [name, holders] : c.tied) {
    std::optional<PlanLeaf> leaf;
    for (const PlanLeaf& l : c.leaves) {
      if (l.name == name) leaf = l;
    }
    if (!leaf.has_value()) continue;  // held by other ranks only
    ASSIGN_OR_RETURN(const int64_t n, RankElements(*leaf, split));
    const int owner = holders.front() % pp;
    int64_t remote = 0, mine = 0;  // holders off the owner's rank; of them, this rank's
    for (int h : holders) {
      if (h % pp == owner) continue;
      ++remote;
      if (h % pp == stage) ++mine;
    }
    if (stage == owner && remote > 0) {
      comm.Add(channel(true, 0), "recv", {remote}, {n}, width, pp);
      comm.Add(channel(false, 1), "send", {remote}, {n}, width, pp);
    } else if (mine > 0) {
      comm.Add(channel(true, 0), "send", {mine}, {n}, width, pp);
      comm.Add(channel(false, 1), "recv", {mine}, {n}, width, pp);
    }
  }
  return absl::OkStatus();
}

// The plan of one rank of pipeline stage `stage` (-1: no pipeline): the
// checks, then the model's memory, the batch, the activations and the
// communication, each its own part.
absl::StatusOr<JobPlan> PlanStage(const ModelConfig& config, const v1::JobSpec& spec, int stage, PlanDevice device) {
  JobPlan plan;
  if (spec.kind() == v1::JOB_KIND_TENSOR) return plan;
  const v1::ShardConfig& layout = spec.shard();
  RETURN_IF_ERROR(CheckShardable(config, layout));
  StageContext c{config, spec};
  c.stage = stage;
  c.device = device;
  c.train = spec.kind() == v1::JOB_KIND_TRAIN;
  c.dp = std::max(1, layout.data_parallel_size());
  c.pp = std::max(1, layout.pipeline_parallel_size());
  c.sp = layout.sequence_parallel();
  ASSIGN_OR_RETURN(c.split, SplitOf(layout));
  RETURN_IF_ERROR(CheckPlannable(config, layout, c.split));
  ASSIGN_OR_RETURN(c.leaves, PlanLeaves(config));
  // Pipeline stages: this stage's leaves and layers.
  c.stages = {config.num_layers};
  c.stage_layers = config.num_layers;
  const std::vector<PlanLeaf> all_leaves = c.leaves;
  if (stage >= 0) {
    if (!c.train) return absl::InvalidArgumentError("pipeline_parallel_size applies to TRAIN jobs");
    c.v = std::max(1, layout.virtual_stages());
    ASSIGN_OR_RETURN(c.stages, PipelineStageLayers(config, layout));  // pp * V
    c.leaves = RankStageLeaves(config, c.leaves, c.stages, c.pp, stage);
    c.stage_layers = 0;
    for (size_t vs = static_cast<size_t>(stage); vs < c.stages.size(); vs += static_cast<size_t>(c.pp)) {
      c.stage_layers += c.stages[vs];
    }
  }
  if (stage >= 0) {
    c.tied = TiedTables(config, all_leaves, c.stages);
    c.norm_slots = 0;
    for (const PlanLeaf& l : all_leaves) c.norm_slots += ParamTensors(l, c.split.blocks());
  }
  c.zero = c.train && c.dp > 1 ? spec.train().zero_stage() : 0;
  if (c.zero > 0 && !c.tied.empty()) {
    // ZeRO keeps a tied table whole on each stage holding it (the sum
    // between the stages reads it whole): every copy this rank holds.
    for (size_t vs = static_cast<size_t>(stage); vs < c.stages.size(); vs += static_cast<size_t>(c.pp)) {
      for (const PlanLeaf& l : StageLeaves(config, all_leaves, c.stages, vs)) {
        for (const auto& [name, holders] : c.tied) {
          if (l.name != name || std::find(holders.begin(), holders.end(), static_cast<int>(vs)) == holders.end()) {
            continue;
          }
          ASSIGN_OR_RETURN(int64_t n, RankElements(l, c.split));
          c.zero_whole += n;
        }
      }
    }
  }
  c.width = ParamWidth(spec);
  c.act = c.width;  // activations are held in the parameters' dtype
  RETURN_IF_ERROR(PlanModelMemory(c, plan));
  RETURN_IF_ERROR(PlanBatch(c, plan));
  ASSIGN_OR_RETURN(plan.activation_bytes, PlanActivations(c, plan));
  plan.notes.push_back("activations are an estimate of what the autograd tape holds (every op's output): "
                       "tested at 95-100 % of a measured step in 1D (80-100 % in 2D and 3D)");

  // Communication, per micro-batch, then per step.
  CommSum comm;
  if (!c.split.blocks() && c.split.t > 1) PlanComm1D(c, comm);
  if (c.dp > 1) PlanCommDataParallel(c, plan, comm);
  if (c.split.two_d && c.split.q > 1) PlanComm2D(c, comm);
  if (c.split.three_d && c.split.q > 1) PlanComm3D(c, comm);
  if (stage >= 0) RETURN_IF_ERROR(PlanCommPipeline(c, comm));
  ASSIGN_OR_RETURN(plan.comm, comm.Done());
  for (const PlanComm& pc : plan.comm) plan.wire_bytes += pc.wire_bytes;
  CheckedSum total;
  total.Add({plan.param_bytes});
  total.Add({plan.grad_bytes});
  total.Add({plan.optimizer_bytes});
  total.Add({plan.activation_bytes});
  ASSIGN_OR_RETURN(plan.total_bytes, total.Total("the memory per rank"));
  if (stage >= 0) {
    plan.pipeline_stage = stage;
    plan.notes.push_back(
        c.v == 1 ? absl::StrCat("pipeline: the plan of stage ", stage, " of ", c.pp, ", the fullest (",
                                c.stage_layers, " of the layers, ", InFlight(c, plan),
                                " micro-batches' activations alive under 1F1B)")
                 : absl::StrCat("pipeline: the plan of pipeline rank ", stage, " of ", c.pp, ", the fullest (",
                                c.v, " chunks of ", c.stage_layers, " layers in all; ", InFlight(c, plan),
                                " chunk forwards' activations alive under interleaved 1F1B)"));
  }
  return plan;
}

}  // namespace

absl::StatusOr<JobPlan> PlanJob(const ModelConfig& config, const v1::JobSpec& spec, PlanDevice device) {
  const int pp = std::max(1, spec.shard().pipeline_parallel_size());
  if (pp == 1 || spec.kind() == v1::JOB_KIND_TENSOR) return PlanStage(config, spec, -1, device);
  RETURN_IF_ERROR(CheckInterleavedMicroBatches(spec.shard(), spec.train().micro_batches()));
  // The fullest stage: the one a layout must fit.
  std::optional<JobPlan> fullest;
  for (int s = 0; s < pp; ++s) {
    ASSIGN_OR_RETURN(JobPlan p, PlanStage(config, spec, s, device));
    if (!fullest.has_value() || p.total_bytes > fullest->total_bytes) fullest = std::move(p);
  }
  // Of a step's time: (p - 1) chunk-times idle against V m of work (1F1B: V = 1).
  const int64_t v = std::max(1, spec.shard().virtual_stages());
  fullest->bubble_fraction =
      static_cast<double>(pp - 1) / static_cast<double>(v * fullest->micro_batches + pp - 1);
  return *std::move(fullest);
}

std::string LayoutName(const v1::ShardConfig& s) {
  std::string mode = "1d";
  if (s.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2D) mode = "2d";
  if (s.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2P5D) mode = absl::StrCat("2.5d depth ", s.depth());
  if (s.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_3D) mode = "3d";
  std::string out = absl::StrCat("tp", s.tensor_parallel_size(), " x ",
                                 s.pipeline_parallel_size() > 1
                                     ? absl::StrCat("pp", s.pipeline_parallel_size(),
                                                    s.virtual_stages() > 1 ? absl::StrCat("v", s.virtual_stages()) : "",
                                                    " x ")
                                     : "",
                                 "dp", s.data_parallel_size(), " ", mode);
  if (s.sequence_parallel()) absl::StrAppend(&out, " sp");
  return out;
}

absl::StatusOr<LayoutSearch> RankLayouts(const ModelConfig& config, const v1::JobSpec& spec, int world,
                                         int64_t memory_per_rank, PlanDevice device) {
  if (world < 1 || world > 65536) return absl::InvalidArgumentError("world must be between 1 and 65536 ranks");
  LayoutSearch search;
  // Pipeline stages where the spec trains a family that has them (one
  // refusal says why not otherwise, rather than one per layout).
  bool stages = spec.kind() == v1::JOB_KIND_TRAIN;
  v1::ShardConfig two_stages;
  two_stages.set_pipeline_parallel_size(2);
  if (absl::Status takes = CheckFamilyTakes(config, two_stages); stages && world > 1 && !takes.ok()) {
    search.refused.push_back(absl::StrCat("pp > 1: ", takes.message()));
    stages = false;
  }
  std::vector<v1::ShardConfig> candidates;
  for (int dp = 1; dp <= world; ++dp) {
    if (world % dp != 0) continue;
    for (int pp = 1; pp <= world / dp; ++pp) {
      if ((world / dp) % pp != 0 || (pp > 1 && !stages)) continue;
      const int tp = world / dp / pp;
      v1::ShardConfig s = spec.shard();
      s.set_tensor_parallel_size(tp);
      s.set_data_parallel_size(dp);
      s.set_pipeline_parallel_size(pp);
      s.clear_pipeline_stage_layers();  // equal stages
      if (pp == 1) s.clear_virtual_stages();        // interleaving needs stages: the spec's V for pp > 1
      if (pp > 1) s.set_sequence_parallel(false);  // which pipeline stages do not combine with
      s.set_depth(0);
      s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
      candidates.push_back(s);
      if (tp == 1) continue;
      s.set_sequence_parallel(false);
      s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
      candidates.push_back(s);
      for (int depth = 2; depth <= tp; ++depth) {
        if (tp % depth != 0) continue;
        if (IntegerRoot(tp / depth, 2) < 2) continue;  // tp = depth * q^2, q >= 2
        s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2P5D);
        s.set_depth(depth);
        candidates.push_back(s);
      }
      s.set_depth(0);
      s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
      candidates.push_back(s);
    }
  }
  for (const v1::ShardConfig& s : candidates) {
    v1::JobSpec candidate = spec;
    *candidate.mutable_shard() = s;
    const std::string name = LayoutName(s);
    if (s.tensor_parallel_mode() != v1::TENSOR_PARALLEL_MODE_1D) {
      v1::ShardConfig tp_only = s;
      tp_only.set_data_parallel_size(1);
      tp_only.set_pipeline_parallel_size(1);
      if (!DeviceMesh::FromShardConfig(tp_only).ok()) continue;  // not a square (cube) number of ranks
    }
    absl::StatusOr<JobPlan> plan = PlanJob(config, candidate, device);
    if (!plan.ok()) {
      search.refused.push_back(absl::StrCat(name, ": ", plan.status().message()));
      continue;
    }
    if (memory_per_rank > 0 && plan->total_bytes > memory_per_rank) {
      search.refused.push_back(absl::StrCat(name, ": needs ", GiB(plan->total_bytes), " per rank, more than ",
                                            GiB(memory_per_rank)));
      continue;
    }
    search.fits.push_back({s, *std::move(plan)});
  }
  std::stable_sort(search.fits.begin(), search.fits.end(), [](const RankedLayout& x, const RankedLayout& y) {
    return std::tie(x.plan.wire_bytes, x.plan.total_bytes) < std::tie(y.plan.wire_bytes, y.plan.total_bytes);
  });
  return search;
}

}  // namespace colod
