#include "worker/shardformer/layers.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"
#include "worker/shardformer/layer_loading.h"

namespace colod::shardformer {
namespace layers {

using Kind = LayerDecl::Kind;

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

absl::StatusOr<BoundParam> Load(const LayerContext& c, const std::string& name, const HfTensor& hf,
                                const Shape& layer_shape, const DistSpec& spec, ComputeSpec compute) {
  if (c.files == nullptr) return absl::FailedPreconditionError("no checkpoint to load layers from");
  ASSIGN_OR_RETURN(HfReader read, FileReader(*c.files, hf));
  ASSIGN_OR_RETURN(ColoParameter p,
                   LoadParameter(hf, layer_shape, spec, c.pg, read, name, compute, c.shard->param_dtype,
                                 c.shard->device));
  return BoundParam{name, std::move(p), hf};
}

std::optional<ColoParameter> WeightAndBias::bias_param() const {
  if (!bias.has_value()) return std::nullopt;
  return bias->param;
}

std::vector<BoundParam> WeightAndBias::list() const {
  std::vector<BoundParam> out = {weight};
  if (bias.has_value()) out.push_back(*bias);
  return out;
}

absl::StatusOr<WeightAndBias> LoadWeightAndBias(const LayerDecl& d, const LayerContext& c,
                                                const WeightAndBiasLayout& layout) {
  HfTensor hf = WeightTensor(d);
  hf.transpose = layout.transpose;
  if (layout.weight_narrow_dim >= 0) {
    hf.narrow_dim = layout.weight_narrow_dim;
    hf.narrow_start = layout.narrow_start;
  }
  ASSIGN_OR_RETURN(BoundParam weight, Load(c, "weight" + layout.part, hf, layout.weight_shape, layout.weight_spec,
                                          layout.compute));
  WeightAndBias out{std::move(weight), std::nullopt};
  if (std::optional<HfTensor> bias = BiasTensor(d)) {
    if (layout.weight_narrow_dim >= 0) {
      bias->narrow_dim = 0;
      bias->narrow_start = layout.narrow_start;
    }
    ASSIGN_OR_RETURN(out.bias,
                     Load(c, "bias" + layout.part, *bias, layout.bias_shape, layout.bias_spec, layout.compute));
  }
  return out;
}

absl::StatusOr<ColoTensor> JoinFusedParts(const std::vector<ColoTensor>& parts,
                                          const std::function<DistSpec(int64_t ndim)>& spec) {
  if (parts.empty()) return absl::InvalidArgumentError("no fused parts to join");
  std::vector<Variable> ys;
  for (const ColoTensor& y : parts) {
    Shape s = y.local().shape();
    s.insert(s.end() - 1, 1);
    ASSIGN_OR_RETURN(Variable v, nn::Reshape(y.variable(), s));
    ys.push_back(v);
  }
  const int64_t ndim = ys[0].value().dim();
  ASSIGN_OR_RETURN(Variable cat, nn::Cat(ys, ndim - 2));
  return ColoTensor::FromLocal(cat, spec(ndim), parts[0].process_group());
}

DistSpec TpShard(int64_t dim, int p) { return nn::WithTp({}, Placement::Shard({dim}, {p})); }

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

}  // namespace layers

HfTensor WeightTensor(const LayerDecl& d) {
  using Kind = LayerDecl::Kind;
  HfTensor hf;
  hf.name = d.kind == Kind::kParameter ? d.prefix : absl::StrCat(d.prefix, d.kind == Kind::kBias ? ".bias" : ".weight");
  switch (d.kind) {
    case Kind::kLinear: hf.shape = {d.out, d.in}; break;
    case Kind::kConv1D: hf.shape = {d.in, d.out}; break;
    case Kind::kEmbedding: hf.shape = {d.in, d.out}; break;
    case Kind::kLayerNorm:
    case Kind::kRmsNorm:
    case Kind::kBias: hf.shape = {d.out}; break;
    case Kind::kParameter:
    case Kind::kPatchEmbedding: hf.shape = d.shape; break;
  }
  return hf;
}

std::optional<HfTensor> BiasTensor(const LayerDecl& d) {
  using Kind = LayerDecl::Kind;
  if (!d.bias || d.kind == Kind::kEmbedding || d.kind == Kind::kRmsNorm || d.kind == Kind::kBias ||
      d.kind == Kind::kParameter) {
    return std::nullopt;
  }
  HfTensor hf;
  hf.name = absl::StrCat(d.prefix, ".bias");
  hf.shape = {d.out};
  return hf;
}

LayerRegistry& LayerRegistry::Global() {
  static LayerRegistry* registry = [] {
    auto* r = new LayerRegistry();
    layers::RegisterNativeLayers(*r);
    layers::Register1DLayers(*r);
    layers::Register2DLayers(*r);
    layers::Register3DLayers(*r);
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
