// HfTensor: how a layer's parameter maps to a tensor of a Hugging Face
// checkpoint (hf_tensor.h says how it is read and written back). On its own
// so that the checkpoint index (checkpoint_index.h), which records it, needs
// nothing else of ShardFormer.
//
// Thread-safety: a value type.
#ifndef COLOD_WORKER_SHARDFORMER_HF_BINDING_H_
#define COLOD_WORKER_SHARDFORMER_HF_BINDING_H_

#include <cstdint>
#include <string>

#include "worker/tensor/tensor.h"

namespace colod::shardformer {

struct HfTensor {
  std::string name;          // "h.0.attn.c_attn.weight"
  Shape shape;               // the checkpoint tensor's full shape, as config.json implies
  bool transpose = false;    // the layer holds the slice transposed (2-D checkpoint tensors)
  int64_t narrow_dim = -1;   // the layer holds a slice along this checkpoint dim...
  int64_t narrow_start = 0;  // ...from here (its length is the layer's)
  int64_t valid_rows = -1;   // flattened layer rows (elements, for a vector) from here on are zero padding
};

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_HF_BINDING_H_
