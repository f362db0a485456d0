// Validation of client-submitted job specs, before any worker is touched.
#ifndef COLOD_SERVER_JOB_VALIDATION_H_
#define COLOD_SERVER_JOB_VALIDATION_H_

#include "absl/status/status.h"
#include "colod/v1/job.pb.h"

namespace colod {

// OK, or INVALID_ARGUMENT whose message starts with the offending field's
// path (e.g. "spec.shard.tensor_parallel_size: ...").
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// Checks the tp/dp/mode/depth combination of a ShardConfig (also used by the
// mesh builder). Field paths are prefixed with `path`.
absl::Status ValidateShardConfig(const v1::ShardConfig& shard, absl::string_view path);

}  // namespace colod

#endif  // COLOD_SERVER_JOB_VALIDATION_H_
