#include "spec/job_validation.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/limits.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"
#include "spec/model_config.h"

namespace colod {
namespace {


absl::Status Invalid(absl::string_view path, absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ".", field, ": ", why));
}

// Every string field of `m` (at `path`), nested and repeated ones too, is
// UTF-8: protobuf's parse refuses one that is not, so a spec holding one
// (a path or a name with other bytes) cannot be sent, and the sender would
// hear only INTERNAL. Said here, naming the field, before anything is sent.
absl::Status CheckUtf8Strings(const google::protobuf::Message& m, const std::string& path) {
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    const std::string at = absl::StrCat(path, ".", f->name());
    if (f->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
      const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
      std::string scratch;
      for (int i = 0; i < n; ++i) {
        const std::string& v =
            f->is_repeated() ? r->GetRepeatedStringReference(m, f, i, &scratch) : r->GetStringReference(m, f, &scratch);
        if (!IsValidUtf8(v)) {
          return absl::InvalidArgumentError(
              absl::StrCat(at, f->is_repeated() ? absl::StrCat("[", i, "]") : "", ": not valid UTF-8 text"));
        }
      }
    } else if (f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          RETURN_IF_ERROR(CheckUtf8Strings(r->GetRepeatedMessage(m, f, i), absl::StrCat(at, "[", i, "]")));
        }
      } else {
        RETURN_IF_ERROR(CheckUtf8Strings(r->GetMessage(m, f), at));
      }
    }
  }
  return absl::OkStatus();
}

// The model's config.json must parse for a family the workers know, and the
// shard layout must fit it (heads divisible by tp, ...): a job that cannot
// load is refused here rather than failing on every worker.
absl::StatusOr<ModelConfig> ValidateModel(const v1::ModelSpec& model, const v1::ShardConfig& shard,
                                                       absl::string_view path) {
  if (model.config_json().empty()) {
    return Invalid(path, "config_json", "required: the content of the model's config.json");
  }
  nlohmann::json config = ParseJson(model.config_json());
  if (config.is_discarded()) return Invalid(path, "config_json", "is not valid JSON");
  if (!config.is_object()) return Invalid(path, "config_json", "must be a JSON object");
  auto it = config.find("model_type");
  if (it == config.end() || !it->is_string() || it->get<std::string>().empty()) {
    return Invalid(path, "config_json", "has no string field \"model_type\"");
  }
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(model.config_json());
  if (!parsed.ok()) return Invalid(path, "config_json", parsed.status().message());
  if (absl::Status s = CheckShardable(*parsed, shard); !s.ok()) {
    return Invalid("spec", "shard", s.message());
  }
  if (!model.weights_path().empty() && !model.upload_id().empty()) {
    return Invalid(path, "weights_path", "set either weights_path or upload_id, not both");
  }
  if (model.weights_path().empty() && model.upload_id().empty()) {
    return Invalid(path, "weights_path",
                   "required (or upload_id): a model.safetensors file or a model directory every worker can read");
  }
  return parsed;
}

// "1d", "2d", "2.5d" or "3d".
std::string ModeName(const v1::ShardConfig& s) {
  switch (s.tensor_parallel_mode()) {
    case v1::TENSOR_PARALLEL_MODE_2D:
      return "2d";
    case v1::TENSOR_PARALLEL_MODE_2P5D:
      return "2.5d";
    case v1::TENSOR_PARALLEL_MODE_3D:
      return "3d";
    default:
      return "1d";
  }
}

// The blocks a valid layout (ValidateShardConfig) splits a micro-batch's
// sequences into: q in 2d (tp = q * q), q * depth in 2.5d (tp = depth * q *
// q), q * q in 3d (tp = q * q * q); 1 in 1d.
int BatchBlocks(const v1::ShardConfig& s) {
  const int tp = std::max(1, s.tensor_parallel_size());
  switch (s.tensor_parallel_mode()) {
    case v1::TENSOR_PARALLEL_MODE_2D:
      return IntegerRoot(tp, 2);
    case v1::TENSOR_PARALLEL_MODE_2P5D:
      return s.depth() >= 1 && tp % s.depth() == 0 ? IntegerRoot(tp / s.depth(), 2) * s.depth() : 1;
    case v1::TENSOR_PARALLEL_MODE_3D: {
      const int q = IntegerRoot(tp, 3);
      return q * q;
    }
    default:
      return 1;
  }
}

