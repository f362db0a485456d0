// Training a tiny GPT-2 on the text of the GPL (byte-level tokens): the
// first 10 losses agree across layouts (tp, dp, both, 2D, 3D, pipeline
// stages), the loss falls,
// gradient accumulation and clipping give the same run, and runs are
// deterministic.
#include "worker/train/trainer.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/grpc_status.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "spec/model_config.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/checkpoint_index.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data.h"
#include "worker/train/job_options.h"
#include "worker/train/megatron_testing.h"
#include "worker/train/tokenizer_testing.h"
#include "worker/train/train_testing.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

using testing::kGplText;

// A tiny byte-level GPT-2 (of `layers` layers; 0: TinyOptions' own).
std::string TinyModel(const std::string& name, int layers = 0) {
  shardformer::testing::TinyOptions tiny = testing::TinyByteLevel();
  if (layers > 0) tiny.layers = layers;
  auto m = shardformer::testing::WriteTinyGpt2(TempPath(name), tiny);
  EXPECT_TRUE(m.ok()) << m.status();
  return m->dir;
}

// The Hugging Face directories two runs of the same training saved hold the
// same tensors, element by element within 2e-3: 10 AdamW steps of 3e-3 move
// a weight up to 3e-2, and its rounding (a near-zero gradient's
// m / sqrt(v)) by a few 1e-4; a layer from the wrong stage or block would be
// off by the 0.02 scale of the weights.
void ExpectSameModels(const std::string& a_dir, const std::string& b_dir) {
  auto a = shardformer::ModelFiles::Open(a_dir);
  auto b = shardformer::ModelFiles::Open(b_dir);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)->Names(), (*b)->Names());
  for (const std::string& name : (*a)->Names()) {
    const std::vector<float> x = (*a)->Read(name)->ToFloats(), y = (*b)->Read(name)->ToFloats();
    ASSERT_EQ(x.size(), y.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(x[i]) - y[i]));
    EXPECT_LT(worst, 2e-3) << name;
  }
}

TrainOptions Options(const std::string& model, int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  TrainOptions o = testing::SmallRun(model, tp, dp, 10);
  o.shard.layout.set_tensor_parallel_mode(mode);
  return o;
}

// 6 steps of 8 examples (images, or pairs) from .npy data and labels, unsharded.
TrainOptions ExampleOptions(const std::string& model, const std::string& data, const std::string& labels) {
  TrainOptions o = Options(model, 1, 1);
  o.data_path = data;
  o.labels_path = labels;
  o.batch_size = 8;
  o.steps = 6;
  o.warmup_steps = 0;
  return o;
}

using testing::ExpectSameLosses;
using testing::Losses;

// A ViT on 24 labelled random images: the first step's loss is the
// unsharded reference's on the images the sampler drew, tp2 x dp2 (and 2
// micro-batches) trains with the same losses, and the loss falls.
TEST(Trainer, AnImageClassifierTrainsOnItsImagesAndLabels) {
  shardformer::testing::TinyOptions tiny;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("train_vit"), tiny);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const testing::ImageSet set = testing::WriteImages("train_vit", tiny);
  const Tensor& images = set.images;
  const Tensor& labels = set.labels;
  const TrainOptions o = ExampleOptions(vit->dir, set.images_path, set.labels_path);
  const std::vector<StepStats> base = Losses(o);
  ASSERT_EQ(base.size(), 6u);
  EXPECT_LT(base.back().loss, base[0].loss);
  // Step 1 against the reference on the same 8 images.
  auto sampler = BatchSampler::ForExamples(24, 8, 1, o.seed);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<int64_t> drawn = sampler->Starts(0);
  std::vector<Tensor> rows;
  std::vector<int64_t> want;
  const std::vector<int64_t> all = labels.ToInt64s();
  Tensor batch = *Tensor::Empty({8, 3, 8, 8}, DType::kF32);
  for (int64_t r = 0; r < 8; ++r) {
    ASSERT_TRUE(batch.Narrow(0, r, 1)->CopyFrom(*images.Narrow(0, drawn[r], 1)).ok());
    want.push_back(all[drawn[r]]);
  }
  auto ref = shardformer::testing::ReferenceVit(*vit, batch, *Tensor::FromInt64s({8}, want));
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_NEAR(base[0].loss, ref->loss, 1e-5 * ref->loss);
  TrainOptions sharded = o;
  sharded.shard.layout.set_tensor_parallel_size(2);
  sharded.shard.layout.set_data_parallel_size(2);
  sharded.micro_batches = 2;
  ExpectSameLosses(Losses(sharded), base, 1e-4, "tp2 x dp2, 2 micro-batches");
  // Labels it cannot take, and none.
  TrainOptions no_labels = o;
  no_labels.labels_path.clear();
  EXPECT_EQ(Train(no_labels, [](const StepStats&) {}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(WriteNpy(TempPath("few_labels.npy"), *Tensor::FromInt64s({2}, {1, 2})).ok());
  TrainOptions few = o;
  few.labels_path = TempPath("few_labels.npy");
  const absl::Status s = Train(few, [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("one per image"), std::string::npos) << s;
  TrainOptions lm = Options(TinyModel("train_gpt2_labels"), 1, 1);
  lm.labels_path = set.labels_path;
  EXPECT_EQ(Train(lm, [](const StepStats&) {}).code(), absl::StatusCode::kInvalidArgument);
}

// Images labelled -100 are left out of the loss; a step that drew only such
// images trains on nothing: its loss and gradient norm are 0 (the sum over
// no labels divided by 1, not by 0), and the steps around it train.
TEST(Trainer, AStepThatDrewOnlyUnlabelledImagesTrainsOnNothing) {
  shardformer::testing::TinyOptions tiny;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("train_vit_unlabelled"), tiny);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const testing::ImageSet set = testing::WriteImages("train_vit_unlabelled", tiny);
  std::vector<int64_t> labels = set.labels.ToInt64s();
  for (size_t i = 4; i < labels.size(); ++i) labels[i] = -100;  // 4 of the 24 labelled
  const std::string labels_path = TempPath("unlabelled_labels.npy");
  ASSERT_TRUE(WriteNpy(labels_path, *Tensor::FromInt64s({24}, labels)).ok());
  TrainOptions o = ExampleOptions(vit->dir, set.images_path, labels_path);
  o.batch_size = 1;
  o.steps = 12;
  const std::vector<StepStats> got = Losses(o);
  ASSERT_EQ(got.size(), 12u);
  auto sampler = BatchSampler::ForExamples(24, 1, 1, o.seed);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  int empty = 0, trained = 0;
  for (int64_t s = 0; s < 12; ++s) {
    const int64_t drawn = sampler->Starts(s)[0];
    if (labels[drawn] == -100) {
      ++empty;
      EXPECT_EQ(got[s].loss, 0) << "step " << s + 1;
      EXPECT_EQ(got[s].grad_norm, 0) << "step " << s + 1;
    } else {
      ++trained;
      EXPECT_GT(got[s].loss, 0) << "step " << s + 1;
      EXPECT_TRUE(std::isfinite(got[s].loss)) << "step " << s + 1;
      EXPECT_GT(got[s].grad_norm, 0) << "step " << s + 1;
    }
  }
  ASSERT_GT(empty, 0) << "no step drew an unlabelled image: the test proves nothing";
  ASSERT_GT(trained, 0) << "no step drew a labelled image: the test proves nothing";
}

// A T5 (flan-t5's shape) on 24 (input, target) pairs whose targets end at
// different lengths (-100 after): step 1's loss is the unsharded
// reference's on the pairs the sampler drew, with the decoder input built
// here as Hugging Face's _shift_right builds it; 4 micro-batches, and tp2 x
// dp2 with 2, train with the same losses (each micro-batch is divided by
// the whole step's targets, so uneven targets do not tilt the mean); the
// loss falls.
TEST(Trainer, AnEncoderDecoderTrainsOnInputTargetPairs) {
  const shardformer::testing::TinyOptions tiny = shardformer::testing::TinyFlanT5();
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("train_t5"), tiny);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const testing::PairSet pairs = testing::WritePairs("train_t5", t5->config.vocab_size);
  const int64_t n = testing::PairSet::kPairs, se = testing::PairSet::kInputLen, sd = testing::PairSet::kTargetLen;
  const Tensor& inputs = pairs.inputs;
  const std::vector<int64_t>& targets = pairs.targets;
  const TrainOptions o = ExampleOptions(t5->dir, pairs.inputs_path, pairs.targets_path);
  const std::vector<StepStats> base = Losses(o);
  ASSERT_EQ(base.size(), 6u);
  EXPECT_LT(base.back().loss, base[0].loss);
  // Step 1 against the reference on the same 8 pairs.
  auto sampler = BatchSampler::ForExamples(n, 8, 1, o.seed);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<int64_t> drawn = sampler->Starts(0);
  const std::vector<int64_t> in = inputs.ToInt64s();
  std::vector<int64_t> ids, dec, want;
  for (int64_t r = 0; r < 8; ++r) {
    const int64_t i = drawn[r];
    ids.insert(ids.end(), in.begin() + i * se, in.begin() + (i + 1) * se);
    want.insert(want.end(), targets.begin() + i * sd, targets.begin() + (i + 1) * sd);
    dec.push_back(t5->config.decoder_start_token_id);
    for (int64_t s = 0; s + 1 < sd; ++s) {
      const int64_t t = targets[i * sd + s];
      dec.push_back(t == -100 ? t5->config.pad_token_id : t);
    }
  }
  auto ref = shardformer::testing::ReferenceT5(*t5, *Tensor::FromInt64s({8, se}, ids),
                                               *Tensor::FromInt64s({8, sd}, dec), *Tensor::FromInt64s({8, sd}, want));
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_NEAR(base[0].loss, ref->loss, 1e-5 * ref->loss);
  TrainOptions accumulated = o;
  accumulated.micro_batches = 4;
  ExpectSameLosses(Losses(accumulated), base, 1e-4, "4 micro-batches");
  // seq_len bounds the pairs' lengths, which admission counts at seq_len.
  TrainOptions short_seq = o;
  short_seq.seq_len = se - 1;
  const absl::Status too_long = Train(short_seq, nullptr);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument) << too_long;
  EXPECT_NE(too_long.message().find(absl::StrCat("the inputs are ", se, " tokens and the targets ", sd, ", over seq_len ",
                                                 se - 1)),
            std::string::npos)
      << too_long;
  TrainOptions sharded = o;
  sharded.shard.layout.set_tensor_parallel_size(2);
  sharded.shard.layout.set_data_parallel_size(2);
  sharded.micro_batches = 2;
  ExpectSameLosses(Losses(sharded), base, 1e-4, "tp2 x dp2, 2 micro-batches");
  // Sequence parallelism splits the inputs (10 tokens) and the targets (6)
  // over tp: at tp 2 the losses are the same; at tp 4, which divides
  // neither, the run is refused before any rank starts, naming both.
  TrainOptions sp = sharded;
  sp.shard.layout.set_sequence_parallel(true);
  ExpectSameLosses(Losses(sp), base, 1e-4, "sequence parallel, tp2 x dp2");
  sp.shard.layout.set_tensor_parallel_size(4);
  sp.shard.layout.set_data_parallel_size(1);
  const absl::Status unsplit = Train(sp, nullptr);
  EXPECT_EQ(unsplit.code(), absl::StatusCode::kInvalidArgument) << unsplit;
  EXPECT_NE(unsplit.message().find(absl::StrCat("data_path: the inputs are ", se, " tokens and the targets ", sd,
                                                "; sequence parallelism splits each over tensor_parallel_size 4")),
            std::string::npos)
      << unsplit;
  // Pairs need their targets; targets for another count of inputs are refused.
  TrainOptions no_targets = o;
  no_targets.labels_path.clear();
  const absl::Status missing = Train(no_targets, [](const StepStats&) {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("it trains on (input, target) pairs"), std::string::npos) << missing;
  TrainOptions short_targets = o;
  short_targets.labels_path = TempPath("t5_few.npy");
  ASSERT_TRUE(WriteNpy(short_targets.labels_path, *Tensor::FromInt64s({2, 2}, {1, 2, 3, 4})).ok());
  const absl::Status few = Train(short_targets, [](const StepStats&) {});
  EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(few.message().find("one per input"), std::string::npos) << few;
}

