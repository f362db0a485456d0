#include "worker/shardformer/shard_config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/int_math.h"

namespace colod::shardformer {

bool ShardConfig::is_2d() const {
  return layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2D ||
         layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2P5D;
}

bool ShardConfig::is_3d() const { return layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_3D; }

int ShardConfig::head_split() const {
  if (is_3d()) return std::max(1, IntegerRoot(tp(), 3));
  if (!is_2d()) return tp();
  const int depth = layout.tensor_parallel_mode() == v1::TENSOR_PARALLEL_MODE_2P5D ? std::max(1, layout.depth()) : 1;
  return static_cast<int>(std::lround(std::sqrt(tp() / depth)));
}

absl::StatusOr<Recompute> ParseRecompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "full") return Recompute::kFull;
  if (name == "selective") return Recompute::kSelective;
  return absl::InvalidArgumentError(absl::StrCat("recompute '", name, "' is not one of none, full, selective"));
}

const char* RecomputeName(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kFull: return "full";
    case Recompute::kSelective: return "selective";
  }
  return "none";
}

}  // namespace colod::shardformer
