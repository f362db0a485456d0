#include "worker/shardformer/layers.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/embedding2d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"
#include "worker/nn/linear2d.h"
#include "worker/nn/norm.h"

namespace colod::shardformer {
namespace {

using Kind = LayerDecl::Kind;
using LayerPtr = std::unique_ptr<Layer>;

bool IsMatrix(const LayerDecl& d) { return d.kind == Kind::kLinear || d.kind == Kind::kConv1D; }
bool IsNorm(const LayerDecl& d) { return d.kind == Kind::kLayerNorm || d.kind == Kind::kRmsNorm; }

absl::Status Expect(bool ok, const LayerDecl& d, const std::string& layer) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(layer, " cannot replace ", d.prefix, ", a ", KindName(d.kind)));
}

double Kwarg(const LayerContext& c, const std::string& name, double fallback) {
  auto it = c.kwargs.find(name);
  return it == c.kwargs.end() ? fallback : it->second;
}

absl::StatusOr<HfReader> Reader(const LayerContext& c, const HfTensor& hf) {
  if (c.files == nullptr) return absl::FailedPreconditionError("no checkpoint to load layers from");
  return FileReader(*c.files, hf);
}

absl::StatusOr<BoundParam> Load(const LayerContext& c, const std::string& name, const HfTensor& hf,
                                const Shape& layer_shape, const DistSpec& spec, ComputeSpec compute = {}) {
  ASSIGN_OR_RETURN(HfReader read, Reader(c, hf));
  ASSIGN_OR_RETURN(ColoParameter p,
                   LoadParameter(hf, layer_shape, spec, c.pg, read, name, compute, c.shard->param_dtype,
                                 c.shard->device));
  return BoundParam{name, std::move(p), hf};
}

std::optional<ColoParameter> ParamOf(const std::optional<BoundParam>& b) {
  if (!b.has_value()) return std::nullopt;
  return b->param;
}

std::vector<BoundParam> List(const BoundParam& w, const std::optional<BoundParam>& b) {
  std::vector<BoundParam> out = {w};
  if (b.has_value()) out.push_back(*b);
  return out;
}

absl::StatusOr<ColoTensor> SameSpec(const Variable& y, const ColoTensor& x) {
  return ColoTensor::FromLocal(y, x.spec(), x.process_group());
}

absl::Status NoShardedLastDim(const ColoTensor& x, const std::string& layer) {
  const int64_t last = static_cast<int64_t>(x.global_shape().size()) - 1;
  for (const auto& [axis, p] : x.spec().placements()) {
    for (int64_t d : p.dims) {
      if (d == last) {
        return absl::InvalidArgumentError(
            absl::StrCat(layer, " needs its input's last dim whole, got ", x.spec().ToString()));
      }
    }
  }
  return absl::OkStatus();
}

// ---- native layers: the original computation, parameters replicated.

class NativeLinear : public Layer {
 public:
  // `head` is an LM head tied to a table: it shares the parameter and owns none.
  NativeLinear(BoundParam w, std::optional<BoundParam> b, bool tied) : w_(std::move(w)), b_(std::move(b)), tied_(tied) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "native Linear"));
    HfTensor hf = WeightTensor(d);
    hf.transpose = d.kind == Kind::kConv1D;
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", hf, {d.out, d.in}, DistSpec()));
    std::optional<BoundParam> b;
    if (auto bias = BiasTensor(d)) {
      ASSIGN_OR_RETURN(b, Load(c, "bias", *bias, {d.out}, DistSpec()));
    }
    return LayerPtr(new NativeLinear(std::move(w), std::move(b), false));
  }
  std::string type() const override { return tied_ ? "native tied LM head" : "native Linear"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    std::optional<Variable> b;
    if (b_.has_value()) b = b_->param.variable();
    ASSIGN_OR_RETURN(Variable y, nn::Linear(x.variable(), w_.param.variable(), b));
    return SameSpec(y, x);
  }
  absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    std::optional<Variable> b;
    if (b_.has_value()) b = b_->param.variable();
    ASSIGN_OR_RETURN(Variable y, nn::Linear(x.variable(), w_.param.variable(), b, epilogue));
    return SameSpec(y, x);
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return tied_ ? std::vector<BoundParam>{} : List(w_, b_); }

 private:
  BoundParam w_;
  std::optional<BoundParam> b_;
  bool tied_;
};