TEST(Trainer, LossesAgreeAcrossLayoutsAndFall) {
  const std::string model = TinyModel("train_gpt2");
  const std::vector<StepStats> base = Losses(Options(model, 1, 1));
  ASSERT_EQ(base.size(), 10u);
  EXPECT_LT(base.back().loss, base[0].loss - 0.5);  // and it learns
  for (const StepStats& s : base) EXPECT_GT(s.tokens_per_second, 0);
  ExpectSameLosses(Losses(Options(model, 2, 1)), base, 1e-4, "tp=2");
  ExpectSameLosses(Losses(Options(model, 1, 2)), base, 1e-4, "dp=2");
  ExpectSameLosses(Losses(Options(model, 2, 2)), base, 1e-4, "tp=2 dp=2");
  ExpectSameLosses(Losses(Options(model, 4, 1, v1::TENSOR_PARALLEL_MODE_2D)), base, 1e-4, "2d");
  ExpectSameLosses(Losses(Options(model, 8, 1, v1::TENSOR_PARALLEL_MODE_3D)), base, 1e-4, "3d");
}

// Pipeline stages (1F1B over the step's micro-batches): GPT-2 of 4 layers
// and LLaMA of 3, at pp 2, 3 and 4, even and uneven stages, with tp (1D and
// 2D) and dp, train with the unsharded run's losses and gradient norms
// (clipping at 1.0 reads the norm across stages), the tied embedding's
// gradient summed between the first and last stages.
TEST(Trainer, PipelineStagesTrainWithTheUnshardedLosses) {
  shardformer::testing::TinyOptions o;
  o.vocab = kByteVocab;
  o.positions = 32;
  o.layers = 4;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("train_pp_gpt2"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  // 5 steps: a wrong stage boundary or gradient shows from the second.
  auto pipeline = [](TrainOptions t, int pp, int micro, std::vector<int> layers = {}) {
    t.steps = 5;
    t.shard.layout.set_pipeline_parallel_size(pp);
    for (int n : layers) t.shard.layout.add_pipeline_stage_layers(n);
    t.micro_batches = micro;
    return t;
  };
  const std::vector<StepStats> base = Losses(pipeline(Options(gpt2->dir, 1, 1), 1, 1));
  ASSERT_EQ(base.size(), 5u);
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 1, 1), 2, 4)), base, 1e-4, "pp=2");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 1, 1), 2, 4, {3, 1})), base, 1e-4, "pp=2 layers 3+1");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 1, 1), 4, 4)), base, 1e-4, "pp=4");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 2, 1), 2, 2)), base, 1e-4, "tp=2 pp=2");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 1, 2), 2, 2)), base, 1e-4, "pp=2 dp=2");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 2, 2), 2, 2)), base, 1e-4, "tp=2 pp=2 dp=2");
  ExpectSameLosses(Losses(pipeline(Options(gpt2->dir, 4, 1, v1::TENSOR_PARALLEL_MODE_2D), 2, 2)), base, 1e-4,
                   "2d tp=4 pp=2");

  o.layers = 3;
  for (bool tie : {false, true}) {
    o.tie = tie;
    auto llama = shardformer::testing::WriteTinyLlama(TempPath(tie ? "train_pp_llama_tied" : "train_pp_llama"), o);
    ASSERT_TRUE(llama.ok()) << llama.status();
    const std::vector<StepStats> want = Losses(pipeline(Options(llama->dir, 1, 1), 1, 1));
    ExpectSameLosses(Losses(pipeline(Options(llama->dir, 2, 1), 3, 4)), want, 1e-4,
                     tie ? "llama tied tp=2 pp=3" : "llama tp=2 pp=3");
  }
}

// A pipelined run saved every 5 steps and stopped after 6 resumes with the
// uninterrupted run's losses bitwise; another pp cannot resume it; its
// final model, consolidated from the stages, is the unpipelined run's (to
// the rounding 10 AdamW steps amplify).
TEST(Trainer, PipelineStagesCheckpointAndResume) {
  shardformer::testing::TinyOptions o;
  o.vocab = kByteVocab;
  o.positions = 32;
  o.layers = 3;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("train_pp_ck"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  TrainOptions full = Options(gpt2->dir, 2, 1);
  full.shard.layout.set_pipeline_parallel_size(2);
  full.micro_batches = 2;
  full.save_dir = TempPath("pp_ck_full");
  full.save_every = 5;
  full.final_dir = TempPath("pp_final");
  const std::vector<StepStats> want = Losses(full);
  ASSERT_EQ(want.size(), 10u);
  TrainOptions cut = full;
  cut.save_dir = TempPath("pp_ck_cut");
  cut.final_dir.clear();
  cut.stop_after = 6;  // not a multiple of save_every: the stop saves step 6 all the same
  const std::vector<StepStats> before = Losses(cut);
  ASSERT_EQ(before.size(), 6u);
  EXPECT_EQ(before.back().checkpoint, TempPath("pp_ck_cut") + "/step-000006");
  TrainOptions resumed = cut;
  resumed.stop_after = 0;
  resumed.resume_dir = TempPath("pp_ck_cut");
  const std::vector<StepStats> rest = Losses(resumed);
  ASSERT_EQ(rest.size(), 4u);  // steps 7 to 10, none twice
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].loss, want[i + 6].loss) << "step " << i + 7;
  // Without --save-every, --save alone: the stop's checkpoint is its only one.
  TrainOptions stop_only = cut;
  stop_only.save_dir = TempPath("pp_ck_stop_only");
  stop_only.save_every = 0;
  ASSERT_EQ(Losses(stop_only).size(), 6u);
  EXPECT_EQ(LatestCheckpoint(stop_only.save_dir).value_or(""), stop_only.save_dir + "/step-000006");
  TrainOptions other = resumed;
  other.shard.layout.set_pipeline_parallel_size(1);
  EXPECT_EQ(Train(other, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  // The final model, consolidated from the stages, against the same run unpipelined.
  TrainOptions flat = Options(gpt2->dir, 1, 1);
  flat.final_dir = TempPath("flat_final");
  ASSERT_EQ(Losses(flat).size(), 10u);
  ExpectSameModels(TempPath("pp_final"), TempPath("flat_final"));
}

// What pipeline stages refuse, before any rank starts.
TEST(Trainer, PipelineStagesRefuseWhatTheyCannotRun) {
  const std::string model = TinyModel("train_pp_refuse");  // 2 layers
  auto refused = [&](TrainOptions t, const std::string& why) {
    const absl::Status s = Train(t, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(why), std::string::npos) << s;
  };
  TrainOptions t = Options(model, 1, 1);
  t.shard.layout.set_pipeline_parallel_size(3);
  refused(t, "more stages than the model's 2 layers");
  t.shard.layout.set_pipeline_parallel_size(2);
  t.shard.layout.add_pipeline_stage_layers(2);
  t.shard.layout.add_pipeline_stage_layers(1);
  refused(t, "sum to 3 layers");
  t.shard.layout.clear_pipeline_stage_layers();
  t.shard.layout.set_sequence_parallel(true);
  t.shard.layout.set_tensor_parallel_size(2);
  refused(t, "sequence_parallel");
}

// A stage that fails (here the last, whose final norm the checkpoint lacks)
// ends the whole pipeline with its error, naming the tensor; the stages
// waiting for it are aborted, not left waiting.
TEST(Trainer, AFailingStageEndsThePipelineWithItsError) {
  shardformer::testing::TinyOptions o;
  o.vocab = kByteVocab;
  o.positions = 32;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("train_pp_broken"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  std::vector<std::pair<std::string, Tensor>> kept;
  for (const auto& [name, t] : gpt2->tensors) {
    if (name.find("ln_f") == std::string::npos) kept.emplace_back(name, t);
  }
  ASSERT_TRUE(shardformer::WriteSafetensors(gpt2->dir + "/model.safetensors", kept).ok());
  TrainOptions t = Options(gpt2->dir, 1, 1);
  t.shard.layout.set_pipeline_parallel_size(2);
  t.micro_batches = 2;
  for (const bool cuda : {false, true}) {
    // On CUDA ranks the first stage is making its NCCL channels with the
    // stage that failed.
    if (cuda && kernels::CudaDeviceCount() < 2) continue;  // the default build's pass; the emulation has 4
    t.cuda = cuda;
    const absl::Time start = absl::Now();
    const absl::Status s = Train(t, nullptr);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("pipeline stage 1 of 2"), std::string::npos) << s;
    EXPECT_NE(s.message().find("ln_f"), std::string::npos) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "the first stage was left waiting: " << s;
  }
}

// A stage that stops in the middle of a run (the last, before step 2)
// leaves the first inside its step, waiting for a gradient that does not
// come: the run ends at once with the stopped stage's error, on Gloo and on
// NCCL channels, and no rank waits out its timeout.
TEST(Trainer, AStageThatStopsMidRunAbortsTheOthers) {
  const std::string model = TinyModel("train_pp_stop");
  TrainOptions t = Options(model, 1, 1);
  t.shard.layout.set_pipeline_parallel_size(2);
  t.micro_batches = 2;
  t.comm_timeout = absl::Minutes(5);  // a hang would show as minutes, not as a timeout's error
  auto prepared = PrepareTrain(t);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  for (const bool cuda : {false, true}) {
    if (cuda && kernels::CudaDeviceCount() < 2) continue;
    std::atomic<int> stopped_after{0}, first_stage_steps{0};
    const absl::Time start = absl::Now();
    const absl::Status s = shardformer::RunOnLocalRanks(
        t.shard, cuda,
        [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
          RankHooks hooks;
          int polled = 0;
          hooks.on_step = [&](const StepStats& st) {
            (st.rank == 1 ? stopped_after : first_stage_steps) = static_cast<int>(st.step);
          };
          hooks.stop = [&, rank] { return rank == 1 && ++polled == 2; };  // stage 1, before step 2
          return RunTrainRank(**prepared, rank, pg, shard, hooks);
        },
        t.comm_timeout);
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_NE(s.message().find("pipeline stage 1 of 2: stopped before step 2"), std::string::npos) << s;
    EXPECT_EQ(stopped_after.load(), 1) << "stage 1 stops after step 1";
    // Stage 0 finishes step 1 or is aborted in its last host-side checks
    // (the abort can reach it before it reports the step): never step 2.
    EXPECT_LE(first_stage_steps.load(), 1);
    EXPECT_LT(absl::Now() - start, absl::Seconds(60)) << (cuda ? "NCCL" : "Gloo") << ": " << s;
  }
}

// A stop request ends a rank before its next step. On a CUDA device the
// host runs a step ahead (it reads step n once step n + 1 is enqueued), so
// a stop polled after step 2's report finds step 3 enqueued: the rank
// reports it, with the loss the uninterrupted run gives, and stops before
// step 4. On the CPU, or with read_each_step, each step is read as it
// ends: it stops before step 3.
TEST(Trainer, AStopReportsTheStepEnqueuedAheadOfIt) {
  const std::string model = TinyModel("train_stop_ahead");
  TrainOptions t = Options(model, 1, 1);
  t.steps = 6;
  const std::vector<StepStats> whole = Losses(t);
  for (const auto& [cuda, read_each_step] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    if (cuda && kernels::CudaDeviceCount() < 1) continue;
    t.cuda = cuda;
    t.read_each_step = read_each_step;
    auto prepared = PrepareTrain(t);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    std::vector<StepStats> reported;
    const absl::Status s = shardformer::RunOnLocalRanks(
        t.shard, cuda,
        [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
          RankHooks hooks;
          hooks.on_step = [&](const StepStats& st) { reported.push_back(st); };
          hooks.stop = [&] { return reported.size() >= 2; };
          return RunTrainRank(**prepared, rank, pg, shard, hooks);
        },
        t.comm_timeout);
    const int64_t last = cuda && !read_each_step ? 3 : 2;
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_NE(s.message().find(absl::StrCat("stopped before step ", last + 1)), std::string::npos) << s;
    ASSERT_EQ(reported.size(), static_cast<size_t>(last)) << (cuda ? "CUDA" : "CPU") << " " << read_each_step;
    for (int64_t i = 0; i < last; ++i) {
      EXPECT_EQ(reported[i].step, i + 1);
      EXPECT_NEAR(reported[i].loss, whole[i].loss, 1e-4 * whole[i].loss) << "step " << i + 1;
    }
  }
}

// Each of four ranks' end and the steps it reported, in a run of `run` on
// local ranks in which rank 3 asks for a drain once it reported step
// `after` (0: from its first poll, while the ranks load).
struct DrainedRun {
  std::vector<absl::Status> ends = std::vector<absl::Status>(4);
  std::vector<std::vector<StepStats>> reported = std::vector<std::vector<StepStats>>(4);
};
DrainedRun RunDrainedByRank3(const PreparedTrain& run, const TrainOptions& t, int64_t after = 3) {
  DrainedRun out;
  absl::Mutex mu;
  std::atomic<int64_t> rank3_steps{0};
  (void)shardformer::RunOnLocalRanks(
      t.shard, t.cuda,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        RankHooks hooks;
        hooks.on_step = [&, rank](const StepStats& st) {
          absl::MutexLock lock(&mu);
          out.reported[rank].push_back(st);
          if (rank == 3) rank3_steps = st.step;
        };
        hooks.drain = [&, rank] { return rank == 3 && rank3_steps.load() >= after; };
        const absl::Status end = RunTrainRank(run, rank, pg, shard, hooks);
        absl::MutexLock lock(&mu);
        out.ends[rank] = end;
        return end;
      },
      t.comm_timeout);
  return out;
}