absl::Status ValidateTrain(const v1::TrainConfig& t, const v1::ShardConfig& shard,
                           absl::string_view path) {
  if (t.steps() < 1) return Invalid(path, "steps", absl::StrCat("must be >= 1, got ", t.steps()));
  if (t.batch_size() < 1) {
    return Invalid(path, "batch_size", absl::StrCat("must be >= 1, got ", t.batch_size()));
  }
  const int dp = shard.data_parallel_size();
  if (t.batch_size() % dp != 0) {
    return Invalid(path, "batch_size",
                   absl::StrCat(t.batch_size(), " is not divisible by data_parallel_size ", dp));
  }
  if (t.seq_len() < 1) return Invalid(path, "seq_len", absl::StrCat("must be >= 1, got ", t.seq_len()));
  if (!(t.learning_rate() > 0) || !std::isfinite(t.learning_rate())) {
    return Invalid(path, "learning_rate", absl::StrCat("must be a finite number > 0, got ", t.learning_rate()));
  }
  if (!(t.weight_decay() >= 0) || !std::isfinite(t.weight_decay())) {
    return Invalid(path, "weight_decay", "must be a finite number >= 0");
  }
  if (!(t.momentum() >= 0 && t.momentum() < 1)) return Invalid(path, "momentum", "must be in [0, 1)");
  if (t.warmup_steps() < 0) return Invalid(path, "warmup_steps", "must be >= 0");
  if (!(t.grad_clip_norm() >= 0) || !std::isfinite(t.grad_clip_norm())) {
    return Invalid(path, "grad_clip_norm", "must be a finite number >= 0 (0 disables clipping)");
  }
  if (t.micro_batches() < 0) return Invalid(path, "micro_batches", "must be >= 0");
  if (t.micro_batches() > 1 && (t.batch_size() / dp) % t.micro_batches() != 0) {
    return Invalid(path, "micro_batches",
                   absl::StrCat("the per-rank batch ", t.batch_size() / dp,
                                " is not divisible by micro_batches ", t.micro_batches()));
  }
  // Each micro-batch's sequences split into the layout's batch blocks (q in
  // 2d, q * depth in 2.5d, q * q in 3d: its layers' row blocks): refused
  // here, not by a rank's embedding once the job runs.
  if (const int blocks = BatchBlocks(shard); blocks > 1) {
    const int64_t rows = t.batch_size() / dp / std::max(1, t.micro_batches());
    if (rows % blocks != 0) {
      return Invalid(path, "batch_size",
                     absl::StrCat(t.batch_size(), " makes micro-batches of ", rows, " sequences a replica (over ",
                                  "data_parallel_size ", dp, t.micro_batches() > 1 ? absl::StrCat(
                                      " and ", t.micro_batches(), " micro_batches") : "",
                                  "), which ", ModeName(shard), " tp ", shard.tensor_parallel_size(),
                                  " splits into ", blocks, " blocks: make them a multiple of ", blocks));
    }
  }
  if (t.data_path().empty()) return Invalid(path, "data_path", "required for TRAIN jobs");
  if (absl::Status grouped = CheckInterleavedMicroBatches(shard, t.micro_batches()); !grouped.ok()) {
    return Invalid(path, "micro_batches", grouped.message());
  }
  if (t.checkpoint_every() < 0) return Invalid(path, "checkpoint_every", "must be >= 0");
  if (t.checkpoint_every() > 0 && t.checkpoint_dir().empty()) {
    return Invalid(path, "checkpoint_dir", "required when checkpoint_every > 0");
  }
  if (!v1::Optimizer_IsValid(t.optimizer())) return Invalid(path, "optimizer", "unknown value");
  if (!v1::Precision_IsValid(t.precision())) return Invalid(path, "precision", "unknown value");
  if (t.has_loss_scale() || t.loss_scale_window() != 0) {
    if (t.precision() != v1::PRECISION_FP16_MIXED && t.precision() != v1::PRECISION_UNSPECIFIED) {
      return Invalid(path, t.has_loss_scale() ? "loss_scale" : "loss_scale_window",
                     "only fp16 training (PRECISION_FP16_MIXED) scales its loss");
    }
    if (t.has_loss_scale()) {
      if (absl::Status scale = CheckLossScale(t.loss_scale()); !scale.ok()) {
        return Invalid(path, "loss_scale", scale.message());
      }
    }
    if (t.loss_scale_window() != 0) {
      if (absl::Status window = CheckLossScaleWindow(t.loss_scale_window()); !window.ok()) {
        return Invalid(path, "loss_scale_window", window.message());
      }
    }
  }
  if (!v1::Recompute_IsValid(t.recompute())) return Invalid(path, "recompute", "unknown value");
  if (absl::Status format = CheckDataFormat(t.data_format()); !format.ok()) {
    return Invalid(path, "data_format", format.message());
  }
  if (!(t.min_learning_rate() >= 0) || t.min_learning_rate() > t.learning_rate()) {
    return Invalid(path, "min_learning_rate", "must be in [0, learning_rate]");
  }
  if (t.stop_after() < 0) return Invalid(path, "stop_after", "must be >= 0");
  if (t.stop_after() > 0 && t.stop_after() < t.steps() && !t.eval_only() && t.checkpoint_dir().empty()) {
    return Invalid(
        path, "checkpoint_dir",
        absl::StrCat("required with stop_after ", t.stop_after(), " (before the run's last step, ", t.steps(),
                     "): the stop's checkpoint keeps the steps trained, for a resume (coloctl: "
                     "--save DIR)"));
  }
  if (absl::Status dtype = CheckModelDType(t.final_dtype()); !dtype.ok()) {
    return Invalid(path, "final_dtype", dtype.message());
  }
  if (!t.final_dtype().empty() && t.final_dtype() != "auto" && t.final_dir().empty()) {
    return Invalid(path, "final_dtype", "it is the dtype of final_dir's model: set final_dir, or leave it empty");
  }
  if (t.eval_only() && !t.final_dir().empty()) {
    return Invalid(path, "final_dir", "an eval_only run trains nothing and writes no model: leave it empty");
  }
  if (t.bucket_bytes() < 0) return Invalid(path, "bucket_bytes", "must be >= 0 (0: 25 MiB)");
  if (t.zero_stage() < 0 || t.zero_stage() > 2) {
    return Invalid(path, "zero_stage", absl::StrCat("must be 0, 1 or 2, got ", t.zero_stage()));
  }
  if (t.grad_accum() < 0 || t.grad_accum() > kMaxGradAccum) {
    return Invalid(path, "grad_accum",
                   absl::StrCat("must be in [0, ", kMaxGradAccum, "] (0 or 1: none), got ", t.grad_accum()));
  }
  if (static_cast<int64_t>(t.batch_size()) * std::max(1, t.grad_accum()) > std::numeric_limits<int32_t>::max()) {
    return Invalid(path, "grad_accum",
                   absl::StrCat(t.grad_accum(), " passes of batch_size ", t.batch_size(), " are too many sequences a step"));
  }
  if (const int64_t per_step = int64_t{std::max(1, t.grad_accum())} * std::max(1, t.micro_batches());
      per_step > kMaxMicroBatchesPerStep) {
    return Invalid(path, t.grad_accum() > 1 ? "grad_accum" : "micro_batches",
                   absl::StrCat("grad_accum ", std::max(1, t.grad_accum()), " x micro_batches ",
                                std::max(1, t.micro_batches()), " is ", per_step, " micro-batches a step; at most ",
                                kMaxMicroBatchesPerStep));
  }
  if (!t.eval_data_path().empty() && t.eval_split() != 0) {
    return Invalid(path, "eval_split", "and eval_data_path: hold out a part of data_path or evaluate on "
                                      "eval_data_path, not both");
  }
  if (t.eval_split() != 0 && !(t.eval_split() > 0 && t.eval_split() < 1)) {
    return Invalid(path, "eval_split", absl::StrCat("must be in (0, 1) (0: none), got ", t.eval_split()));
  }
  const bool evaluates = !t.eval_data_path().empty() || t.eval_split() != 0;
  if (t.eval_every() < 0) return Invalid(path, "eval_every", "must be >= 0 (0: after the last step only)");
  if (t.eval_steps() < 0 || t.eval_steps() > kMaxEvalSteps) {
    return Invalid(path, "eval_steps", absl::StrCat("must be in [0, ", kMaxEvalSteps, "] (0: the held-out data "
                                                    "once, at most 100 batches), got ", t.eval_steps()));
  }
  if (t.keep_last() < 0) return Invalid(path, "keep_last", absl::StrCat("must be >= 0 (0: all), got ", t.keep_last()));
  if ((t.keep_last() > 0 || t.keep_best()) && t.checkpoint_every() < 1) {
    return Invalid(path, t.keep_last() > 0 ? "keep_last" : "keep_best",
                   "prunes checkpoints: it needs checkpoint_every > 0 and checkpoint_dir");
  }
  if (t.keep_best() && (!evaluates || t.eval_every() < 1 || t.checkpoint_every() % t.eval_every() != 0)) {
    return Invalid(path, "keep_best",
                   absl::StrCat("keeps the checkpoint of the lowest eval loss: it needs held-out data (eval_split or "
                                "eval_data_path) and an eval_every that divides checkpoint_every (",
                                t.checkpoint_every(), "), so that every checkpoint is evaluated; eval_every is ",
                                t.eval_every()));
  }
  if (!evaluates) {
    for (const auto& [field, set] : {std::pair<const char*, bool>{"eval_every", t.eval_every() != 0},
                                     {"eval_steps", t.eval_steps() != 0},
                                     {"eval_only", t.eval_only()},
                                     {"eval_labels_path", !t.eval_labels_path().empty()}}) {
      if (set) return Invalid(path, field, "needs held-out data: eval_data_path or eval_split");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateShardConfig(const v1::ShardConfig& s, absl::string_view path) {
  const int tp = s.tensor_parallel_size();
  const int dp = s.data_parallel_size();
  if (tp < 1) return Invalid(path, "tensor_parallel_size", absl::StrCat("must be >= 1, got ", tp));
  if (dp < 1) return Invalid(path, "data_parallel_size", absl::StrCat("must be >= 1, got ", dp));
  const int pp = s.pipeline_parallel_size();
  if (pp < 0) return Invalid(path, "pipeline_parallel_size", absl::StrCat("must be >= 0 (0 or 1: none), got ", pp));
  // tp * dp < 2^62 fits; pp multiplies only what is already in range.
  const int64_t tp_dp = static_cast<int64_t>(tp) * dp;
  const int64_t world = tp_dp > kMaxWorldSize ? tp_dp : tp_dp * std::max(1, pp);
  if (world > kMaxWorldSize) {
    return Invalid(path, pp > 1 ? "pipeline_parallel_size" : "data_parallel_size",
                   absl::StrCat(pp > 1 ? "tp * pp * dp = " : "tp * dp = ", world, " exceeds ", kMaxWorldSize));
  }
  if (absl::Status chunks = CheckVirtualStages(s); !chunks.ok()) {
    return Invalid(path, "virtual_stages", chunks.message());
  }
  const int v = s.virtual_stages();
  const int64_t stages = int64_t{std::max(1, pp)} * std::max(1, v);
  if (s.pipeline_stage_layers_size() > 0 && s.pipeline_stage_layers_size() != stages) {
    return Invalid(path, "pipeline_stage_layers",
                   absl::StrCat("lists ", s.pipeline_stage_layers_size(), " stages, not pipeline_parallel_size ", pp,
                                v > 1 ? absl::StrCat(" x virtual_stages ", v, " = ", stages) : ""));
  }
  const int depth = s.depth();
  switch (s.tensor_parallel_mode()) {
    case v1::TENSOR_PARALLEL_MODE_UNSPECIFIED:
    case v1::TENSOR_PARALLEL_MODE_1D:
      if (depth != 0) return Invalid(path, "depth", "is only used by 2.5d; must be 0");
      break;
    case v1::TENSOR_PARALLEL_MODE_2D:
      if (depth != 0) return Invalid(path, "depth", "is only used by 2.5d; must be 0");
      if (IntegerRoot(tp, 2) == 0) {
        return Invalid(path, "tensor_parallel_size",
                       absl::StrCat("2d needs a square tp = q*q, got ", tp));
      }
      break;
    case v1::TENSOR_PARALLEL_MODE_2P5D:
      if (depth < 1) return Invalid(path, "depth", absl::StrCat("2.5d needs depth >= 1, got ", depth));
      if (tp % depth != 0 || IntegerRoot(tp / depth, 2) == 0) {
        return Invalid(path, "tensor_parallel_size",
                       absl::StrCat("2.5d needs tp = depth*q*q, got tp ", tp, " with depth ", depth));
      }
      break;
    case v1::TENSOR_PARALLEL_MODE_3D:
      if (depth != 0) return Invalid(path, "depth", "is only used by 2.5d; must be 0");
      if (IntegerRoot(tp, 3) == 0) {
        return Invalid(path, "tensor_parallel_size",
                       absl::StrCat("3d needs a cube tp = q*q*q, got ", tp));
      }
      break;
    default:
      return Invalid(path, "tensor_parallel_mode", absl::StrCat("unknown value ", s.tensor_parallel_mode()));
  }
  if (s.sequence_parallel() && s.tensor_parallel_mode() != v1::TENSOR_PARALLEL_MODE_1D &&
      s.tensor_parallel_mode() != v1::TENSOR_PARALLEL_MODE_UNSPECIFIED) {
    return Invalid(path, "sequence_parallel", "is supported with tensor_parallel_mode 1d only");
  }
  return absl::OkStatus();
}

RestartLimits RestartLimitsOf(const v1::JobSpec& spec) {
  RestartLimits l;
  const v1::RestartPolicy& r = spec.restart();
  l.max_restarts = r.has_max_restarts() ? r.max_restarts() : spec.kind() == v1::JOB_KIND_TENSOR ? 0 : 3;
  // Within ValidateJobSpec's bounds whatever the spec says: a job record
  // read back from disk was validated by an older build, or not at all.
  l.max_restarts = std::clamp(l.max_restarts, 0, kMaxRestarts);
  l.worker_wait = FromProtoDuration(r.worker_wait());
  if (l.worker_wait <= absl::ZeroDuration()) l.worker_wait = absl::Minutes(5);
  l.worker_wait = std::min(l.worker_wait, kMaxWorkerWait);
  return l;
}

bool ResumesFromCheckpoint(const v1::Job& job) {
  return job.spec().kind() == v1::JOB_KIND_TRAIN && !job.last_checkpoint().empty() &&
         !job.spec().train().checkpoint_dir().empty();
}

namespace {

absl::StatusOr<RankMemoryFloor> FloorOf(const v1::JobSpec& spec) {
  if (spec.kind() == v1::JOB_KIND_TENSOR) return RankMemoryFloor();
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(spec.model().config_json()));
  return MemoryFloorPerRank(config, spec);
}

}  // namespace

v1::MemoryFloor JobMemoryFloor(const v1::JobSpec& spec) {
  absl::StatusOr<RankMemoryFloor> floor = FloorOf(spec);
  return floor.ok() ? MemoryFloorToProto(*floor) : v1::MemoryFloor();
}

int64_t RankMemoryFloorBytes(const v1::JobSpec& spec) { return JobMemoryFloor(spec).total_bytes(); }

RankMemoryFloor MemoryFloorFromProto(const v1::MemoryFloor& f) {
  RankMemoryFloor floor;
  floor.parameters = f.parameters();
  floor.rank_parameters = f.rank_parameters();
  floor.param_bytes = f.param_bytes();
  floor.grad_bytes = f.grad_bytes();
  floor.optimizer_bytes = f.optimizer_bytes();
  floor.activation_bytes = f.activation_bytes();
  floor.total_bytes = f.total_bytes();
  return floor;
}

v1::MemoryFloor MemoryFloorToProto(const RankMemoryFloor& floor) {
  v1::MemoryFloor f;
  f.set_parameters(floor.parameters);
  f.set_rank_parameters(floor.rank_parameters);
  f.set_param_bytes(floor.param_bytes);
  f.set_grad_bytes(floor.grad_bytes);
  f.set_optimizer_bytes(floor.optimizer_bytes);
  f.set_activation_bytes(floor.activation_bytes);
  f.set_total_bytes(floor.total_bytes);
  return f;
}

absl::Status CheckMemoryFits(const v1::MemoryFloor& stored, const std::vector<v1::Worker>& workers) {
  const RankMemoryFloor floor = MemoryFloorFromProto(stored);
  if (floor.total_bytes <= 0 || workers.empty()) return absl::OkStatus();
  int64_t largest = 0;
  for (const v1::Worker& w : workers) {
    if (w.info().memory_bytes() == 0) return absl::OkStatus();  // one that does not say: it decides itself
    largest = std::max(largest, w.info().memory_bytes());
  }
  if (floor.total_bytes <= largest) return absl::OkStatus();
  // The spec is valid; the cluster, as registered now, cannot run it.
  return absl::FailedPreconditionError(absl::StrCat(
      "spec.model: this job needs ", DescribeMemoryFloor(floor),
      ", and the largest of the ", workers.size(), " registered workers has ", GiB(largest),
      ": raise tensor_parallel_size or add larger workers"));
}

bool IsRetryableRankError(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAlreadyExists:
      return false;
    default:
      return true;
  }
}

namespace {

absl::Status ValidateRestartPolicy(const v1::JobSpec& spec) {
  const v1::RestartPolicy& r = spec.restart();
  if (r.has_max_restarts() && (r.max_restarts() < 0 || r.max_restarts() > kMaxRestarts)) {
    return Invalid("spec.restart", "max_restarts",
                   absl::StrCat(r.max_restarts(), " is outside [0, ", kMaxRestarts, "]"));
  }
  if (spec.kind() == v1::JOB_KIND_TENSOR && r.max_restarts() > 0) {
    return Invalid("spec.restart", "max_restarts",
                   "TENSOR jobs never restart (their tensors live in the ranks' memory); leave it unset or 0");
  }
  const google::protobuf::Duration& w = r.worker_wait();
  if (w.seconds() < 0 || w.nanos() < 0 || w.nanos() >= 1000000000 || FromProtoDuration(w) > kMaxWorkerWait) {
    return Invalid("spec.restart", "worker_wait", "must be between 0 and 7 days");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDataFormat(const std::string& format) {
  if (format.empty()) return absl::OkStatus();
  for (const char* known : kDataFormats) {
    if (format == known) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", EscapedPrefix(format, 64), "' is not one of ",
                   absl::StrJoin(std::begin(kDataFormats), std::end(kDataFormats), ", ")));
}

absl::Status CheckMaskTokenId(const ModelConfig& config, std::optional<int64_t> id, bool examples) {
  if (config.masked_lm() && !id.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("required for a masked language model (", config.model_type,
                     ": it sees every position, so it trains to predict masked tokens, not the next one): the "
                     "tokenizer's [MASK] id, 103 in bert-base-uncased's vocab.txt"));
  }
  if (!config.masked_lm() && id.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("is for a masked language model (bert); a ", config.model_type,
                                                   examples ? " trains on its labels" : " predicts its next tokens"));
  }
  if (id.has_value() && (*id < 0 || *id >= config.vocab_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(*id, " is not an id of the model's vocabulary [0, ", config.vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckLossScale(double scale) {
  // (Written whole where it is a whole number: 2^25, not 3.35544e+07.)
  const std::string written = std::isfinite(scale) && scale == std::floor(scale) && std::abs(scale) < 1e18
                                  ? absl::StrFormat("%.0f", scale)
                                  : absl::StrFormat("%.17g", scale);
  if (!(scale >= 1 && scale <= kMaxLossScale)) {
    return absl::InvalidArgumentError(absl::StrCat(written, " is outside [1, 16777216] (2^0 to 2^24)"));
  }
  int exponent = 0;
  if (std::frexp(scale, &exponent) != 0.5) {
    return absl::InvalidArgumentError(absl::StrCat(written, " is not a power of two"));
  }
  return absl::OkStatus();
}

absl::Status CheckLossScaleWindow(int64_t window) {
  if (window < 1 || window > kMaxLossScaleWindow) {
    return absl::InvalidArgumentError(absl::StrCat(window, " steps is not in [1, ", kMaxLossScaleWindow, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckModelDType(const std::string& dtype) {
  if (dtype.empty()) return absl::OkStatus();
  for (const char* known : kModelDTypes) {
    if (dtype == known) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", EscapedPrefix(dtype, 64), "' is not one of ",
                   absl::StrJoin(std::begin(kModelDTypes), std::end(kModelDTypes), ", ")));
}

namespace {

// A model whose memory per rank overflows int64 (hidden sizes and layers
// far past any real model's) is refused: a floor that cannot be computed
// would admit it anywhere.
absl::Status CheckMemoryFloorComputes(const ModelConfig& config, const v1::JobSpec& spec) {
  const absl::StatusOr<RankMemoryFloor> floor = MemoryFloorPerRank(config, spec);
  if (floor.ok()) return absl::OkStatus();
  return Invalid("spec.model", "config_json", absl::StrCat("its memory per rank cannot be computed: ", floor.status().message()));
}

}  // namespace

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  RETURN_IF_ERROR(CheckUtf8Strings(spec, "spec"));
  // Names and labels are listed with every job: bounded, so that no job can
  // make ListJobs too large for anyone.
  if (spec.name().size() > kMaxJobNameBytes) {
    return Invalid("spec", "name", absl::StrCat(spec.name().size(), " bytes; at most ", kMaxJobNameBytes));
  }
  // One line of a table or a log: no control characters (a newline or a
  // tab would break `coloctl jobs`' columns, an escape a terminal).
  for (const char c : spec.name()) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7F) {
      return Invalid("spec", "name", absl::StrCat("holds the control character 0x", absl::Hex(u, absl::kZeroPad2),
                                                  "; a name is one line of printable text"));
    }
  }
  if (spec.labels_size() > kMaxLabels) {
    return Invalid("spec", "labels", absl::StrCat(spec.labels_size(), " labels; at most ", kMaxLabels));
  }
  for (const auto& [key, value] : spec.labels()) {
    if (key.empty() || key.size() > kMaxLabelKeyBytes || value.size() > kMaxLabelValueBytes) {
      return Invalid("spec", "labels",
                     absl::StrCat("keys take 1 to ", kMaxLabelKeyBytes, " bytes and values at most ",
                                  kMaxLabelValueBytes, "; '", key.substr(0, 64), "' does not fit"));
    }
  }
  const v1::TrainConfig& t = spec.train();
  const v1::ForwardConfig& f = spec.forward();
  for (const auto& [where, field, value] : std::vector<std::tuple<const char*, const char*, const std::string*>>{
           {"spec.model", "weights_path", &spec.model().weights_path()},
           {"spec.model", "upload_id", &spec.model().upload_id()},
           {"spec.train", "data_path", &t.data_path()},
           {"spec.train", "checkpoint_dir", &t.checkpoint_dir()},
           {"spec.train", "resume_from", &t.resume_from()},
           {"spec.train", "final_dir", &t.final_dir()},
           {"spec.train", "labels_path", &t.labels_path()},
           {"spec.train", "eval_data_path", &t.eval_data_path()},
           {"spec.train", "eval_labels_path", &t.eval_labels_path()},
           {"spec.forward", "input_path", &f.input_path()},
           {"spec.forward", "logits_path", &f.logits_path()},
           {"spec.forward", "labels_path", &f.labels_path()},
           {"spec.forward", "decoder_input_path", &f.decoder_input_path()}}) {
    if (value->size() > kMaxPathBytes) {
      return Invalid(where, field, absl::StrCat(value->size(), " bytes; a path takes at most ", kMaxPathBytes));
    }
  }
  if (spec.model().config_json().size() > kMaxConfigJsonBytes) {
    return Invalid("spec.model", "config_json",
                   absl::StrCat(spec.model().config_json().size(), " bytes; at most ", kMaxConfigJsonBytes));
  }
  RETURN_IF_ERROR(ValidateShardConfig(spec.shard(), "spec.shard"));
  RETURN_IF_ERROR(ValidateRestartPolicy(spec));
  if (spec.shard().pipeline_parallel_size() > 1 && spec.kind() != v1::JOB_KIND_TRAIN) {
    return Invalid("spec.shard", "pipeline_parallel_size", "applies to TRAIN jobs (a forward runs unpipelined)");
  }
  switch (spec.kind()) {
    case v1::JOB_KIND_TRAIN: {
      ASSIGN_OR_RETURN(ModelConfig config, ValidateModel(spec.model(), spec.shard(), "spec.model"));
      RETURN_IF_ERROR(ValidateTrain(spec.train(), spec.shard(), "spec.train"));
      const bool examples = config.takes_images() || config.is_encoder_decoder();  // rows drawn whole
      const int tp = spec.shard().tensor_parallel_size();
      if (!examples && spec.shard().sequence_parallel() && tp > 1 && spec.train().seq_len() % tp != 0) {
        return Invalid("spec.train", "seq_len",
                       absl::StrCat(spec.train().seq_len(), " is not divisible by tensor_parallel_size ", tp,
                                    ": sequence parallelism splits each sequence over tp"));
      }
      if (config.takes_images() && spec.train().labels_path().empty()) {
        return Invalid("spec.train", "labels_path",
                       absl::StrCat("required for an image classifier (", config.model_type,
                                    "): integers [N] as .npy, one per image of data_path"));
      }
      if (config.is_encoder_decoder() && spec.train().labels_path().empty()) {
        return Invalid("spec.train", "labels_path",
                       absl::StrCat("required for an encoder-decoder (", config.model_type,
                                    "): the targets, integers [N, length] as .npy, one row per input of data_path"));
      }
      if (!examples && !spec.train().labels_path().empty()) {
        return Invalid("spec.train", "labels_path",
                       absl::StrCat("is for image classifiers and encoder-decoders; a ", config.model_type,
                                    " predicts its next tokens"));
      }
      if (examples && !spec.train().eval_data_path().empty() && spec.train().eval_labels_path().empty()) {
        return Invalid("spec.train", "eval_labels_path",
                       absl::StrCat("required with eval_data_path for a ", config.model_type,
                                    ": the held-out examples' labels, as labels_path holds the training ones"));
      }
      if (!examples && !spec.train().eval_labels_path().empty()) {
        return Invalid("spec.train", "eval_labels_path",
                       absl::StrCat("is for image classifiers and encoder-decoders; a ", config.model_type,
                                    " predicts its next tokens"));
      }
      if (absl::Status mask = CheckMaskTokenId(
              config,
              spec.train().has_mask_token_id() ? std::optional<int64_t>(spec.train().mask_token_id()) : std::nullopt,
              examples);
          !mask.ok()) {
        return Invalid("spec.train", "mask_token_id", mask.message());
      }
      if (config.is_encoder_decoder() && spec.train().recompute() != v1::RECOMPUTE_UNSPECIFIED &&
          spec.train().recompute() != v1::RECOMPUTE_NONE) {
        return Invalid("spec.train", "recompute",
                       absl::StrCat("is not available for an encoder-decoder (", config.model_type,
                                    "): its stacks' blocks take two inputs"));
      }
      if (!examples && spec.train().seq_len() > config.max_positions) {
        return Invalid("spec.train", "seq_len",
                       absl::StrCat(spec.train().seq_len(), " exceeds the model's ", config.max_positions,
                                    " positions"));
      }
      if (spec.shard().inference_only()) {
        return Invalid("spec", "shard.inference_only", "must be false for TRAIN jobs");
      }
      RETURN_IF_ERROR(CheckMemoryFloorComputes(config, spec));
      break;
    }
    case v1::JOB_KIND_FORWARD: {
      ASSIGN_OR_RETURN(ModelConfig config, ValidateModel(spec.model(), spec.shard(), "spec.model"));
      RETURN_IF_ERROR(CheckMemoryFloorComputes(config, spec));
      if (spec.forward().input_path().empty()) {
        return Invalid("spec.forward", "input_path",
                       "required for FORWARD jobs: token ids [batch, seq] (an image classifier's pixel values "
                       "[batch, channels, height, width]) as .npy");
      }
      if (!spec.forward().labels_path().empty() && !config.takes_images() && !config.masked_lm()) {
        return Invalid("spec.forward", "labels_path",
                       absl::StrCat("is for image classifiers and masked language models (bert); a ", config.model_type,
                                    " predicts its next tokens"));
      }
      break;
    }
    case v1::JOB_KIND_TENSOR:
      break;
    default:
      return Invalid("spec", "kind", "required: TRAIN, FORWARD or TENSOR");
  }
  return absl::OkStatus();
}

void BoundUnreadTensors(v1::ForwardResult& result) {
  auto& names = *result.mutable_unread_tensors();
  const int kept = static_cast<int>(kMaxUnreadTensorsReported);
  if (names.size() > kept) names.DeleteSubrange(kept, names.size() - kept);
  for (std::string& n : names) n = Utf8Prefix(n, kMaxUnreadTensorNameBytes);
}

}  // namespace colod
