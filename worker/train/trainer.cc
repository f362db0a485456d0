#include "worker/train/trainer.h"

#include <filesystem>
#include <limits>
#include <optional>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/int_math.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "spec/job_validation.h"
#include "worker/tensor/ops.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/shardformer.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data_parallel.h"
#include "worker/train/image_data.h"
#include "worker/train/pipeline.h"
#include "worker/train/seq2seq_data.h"

namespace colod::train {

using shardformer::NamedParam;

namespace {

// One step's rows on one replica.
struct StepBatch {
  Tensor inputs, labels;
  Tensor decoder_inputs;  // an encoder-decoder's (TrainData::pairs())
  // The labelled positions of the whole step's batch (every replica): each
  // micro-batch's loss is divided by them, so the step's loss is its mean
  // however the labels fall across replicas and micro-batches.
  int64_t step_labels = 0;
};

// What a run trains on, as a step reads it: a token corpus (next-token
// prediction), images and labels (a classifier), or (input, target) pairs
// (an encoder-decoder), each with its seeded sampler. Thread-safe after
// construction (read-only; every rank of a local run shares one).
class TrainData {
 public:
  virtual ~TrainData() = default;
  // Rows [first, first + count) of replica `replica`'s `rows` of step
  // `step` (one accumulation pass: a step's passes are loaded one at a
  // time); step_labels counts the whole step's.
  virtual absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t rows, int64_t first,
                                          int64_t count) const = 0;
  // What one row counts for tokens/s: a sequence's tokens, a pair's input
  // and target tokens, an image (1).
  virtual int64_t TokensPerRow() const = 0;
  // The model classifies its rows (ClassificationLoss), rather than
  // predicting tokens.
  virtual bool classifies() const { return false; }
  // The model reads decoder inputs beside its inputs.
  virtual bool pairs() const { return false; }
};

class CorpusData final : public TrainData {
 public:
  CorpusData(std::unique_ptr<TokenCorpus> corpus, BatchSampler sampler, int64_t step_tokens)
      : corpus_(std::move(corpus)), sampler_(std::move(sampler)), step_tokens_(step_tokens) {}
  absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t, int64_t first, int64_t count) const override {
    StepBatch b;
    b.step_labels = step_tokens_;  // every token has its next
    RETURN_IF_ERROR(sampler_.Batch(*corpus_, step, replica, &b.inputs, &b.labels, first, count));
    return b;
  }
  int64_t TokensPerRow() const override { return sampler_.seq_len(); }

 private:
  std::unique_ptr<TokenCorpus> corpus_;
  BatchSampler sampler_;
  int64_t step_tokens_;
};

// Images with labels, or (input, target) pairs: whole examples, some of
// whose labels may be -100 (ignored).
template <typename Dataset>
class ExampleData final : public TrainData {
 public:
  ExampleData(std::unique_ptr<Dataset> set, BatchSampler sampler) : set_(std::move(set)), sampler_(std::move(sampler)) {}
  absl::StatusOr<StepBatch> Batch(int64_t step, int replica, int64_t rows, int64_t first,
                                  int64_t count) const override {
    StepBatch b;
    const std::vector<int64_t> all = sampler_.Starts(step);
    b.step_labels = set_->Labelled(all);
    if (b.step_labels == 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step + 1, " drew ", all.size(),
                                                     " images and every one is labelled -100"));
    }
    if (first < 0 || count < 0 || first > rows - count || (replica + 1) * rows > static_cast<int64_t>(all.size())) {
      return absl::InternalError(absl::StrCat("rows [", first, ", ", first + count, ") of replica ", replica,
                                              "'s ", rows, " of a step of ", all.size()));
    }
    const std::vector<int64_t> mine(all.begin() + replica * rows + first, all.begin() + replica * rows + first + count);
    if constexpr (std::is_same_v<Dataset, Seq2SeqDataset>) {
      RETURN_IF_ERROR(set_->Batch(mine, &b.inputs, &b.decoder_inputs, &b.labels));
    } else {
      RETURN_IF_ERROR(set_->Batch(mine, &b.inputs, &b.labels));
    }
    return b;
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

 private:
  std::unique_ptr<Dataset> set_;
  BatchSampler sampler_;
};

}  // namespace