// A drain (a worker of the job shuts down) asked of one rank of four (tp=2 x
// dp=2) stops every rank after the same step, its checkpoint saved and
// reported, with a MarkDrained ABORTED; resuming from that checkpoint gives
// the uninterrupted run's losses bitwise. On the CPU the read of the step
// enqueued after the drain was asked finds it (rank 3 asks once it
// reported step 3: the ranks stop after step 4); on a CUDA device the host
// runs a step ahead, so the ranks stop after the step enqueued ahead of
// that read (step 6).
TEST(Trainer, ADrainStopsEveryRankAfterTheSameStepWithItsCheckpoint) {
  const std::string model = TinyModel("train_drain");
  TrainOptions t = Options(model, 2, 2);
  t.steps = 8;
  t.save_every = 100;  // no checkpoint but the drain's before the last step
  for (const bool cuda : {false, true}) {
    if (cuda && kernels::CudaDeviceCount() < 4) continue;  // the default build's pass; the emulation has 4
    t.cuda = cuda;
    const std::string tag = cuda ? "cuda" : "cpu";
    TrainOptions whole = t;
    whole.save_dir = TempPath("drain_whole_" + tag);
    const std::vector<StepStats> want = Losses(whole);
    ASSERT_EQ(want.size(), 8u);
    t.save_dir = TempPath("drain_" + tag);
    auto prepared = PrepareTrain(t);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    const DrainedRun run = RunDrainedByRank3(**prepared, t);
    const std::vector<absl::Status>& ends = run.ends;
    const std::vector<std::vector<StepStats>>& reported = run.reported;
    const int64_t last = cuda ? 6 : 4;
    const std::string dir = StepDir(t.save_dir, last);
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(IsDrained(ends[rank])) << tag << " rank " << rank << ": " << ends[rank];
      EXPECT_EQ(ends[rank].code(), absl::StatusCode::kAborted) << ends[rank];
      EXPECT_NE(ends[rank].message().find(absl::StrCat("stopped after step ", last, " for a drain")), std::string::npos)
          << ends[rank];
      ASSERT_EQ(reported[rank].size(), static_cast<size_t>(last)) << tag << " rank " << rank;
      EXPECT_EQ(reported[rank].back().checkpoint, dir) << "every rank reports the checkpoint";
      for (int64_t i = 0; i < last; ++i) EXPECT_EQ(reported[rank][i].loss, want[i].loss) << "step " << i + 1;
    }
    EXPECT_TRUE(std::filesystem::exists(dir + "/rank-00003-of-00004.safetensors")) << dir;
    EXPECT_EQ(std::distance(std::filesystem::directory_iterator(t.save_dir), std::filesystem::directory_iterator()), 1)
        << "the drain's checkpoint alone";
    TrainOptions resumed = t;
    resumed.resume_dir = t.save_dir;
    const std::vector<StepStats> rest = Losses(resumed);
    ASSERT_EQ(rest.size(), static_cast<size_t>(8 - last)) << tag;
    for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].loss, want[last + i].loss) << "step " << last + i + 1;
  }
  // Pipeline stages (pp=2 x tp=2): the stage names itself in the error,
  // which stays marked drained; the ranks stop after step 4 (a pipelined
  // CUDA step is read as it ends).
  {
    TrainOptions pp = Options(TinyModel("train_drain_pp", 2), 2, 1);
    pp.shard.layout.set_pipeline_parallel_size(2);
    pp.micro_batches = 2;
    pp.steps = 8;
    pp.save_every = 100;
    pp.save_dir = TempPath("drain_pp");
    auto prepared = PrepareTrain(pp);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    const std::vector<absl::Status> ends = RunDrainedByRank3(**prepared, pp).ends;
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(IsDrained(ends[rank])) << "pp rank " << rank << ": " << ends[rank];
      EXPECT_NE(ends[rank].message().find("pipeline stage "), std::string::npos) << ends[rank];
      EXPECT_NE(ends[rank].message().find("stopped after step 4 for a drain"), std::string::npos) << ends[rank];
    }
    EXPECT_TRUE(std::filesystem::exists(StepDir(pp.save_dir, 4))) << "the drain's checkpoint";
  }
  // A run that does not save checkpoints takes no part in drains: it
  // trains on, whatever a rank answers.
  TrainOptions unsaved = t;
  unsaved.cuda = false;
  unsaved.save_dir.clear();
  auto prepared = PrepareTrain(unsaved);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  const absl::Status s = shardformer::RunOnLocalRanks(
      unsaved.shard, false,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        RankHooks hooks;
        hooks.drain = [] { return true; };
        return RunTrainRank(**prepared, rank, pg, shard, hooks);
      },
      unsaved.comm_timeout);
  EXPECT_TRUE(s.ok()) << s;
}

// A drain asked before the first step (the worker shuts down while the
// job loads), and drains of runs that keep other state: ZeRO-2's sharded
// optimizer state and gradients, a 2D mesh (tp=4 as 2 x 2), interleaved
// pipeline chunks (pp=2 x 2 virtual stages x tp=2). Each stops every rank
// after the same step with its checkpoint (after step 1 for the first: the
// drain's answer rides on the first step's read), and resuming from it
// gives the uninterrupted run's losses bitwise.
TEST(Trainer, ADrainWhileTheRanksLoadOrOfZeroA2DMeshOrInterleavedChunksResumesBitwise) {
  const std::string gpt2 = TinyModel("train_drain_more", 4);
  struct Case {
    std::string name;
    TrainOptions options;
    int64_t after;  // rank 3 asks once it reported this step
    int64_t last;   // the step every rank stops after
  };
  std::vector<Case> cases;
  cases.push_back({"loading", Options(gpt2, 2, 2), 0, 1});
  cases.push_back({"zero2", Options(gpt2, 2, 2), 3, 4});
  cases.back().options.zero_stage = 2;
  cases.push_back({"2d", Options(gpt2, 4, 1, v1::TENSOR_PARALLEL_MODE_2D), 3, 4});
  cases.push_back({"interleaved", Options(gpt2, 2, 1), 3, 4});
  cases.back().options.shard.layout.set_pipeline_parallel_size(2);
  cases.back().options.shard.layout.set_virtual_stages(2);
  cases.back().options.micro_batches = 2;
  for (Case& c : cases) {
    TrainOptions& t = c.options;
    t.steps = 6;
    t.save_every = 100;  // no checkpoint but the drain's
    TrainOptions whole = t;
    whole.save_dir = TempPath("drain_more_whole_" + c.name);
    const std::vector<StepStats> want = Losses(whole);
    ASSERT_EQ(want.size(), 6u) << c.name;
    t.save_dir = TempPath("drain_more_" + c.name);
    auto prepared = PrepareTrain(t);
    ASSERT_TRUE(prepared.ok()) << c.name << ": " << prepared.status();
    const DrainedRun run = RunDrainedByRank3(**prepared, t, c.after);
    for (int rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(IsDrained(run.ends[rank])) << c.name << " rank " << rank << ": " << run.ends[rank];
      EXPECT_NE(run.ends[rank].message().find(absl::StrCat("stopped after step ", c.last, " for a drain")),
                std::string::npos)
          << c.name << " rank " << rank << ": " << run.ends[rank];
      EXPECT_EQ(run.reported[rank].size(), static_cast<size_t>(c.last)) << c.name << " rank " << rank;
    }
    EXPECT_EQ(std::distance(std::filesystem::directory_iterator(t.save_dir), std::filesystem::directory_iterator()), 1)
        << c.name << ": the drain's checkpoint alone";
    ASSERT_TRUE(std::filesystem::exists(StepDir(t.save_dir, c.last))) << c.name;
    TrainOptions resumed = t;
    resumed.resume_dir = t.save_dir;
    const std::vector<StepStats> rest = Losses(resumed);
    ASSERT_EQ(rest.size(), static_cast<size_t>(6 - c.last)) << c.name;
    for (size_t i = 0; i < rest.size(); ++i) {
      EXPECT_EQ(rest[i].loss, want[c.last + i].loss) << c.name << " step " << c.last + i + 1;
    }
  }
}

