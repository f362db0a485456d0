#include "worker/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/grpc_status.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/logging.h"
#include "common/model_layout.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/device.h"
#include "kernels/types.h"
#include "spec/job_validation.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/shardformer.h"
#include "worker/tensor/ops.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data_parallel.h"
#include "worker/train/image_data.h"
#include "worker/train/job_options.h"
#include "worker/train/pipeline.h"
#include "worker/train/seq2seq_data.h"

namespace colod::train {

using shardformer::NamedParam;

namespace {

// Rows of one step on one replica: a pipeline's pass, or one micro-batch.
struct StepBatch {
  Tensor inputs, labels;
  Tensor decoder_inputs;  // an encoder-decoder's (TrainData::pairs())
};

// What a run trains on, as a step reads it: a token corpus (next-token
// prediction), images and labels (a classifier), or (input, target) pairs
// (an encoder-decoder), each with its seeded sampler; or what it evaluates
// on, the same with a sequential sampler. Thread-safe after construction
// (read-only; every rank of a local run shares one).
class TrainData {
 public:
  virtual ~TrainData() = default;
  // Rows [first, first + count) of replica `replica`'s `rows` of step
  // `step`, computed alone (a micro-batch, or a pipeline's pass: a step is
  // loaded a part at a time, its host memory that part's).
  virtual absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t rows, int64_t first,
                                          int64_t count) const = 0;
  // The labelled positions of step `step`'s batch (every replica): each
  // micro-batch's loss is divided by them (TrainStepLabels), so the step's
  // loss is its mean however the labels fall across replicas and
  // micro-batches.
  virtual int64_t Labelled(int64_t step) const = 0;
  // What one row counts for tokens/s: a sequence's tokens, a pair's input
  // and target tokens, an image (1).
  virtual int64_t TokensPerRow() const = 0;
  // The model classifies its rows (ClassificationLoss), rather than
  // predicting tokens.
  virtual bool classifies() const { return false; }
  // The model reads decoder inputs beside its inputs.
  virtual bool pairs() const { return false; }
  // The distinct windows (examples) its sampler draws from.
  virtual int64_t windows() const = 0;
};

// An evaluation that reads its held-out rows once (TrainConfig.eval_steps
// 0) still runs whole batches: the last one's rows past the held-out data
// (the sequential sampler wraps to the first rows) are left out of the loss,
// labels -100. `once`: the rows read once (global row k·B + r of batch k);
// no limit where it is kNoLimit.
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// How many of batch `step`'s `batch` rows lie within `once` rows.
int64_t RowsWithin(int64_t once, int64_t step, int64_t batch) {
  if (once == kNoLimit) return batch;
  const std::optional<int64_t> before = CheckedMul(step, batch);
  if (!before.has_value() || *before >= once) return 0;
  return std::min(batch, once - *before);
}

// `labels`' rows from `from` on (of its first dimension) set to -100.
absl::StatusOr<Tensor> IgnoreRowsFrom(const Tensor& labels, int64_t from) {
  const int64_t rows = labels.shape().empty() ? 0 : labels.shape()[0];
  if (from >= rows) return labels;
  std::vector<int64_t> values = labels.ToInt64s();
  const int64_t per_row = rows > 0 ? static_cast<int64_t>(values.size()) / rows : 0;
  std::fill(values.begin() + std::max<int64_t>(from, 0) * per_row, values.end(), int64_t{-100});
  return Tensor::FromInt64s(labels.shape(), values);
}

// A token corpus's windows: next-token prediction, or with `masked` a
// masked language model's.
class CorpusData final : public TrainData {
 public:
  CorpusData(std::shared_ptr<const TokenCorpus> corpus, BatchSampler sampler, int64_t once,
             std::optional<MaskedLm> masked)
      : corpus_(std::move(corpus)), sampler_(std::move(sampler)), once_(once), masked_(masked) {}
  absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t rows, int64_t first,
                                  int64_t count) const override {
    StepBatch b;
    RETURN_IF_ERROR(sampler_.Batch(*corpus_, step, replica, &b.inputs, &b.labels, first, count,
                                   masked_.has_value() ? &*masked_ : nullptr));
    if (once_ != kNoLimit) {
      const int64_t within = RowsWithin(once_, step, sampler_.global_batch());
      ASSIGN_OR_RETURN(b.labels, IgnoreRowsFrom(b.labels, within - replica * rows - first));
    }
    return b;
  }
  int64_t Labelled(int64_t step) const override {
    const int64_t rows = RowsWithin(once_, step, sampler_.global_batch());
    if (masked_.has_value()) return sampler_.MaskedPositions(step, 0, rows);
    return rows * sampler_.seq_len();  // every token has its next
  }
  int64_t TokensPerRow() const override { return sampler_.seq_len(); }
  int64_t windows() const override { return sampler_.windows(); }

 private:
  std::shared_ptr<const TokenCorpus> corpus_;
  BatchSampler sampler_;
  int64_t once_;
  std::optional<MaskedLm> masked_;
};

// Images with labels, or (input, target) pairs: whole examples, some of
// whose labels may be -100 (ignored).
template <typename Dataset>
class ExampleData final : public TrainData {
 public:
  ExampleData(std::shared_ptr<const Dataset> set, BatchSampler sampler, int64_t once)
      : set_(std::move(set)), sampler_(std::move(sampler)), once_(once) {}
  absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t rows, int64_t first,
                                  int64_t count) const override {
    StepBatch b;
    const int64_t global = sampler_.global_batch();
    if (replica < 0 || first < 0 || count < 0 || first > rows - count || rows > global ||
        replica >= global / std::max<int64_t>(rows, 1)) {
      return absl::InternalError(absl::StrCat("rows [", first, ", ", first + count, ") of replica ", replica,
                                              "'s ", rows, " of a step of ", global));
    }
    const std::vector<int64_t> mine = sampler_.Starts(step, replica * rows + first, count);
    if constexpr (std::is_same_v<Dataset, Seq2SeqDataset>) {
      RETURN_IF_ERROR(set_->Batch(mine, &b.inputs, &b.decoder_inputs, &b.labels));
    } else {
      RETURN_IF_ERROR(set_->Batch(mine, &b.inputs, &b.labels));
    }
    if (once_ != kNoLimit) {
      const int64_t within = RowsWithin(once_, step, global);
      ASSIGN_OR_RETURN(b.labels, IgnoreRowsFrom(b.labels, within - replica * rows - first));
    }
    return b;
  }
  int64_t Labelled(int64_t step) const override {
    const std::vector<int64_t> all = sampler_.Starts(step);
    return LabelledWithin(all, RowsWithin(once_, step, static_cast<int64_t>(all.size())));
  }
  int64_t TokensPerRow() const override {
    if constexpr (std::is_same_v<Dataset, Seq2SeqDataset>) {
      return set_->input_len() + set_->target_len();
    } else {
      return 1;
    }
  }
  bool classifies() const override { return std::is_same_v<Dataset, ImageDataset>; }
  bool pairs() const override { return std::is_same_v<Dataset, Seq2SeqDataset>; }
  int64_t windows() const override { return sampler_.windows(); }

 private:
  // The labelled positions of a step's examples `all`, of which the first
  // `within` count.
  int64_t LabelledWithin(const std::vector<int64_t>& all, int64_t within) const {
    if (within == static_cast<int64_t>(all.size())) return set_->Labelled(all);
    return set_->Labelled(std::vector<int64_t>(all.begin(), all.begin() + within));
  }

  std::shared_ptr<const Dataset> set_;
  BatchSampler sampler_;
  int64_t once_;
};

// A dataset opened, before its samplers: a token corpus, images or pairs.
struct Source {
  std::shared_ptr<const TokenCorpus> corpus;
  std::shared_ptr<const ImageDataset> images;
  std::shared_ptr<const Seq2SeqDataset> pairs;
  int64_t size() const { return corpus ? corpus->size() : images ? images->size() : pairs->size(); }
};

// `data` (and its `labels`) as the model reads it; `tokenizer` (may be
// null) encodes text.
absl::StatusOr<Source> OpenSource(const ModelConfig& config, const std::string& data, const std::string& labels,
                                  DataFormat format, const Tokenizer* tokenizer, const std::function<bool()>& stopped) {
  Source s;
  if (config.takes_images()) {
    ASSIGN_OR_RETURN(s.images, ImageDataset::Open(data, labels, config.num_channels, config.image_size,
                                                  config.vocab_size));
  } else if (config.is_encoder_decoder()) {
    ASSIGN_OR_RETURN(s.pairs, Seq2SeqDataset::Open(data, labels, config.vocab_size, config.decoder_start_token_id,
                                                   config.pad_token_id));
  } else {
    ASSIGN_OR_RETURN(s.corpus, TokenCorpus::Open(data, format, tokenizer, stopped, config.vocab_size));
  }
  return s;
}

