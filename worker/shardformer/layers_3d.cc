// The 3D tensor-parallel layers (worker/nn/linear3d.h, embedding3d.h): the
// linears, the norms, the embedding, the LM head computed with its table and
// the vocabulary bias after it.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding3d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear3d.h"
#include "worker/shardformer/layer_loading.h"

namespace colod::shardformer::layers {
namespace {

using Kind = LayerDecl::Kind;
using LayerPtr = std::unique_ptr<Layer>;

// kwargs: n_fused (q|k|v in one checkpoint tensor, held as n matrices) and
// swap (1 for the second linear of a pair: it takes the first one's output
// spec and gives back the residual stream's).
class Linear3DLayer : public Layer {
 public:
  struct Part {
    nn::Linear3D layer;
    WeightAndBias params;
  };
  explicit Linear3DLayer(std::vector<Part> parts) : parts_(std::move(parts)) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "Linear3D"));
    ASSIGN_OR_RETURN(int q, nn::Get3DSize(c.pg));
    const int n = static_cast<int>(Kwarg(c, "n_fused", 1));
    const nn::Linear3D::Options options{.swap = Kwarg(c, "swap", 0) != 0};
    if (n < 1 || d.out % n != 0) {
      return absl::InvalidArgumentError(absl::StrCat(d.prefix, ": ", d.out, " outputs do not split into n_fused = ",
                                                     n, " projections"));
    }
    const int64_t o = d.out / n;
    if (o % (static_cast<int64_t>(q) * q) != 0 || d.in % q != 0) {
      return absl::InvalidArgumentError(absl::StrCat(d.prefix, ": Linear3D needs outputs divisible by q^2 = ", q * q,
                                                     " and inputs by q = ", q, ", got ", d.in, " -> ", o));
    }
    ASSIGN_OR_RETURN(nn::ParamSpecs specs, nn::Linear3D::Specs(c.pg, options));
    const bool conv = d.kind == Kind::kConv1D;
    std::vector<Part> parts;
    for (int k = 0; k < n; ++k) {
      WeightAndBiasLayout layout;
      // A^T [o, in] as [q, o/q, in]: nn.Linear's layout; Conv1D's transposed.
      layout.weight_shape = {q, o / q, d.in};
      layout.weight_spec = specs.weight;
      layout.bias_shape = {q, o / q};
      layout.bias_spec = specs.bias;
      layout.transpose = conv;
      layout.compute = {ComputePattern::kTP3D};
      if (n > 1) {
        layout.weight_narrow_dim = conv ? 1 : 0;
        layout.narrow_start = k * o;
        layout.part = absl::StrCat("[", k, "]");
      }
      ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
      ASSIGN_OR_RETURN(nn::Linear3D layer, nn::Linear3D::FromParameters(p.weight.param, p.bias_param(), c.pg, options));
      parts.push_back(Part{std::move(layer), std::move(p)});
    }
    return LayerPtr(new Linear3DLayer(std::move(parts)));
  }
  std::string type() const override { return "Linear3D"; }
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
    return JoinFusedParts(ys, [this](int64_t ndim) { return parts_[0].layer.OutputSpec(ndim); });
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return parts_[0].layer.InputSpec(ndim); }
  std::vector<BoundParam> Params() override {
    std::vector<BoundParam> out;
    for (Part& p : parts_) {
      for (BoundParam& b : p.params.list()) out.push_back(std::move(b));
    }
    return out;
  }

 private:
  std::vector<Part> parts_;
};