// Training on a Megatron-LM indexed dataset (uint16 tokens, one document
// per paragraph, each paragraph a sequence) holding exactly the text
// corpus's tokens gives the text run's losses bitwise, at tp=2: the same
// tokens in the same order make the same batches.
TEST(Trainer, AMegatronDatasetTrainsAsTheSameTokensDo) {
  const std::string model = TinyModel("train_megatron");
  TrainOptions text = Options(model, 2, 1);
  text.steps = 4;
  auto corpus = TokenCorpus::Open(kGplText);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const std::vector<int64_t> tokens = (*corpus)->Window(0, (*corpus)->size())->ToInt64s();
  testing::MegatronDataset m;
  std::vector<int64_t> paragraph;
  for (size_t i = 0; i < tokens.size(); ++i) {
    paragraph.push_back(tokens[i]);
    const bool blank_line = i >= 1 && tokens[i] == '\n' && tokens[i - 1] == '\n';
    if (blank_line || i + 1 == tokens.size()) {
      m.doc_bounds.push_back(static_cast<int64_t>(m.sequences.size()));
      m.sequences.push_back(std::move(paragraph));
      paragraph.clear();
    }
  }
  m.doc_bounds.push_back(static_cast<int64_t>(m.sequences.size()));
  ASSERT_GT(m.sequences.size(), 50u);
  const std::string prefix = TempPath("gpl_text_document");
  testing::WriteMegatronDataset(prefix, m);
  auto megatron = TokenCorpus::Open(prefix);
  ASSERT_TRUE(megatron.ok()) << megatron.status();
  EXPECT_EQ((*megatron)->documents().size(), m.sequences.size());
  TrainOptions from_megatron = text;
  from_megatron.data_path = prefix + ".bin";  // as Megatron's tools name it; the .idx beside it says the format
  const std::vector<StepStats> want = Losses(text), got = Losses(from_megatron);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i].loss, want[i].loss) << "step " << i + 1;
}

// A corpus holding an id outside the model's vocabulary: a .npy (held in
// memory) is refused before the first step; a .bin (read as batches need
// it) at the step that first draws the id, either way naming the file, the
// token's place and its id, not a bare "id at position" of the embedding.
TEST(Trainer, DataOutsideTheModelsVocabularyIsRefusedNamingTheToken) {
  const std::string model = TinyModel("train_oov");
  TrainOptions o = Options(model, 1, 1);
  o.steps = 3;
  std::vector<int64_t> ids(4096);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 200);
  ids[1000] = 300;  // the tiny model's vocabulary is 257 ids
  ASSERT_TRUE(WriteNpy(TempPath("oov_corpus.npy"), *Tensor::FromInt64s({4096}, ids)).ok());
  int steps = 0;
  o.data_path = TempPath("oov_corpus.npy");
  absl::Status s = Train(o, [&](const StepStats&) { ++steps; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "token 1000 of the corpus is id 300, outside the model's vocabulary"))
      << s;
  EXPECT_EQ(steps, 0);
  std::string bin;
  for (const int64_t id : ids) bin += testing::LittleEndian(static_cast<uint64_t>(id), 2);
  std::ofstream(TempPath("oov_corpus.bin"), std::ios::binary) << bin;
  o.data_path = TempPath("oov_corpus.bin");
  o.steps = 200;  // 200 steps of 8 x 32 tokens draw token 1000 (at random) long before the end
  s = Train(o, [&](const StepStats&) { ++steps; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "oov_corpus.bin: token 1000 of the corpus is id 300")) << s;
  EXPECT_LT(steps, 200);
}