// A sampler of `s` over `range` as a TrainData (`once`: an evaluation's
// that reads the held-out rows once, the rows past them in its last batch
// left out).
absl::StatusOr<std::unique_ptr<TrainData>> SampleSource(const Source& s, int64_t seq_len, int64_t batch, int dp,
                                                        uint64_t seed, SampleRange range,
                                                        std::optional<MaskedLm> masked, bool once = false) {
  if (s.corpus) {
    ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::Create(s.corpus->size(), seq_len, batch, dp, seed, range));
    const int64_t limit = once ? sampler.windows() : kNoLimit;
    return std::make_unique<CorpusData>(s.corpus, std::move(sampler), limit, masked);
  }
  ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::ForExamples(s.size(), batch, dp, seed, range));
  const int64_t limit = once ? sampler.windows() : kNoLimit;
  if (s.images) return std::make_unique<ExampleData<ImageDataset>>(s.images, std::move(sampler), limit);
  return std::make_unique<ExampleData<Seq2SeqDataset>>(s.pairs, std::move(sampler), limit);
}

// What a training step's losses are divided by: its labelled positions
// (TrainData::Labelled). A step that drew only examples labelled -100
// (images: a target that is all -100 is refused when the pairs are read)
// counts nothing: its loss, a sum over no labels, is divided by 1, so the
// step reports 0 and its gradients are 0, and the optimizer steps as on any
// other (its moments, the weight decay and the schedule go on), so that a
// resumed run stays the same.
int64_t TrainStepLabels(const TrainData& data, int64_t step) {
  const int64_t labelled = data.Labelled(step);
  if (labelled > 0) return labelled;
  COLOD_LOG(WARNING) << "step " << step + 1 << " has no labelled position (every example it drew is labelled "
                     << "-100, or a masked language model's draw masked none of its positions): its loss and "
                     << "gradients are 0";
  return 1;
}

// What a run evaluates on, and how much.
struct EvalPlan {
  std::unique_ptr<TrainData> data;  // sequential over the held-out rows
  int64_t steps = 0;                // batches of batch_size rows
  int64_t labels = 0;               // labelled positions over all of them
};

// "fp32", "bf16 mixed", "fp16 mixed": the precision a parameter dtype trains at.
std::string PrecisionName(DType param_dtype) {
  switch (param_dtype) {
    case DType::kBF16:
      return "bf16 mixed";
    case DType::kF16:
      return "fp16 mixed";
    case DType::kF32:
      return "fp32";
    default:
      return std::string(DTypeName(param_dtype));
  }
}

// A run outside a coordinator writes as "local-" and 16 random hex digits,
// its own: retention counts a writer's checkpoints as the run's, so runs
// that shared one name (all of them, until 2026-12) pruned each other's
// checkpoints in a directory they shared, the one a run resumed from too.
CheckpointWriter LocalRunWriter() {
  std::random_device random;
  const uint64_t id = (uint64_t{random()} << 32) ^ random() ^ static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  return CheckpointWriter{.job = absl::StrFormat("local-%016x", id), .generation = 0};
}

}  // namespace

struct PreparedTrain {
  TrainOptions options;
  std::string resume;          // the checkpoint to resume from, if any
  int64_t resumed_step = -1;   // its step (-1: none)
  std::vector<std::string> skipped;  // newer checkpoints passed over as damaged, and why
  bool resumed_named = false;  // resume_dir is the checkpoint itself (DIR/step-N), not a directory of them
  // Who writes this run's checkpoints: the job and generation, or, outside a
  // coordinator (no job), an id of this run alone (LocalRunWriter).
  CheckpointWriter writer;
  uint64_t seed = 0;
  std::unique_ptr<TrainData> data;
  std::optional<EvalPlan> eval;
  int64_t micro_rows = 0;
  int64_t step_batch = 0;  // sequences an optimizer step reads: batch_size * grad_accum
  // fp16: the loss scale the first step starts from (the options', or the
  // checkpoint's it resumes); none at another precision.
  std::optional<LossScaler> loss_scale;
};

namespace {

// Whether `a` and `b` name one directory (both made absolute and normal;
// links resolved where they exist).
bool SameDirectory(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code ea, eb;
  const std::filesystem::path x = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ea), ea);
  const std::filesystem::path y = std::filesystem::weakly_canonical(std::filesystem::absolute(b, eb), eb);
  if (ea || eb) return std::filesystem::path(a).lexically_normal() == std::filesystem::path(b).lexically_normal();
  return x == y;
}