struct PreparedTrain {
  TrainOptions options;
  std::string resume;  // the checkpoint to resume from, if any
  uint64_t seed = 0;
  std::unique_ptr<TrainData> data;
  int64_t micro_rows = 0;
  int64_t step_batch = 0;  // sequences an optimizer step reads: batch_size * grad_accum
};

absl::StatusOr<std::shared_ptr<const PreparedTrain>> PrepareTrain(const TrainOptions& o) {
  if (o.steps < 1 || o.micro_batches < 1) return absl::InvalidArgumentError("steps and micro_batches must be >= 1");
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
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(o.shard.layout));
  ASSIGN_OR_RETURN(int dp, mesh.AxisSize("dp"));
  ASSIGN_OR_RETURN(ModelConfig config, shardformer::LoadConfig(o.model_dir));
  RETURN_IF_ERROR(CheckShardable(config, o.shard.layout));
  const bool examples = config.takes_images() || config.is_encoder_decoder();  // rows drawn whole
  if (!examples && !o.labels_path.empty()) {
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
  if (!examples && o.seq_len > config.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len ", o.seq_len, " exceeds the model's ",
                                                   config.max_positions, " positions"));
  }
  auto run = std::make_shared<PreparedTrain>();
  run->options = o;
  run->seed = o.seed;
  if (!o.resume_dir.empty()) {
    std::vector<std::string> skipped;
    ASSIGN_OR_RETURN(run->resume, LatestCheckpoint(o.resume_dir, &skipped));
    for (const std::string& s : skipped) COLOD_LOG(WARNING) << "skipping damaged checkpoint " << s;
    ASSIGN_OR_RETURN(Resumed state, ReadTrainState(run->resume));
    run->seed = state.seed;  // the sampler continues the stream it was on
  }
  const int64_t rows = o.batch_size / dp;
  if (rows * dp != o.batch_size || rows % o.micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the batch of ", o.batch_size,
                                                   " does not split over data_parallel_size ", dp, " and ",
                                                   o.micro_batches, " micro-batches a replica"));
  }
  run->micro_rows = rows / o.micro_batches;
  run->step_batch = *step_batch;
  if (config.takes_images()) {
    ASSIGN_OR_RETURN(std::unique_ptr<ImageDataset> images,
                     ImageDataset::Open(o.data_path, o.labels_path, config.num_channels, config.image_size,
                                        config.vocab_size));
    ASSIGN_OR_RETURN(BatchSampler sampler,
                     BatchSampler::ForExamples(images->size(), run->step_batch, dp, run->seed));
    run->data = std::make_unique<ExampleData<ImageDataset>>(std::move(images), std::move(sampler));
    return std::shared_ptr<const PreparedTrain>(std::move(run));
  }
  if (config.is_encoder_decoder()) {
    ASSIGN_OR_RETURN(std::unique_ptr<Seq2SeqDataset> pairs,
                     Seq2SeqDataset::Open(o.data_path, o.labels_path, config.vocab_size,
                                          config.decoder_start_token_id, config.pad_token_id));
    ASSIGN_OR_RETURN(BatchSampler sampler, BatchSampler::ForExamples(pairs->size(), run->step_batch, dp, run->seed));
    run->data = std::make_unique<ExampleData<Seq2SeqDataset>>(std::move(pairs), std::move(sampler));
    return std::shared_ptr<const PreparedTrain>(std::move(run));
  }
  const DataFormat format = ResolveDataFormat(o.data_path, o.data_format);
  std::unique_ptr<Tokenizer> tokenizer;
  if (IsTextFormat(format)) {
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
  ASSIGN_OR_RETURN(std::unique_ptr<TokenCorpus> corpus, TokenCorpus::Open(o.data_path, format, tokenizer.get()));
  ASSIGN_OR_RETURN(BatchSampler sampler,
                   BatchSampler::Create(corpus->size(), o.seq_len, run->step_batch, dp, run->seed));
  run->data = std::make_unique<CorpusData>(std::move(corpus), std::move(sampler), run->step_batch * o.seq_len);
  return std::shared_ptr<const PreparedTrain>(std::move(run));
}