// Text trains with the model directory's own tokenizer: the run on the
// GPL's text gives, bitwise, the losses of a run on a Megatron dataset of
// the same paragraphs encoded by that tokenizer, for a byte-level BPE
// (GPT-2's layout, a few merges) and a SentencePiece model that
// libsentencepiece trained on the text.
TEST(Trainer, TextTrainsWithTheModelDirectorysTokenizer) {
  std::string gpl;
  {
    std::ifstream in(kGplText, std::ios::binary);
    gpl.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The paragraphs, split here on their own: runs of non-blank lines.
  std::vector<std::string> paragraphs;
  {
    std::string current;
    std::istringstream lines(gpl);
    for (std::string line; std::getline(lines, line);) {
      if (line.find_first_not_of(" \t\r\v\f") == std::string::npos) {
        if (!current.empty()) paragraphs.push_back(current);
        current.clear();
      } else {
        current += (current.empty() ? "" : "\n") + line;
      }
    }
    if (!current.empty()) paragraphs.push_back(current);
  }
  ASSERT_GT(paragraphs.size(), 100u);
  for (const std::string kind : {"byte-level BPE", "sentencepiece"}) {
    SCOPED_TRACE(kind);
    const std::string dir_name = kind == "sentencepiece" ? "train_spm" : "train_bpe";
    shardformer::testing::TinyOptions tiny;
    tiny.vocab = kind == "sentencepiece" ? 400 : 260;
    tiny.positions = 32;
    auto m = shardformer::testing::WriteTinyGpt2(TempPath(dir_name), tiny);
    ASSERT_TRUE(m.ok()) << m.status();
    if (kind == "sentencepiece") {
      ASSERT_EQ(testing::TrainSentencePiece(m->dir + "/tokenizer", gpl,
                                            "--vocab_size=400 --model_type=bpe --byte_fallback=true "
                                            "--normalization_rule_name=identity --remove_extra_whitespaces=false"),
                "");
    } else {
      testing::WriteSmallGpt2Tokenizer(m->dir);
    }
    auto tok = LoadTokenizer(m->dir);
    ASSERT_TRUE(tok.ok()) << tok.status();
    ASSERT_EQ((*tok)->kind(), kind);
    testing::MegatronDataset want;
    size_t tokens = 0;
    for (const std::string& p : paragraphs) {
      auto ids = (*tok)->EncodeDocument(p);
      ASSERT_TRUE(ids.ok()) << ids.status();
      tokens += ids->size();
      want.doc_bounds.push_back(static_cast<int64_t>(want.sequences.size()));
      want.sequences.push_back(std::move(*ids));
    }
    want.doc_bounds.push_back(static_cast<int64_t>(want.sequences.size()));
    EXPECT_LT(tokens, gpl.size());  // merges happened: fewer tokens than bytes, even with an eos per paragraph
    const std::string prefix = TempPath(dir_name + "_document");
    testing::WriteMegatronDataset(prefix, want);
    TrainOptions text = Options(m->dir, 2, 1);
    text.steps = 3;
    TrainOptions megatron = text;
    megatron.data_path = prefix;
    const std::vector<StepStats> got = Losses(text), expected = Losses(megatron);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].loss, expected[i].loss) << "step " << i + 1;
  }
  // A tokenizer larger than the model's vocabulary is refused before training.
  const std::string small = TinyModel("train_small_vocab");
  std::ofstream(small + "/tokenizer.model", std::ios::binary) << testing::HandBuiltBpeModel();
  auto s = Train(Options(small, 1, 1), [](const StepStats&) {});
  EXPECT_TRUE(s.ok()) << s;  // 11 pieces fit 257
  shardformer::testing::TinyOptions few;
  few.vocab = 8;
  few.positions = 32;
  auto tiny = shardformer::testing::WriteTinyGpt2(TempPath("train_vocab8"), few);
  ASSERT_TRUE(tiny.ok());
  s = Train(Options(tiny->dir, 1, 1), [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("vocab_size of at least 257"), std::string::npos) << s;
  std::ofstream(tiny->dir + "/tokenizer.model", std::ios::binary) << testing::HandBuiltBpeModel();
  s = Train(Options(tiny->dir, 1, 1), [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("11 ids, over the model's vocab_size 8"), std::string::npos) << s;
}

TEST(Trainer, GradientAccumulationAndDeterminism) {
  const std::string model = TinyModel("train_accum");
  TrainOptions one = Options(model, 1, 2);
  one.steps = 4;
  const std::vector<StepStats> base = Losses(one);
  TrainOptions two = one;
  two.micro_batches = 2;  // 2 micro-batches of B/2 per step
  ExpectSameLosses(Losses(two), base, 1e-5, "2 micro-batches");
  // The same seed and layout reproduce the losses bitwise.
  const std::vector<StepStats> again = Losses(one);
  ASSERT_EQ(again.size(), base.size());
  for (size_t i = 0; i < base.size(); ++i) EXPECT_EQ(again[i].loss, base[i].loss) << i;
  // Another seed draws other batches.
  TrainOptions other = one;
  other.seed = 8;
  EXPECT_NE(Losses(other)[0].loss, base[0].loss);
}

TEST(Trainer, ClippingIsTheSameAcrossLayouts) {
  const std::string model = TinyModel("train_clip");
  TrainOptions tight = Options(model, 1, 1);
  tight.steps = 3;
  tight.clip_norm = 0.05;  // below every norm: each step is clipped
  const std::vector<StepStats> base = Losses(tight);
  for (const StepStats& s : base) EXPECT_GT(s.grad_norm, 0.05);
  TrainOptions sharded = tight;
  sharded.shard.layout.set_tensor_parallel_size(2);
  sharded.shard.layout.set_data_parallel_size(2);
  ExpectSameLosses(Losses(sharded), base, 1e-4, "clipped tp=2 dp=2");
  TrainOptions unclipped = tight;
  unclipped.clip_norm = 0;
  EXPECT_NE(Losses(unclipped)[2].loss, base[2].loss);
}

TEST(Trainer, AnInterruptedRunResumesWithTheSameLossesBitwise) {
  const std::string model = TinyModel("train_resume");
  TrainOptions full = Options(model, 2, 2);
  full.save_dir = TempPath("ck_full");
  full.save_every = 5;
  const std::vector<StepStats> want = Losses(full);
  ASSERT_EQ(want.size(), 10u);
  // Stopped after step 6 (a checkpoint every 5 steps; the stop saves its
  // own), then resumed from the stop's checkpoint.
  TrainOptions cut = full;
  cut.save_dir = TempPath("ck_cut");
  cut.stop_after = 6;
  const std::vector<StepStats> first = Losses(cut);
  ASSERT_EQ(first.size(), 6u);
  EXPECT_TRUE(std::filesystem::exists(TempPath("ck_cut") + "/step-000006"));
  TrainOptions resumed = full;
  resumed.save_dir = TempPath("ck_cut");
  resumed.resume_dir = TempPath("ck_cut");
  resumed.seed = 99;  // the checkpoint's seed wins: the sampler continues its stream
  const std::vector<StepStats> rest = Losses(resumed);
  ASSERT_EQ(rest.size(), 4u);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].step, static_cast<int64_t>(i + 7));
    EXPECT_EQ(rest[i].loss, want[i + 6].loss) << "step " << i + 7;
    EXPECT_EQ(rest[i].lr, want[i + 6].lr);
  }
  // Resumed at its last step (a restart after the last checkpoint): nothing
  // to train, the final model is written. Past it: refused, not "done".
  TrainOptions at_end = resumed;
  at_end.save_dir.clear();
  at_end.final_dir = TempPath("ck_at_end_final");
  EXPECT_TRUE(Losses(at_end).empty());
  EXPECT_TRUE(std::filesystem::exists(TempPath("ck_at_end_final") + "/config.json"));
  TrainOptions past = at_end;
  past.steps = 8;
  past.final_dir = TempPath("ck_past_final");
  const absl::Status refused = Train(past, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("is after step 10, past the run's last step 8"), std::string::npos) << refused;
  EXPECT_FALSE(std::filesystem::exists(TempPath("ck_past_final")));
  // A time-boxed run resumed at its stop trains no further.
  TrainOptions boxed = at_end;
  boxed.steps = 12;
  boxed.stop_after = 10;
  boxed.final_dir.clear();
  boxed.save_dir = TempPath("ck_cut");
  EXPECT_TRUE(Losses(boxed).empty());
  // A checkpoint cut short mid-write, and a crashed attempt's temporary
  // directory: the previous complete one is used.
  const std::string damaged = TempPath("ck_full") + "/step-000010/rank-00001-of-00004.safetensors";
  std::filesystem::resize_file(damaged, std::filesystem::file_size(damaged) - 100);
  std::filesystem::create_directories(TempPath("ck_full") + "/step-000015.tmp");
  // And a newer one whose state file has the wrong types: skipped, not an
  // exception out of the worker.
  std::filesystem::create_directories(TempPath("ck_full") + "/step-000012");
  std::filesystem::copy_file(TempPath("ck_full") + "/step-000005/colod_checkpoint.json",
                             TempPath("ck_full") + "/step-000012/colod_checkpoint.json");
  std::ofstream(TempPath("ck_full") + "/step-000012/train_state.json")
      << R"({"step": 12, "world_size": "four", "seed": 7})";
  std::vector<std::string> skipped;
  auto latest = LatestCheckpoint(TempPath("ck_full"), &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, TempPath("ck_full") + "/step-000005");
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[0].find("world_size is not an integer"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find("rank-00001-of-00004"), std::string::npos) << skipped[1];
  std::filesystem::remove_all(TempPath("ck_full") + "/step-000012");
  TrainOptions again = full;
  again.save_dir.clear();
  again.resume_dir = TempPath("ck_full");
  const std::vector<StepStats> redo = Losses(again);
  ASSERT_EQ(redo.size(), 5u);
  for (size_t i = 0; i < redo.size(); ++i) EXPECT_EQ(redo[i].loss, want[i + 5].loss) << "step " << i + 6;
  // A checkpoint named itself is the one resumed from; a damaged one named
  // so is an error, not another checkpoint.
  TrainOptions chosen = again;
  chosen.resume_dir = TempPath("ck_full") + "/step-000005";
  const std::vector<StepStats> from_five = Losses(chosen);
  ASSERT_EQ(from_five.size(), 5u);
  EXPECT_EQ(from_five[0].loss, want[5].loss);
  chosen.resume_dir = TempPath("ck_full") + "/step-000010";
  const absl::Status damaged_named = Train(chosen, nullptr);
  EXPECT_EQ(damaged_named.code(), absl::StatusCode::kFailedPrecondition) << damaged_named;
  EXPECT_NE(damaged_named.message().find("is damaged"), std::string::npos) << damaged_named;
  // Another layout cannot resume it; no checkpoint at all is NOT_FOUND.
  TrainOptions other = again;
  other.shard.layout.set_tensor_parallel_size(1);
  EXPECT_EQ(Train(other, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  other.resume_dir = TempPath("ck_none");
  EXPECT_EQ(Train(other, nullptr).code(), absl::StatusCode::kNotFound);
  // Nor another model: a layer fewer (before, it resumed, dropping the
  // checkpoint's second layer without a word).
  const std::string shallow = TempPath("train_resume_shallow");
  std::filesystem::copy(model, shallow, std::filesystem::copy_options::recursive);
  auto config = ReadFileToString(shallow + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  const size_t at = config->find("\"n_layer\": 2");
  ASSERT_NE(at, std::string::npos) << *config;
  std::ofstream(shallow + "/config.json", std::ios::trunc) << config->replace(at, 12, "\"n_layer\": 1");
  TrainOptions another = again;
  another.model_dir = shallow;
  const absl::Status refused_model = Train(another, nullptr);
  EXPECT_EQ(refused_model.code(), absl::StatusCode::kFailedPrecondition) << refused_model;
  EXPECT_NE(refused_model.message().find("is of another model than"), std::string::npos) << refused_model;
  EXPECT_NE(refused_model.message().find("num_layers 2, not 1"), std::string::npos) << refused_model;
}

// A run that leaves its precision to the device (a job spec without one:
// bf16 on a GPU, fp32 on a CPU) resumes a checkpoint at the checkpoint's
// precision, so that a job restarted on workers of the other kind goes on
// with the uninterrupted run's losses (the copy of the first parameter
// failed, INVALID_ARGUMENT, and the job with it for good). A run that names
// another precision is refused, saying which.
TEST(Trainer, AResumeAtTheDevicesPrecisionTakesTheCheckpoints) {
  const std::string model = TinyModel("train_resume_precision");
  for (const DType trained : {DType::kBF16, DType::kF32}) {
    const DType other = trained == DType::kF32 ? DType::kBF16 : DType::kF32;
    SCOPED_TRACE(absl::StrCat("trained at ", DTypeName(trained)));
    TrainOptions full = Options(model, 1, 2);
    full.shard.param_dtype = trained;
    full.steps = 6;
    const std::vector<StepStats> want = Losses(full);
    ASSERT_EQ(want.size(), 6u);
    TrainOptions cut = full;
    cut.save_dir = TempPath(absl::StrCat("ck_precision_", DTypeName(trained)));
    cut.stop_after = 3;
    ASSERT_EQ(Losses(cut).size(), 3u);
    TrainOptions resumed = full;
    resumed.resume_dir = cut.save_dir;
    resumed.shard.param_dtype = other;  // the other device kind's default ...
    resumed.precision_auto = true;      // ... which the job did not choose
    const std::vector<StepStats> rest = Losses(resumed);
    ASSERT_EQ(rest.size(), 3u);
    for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].loss, want[i + 3].loss) << "step " << i + 4;
    EXPECT_EQ(rest[0].param_bytes, want[0].param_bytes);  // at the checkpoint's dtype
    // ... which the rank says it trains at (the job's MFU divides by that
    // precision's peak).
    std::vector<DType> started;
    ASSERT_TRUE(Train(resumed, nullptr, [&](const RankStart& s) { started.push_back(s.param_dtype); }).ok());
    ASSERT_FALSE(started.empty());
    for (DType d : started) EXPECT_EQ(d, trained);
    resumed.precision_auto = false;                       // named
    const absl::Status refused = Train(resumed, nullptr);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_TRUE(absl::StrContains(
        refused.message(), absl::StrCat("was trained at precision ", trained == DType::kF32 ? "fp32" : "bf16 mixed",
                                        ", this run asks for ", other == DType::kF32 ? "fp32" : "bf16 mixed")))
        << refused;
  }
}

