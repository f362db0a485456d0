#include "worker/train/job_options.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "spec/job_validation.h"
#include "worker/shardformer/checkpoint.h"

namespace colod::train {

DType DefaultParamDType(bool cuda) { return cuda ? DType::kBF16 : DType::kF32; }

absl::StatusOr<TrainOptions> TrainOptionsFromSpec(const v1::JobSpec& spec, const std::string& model_dir,
                                                  bool cuda) {
  const v1::TrainConfig& t = spec.train();
  TrainOptions o;
  o.model_dir = model_dir;
  o.cuda = cuda;
  o.allow_tf32 = t.allow_tf32();
  o.data_path = t.data_path();
  o.labels_path = t.labels_path();
  ASSIGN_OR_RETURN(o.data_format, ParseDataFormat(t.data_format().empty() ? "auto" : t.data_format()));
  o.steps = t.steps();
  o.batch_size = t.batch_size();
  o.seq_len = t.seq_len();
  o.micro_batches = t.micro_batches() < 1 ? 1 : t.micro_batches();
  o.lr = t.learning_rate();
  o.min_lr = t.min_learning_rate();
  o.warmup_steps = t.warmup_steps();
  switch (t.optimizer()) {
    case v1::OPTIMIZER_UNSPECIFIED:
    case v1::OPTIMIZER_ADAMW:
      o.optimizer.kind = OptimizerOptions::Kind::kAdamW;
      break;
    case v1::OPTIMIZER_SGD:
      o.optimizer.kind = OptimizerOptions::Kind::kSgd;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("spec.train.optimizer: unknown value ", t.optimizer()));
  }
  o.optimizer.weight_decay = t.weight_decay();
  o.optimizer.momentum = t.momentum();
  o.clip_norm = t.grad_clip_norm();
  o.seed = t.seed();
  o.shard.layout = spec.shard();
  switch (t.precision()) {
    case v1::PRECISION_UNSPECIFIED:
      o.shard.param_dtype = DefaultParamDType(cuda);
      o.precision_auto = true;
      break;
    case v1::PRECISION_FP32:
      o.shard.param_dtype = DType::kF32;
      break;
    case v1::PRECISION_BF16_MIXED:
      o.shard.param_dtype = DType::kBF16;
      break;
    case v1::PRECISION_FP16_MIXED:  // its loss scaled (LossScaler)
      o.shard.param_dtype = DType::kF16;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("spec.train.precision: unknown value ", t.precision()));
  }
  if (t.bucket_bytes() > 0) o.bucket_bytes = t.bucket_bytes();
  o.zero_stage = t.zero_stage();
  o.grad_accum = std::max(1, t.grad_accum());
  switch (t.recompute()) {
    case v1::RECOMPUTE_UNSPECIFIED:
    case v1::RECOMPUTE_NONE:
      o.shard.recompute = shardformer::Recompute::kNone;
      break;
    case v1::RECOMPUTE_FULL:
      o.shard.recompute = shardformer::Recompute::kFull;
      break;
    case v1::RECOMPUTE_SELECTIVE:
      o.shard.recompute = shardformer::Recompute::kSelective;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("spec.train.recompute: unknown value ", t.recompute()));
  }
  o.final_dir = t.final_dir();
  auto final_dtype = shardformer::ParseModelDType(t.final_dtype());
  if (!final_dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.train.final_dtype: ", final_dtype.status().message()));
  }
  o.final_dtype = *final_dtype;
  o.save_dir = t.checkpoint_dir();
  o.save_every = t.checkpoint_every();
  o.resume_dir = t.resume_from();
  o.stop_after = t.stop_after();
  o.eval_data_path = t.eval_data_path();
  o.eval_labels_path = t.eval_labels_path();
  o.eval_split = t.eval_split();
  o.eval_every = t.eval_every();
  o.eval_steps = t.eval_steps();
  o.eval_only = t.eval_only();
  o.keep_last = t.keep_last();
  o.keep_best = t.keep_best();
  if (t.has_mask_token_id()) o.mask_token_id = t.mask_token_id();
  if (t.has_loss_scale()) o.loss_scale = t.loss_scale();
  if (t.loss_scale_window() != 0) o.loss_scale_window = t.loss_scale_window();
  return o;
}

v1::Precision PrecisionOf(DType param_dtype) {
  return param_dtype == DType::kBF16  ? v1::PRECISION_BF16_MIXED
         : param_dtype == DType::kF16 ? v1::PRECISION_FP16_MIXED
                                      : v1::PRECISION_FP32;
}

