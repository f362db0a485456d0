// Validation of client-submitted job specs, before any worker is touched.
#ifndef COLOD_SPEC_JOB_VALIDATION_H_
#define COLOD_SPEC_JOB_VALIDATION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/worker.pb.h"
#include "spec/model_config.h"

namespace colod {

// Bounds on what every ListJobs lists with each job.
inline constexpr size_t kMaxJobNameBytes = 256;
// Labels: kMaxLabels, kMaxLabelKeyBytes and kMaxLabelValueBytes (common/limits.h).
// A SubmitJob's request_id.
inline constexpr size_t kMaxRequestIdBytes = 256;

// The values of TrainConfig.data_format ("" is auto): the one list that
// coloctl's --data-format, the coordinator and the worker check against.
inline constexpr const char* kDataFormats[] = {"auto", "uint16", "uint32", "npy", "text", "jsonl", "megatron"};
// INVALID_ARGUMENT "'x' is not one of auto, uint16, ..." unless `format` is
// one of kDataFormats or empty.
absl::Status CheckDataFormat(const std::string& format);
// The values of TrainConfig.final_dtype and `coloctl consolidate --dtype`
// ("" is auto), and the check of one, as kDataFormats.
inline constexpr const char* kModelDTypes[] = {"auto", "f32", "bf16", "f16"};
absl::Status CheckModelDType(const std::string& dtype);

// OK, or INVALID_ARGUMENT whose message starts with the offending field's
// path (e.g. "spec.shard.tensor_parallel_size: ..."). Names and labels are
// bounded (above).
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// A TRAIN job's [MASK] id (TrainConfig.mask_token_id) for a model of
// `config`: required for a masked language model (ModelConfig::masked_lm),
// refused for another (`examples`: one that trains on labels or targets, as
// the message says), an id of the vocabulary. INVALID_ARGUMENT saying which,
// without the field's name (the callers put theirs before it).
// ValidateJobSpec and the worker (train::PrepareTrain) check by it.
absl::Status CheckMaskTokenId(const ModelConfig& config, std::optional<int64_t> id, bool examples);
// fp16 training's loss scale (TrainConfig.loss_scale; train::LossScaler, a
// checkpoint's): OK where `scale` is a power of two in [1, kMaxLossScale],
// else INVALID_ARGUMENT saying which, without the field's name.
// ValidateJobSpec and the worker check by it.
inline constexpr double kMaxLossScale = 16777216;  // 2^24
absl::Status CheckLossScale(double scale);
// Its growth window (TrainConfig.loss_scale_window): OK in [1,
// kMaxLossScaleWindow] steps, else INVALID_ARGUMENT.
inline constexpr int64_t kMaxLossScaleWindow = 1000000000;
absl::Status CheckLossScaleWindow(int64_t window);
// The most passes a training step accumulates (TrainConfig.grad_accum).
inline constexpr int kMaxGradAccum = 65536;
// The most micro-batches one training step runs: grad_accum passes of
// micro_batches each (a step reads their losses at once, after its update).
inline constexpr int64_t kMaxMicroBatchesPerStep = 8192;
// The most batches one held-out evaluation reads (TrainConfig.eval_steps).
inline constexpr int64_t kMaxEvalSteps = 1000000;

// A job's restart policy with the defaults filled in (RestartPolicy in
// job.proto): 3 restarts for TRAIN and FORWARD jobs, none for TENSOR jobs;
// 5 minutes of waiting for workers. Always within the bounds below, even
// for a spec ValidateJobSpec refuses.
// ValidateJobSpec's bounds on a restart policy.
inline constexpr int kMaxRestarts = 100;
inline constexpr absl::Duration kMaxWorkerWait = absl::Hours(7 * 24);
struct RestartLimits {
  int max_restarts = 0;
  absl::Duration worker_wait;
};
RestartLimits RestartLimitsOf(const v1::JobSpec& spec);

// Whether placing `job` again resumes it from its checkpoint directory: a
// TRAIN job that recorded a checkpoint there. The scheduler sets resume_from
// by it, and restart reasons say so by it.
bool ResumesFromCheckpoint(const v1::Job& job);

// Whether a rank's error may go away on another attempt (a lost peer, a
// timeout, an abort) rather than being the job's own (bad input, a missing
// file, memory; see RestartPolicy).
bool IsRetryableRankError(absl::StatusCode code);

// What one rank of `spec` holds at least for its model
// (MemoryFloorPerRank), as a job stores it; empty (all zero) for TENSOR jobs
// and for a spec whose model does not parse (ValidateJobSpec reports that).
// The coordinator computes it once, at submit (Job.memory_floor).
v1::MemoryFloor JobMemoryFloor(const v1::JobSpec& spec);
// JobMemoryFloor(spec).total_bytes().
int64_t RankMemoryFloorBytes(const v1::JobSpec& spec);
// The stored floor, and back.
RankMemoryFloor MemoryFloorFromProto(const v1::MemoryFloor& floor);
v1::MemoryFloor MemoryFloorToProto(const RankMemoryFloor& floor);

// FAILED_PRECONDITION when workers are registered and none has the memory
// one rank of a job with `floor` needs, with the need and the largest
// worker's memory: the spec is valid, the cluster cannot run it as it is.
// OK with none registered: the workers check again before they allocate.
absl::Status CheckMemoryFits(const v1::MemoryFloor& floor, const std::vector<v1::Worker>& workers);

// Checks the tp/dp/mode/depth combination of a ShardConfig (also used by the
// mesh builder). Field paths are prefixed with `path`.
absl::Status ValidateShardConfig(const v1::ShardConfig& shard, absl::string_view path);

// Holds `result`'s unread tensor names to what a job keeps of them: the
// first kMaxUnreadTensorsReported, each cut to kMaxUnreadTensorNameBytes
// (common/text.h); their count stays. The worker that sends a result and
// the coordinator that records it both apply it.
void BoundUnreadTensors(v1::ForwardResult& result);

}  // namespace colod

#endif  // COLOD_SPEC_JOB_VALIDATION_H_