namespace {

absl::Status RunTrainSteps(const PreparedTrain& run, int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                           const RankHooks& hooks) {
  const TrainOptions& o = run.options;
  const int64_t micro_rows = run.micro_rows;
  // Every run sets it: a worker daemon's device outlives its jobs.
  RETURN_IF_ERROR(ops::SetAllowTf32(shard.device, o.allow_tf32));
  ASSIGN_OR_RETURN(std::unique_ptr<shardformer::ShardedModel> model,
                   shardformer::ShardFormer(shard, &pg).Load(o.model_dir));
  if (shard.pp() > 1) RETURN_IF_ERROR(MakePipelineChannels(pg, shard.pp()));
  std::vector<NamedParam> params = model->Parameters();
  ASSIGN_OR_RETURN(std::unique_ptr<GradSync> sync, GradSync::Create(params, &pg, o.bucket_bytes, o.zero_stage));
  // Under ZeRO each dp rank updates (and keeps the state of) its partition.
  ASSIGN_OR_RETURN(Optimizer optimizer, Optimizer::Create(params, o.optimizer, sync->partition()));
  ASSIGN_OR_RETURN(int replica, pg.dp_local_rank());
  int64_t first = 0;
  if (!run.resume.empty()) {
    ASSIGN_OR_RETURN(Resumed r, RestoreTrainingCheckpoint(run.resume, *model, optimizer));
    first = r.step;
  }
  if (hooks.on_start) hooks.on_start();
  for (int64_t step = first; step < o.steps; ++step) {
    if (hooks.stop && hooks.stop()) {
      return absl::CancelledError(absl::StrCat("stopped before step ", step + 1));
    }
    const absl::Time start = absl::Now();
    optimizer.ZeroGrad();
    // The step's rows on this replica: grad_accum passes of micro_batches
    // micro-batches each; the dp sync reduces after the last one.
    const int64_t pass_rows = micro_rows * o.micro_batches;
    double loss = 0, pipeline_wait = 0;
    for (int64_t pass = 0; pass < o.grad_accum; ++pass) {
      const bool last_pass = pass + 1 == o.grad_accum;
      ASSIGN_OR_RETURN(const StepBatch batch,
                       run.data->Batch(step, replica, pass_rows * o.grad_accum, pass * pass_rows, pass_rows));
      const Tensor& inputs = batch.inputs;
      const Tensor& labels = batch.labels;
      const int64_t step_labels = batch.step_labels;
      if (shard.pp() > 1) {
        ASSIGN_OR_RETURN(PipelineStepResult r, RunPipelineStep(*model, pg, *sync, inputs, labels, o.micro_batches,
                                                               step_labels, /*reduce=*/last_pass));
        loss += r.loss;
        pipeline_wait += r.wait_seconds;
        continue;
      }
      for (int64_t mb = 0; mb < o.micro_batches; ++mb) {
        ASSIGN_OR_RETURN(Tensor in, inputs.Narrow(0, mb * micro_rows, micro_rows));
        ASSIGN_OR_RETURN(Tensor want, labels.Narrow(0, mb * micro_rows, micro_rows));
        sync->set_enabled(last_pass && mb + 1 == o.micro_batches);  // accumulate, then reduce once
        Tensor dec;  // an encoder-decoder's decoder input
        if (run.data->pairs()) {
          ASSIGN_OR_RETURN(dec, batch.decoder_inputs.Narrow(0, mb * micro_rows, micro_rows));
        }
        auto forward = [&]() -> absl::StatusOr<ColoTensor> {
          return run.data->pairs() ? model->Forward(in.Contiguous(), dec.Contiguous())
                                   : model->Forward(in.Contiguous());
        };
        shardformer::LmLoss l;
        if (run.data->classifies()) {
          ASSIGN_OR_RETURN(ColoTensor logits, forward());
          ASSIGN_OR_RETURN(l, model->ClassificationLoss(logits, want.Contiguous(), step_labels));
        } else {  // the LM head fused with the loss where the model allows
          ASSIGN_OR_RETURN(l, model->ForwardTokenLoss(forward, want.Contiguous(), step_labels));
        }
        RETURN_IF_ERROR(Backward(l.loss));
        loss += l.value;
      }
    }
    RETURN_IF_ERROR(sync->Finish());
    RETURN_IF_ERROR(SumTiedGradients(params, *model, pg));
    ASSIGN_OR_RETURN(double norm, GlobalGradNorm(optimizer, &pg));
    // The loss and the norm were read on the host, after the device passed
    // every collective before them: a collective that failed is reported now,
    // before its garbage reaches the weights.
    RETURN_IF_ERROR(pg.AsyncError());
    const double lr = LearningRate(step, o.lr, o.warmup_steps, o.steps, o.min_lr);
    RETURN_IF_ERROR(optimizer.Step(lr, ClipFactor(norm, o.clip_norm)));  // clipping as the update reads
    RETURN_IF_ERROR(sync->GatherParams());  // ZeRO: every replica gets the weights the others updated
    StepStats s;
    s.rank = rank;
    s.step = step + 1;
    s.loss = loss;
    s.lr = lr;
    s.grad_norm = norm;
    s.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    s.pipeline_wait_seconds = pipeline_wait;
    s.dp_bucket_bytes = sync->last_bucket_bytes();
    s.dp_overlapped_bytes = sync->last_overlapped_bytes();
    const int64_t per_row = run.data->TokensPerRow();
    s.tokens_per_second = s.seconds > 0 ? static_cast<double>(run.step_batch * per_row) / s.seconds : 0;
    s.rank_tokens = micro_rows * o.micro_batches * o.grad_accum * per_row;
    for (const NamedParam& p : params) {
      s.param_bytes += p.bound.param.local().nbytes();
      if (auto g = p.bound.param.variable().grad()) s.grad_bytes += g->nbytes();
    }
    s.grad_bytes += sync->chunk_bytes();
    s.optimizer_bytes = optimizer.state_bytes();
    if (!params.empty() && params[0].bound.param.local().device().is_cuda()) {
      ASSIGN_OR_RETURN(kernels::CudaPoolBytes pool,
                       kernels::GetCudaPoolBytes(params[0].bound.param.local().device().index));
      s.cuda = true;
      s.pool_reserved_bytes = pool.reserved;
      s.pool_used_bytes = pool.used;
    }
    const bool last = step + 1 == o.steps;
    if (!o.save_dir.empty() && o.save_every > 0 && ((step + 1) % o.save_every == 0 || last)) {
      RETURN_IF_ERROR(SaveTrainingCheckpoint(*model, optimizer, o.save_dir, step + 1, run.seed));
      s.checkpoint = StepDir(o.save_dir, step + 1);
    }
    if (step == first) s.resumed_from = run.resume;
    if (hooks.on_step) hooks.on_step(s);
    if (step + 1 == o.stop_after) return absl::OkStatus();
  }
  if (o.final_dir.empty()) return absl::OkStatus();
  const std::string sharded = o.final_dir + "/.sharded";
  RETURN_IF_ERROR(shardformer::SaveShardedCheckpoint(*model, sharded));
  if (rank != 0) return absl::OkStatus();
  RETURN_IF_ERROR(shardformer::ConsolidateCheckpoint(sharded, o.final_dir));
  std::error_code ec;
  std::filesystem::remove_all(sharded, ec);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunTrainRank(const PreparedTrain& run, int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard,
                          const RankHooks& hooks) {
  const absl::Status s = RunTrainSteps(run, rank, pg, shard, hooks);
  if (s.ok() || shard.pp() < 2) return s;
  // A pipelined run's error names the stage it came from.
  absl::StatusOr<int> stage = pg.LocalRank("pp");
  if (!stage.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("pipeline stage ", *stage, " of ", shard.pp(), ": ", s.message()));
}

absl::Status Train(const TrainOptions& o, const std::function<void(const StepStats&)>& on_step) {
  ASSIGN_OR_RETURN(std::shared_ptr<const PreparedTrain> run, PrepareTrain(o));
  RankHooks hooks;
  hooks.on_step = [&](const StepStats& s) {
    if (s.rank == 0 && on_step) on_step(s);
  };
  return shardformer::RunOnLocalRanks(o.shard, o.cuda, [&](int rank, ProcessGroup& pg,
                                                           const shardformer::ShardConfig& shard) {
    return RunTrainRank(*run, rank, pg, shard, hooks);
  }, o.comm_timeout);
}

}  // namespace colod::train
