// A TRAIN job's spec (colod.v1.JobSpec, what clients submit) as the options
// of the training loop: how a worker daemon turns an AssignJob into a run,
// and how coloctl builds the spec that the same run comes from.
#ifndef COLOD_WORKER_TRAIN_JOB_OPTIONS_H_
#define COLOD_WORKER_TRAIN_JOB_OPTIONS_H_

#include <string>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"
#include "worker/train/trainer.h"

namespace colod::train {

// The parameter dtype of a run that names no precision: bf16 (mixed
// precision, f32 master weights) on CUDA devices, f32 on the CPU.
DType DefaultParamDType(bool cuda);
// The precision that trains parameters of `param_dtype` (f32: FP32, bf16:
// BF16_MIXED, f16: FP16_MIXED).
v1::Precision PrecisionOf(DType param_dtype);

// `spec` (a validated TRAIN job) with the model read from `model_dir` (the
// worker's directory holding config.json and the weights), for ranks on CUDA
// devices or not (`cuda`, which decides an unspecified precision). The
// default of each zero field is the one documented in job.proto.
// INVALID_ARGUMENT for a data format or optimizer it does not know.
absl::StatusOr<TrainOptions> TrainOptionsFromSpec(const v1::JobSpec& spec, const std::string& model_dir,
                                                  bool cuda);

// The inverse, for clients: the TrainConfig and ShardConfig of `options`
// (model_dir is not part of it; the caller sets ModelSpec).
v1::JobSpec SpecFromTrainOptions(const TrainOptions& options);

// A step's report as a job's StepProgress event (what the worker sends the
// coordinator, and what coloctl prints).
v1::StepProgress StepProgressOf(const StepStats& st);
// An evaluation as the job reports it, with the checkpoint written after
// the same step (if any).
v1::EvalResult EvalResultOf(const EvalStats& e, const std::string& checkpoint);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_JOB_OPTIONS_H_
