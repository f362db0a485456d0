// The native layers: the original computation, parameters replicated.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/layer_loading.h"

namespace colod::shardformer::layers {
namespace {

using Kind = LayerDecl::Kind;
using LayerPtr = std::unique_ptr<Layer>;

class NativeLinear : public Layer {
 public:
  // `tied`: an LM head tied to an embedding's table; it shares the parameter and owns none.
  NativeLinear(WeightAndBias p, bool tied) : p_(std::move(p)), tied_(tied) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsMatrix(d), d, "native Linear"));
    WeightAndBiasLayout layout;
    layout.weight_shape = {d.out, d.in};
    layout.bias_shape = {d.out};
    layout.transpose = d.kind == Kind::kConv1D;
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    return LayerPtr(new NativeLinear(std::move(p), false));
  }
  std::string type() const override { return tied_ ? "native tied LM head" : "native Linear"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    return ForwardWithEpilogue(x, nn::Epilogue::kNone);
  }
  // On a CUDA device a weight whose rows (the output width) are not a
  // multiple of 8 computes padded with zero rows to a multiple of 64, and
  // the extra output columns are dropped: cuBLAS runs a GEMM with such a
  // width on its align1 kernels, about 8x slower on an H200 (GPT-2's tied
  // head, 50257 wide; docs/GPU.md). The parameter keeps its shape, so
  // checkpoints, the planner and every consumer of the output see nothing of
  // it; the copies cost about a tenth of the GEMMs' saving.
  absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    Variable w = p_.weight.param.variable();
    std::optional<Variable> b;
    if (p_.bias.has_value()) b = p_.bias->param.variable();
    const int64_t out = w.value().shape()[0];
    const int64_t pad = out % 8 == 0 ? 0 : (64 - out % 64);
    if (pad == 0 || !x.local().device().is_cuda()) {
      ASSIGN_OR_RETURN(Variable y, nn::Linear(x.variable(), w, b, epilogue));
      return SameSpec(y, x);
    }
    const Tensor& wv = w.value();
    ASSIGN_OR_RETURN(Tensor w_zeros, Tensor::Zeros({pad, wv.shape()[1]}, wv.dtype(), wv.device()));
    ASSIGN_OR_RETURN(w, nn::Cat({w, Variable(std::move(w_zeros))}, 0));
    if (b.has_value()) {
      const Tensor& bv = b->value();
      ASSIGN_OR_RETURN(Tensor b_zeros, Tensor::Zeros({pad}, bv.dtype(), bv.device()));
      ASSIGN_OR_RETURN(b, nn::Cat({*b, Variable(std::move(b_zeros))}, 0));
    }
    ASSIGN_OR_RETURN(Variable padded, nn::Linear(x.variable(), w, b, epilogue));
    ASSIGN_OR_RETURN(Variable y, nn::Narrow(padded, -1, 0, out));
    return SameSpec(y, x);
  }
  // The fused LM head and loss pads the weight as Forward does.
  absl::StatusOr<ColoTensor> HeadWeight() override {
    if (p_.bias.has_value()) return Layer::HeadWeight();
    return static_cast<const ColoTensor&>(p_.weight.param);
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return tied_ ? std::vector<BoundParam>{} : p_.list(); }

 private:
  WeightAndBias p_;
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
  absl::StatusOr<LayerPtr> TiedHead() override {
    return LayerPtr(new NativeLinear(WeightAndBias{w_, std::nullopt}, true));
  }

 private:
  BoundParam w_;
};

class NativeNorm : public Layer {
 public:
  NativeNorm(WeightAndBias p, float eps) : p_(std::move(p)), eps_(eps) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(IsNorm(d), d, "native norm"));
    WeightAndBiasLayout layout;
    layout.weight_shape = layout.bias_shape = {d.out};
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    return LayerPtr(new NativeNorm(std::move(p), d.eps));
  }
  std::string type() const override { return p_.bias.has_value() ? "native LayerNorm" : "native RMSNorm"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    Variable y;
    if (p_.bias.has_value()) {
      ASSIGN_OR_RETURN(y, nn::LayerNorm(x.variable(), p_.weight.param.variable(), p_.bias->param.variable(), eps_));
    } else {
      ASSIGN_OR_RETURN(y, nn::RmsNorm(x.variable(), p_.weight.param.variable(), eps_));
    }
    return SameSpec(y, x);
  }
  absl::StatusOr<WithSum> ForwardResidual(const ColoTensor& x, const ColoTensor& residual) override {
    RETURN_IF_ERROR(NoShardedLastDim(x, type()));
    if (x.global_shape() != residual.global_shape() || !CheckSpec(residual, x.spec(), "the residual").ok()) {
      return Layer::ForwardResidual(x, residual);  // its error
    }
    std::optional<Variable> b;
    if (p_.bias.has_value()) b = p_.bias->param.variable();
    ASSIGN_OR_RETURN(nn::ResidualNorm r,
                     nn::AddNorm(x.variable(), residual.variable(), p_.weight.param.variable(), b, eps_));
    ASSIGN_OR_RETURN(ColoTensor sum, SameSpec(r.sum, x));
    ASSIGN_OR_RETURN(ColoTensor y, SameSpec(r.y, x));
    return WithSum{std::move(sum), std::move(y)};
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  WeightAndBias p_;
  float eps_;
};