v1::JobSpec SpecFromTrainOptions(const TrainOptions& o) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  *spec.mutable_shard() = o.shard.layout;
  v1::TrainConfig& t = *spec.mutable_train();
  t.set_data_path(o.data_path);
  t.set_labels_path(o.labels_path);
  switch (o.data_format) {
    case DataFormat::kAuto: t.set_data_format("auto"); break;
    case DataFormat::kU16: t.set_data_format("uint16"); break;
    case DataFormat::kU32: t.set_data_format("uint32"); break;
    case DataFormat::kNpy: t.set_data_format("npy"); break;
    case DataFormat::kText: t.set_data_format("text"); break;
    case DataFormat::kJsonl: t.set_data_format("jsonl"); break;
    case DataFormat::kMegatron: t.set_data_format("megatron"); break;
  }
  t.set_steps(o.steps);
  t.set_batch_size(static_cast<int32_t>(o.batch_size));
  t.set_seq_len(static_cast<int32_t>(o.seq_len));
  t.set_micro_batches(static_cast<int32_t>(o.micro_batches));
  t.set_learning_rate(o.lr);
  t.set_min_learning_rate(o.min_lr);
  t.set_warmup_steps(o.warmup_steps);
  t.set_optimizer(o.optimizer.kind == OptimizerOptions::Kind::kSgd ? v1::OPTIMIZER_SGD : v1::OPTIMIZER_ADAMW);
  t.set_weight_decay(o.optimizer.weight_decay);
  t.set_momentum(o.optimizer.momentum);
  t.set_grad_clip_norm(o.clip_norm);
  t.set_seed(o.seed);
  t.set_precision(PrecisionOf(o.shard.param_dtype));
  t.set_bucket_bytes(o.bucket_bytes);
  t.set_zero_stage(o.zero_stage);
  t.set_grad_accum(static_cast<int32_t>(o.grad_accum));
  t.set_recompute(o.shard.recompute == shardformer::Recompute::kFull        ? v1::RECOMPUTE_FULL
                  : o.shard.recompute == shardformer::Recompute::kSelective ? v1::RECOMPUTE_SELECTIVE
                                                                            : v1::RECOMPUTE_NONE);
  t.set_allow_tf32(o.allow_tf32);
  t.set_final_dir(o.final_dir);
  if (o.final_dtype.has_value()) {
    t.set_final_dtype(*o.final_dtype == DType::kBF16 ? "bf16" : *o.final_dtype == DType::kF16 ? "f16" : "f32");
  }
  t.set_checkpoint_dir(o.save_dir);
  t.set_checkpoint_every(o.save_every);
  t.set_resume_from(o.resume_dir);
  t.set_stop_after(o.stop_after);
  t.set_eval_data_path(o.eval_data_path);
  t.set_eval_labels_path(o.eval_labels_path);
  t.set_eval_split(o.eval_split);
  t.set_eval_every(o.eval_every);
  t.set_eval_steps(o.eval_steps);
  t.set_eval_only(o.eval_only);
  t.set_keep_last(static_cast<int32_t>(o.keep_last));
  t.set_keep_best(o.keep_best);
  if (o.mask_token_id.has_value()) t.set_mask_token_id(*o.mask_token_id);
  if (o.shard.param_dtype == DType::kF16) {  // (refused at another precision)
    if (o.loss_scale != LossScaler::kDefaultInitial) t.set_loss_scale(o.loss_scale);
    if (o.loss_scale_window != LossScaler::kDefaultWindow) t.set_loss_scale_window(o.loss_scale_window);
  }
  return spec;
}

v1::EvalResult EvalResultOf(const EvalStats& e, const std::string& checkpoint) {
  v1::EvalResult r;
  r.set_step(e.step);
  r.set_loss(e.loss);
  if (e.perplexity.has_value()) r.set_perplexity(*e.perplexity);
  if (e.accuracy.has_value()) r.set_accuracy(*e.accuracy);
  r.set_tokens(e.tokens);
  *r.mutable_duration() = ToProtoDuration(absl::Seconds(e.seconds));
  r.set_checkpoint(checkpoint);
  return r;
}

v1::StepProgress StepProgressOf(const StepStats& st) {
  v1::StepProgress p;
  p.set_step(st.step);
  if (st.eval.has_value()) *p.mutable_eval() = EvalResultOf(*st.eval, st.checkpoint);
  for (const CheckpointInfo& c : st.checkpoints) {
    v1::CheckpointInfo* out = p.add_checkpoints();
    out->set_path(c.path);
    out->set_step(c.step);
    if (c.eval_loss.has_value()) out->set_eval_loss(*c.eval_loss);
    out->set_bytes(c.bytes);
  }
  if (!st.trained) {  // an eval_only run's report
    p.set_resumed_from(st.resumed_from);
    return p;
  }
  p.set_loss(st.loss);
  p.set_tokens(st.step_tokens);
  p.set_learning_rate(st.lr);
  p.set_grad_norm(st.grad_norm);
  if (st.loss_scale > 0) p.set_loss_scale(st.loss_scale);
  p.set_update_skipped(st.update_skipped);
  p.set_tokens_per_second(st.tokens_per_second);
  *p.mutable_step_duration() = ToProtoDuration(absl::Seconds(st.seconds));
  p.set_param_bytes(st.param_bytes);
  p.set_grad_bytes(st.grad_bytes);
  p.set_optimizer_bytes(st.optimizer_bytes);
  p.set_checkpoint(st.checkpoint);
  p.set_resumed_from(st.resumed_from);
  if (st.pipeline_wait_seconds > 0) *p.mutable_pipeline_wait() = ToProtoDuration(absl::Seconds(st.pipeline_wait_seconds));
  if (st.pipeline_span_seconds > 0) *p.mutable_pipeline_span() = ToProtoDuration(absl::Seconds(st.pipeline_span_seconds));
  return p;
}

}  // namespace colod::train