// A run's final_dir holds no model, or the one this job wrote (a restart
// after the write: kFinalWriterFile names the job), and can be written:
// FAILED_PRECONDITION otherwise, before the first step rather than after
// the last.
absl::Status CheckFinalDir(const TrainOptions& o) {
  if (o.final_dir.empty()) return absl::OkStatus();
  if (const std::optional<std::string> found = ModelFileIn(o.final_dir)) {
    const absl::StatusOr<std::string> writer = ReadFileToString(absl::StrCat(o.final_dir, "/", kFinalWriterFile));
    if (o.job.empty() || !writer.ok() || *writer != o.job) {
      return absl::FailedPreconditionError(absl::StrCat(
          "final_dir ", o.final_dir, " already holds a model (", *found, "): give a new or empty directory (new ",
          "weights beside another model's files would load as neither)"));
    }
  }
  // The directory, or the nearest one above it that exists (it is made at
  // the end); a relative one from the working directory.
  std::error_code ec;
  std::filesystem::path dir = std::filesystem::absolute(o.final_dir, ec).lexically_normal();
  if (ec) return absl::FailedPreconditionError(absl::StrCat("final_dir ", o.final_dir, ": ", ec.message()));
  while (!std::filesystem::exists(dir, ec) && dir.has_relative_path() && !ec) dir = dir.parent_path();
  if (!ec && std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("final_dir ", o.final_dir, ": ", dir.string(), " is not a directory"));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("final_dir ", o.final_dir, ": ", dir.string(), " cannot be written: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const PreparedTrain>> PrepareTrain(const TrainOptions& o) {
  if (o.steps < 1 || o.micro_batches < 1) return absl::InvalidArgumentError("steps and micro_batches must be >= 1");
  // (fp16 scales its loss: checked at any precision, as a resume may take fp16.)
  ASSIGN_OR_RETURN(const LossScaler options_scale, LossScaler::Create(o.loss_scale, o.loss_scale_window));
  if (o.grad_accum < 1 || o.grad_accum > kMaxGradAccum) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_accum ", o.grad_accum, " is not in [1, ", kMaxGradAccum, "]"));
  }
  const std::optional<int64_t> step_batch = CheckedMul(o.batch_size, o.grad_accum);
  if (!step_batch.has_value() || *step_batch > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("a step of ", o.grad_accum, " passes of ", o.batch_size,
                                                   " sequences is too large"));
  }
  if (o.zero_stage < 0 || o.zero_stage > 2) {
    return absl::InvalidArgumentError(absl::StrCat("zero_stage ", o.zero_stage, " is not one of 0, 1, 2"));
  }
  const bool evaluates = !o.eval_data_path.empty() || o.eval_split != 0;
  if (!o.eval_data_path.empty() && o.eval_split != 0) {
    return absl::InvalidArgumentError("eval_data_path and eval_split: give one, not both");
  }
  if (o.eval_split != 0 && !(o.eval_split > 0 && o.eval_split < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("eval_split ", o.eval_split, " is not in (0, 1)"));
  }
  if (!evaluates && (o.eval_only || o.eval_every != 0 || o.eval_steps != 0 || !o.eval_labels_path.empty())) {
    return absl::InvalidArgumentError("eval_only, eval_every, eval_steps and eval_labels_path need eval_data_path "
                                      "or eval_split");
  }
  if (o.keep_last < 0) return absl::InvalidArgumentError(absl::StrCat("keep_last ", o.keep_last, " must be >= 0"));
  RETURN_IF_ERROR((CheckpointWriter{.job = o.job, .generation = o.generation}.Check()));
  if (o.stop_after < 0) return absl::InvalidArgumentError(absl::StrCat("stop_after ", o.stop_after, " must be >= 0"));
  // (A job spec refuses it without checkpoint_dir; one recorded before that
  // rule, placed again after an upgrade, stops as it did: nothing saved.)
  if (o.stop_after > 0 && o.stop_after < o.steps && !o.eval_only && o.save_dir.empty()) {
    COLOD_LOG(WARNING) << "stop_after " << o.stop_after << " ends the run before its last step (" << o.steps
                       << ") without checkpoint_dir: the steps it trains are kept nowhere";
  }
  if ((o.keep_last > 0 || o.keep_best) && (o.save_dir.empty() || o.save_every < 1)) {
    return absl::InvalidArgumentError("keep_last and keep_best prune checkpoints: they need checkpoint_dir and "
                                      "checkpoint_every");
  }
  if (o.keep_best && (!evaluates || o.eval_every < 1 || o.save_every % o.eval_every != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keep_best keeps the checkpoint of the lowest eval loss: it needs held-out data and an eval_every that "
        "divides checkpoint_every (", o.save_every, "), so that every checkpoint is evaluated; eval_every is ",
        o.eval_every));
  }
  if (o.eval_only && !o.final_dir.empty()) {
    return absl::InvalidArgumentError("final_dir: an eval_only run trains nothing and writes no model");
  }
  RETURN_IF_ERROR(CheckFinalDir(o));
  if (o.final_dtype.has_value() && !shardformer::IsModelDType(*o.final_dtype)) {
    return absl::InvalidArgumentError("final_dtype: a model is written in f32, bf16 or f16");
  }
  if (o.eval_every < 0 || o.eval_steps < 0 || o.eval_steps > kMaxEvalSteps) {
    return absl::InvalidArgumentError(absl::StrCat("eval_every ", o.eval_every, " must be >= 0 and eval_steps ",
                                                   o.eval_steps, " in [0, ", kMaxEvalSteps, "]"));
  }
  // The range of virtual_stages, pp >= 2 and pp * V <= layers: spec's
  // PipelineStageLayers (CheckShardable, below); the interleaved schedule's
  // grouping of the micro-batches: spec's check, as the coordinator's.
  RETURN_IF_ERROR(CheckInterleavedMicroBatches(o.shard.layout, o.micro_batches));
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(o.shard.layout));
  ASSIGN_OR_RETURN(int dp, mesh.AxisSize("dp"));
  ASSIGN_OR_RETURN(ModelConfig config, shardformer::LoadConfig(o.model_dir));
  RETURN_IF_ERROR(CheckShardable(config, o.shard.layout));
  const bool examples = config.takes_images() || config.is_encoder_decoder();  // rows drawn whole
  if (!examples && (!o.labels_path.empty() || !o.eval_labels_path.empty())) {
    return absl::InvalidArgumentError(absl::StrCat("labels are for image classifiers and encoder-decoders: ",
                                                   o.model_dir, " (", config.model_type,
                                                   ") predicts its next tokens"));
  }
  if (config.takes_images() && o.labels_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(o.model_dir, " is an image classifier (", config.model_type,
                                                   "): it trains on images (the data) and their labels (a labels "
                                                   ".npy, integers [N])"));
  }
  if (config.is_encoder_decoder() && o.labels_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(o.model_dir, " is an encoder-decoder (", config.model_type,
                                                   "): it trains on (input, target) pairs, the inputs as the data "
                                                   "and the targets as the labels (.npy, integers [N, length])"));
  }
  if (examples && !o.eval_data_path.empty() && o.eval_labels_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(o.model_dir, " (", config.model_type, ") evaluates on examples ",
                                                   "with labels: eval_data_path needs eval_labels_path"));
  }
  if (!examples && o.seq_len > config.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len ", o.seq_len, " exceeds the model's ",
                                                   config.max_positions, " positions"));
  }
  if (absl::Status mask = CheckMaskTokenId(config, o.mask_token_id, examples); !mask.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("mask_token_id: ", mask.message(), " (", o.model_dir, ")"));
  }
  auto run = std::make_shared<PreparedTrain>();
  run->options = o;
  run->seed = o.seed;
  run->writer = o.job.empty() ? LocalRunWriter() : CheckpointWriter{.job = o.job, .generation = o.generation};
  if (!o.resume_dir.empty()) {
    // A save that died mid-replace may have left its step's only copy aside.
    RestoreMovedAsideCheckpoints(o.resume_dir, run->writer, o.check_path);
    ASSIGN_OR_RETURN(run->resume, LatestCheckpoint(o.resume_dir, &run->skipped, o.resume_writers, o.check_path));
    run->resumed_named = run->resume == o.resume_dir;
    for (const std::string& s : run->skipped) COLOD_LOG(WARNING) << "skipping damaged checkpoint " << s;
    ASSIGN_OR_RETURN(Resumed state, ReadTrainState(run->resume));
    // The checkpoint's model must be this one: loading another's would
    // take what fits and drop the rest (a layer fewer), or fail on a shape.
    // (A checkpoint without its config, of an older colod, is not checked.)
    if (absl::StatusOr<ModelConfig> saved = shardformer::LoadConfig(run->resume); saved.ok()) {
      const std::vector<std::string> differ = ArchitectureDifferences(*saved, config);
      if (!differ.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the checkpoint to resume from, ", run->resume, ", is of another model than ", o.model_dir, ": ",
            absl::StrJoin(differ, "; "), " (the checkpoint's, then the model's). Resume with the model it was "
            "trained from, or start from it with `coloctl consolidate --checkpoint ", run->resume, " --out DIR`"));
      }
    } else if (!absl::IsNotFound(saved.status())) {
      return saved.status();
    }
    if (!o.eval_only && state.step > o.steps) {  // an evaluation trains no step: steps does not matter
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint to resume from, ", run->resume, ", is after step ", state.step,
          ", past the run's last step ", o.steps, ": raise steps, or resume from an earlier checkpoint"));
    }
    // The precision it was trained at: a run that left it to the device
    // (auto) takes the checkpoint's, so that a job restarted on workers of
    // the other kind (bf16 on a GPU, fp32 on a CPU) resumes; one that named
    // another is refused here, not by the first parameter's copy.
    if (state.param_dtype.has_value() && *state.param_dtype != o.shard.param_dtype) {
      if (!o.precision_auto) {
        return absl::FailedPreconditionError(
            absl::StrCat("the checkpoint to resume from, ", run->resume, ", was trained at precision ",
                         PrecisionName(*state.param_dtype), ", this run asks for ", PrecisionName(o.shard.param_dtype),
                         ": resume at ", PrecisionName(*state.param_dtype),
                         " (or auto, which takes the checkpoint's), or start "
                         "a run from its model (`coloctl consolidate --checkpoint ",
                         run->resume, " --out DIR`)"));
      }
      COLOD_LOG(INFO) << "resuming " << run->resume << " at its precision, " << PrecisionName(*state.param_dtype)
                      << " (auto; this device's default is " << PrecisionName(o.shard.param_dtype) << ")";
      run->options.shard.param_dtype = *state.param_dtype;
    }
    // The masking goes on as it was: another [MASK] id would predict
    // another token at the positions the run learned on.
    if (state.mask_token_id.has_value() && state.mask_token_id != o.mask_token_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint to resume from, ", run->resume, ", trained with mask_token_id ", *state.mask_token_id,
          ", this run asks for ", o.mask_token_id.has_value() ? absl::StrCat(*o.mask_token_id) : std::string("none"),
          ": resume with ", *state.mask_token_id, ", or start a run from its model (`coloctl consolidate --checkpoint ",
          run->resume, " --out DIR`)"));
    }
    if (o.mask_token_id.has_value() && !state.mask_token_id.has_value()) {
      COLOD_LOG(WARNING) << "resuming " << run->resume << ", which records no mask_token_id: written by a colod that "
                         << "trained " << config.model_type << " on next tokens, it now trains as a masked language "
                         << "model";
    }
    // fp16's loss scale goes on from the checkpoint's (a checkpoint of an
    // fp16 run of an older colod, which scaled nothing, records none: the
    // run starts at the options' scale).
    if (state.loss_scale.has_value() && run->options.shard.param_dtype == DType::kF16) {
      ASSIGN_OR_RETURN(run->loss_scale,
                       LossScaler::Create(*state.loss_scale, o.loss_scale_window,
                                          std::min(state.loss_scale_good_steps, o.loss_scale_window - 1)));
      if (o.loss_scale != LossScaler::kDefaultInitial && o.loss_scale != *state.loss_scale) {
        COLOD_LOG(WARNING) << "resuming " << run->resume << " at its loss scale, "
                           << absl::StrFormat("%.0f", *state.loss_scale) << ", not the run's loss_scale "
                           << absl::StrFormat("%.0f", o.loss_scale) << " (the scale a run starts at)";
      }
    }
    run->seed = state.seed;  // the sampler continues the stream it was on
    // A run continued in a directory of checkpoints counts the runs it
    // continues as its own (retention). (Not where the user named one
    // checkpoint: the run it came from may have newer ones there, which are
    // not this run's to prune.)
    // The chain it continues only where it saves into the directory it
    // resumed from; elsewhere the run it resumed from alone (as before
    // lineages: that run's checkpoints in another directory are its
    // history's, not this link's to prune). Of the chain, the links whose
    // checkpoints are still there: it stays short however long it grows.
    if (!run->resumed_named) {
      run->writer.lineage =
          ContinuedLineage(SameDirectory(o.resume_dir, o.save_dir) ? LineageWithCheckpointsIn(state.lineage, o.save_dir)
                                                                   : std::vector<std::string>{},
                           state.job, run->writer.job);
    }
    run->resumed_step = state.step;
  }
  const int64_t rows = o.batch_size / dp;
  if (rows * dp != o.batch_size || rows % o.micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the batch of ", o.batch_size,
                                                   " does not split over data_parallel_size ", dp, " and ",
                                                   o.micro_batches, " micro-batches a replica"));
  }
  run->micro_rows = rows / o.micro_batches;
  run->step_batch = *step_batch;
  if (run->options.shard.param_dtype == DType::kF16 && !o.eval_only && !run->loss_scale.has_value()) {
    run->loss_scale = options_scale;
  }
  if (run->options.shard.param_dtype != DType::kF16 && !o.eval_only &&
      (o.loss_scale != LossScaler::kDefaultInitial || o.loss_scale_window != LossScaler::kDefaultWindow)) {
    // (Taken at auto precision, which may resume an fp16 checkpoint.)
    COLOD_LOG(WARNING) << "loss_scale and loss_scale_window are for fp16 training; this run trains at "
                       << PrecisionName(run->options.shard.param_dtype) << " and scales nothing";
  }
  const DataFormat format = ResolveDataFormat(o.data_path, o.data_format);
  const bool text = IsTextFormat(format) ||
                    (!o.eval_data_path.empty() && IsTextFormat(ResolveDataFormat(o.eval_data_path, o.data_format)));
  std::unique_ptr<Tokenizer> tokenizer;
  if (!examples && text) {
    // Text trains with the ids the model knows: its directory's tokenizer,
    // else bytes.
    if (HasTokenizer(o.model_dir)) {
      ASSIGN_OR_RETURN(tokenizer, LoadTokenizer(o.model_dir));
      if (tokenizer->vocab_size() > config.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("the model directory's ", tokenizer->kind(), " tokenizer has ",
                                                       tokenizer->vocab_size(), " ids, over the model's vocab_size ",
                                                       config.vocab_size));
      }
    } else if (config.vocab_size < kByteVocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          o.data_path, " is text and ", o.model_dir, " has no tokenizer, so it trains byte-level, which needs a ",
          "vocab_size of at least ", kByteVocab, ", not ", config.vocab_size));
    }
  }
  ASSIGN_OR_RETURN(const Source train, OpenSource(config, o.data_path, o.labels_path, format, tokenizer.get(), o.stopped));
  // An encoder-decoder's pairs bring their own lengths; seq_len bounds them,
  // since the memory admission and the planner count both at seq_len.
  // Sequence parallelism splits both sequences over tp (the coordinator
  // cannot check that at submit: the lengths are the data's).
  const int tp = o.shard.layout.tensor_parallel_size();
  auto within_seq_len = [&](const Source& s, const std::string& what) -> absl::Status {
    if (!s.pairs) return absl::OkStatus();
    if (o.shard.layout.sequence_parallel() && tp > 1 &&
        (s.pairs->input_len() % tp != 0 || s.pairs->target_len() % tp != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the inputs are ", s.pairs->input_len(), " tokens and the targets ", s.pairs->target_len(),
          "; sequence parallelism splits each over tensor_parallel_size ", tp,
          ", which must divide both: pad them (targets with -100) or turn sequence_parallel off"));
    }
    if (s.pairs->input_len() <= o.seq_len && s.pairs->target_len() <= o.seq_len) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the inputs are ", s.pairs->input_len(), " tokens and the targets ", s.pairs->target_len(),
        ", over seq_len ", o.seq_len, ", which the memory admission and the plan count them at: set seq_len to ",
        std::max(s.pairs->input_len(), s.pairs->target_len()), " or more"));
  };
  RETURN_IF_ERROR(within_seq_len(train, "data_path"));
  SampleRange train_range;
  Source held = train;  // what the evaluation reads
  SampleRange eval_range{.sequential = true};
  if (o.eval_split != 0) {
    int64_t at = 0;
    if (train.corpus) {
      ASSIGN_OR_RETURN(at, HeldOutStart(*train.corpus, o.eval_split, o.seq_len + 1));
    } else {
      ASSIGN_OR_RETURN(at, HeldOutStart(train.size(), o.eval_split));
    }
    train_range.end = at;
    eval_range.begin = at;
  } else if (!o.eval_data_path.empty()) {
    absl::StatusOr<Source> opened =
        OpenSource(config, o.eval_data_path, o.eval_labels_path, ResolveDataFormat(o.eval_data_path, o.data_format),
                   tokenizer.get(), o.stopped);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat("eval_data_path: ", opened.status().message()));
    }
    held = *std::move(opened);
    RETURN_IF_ERROR(within_seq_len(held, "eval_data_path"));
  }
  std::optional<MaskedLm> masked;
  if (o.mask_token_id.has_value()) {
    masked = MaskedLm{.mask_token_id = *o.mask_token_id, .vocab_size = config.vocab_size};
  }
  ASSIGN_OR_RETURN(run->data, SampleSource(train, o.seq_len, run->step_batch, dp, run->seed, train_range, masked));
  if (!evaluates) return std::shared_ptr<const PreparedTrain>(std::move(run));
  EvalPlan eval;
  // Seed 0: every evaluation (of any run) reads, and masks, the same.
  absl::StatusOr<std::unique_ptr<TrainData>> sampled =
      SampleSource(held, o.seq_len, o.batch_size, dp, /*seed=*/0, eval_range, masked, /*once=*/o.eval_steps == 0);
  if (!sampled.ok()) {
    return absl::Status(sampled.status().code(), absl::StrCat("the held-out data: ", sampled.status().message()));
  }
  eval.data = *std::move(sampled);
  eval.steps = o.eval_steps > 0 ? o.eval_steps
                                : std::min(kDefaultEvalStepsMax, (eval.data->windows() + o.batch_size - 1) / o.batch_size);
  for (int64_t k = 0; k < eval.steps; ++k) {
    const std::optional<int64_t> sum = CheckedAdd(eval.labels, eval.data->Labelled(k));
    if (!sum.has_value()) return absl::InvalidArgumentError("the evaluation's labelled positions overflow");
    eval.labels = *sum;
  }
  if (eval.labels == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the evaluation's ", eval.steps, " batches hold no labelled position ",
        masked.has_value() ? "(a masked language model's draw masked none of their positions, 15 % of each: give "
                             "the evaluation more with seq_len, batch_size or eval_steps)"
                           : "(every label is -100)"));
  }
  run->eval = std::move(eval);
  return std::shared_ptr<const PreparedTrain>(std::move(run));
}

