// Held-out evaluation (TrainOptions::eval_*): the loss on data the run does
// not train on, with no gradient and no optimizer step, under the run's
// layout. Held against the unsharded reference implementations on the
// windows (images) the held-out split names, computed here from the file;
// the same at every layout (tp x dp, 2D, pp x dp, the emulated NCCL) within
// 1e-5; and without effect on the training it interleaves with.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;
using testing::Losses;
using testing::TinyByteLevel;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The one report of an eval_only run.
EvalStats EvalOnly(TrainOptions o) {
  o.eval_only = true;
  const std::vector<StepStats> got = Losses(o);
  EXPECT_EQ(got.size(), 1u);
  if (got.size() != 1 || !got[0].eval.has_value()) return EvalStats{.loss = std::nan("")};
  EXPECT_FALSE(got[0].trained);
  return *got[0].eval;
}

TrainOptions WithLayout(TrainOptions o, int tp, int pp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  o.shard.layout.set_tensor_parallel_size(tp);
  o.shard.layout.set_pipeline_parallel_size(pp);
  o.shard.layout.set_data_parallel_size(dp);
  o.shard.layout.set_tensor_parallel_mode(mode);
  return o;
}

// `o`'s evaluation at tp 2 x dp 2 with 2 micro-batches, 2D (tp 4) and
// pp 2 x dp 2: `loss` within 1e-5, over `tokens` labelled positions.
void ExpectTheEvaluationAtEveryLayout(const TrainOptions& o, double loss, int64_t tokens) {
  TrainOptions micro = WithLayout(o, 2, 1, 2);
  micro.micro_batches = 2;
  TrainOptions pipelined = WithLayout(o, 1, 2, 2);
  pipelined.micro_batches = 2;
  for (const auto& [what, layout] : std::vector<std::pair<std::string, TrainOptions>>{
           {"tp2 x dp2, 2 micro-batches", micro},
           {"2D tp4", WithLayout(o, 4, 1, 1, v1::TENSOR_PARALLEL_MODE_2D)},
           {"pp2 x dp2", pipelined}}) {
    const EvalStats e = EvalOnly(layout);
    EXPECT_NEAR(e.loss, loss, 1e-5 * loss) << what;
    EXPECT_EQ(e.tokens, tokens) << what;
  }
}

// GPT-2 on the GPL's text, byte-level (one document: the split is at the
// token): 10 % held out from round(0.9 n), read in windows of 17 tokens
// 16 apart. Two batches of 8 are the first 16 windows; their mean
// next-token loss is the reference's on them, at every layout.
TEST(Eval, TheHeldOutLossIsTheUnshardedReferencesOnTheTrailingWindows) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("eval_ref"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 1, 1);
  o.seq_len = 16;
  o.eval_split = 0.1;
  o.eval_steps = 2;
  const std::string text = ReadAll(testing::kGplText);
  const int64_t n = static_cast<int64_t>(text.size()) + 1;  // the bytes and <|endoftext|>
  const int64_t split = std::llround(0.9 * static_cast<double>(n));
  ASSERT_GT((n - split - 1) / 16, 16) << "the held-out part has 16 windows";
  std::vector<int64_t> ids;
  for (int64_t w = 0; w < 16; ++w) {
    for (int64_t j = 0; j <= 16; ++j) {
      const int64_t i = split + w * 16 + j;
      ids.push_back(i < static_cast<int64_t>(text.size()) ? static_cast<unsigned char>(text[i]) : 256);
    }
  }
  auto ref = shardformer::testing::ReferenceGpt2(*model, *Tensor::FromInt64s({16, 17}, ids));
  ASSERT_TRUE(ref.ok()) << ref.status();
  const EvalStats plain = EvalOnly(o);
  EXPECT_EQ(plain.step, 0);
  EXPECT_EQ(plain.tokens, 16 * 16);
  EXPECT_NEAR(plain.loss, ref->loss, 1e-5 * ref->loss);
  ASSERT_TRUE(plain.perplexity.has_value());
  EXPECT_DOUBLE_EQ(*plain.perplexity, std::exp(plain.loss));
  EXPECT_FALSE(plain.accuracy.has_value());
  ExpectTheEvaluationAtEveryLayout(o, ref->loss, 16 * 16);
}