TEST(Trainer, MixedPrecisionTracksTheF32RunWithF32MasterWeights) {
  const std::string model = TinyModel("train_bf16");
  const std::vector<StepStats> f32 = Losses(Options(model, 2, 2));
  TrainOptions mixed = Options(model, 2, 2);
  mixed.shard.param_dtype = DType::kBF16;
  const std::vector<StepStats> bf16 = Losses(mixed);
  ASSERT_EQ(bf16.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    // bf16 keeps 8 bits of mantissa: the losses stay within a few percent.
    EXPECT_NEAR(bf16[i].loss, f32[i].loss, 0.03 * f32[i].loss) << "step " << i + 1;
  }
  EXPECT_LT(bf16.back().loss, bf16[0].loss - 0.5);
  // Parameters and gradients take half the bytes; the optimizer holds f32
  // moments and f32 master weights.
  EXPECT_EQ(bf16[0].param_bytes * 2, f32[0].param_bytes);
  EXPECT_EQ(bf16[0].grad_bytes * 2, f32[0].grad_bytes);
  EXPECT_EQ(bf16[0].optimizer_bytes, f32[0].optimizer_bytes * 3 / 2);
  // The admission floor (what the coordinator and the worker refuse by)
  // holds what a rank holds: the same parameter, gradient and optimizer
  // bytes, and a step's activations on top (plan_test measures those).
  auto config = shardformer::LoadConfig(model);
  ASSERT_TRUE(config.ok()) << config.status();
  // Its final model is bf16 (the parameters it trained, not widened), or
  // F32 where the run asks (TrainConfig.final_dtype, through the spec): its
  // f32 master weights, of which the bf16 parameters are the rounding, with
  // ZeRO too (each dp rank holds a slice of them); F16 is those rounded
  // once, not the bf16 parameters converted.
  for (const int zero : {0, 2}) {
    const auto final_dir = [&](std::optional<DType> dtype) {
      return TempPath(absl::StrCat("train_bf16_zero", zero, "_final_", dtype ? DTypeName(*dtype) : "auto"));
    };
    for (const std::optional<DType> want :
         {std::optional<DType>(), std::optional<DType>(DType::kF32), std::optional<DType>(DType::kF16)}) {
      TrainOptions o = mixed;
      o.steps = 1;
      o.warmup_steps = 0;  // an update the master weights hold
      o.zero_stage = zero;
      o.final_dir = final_dir(want);
      o.final_dtype = want;
      v1::JobSpec spec = SpecFromTrainOptions(o);
      EXPECT_EQ(spec.train().final_dtype(), !want ? "" : *want == DType::kF32 ? "f32" : "f16");
      auto from_spec = TrainOptionsFromSpec(spec, model, /*cuda=*/false);
      ASSERT_TRUE(from_spec.ok()) << from_spec.status();
      EXPECT_EQ(from_spec->final_dtype, want);
      o.final_dtype = from_spec->final_dtype;
      ASSERT_EQ(Losses(o).size(), 1u);
      auto files = shardformer::ModelFiles::Open(o.final_dir);
      ASSERT_TRUE(files.ok()) << files.status();
      auto wte = (*files)->Read("transformer.wte.weight");
      ASSERT_TRUE(wte.ok()) << wte.status();
      EXPECT_EQ(wte->dtype(), want.value_or(DType::kBF16));
      auto config_json = ReadFileToString(o.final_dir + "/config.json");
      ASSERT_TRUE(config_json.ok()) << config_json.status();
      const char* torch_dtype = !want ? "bfloat16" : *want == DType::kF32 ? "float32" : "float16";
      EXPECT_TRUE(absl::StrContains(*config_json, absl::StrCat(R"("torch_dtype": ")", torch_dtype, "\"")))
          << *config_json;
    }
    auto trained = shardformer::ModelFiles::Open(final_dir(std::nullopt));
    auto masters = shardformer::ModelFiles::Open(final_dir(DType::kF32));
    auto half = shardformer::ModelFiles::Open(final_dir(DType::kF16));
    ASSERT_TRUE(trained.ok() && masters.ok() && half.ok());
    int64_t elements = 0, finer = 0, finer_f16 = 0;
    const auto as = [](const Tensor& t, DType dtype) {
      absl::StatusOr<Tensor> to = t.ToDType(dtype);
      EXPECT_TRUE(to.ok()) << to.status();
      return to.ok() ? *to : Tensor();
    };
    const auto same = [](const Tensor& a, const Tensor& b) {
      return a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
    };
    for (const std::string& name : (*trained)->Names()) {
      auto bf16_weights = (*trained)->Read(name);
      auto f32_weights = (*masters)->Read(name);
      auto f16_weights = (*half)->Read(name);
      ASSERT_TRUE(bf16_weights.ok() && f32_weights.ok() && f16_weights.ok()) << name;
      ASSERT_EQ(f32_weights->dtype(), DType::kF32) << name;
      EXPECT_TRUE(same(as(*f32_weights, DType::kBF16), *bf16_weights))
          << name << ": the bf16 parameters are the master weights' rounding (ZeRO " << zero << ")";
      EXPECT_TRUE(same(as(*f32_weights, DType::kF16), *f16_weights))
          << name << ": the f16 model is the master weights rounded once (ZeRO " << zero << ")";
      const Tensor wide = as(*bf16_weights, DType::kF32);
      const Tensor twice = as(*bf16_weights, DType::kF16);
      for (int64_t i = 0; i < f32_weights->numel(); ++i) {
        finer += f32_weights->data<float>()[i] != wide.data<float>()[i];
        finer_f16 += f16_weights->data<uint16_t>()[i] != twice.data<uint16_t>()[i];
      }
      elements += f32_weights->numel();
    }
    // One AdamW step moves each weight by about lr, far below bf16's step
    // near 1: most master weights lie between two bf16 values, and f16
    // keeps 3 bits more of them.
    EXPECT_GT(finer, elements / 2) << "ZeRO " << zero << ": the f32 model is not the bf16 one widened";
    EXPECT_GT(finer_f16, elements / 2) << "ZeRO " << zero << ": the f16 model is not the bf16 one converted";
  }
  for (const auto& [options, stats] : {std::pair(Options(model, 2, 2), f32[0]), std::pair(mixed, bf16[0])}) {
    auto floor = MemoryFloorPerRank(*config, SpecFromTrainOptions(options));
    ASSERT_TRUE(floor.ok()) << floor.status();
    EXPECT_EQ(floor->param_bytes, stats.param_bytes);
    EXPECT_EQ(floor->grad_bytes, stats.grad_bytes);
    EXPECT_EQ(floor->optimizer_bytes, stats.optimizer_bytes);
    EXPECT_GT(floor->activation_bytes, 0);
    EXPECT_EQ(floor->total_bytes,
              stats.param_bytes + stats.grad_bytes + stats.optimizer_bytes + floor->activation_bytes);
  }
}

// One GPU (f32 and bf16) and pipeline stages on two, against the CPU run,
// 5 steps each. The multi-device layouts beyond have tests of their own:
// tp2 x dp2 and tp2 x pp2 through coloctl (tests/gpu_cli_test.cc), 2D for
// every family (cuda_families_test), each family's stages
// (pipeline_families_test).
// fp16 mixed precision (f16's 10-bit mantissa, its range ending at 6e-8)
// with its loss scaled: at tp2 x dp2 and with pipeline stages (whose last
// stage seeds the scaled backward) the losses track the f32 run's within
// 1 %, and the first step's gradient norm (before any update) is the f32
// one's within 0.5 % (the scale is taken out of it: 65536 times off
// otherwise). Every step updates at GradScaler's 65536 (its window of 2000
// is not reached).
TEST(Trainer, Fp16ScalesItsLossAndTracksTheF32Run) {
  const std::string model = TinyModel("train_fp16");
  const std::vector<StepStats> f32 = Losses(Options(model, 2, 2));
  TrainOptions half = Options(model, 2, 2);
  half.shard.param_dtype = DType::kF16;
  const std::vector<StepStats> fp16 = Losses(half);
  ASSERT_EQ(fp16.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    EXPECT_NEAR(fp16[i].loss, f32[i].loss, 0.01 * f32[i].loss) << "step " << i + 1;
    EXPECT_EQ(fp16[i].loss_scale, LossScaler::kDefaultInitial) << "step " << i + 1;
    EXPECT_FALSE(fp16[i].update_skipped) << "step " << i + 1;
    EXPECT_EQ(f32[i].loss_scale, 0);  // (f32 scales nothing)
  }
  EXPECT_LT(fp16.back().loss, fp16[0].loss - 0.5);
  EXPECT_EQ(fp16[0].param_bytes * 2, f32[0].param_bytes);
  EXPECT_NEAR(fp16[0].grad_norm, f32[0].grad_norm, 5e-3 * f32[0].grad_norm);
  TrainOptions stages = half;
  stages.shard.layout.set_tensor_parallel_size(1);
  stages.shard.layout.set_pipeline_parallel_size(2);
  stages.micro_batches = 2;
  const std::vector<StepStats> piped = Losses(stages);
  ASSERT_EQ(piped.size(), f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    EXPECT_NEAR(piped[i].loss, f32[i].loss, 0.01 * f32[i].loss) << "pp 2 step " << i + 1;
    EXPECT_EQ(piped[i].loss_scale, LossScaler::kDefaultInitial);
  }
}

// A failed run's sharded copy in final_dir/.sharded (its index, which the
// failure's message named to consolidate) does not stay standing over the
// files of a later run's save there that fails midway (rank 1 cannot write
// its file; rank 0 wrote its own): the later run removes the index first.
TEST(Trainer, AFinalModelsSaveRemovesAnEarlierRunsShardedIndexFirst) {
  const std::string model = TinyModel("final_sharded");
  TrainOptions o = Options(model, 2, 1);
  o.steps = 1;
  o.final_dir = TempPath("final_sharded_out");
  const std::string sharded = o.final_dir + "/.sharded";
  std::filesystem::create_directories(sharded + "/rank-00001-of-00002.safetensors");  // a directory: not written
  std::ofstream(sharded + "/" + shardformer::kCheckpointIndex) << "{\"an earlier run's\": true}";
  const absl::Status s = Train(o, [](const StepStats&) {});
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(std::filesystem::exists(sharded + "/rank-00000-of-00002.safetensors")) << "rank 0 wrote its file";
  EXPECT_FALSE(std::filesystem::exists(sharded + "/" + shardformer::kCheckpointIndex))
      << "an index over a mix of two runs' files";
}

// fp16 with its loss scaled beyond GPT-2, each family's own loss seeding
// the scaled backward: BERT (its masked positions), BLOOM (ALiBi), ViT
// (images and a classifier) and T5 (an encoder-decoder, padded targets) at
// tp 2. At a scale of 1024 every step updates and the run tracks its f32
// run within 2 % over 4 steps, the first step's gradient norm the f32 one's
// within 1 % (unscaled: 1024 times off otherwise). At GradScaler's 65536
// the first gradients of BERT, ViT and T5 here (norms of 25 to 35)
// overflow f16: a run's first steps update nothing, each halving the
// scale, until one does, and it goes on from there.
TEST(Trainer, Fp16TracksTheF32RunOfEveryFamily) {
  shardformer::testing::TinyOptions byte_level = testing::TinyByteLevel();
  std::vector<std::pair<std::string, TrainOptions>> runs;
  auto bert = shardformer::testing::WriteTinyBert(TempPath("fp16_bert"), byte_level);
  ASSERT_TRUE(bert.ok()) << bert.status();
  runs.emplace_back("bert", testing::SmallRun(bert->dir, 2, 1, 4));
  auto bloom = shardformer::testing::WriteTinyBloom(TempPath("fp16_bloom"), byte_level);
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  runs.emplace_back("bloom", testing::SmallRun(bloom->dir, 2, 1, 4));
  shardformer::testing::TinyOptions vit_options;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("fp16_vit"), vit_options);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const testing::ImageSet images = testing::WriteImages("fp16_vit", vit_options);
  runs.emplace_back("vit",
                    testing::OnExamples(testing::SmallRun(vit->dir, 2, 1, 4), images.images_path, images.labels_path));
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("fp16_t5"), byte_level);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const testing::PairSet pairs = testing::WritePairs("fp16_t5", t5->config.vocab_size);
  runs.emplace_back("t5",
                    testing::OnExamples(testing::SmallRun(t5->dir, 2, 1, 4), pairs.inputs_path, pairs.targets_path));
  int overflowed = 0;  // families whose first step overflowed at 65536
  for (const auto& [family, run] : runs) {
    const std::vector<StepStats> f32 = Losses(run);
    TrainOptions half = run;
    half.shard.param_dtype = DType::kF16;
    half.loss_scale = 1024;
    const std::vector<StepStats> fp16 = Losses(half);
    ASSERT_EQ(f32.size(), 4u) << family;
    ASSERT_EQ(fp16.size(), f32.size()) << family;
    for (size_t i = 0; i < f32.size(); ++i) {
      EXPECT_NEAR(fp16[i].loss, f32[i].loss, 0.02 * f32[i].loss) << family << " step " << i + 1;
      EXPECT_EQ(fp16[i].loss_scale, 1024) << family << " step " << i + 1;
      EXPECT_FALSE(fp16[i].update_skipped) << family << " step " << i + 1;
    }
    EXPECT_NEAR(fp16[0].grad_norm, f32[0].grad_norm, 0.01 * f32[0].grad_norm) << family;
    half.loss_scale = LossScaler::kDefaultInitial;
    const std::vector<StepStats> scaled = Losses(half);
    ASSERT_EQ(scaled.size(), f32.size()) << family;
    double scale = LossScaler::kDefaultInitial;
    bool updated = false;  // a step updated: no later one overflows here
    for (const StepStats& st : scaled) {
      EXPECT_EQ(st.loss_scale, scale) << family << " step " << st.step;
      EXPECT_FALSE(updated && st.update_skipped) << family << " step " << st.step;
      EXPECT_TRUE(std::isfinite(st.loss)) << family << " step " << st.step;
      if (st.update_skipped) scale /= 2;
      updated = updated || !st.update_skipped;
    }
    EXPECT_TRUE(updated) << family;
    overflowed += scaled[0].update_skipped ? 1 : 0;
  }
  EXPECT_GE(overflowed, 3) << "the halving above was not exercised";
}

