// The native model representation ShardFormer rewrites: a tree of modules
// named like the Hugging Face model's (`transformer.h.0.attn.c_attn`), each
// with a class name (`GPT2Attention`), numeric attributes (`num_heads`) and a
// forward function; the leaves are layers (Linear, Conv1D, Embedding,
// LayerNorm, RMSNorm) that a policy replaces with tensor-parallel ones.
//
// Forward functions see ColoTensors and use each tensor's *local* shape, so
// the same model code runs unsharded and sharded once a policy has replaced
// the leaves and adjusted the attributes (ShardFormer's approach: the
// attention forward reads `num_heads`, which the policy divides by tp).
//
// Thread-safety: a model belongs to one rank thread.
#ifndef COLOD_WORKER_SHARDFORMER_MODULE_H_
#define COLOD_WORKER_SHARDFORMER_MODULE_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/nn/functional.h"
#include "worker/shardformer/hf_tensor.h"
#include "worker/shardformer/shard_config.h"

namespace colod::shardformer {

// What a leaf is in the original model (before any replacement).
struct LayerDecl {

  // kBias: a vector added to the last dim (BERT's MLM decoder bias), named
  // "<prefix>.bias". kParameter: a bare tensor of `shape` named `prefix`
  // itself (ViT's cls_token and position_embeddings); its layer's forward
  // returns it. kPatchEmbedding: a Conv2d whose kernel and stride are its
  // patch size, weight [out, channels, patch, patch] (`shape`) and bias
  // [out], computed as a linear over the flattened patches of images
  // [B, channels, H, W] (nn::ImagePatches): [B, patches, out].
  enum class Kind { kLinear, kConv1D, kEmbedding, kLayerNorm, kRmsNorm, kBias, kParameter, kPatchEmbedding };
  Kind kind = Kind::kLinear;
  std::string prefix;  // checkpoint name prefix: "transformer.h.0.attn.c_attn"
  // Linear/Conv1D: in and out features; Embedding: rows (in) and dim (out);
  // norms and biases: the size (out).
  int64_t in = 0, out = 0;
  bool bias = true;  // Linear/Conv1D bias; LayerNorm beta
  float eps = 1e-5f;
  std::string tied_to;  // an LM head sharing this embedding module's table
  Shape shape;          // kParameter's and kPatchEmbedding's weight's

  static LayerDecl Of(Kind kind, std::string prefix, int64_t in, int64_t out, bool bias = true, float eps = 1e-5f);
};
// "Linear", "Conv1D", "Embedding", "LayerNorm", "RMSNorm", "Bias",
// "Parameter", "PatchEmbedding".
const char* KindName(LayerDecl::Kind kind);

// A parameter of a layer and where it lives in the checkpoint.
// The parameter is a handle sharing its tensor and gradient with the layer.
struct BoundParam {
  std::string name;  // in the layer: "weight", "bias"; empty for a kParameter's tensor (named as its module)
  ColoParameter param;
  HfTensor hf;
};

// A leaf module's computation (native or tensor-parallel).
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string type() const = 0;  // "Linear1D_Col", "native Linear", ...
  virtual absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) = 0;
  // Forward, then `epilogue` (GELU) on this rank's piece of the output. A
  // linear that adds its bias to its local output overrides this to fuse the
  // bias and the epilogue: one kernel forward, one backward.
  virtual absl::StatusOr<ColoTensor> ForwardWithEpilogue(const ColoTensor& x, nn::Epilogue epilogue);
  // The layer on a residual stream: sum = x + residual (AddActivations) and
  // Forward(sum). A norm overrides this to add and normalize in one kernel.
  struct WithSum {
    ColoTensor sum, y;
  };
  virtual absl::StatusOr<WithSum> ForwardResidual(const ColoTensor& x, const ColoTensor& residual);
  // The spec this layer wants a rank-`ndim` input in; where a forward
  // rebuilds an activation from local pieces (attention heads), it uses this.
  virtual absl::StatusOr<DistSpec> InputSpec(int64_t ndim) const = 0;
  // The parameters this layer owns (a tied head owns none).
  virtual std::vector<BoundParam> Params() = 0;
  // For embeddings: an LM head computing h E^T with this table.
  virtual absl::StatusOr<std::unique_ptr<Layer>> TiedHead() {
    return absl::UnimplementedError(absl::StrCat(type(), " cannot serve as a tied LM head"));
  }
  // For an LM head that nn::VocabParallelLinearCrossEntropy can compute
  // fused with the loss: its weight [vocab (padded), hidden], whole or split
  // on the vocabulary (dim 0) over tp, multiplied as x W^T with no bias,
  // its input replicated over tp (a native head, VocabParallelLMHead1D, a
  // tied 1D head; not with sequence parallelism). UNIMPLEMENTED otherwise.
  virtual absl::StatusOr<ColoTensor> HeadWeight() {
    return absl::UnimplementedError(absl::StrCat(type(), " is no LM head the fused loss can take"));
  }
};