// BERT sees every position, so it is evaluated (and trained) as a masked
// language model: the loss is the unsharded reference's over the masked
// positions of the windows the evaluation reads, masked as BatchSampler
// masks them (seed 0), and counts only those; the same at tp 2 x dp 2, 2D
// and pp 2 x dp 2.
TEST(Eval, AMaskedLanguageModelIsEvaluatedOnItsMaskedPositions) {
  auto model = shardformer::testing::WriteTinyBert(TempPath("eval_bert"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 1, 1);
  ASSERT_TRUE(o.mask_token_id.has_value());
  o.seq_len = 16;
  std::vector<int64_t> held(400);
  for (size_t i = 0; i < held.size(); ++i) held[i] = static_cast<int64_t>((i * 37 + 11) % 250);
  o.eval_data_path = TempPath("eval_bert_held.npy");
  ASSERT_TRUE(WriteNpy(o.eval_data_path, *Tensor::FromInt64s({400}, held)).ok());
  o.eval_steps = 2;
  // The evaluation's two batches of 8: the first 16 windows, masked.
  auto sampler = BatchSampler::Create(400, 16, 8, 1, /*seed=*/0, SampleRange{.sequential = true});
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  auto corpus = TokenCorpus::Open(o.eval_data_path);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const MaskedLm mlm{.mask_token_id = *o.mask_token_id, .vocab_size = model->config.vocab_size};
  std::vector<int64_t> ids, labels;
  for (int64_t k = 0; k < 2; ++k) {
    Tensor in, out;
    ASSERT_TRUE(sampler->Batch(**corpus, k, 0, &in, &out, 0, -1, &mlm).ok());
    for (int64_t v : in.ToInt64s()) ids.push_back(v);
    for (int64_t v : out.ToInt64s()) labels.push_back(v);
  }
  const int64_t masked = sampler->MaskedPositions(0, 0, 8) + sampler->MaskedPositions(1, 0, 8);
  ASSERT_GT(masked, 0);
  auto ref = shardformer::testing::ReferenceBert(*model, *Tensor::FromInt64s({16, 16}, ids),
                                                 *Tensor::FromInt64s({16, 16}, labels));
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_EQ(ref->tokens, masked);
  const EvalStats one = EvalOnly(o);
  EXPECT_NEAR(one.loss, ref->loss, 1e-5 * ref->loss);
  EXPECT_EQ(one.tokens, masked);
  ExpectTheEvaluationAtEveryLayout(o, ref->loss, masked);
  // Without its [MASK] id a BERT run is refused, naming why.
  TrainOptions bare = o;
  bare.mask_token_id.reset();
  const absl::Status refused = Train(bare, [](const StepStats&) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("mask_token_id: required for a masked language model (bert"), std::string::npos)
      << refused;
}

// A masked language model's training resumes masking as the uninterrupted
// run masks (the draws are the step's and the row's): the resumed steps'
// losses are the whole run's, bitwise. The checkpoint records its
// [MASK] id; a resume that asks for another is refused, naming both.
TEST(Eval, AMaskedLanguageModelResumesMaskingAsItDid) {
  auto model = shardformer::testing::WriteTinyBert(TempPath("resume_bert"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions full = testing::SmallRun(model->dir, 1, 1, 4);
  ASSERT_TRUE(full.mask_token_id.has_value());
  full.seq_len = 16;
  const std::vector<StepStats> want = Losses(full);
  ASSERT_EQ(want.size(), 4u);
  TrainOptions cut = full;
  cut.save_dir = TempPath("resume_bert_ck");
  cut.stop_after = 2;
  ASSERT_EQ(Losses(cut).size(), 2u);
  TrainOptions other = full;
  other.resume_dir = cut.save_dir;
  other.mask_token_id = *full.mask_token_id - 1;
  const absl::Status refused = Train(other, [](const StepStats&) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find(absl::StrCat("trained with mask_token_id ", *full.mask_token_id,
                                                ", this run asks for ", *full.mask_token_id - 1)),
            std::string::npos)
      << refused;
  TrainOptions resumed = full;
  resumed.resume_dir = cut.save_dir;
  const std::vector<StepStats> rest = Losses(resumed);
  ASSERT_EQ(rest.size(), 2u);
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].loss, want[i + 2].loss) << "step " << i + 3;
}

// The default evaluation reads the held-out windows once, even where they
// do not fill its last batch: batches of 8 over W windows (W not a multiple
// of 8) give the loss and the labelled positions of batches of 1, which
// never wrap.
TEST(Eval, TheDefaultEvaluationCountsEachHeldOutWindowOnce) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("eval_once"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 1, 1);
  o.seq_len = 16;
  o.eval_split = 0.03;
  TrainOptions ones = o;
  ones.batch_size = 1;
  const EvalStats exact = EvalOnly(ones);
  const int64_t windows = exact.tokens / 16;
  ASSERT_EQ(exact.tokens, windows * 16);
  ASSERT_LT(windows, 100) << "batches of 1 read them all (at most 100 by default)";
  ASSERT_NE(windows % 8, 0) << "the last batch of 8 must wrap for the test to prove anything";
  for (const auto& [what, layout] : std::vector<std::pair<std::string, TrainOptions>>{
           {"one replica", o}, {"tp2 x dp2, 2 micro-batches", [&] {
              TrainOptions m = WithLayout(o, 2, 1, 2);
              m.micro_batches = 2;
              return m;
            }()}}) {
    const EvalStats e = EvalOnly(layout);
    EXPECT_EQ(e.tokens, exact.tokens) << what;
    EXPECT_NEAR(e.loss, exact.loss, 1e-6 * exact.loss) << what;
  }
  // eval_steps asks for batches: they wrap, every row counted.
  TrainOptions asked = o;
  asked.eval_steps = (windows + 7) / 8;
  EXPECT_EQ(EvalOnly(asked).tokens, asked.eval_steps * 8 * 16);
}

