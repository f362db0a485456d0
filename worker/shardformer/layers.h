// The layers a policy can put in a model's leaves, by name (ShardFormer's
// target modules), each built from a LayerDecl and the checkpoint, every
// rank reading only its block of each tensor:
//
//   native                the original layer, parameters replicated
//   Linear1D_Col          worker/nn/linear1d.h; kwargs n_fused (3 for a
//                         fused q|k|v), gather_output
//   Linear1D_Row          worker/nn/linear1d.h
//   VocabParallelEmbedding1D   worker/nn/embedding1d.h (vocabulary padded to
//                         a multiple of make_vocab_size_divisible_by * tp)
//   VocabParallelLMHead1D an untied LM head [V_pad, H] as a Linear1D_Col
//   VocabParallelBias1D   a bias added to vocab-parallel logits ([V_pad] tp: S(0))
//   Norm1D                LayerNorm or RMSNorm (worker/nn/norm.h)
//   Linear2D              worker/nn/linear2d.h (2D and 2.5D); kwargs n_fused
//   LayerNorm2D, RMSNorm2D  nn::Norm2D (worker/nn/linear2d.h)
//   Embedding2D           worker/nn/embedding2d.h
//   LMHead2D              an untied LM head [V, H] computed as Embedding2D's
//                         tied logits
//   Linear3D              worker/nn/linear3d.h; kwargs n_fused, swap (the
//                         second linear of a pair)
//   LayerNorm3D, RMSNorm3D  nn::Norm3D (worker/nn/linear3d.h)
//   Embedding3D           worker/nn/embedding3d.h
//   LMHead3D              an untied LM head [V, H] computed as Embedding3D's
//                         logits
//
// Sequence parallelism comes from the ShardConfig. Users add their own
// layers with LayerRegistry::Register. The adapters live by mode in
// layers_native.cc, layers_1d.cc, layers_2d.cc and layers_3d.cc, and read their
// parameters through layer_loading.h.
//
// Thread-safety: the registry is thread-safe; a layer belongs to one rank thread.
#ifndef COLOD_WORKER_SHARDFORMER_LAYERS_H_
#define COLOD_WORKER_SHARDFORMER_LAYERS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/shardformer/model_files.h"
#include "worker/shardformer/module.h"
#include "worker/shardformer/shard_config.h"

namespace colod::shardformer {

// What a layer factory gets besides the declaration.
struct LayerContext {
  const ModelFiles* files = nullptr;
  ProcessGroup* pg = nullptr;
  const ShardConfig* shard = nullptr;
  std::map<std::string, double> kwargs;  // from the SubModuleReplacementDescription
};
using LayerFactory =
    std::function<absl::StatusOr<std::unique_ptr<Layer>>(const LayerDecl& decl, const LayerContext& context)>;

class LayerRegistry {
 public:
  // The process-wide registry, holding the layers above.
  static LayerRegistry& Global();
  // ALREADY_EXISTS for a taken name.
  absl::Status Register(const std::string& name, LayerFactory factory);
  // NOT_FOUND naming the known layers.
  absl::StatusOr<LayerFactory> Get(const std::string& name) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, LayerFactory> factories_ ABSL_GUARDED_BY(mu_);
};

// The checkpoint tensors of a declaration's weight and bias, as stored.
HfTensor WeightTensor(const LayerDecl& decl);
std::optional<HfTensor> BiasTensor(const LayerDecl& decl);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_LAYERS_H_
