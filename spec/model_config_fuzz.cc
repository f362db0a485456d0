// ParseModelConfig on arbitrary text, then what the coordinator and
// `coloctl plan` compute from an accepted config (parameter count, memory
// floor, shardability and the plan for every mode, the layouts of 8 ranks):
// errors, never a crash or an overflowed number.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "spec/model_config.h"
#include "spec/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<colod::ModelConfig> c = colod::ParseModelConfig(text);
  if (!c.ok()) return 0;
  absl::StatusOr<int64_t> n = colod::ParameterCount(*c);
  if (!n.ok() || *n < 1) std::abort();  // an accepted config has a count
  if (c->num_layers > colod::kMaxLayers) std::abort();
  for (colod::v1::TensorParallelMode mode :
       {colod::v1::TENSOR_PARALLEL_MODE_1D, colod::v1::TENSOR_PARALLEL_MODE_2D, colod::v1::TENSOR_PARALLEL_MODE_2P5D,
        colod::v1::TENSOR_PARALLEL_MODE_3D}) {
    colod::v1::JobSpec spec;
    spec.set_kind(colod::v1::JOB_KIND_TRAIN);
    spec.mutable_shard()->set_tensor_parallel_size(mode == colod::v1::TENSOR_PARALLEL_MODE_3D ? 8 : 4);
    spec.mutable_shard()->set_data_parallel_size(1);
    spec.mutable_shard()->set_tensor_parallel_mode(mode);
    if (mode == colod::v1::TENSOR_PARALLEL_MODE_2P5D) spec.mutable_shard()->set_depth(1);
    (void)colod::CheckShardable(*c, spec.shard());
    absl::StatusOr<colod::RankMemoryFloor> floor = colod::MemoryFloorPerRank(*c, spec);
    if (floor.ok() && (floor->total_bytes < floor->param_bytes || floor->param_bytes < 0)) std::abort();
    absl::StatusOr<colod::JobPlan> plan = colod::PlanJob(*c, spec);
    if (plan.ok() && (plan->total_bytes < plan->param_bytes || plan->activation_bytes < 0 || plan->wire_bytes < 0)) {
      std::abort();
    }
  }
  // Every layout of 8 ranks, as `coloctl plan --world 8` asks.
  colod::v1::JobSpec train;
  train.set_kind(colod::v1::JOB_KIND_TRAIN);
  (void)colod::RankLayouts(*c, train, 8, int64_t{1} << 34);
  return 0;
}