// A run that evaluates every 2 of its 3 steps at tp2 x dp2: evaluations
// after steps 2 and 3, the last equal to a tp=1 (and pp2 x dp2, and, where
// the emulation's devices are, an NCCL tp2 x dp2) evaluation of the model it
// wrote, within 1e-5; and its training losses are bit for bit those of
// the same run that never evaluates (eval_data_path: another file, so that
// both train on the same data).
TEST(Eval, EvaluatingLeavesTrainingAsItIsAndEveryLayoutAgrees) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("eval_train"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions plain = WithLayout(testing::SmallRun(model->dir, 1, 1, 3), 2, 1, 2);
  plain.seq_len = 16;
  TrainOptions evaluated = plain;
  evaluated.eval_data_path = "/usr/share/common-licenses/Apache-2.0";
  evaluated.eval_every = 2;
  evaluated.eval_steps = 3;
  evaluated.final_dir = TempPath("eval_train_final");
  evaluated.save_dir = TempPath("eval_train_ck");
  evaluated.save_every = 3;
  const std::vector<StepStats> a = Losses(plain), b = Losses(evaluated);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i + 1;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << i + 1;
    EXPECT_FALSE(a[i].eval.has_value());
  }
  EXPECT_FALSE(b[0].eval.has_value());
  ASSERT_TRUE(b[1].eval.has_value());
  ASSERT_TRUE(b[2].eval.has_value());
  EXPECT_EQ(b[1].eval->step, 2);
  EXPECT_EQ(b[2].eval->step, 3);
  EXPECT_NE(b[1].eval->loss, b[2].eval->loss);  // a step between them
  const double want = b[2].eval->loss;
  TrainOptions of_final = testing::SmallRun(evaluated.final_dir, 1, 1, 1);
  of_final.seq_len = 16;
  of_final.eval_data_path = evaluated.eval_data_path;
  of_final.eval_steps = 3;
  EXPECT_NEAR(EvalOnly(of_final).loss, want, 1e-5 * want) << "tp1";
  TrainOptions pp = WithLayout(of_final, 1, 2, 2);
  pp.micro_batches = 2;
  EXPECT_NEAR(EvalOnly(pp).loss, want, 1e-5 * want) << "pp2 x dp2";
  // The step-3 checkpoint evaluated where it was written (resumed): the
  // same loss, whatever the run's steps (an evaluation trains none).
  TrainOptions of_checkpoint = plain;
  of_checkpoint.eval_data_path = evaluated.eval_data_path;
  of_checkpoint.eval_steps = 3;
  of_checkpoint.resume_dir = evaluated.save_dir;
  of_checkpoint.steps = 1;
  const EvalStats resumed = EvalOnly(of_checkpoint);
  EXPECT_EQ(resumed.step, 3);
  EXPECT_NEAR(resumed.loss, want, 1e-5 * want) << "resumed from step 3 with steps 1";
  // An evaluation updates nothing: it reads no optimizer state, so one of
  // another optimizer's checkpoint (SGD's, AdamW's here) evaluates too.
  TrainOptions other_optimizer = of_checkpoint;
  other_optimizer.optimizer.kind = of_checkpoint.optimizer.kind == OptimizerOptions::Kind::kSgd
                                       ? OptimizerOptions::Kind::kAdamW
                                       : OptimizerOptions::Kind::kSgd;
  EXPECT_NEAR(EvalOnly(other_optimizer).loss, want, 1e-5 * want) << "another optimizer's run";
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices (the emulation has them)";
  TrainOptions nccl = WithLayout(of_final, 2, 1, 2);
  nccl.cuda = true;
  nccl.shard.param_dtype = DType::kF32;
  EXPECT_NEAR(EvalOnly(nccl).loss, want, 1e-5 * want) << "NCCL tp2 x dp2";
}