class NativeEmbedding : public Layer {
 public:
  explicit NativeEmbedding(BoundParam w) : w_(std::move(w)) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kEmbedding, d, "native Embedding"));
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", WeightTensor(d), {d.in, d.out}, DistSpec()));
    return LayerPtr(new NativeEmbedding(std::move(w)));
  }
  std::string type() const override { return "native Embedding"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& ids) override {
    RETURN_IF_ERROR(nn::CheckIds(ids.local(), w_.param.global_shape()[0]));
    ASSIGN_OR_RETURN(Variable y, nn::Embedding(w_.param.variable(), ids.local()));
    return ColoTensor::FromLocal(y, ids.spec(), ids.process_group());
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return {w_}; }
  absl::StatusOr<LayerPtr> TiedHead() override { return LayerPtr(new NativeLinear(w_, std::nullopt, true)); }

 private:
  BoundParam w_;
};

class NativeNorm : public Layer {
 public:
  NativeNorm(BoundParam g, std::optional<BoundParam> b, float eps) : g_(std::move(g)), b_(std::move(b)), eps_(eps) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsNorm(d), d, "native norm"));
    ASSIGN_OR_RETURN(BoundParam g, Load(c, "weight", WeightTensor(d), {d.out}, DistSpec()));
    std::optional<BoundParam> b;
    if (auto bias = BiasTensor(d)) {
      ASSIGN_OR_RETURN(b, Load(c, "bias", *bias, {d.out}, DistSpec()));
    }
    return LayerPtr(new NativeNorm(std::move(g), std::move(b), d.eps));
  }
  std::string type() const override { return b_.has_value() ? "native LayerNorm" : "native RMSNorm"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    Variable y;
    if (b_.has_value()) {
      ASSIGN_OR_RETURN(y, nn::LayerNorm(x.variable(), g_.param.variable(), b_->param.variable(), eps_));
    } else {
      ASSIGN_OR_RETURN(y, nn::RmsNorm(x.variable(), g_.param.variable(), eps_));
    }
    return SameSpec(y, x);
  }
  absl::StatusOr<WithSum> ForwardResidual(const ColoTensor& x, const ColoTensor& residual) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    if (x.global_shape() != residual.global_shape() || !CheckSpec(residual, x.spec(), "the residual").ok()) {
      return Layer::ForwardResidual(x, residual);  // its error
    }
    std::optional<Variable> b;
    if (b_.has_value()) b = b_->param.variable();
    ASSIGN_OR_RETURN(nn::ResidualNorm r, nn::AddNorm(x.variable(), residual.variable(), g_.param.variable(), b, eps_));
    ASSIGN_OR_RETURN(ColoTensor sum, SameSpec(r.sum, x));
    ASSIGN_OR_RETURN(ColoTensor y, SameSpec(r.y, x));
    return WithSum{std::move(sum), std::move(y)};
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return List(g_, b_); }

 private:
  BoundParam g_;
  std::optional<BoundParam> b_;
  float eps_;
};

DistSpec TpShard(int64_t dim, int p) { return nn::WithTp({}, Placement::Shard({dim}, {p})); }