// A bare parameter (ViT's cls_token, position_embeddings): its forward
// returns it, replicated, whatever it is given.
class NativeParameter : public Layer {
 public:
  explicit NativeParameter(BoundParam p) : p_(std::move(p)) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kParameter && !d.shape.empty(), d, "native Parameter"));
    ASSIGN_OR_RETURN(BoundParam p, Load(c, "", WeightTensor(d), d.shape, DistSpec()));
    return LayerPtr(new NativeParameter(std::move(p)));
  }
  std::string type() const override { return "native Parameter"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    return ColoTensor::FromLocal(p_.param.variable(), DistSpec(), x.process_group());
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return {p_}; }

 private:
  BoundParam p_;
};

// A Conv2d with kernel = stride = patch (ViT's patch embedding) as a Linear
// over the flattened patches: images [B, C, H, W] in, [B, patches, out] out.
class NativePatchEmbedding : public Layer {
 public:
  NativePatchEmbedding(WeightAndBias p, int64_t patch) : p_(std::move(p)), patch_(patch) {}
  static absl::StatusOr<LayerPtr> Create(const LayerDecl& d, const LayerContext& c) {
    RETURN_IF_ERROR(Expect(d.kind == Kind::kPatchEmbedding && d.shape.size() == 4 && d.shape[2] == d.shape[3] &&
                               d.shape[0] == d.out && d.shape[1] * d.shape[2] * d.shape[3] == d.in,
                           d, "native PatchEmbedding"));
    WeightAndBiasLayout layout;
    layout.weight_shape = d.shape;
    layout.bias_shape = {d.out};
    ASSIGN_OR_RETURN(WeightAndBias p, LoadWeightAndBias(d, c, layout));
    return LayerPtr(new NativePatchEmbedding(std::move(p), d.shape[2]));
  }
  std::string type() const override { return "native PatchEmbedding"; }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& images) override {
    RETURN_IF_ERROR(NoShardedLastDim(images, type()));
    const Shape& w = p_.weight.param.global_shape();
    if (images.local().dim() != 4 || images.local().shape()[1] != w[1]) {
      return absl::InvalidArgumentError(absl::StrCat("pixel values must be [batch, ", w[1], ", height, width], got ",
                                                     ShapeToString(images.local().shape())));
    }
    ASSIGN_OR_RETURN(Tensor patches, nn::ImagePatches(images.local(), patch_));
    ASSIGN_OR_RETURN(patches, patches.ToDType(p_.weight.param.local().dtype()));
    // The Conv2d weight [out, C, P, P] read as [out, C * P * P] (a view on the tape).
    ASSIGN_OR_RETURN(Variable flat, nn::Reshape(p_.weight.param.variable(), {w[0], w[1] * w[2] * w[3]}));
    std::optional<Variable> b;
    if (p_.bias.has_value()) b = p_.bias->param.variable();
    ASSIGN_OR_RETURN(Variable y, nn::Linear(Variable(patches), flat, b));
    return ColoTensor::FromLocal(y, images.spec(), images.process_group());
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t) const override { return DistSpec(); }
  std::vector<BoundParam> Params() override { return p_.list(); }

 private:
  WeightAndBias p_;
  int64_t patch_;
};

absl::StatusOr<LayerPtr> CreateNative(const LayerDecl& d, const LayerContext& c) {
  if (d.kind == Kind::kBias) return CreateBias(d, c, /*vocab_parallel=*/false);
  if (d.kind == Kind::kParameter) return NativeParameter::Create(d, c);
  if (d.kind == Kind::kPatchEmbedding) return NativePatchEmbedding::Create(d, c);
  if (IsMatrix(d)) return NativeLinear::Create(d, c);
  if (d.kind == Kind::kEmbedding) return NativeEmbedding::Create(d, c);
  return NativeNorm::Create(d, c);
}

}  // namespace

void RegisterNativeLayers(LayerRegistry& registry) { (void)registry.Register("native", CreateNative); }

}  // namespace colod::shardformer::layers