// A ViT on 24 labelled images with a quarter held out: the evaluation
// reads images 18-23 once (one batch of 8, the default: the held-out images
// once; the batch's last 2 rows wrap to 18 and 19, left out); its loss and
// accuracy are the reference's on the 6, at tp2 x dp2 too (the replicas' correct counts added up), and at
// tp2 x pp2 x dp2 (the last stage's counts, its logits gathered over tp,
// on every stage).
TEST(Eval, AnImageClassifierReportsItsAccuracy) {
  shardformer::testing::TinyOptions tiny;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("eval_vit"), tiny);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const testing::ImageSet set = testing::WriteImages("eval_vit", tiny);
  const Tensor& images = set.images;
  const Tensor& labels = set.labels;
  TrainOptions o = testing::OnExamples(testing::SmallRun(vit->dir, 1, 1, 1), set.images_path, set.labels_path);
  o.eval_split = 0.25;
  // The 6 held-out images once: the batch of 8 wraps to images 18 and 19
  // again, which are left out of the loss and the accuracy.
  const std::vector<int64_t> rows = {18, 19, 20, 21, 22, 23};
  const int64_t n = static_cast<int64_t>(rows.size());
  const std::vector<int64_t> all = labels.ToInt64s();
  Tensor batch = *Tensor::Empty({n, 3, 8, 8}, DType::kF32);
  std::vector<int64_t> want;
  for (int64_t r = 0; r < n; ++r) {
    ASSERT_TRUE(batch.Narrow(0, r, 1)->CopyFrom(*images.Narrow(0, rows[r], 1)).ok());
    want.push_back(all[rows[r]]);
  }
  auto ref = shardformer::testing::ReferenceVit(*vit, batch, *Tensor::FromInt64s({n}, want));
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<float> z = ref->logits.ToFloats();
  const int64_t classes = static_cast<int64_t>(z.size()) / n;
  int correct = 0;
  for (int64_t r = 0; r < n; ++r) {
    correct += std::max_element(z.begin() + r * classes, z.begin() + (r + 1) * classes) - (z.begin() + r * classes) ==
               want[r];
  }
  for (const auto& [what, layout] : std::vector<std::pair<std::string, TrainOptions>>{
           {"unsharded", o}, {"tp2 x dp2", WithLayout(o, 2, 1, 2)}, {"tp2 x pp2 x dp2", WithLayout(o, 2, 2, 2)}}) {
    const EvalStats e = EvalOnly(layout);
    EXPECT_EQ(e.tokens, n) << what;
    EXPECT_NEAR(e.loss, ref->loss, 1e-5 * ref->loss) << what;
    ASSERT_TRUE(e.accuracy.has_value()) << what;
    EXPECT_DOUBLE_EQ(*e.accuracy, correct / static_cast<double>(n)) << what;
    EXPECT_FALSE(e.perplexity.has_value()) << what;
  }
}