// A loss scale too large for f16 (2^24 times a gradient of 1e-2 is past
// its 65504): each step whose gradients overflow is reported with a norm
// that is not finite, updates nothing and halves the scale; two steps in a
// row that do not (a window of 2) double it: GradScaler's rule, replayed
// from what the run reported. A skipped step changes no weight: a run whose
// one step overflowed saves the model it loaded (rounded to f16). A resume
// goes on from its checkpoint's scale, with the whole run's losses and
// scales bitwise (at the options' 2^24 it would overflow again). Under
// ZeRO 1 (a skipped step gathers no weights) with 2 accumulation passes.
TEST(Trainer, Fp16StepsThatOverflowUpdateNothingAndHalveTheScale) {
  const std::string model = TinyModel("train_fp16_overflow");
  TrainOptions o = Options(model, 1, 2);
  o.shard.param_dtype = DType::kF16;
  o.zero_stage = 1;
  o.grad_accum = 2;
  o.loss_scale = LossScaler::kMax;
  o.loss_scale_window = 2;
  o.steps = 12;
  o.save_dir = TempPath("fp16_overflow_ck");
  o.save_every = 6;
  const std::vector<StepStats> steps = Losses(o);
  ASSERT_EQ(steps.size(), 12u);
  ASSERT_TRUE(steps[0].update_skipped);
  double scale = LossScaler::kMax;
  int good = 0, updates = 0, doublings = 0;
  for (const StepStats& s : steps) {
    EXPECT_EQ(s.loss_scale, scale) << "step " << s.step;
    EXPECT_EQ(s.update_skipped, !std::isfinite(s.grad_norm)) << "step " << s.step;
    EXPECT_TRUE(std::isfinite(s.loss)) << "step " << s.step;
    if (s.update_skipped) {
      scale /= 2;
      good = 0;
    } else if (++updates, ++good == 2) {
      scale = std::min(scale * 2, LossScaler::kMax);
      good = 0;
      ++doublings;
    }
  }
  EXPECT_GE(updates, 3);
  EXPECT_GE(doublings, 1);
  // The checkpoint records the scale its next step starts from; one that is
  // not a scale makes a damaged checkpoint.
  const absl::StatusOr<Resumed> state = ReadTrainState(StepDir(o.save_dir, 6));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->loss_scale, steps[6].loss_scale);
  const std::string damaged = StepDir(TempPath("fp16_damaged_ck"), 6);
  std::filesystem::create_directories(damaged);
  std::ofstream(damaged + "/train_state.json")
      << R"({"step": 6, "seed": 7, "loss_scale": {"scale": 3, "good_steps": 0}})";
  const absl::Status bad = ReadTrainState(damaged).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("loss_scale: 3 is not a power of two"), std::string::npos) << bad;
  // Resumed from step 6's checkpoint (a scale other than the options').
  TrainOptions resumed = o;
  resumed.save_dir.clear();
  resumed.resume_dir = StepDir(o.save_dir, 6);
  const std::vector<StepStats> rest = Losses(resumed);
  ASSERT_EQ(rest.size(), 6u);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].loss, steps[i + 6].loss) << "step " << i + 7;
    EXPECT_EQ(rest[i].loss_scale, steps[i + 6].loss_scale) << "step " << i + 7;
    EXPECT_EQ(rest[i].update_skipped, steps[i + 6].update_skipped) << "step " << i + 7;
  }
  // One step, which overflows: the saved model is the loaded one in f16.
  TrainOptions skipped = o;
  skipped.steps = 1;
  skipped.save_dir.clear();
  skipped.final_dir = TempPath("fp16_overflow_final");
  const std::vector<StepStats> first = Losses(skipped);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_TRUE(first[0].update_skipped);
  auto loaded = shardformer::ModelFiles::Open(model);
  auto saved = shardformer::ModelFiles::Open(skipped.final_dir);
  ASSERT_TRUE(loaded.ok() && saved.ok());
  for (const std::string& name : (*saved)->Names()) {
    const absl::StatusOr<Tensor> was = (*loaded)->Read(name);
    const absl::StatusOr<Tensor> is = (*saved)->Read(name);
    ASSERT_TRUE(was.ok() && is.ok()) << name;
    EXPECT_EQ(is->dtype(), DType::kF16) << name;
    EXPECT_EQ(is->ToBytes(), was->ToDType(DType::kF16)->ToBytes()) << name;
  }
}

TEST(Trainer, OnGpusTheRunMatchesTheCpuRun) {
  const int gpus = kernels::CudaDeviceCount();
  if (gpus < 1) GTEST_SKIP() << "no CUDA device";
  const std::string model = TinyModel("train_gpu");
  TrainOptions on_cpu = Options(model, 1, 1);
  on_cpu.steps = 5;
  on_cpu.final_dir = TempPath("gpu_vs_cpu_final_cpu");
  const std::vector<StepStats> cpu = Losses(on_cpu);
  TrainOptions one = on_cpu;
  one.cuda = true;
  // On a device the tied head computes its 257 columns padded to 320 (for
  // cuBLAS); the run, and the model it saves, are the CPU's.
  one.final_dir = TempPath("gpu_vs_cpu_final_gpu");
  ExpectSameLosses(Losses(one), cpu, 1e-4, "1 GPU");
  {
    ASSERT_NO_FATAL_FAILURE(ExpectSameModels(on_cpu.final_dir, one.final_dir));
    auto b = shardformer::ModelFiles::Open(one.final_dir);
    ASSERT_TRUE(b.ok()) << b.status();
    auto wte = (*b)->Read("transformer.wte.weight");
    ASSERT_TRUE(wte.ok()) << wte.status();
    EXPECT_EQ(wte->shape()[0], kByteVocab);
  }
  TrainOptions bf16 = one;
  bf16.final_dir.clear();
  bf16.shard.param_dtype = DType::kBF16;
  const std::vector<StepStats> mixed = Losses(bf16);
  ASSERT_EQ(mixed.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(mixed[i].loss, cpu[i].loss, 0.03 * cpu[i].loss) << i;
  // fp16, its loss scaled (the norm read before each update).
  TrainOptions fp16 = bf16;
  fp16.shard.param_dtype = DType::kF16;
  const std::vector<StepStats> half = Losses(fp16);
  ASSERT_EQ(half.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_NEAR(half[i].loss, cpu[i].loss, 0.01 * cpu[i].loss) << i;
    EXPECT_EQ(half[i].loss_scale, LossScaler::kDefaultInitial) << i;
    EXPECT_FALSE(half[i].update_skipped) << i;
  }
  if (gpus < 2) return;
  // Pipeline stages over NCCL send/recv (one-way channels, each its own
  // stream), with the tied table's gradient summed across the stages.
  TrainOptions stages = one;
  stages.final_dir.clear();
  stages.shard.layout.set_pipeline_parallel_size(2);
  stages.micro_batches = 2;
  ExpectSameLosses(Losses(stages), cpu, 1e-4, "pp=2 on 2 GPUs");
}

// A learning rate of 1e30 sends the weights to 1e30 after the first step
// and the activations past f32's range at the next: the run ends with
// FAILED_PRECONDITION at its first step whose loss or gradient norm is not
// finite, on every rank together (tp2 x dp2, in well under the collectives'
// timeout), and on a CUDA device, whose steps are read a step late. The
// error names that step; it and the steps after it are neither reported,
// checkpointed nor saved as the final model, while each step before it was
// reported, finite, with its checkpoint.
TEST(Trainer, ADivergingRunEndsAtItsFirstStepThatIsNotFiniteAndSavesNothingOfIt) {
  const std::string model = TinyModel("train_diverge");
  for (const bool cuda : {false, true}) {
    if (cuda && kernels::CudaDeviceCount() < 1) continue;
    const std::string name = cuda ? "diverge_gpu" : "diverge_cpu";
    TrainOptions o = cuda ? Options(model, 1, 1) : Options(model, 2, 2);
    o.cuda = cuda;
    o.steps = 6;
    o.lr = 1e30;
    o.warmup_steps = 0;
    o.clip_norm = 0;
    o.save_dir = TempPath(name + "_ck");
    o.save_every = 1;
    o.final_dir = TempPath(name + "_final");
    o.comm_timeout = absl::Seconds(60);
    std::vector<StepStats> steps;
    const absl::Time start = absl::Now();
    const absl::Status s = Train(o, [&](const StepStats& st) { steps.push_back(st); });
    EXPECT_LT(absl::Now() - start, absl::Seconds(45)) << name << ": a rank waited for the others";
    ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << name << ": " << s;
    const int64_t diverged = static_cast<int64_t>(steps.size()) + 1;
    EXPECT_NE(s.message().find(absl::StrCat("training diverged at step ", diverged, ": its loss is ")),
              std::string::npos) << name << ": " << s.message();
    EXPECT_NE(s.message().find("lower learning rate"), std::string::npos) << s.message();
    EXPECT_GE(diverged, 2) << name << ": the first step trains the initial weights";
    EXPECT_LT(diverged, o.steps) << name;
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i].step, static_cast<int64_t>(i) + 1) << name;
      EXPECT_TRUE(std::isfinite(steps[i].loss) && std::isfinite(steps[i].grad_norm)) << name << " step " << i + 1;
      EXPECT_EQ(steps[i].checkpoint, StepDir(o.save_dir, steps[i].step)) << name;
    }
    EXPECT_FALSE(std::filesystem::exists(StepDir(o.save_dir, diverged))) << name;
    EXPECT_FALSE(std::filesystem::exists(o.final_dir)) << name;
    absl::StatusOr<std::string> newest = LatestCheckpoint(o.save_dir);
    ASSERT_TRUE(newest.ok()) << newest.status();
    EXPECT_EQ(*newest, StepDir(o.save_dir, diverged - 1)) << name;
  }
}

