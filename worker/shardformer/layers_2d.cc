// The 2D and 2.5D tensor-parallel layers (SUMMA linears, the norms, the
// embedding and the LM head computed with its table).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding2d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear2d.h"
#include "worker/shardformer/layer_loading.h"

namespace colod::shardformer::layers {
namespace {

using Kind = LayerDecl::Kind;
using LayerPtr = std::unique_ptr<Layer>;

class Linear2DLayer : public Layer {
 public:
  struct Part {
    nn::Linear2D layer;
    WeightAndBias params;
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
      WeightAndBiasLayout layout;
      layout.weight_shape = {d.in, o};
      layout.weight_spec = specs.weight;
      layout.bias_shape = {o};
      layout.bias_spec = specs.bias;
      // Linear2D holds [in, out]: Conv1D's layout; nn.Linear's [out, in] transposed.
      layout.transpose = !conv;
      if (n > 1) {
        // Fused parts are "weight[k]" and "bias[k]": each holds a slice of the tensor.
        layout.weight_narrow_dim = conv ? 1 : 0;
        layout.narrow_start = k * o;
        layout.part = absl::StrCat("[", k, "]");
      }
      ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
      ASSIGN_OR_RETURN(nn::Linear2D layer, nn::Linear2D::FromParameters(p.weight.param, p.bias_param(), c.pg));
      parts.push_back(Part{std::move(layer), std::move(p)});
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
    std::vector<ColoTensor> ys;
    for (Part& part : parts_) {
      ASSIGN_OR_RETURN(ColoTensor y, part.layer.Forward(x));
      ys.push_back(std::move(y));
    }
    return JoinFusedParts(ys, [this](int64_t ndim) { return nn::Activation2D(ndim, g_.q, g_.depth); });
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return nn::Activation2D(ndim, g_.q, g_.depth); }
  std::vector<BoundParam> Params() override {
    std::vector<BoundParam> out;
    for (Part& p : parts_) {
      for (BoundParam& b : p.params.list()) out.push_back(std::move(b));
    }
    return out;
  }

 private:
  std::vector<Part> parts_;
  nn::Groups2D g_;
};

// LayerNorm2D and RMSNorm2D: one layer, the kind the declaration's.
class Norm2DLayer : public Layer {
 public:
  Norm2DLayer(nn::Norm2D layer, WeightAndBias p, nn::Groups2D groups)
      : layer_(std::move(layer)), p_(std::move(p)), groups_(groups) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c, nn::Norm2D::Kind kind) {
    const bool layer_norm = kind == nn::Norm2D::Kind::kLayerNorm;
    RETURN_IF_ERROR(Expect(d.kind == (layer_norm ? Kind::kLayerNorm : Kind::kRmsNorm), d,
                           layer_norm ? "LayerNorm2D" : "RMSNorm2D"));
    ASSIGN_OR_RETURN(nn::Groups2D groups, nn::GetGroups2D(c.pg));
    WeightAndBiasLayout layout;
    layout.weight_shape = layout.bias_shape = {d.out};
    ASSIGN_OR_RETURN(layout.weight_spec, nn::Norm2D::Spec(c.pg));
    layout.bias_spec = layout.weight_spec;
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    ASSIGN_OR_RETURN(nn::Norm2D layer, nn::Norm2D::FromParameters(p.weight.param, p.bias_param(), c.pg, {kind, d.eps}));
    return LayerPtr(new Norm2DLayer(std::move(layer), std::move(p), groups));
  }
  std::string type() const override { return p_.bias.has_value() ? "LayerNorm2D" : "RMSNorm2D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return nn::Activation2D(ndim, groups_.q, groups_.depth);
  }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  nn::Norm2D layer_;
  WeightAndBias p_;
  nn::Groups2D groups_;
};

// The vocabulary bias after a 2D / 2.5D head (BERT's cls.predictions.bias):
// the logits' rows are split over tp_col (and tp_dep) and their vocabulary
// is whole, replicated over tp_row (nn::Embedding2D::TiedLogits), so the
// bias [V] is replicated on every rank and its gradient, one term per row
// block, is summed over tp_col and tp_dep (not over tp_row, whose ranks
// hold the same rows).
class Bias2DLayer : public Layer {
 public:
  Bias2DLayer(BoundParam b, ProcessGroup* pg, nn::Groups2D g) : b_(std::move(b)), pg_(pg), g_(g) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kBias, d, "Bias2D"));
    ASSIGN_OR_RETURN(nn::Groups2D g, nn::GetGroups2D(c.pg));
    const ComputeSpec compute{g.depth > 1 ? ComputePattern::kTP2P5D : ComputePattern::kTP2D};
    ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", WeightTensor(d), {d.out}, DistSpec(), compute));
    return LayerPtr(new Bias2DLayer(std::move(b), c.pg, g));
  }
  std::string type() const override { return "Bias2D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    ASSIGN_OR_RETURN(DistSpec want, InputSpec(static_cast<int64_t>(x.global_shape().size())));
    RETURN_IF_ERROR(CheckSpec(x, want, "Bias2D input"));
    ASSIGN_OR_RETURN(Variable b, nn::SumGradOverReplicas(b_.param.variable(), g_, pg_->timeout()));
    ASSIGN_OR_RETURN(Variable y, nn::BiasAdd(x.variable(), b));
    return ColoTensor::FromLocal(y, x.spec(), pg_);
  }
  // The logits' spec: rows as every 2D activation's, the vocabulary whole.
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return nn::Activation2D(ndim, g_.q, g_.depth).Set("tp_row", Placement::Replicate());
  }
  std::vector<BoundParam> Params() override { return {b_}; }

 private:
  BoundParam b_;
  ProcessGroup* pg_;
  nn::Groups2D g_;
};

}  // namespace

void Register2DLayers(LayerRegistry& r) {
  (void)r.Register("Linear2D", Linear2DLayer::Create);
  (void)r.Register("LayerNorm2D", [](const LayerDecl& d, const LayerContext& c) {
    return Norm2DLayer::Create(d, c, nn::Norm2D::Kind::kLayerNorm);
  });
  (void)r.Register("RMSNorm2D", [](const LayerDecl& d, const LayerContext& c) {
    return Norm2DLayer::Create(d, c, nn::Norm2D::Kind::kRmsNorm);
  });
  (void)r.Register("Bias2D", Bias2DLayer::Create);
  (void)r.Register("Embedding2D", [](const LayerDecl& d, const LayerContext& c) {
    return TableLayer<nn::Embedding2D>::Create(d, c, false, "2D");
  });
  (void)r.Register("LMHead2D", [](const LayerDecl& d, const LayerContext& c) {
    return TableLayer<nn::Embedding2D>::Create(d, c, true, "2D");
  });
}

}  // namespace colod::shardformer::layers
