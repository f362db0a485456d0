// What the layer adapters of layers_native.cc, layers_1d.cc, layers_2d.cc
// and layers_3d.cc share: reading a declaration's weight and bias (each rank its
// block), the declaration checks, and the registration of each mode's
// layers. Internal to worker/shardformer; policies use LayerRegistry.
//
// Thread-safety: functions of their arguments; a layer belongs to one rank
// thread.
#ifndef COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_
#define COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
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

// A fused projection's outputs, each this rank's [.., out/n] piece of one
// projection, joined as [.., n, out/n] in the spec `spec(ndim)` gives for
// the joined rank (the 2D and 3D linears hold q, k and v as n matrices).
absl::StatusOr<ColoTensor> JoinFusedParts(const std::vector<ColoTensor>& parts,
                                          const std::function<DistSpec(int64_t ndim)>& spec);

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

// An embedding table of the 2D or 3D layouts (`Table` is nn::Embedding2D or
// nn::Embedding3D, `mode` "2D" or "3D"): the lookup, or with `head` an LM
// head computing h E^T with the table, which a tied head shares (it owns no
// parameter).
template <class Table>
class TableLayer : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<Layer>> Create(const LayerDecl& d, const LayerContext& c, bool head,
                                                       const std::string& mode) {
    if (head) {
      RETURN_IF_ERROR(Expect(d.kind == LayerDecl::Kind::kLinear && !d.bias, d, "LMHead" + mode));
    } else {
      RETURN_IF_ERROR(Expect(d.kind == LayerDecl::Kind::kEmbedding, d, "Embedding" + mode));
    }
    ASSIGN_OR_RETURN(DistSpec spec, Table::Spec(c.pg));
    // Both an embedding [V, H] and an LM head Linear(H -> V) store [V, H].
    const Shape shape = head ? Shape{d.out, d.in} : Shape{d.in, d.out};
    ASSIGN_OR_RETURN(BoundParam w, Load(c, "weight", WeightTensor(d), shape, spec));
    ASSIGN_OR_RETURN(Table table, Table::FromParameters(w.param, c.pg));
    return std::unique_ptr<Layer>(new TableLayer(std::move(table), std::move(w), mode, head, true));
  }
  std::string type() const override {
    return head_ ? (owns_ ? "LMHead" + mode_ : "tied Embedding" + mode_ + " LM head") : "Embedding" + mode_;
  }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    if (head_) return table_.TiedLogits(x);
    return table_.Forward(x.local());
  }
  absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const override {
    if (head_) return table_.ActivationSpec(ndim);
    return DistSpec();
  }
  std::vector<BoundParam> Params() override { return owns_ ? std::vector<BoundParam>{w_} : std::vector<BoundParam>{}; }
  absl::StatusOr<std::unique_ptr<Layer>> TiedHead() override {
    if (head_) return Layer::TiedHead();
    return std::unique_ptr<Layer>(new TableLayer(table_, w_, mode_, true, false));
  }

 private:
  TableLayer(Table table, BoundParam w, std::string mode, bool head, bool owns)
      : table_(std::move(table)), w_(std::move(w)), mode_(std::move(mode)), head_(head), owns_(owns) {}
  Table table_;
  BoundParam w_;
  std::string mode_;
  bool head_, owns_;
};

// Each mode's layers, registered by LayerRegistry::Global().
void RegisterNativeLayers(LayerRegistry& registry);
void Register1DLayers(LayerRegistry& registry);
void Register2DLayers(LayerRegistry& registry);
void Register3DLayers(LayerRegistry& registry);

}  // namespace colod::shardformer::layers

#endif  // COLOD_WORKER_SHARDFORMER_LAYER_LOADING_H_