// A bias over the last dim: replicated (native), or split like a
// vocab-parallel LM head's logits (VocabParallelBias1D: [V_pad] tp: S(0),
// zero padding from V on).
class BiasLayer : public Layer {
 public:
  BiasLayer(BoundParam b, bool vocab_parallel, int p) : b_(std::move(b)), vocab_parallel_(vocab_parallel), p_(p) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c, bool vocab_parallel) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kBias, d, vocab_parallel ? "VocabParallelBias1D" : "native Bias"));
    if (!vocab_parallel) {
      ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", WeightTensor(d), {d.out}, DistSpec()));
      return LayerPtr(new BiasLayer(std::move(b), false, 1));
    }
    nn::VocabParallelEmbedding1D::Options o{c.shard->make_vocab_size_divisible_by};
    ASSIGN_OR_RETURN(int64_t padded, nn::VocabParallelEmbedding1D::PaddedVocab(d.out, c.pg, o));
    ASSIGN_OR_RETURN(int p, c.pg->AxisSize("tp"));
    HfTensor hf = WeightTensor(d);
    hf.valid_rows = d.out;
    ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", hf, {padded}, TpShard(0, p), {ComputePattern::kTP1D}));
    return LayerPtr(new BiasLayer(std::move(b), true, p));
  }
  std::string type() const override { return vocab_parallel_ ? "VocabParallelBias1D" : "native Bias"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    const int64_t last = static_cast<int64_t>(x.global_shape().size()) - 1;
    if (vocab_parallel_) {
      RETURN_IF_ERROR(CheckSpec(x, nn::WithTp(x.spec(), Placement::Shard({last}, {p_})), type() + " input"));
    } else {
      RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    }
    ASSIGN_OR_RETURN(Variable y, nn::BiasAdd(x.variable(), b_.param.variable()));
    return SameSpec(y, x);
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return vocab_parallel_ ? TpShard(ndim - 1, p_) : DistSpec();
  }
  std::vector<BoundParam> Params() override { return {b_}; }

 private:
  BoundParam b_;
  bool vocab_parallel_;
  int p_;
};

absl::StatusOr<LayerPtr> CreateNative(const LayerDecl& d, const LayerContext& c) {
  if (d.kind == Kind::kBias) return BiasLayer::Create(d, c, false);
  if (IsMatrix(d)) return NativeLinear::Create(d, c);
  if (d.kind == Kind::kEmbedding) return NativeEmbedding::Create(d, c);
  return NativeNorm::Create(d, c);
}

// ---- 1D

class Col1D : public Layer {
 public:
  Col1D(nn::Linear1DCol layer, BoundParam w, std::optional<BoundParam> b, bool owns, bool sp, int p)
      : layer_(std::move(layer)), w_(std::move(w)), b_(std::move(b)), owns_(owns), sp_(sp), p_(p) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "Linear1D_Col"));
    nn::Linear1DCol::Options o;
    o.fused = static_cast<int>(Kwarg(c, "n_fused", 1));
    o.gather_output = Kwarg(c, "gather_output", 0) != 0;
    o.sequence_parallel = c.shard->sequence_parallel();
    if (o.fused < 1 || d.out % o.fused != 0) {
      return absl::InvalidArgumentError(absl::StrCat(d.prefix, ": ", d.out, " outputs do not split into n_fused = ",
                                                     o.fused, " projections"));
    }
    ASSIGN_OR_RETURN(nn::ParamSpecs specs, nn::Linear1DCol::Specs(c.pg, o));
    const Shape w_shape = o.fused == 1 ? Shape{d.out, d.in} : Shape{o.fused, d.out / o.fused, d.in};
    HfTensor hf = WeightTensor(d);
    hf.transpose = d.kind == Kind::kConv1D;
    const ComputeSpec compute{ComputePattern::kTP1D};
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", hf, w_shape, specs.weight, compute));
    std::optional<BoundParam> b;
    if (auto bias = BiasTensor(d)) {
      const Shape b_shape = o.fused == 1 ? Shape{d.out} : Shape{o.fused, d.out / o.fused};
      ASSIGN_OR_RETURN(b, Load(c, "bias", *bias, b_shape, specs.bias, compute));
    }
    ASSIGN_OR_RETURN(nn::Linear1DCol layer, nn::Linear1DCol::FromParameters(w.param, ParamOf(b), c.pg, o));
    ASSIGN_OR_RETURN(int p, c.pg->AxisSize("tp"));
    return LayerPtr(new Col1D(std::move(layer), std::move(w), std::move(b), true, o.sequence_parallel, p));
  }
  std::string type() const override { return owns_ ? "Linear1D_Col" : "tied vocab-parallel LM head"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) override {
    return layer_.Forward(x, epilogue);  // gathered or not, the epilogue is element-wise
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return sp_ ? TpShard(ndim - 2, p_) : DistSpec();
  }
  std::vector<BoundParam> Params() override { return owns_ ? List(w_, b_) : std::vector<BoundParam>{}; }

 private:
  nn::Linear1DCol layer_;
  BoundParam w_;
  std::optional<BoundParam> b_;
  bool owns_, sp_;
  int p_;
};

