// The 1D tensor-parallel layers (Megatron's column and row splits, the
// vocabulary-parallel embedding, LM head and bias, the norms with sequence
// parallelism) and the bias layer the native ones share.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"
#include "worker/nn/norm.h"
#include "worker/shardformer/layer_loading.h"

namespace colod::shardformer::layers {
namespace {

using Kind = LayerDecl::Kind;
using LayerPtr = std::unique_ptr<Layer>;

class BiasLayer : public Layer {
 public:
  BiasLayer(BoundParam b, bool vocab_parallel, int p) : b_(std::move(b)), vocab_parallel_(vocab_parallel), p_(p) {}
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

class Col1D : public Layer {
 public:
  Col1D(nn::Linear1DCol layer, WeightAndBias p, bool owns, bool sp, int tp)
      : layer_(std::move(layer)), p_(std::move(p)), owns_(owns), sp_(sp), tp_(tp) {}
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
    WeightAndBiasLayout layout;
    layout.weight_shape = o.fused == 1 ? Shape{d.out, d.in} : Shape{o.fused, d.out / o.fused, d.in};
    layout.weight_spec = specs.weight;
    layout.bias_shape = o.fused == 1 ? Shape{d.out} : Shape{o.fused, d.out / o.fused};
    layout.bias_spec = specs.bias;
    layout.compute = {ComputePattern::kTP1D};
    layout.transpose = d.kind == Kind::kConv1D;
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    ASSIGN_OR_RETURN(nn::Linear1DCol layer, nn::Linear1DCol::FromParameters(p.weight.param, p.bias_param(), c.pg, o));
    ASSIGN_OR_RETURN(int tp, c.pg->AxisSize("tp"));
    return LayerPtr(new Col1D(std::move(layer), std::move(p), true, o.sequence_parallel, tp));
  }
  std::string type() const override { return owns_ ? "Linear1D_Col" : "tied vocab-parallel LM head"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) override {
    return layer_.Forward(x, epilogue);  // gathered or not, the epilogue is element-wise
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return sp_ ? TpShard(ndim - 2, tp_) : DistSpec(); }
  std::vector<BoundParam> Params() override { return owns_ ? p_.list() : std::vector<BoundParam>{}; }
  absl::StatusOr<ColoTensor> HeadWeight() override {
    if (p_.bias.has_value() || sp_ || p_.weight.param.global_shape().size() != 2) return Layer::HeadWeight();
    return static_cast<const ColoTensor&>(p_.weight.param);
  }

 private:
  nn::Linear1DCol layer_;
  WeightAndBias p_;
  bool owns_, sp_;
  int tp_;
};

class Row1D : public Layer {
 public:
  Row1D(nn::Linear1DRow layer, WeightAndBias p, int tp) : layer_(std::move(layer)), p_(std::move(p)), tp_(tp) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "Linear1D_Row"));
    nn::Linear1DRow::Options o;
    o.parallel_input = Kwarg(c, "parallel_input", 1) != 0;
    o.sequence_parallel = c.shard->sequence_parallel();
    ASSIGN_OR_RETURN(nn::ParamSpecs specs, nn::Linear1DRow::Specs(c.pg, o));
    WeightAndBiasLayout layout;
    layout.weight_shape = {d.out, d.in};
    layout.weight_spec = specs.weight;
    layout.bias_shape = {d.out};
    layout.bias_spec = specs.bias;
    layout.compute = {ComputePattern::kTP1D};
    layout.transpose = d.kind == Kind::kConv1D;
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    ASSIGN_OR_RETURN(nn::Linear1DRow layer, nn::Linear1DRow::FromParameters(p.weight.param, p.bias_param(), c.pg, o));
    ASSIGN_OR_RETURN(int tp, c.pg->AxisSize("tp"));
    return LayerPtr(new Row1D(std::move(layer), std::move(p), tp));
  }
  std::string type() const override { return "Linear1D_Row"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return TpShard(ndim - 1, tp_); }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  nn::Linear1DRow layer_;
  WeightAndBias p_;
  int tp_;
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
  ASSIGN_OR_RETURN(int tp, pg->AxisSize("tp"));
  return LayerPtr(new Col1D(std::move(layer), WeightAndBias{table, std::nullopt}, owns, o.sequence_parallel, tp));
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
  Norm1DLayer(nn::Norm1D layer, WeightAndBias p, bool sp, int tp)
      : layer_(std::move(layer)), p_(std::move(p)), sp_(sp), tp_(tp) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsNorm(d), d, "Norm1D"));
    nn::Norm1D::Options o;
    o.kind = d.kind == Kind::kLayerNorm ? nn::NormKind::kLayerNorm : nn::NormKind::kRmsNorm;
    o.eps = d.eps;
    o.sequence_parallel = c.shard->sequence_parallel();
    WeightAndBiasLayout layout;
    layout.weight_shape = layout.bias_shape = {d.out};
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    ASSIGN_OR_RETURN(nn::Norm1D layer, nn::Norm1D::FromParameters(p.weight.param, p.bias_param(), c.pg, o));
    ASSIGN_OR_RETURN(int tp, c.pg->AxisSize("tp"));
    return LayerPtr(new Norm1DLayer(std::move(layer), std::move(p), o.sequence_parallel, tp));
  }
  std::string type() const override { return "Norm1D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<WithSum> ForwardResidual(const ColoTensor& x, const ColoTensor& residual) override {
    ASSIGN_OR_RETURN(nn::Norm1D::WithSum r, layer_.Forward(x, residual));
    return WithSum{std::move(r.sum), std::move(r.y)};
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return sp_ ? TpShard(ndim - 2, tp_) : DistSpec(); }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  nn::Norm1D layer_;
  WeightAndBias p_;
  bool sp_;
  int tp_;
};

}  // namespace

absl::StatusOr<LayerPtr> CreateBias(const LayerDecl& d, const LayerContext& c, bool vocab_parallel) {
  RETURN_IF_ERROR(Expect(d.kind == Kind::kBias, d, vocab_parallel ? "VocabParallelBias1D" : "native Bias"));
  if (!vocab_parallel) {
    ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", WeightTensor(d), {d.out}, DistSpec()));
    return LayerPtr(new BiasLayer(std::move(b), false, 1));
  }
  nn::VocabParallelEmbedding1D::Options o{c.shard->make_vocab_size_divisible_by};
  ASSIGN_OR_RETURN(int64_t padded, nn::VocabParallelEmbedding1D::PaddedVocab(d.out, c.pg, o));
  ASSIGN_OR_RETURN(int tp, c.pg->AxisSize("tp"));
  HfTensor hf = WeightTensor(d);
  hf.valid_rows = d.out;
  ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", hf, {padded}, TpShard(0, tp), {ComputePattern::kTP1D}));
  return LayerPtr(new BiasLayer(std::move(b), true, tp));
}

void Register1DLayers(LayerRegistry& r) {
  (void)r.Register("Linear1D_Col", Col1D::Create);
  (void)r.Register("Linear1D_Row", Row1D::Create);
  (void)r.Register("VocabParallelEmbedding1D", VocabEmbedding1D::Create);
  (void)r.Register("VocabParallelLMHead1D", CreateVocabLmHead1D);
  (void)r.Register("Norm1D", Norm1DLayer::Create);
  (void)r.Register("VocabParallelBias1D",
                   [](const LayerDecl& d, const LayerContext& c) { return CreateBias(d, c, /*vocab_parallel=*/true); });
}

}  // namespace colod::shardformer::layers
