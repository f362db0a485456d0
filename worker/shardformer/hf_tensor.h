// How a layer's parameter maps to a tensor of a Hugging Face checkpoint.
//
// A layer may hold a parameter in another layout than the checkpoint: GPT-2's
// Conv1D stores [in, out] where colod's 1D layers hold [out, in]; a fused
// q|k|v projection is held as [3, out/3, in]; a vocabulary-parallel table
// carries zero padding rows; a 2D layer holds q, k and v as three matrices
// cut from one checkpoint tensor. HfTensor says how: the layer's tensor,
// with its leading dims flattened ([F, last], or [N] for a 1-D checkpoint
// tensor), is the checkpoint tensor's slice along `narrow_dim` from
// `narrow_start`, transposed when `transpose`, padded with zero rows from
// `valid_rows` on. A checkpoint tensor of more than two dims (a Conv2d
// weight) is held as it is stored.
//
// Each rank reads only the block it owns (ReadLayerBlock), and a gathered
// layer tensor converts back for consolidation (LayerToHf, PlaceInHf).
//
// Thread-safety: value types and free functions.
#ifndef COLOD_WORKER_SHARDFORMER_HF_TENSOR_H_
#define COLOD_WORKER_SHARDFORMER_HF_TENSOR_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/shardformer/hf_binding.h"
#include "worker/shardformer/model_files.h"

namespace colod::shardformer {

// Reads [starts, starts + lengths) of the checkpoint tensor (its coordinates).
using HfReader =
    std::function<absl::StatusOr<Tensor>(const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths)>;
// A reader of `hf.name` in `files`; INVALID_ARGUMENT naming the tensor when
// it is missing or its shape is not hf.shape.
absl::StatusOr<HfReader> FileReader(const ModelFiles& files, const HfTensor& hf);
// A reader of an in-memory checkpoint tensor.
HfReader MemoryReader(const Tensor& t);

// The block [starts, starts + lengths) of the layer tensor of shape
// `layer_shape` bound to `hf`, as f32.
absl::StatusOr<Tensor> ReadLayerBlock(const HfTensor& hf, const Shape& layer_shape, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& lengths, const HfReader& read);

// This rank's shard of the parameter under `spec`, reading only its block;
// a leaf that requires grad, named `name`.
absl::StatusOr<ColoParameter> LoadParameter(const HfTensor& hf, const Shape& layer_shape, const DistSpec& spec,
                                            ProcessGroup* pg, const HfReader& read, const std::string& name,
                                            ComputeSpec compute = {}, DType dtype = DType::kF32,
                                            Device device = Device::Cpu());

// The checkpoint slice a full (gathered) layer tensor holds: padding rows
// dropped, transposed back.
absl::StatusOr<Tensor> LayerToHf(const HfTensor& hf, const Tensor& layer_global);
// Writes that slice into the full checkpoint tensor `full` (hf.shape).
absl::Status PlaceInHf(const HfTensor& hf, const Tensor& slice, Tensor& full);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_HF_TENSOR_H_