class Row1D : public Layer {
 public:
  Row1D(nn::Linear1DRow layer, BoundParam w, std::optional<BoundParam> b, int p)
      : layer_(std::move(layer)), w_(std::move(w)), b_(std::move(b)), p_(p) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "Linear1D_Row"));
    nn::Linear1DRow::Options o;
    o.parallel_input = Kwarg(c, "parallel_input", 1) != 0;
    o.sequence_parallel = c.shard->sequence_parallel();
    ASSIGN_OR_RETURN(nn::ParamSpecs specs, nn::Linear1DRow::Specs(c.pg, o));
    HfTensor hf = WeightTensor(d);
    hf.transpose = d.kind == Kind::kConv1D;
    const ComputeSpec compute{ComputePattern::kTP1D};
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", hf, {d.out, d.in}, specs.weight, compute));
    std::optional<BoundParam> b;
    if (auto bias = BiasTensor(d)) {
      ASSIGN_OR_RETURN(b, Load(c, "bias", *bias, {d.out}, specs.bias, compute));
    }
    ASSIGN_OR_RETURN(nn::Linear1DRow layer, nn::Linear1DRow::FromParameters(w.param, ParamOf(b), c.pg, o));
    ASSIGN_OR_RETURN(int p, c.pg->AxisSize("tp"));
    return LayerPtr(new Row1D(std::move(layer), std::move(w), std::move(b), p));
  }
  std::string type() const override { return "Linear1D_Row"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return TpShard(ndim - 1, p_); }
  std::vector<BoundParam> Params() override { return List(w_, b_); }

 private:
  nn::Linear1DRow layer_;
  BoundParam w_;
  std::optional<BoundParam> b_;
  int p_;
};

// The padded [V_pad, H] table of a vocabulary-parallel embedding or LM head.
absl::StatusOr<BoundParam> LoadVocabTable(const LayerDecl& d, const LayerContext& c, int64_t vocab, int64_t dim) {
  nn::VocabParallelEmbedding1D::Options o{c.shard->make_vocab_size_divisible_by};
  ASSIGN_OR_RETURN(int64_t padded, nn::VocabParallelEmbedding1D::PaddedVocab(vocab, c.pg, o));
  ASSIGN_OR_RETURN(DistSpec spec, nn::VocabParallelEmbedding1D::Spec(c.pg));
  HfTensor hf = WeightTensor(d);
  hf.valid_rows = vocab;
  return Load(c, "weight", hf, {padded, dim}, spec, {ComputePattern::kTP1D});
}

// A Linear1D_Col LM head over the padded table; `owns` when it read the
// table itself rather than sharing an embedding's.
absl::StatusOr<LayerPtr> VocabHead1D(const BoundParam& table, ProcessGroup* pg, const ShardConfig& shard, bool owns) {
  nn::Linear1DCol::Options o;
  o.gather_output = shard.layout.gather_output();
  o.sequence_parallel = shard.sequence_parallel();
  ASSIGN_OR_RETURN(nn::Linear1DCol layer, nn::Linear1DCol::FromParameters(table.param, std::nullopt, pg, o));
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  return LayerPtr(new Col1D(std::move(layer), table, std::nullopt, owns, o.sequence_parallel, p));
}