namespace {

// Rows [first, first + rows) of `batch` through the model: their loss
// divided by `denominator` (the LM head fused with it where the model
// allows). With `correct`, a classifier's logits are gathered and the rows
// whose largest logit is their label's added to it. `defer_read`: the value
// is left on the device (LmLoss::sum_on_device).
absl::StatusOr<shardformer::LmLoss> MicroBatchLoss(shardformer::ShardedModel& model, const TrainData& data,
                                                   const StepBatch& batch, int64_t first, int64_t rows,
                                                   int64_t denominator, int64_t* correct = nullptr,
                                                   bool defer_read = false) {
  ASSIGN_OR_RETURN(Tensor in, batch.inputs.Narrow(0, first, rows));
  ASSIGN_OR_RETURN(Tensor want, batch.labels.Narrow(0, first, rows));
  Tensor dec;  // an encoder-decoder's decoder input
  if (data.pairs()) {
    ASSIGN_OR_RETURN(dec, batch.decoder_inputs.Narrow(0, first, rows));
  }
  auto forward = [&]() -> absl::StatusOr<ColoTensor> {
    ASSIGN_OR_RETURN(const Tensor ids, in.TryContiguous());
    if (!data.pairs()) return model.Forward(ids);
    ASSIGN_OR_RETURN(const Tensor decoder_ids, dec.TryContiguous());
    return model.Forward(ids, decoder_ids);
  };
  // The model's own setting again afterwards, whatever the forward returns.
  const bool was_deferred = model.loss_read_deferred();
  model.set_loss_read_deferred(defer_read);
  ASSIGN_OR_RETURN(const Tensor want_dense, want.TryContiguous());
  absl::StatusOr<shardformer::LmLoss> loss = ForwardLoss(model, forward, want_dense, denominator, correct);
  model.set_loss_read_deferred(was_deferred);
  return loss;
}

// The held-out evaluation of `model` (after `step` optimizer steps): every
// batch of run.eval through the model with no tape, in the run's layout
// (a pipeline's stages forward only), the loss divided by the evaluation's
// labelled positions. Collective over the mesh.
absl::StatusOr<EvalStats> Evaluate(const PreparedTrain& run, const std::vector<shardformer::ShardedModel*>& chunks,
                                   ProcessGroup& pg, GradSync& sync, int replica, int64_t step,
                                   const RankHooks& hooks) {
  shardformer::ShardedModel& model = *chunks.front();
  NoGradScope no_grad;
  const absl::Time start = absl::Now();
  const TrainOptions& o = run.options;
  const EvalPlan& eval = *run.eval;
  const TrainData& data = *eval.data;
  const int64_t micro_rows = run.micro_rows, rows = micro_rows * o.micro_batches;
  double loss = 0;
  int64_t correct = 0;
  double correct_all = 0;  // summed over dp a batch at a time (each count exact in f32)
  for (int64_t k = 0; k < eval.steps; ++k) {
    if (hooks.stop && hooks.stop()) {
      return absl::CancelledError(absl::StrCat("stopped during the evaluation after step ", step));
    }
    if (model.shard_config().pp() > 1) {
      ASSIGN_OR_RETURN(const StepBatch batch, data.Batch(k, replica, rows, 0, rows));
      ASSIGN_OR_RETURN(PipelineStepResult r, RunPipelineStep(chunks, pg, sync, batch.inputs, batch.labels,
                                                             o.micro_batches, eval.labels, /*reduce=*/false,
                                                             /*train=*/false,
                                                             data.pairs() ? &batch.decoder_inputs : nullptr));
      loss += r.loss;
      correct += r.correct;  // the last stage's count, on every stage
    } else {
      for (int64_t mb = 0; mb < o.micro_batches; ++mb) {
        ASSIGN_OR_RETURN(const StepBatch batch, data.Batch(k, replica, rows, mb * micro_rows, micro_rows));
        ASSIGN_OR_RETURN(const shardformer::LmLoss l,
                         MicroBatchLoss(model, data, batch, 0, micro_rows, eval.labels, &correct));
        loss += l.value;
      }
    }
    if (data.classifies()) {
      // Every rank of a replica counted its rows; the replicas' counts add up.
      ASSIGN_OR_RETURN(const double all, SumOver(pg, "dp", static_cast<double>(correct), model.shard_config().device));
      correct_all += all;
      correct = 0;
    }
  }
  EvalStats e;
  e.step = step;
  e.loss = loss;
  e.tokens = eval.labels;
  if (data.classifies()) {
    e.accuracy = correct_all / static_cast<double>(eval.labels);
  } else {
    e.perplexity = std::exp(loss);
  }
  RETURN_IF_ERROR(pg.AsyncError());
  e.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return e;
}

// Whether the run evaluates after `step` (1-based) of its `steps`.
bool EvaluatesAfter(const PreparedTrain& run, int64_t step) {
  if (!run.eval.has_value()) return false;
  const int64_t every = run.options.eval_every;
  return step == run.options.steps || (every > 0 && step % every == 0);
}

// Evaluate, its input errors naming the held-out data (a token id outside
// the vocabulary said only its position).
absl::StatusOr<EvalStats> EvaluateNamed(const PreparedTrain& run,
                                        const std::vector<shardformer::ShardedModel*>& chunks, ProcessGroup& pg,
                                        GradSync& sync, int replica, int64_t step, const RankHooks& hooks) {
  absl::StatusOr<EvalStats> e = Evaluate(run, chunks, pg, sync, replica, step, hooks);
  if (e.ok() || !absl::IsInvalidArgument(e.status())) return e;
  const TrainOptions& o = run.options;
  const std::string source = !o.eval_data_path.empty()
                                 ? absl::StrCat("eval_data_path ", o.eval_data_path)
                                 : absl::StrCat("the held-out ", o.eval_split, " of data_path ", o.data_path);
  return absl::InvalidArgumentError(absl::StrCat("evaluating on ", source, ": ", e.status().message()));
}

// What rank 0 reported of a step (StepProgressOf), kept in its checkpoint
// as protobuf JSON (StepFromReport reads it back): the checkpoint's path
// and the list of those kept are the resuming run's to say.
std::string StepReportJson(const StepStats& s) {
  v1::StepProgress p = StepProgressOf(s);
  p.clear_checkpoints();
  p.clear_checkpoint();
  p.clear_resumed_from();
  if (p.has_eval()) p.mutable_eval()->clear_checkpoint();
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(p, &text).ok()) return "";
  return text;
}

