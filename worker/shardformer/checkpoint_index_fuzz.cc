// The checkpoint index parsers on arbitrary text: colod_checkpoint.json
// (ParseCheckpointIndex) and model.safetensors.index.json (ParseWeightMap).
// Errors, never a crash; and what they accept keeps its promises: every file
// named is a plain name, every block lies inside its tensor, and the blocks
// tile it: each element in exactly one block (counted element by element
// where the tensor is small enough).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "common/int_math.h"
#include "worker/shardformer/checkpoint_index.h"

namespace {

void CheckIndex(const colod::shardformer::CheckpointIndex& index) {
  if (index.world_size < 1) std::abort();
  for (const auto& [name, t] : index.tensors) {
    const std::optional<int64_t> elements = colod::CheckedProduct(t.global_shape);
    if (!elements.has_value() || !colod::CheckedProduct(t.hf.shape).has_value()) std::abort();
    int64_t covered = 0;
    for (const colod::shardformer::CheckpointBlock& b : t.blocks) {
      if (!colod::IsPlainFileName(b.file)) std::abort();
      if (b.starts.size() != t.global_shape.size() || b.lengths.size() != t.global_shape.size()) std::abort();
      for (size_t d = 0; d < t.global_shape.size(); ++d) {
        if (b.starts[d] < 0 || b.lengths[d] < 0 || b.starts[d] > t.global_shape[d] - b.lengths[d]) std::abort();
      }
      covered += *colod::CheckedProduct(b.lengths);
    }
    if (covered != *elements) std::abort();
    if (*elements <= (1 << 16)) {  // each element once, marked block by block
      std::vector<uint8_t> hits(static_cast<size_t>(*elements), 0);
      const size_t dims = t.global_shape.size();
      for (const colod::shardformer::CheckpointBlock& b : t.blocks) {
        if (*colod::CheckedProduct(b.lengths) == 0) continue;
        std::vector<int64_t> at(dims, 0);  // an index into the block
        for (;;) {
          int64_t flat = 0;
          for (size_t d = 0; d < dims; ++d) flat = flat * t.global_shape[d] + b.starts[d] + at[d];
          if (++hits[static_cast<size_t>(flat)] != 1) std::abort();
          size_t d = dims;
          while (d > 0 && ++at[d - 1] == b.lengths[d - 1]) at[--d] = 0;
          if (d == 0) break;
        }
      }
    }
    if (t.hf.narrow_dim < -1 || t.hf.narrow_dim >= static_cast<int64_t>(t.hf.shape.size())) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto index = colod::shardformer::ParseCheckpointIndex(text, "fuzz");
  if (index.ok()) CheckIndex(*index);
  auto weights = colod::shardformer::ParseWeightMap(text, "fuzz");
  if (weights.ok()) {
    for (const auto& [tensor, file] : *weights) {
      if (!colod::IsPlainFileName(file)) std::abort();
    }
  }
  return 0;
}