class VocabEmbedding1D : public Layer {
 public:
  VocabEmbedding1D(nn::VocabParallelEmbedding1D layer, BoundParam w, ProcessGroup* pg, const ShardConfig* shard)
      : layer_(std::move(layer)), w_(std::move(w)), pg_(pg), shard_(shard) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kEmbedding, d, "VocabParallelEmbedding1D"));
    ASSIGN_OR_RETURN(BoundParam w, LoadVocabTable(d, c, d.in, d.out));
    nn::VocabParallelEmbedding1D::Options o{c.shard->make_vocab_size_divisible_by};
    ASSIGN_OR_RETURN(nn::VocabParallelEmbedding1D layer,
                     nn::VocabParallelEmbedding1D::FromParameters(w.param, d.in, c.pg, o));
    return LayerPtr(new VocabEmbedding1D(std::move(layer), std::move(w), c.pg, c.shard));
  }
  std::string type() const override { return "VocabParallelEmbedding1D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& ids) override { return layer_.Forward(ids.local()); }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return {w_}; }
  absl::StatusOr<LayerPtr> TiedHead() override { return VocabHead1D(w_, pg_, *shard_, /*owns=*/false); }

 private:
  nn::VocabParallelEmbedding1D layer_;
  BoundParam w_;
  ProcessGroup* pg_;
  const ShardConfig* shard_;
};

absl::StatusOr<LayerPtr> CreateVocabLmHead1D(const LayerDecl& d, const LayerContext& c) {
  RETURN_IF_ERROR(Expect(d.kind == Kind::kLinear && !d.bias, d, "VocabParallelLMHead1D (a Linear without bias)"));
  ASSIGN_OR_RETURN(BoundParam w, LoadVocabTable(d, c, d.out, d.in));
  return VocabHead1D(w, c.pg, *c.shard, /*owns=*/true);
}

class Norm1DLayer : public Layer {
 public:
  Norm1DLayer(nn::Norm1D layer, BoundParam g, std::optional<BoundParam> b, bool sp, int p)
      : layer_(std::move(layer)), g_(std::move(g)), b_(std::move(b)), sp_(sp), p_(p) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsNorm(d), d, "Norm1D"));
    nn::Norm1D::Options o;
    o.kind = d.kind == Kind::kLayerNorm ? nn::Norm1D::Kind::kLayerNorm : nn::Norm1D::Kind::kRmsNorm;
    o.eps = d.eps;
    o.sequence_parallel = c.shard->sequence_parallel();
    ASSIGN_OR_RETURN(BoundParam g, Load(c, "weight", WeightTensor(d), {d.out}, DistSpec()));
    std::optional<BoundParam> b;
    if (auto bias = BiasTensor(d)) {
      ASSIGN_OR_RETURN(b, Load(c, "bias", *bias, {d.out}, DistSpec()));
    }
    ASSIGN_OR_RETURN(nn::Norm1D layer, nn::Norm1D::FromParameters(g.param, ParamOf(b), c.pg, o));
    ASSIGN_OR_RETURN(int p, c.pg->AxisSize("tp"));
    return LayerPtr(new Norm1DLayer(std::move(layer), std::move(g), std::move(b), o.sequence_parallel, p));
  }
  std::string type() const override { return "Norm1D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<WithSum> ForwardResidual(const ColoTensor& x, const ColoTensor& residual) override {
    ASSIGN_OR_RETURN(nn::Norm1D::WithSum r, layer_.Forward(x, residual));
    return WithSum{std::move(r.sum), std::move(r.y)};
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return sp_ ? TpShard(ndim - 2, p_) : DistSpec();
  }
  std::vector<BoundParam> Params() override { return List(g_, b_); }

 private:
  nn::Norm1D layer_;
  BoundParam g_;
  std::optional<BoundParam> b_;
  bool sp_;
  int p_;
};

