// Jobs from coloctl's flags: the layout (--tp, --dp, --mode, --depth,
// --sequence-parallel), --device, the model directory and the train flags,
// shared by `submit` and `train` (and the layout by `forward` and TENSOR jobs).
// Every error is INVALID_ARGUMENT naming the flag (a usage error) unless said
// otherwise.
#ifndef COLOD_CLIENT_JOB_FLAGS_H_
#define COLOD_CLIENT_JOB_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator_client.h"
#include "colod/v1/job.pb.h"
#include "worker/shardformer/shard_config.h"
#include "worker/train/trainer.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, data_format);
ABSL_DECLARE_FLAG(std::string, labels);
ABSL_DECLARE_FLAG(std::string, precision);

namespace colod::cli {

// --tp, --dp, --mode, --depth, --sequence-parallel.
absl::StatusOr<shardformer::ShardConfig> ShardFromFlags();
// --device: false for cpu, true for cuda.
absl::StatusOr<bool> CudaFromFlags();
// --comm-timeout (INVALID_ARGUMENT unless positive).
absl::StatusOr<absl::Duration> CommTimeoutFromFlags();

// The train flags (--model, --data, --steps, ...) as training options;
// `require_data` false for a plan, which reads no data.
absl::StatusOr<train::TrainOptions> TrainOptionsFromFlags(bool require_data = true);
// A TRAIN job from the train flags: the model directory's config.json and its
// absolute path as the weights every worker reads; every path absolute.
absl::StatusOr<v1::JobSpec> TrainJobSpecFromFlags();
// Submits a TENSOR job named `name` on the layout of the flags.
absl::StatusOr<v1::Job> SubmitTensorJob(CoordinatorClient& client, const std::string& name);

// `path` made absolute and normal: paths the workers open must not depend on
// coloctl's working directory.
std::string Absolute(const std::string& path);
// The model of `spec` from a Hugging Face directory: its config.json, the
// directory's absolute path as the weights, and (unless --name is given) its
// name as the job's. NOT_FOUND when config.json cannot be read.
absl::Status SetModelFromDir(const std::string& model_dir, v1::JobSpec& spec);

}  // namespace colod::cli

#endif  // COLOD_CLIENT_JOB_FLAGS_H_