class Module {
 public:
  using ForwardFn = std::function<absl::StatusOr<ColoTensor>(Module& self, const ColoTensor& x)>;

  Module(std::string cls, ForwardFn forward) : cls_(std::move(cls)), forward_(std::move(forward)) {}
  // A leaf whose class is KindName(decl.kind); it computes once a layer is set.
  static std::unique_ptr<Module> Leaf(LayerDecl decl);

  const std::string& cls() const { return cls_; }
  Module* Add(const std::string& name, std::unique_ptr<Module> child);
  // Drops the child `name` (and its subtree); false when there is none. A
  // pipeline stage drops the layers other stages hold.
  bool Remove(const std::string& name);
  // The direct children, in the order added.
  std::vector<Module*> Children();
  // Their names, in the same order.
  std::vector<std::string> ChildNames() const;
  // The descendant at a dotted path ("attn.c_attn"); nullptr when absent.
  Module* Find(const std::string& path);
  // NOT_FOUND naming the path and this module's class.
  absl::StatusOr<Module*> Get(const std::string& path);
  // This module ("") and its descendants with their dotted paths, depth
  // first, children in the order added.
  std::vector<std::pair<std::string, Module*>> Modules();

  // Numeric attributes (head counts, sizes).
  void SetAttr(const std::string& name, double value) { attrs_[name] = value; }
  absl::StatusOr<double> Attr(const std::string& name) const;
  absl::StatusOr<int64_t> IntAttr(const std::string& name) const;
  bool HasAttr(const std::string& name) const { return attrs_.count(name) > 0; }

  const std::optional<LayerDecl>& decl() const { return decl_; }
  Layer* layer() { return layer_.get(); }
  // While `seen` is set, this leaf computes nothing: its forward stores its
  // input in *seen and returns it. ShardedModel::ForwardTokenLoss runs a
  // model up to its LM head so, to fuse the head with the loss; nullptr
  // restores the layer.
  void set_pass_through(std::optional<ColoTensor>* seen) { pass_through_ = seen; }
  // A layer list's activation recomputation (RunSequential; ShardFormer
  // sets it from ShardConfig::recompute).
  void set_recompute(Recompute r) { recompute_ = r; }
  Recompute recompute() const { return recompute_; }
  void set_layer(std::unique_ptr<Layer> layer) { layer_ = std::move(layer); }
  void set_forward(ForwardFn forward) { forward_ = std::move(forward); }
  // A forward of two inputs: an encoder-decoder's token ids and decoder ids
  // (T5's root). FAILED_PRECONDITION for a module without one.
  using CrossForwardFn =
      std::function<absl::StatusOr<ColoTensor>(Module& self, const ColoTensor& x, const ColoTensor& context)>;
  void set_cross_forward(CrossForwardFn forward) { cross_forward_ = std::move(forward); }
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, const ColoTensor& context);

  // The layer's forward for a leaf (FAILED_PRECONDITION before it is
  // loaded), the forward function otherwise.
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x);
  // Forward followed by `epilogue` on the output; a leaf's layer fuses it
  // where it can (Layer::ForwardWithEpilogue). The models call their MLP's up
  // projection so: Call("c_fc", x, nn::GeluEpilogue(approx)).
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, nn::Epilogue epilogue);
  // Get(path)->Forward(x) and Get(path)->Forward(x, epilogue).
  absl::StatusOr<ColoTensor> Call(const std::string& path, const ColoTensor& x);
  absl::StatusOr<ColoTensor> Call(const std::string& path, const ColoTensor& x, nn::Epilogue epilogue);
  // The leaf at `path` on x + residual, returned with the sum: a block's
  // "x1 = x + attn(h); h2 = ln_2(x1)" is CallResidual("ln_2", x, a), which a
  // norm computes in one kernel (Layer::ForwardResidual).
  absl::StatusOr<Layer::WithSum> CallResidual(const std::string& path, const ColoTensor& x,
                                              const ColoTensor& residual);

 private:
  std::string cls_;
  ForwardFn forward_;
  CrossForwardFn cross_forward_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::map<std::string, double> attrs_;
  std::optional<LayerDecl> decl_;
  std::unique_ptr<Layer> layer_;
  std::optional<ColoTensor>* pass_through_ = nullptr;
  Recompute recompute_ = Recompute::kNone;
};