// ---- 2D / 2.5D

class Linear2DLayer : public Layer {
 public:
  struct Part {
    nn::Linear2D layer;
    BoundParam w;
    std::optional<BoundParam> b;
  };
  Linear2DLayer(std::vector<Part> parts, nn::Groups2D g) : parts_(std::move(parts)), g_(g) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "Linear2D"));
    ASSIGN_OR_RETURN(nn::Groups2D g, nn::GetGroups2D(c.pg));
    const int n = static_cast<int>(Kwarg(c, "n_fused", 1));
    if (n < 1 || d.out % n != 0) {
      return absl::InvalidArgumentError(absl::StrCat(d.prefix, ": ", d.out, " outputs do not split into n_fused = ",
                                                     n, " projections"));
    }
    ASSIGN_OR_RETURN(nn::ParamSpecs specs, nn::Linear2D::Specs(c.pg));
    const int64_t o = d.out / n;
    const bool conv = d.kind == Kind::kConv1D;
    std::vector<Part> parts;
    for (int k = 0; k < n; ++k) {
      // Linear2D holds [in, out]: Conv1D's layout; nn.Linear's [out, in] transposed.
      HfTensor hf = WeightTensor(d);
      hf.transpose = !conv;
      if (n > 1) {
        hf.narrow_dim = conv ? 1 : 0;
        hf.narrow_start = k * o;
      }
      // Fused parts are "weight[k]" and "bias[k]": each holds a slice of the tensor.
      const std::string part = n > 1 ? absl::StrCat("[", k, "]") : "";
      ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight" + part, hf, {d.in, o}, specs.weight));
      std::optional<BoundParam> b;
      if (auto bias = BiasTensor(d)) {
        if (n > 1) {
          bias->narrow_dim = 0;
          bias->narrow_start = k * o;
        }
        ASSIGN_OR_RETURN(b, Load(c, "bias" + part, *bias, {o}, specs.bias));
      }
      ASSIGN_OR_RETURN(nn::Linear2D layer, nn::Linear2D::FromParameters(w.param, ParamOf(b), c.pg));
      parts.push_back(Part{std::move(layer), std::move(w), std::move(b)});
    }
    return LayerPtr(new Linear2DLayer(std::move(parts), g));
  }
  std::string type() const override { return "Linear2D"; }
  absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) override {
    if (parts_.size() == 1) return parts_[0].layer.Forward(x, epilogue);
    return Layer::ForwardWithEpilogue(x, epilogue);
  }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    if (parts_.size() == 1) return parts_[0].layer.Forward(x);
    // Fused: [.., n, out/n], each rank holding its columns of every projection.
    std::vector<Variable> ys;
    ProcessGroup* pg = x.process_group();
    for (Part& part : parts_) {
      ASSIGN_OR_RETURN(ColoTensor y, part.layer.Forward(x));
      Shape s = y.local().shape();
      s.insert(s.end() - 1, 1);
      ASSIGN_OR_RETURN(Variable v, nn::Reshape(y.variable(), s));
      ys.push_back(v);
    }
    const int64_t ndim = ys[0].value().dim();
    ASSIGN_OR_RETURN(Variable cat, nn::Cat(ys, ndim - 2));
    return ColoTensor::FromLocal(cat, nn::Activation2D(ndim, g_.q, g_.depth), pg);
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return nn::Activation2D(ndim, g_.q, g_.depth); }
  std::vector<BoundParam> Params() override {
    std::vector<BoundParam> out;
    for (Part& p : parts_) {
      for (BoundParam& b : List(p.w, p.b)) out.push_back(b);
    }
    return out;
  }

 private:
  std::vector<Part> parts_;
  nn::Groups2D g_;
};

