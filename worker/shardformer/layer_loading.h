// What the layer adapters of layers_native.cc, layers_1d.cc and
// layers_2d.cc share: reading a declaration's weight and bias (each rank its
// block), the declaration checks, and the registration of each mode's
// layers. Internal to worker/shardformer; policies use LayerRegistry.
//
// Thread-safety: functions of their arguments; a layer belongs to one rank
// thread.
#ifndef COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_
#define COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/shardformer/layers.h"

namespace colod::shardformer::layers {

bool IsMatrix(const LayerDecl& d);  // nn.Linear or Conv1D
bool IsNorm(const LayerDecl& d);    // LayerNorm or RMSNorm

// INVALID_ARGUMENT "`layer` cannot replace PREFIX, a KIND" unless `ok`.
absl::Status Expect(bool ok, const LayerDecl& d, const std::string& layer);
// A policy's kwarg, or `fallback`.
double Kwarg(const LayerContext& c, const std::string& name, double fallback);

// One parameter of the checkpoint, read as `layer_shape` in `spec`.
absl::StatusOr<BoundParam> Load(const LayerContext& c, const std::string& name, const HfTensor& hf,
                                const Shape& layer_shape, const DistSpec& spec, ComputeSpec compute = {});

// A layer's weight and, when its declaration has one, its bias.
struct WeightAndBias {
  BoundParam weight;
  std::optional<BoundParam> bias;

  std::optional<ColoParameter> bias_param() const;
  // Both, for Layer::Params().
  std::vector<BoundParam> list() const;
};
// How a layer holds them: its shapes and specs, and where they sit in the
// stored tensors.
struct WeightAndBiasLayout {
  Shape weight_shape;
  DistSpec weight_spec;
  Shape bias_shape;
  DistSpec bias_spec;
  ComputeSpec compute;
  // The layer holds the stored weight transposed (Conv1D's [in, out] as
  // [out, in], or the reverse).
  bool transpose = false;
  // A fused part: the layer holds the stored weight's dim
  // `weight_narrow_dim` from `narrow_start` (as long as the layer's dim) and
  // the same rows of the bias, named "weight`part`" and "bias`part`".
  int weight_narrow_dim = -1;
  int64_t narrow_start = 0;
  std::string part;
};
absl::StatusOr<WeightAndBias> LoadWeightAndBias(const LayerDecl& d, const LayerContext& c,
                                                const WeightAndBiasLayout& layout);

// The spec that splits dim `dim` over tp in `p` blocks.
DistSpec TpShard(int64_t dim, int p);
// `y` with `x`'s spec and process group.
absl::StatusOr<ColoTensor> SameSpec(const Variable& y, const ColoTensor& x);
// INVALID_ARGUMENT when `x`'s last dim is split.
absl::Status NoShardedLastDim(const ColoTensor& x, const std::string& layer);

// A bias over the last dim: replicated ("native"), or split like a
// vocab-parallel LM head's logits (VocabParallelBias1D: [V_pad] tp: S(0),
// zero padding from V on).
absl::StatusOr<std::unique_ptr<Layer>> CreateBias(const LayerDecl& d, const LayerContext& c, bool vocab_parallel);

// Each mode's layers, registered by LayerRegistry::Global().
void RegisterNativeLayers(LayerRegistry& registry);
void Register1DLayers(LayerRegistry& registry);
void Register2DLayers(LayerRegistry& registry);

}  // namespace colod::shardformer::layers

#endif  // COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_