// The report of step `step` as StepReportJson kept it, written to
// `checkpoint`; nullopt where it does not read as that step's (a report of
// another step or none, a loss that is not finite: nothing is reported
// rather than a wrong figure).
std::optional<v1::StepProgress> StepFromReport(const std::string& text, int64_t step,
                                               const std::string& checkpoint) {
  v1::StepProgress p;
  if (!google::protobuf::util::JsonStringToMessage(text, &p).ok()) return std::nullopt;
  if (p.step() != step || !std::isfinite(p.loss())) return std::nullopt;
  p.set_checkpoint(checkpoint);
  if (p.has_eval()) p.mutable_eval()->set_checkpoint(checkpoint);
  return p;
}

// What a run ends with where training diverged: FAILED_PRECONDITION (a
// restart from the same checkpoint with the same settings would diverge
// again, so the coordinator does not retry it), naming the step and what to
// change.
std::string DivergedAdvice(int64_t step) {
  return absl::StrCat("; nothing of step ", step, " or later was saved. Resume from an earlier checkpoint with a lower ",
                      "learning rate (lr), a longer warm-up (warmup_steps) or gradient clipping (clip_norm)");
}

// (fp16: a step whose gradients overflowed updated nothing and goes on at
// half the scale; its loss is still the run's.)
absl::Status FiniteStep(const StepStats& s) {
  if (std::isfinite(s.loss) && (std::isfinite(s.grad_norm) || s.update_skipped)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("training diverged at step ", s.step, ": its loss is ", s.loss,
                                                    " and its gradient norm ", s.grad_norm, DivergedAdvice(s.step)));
}

// `training`: the evaluation of a step this run trained (else an eval_only
// run's, of the model or checkpoint it loaded).
absl::Status FiniteEval(const EvalStats& e, bool training) {
  if (std::isfinite(e.loss)) return absl::OkStatus();
  if (!training) {
    return absl::FailedPreconditionError(absl::StrCat("the evaluation gave a loss of ", e.loss,
                                                      ": the weights evaluated (after step ", e.step,
                                                      ") are not finite, or make the logits overflow"));
  }
  return absl::FailedPreconditionError(absl::StrCat("training diverged: the evaluation after step ", e.step,
                                                    " gave a loss of ", e.loss, DivergedAdvice(e.step)));
}

// A training step enqueued on the device, its one read still to come
// (RunTrainSteps' finish).
struct EnqueuedStep {
  int64_t step = 0;  // 0-based
  absl::Time start;  // when the host began enqueueing it
  double enqueue_seconds = 0;  // how long that took
  double lr = 0;
  double loss = 0;  // the part the host read already (pipeline stages)
  double pipeline_wait = 0, pipeline_span = 0;
  double loss_scale = 0;        // fp16: the scale its backward started from
  bool update_skipped = false;  // fp16: its gradients overflowed, so it updated nothing
  // The norm and the clipping factor, then the micro-batches' loss sums:
  // their copy to the host, enqueued right after the step's work.
  std::optional<PendingRead> read;
  std::vector<int64_t> loss_denominators;  // one a loss sum
  // The mesh's drain flag's place in the read (after the loss sums); -1
  // where the run does not drain (RankHooks::drain).
  int drain_index = -1;
  // Taken once the step is enqueued (the next step's changes them).
  int64_t dp_bucket_bytes = 0, dp_overlapped_bytes = 0;
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  std::optional<kernels::CudaPoolBytes> pool;
};