// Held-out data that is missing, a split out of (0, 1) or too small for a
// window, evaluation settings without held-out data, both sources at once,
// labels a language model cannot take: refused before any rank starts,
// naming the field.
TEST(Eval, BadSettingsAreRefusedNamingTheField) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("eval_bad"), TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  const TrainOptions base = testing::SmallRun(model->dir, 1, 1, 1);
  struct Case {
    std::string what;
    std::function<void(TrainOptions&)> set;
    absl::StatusCode code;
    std::string names;
  };
  const std::vector<Case> cases = {
      {"split 1", [](TrainOptions& o) { o.eval_split = 1; }, absl::StatusCode::kInvalidArgument, "eval_split"},
      {"split -0.1", [](TrainOptions& o) { o.eval_split = -0.1; }, absl::StatusCode::kInvalidArgument, "eval_split"},
      {"split NaN", [](TrainOptions& o) { o.eval_split = std::nan(""); }, absl::StatusCode::kInvalidArgument,
       "eval_split"},
      {"split under a window", [](TrainOptions& o) { o.eval_split = 1e-5; }, absl::StatusCode::kInvalidArgument,
       "eval_split"},
      {"missing file", [](TrainOptions& o) { o.eval_data_path = TempPath("no_such_eval.txt"); },
       absl::StatusCode::kNotFound, "eval_data_path"},
      {"both", [](TrainOptions& o) { o.eval_split = 0.1; o.eval_data_path = testing::kGplText; },
       absl::StatusCode::kInvalidArgument, "eval_split"},
      {"every alone", [](TrainOptions& o) { o.eval_every = 2; }, absl::StatusCode::kInvalidArgument, "eval_every"},
      {"only alone", [](TrainOptions& o) { o.eval_only = true; }, absl::StatusCode::kInvalidArgument, "eval_only"},
      {"negative steps", [](TrainOptions& o) { o.eval_split = 0.1; o.eval_steps = -1; },
       absl::StatusCode::kInvalidArgument, "eval_steps"},
      {"labels for a language model", [](TrainOptions& o) { o.eval_split = 0.1; o.eval_labels_path = testing::kGplText; },
       absl::StatusCode::kInvalidArgument, "labels"},
  };
  for (const Case& c : cases) {
    TrainOptions o = base;
    c.set(o);
    const absl::Status s = Train(o, [](const StepStats&) { ADD_FAILURE() << "a step ran"; });
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.names), absl::string_view::npos) << c.what << ": " << s;
  }
}

}  // namespace
}  // namespace colod::train