// A run writes its final model only where no other model is: its own
// model directory, another run's final model or a path under a file are
// refused before the first step; a restart of the job that wrote one
// writes it again. A time-boxed run whose stop is its last step is whole
// and writes it; an evaluation writes none.
TEST(Trainer, AFinalModelIsWrittenOnlyWhereNoOtherModelIs) {
  const std::string model = TinyModel("train_final");
  TrainOptions o = Options(model, 1, 1);
  o.steps = 2;
  o.job = "job-000042";
  o.generation = 1;
  auto refused_before_training = [&](const TrainOptions& t, absl::string_view why) {
    int reported = 0;
    const absl::Status s = Train(t, [&](const StepStats&) { ++reported; });
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(why), std::string::npos) << s;
    EXPECT_EQ(reported, 0) << s;
  };
  o.final_dir = model;  // the model it trains
  refused_before_training(o, "already holds a model (config.json)");
  std::ofstream(TempPath("train_final_a_file")) << "x";
  o.final_dir = TempPath("train_final_a_file") + "/final";
  refused_before_training(o, "is not a directory");
  // Whole at its stop: written, with the job that wrote it.
  o.final_dir = TempPath("train_final_out");
  o.stop_after = o.steps;
  ASSERT_EQ(Losses(o).size(), 2u);
  ASSERT_TRUE(std::filesystem::exists(o.final_dir + "/model.safetensors"));
  auto writer = ReadFileToString(absl::StrCat(o.final_dir, "/", kFinalWriterFile));
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ(*writer, "job-000042");
  // The same job again (a restart after the write): written over.
  o.generation = 2;
  EXPECT_EQ(Losses(o).size(), 2u);
  // Another job, or a run outside a coordinator: refused, the model left.
  TrainOptions other = o;
  other.job = "job-000043";
  refused_before_training(other, "already holds a model");
  other.job.clear();
  refused_before_training(other, "already holds a model");
  // Another model's index beside: refused (the index would be loaded).
  std::filesystem::create_directories(TempPath("train_final_index"));
  std::ofstream(TempPath("train_final_index") + "/model.safetensors.index.json") << "{}";
  other.final_dir = TempPath("train_final_index");
  refused_before_training(other, "(model.safetensors.index.json)");
  // A relative directory that does not exist yet is made where the run
  // runs (it was refused: the nearest existing directory above "out" was
  // looked for among its parents, which it has none of).
  {
    char* was = ::getcwd(nullptr, 0);
    ASSERT_NE(was, nullptr);
    std::filesystem::create_directories(TempPath("train_final_cwd"));
    ASSERT_EQ(::chdir(TempPath("train_final_cwd").c_str()), 0);
    TrainOptions relative = Options(model, 1, 1);
    relative.steps = 1;
    relative.final_dir = "out/model";
    const absl::Status written = Train(relative, nullptr);
    EXPECT_EQ(::chdir(was), 0);
    std::free(was);
    EXPECT_TRUE(written.ok()) << written;
    EXPECT_TRUE(std::filesystem::exists(TempPath("train_final_cwd") + "/out/model/model.safetensors"));
  }
  // Time-boxed (stopping before the last step): no model written, the
  // stop's checkpoint saved.
  TrainOptions boxed = Options(model, 1, 1);
  boxed.steps = 3;
  boxed.stop_after = 2;
  boxed.final_dir = TempPath("train_final_boxed");
  boxed.save_dir = TempPath("train_final_boxed_ck");
  EXPECT_EQ(Losses(boxed).size(), 2u);
  EXPECT_FALSE(std::filesystem::exists(boxed.final_dir + "/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(boxed.save_dir + "/step-000002/train_state.json"));
  TrainOptions eval = Options(model, 1, 1);
  eval.eval_split = 0.1;
  eval.eval_only = true;
  eval.final_dir = TempPath("train_final_eval");
  EXPECT_EQ(Train(eval, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// A checkpoint keeps rank 0's report of its step, and a restart of the job
// that wrote it hands that report to its start (RankStart::checkpoint_step),
// to be reported again: the report may have died with the worker that
// wrote the checkpoint, and the restart begins after the step. A run
// resuming another job's checkpoint gets none (that step is not its own).
TEST(Trainer, ARestartHandsOnTheReportOfItsCheckpointsStep) {
  const std::string model = TinyModel("train_report");
  TrainOptions o = Options(model, 1, 1);
  o.steps = 4;
  o.save_dir = TempPath("ck_report");
  o.save_every = 2;
  o.eval_split = 0.1;
  o.eval_every = 2;
  o.job = "job-000042";
  o.generation = 1;
  const std::vector<StepStats> steps = Losses(o);
  ASSERT_EQ(steps.size(), 4u);
  ASSERT_TRUE(steps[1].eval.has_value());
  std::filesystem::remove_all(StepDir(o.save_dir, 4));  // the restart resumes after step 2
  const auto started = [](const TrainOptions& t) {
    std::optional<RankStart> got;
    auto run = PrepareTrain(t);
    EXPECT_TRUE(run.ok()) << run.status();
    if (!run.ok()) return got;
    RankHooks hooks;
    hooks.on_start = [&](const RankStart& s) { got = s; };
    const absl::Status ran = shardformer::RunOnLocalRanks(
        t.shard, t.cuda,
        [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
          return RunTrainRank(**run, rank, pg, shard, hooks);
        },
        t.comm_timeout);
    EXPECT_TRUE(ran.ok()) << ran;
    return got;
  };
  TrainOptions restart = o;
  restart.generation = 2;
  restart.resume_dir = o.save_dir;
  const std::optional<RankStart> again = started(restart);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->step, 2);
  ASSERT_TRUE(again->checkpoint_step.has_value());
  // As rank 0 reported it then (StepProgressOf), in the checkpoint's name.
  const v1::StepProgress& s = *again->checkpoint_step;
  EXPECT_EQ(s.step(), 2);
  EXPECT_EQ(s.loss(), steps[1].loss);
  EXPECT_EQ(s.learning_rate(), steps[1].lr);
  EXPECT_EQ(s.grad_norm(), steps[1].grad_norm);
  EXPECT_EQ(s.tokens(), steps[1].step_tokens);
  EXPECT_EQ(s.tokens_per_second(), steps[1].tokens_per_second);
  EXPECT_EQ(s.param_bytes(), steps[1].param_bytes);
  EXPECT_EQ(s.checkpoint(), StepDir(o.save_dir, 2));
  EXPECT_EQ(s.checkpoints_size(), 0);
  ASSERT_TRUE(s.has_eval());
  EXPECT_EQ(s.eval().loss(), steps[1].eval->loss);
  EXPECT_EQ(s.eval().tokens(), steps[1].eval->tokens);
  EXPECT_EQ(s.eval().checkpoint(), StepDir(o.save_dir, 2));
  EXPECT_TRUE(again->skipped.empty());
  std::filesystem::remove_all(StepDir(o.save_dir, 4));
  // A newer checkpoint that does not read is passed over, and named.
  std::filesystem::create_directories(StepDir(o.save_dir, 8));
  std::ofstream(StepDir(o.save_dir, 8) + "/train_state.json") << "{";
  TrainOptions other = restart;
  other.job = "job-000043";
  const std::optional<RankStart> theirs = started(other);
  ASSERT_TRUE(theirs.has_value());
  EXPECT_EQ(theirs->step, 2);
  EXPECT_FALSE(theirs->checkpoint_step.has_value());
  ASSERT_EQ(theirs->skipped.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(theirs->skipped[0], "step-000008: ")) << theirs->skipped[0];
}

// A run resumed from a checkpoint it names, saving into the same
// directory, prunes only its own checkpoints: the run it came from keeps
// its others there, the chosen one included (retention counted them as
// this run's and removed the chosen one). So do runs outside a
// coordinator, each a writer of its own (they were one, "", and pruned
// each other's).
TEST(Trainer, ResumingANamedCheckpointPrunesNoneOfItsRunsOthers) {
  const std::string model = TinyModel("train_named");
  for (const bool jobs : {true, false}) {
    SCOPED_TRACE(jobs ? "jobs of a coordinator" : "runs outside a coordinator");
    TrainOptions first = Options(model, 1, 1);
    first.steps = 6;
    first.save_dir = TempPath(jobs ? "ck_named" : "ck_named_local");
    first.save_every = 2;
    if (jobs) {
      first.job = "job-000001";
      first.generation = 1;
    }
    ASSERT_EQ(Losses(first).size(), 6u);
    TrainOptions again = first;
    if (jobs) again.job = "job-000002";  // another job
    again.resume_dir = StepDir(first.save_dir, 2);
    again.keep_last = 1;
    const std::vector<StepStats> steps = Losses(again);
    ASSERT_EQ(steps.size(), 4u);
    EXPECT_TRUE(std::filesystem::exists(StepDir(first.save_dir, 2))) << "the chosen checkpoint was pruned";
    EXPECT_FALSE(std::filesystem::exists(StepDir(first.save_dir, 4)));  // its own, pruned
    EXPECT_TRUE(std::filesystem::exists(StepDir(first.save_dir, 6)));
    // A third run, not resumed, saving there too, counts neither's.
    TrainOptions third = first;
    if (jobs) third.job = "job-000003";
    third.steps = 1;
    third.save_every = 1;
    third.keep_last = 1;
    ASSERT_EQ(Losses(third).size(), 1u);
    EXPECT_TRUE(std::filesystem::exists(StepDir(first.save_dir, 1)));
    EXPECT_TRUE(std::filesystem::exists(StepDir(first.save_dir, 2)));
    EXPECT_TRUE(std::filesystem::exists(StepDir(first.save_dir, 6)));
  }
}

TEST(Trainer, OptionsThatDoNotFitAreRefusedBeforeAnyRankStarts) {
  const std::string model = TinyModel("train_bad");
  TrainOptions o = Options(model, 1, 2);
  o.batch_size = 3;
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.seq_len = 64;  // the model has 32 positions
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.micro_batches = 3;
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kInvalidArgument);
  o = Options(model, 1, 1);
  o.data_path = TempPath("no_such_corpus.bin");
  EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kNotFound);
  // Held-out tokens outside the vocabulary: the error names the file.
  {
    std::ofstream out(TempPath("oov_eval.bin"), std::ios::binary);
    const uint16_t id = 65000;
    for (int i = 0; i < 4096; ++i) out.write(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  o = Options(model, 1, 1);
  o.steps = 1;
  o.eval_data_path = TempPath("oov_eval.bin");
  const absl::Status oov = Train(o, nullptr);
  EXPECT_EQ(oov.code(), absl::StatusCode::kInvalidArgument) << oov;
  EXPECT_NE(oov.message().find("evaluating on eval_data_path " + TempPath("oov_eval.bin") + ": "), std::string::npos)
      << oov;
  if (kernels::CudaDeviceCount() < 2) {  // two ranks, one per device
    o = Options(model, 2, 1);
    o.cuda = true;
    EXPECT_EQ(Train(o, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace colod::train