class LayerNorm2DLayer : public Layer {
 public:
  LayerNorm2DLayer(nn::LayerNorm2D layer, BoundParam g, BoundParam b, nn::Groups2D groups)
      : layer_(std::move(layer)), g_(std::move(g)), b_(std::move(b)), groups_(groups) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kLayerNorm, d, "LayerNorm2D"));
    ASSIGN_OR_RETURN(nn::Groups2D groups, nn::GetGroups2D(c.pg));
    ASSIGN_OR_RETURN(DistSpec spec, nn::LayerNorm2D::Spec(c.pg));
    ASSIGN_OR_RETURN(BoundParam g, Load(c, "weight", WeightTensor(d), {d.out}, spec));
    ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", *BiasTensor(d), {d.out}, spec));
    ASSIGN_OR_RETURN(nn::LayerNorm2D layer, nn::LayerNorm2D::FromParameters(g.param, b.param, d.eps, c.pg));
    return LayerPtr(new LayerNorm2DLayer(std::move(layer), std::move(g), std::move(b), groups));
  }
  std::string type() const override { return "LayerNorm2D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return nn::Activation2D(ndim, groups_.q, groups_.depth);
  }
  std::vector<BoundParam> Params() override { return {g_, b_}; }

 private:
  nn::LayerNorm2D layer_;
  BoundParam g_, b_;
  nn::Groups2D groups_;
};

class RmsNorm2DLayer : public Layer {
 public:
  RmsNorm2DLayer(nn::RmsNorm2D layer, BoundParam g, nn::Groups2D groups)
      : layer_(std::move(layer)), g_(std::move(g)), groups_(groups) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kRmsNorm, d, "RMSNorm2D"));
    ASSIGN_OR_RETURN(nn::Groups2D groups, nn::GetGroups2D(c.pg));
    ASSIGN_OR_RETURN(DistSpec spec, nn::LayerNorm2D::Spec(c.pg));
    ASSIGN_OR_RETURN(BoundParam g, Load(c, "weight", WeightTensor(d), {d.out}, spec));
    ASSIGN_OR_RETURN(nn::RmsNorm2D layer, nn::RmsNorm2D::FromParameters(g.param, d.eps, c.pg));
    return LayerPtr(new RmsNorm2DLayer(std::move(layer), std::move(g), groups));
  }
  std::string type() const override { return "RMSNorm2D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return nn::Activation2D(ndim, groups_.q, groups_.depth);
  }
  std::vector<BoundParam> Params() override { return {g_}; }

 private:
  nn::RmsNorm2D layer_;
  BoundParam g_;
  nn::Groups2D groups_;
};

class Embedding2DLayer : public Layer {
 public:
  // `head`: this layer computes the logits of an LM head with the table.
  Embedding2DLayer(nn::Embedding2D layer, BoundParam w, nn::Groups2D g, bool head, bool owns)
      : layer_(std::move(layer)), w_(std::move(w)), g_(g), head_(head), owns_(owns) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c, bool head) {
    if (head) {
      RETURN_IF_ERROR(Expect(d.kind == Kind::kLinear && !d.bias, d, "LMHead2D"));
    } else {
      RETURN_IF_ERROR(Expect(d.kind == Kind::kEmbedding, d, "Embedding2D"));
    }
    ASSIGN_OR_RETURN(nn::Groups2D g, nn::GetGroups2D(c.pg));
    ASSIGN_OR_RETURN(DistSpec spec, nn::Embedding2D::Spec(c.pg));
    // Both an embedding [V, H] and an LM head Linear(H -> V) store [V, H].
    const Shape shape = head ? Shape{d.out, d.in} : Shape{d.in, d.out};
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", WeightTensor(d), shape, spec));
    ASSIGN_OR_RETURN(nn::Embedding2D layer, nn::Embedding2D::FromParameters(w.param, c.pg));
    return LayerPtr(new Embedding2DLayer(std::move(layer), std::move(w), g, head, true));
  }
  std::string type() const override {
    return head_ ? (owns_ ? "LMHead2D" : "tied Embedding2D LM head") : "Embedding2D";
  }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    if (head_) return layer_.TiedLogits(x);
    return layer_.Forward(x.local());
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return head_ ? nn::Activation2D(ndim, g_.q, g_.depth) : DistSpec();
  }
  std::vector<BoundParam> Params() override { return owns_ ? std::vector<BoundParam>{w_} : std::vector<BoundParam>{}; }
  absl::StatusOr<LayerPtr> TiedHead() override {
    if (head_) return Layer::TiedHead();
    return LayerPtr(new Embedding2DLayer(layer_, w_, g_, true, false));
  }

 private:
  nn::Embedding2D layer_;
  BoundParam w_;
  nn::Groups2D g_;
  bool head_, owns_;
};

}  // namespace