absl::Status RunTrainSteps(const PreparedTrain& run, int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                           const RankHooks& hooks) {
  const TrainOptions& o = run.options;
  const int64_t micro_rows = run.micro_rows;
  // Every run sets it: a worker daemon's device outlives its jobs.
  RETURN_IF_ERROR(ops::SetAllowTf32(shard.device, o.allow_tf32));
  // The rank's model: one, or (an interleaved pipeline) its virtual
  // stages' chunks, whose parameters the optimizer and the dp sync take as one.
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<shardformer::ShardedModel>> owned,
                   shardformer::ShardFormer(shard, &pg).LoadChunks(o.model_dir));
  const int v = static_cast<int>(owned.size());
  std::vector<shardformer::ShardedModel*> chunks;
  std::vector<std::vector<NamedParam>> chunk_params;
  std::vector<NamedParam> params;
  std::vector<int> chunk_starts;  // where each chunk's parameters begin in `params`
  for (const std::unique_ptr<shardformer::ShardedModel>& loaded : owned) {
    chunk_starts.push_back(static_cast<int>(params.size()));
    chunk_params.push_back(loaded->Parameters());
    params.insert(params.end(), chunk_params.back().begin(), chunk_params.back().end());
    chunks.push_back(loaded.get());
  }
  std::unique_ptr<shardformer::ShardedModel>& model = owned.front();  // the one model but for interleaving
  if (shard.pp() > 1) RETURN_IF_ERROR(MakePipelineChannels(pg, shard.pp(), v));
  // No bucket spans two chunks, whose backwards come at different times.
  ASSIGN_OR_RETURN(std::unique_ptr<GradSync> sync,
                   GradSync::Create(params, &pg, o.bucket_bytes, o.zero_stage, chunk_starts));
  // Under ZeRO each dp rank updates (and keeps the state of) its partition.
  ASSIGN_OR_RETURN(Optimizer optimizer, Optimizer::Create(params, o.optimizer, sync->partition()));
  // Pipelines: the norm adds the parameters' squares in one order whichever
  // stages hold them.
  ASSIGN_OR_RETURN(const NormOrder norm_order, NormOrder::Create(params, &pg, shard.device));
  ASSIGN_OR_RETURN(int replica, pg.dp_local_rank());
  int64_t first = 0;
  RankStart start;
  // Each rank chose the newest checkpoint on its own (PrepareTrain): a save
  // of another job into the directory, or a file system's listing that
  // lagged on one host, between two ranks' choices would have them train
  // from different steps, with different weights, without a word.
  if (!o.resume_dir.empty() && o.agree_on_resume) {
    if (const absl::Status same =
            SameOverMesh(pg, run.resumed_step, shard.device,
                         absl::StrCat("the ranks chose different checkpoints in ", o.resume_dir,
                                      " to resume from (its step; -1: none): one may have been written or removed "
                                      "meanwhile, or a worker's view of the directory lags; resume again, or name "
                                      "one, DIR/step-N"));
        !same.ok()) {
      // ABORTED, which a restart retries (the ranks choose again, and a
      // listing that lagged has caught up), not the job's own error.
      return absl::IsFailedPrecondition(same) ? absl::AbortedError(same.message()) : same;
    }
  }
  if (!run.resume.empty()) {
    ASSIGN_OR_RETURN(Resumed r, RestoreTrainingCheckpoint(run.resume, chunks, optimizer,
                                                          /*parameters_only=*/o.eval_only));
    first = r.step;
    if (rank == 0 && !o.job.empty() && r.job == o.job && !o.eval_only && !r.report.empty()) {
      start.checkpoint_step = StepFromReport(r.report, r.step, run.resume);
    }
  }
  start.step = first;
  start.checkpoint = run.resume;
  start.param_dtype = shard.param_dtype;
  if (rank == 0) {
    start.skipped = run.skipped;
    start.unread_tensors = chunks.front()->unread_tensors();
  }
  if (hooks.on_start) hooks.on_start(start);
  // A time-boxed run (one that stops before its last step, writing no
  // final model) resumed at or past its stop (a restart after the stop's
  // checkpoint) has nothing left to do.
  const bool time_boxed = o.stop_after > 0 && o.stop_after < o.steps;
  if (time_boxed && first >= o.stop_after && !o.eval_only) return absl::OkStatus();
  if (o.eval_only) {
    StepStats s;
    s.rank = rank;
    s.step = first;
    s.trained = false;
    ASSIGN_OR_RETURN(s.eval, EvaluateNamed(run, chunks, pg, *sync, replica, first, hooks));
    s.resumed_from = run.resume;
    RETURN_IF_ERROR(FiniteEval(*s.eval, /*training=*/false));
    if (hooks.on_step) hooks.on_step(s);
    return absl::OkStatus();
  }
  // Where the run saves a training checkpoint after `done` steps.
  // A time-boxed run saves one at its stop too, so that --resume goes on
  // from there, training no step twice.
  auto saves_after = [&](int64_t done) {
    if (o.save_dir.empty()) return false;
    if (time_boxed && done == o.stop_after) return true;
    return o.save_every > 0 && (done % o.save_every == 0 || done == o.steps);
  };
  // Whether this run takes part in drains (RankHooks::drain), and whether
  // one was agreed: set by the read of the first step whose flag was up, the
  // same step on every rank.
  const bool drains = hooks.drain != nullptr && !o.save_dir.empty();
  bool draining = false;
  // fp16's loss scale, updated as each step's norm is read (the same on
  // every rank: the norm is global).
  std::optional<LossScaler> scaler = run.loss_scale;
  // Enqueues step `step` (0-based): its forwards, backwards, dp sync and
  // update, up to the tensor its one read takes.
  auto enqueue = [&](int64_t step) -> absl::StatusOr<EnqueuedStep> {
    EnqueuedStep e;
    e.step = step;
    e.start = absl::Now();
    const double loss_scale = scaler.has_value() ? scaler->scale() : 1.0;
    if (scaler.has_value()) e.loss_scale = loss_scale;
    optimizer.ZeroGrad();
    // The step's rows on this replica: grad_accum passes of micro_batches
    // micro-batches each; the dp sync reduces after the last one.
    const int64_t pass_rows = micro_rows * o.micro_batches;
    // The micro-batches' loss sums left on the device, read with the norm
    // after the update is enqueued.
    std::vector<Tensor> loss_sums;
    const int64_t step_labels = TrainStepLabels(*run.data, step);
    const int64_t replica_rows = pass_rows * o.grad_accum;
    for (int64_t pass = 0; pass < o.grad_accum; ++pass) {
      const bool last_pass = pass + 1 == o.grad_accum;
      if (shard.pp() > 1) {  // the schedule takes the pass's micro-batches together
        ASSIGN_OR_RETURN(const StepBatch batch,
                         run.data->Batch(step, replica, replica_rows, pass * pass_rows, pass_rows));
        ASSIGN_OR_RETURN(PipelineStepResult r,
                         RunPipelineStep(chunks, pg, *sync, batch.inputs, batch.labels, o.micro_batches, step_labels,
                                         /*reduce=*/last_pass, /*train=*/true,
                                         run.data->pairs() ? &batch.decoder_inputs : nullptr, loss_scale));
        e.loss += r.loss;
        e.pipeline_wait += r.mean_wait_seconds;
        e.pipeline_span += r.span_seconds;
        continue;
      }
      for (int64_t mb = 0; mb < o.micro_batches; ++mb) {
        sync->set_enabled(last_pass && mb + 1 == o.micro_batches);  // accumulate, then reduce once
        ASSIGN_OR_RETURN(const StepBatch batch, run.data->Batch(step, replica, replica_rows,
                                                                pass * pass_rows + mb * micro_rows, micro_rows));
        ASSIGN_OR_RETURN(const shardformer::LmLoss l,
                         MicroBatchLoss(*model, *run.data, batch, 0, micro_rows, step_labels,
                                        /*correct=*/nullptr, /*defer_read=*/true));
        RETURN_IF_ERROR(Backward(l.loss, static_cast<float>(loss_scale)));
        if (l.sum_on_device.has_value()) {
          loss_sums.push_back(*l.sum_on_device);
          e.loss_denominators.push_back(l.denominator);
        } else {
          e.loss += l.value;
        }
      }
    }
    RETURN_IF_ERROR(sync->Finish());
    RETURN_IF_ERROR(SumTiedGradients(chunks, chunk_params, pg));
    // The norm and the clipping factor are computed on the device and the
    // update reads the factor there: without pipeline stages (whose steps
    // read each micro-batch's loss) and with AdamW (SGD reads the factor),
    // nothing waits for the device from the first forward to the update.
    // (fp16: the factor unscales the gradients too.)
    ASSIGN_OR_RETURN(const DeviceClip clip, ClipOnDevice(optimizer, o.clip_norm, &pg, &norm_order, loss_scale));
    e.lr = LearningRate(step, o.lr, o.warmup_steps, o.steps, o.min_lr);
    if (scaler.has_value()) {
      // fp16: whether the gradients overflowed decides whether the step
      // updates, so the host reads the norm first (as GradScaler's step
      // reads found_inf): every rank reads the same global norm and decides
      // alike.
      ASSIGN_OR_RETURN(PendingRead pending, clip.norm_and_scale.StartRead());
      absl::StatusOr<std::vector<float>> norm = pending.Floats();
      RETURN_IF_ERROR(pg.AsyncError());  // a communicator's failure says more
      if (!norm.ok()) return norm.status();
      const absl::StatusOr<bool> updates = scaler->Update((*norm)[0]);
      if (!updates.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("training diverged at step ", step + 1, ": ",
                                                          updates.status().message(), DivergedAdvice(step + 1)));
      }
      e.update_skipped = !*updates;
    }
    if (!e.update_skipped) {
      RETURN_IF_ERROR(optimizer.Step(e.lr, clip.scale));  // clipping as the update reads
      RETURN_IF_ERROR(sync->GatherParams());              // ZeRO: every replica gets the weights the others updated
    }
    static_assert((3 + kMaxMicroBatchesPerStep) * sizeof(float) <= kernels::kMaxStartedRead,
                  "a step's losses are read at once");
    std::vector<Tensor> read = {clip.norm_and_scale};
    read.insert(read.end(), loss_sums.begin(), loss_sums.end());
    if (drains) {  // 1 once any rank's worker shuts down
      ASSIGN_OR_RETURN(Tensor flag, AnyOverMesh(pg, hooks.drain(), shard.device));
      e.drain_index = static_cast<int>(read.size()) + 1;  // after the norm's 2 elements and the loss sums
      read.push_back(std::move(flag));
    }
    ASSIGN_OR_RETURN(const Tensor all, Tensor::Cat(read, 0));
    // In stream order after the step's work, before the next step's: its
    // read waits for this step alone.
    ASSIGN_OR_RETURN(PendingRead started, all.StartRead());
    e.read.emplace(std::move(started));
    e.dp_bucket_bytes = sync->last_bucket_bytes();
    e.dp_overlapped_bytes = sync->last_overlapped_bytes();
    for (const NamedParam& p : params) {
      e.param_bytes += p.bound.param.local().nbytes();
      if (auto g = p.bound.param.variable().grad()) e.grad_bytes += g->nbytes();
    }
    e.grad_bytes += sync->chunk_bytes();
    e.optimizer_bytes = optimizer.state_bytes();
    if (!params.empty() && params[0].bound.param.local().device().is_cuda()) {
      ASSIGN_OR_RETURN(e.pool, kernels::GetCudaPoolBytes(params[0].bound.param.local().device().index));
    }
    e.enqueue_seconds = absl::ToDoubleSeconds(absl::Now() - e.start);
    return e;
  };
  absl::Time last_read = absl::InfinitePast();  // when the previous step's read returned
  // The step's one read (the norm and the losses, after every kernel and
  // collective of the step), then its report, evaluation and checkpoint. A
  // collective that failed is reported now. Its garbage may have reached the
  // weights in memory, but not a checkpoint or a report: the run ends here
  // and a restart loads the last checkpoint.
  // `drain_saves`: a drain agreed by this step's read (or an earlier one)
  // saves after it: false where the next step is enqueued already (the
  // drain saves after that one) or where the run ends after this one for
  // another reason (a stop, a step that failed to enqueue).
  auto finish = [&](EnqueuedStep& e, bool drain_saves) -> absl::Status {
    const int64_t step = e.step;
    const absl::Time read_start = absl::Now();
    absl::StatusOr<std::vector<float>> read = e.read->Floats();
    if (!read.ok()) {
      // A communicator's failure, where one is the cause, says more.
      RETURN_IF_ERROR(pg.AsyncError());
      return read.status();
    }
    const std::vector<float>& values = *read;
    const absl::Time read_end = absl::Now();
    const double device_wait = shard.device.is_cuda() ? absl::ToDoubleSeconds(read_end - read_start) : 0;
    RETURN_IF_ERROR(pg.AsyncError());
    double loss = e.loss;
    for (size_t k = 0; k < e.loss_denominators.size(); ++k) {
      loss += static_cast<double>(values[2 + k]) / static_cast<double>(e.loss_denominators[k]);
    }
    StepStats s;
    s.rank = rank;
    s.step = step + 1;
    s.loss = loss;
    s.lr = e.lr;
    s.grad_norm = values[0];
    s.loss_scale = e.loss_scale;
    s.update_skipped = e.update_skipped;
    // From the step's start, or from the previous step's read where the
    // step was enqueued before it: the device's time for the step where the
    // host runs ahead.
    s.seconds = absl::ToDoubleSeconds(read_end - std::max(e.start, last_read));
    last_read = read_end;
    s.device_wait_seconds = device_wait;
    s.enqueue_seconds = e.enqueue_seconds;
    s.pipeline_wait_seconds = e.pipeline_wait;
    s.pipeline_span_seconds = e.pipeline_span;
    s.dp_bucket_bytes = e.dp_bucket_bytes;
    s.dp_overlapped_bytes = e.dp_overlapped_bytes;
    const int64_t per_row = run.data->TokensPerRow();
    s.tokens_per_second = s.seconds > 0 ? static_cast<double>(run.step_batch * per_row) / s.seconds : 0;
    s.rank_tokens = micro_rows * o.micro_batches * o.grad_accum * per_row;
    s.step_tokens = run.step_batch * per_row;
    s.param_bytes = e.param_bytes;
    s.grad_bytes = e.grad_bytes;
    s.optimizer_bytes = e.optimizer_bytes;
    if (e.pool.has_value()) {
      s.cuda = true;
      s.pool_reserved_bytes = e.pool->reserved;
      s.pool_used_bytes = e.pool->used;
    }
    // A step whose loss or norm is not finite ends the run before its
    // evaluation and checkpoint (its update spread the NaN to every weight).
    // Both are the same on every rank (summed over the mesh), so every rank
    // stops here, with the same error. The step is not reported (a peer's
    // failure may abort this rank first): the error names it and its values.
    RETURN_IF_ERROR(FiniteStep(s));
    if (e.drain_index >= 0 && values[e.drain_index] > 0) draining = true;
    if (EvaluatesAfter(run, step + 1)) {
      ASSIGN_OR_RETURN(s.eval, EvaluateNamed(run, chunks, pg, *sync, replica, step + 1, hooks));
      RETURN_IF_ERROR(FiniteEval(*s.eval, /*training=*/true));
    }
    if (saves_after(step + 1) || (draining && drain_saves && step + 1 < o.steps)) {
      const absl::Status saved = SaveTrainingCheckpoint(
          chunks, optimizer, o.save_dir, step + 1, run.seed,
          s.eval.has_value() ? std::optional<double>(s.eval->loss) : std::nullopt, run.writer,
          rank == 0 ? StepReportJson(s) : "", o.mask_token_id, scaler.has_value() ? &*scaler : nullptr);
      if (!saved.ok()) {
        // The step trained, and its checkpoint may be whole on disk all the
        // same (rank 0 renames it into place before the save's last agreement,
        // which a peer that was stopped fails), so that a restart resumes
        // after it: the step is reported, or the job's history would lack it.
        if (hooks.on_step) hooks.on_step(s);
        return saved;
      }
      s.checkpoint = StepDir(o.save_dir, step + 1);
      // The checkpoint is complete on every rank (the save's last agreement);
      // a rank aborted since then removes nothing (another job or generation
      // may own the directory now).
      if (rank == 0 && pg.Aborted().ok()) {
        // The runs it continues are the same run: their checkpoints here
        // count as this one's (run.writer.lineage; a restart's are its own).
        absl::StatusOr<std::vector<CheckpointInfo>> kept =
            PruneCheckpoints(o.save_dir, Retention{.keep_last = o.keep_last, .keep_best = o.keep_best}, s.checkpoint,
                             run.writer, o.check_path);
        if (kept.ok()) {
          s.checkpoints = *std::move(kept);
          // The report carries the newest kMaxReportedCheckpoints, their
          // paths within kMaxReportedCheckpointPathBytes (the coordinator
          // refuses a report past either).
          if (s.checkpoints.size() > kMaxReportedCheckpoints) {
            s.checkpoints.erase(s.checkpoints.begin(), s.checkpoints.end() - kMaxReportedCheckpoints);
          }
          size_t path_bytes = 0, keep = 0;
          for (auto it = s.checkpoints.rbegin(); it != s.checkpoints.rend(); ++it, ++keep) {
            if (path_bytes + it->path.size() > kMaxReportedCheckpointPathBytes) break;
            path_bytes += it->path.size();
          }
          s.checkpoints.erase(s.checkpoints.begin(), s.checkpoints.end() - keep);
        } else {  // the run goes on: nothing was removed that a resume needs
          COLOD_LOG(WARNING) << "checkpoint retention in " << o.save_dir << ": " << kept.status();
        }
      }
    }
    if (step == first) s.resumed_from = run.resume;
    if (hooks.on_step) hooks.on_step(s);
    return absl::OkStatus();
  };
  // On a CUDA device the host runs a step ahead: step n is read once step
  // n + 1 is enqueued, so the device starts step n + 1 without waiting for
  // the host's report, data and launches. A step after which the run
  // evaluates, saves, stops or ends is read at once (eval and the checkpoint
  // read the weights it updated); so is every step with pipeline stages,
  // which read each micro-batch's loss, and every step of a run that asks
  // for it (TrainOptions::read_each_step).
  std::optional<EnqueuedStep> ahead;
  for (int64_t step = first; step < o.steps; ++step) {
    if (hooks.stop && hooks.stop()) {
      // (No drain's save: the run stops here, whatever its peers do.)
      if (ahead.has_value()) RETURN_IF_ERROR(finish(*ahead, /*drain_saves=*/false));
      return absl::CancelledError(absl::StrCat("stopped before step ", step + 1));
    }
    absl::StatusOr<EnqueuedStep> e = enqueue(step);
    if (ahead.has_value()) {
      // Reported even where this step failed to enqueue (it trained), unless
      // a communicator failed before its read: the error is then sticky and
      // could be its own, so it is not reported (a restart redoes it).
      // (No drain's save where this step failed: the run ends here.)
      const absl::Status previous = finish(*ahead, /*drain_saves=*/false);
      ahead.reset();
      if (!previous.ok()) {
        if (!e.ok()) COLOD_LOG(WARNING) << "step " << step + 1 << " failed too: " << e.status();
        return previous;
      }
    }
    if (!e.ok()) return e.status();
    const int64_t done = step + 1;
    if (shard.device.is_cuda() && !o.read_each_step && shard.pp() == 1 && done < o.steps && done != o.stop_after &&
        !EvaluatesAfter(run, done) && !saves_after(done) && !draining) {
      ahead = *std::move(e);
      continue;
    }
    RETURN_IF_ERROR(finish(*e, /*drain_saves=*/true));
    if (time_boxed && done == o.stop_after) return absl::OkStatus();
    if (draining && done < o.steps) {
      return MarkDrained(absl::AbortedError(
          absl::StrCat("stopped after step ", done, " for a drain (a worker of the job shuts down); its checkpoint ",
                       StepDir(o.save_dir, done), " was saved")));
    }
  }
  if (o.final_dir.empty()) return absl::OkStatus();
  const std::string sharded = o.final_dir + "/.sharded";
  // A failed run's sharded copy there (its index, which a message named to
  // consolidate) is rewritten rank file by rank file below: its index goes
  // first, so that a save that fails or dies midway leaves no index over a
  // mix of its files and the old run's.
  absl::Status cleared = absl::OkStatus();
  if (rank == 0) {
    std::error_code rm;
    std::filesystem::remove(absl::StrCat(sharded, "/", shardformer::kCheckpointIndex), rm);
    if (rm) {
      cleared = absl::FailedPreconditionError(
          absl::StrCat("cannot remove the old index of ", sharded, " before writing there: ", rm.message()));
    }
  }
  RETURN_IF_ERROR(AgreeOverMesh(pg, cleared, shard.device,
                                absl::StrCat("the trained model was not written: rank 0 could not clear ", sharded)));
  // A mixed-precision run's model in another dtype than its parameters'
  // (f32, or f16 after bf16) is made of its f32 master weights (what the
  // updates ran on), not of its 16-bit parameters widened or rounded twice.
  std::optional<shardformer::PartValues> masters;
  absl::flat_hash_map<absl::string_view, size_t> index;  // of the optimizer's parameters, by name
  if (o.final_dtype.has_value() && *o.final_dtype != shard.param_dtype && shard.param_dtype != DType::kF32) {
    for (size_t i = 0; i < optimizer.params().size(); ++i) index.emplace(optimizer.params()[i].name, i);
    masters.emplace();
    masters->of = [&](const shardformer::NamedParam& p, bool owns) -> absl::StatusOr<Tensor> {
      // (Under ZeRO every dp rank joins each parameter's sum.)
      if (!owns && !optimizer.partition().over_dp) return Tensor();
      auto it = index.find(p.name);
      if (it == index.end()) return absl::InternalError(absl::StrCat(p.name, " is not the optimizer's"));
      return optimizer.F32Weights(it->second, &pg);
    };
  }
  RETURN_IF_ERROR(shardformer::SaveShardedCheckpoint(chunks, sharded, masters.has_value() ? &*masters : nullptr));
  if (rank != 0) return absl::OkStatus();
  // Checked again: a model may have come there during the run. The
  // trained weights stay in `sharded` then (a checkpoint to consolidate).
  if (const absl::Status free = CheckFinalDir(o); !free.ok()) {
    return absl::Status(free.code(), absl::StrCat(free.message(), "; the trained weights are in ", sharded,
                                                  " (coloctl consolidate --checkpoint ", sharded, " --out DIR)"));
  }
  if (!o.job.empty()) {  // before the model: a restart after a partial write may write it again
    RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(o.final_dir, "/", kFinalWriterFile), o.job));
  }
  if (const absl::Status wrote = shardformer::ConsolidateCheckpoint(sharded, o.final_dir, o.final_dtype); !wrote.ok()) {
    return absl::Status(wrote.code(), absl::StrCat(wrote.message(), "; the trained weights are in ", sharded,
                                                   " (coloctl consolidate --checkpoint ", sharded, " --out DIR)"));
  }
  std::error_code ec;
  std::filesystem::remove_all(sharded, ec);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunTrainRank(const PreparedTrain& run, int rank, ProcessGroup& pg, const shardformer::ShardConfig& given,
                          const RankHooks& hooks) {
  // At the run's precision: a resumed run's may be its checkpoint's
  // (TrainOptions::precision_auto).
  shardformer::ShardConfig shard = given;
  shard.param_dtype = run.options.shard.param_dtype;
  const absl::Status s = RunTrainSteps(run, rank, pg, shard, hooks);
  if (s.ok() || shard.pp() < 2) return s;
  // A pipelined run's error names the stage it came from.
  absl::StatusOr<int> stage = pg.LocalRank("pp");
  if (!stage.ok()) return s;
  return WithMessage(s, absl::StrCat("pipeline stage ", *stage, " of ", shard.pp(), ": ",
                                     s.message()));  // still marked (MarkDrained)
}

absl::Status Train(const TrainOptions& o, const std::function<void(const StepStats&)>& on_step,
                   const std::function<void(const RankStart&)>& on_start) {
  ASSIGN_OR_RETURN(std::shared_ptr<const PreparedTrain> run, PrepareTrain(o));
  RankHooks hooks;
  hooks.on_step = [&](const StepStats& s) {
    if (s.rank == 0 && on_step) on_step(s);
  };
  return shardformer::RunOnLocalRanks(
      o.shard, o.cuda,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        RankHooks mine = hooks;
        if (rank == 0 && on_start) mine.on_start = on_start;
        return RunTrainRank(*run, rank, pg, shard, mine);
      },
      o.comm_timeout);
}

}  // namespace colod::train