// A parameter of a model with its full name: the owning module's path and
// the layer's name ("transformer.h.0.attn.c_attn.weight").
struct NamedParam {
  std::string name;
  BoundParam bound;
  // A table several pipeline stages share (an LM head tied to the
  // embedding): their gradients are summed.
  bool tied = false;
  // A copy of a table another stage owns (the last stage's of a tied
  // embedding): neither counted in the gradient norm nor saved.
  bool mirror = false;
  // The (virtual) stages holding a tied table, ascending (the first owns
  // it; TiedTable).
  std::vector<int> tie_stages;
};

// Forward helpers shared by the model families.
//
// The position ids [B, S] of token ids [B, S]: s + offset at position s
// (OPT's learned positions start at row 2), in ids' spec, on ids' device.
absl::StatusOr<ColoTensor> PositionIds(const ColoTensor& ids, int64_t offset = 0);
// A projection's local output [B, S, heads * head_dim] as [B, S, heads,
// head_dim]; INVALID_ARGUMENT naming `what` when it does not hold this
// rank's `heads` heads (a policy that split the heads differently).
absl::StatusOr<Variable> SplitHeads(const ColoTensor& t, int64_t heads, int64_t head_dim, const std::string& what);
// Runs the children of a ModuleList ("0", "1", ...; a pipeline stage's run of
// them) in order. With the list's recompute() kFull, and a forward that
// records (x requires grad), each child runs without recording and is one
// op on the tape that keeps only its input; its backward runs the child
// again, recording, and back-propagates through that (the child's
// collectives re-issued in the order of the backward, the same on every
// rank; its parameters' gradients complete there). kSelective runs each
// child under nn::RecomputeScoresScope.
absl::StatusOr<ColoTensor> RunSequential(Module& list, ColoTensor x);
// x (replicated over tp) split along the sequence dim (1) over tp: where
// sequence-parallel models enter the split region. Backward all-gathers.
absl::StatusOr<ColoTensor> SplitSequence(const ColoTensor& x);
// Calls the layer at `path` on a tensor rebuilt from this rank's `local`
// piece (e.g. attention heads merged back) in the spec that layer wants.
absl::StatusOr<ColoTensor> CallWithLocal(Module& self, const std::string& path, const Variable& local,
                                         ProcessGroup* pg);
// `op`(x) on the local values, in x's spec.
absl::StatusOr<ColoTensor> MapLocal(const ColoTensor& x,
                                    const std::function<absl::StatusOr<Variable>(const Variable&)>& op);

// `a` + `b` for two activations of one spec (residual connections);
// INVALID_ARGUMENT naming both specs otherwise.
absl::StatusOr<ColoTensor> AddActivations(const ColoTensor& a, const ColoTensor& b);

// Whether `spec` splits dim `dim` over some mesh axis.
bool SplitsDim(const DistSpec& spec, int64_t dim);
// `x` in the spec the layer at `path` under `self` takes (ColoTensor::
// Redistribute, which takes no step when it already is): where a replicated part of a
// model (embeddings, a head) meets a sharded one. FAILED_PRECONDITION when
// the module holds no layer.
absl::StatusOr<ColoTensor> ToInputOf(Module& self, const std::string& path, const ColoTensor& x);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_MODULE_H_