bool ShardConfig::is_2d() const {
  return layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2D ||
         layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2P5D;
}

int ShardConfig::head_split() const {
  if (!is_2d()) return tp();
  const int depth = layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2P5D ? std::max(1, layout.depth()) : 1;
  return static_cast<int>(std::lround(std::sqrt(tp() / depth)));
}

HfTensor WeightTensor(const LayerDecl& d) {
  HfTensor hf;
  hf.name = absl::StrCat(d.prefix, d.kind == Kind::kBias ? ".bias" : ".weight");
  switch (d.kind) {
    case Kind::kLinear: hf.shape = {d.out, d.in}; break;
    case Kind::kConv1D: hf.shape = {d.in, d.out}; break;
    case Kind::kEmbedding: hf.shape = {d.in, d.out}; break;
    case Kind::kLayerNorm:
    case Kind::kRmsNorm:
    case Kind::kBias: hf.shape = {d.out}; break;
  }
  return hf;
}

std::optional<HfTensor> BiasTensor(const LayerDecl& d) {
  if (!d.bias || d.kind == Kind::kEmbedding || d.kind == Kind::kRmsNorm || d.kind == Kind::kBias) return std::nullopt;
  HfTensor hf;
  hf.name = absl::StrCat(d.prefix, ".bias");
  hf.shape = {d.out};
  return hf;
}

LayerRegistry& LayerRegistry::Global() {
  static LayerRegistry* registry = [] {
    auto* r = new LayerRegistry();
    (void)r->Register("native", CreateNative);
    (void)r->Register("Linear1D_Col", Col1D::Create);
    (void)r->Register("Linear1D_Row", Row1D::Create);
    (void)r->Register("VocabParallelEmbedding1D", VocabEmbedding1D::Create);
    (void)r->Register("VocabParallelLMHead1D", CreateVocabLmHead1D);
    (void)r->Register("Norm1D", Norm1DLayer::Create);
    (void)r->Register("VocabParallelBias1D", [](const LayerDecl& d, const LayerContext& c) {
      return BiasLayer::Create(d, c, true);
    });
    (void)r->Register("Linear2D", Linear2DLayer::Create);
    (void)r->Register("LayerNorm2D", LayerNorm2DLayer::Create);
    (void)r->Register("RMSNorm2D", RmsNorm2DLayer::Create);
    (void)r->Register("Embedding2D", [](const LayerDecl& d, const LayerContext& c) {
      return Embedding2DLayer::Create(d, c, false);
    });
    (void)r->Register("LMHead2D", [](const LayerDecl& d, const LayerContext& c) {
      return Embedding2DLayer::Create(d, c, true);
    });
    return r;
  }();
  return *registry;
}

absl::Status LayerRegistry::Register(const std::string& name, LayerFactory factory) {
  absl::MutexLock lock(&mu_);
  if (!factories_.emplace(name, std::move(factory)).second) {
    return absl::AlreadyExistsError(absl::StrCat("a layer named ", name, " is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerFactory> LayerRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    std::vector<std::string> known;
    for (const auto& [n, f] : factories_) known.push_back(n);
    return absl::NotFoundError(absl::StrCat("no layer named ", name, "; known: ", absl::StrJoin(known, ", ")));
  }
  return it->second;
}

}  // namespace colod::shardformer