// LayerNorm3D and RMSNorm3D, on the residual stream's spec.
class Norm3DLayer : public Layer {
 public:
  Norm3DLayer(nn::Norm3D layer, WeightAndBias p, ProcessGroup* pg)
      : layer_(std::move(layer)), p_(std::move(p)), pg_(pg) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c, nn::Norm3D::Kind kind) {
    const bool layer_norm = kind == nn::Norm3D::Kind::kLayerNorm;
    RETURN_IF_ERROR(Expect(d.kind == (layer_norm ? Kind::kLayerNorm : Kind::kRmsNorm), d,
                           layer_norm ? "LayerNorm3D" : "RMSNorm3D"));
    const nn::Norm3D::Options options{.kind = kind, .eps = d.eps};
    WeightAndBiasLayout layout;
    layout.weight_shape = layout.bias_shape = {d.out};
    ASSIGN_OR_RETURN(layout.weight_spec, nn::Norm3D::Spec(c.pg, options));
    layout.bias_spec = layout.weight_spec;
    layout.compute = {ComputePattern::kTP3D};
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    ASSIGN_OR_RETURN(nn::Norm3D layer, nn::Norm3D::FromParameters(p.weight.param, p.bias_param(), c.pg, options));
    return LayerPtr(new Norm3DLayer(std::move(layer), std::move(p), c.pg));
  }
  std::string type() const override { return p_.bias.has_value() ? "LayerNorm3D" : "RMSNorm3D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return layer_.Forward(x); }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override { return nn::StreamSpec3D(ndim, pg_); }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  nn::Norm3D layer_;
  WeightAndBias p_;
  ProcessGroup* pg_;
};

// The vocabulary bias after a 3D head (BERT's cls.predictions.bias): the
// logits' rows are split over tp_output and K and their vocabulary is whole,
// replicated over C (nn::Embedding3D::TiedLogits), so the bias [V] is
// replicated on every rank and its gradient, one term per row block, is
// summed over tp_output and K (not over C, whose ranks hold the same rows).
class Bias3DLayer : public Layer {
 public:
  Bias3DLayer(BoundParam b, ProcessGroup* pg, int q) : b_(std::move(b)), pg_(pg), q_(q) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kBias, d, "Bias3D"));
    ASSIGN_OR_RETURN(int q, nn::Get3DSize(c.pg));
    ASSIGN_OR_RETURN(BoundParam b, Load(c, "bias", WeightTensor(d), {d.out}, DistSpec(), {ComputePattern::kTP3D}));
    return LayerPtr(new Bias3DLayer(std::move(b), c.pg, q));
  }
  std::string type() const override { return "Bias3D"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    ASSIGN_OR_RETURN(DistSpec want, InputSpec(static_cast<int64_t>(x.global_shape().size())));
    RETURN_IF_ERROR(CheckSpec(x, want, "Bias3D input"));
    ASSIGN_OR_RETURN(Communicator * r, pg_->Comm("tp_output"));
    ASSIGN_OR_RETURN(Communicator * k, pg_->Comm(nn::kStreamK));
    ASSIGN_OR_RETURN(Variable b, nn::ReduceGradient(b_.param.variable(), r, pg_->timeout()));
    ASSIGN_OR_RETURN(b, nn::ReduceGradient(b, k, pg_->timeout()));
    ASSIGN_OR_RETURN(Variable y, nn::BiasAdd(x.variable(), b));
    return ColoTensor::FromLocal(y, x.spec(), pg_);
  }
  // The logits' spec: rows as every 3D activation's, the vocabulary whole.
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    return nn::Activation3D(ndim, q_, nn::kStreamK, nn::kStreamC).Set(nn::kStreamC, Placement::Replicate());
  }
  std::vector<BoundParam> Params() override { return {b_}; }

 private:
  BoundParam b_;
  ProcessGroup* pg_;
  int q_;
};

}  // namespace

void Register3DLayers(LayerRegistry& r) {
  (void)r.Register("Bias3D", Bias3DLayer::Create);
  (void)r.Register("Linear3D", Linear3DLayer::Create);
  (void)r.Register("LayerNorm3D", [](const LayerDecl& d, const LayerContext& c) {
    return Norm3DLayer::Create(d, c, nn::Norm3D::Kind::kLayerNorm);
  });
  (void)r.Register("RMSNorm3D", [](const LayerDecl& d, const LayerContext& c) {
    return Norm3DLayer::Create(d, c, nn::Norm3D::Kind::kRmsNorm);
  });
  (void)r.Register("Embedding3D", [](const LayerDecl& d, const LayerContext& c) {
    return TableLayer<nn::Embedding3D>::Create(d, c, false, "3D");
  });
  (void)r.Register("LMHead3D", [](const LayerDecl& d, const LayerContext& c) {
    return TableLayer<nn::Embedding3D>::Create(d, c, true, "3D");
  });
}

}  // namespace colod::shardformer::layers
