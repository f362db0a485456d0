// Rendering of API objects for coloctl: aligned tables and JSON.
#ifndef COLOD_CLIENT_FORMAT_H_
#define COLOD_CLIENT_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/mesh.pb.h"
#include "colod/v1/tensor.pb.h"
#include "colod/v1/worker.pb.h"
#include "google/protobuf/message.h"

namespace colod {

// A table with a header row; columns padded to their widest cell.
std::string RenderTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// ID, ADDRESS, HOST, DEVICE, STATE, LAST HEARTBEAT (age relative to `now`).
std::string RenderWorkersTable(const std::vector<v1::Worker>& workers, absl::Time now);

// A tensor value's elements as floats (f16, bf16 and integers converted);
// INVALID_ARGUMENT for an unknown dtype, a negative or overflowing shape, or
// data that is not the shape's bytes.
absl::StatusOr<std::vector<float>> TensorValueFloats(const v1::TensorValue& value);
// A tensor value as a .npy file's bytes (f32, f16, i64, i32; INVALID_ARGUMENT
// for bf16, which .npy has no type for, and as TensorValueFloats).
absl::StatusOr<std::string> TensorValueNpy(const v1::TensorValue& value);

// "pending", "running", ...
std::string JobStateLabel(v1::JobState state);
// JOB, NAME, KIND, STATE, LAYOUT, STEP, LOSS, UPDATED, REASON.
std::string RenderJobsTable(const std::vector<v1::Job>& jobs, absl::Time now);
// One job, a field a line.
std::string RenderJob(const v1::Job& job, absl::Time now);
// fp16 training's part of a step's line: "  loss_scale 1024", and
// " (overflowed: no update)" for a step that updated nothing; "" for a step
// of another precision.
std::string LossScaleSuffix(const v1::StepProgress& p);
// One line of a held-out evaluation: "loss 2.345678  perplexity 10.43
// after step 20 (/ckpt/step-000020)".
std::string EvalSummary(const v1::EvalResult& e);
// "1.50 MiB", "12 B": bytes for people (powers of 1024).
std::string HumanBytes(int64_t n);
// The checkpoints a job keeps (Job.checkpoints), oldest first, one row
// each: step, eval loss, size, path, and which is the best and the latest.
std::string RenderCheckpoints(const v1::Job& job);
// The same as JSON: {"checkpoints": [CheckpointInfo, ...]} (proto3 JSON
// names), pretty or on one line, and nothing else of the job.
absl::StatusOr<std::string> RenderCheckpointsJson(const v1::Job& job, bool pretty);
// The rank grid of the ColoTensor document's figure (a row per dp replica,
// a column per tp rank, each cell the rank and its worker), then every
// group per axis.
std::string RenderMesh(const v1::MeshSpec& mesh);

// The values as a line of at most `width` block characters (▁ to █), low
// to high; longer series are averaged into `width` buckets.
std::string Sparkline(const std::vector<double>& values, size_t width);

// The end of `coloctl watch`: the losses' first, last and least with the
// mean tokens/s, the loss curve, and the held-out curve, each in the order
// of its steps (a step a restarted coordinator heard late arrives after
// later ones; each step is in the stream once). Empty without steps.
struct StepPoint {
  int64_t step = 0;
  double value = 0;
};
std::string RenderRunCurves(std::vector<StepPoint> losses, double tokens_per_second_sum,
                            std::vector<StepPoint> evals);

// A dist spec from text: placements "AXIS=R", "AXIS=S(DIM)" (split into the
// axis' size), "AXIS=S(D1,D2|N1,N2)" or "AXIS=P" (pending sum), separated by
// ';', e.g. "tp=S(-1)" or "dp=S(0);tp=S(1)". "R" alone is replicate
// everywhere. Axis sizes come from `mesh`. INVALID_ARGUMENT naming the part.
absl::StatusOr<v1::DistSpec> ParseDistSpecText(const std::string& text, const v1::MeshSpec& mesh);
// The inverse: "tp=S(-1|2)", or "R" when every axis replicates.
std::string DistSpecText(const v1::DistSpec& spec);
// NAME, DTYPE, GLOBAL, SPEC, then a row per rank: RANK, SHAPE, OFFSETS.
std::string RenderTensorLayout(const v1::TensorLayout& layout);

// Proto3 JSON of `message` (field names in lowerCamelCase, enums by name),
// followed by a newline.
absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message, bool pretty);

}  // namespace colod

#endif  // COLOD_CLIENT_FORMAT_H_
