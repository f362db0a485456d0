// The interleaved 1F1B step (RunPipelineStep over V model chunks a rank)
// against plain 1F1B on the same pipeline depth: a tiny GPT-2 (its head
// tied to the table, so the first and last virtual stages share it) at
// pp = 2 with V = 2 (2 and 4 micro-batches) and at pp = 4 with V = 2, over
// real Gloo ranks. Every parameter's gradient, the tied table's on the
// first and on the last stage, and the step's loss are 1F1B's bit for bit:
// each layer computes the same micro-batches from the same inputs, and the
// last stage sums the micro-batches' losses in the same order. An
// evaluation (forwards only) gives the same loss. The trainer with
// layout.virtual_stages = 2 trains as with 1F1B bit for bit (clipped too
// at pp = 2 and 4: the gradient norm adds each parameter's squares in one
// order whichever ranks hold it, NormOrder; ZeRO's norm within f32
// rounding), at pp = 2 and 4, at
// tp2 x pp2 x dp2, on uneven virtual stages, with a held-out evaluation, and on CUDA ranks (the
// emulation's in CI); what it cannot take is refused.
#include <map>
#include <mutex>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/rank_group.h"
#include "worker/colo/testing.h"
#include "worker/comm/flight_recorder.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "worker/train/checkpoint.h"
#include "worker/train/pipeline.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TempPath;

struct Step {
  double loss = 0, eval_loss = 0;
  // (name, mirror) -> the gradient, over every rank.
  std::map<std::pair<std::string, bool>, std::vector<float>> grads;
};

Step RunStep(const std::string& dir, int pp, int chunks, int micro, const Tensor& ids, const Tensor& labels) {
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(pp);
  std::mutex mu;
  Step out;
  shard.layout.set_virtual_stages(chunks);
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto owned = shardformer::ShardFormer(shard, &pg).LoadChunks(dir);
    ASSERT_TRUE(owned.ok()) << owned.status();
    std::vector<shardformer::ShardedModel*> models;
    std::vector<shardformer::NamedParam> params;
    for (const std::unique_ptr<shardformer::ShardedModel>& model : *owned) {
      for (shardformer::NamedParam& p : model->Parameters()) params.push_back(p);
      models.push_back(model.get());
    }
    auto sync = GradSync::Create(params, &pg, 64 << 10);
    ASSERT_TRUE(sync.ok()) << sync.status();
    const int64_t labelled = labels.numel();
    auto step = RunPipelineStep(models, pg, **sync, ids, labels, micro, labelled);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE((*sync)->Finish().ok());
    absl::StatusOr<PipelineStepResult> eval;
    {
      NoGradScope no_grad;
      eval = RunPipelineStep(models, pg, **sync, ids, labels, micro, labelled, /*reduce=*/false, /*train=*/false);
    }
    ASSERT_TRUE(eval.ok()) << eval.status();
    std::lock_guard<std::mutex> lock(mu);
    out.loss = step->loss;
    out.eval_loss = eval->loss;
    for (const shardformer::NamedParam& p : params) {
      std::optional<Tensor> g = p.bound.param.variable().grad();
      ASSERT_TRUE(g.has_value()) << p.name;
      out.grads[{p.name, p.mirror}] = g->ContiguousAs(DType::kF32)->ToFloats();
    }
  });
  return out;
}

void ExpectInterleavedIsOneFOneB(int pp, int layers, int micro) {
  shardformer::testing::TinyOptions o;
  o.layers = layers;
  o.tie = true;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("interleaved_gpt2_" + std::to_string(layers)), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  const int64_t rows = 2 * micro, seq = 8;
  const Tensor ids = shardformer::testing::TokenIds(rows, seq, o.vocab, 3);
  const Tensor labels = shardformer::testing::TokenIds(rows, seq, o.vocab, 5);
  const std::string what = "pp=" + std::to_string(pp) + " m=" + std::to_string(micro);
  const Step plain = RunStep(gpt2->dir, pp, 1, micro, ids, labels);
  const Step interleaved = RunStep(gpt2->dir, pp, 2, micro, ids, labels);
  ASSERT_GT(plain.loss, 0) << what;
  EXPECT_EQ(interleaved.loss, plain.loss) << what;
  EXPECT_EQ(interleaved.eval_loss, plain.eval_loss) << what;
  EXPECT_EQ(plain.eval_loss, plain.loss) << what;
  ASSERT_EQ(interleaved.grads.size(), plain.grads.size()) << what;
  EXPECT_TRUE(plain.grads.count({"transformer.wte.weight", true})) << what << ": the last stage's mirror";
  for (const auto& [key, g] : plain.grads) {
    auto it = interleaved.grads.find(key);
    ASSERT_NE(it, interleaved.grads.end()) << what << ": " << key.first;
    EXPECT_EQ(it->second, g) << what << ": " << key.first << (key.second ? " (mirror)" : "");
  }
}

TEST(Interleaved, TwoChunksOnTwoRanksAreOneFOneB) {
  ExpectInterleavedIsOneFOneB(2, 4, 2);
  ExpectInterleavedIsOneFOneB(2, 4, 4);
}

TEST(Interleaved, TwoChunksOnFourRanksAreOneFOneB) {
  ExpectInterleavedIsOneFOneB(4, 8, 4);  // every forward first
  ExpectInterleavedIsOneFOneB(4, 8, 8);  // forwards and backwards in turn
}

// Two pipeline stages of one rank each.
shardformer::ShardConfig TwoStages() {
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(1);
  shard.layout.set_data_parallel_size(1);
  shard.layout.set_pipeline_parallel_size(2);
  return shard;
}

TEST(Interleaved, ChunksThatAreNotTheRanksVirtualStagesAreRefused) {
  shardformer::testing::TinyOptions o;
  o.layers = 4;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("interleaved_refused"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  const shardformer::ShardConfig shard = TwoStages();
  RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    shardformer::ShardConfig mine = shard;
    mine.layout.set_virtual_stages(2);
    mine.chunk = 1;
    auto model = shardformer::ShardFormer(mine, &pg).Load(gpt2->dir);
    ASSERT_TRUE(model.ok()) << model.status();
    auto sync = GradSync::Create((*model)->Parameters(), &pg, 64 << 10);
    ASSERT_TRUE(sync.ok()) << sync.status();
    const Tensor ids = shardformer::testing::TokenIds(2, 8, o.vocab, 3);
    // Chunk 1 of 2 passed as a rank's only chunk: refused before any message.
    auto step = RunPipelineStep(std::vector<shardformer::ShardedModel*>{model->get()}, pg, **sync, ids, ids, 2, 16);
    EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
    EXPECT_NE(step.status().message().find(" of 4, not "), std::string::npos) << step.status();
  });
}

// Inputs no stage can read are refused by every rank before any message
// (the first stage alone refusing them would leave the others waiting for
// its activations): ids longer than GPT-2's positions, float ids, rows
// that do not split into the micro-batches, an encoder-decoder without its
// decoder inputs or with empty ones.
TEST(Interleaved, InputsNoStageCanReadAreRefusedOnEveryRank) {
  shardformer::testing::TinyOptions o;
  o.layers = 2;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("pipeline_refused_gpt2"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("pipeline_refused_t5"), o);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const shardformer::ShardConfig shard = TwoStages();
  const Tensor ids = shardformer::testing::TokenIds(4, 8, o.vocab, 3);
  const Tensor too_long = shardformer::testing::TokenIds(4, o.positions + 1, o.vocab, 3);
  const Tensor floats = *ids.ToDType(DType::kF32);
  const Tensor no_decoder = shardformer::testing::TokenIds(4, 0, o.vocab, 3);
  for (const std::string& dir : {gpt2->dir, t5->dir}) {
    RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
      auto model = shardformer::ShardFormer(shard, &pg).Load(dir);
      ASSERT_TRUE(model.ok()) << model.status();
      auto sync = GradSync::Create((*model)->Parameters(), &pg, 64 << 10);
      ASSERT_TRUE(sync.ok()) << sync.status();
      const bool pairs = (*model)->config().is_encoder_decoder();
      const Tensor* dec = pairs ? &ids : nullptr;
      auto refused = [&](const Tensor& in, int64_t micro, const Tensor* decoder, const std::string& what) {
        auto step = RunPipelineStep(**model, pg, **sync, in, ids, micro, 32, true, true, decoder);
        EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << step.status();
      };
      if (!pairs) refused(too_long, 2, dec, "ids longer than the positions");  // T5's relative positions: any
      refused(floats, 2, dec, "float ids");
      refused(ids, 3, dec, "4 rows in 3 micro-batches");
      if (pairs) {
        refused(ids, 2, nullptr, "no decoder inputs");
        refused(ids, 2, &no_decoder, "empty decoder inputs");
      } else {
        refused(ids, 2, &ids, "decoder inputs for a decoder-only model");
      }
    });
  }
}

// The order in which each rank of a two-stage 1F1B step over 4
// micro-batches enqueues its point-to-point operations (its flight
// recorder), over Gloo or on CUDA ranks over NCCL.
struct Posting {
  std::vector<std::shared_ptr<FlightRecorder>> recorders;
  std::vector<double> losses;
  // Where (group, op, sequence) was enqueued on `rank`: its index in the
  // rank's record, or -1.
  int At(int rank, const std::string& group, const std::string& op, int64_t sequence) const {
    const std::vector<FlightRecorder::Entry> entries = recorders[rank]->Entries();
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].group == group && entries[i].op == op && entries[i].sequence == sequence) return static_cast<int>(i);
    }
    return -1;
  }
};

constexpr int kPostingMicro = 4;

Posting PostingOrder(bool cuda) {
  shardformer::testing::TinyOptions o;
  o.layers = 2;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("pipeline_posted_gpt2"), o);
  EXPECT_TRUE(gpt2.ok()) << gpt2.status();
  if (!gpt2.ok()) return {};
  const Tensor ids = shardformer::testing::TokenIds(2 * kPostingMicro, 8, o.vocab, 3);
  const Tensor labels = shardformer::testing::TokenIds(2 * kPostingMicro, 8, o.vocab, 5);
  const shardformer::ShardConfig shard = TwoStages();
  Posting out;
  out.recorders = {std::make_shared<FlightRecorder>(), std::make_shared<FlightRecorder>()};
  out.losses.resize(2);
  LocalRanksOptions options;
  options.cuda = cuda;
  options.timeout = absl::Seconds(60);
  options.wrap = [&](std::unique_ptr<Communicator> c, const ProcessGroup::GroupInfo& g) {
    return std::unique_ptr<Communicator>(new InstrumentedCommunicator(std::move(c), nullptr, out.recorders[g.rank], g.axis));
  };
  const absl::Status ran = RunLocalRanks(
      *DeviceMesh::FromShardConfig(shard.layout),
      [&](int rank, ProcessGroup& pg) -> absl::Status {
        shardformer::ShardConfig mine = shard;
        if (cuda) mine.device = Device::Cuda(rank);
        ASSIGN_OR_RETURN(std::unique_ptr<shardformer::ShardedModel> model,
                         shardformer::ShardFormer(mine, &pg).Load(gpt2->dir));
        ASSIGN_OR_RETURN(std::unique_ptr<GradSync> sync, GradSync::Create(model->Parameters(), &pg, 64 << 10));
        ASSIGN_OR_RETURN(PipelineStepResult step,
                         RunPipelineStep(*model, pg, *sync, ids, labels, kPostingMicro, labels.numel()));
        out.losses[rank] = step.loss;
        // The idle times lie in the span: the first stage's is its waits,
        // the last stage's also its time after its last task.
        EXPECT_GT(step.span_seconds, 0) << rank;
        EXPECT_LT(step.wait_seconds, step.span_seconds) << rank;
        EXPECT_LT(step.mean_wait_seconds, step.span_seconds) << rank;
        return sync->Finish();
      },
      std::move(options));
  EXPECT_TRUE(ran.ok()) << ran;
  EXPECT_EQ(out.losses[0], out.losses[1]);
  EXPECT_GT(out.losses[0], 0);
  return out;
}

// Ahead: the last stage posts F(k+1)'s input before it sends B(k)'s
// gradient, the first posts B(k)'s gradient before it sends F(k+1)'s
// activation. When needed: each after, the reverse.
void ExpectPostingOrder(const Posting& p, bool ahead) {
  ASSERT_EQ(p.recorders.size(), 2u);
  const std::string when = ahead ? " before " : " after ";
  for (int k = 0; k + 1 < kPostingMicro; ++k) {
    const int next_input = p.At(1, "pp#f0", "recv", k + 2), gradient_sent = p.At(1, "pp#b1", "send", k + 1);
    ASSERT_GE(next_input, 0) << k;
    ASSERT_GE(gradient_sent, 0) << k;
    EXPECT_EQ(next_input < gradient_sent, ahead)
        << "the last stage posts F" << k + 1 << "'s input" << when << "it sends B" << k;
    const int gradient = p.At(0, "pp#b1", "recv", k + 1), next_sent = p.At(0, "pp#f0", "send", k + 2);
    ASSERT_GE(gradient, 0) << k;
    ASSERT_GE(next_sent, 0) << k;
    EXPECT_EQ(gradient < next_sent, ahead)
        << "the first stage posts B" << k << "'s gradient" << when << "it sends F" << k + 1;
  }
}

// On Gloo each receive is posted ahead of the task that reads it: as soon
// as its channel's previous message was read (a gradient's once its
// forward ran), so that the transfer overlaps the rank's compute. Stage 0
// sends forward on pp#f0, stage 1 back on pp#b1; micro-batch k is each
// channel's (k+1)-th message. The last stage posts F(k+1)'s input before it
// sends B(k)'s gradient back (posted only when needed, after it); the first
// posts B(k)'s gradient before it sends F(k+1)'s activation on.
TEST(PipelineReceives, ArePostedAheadOfTheTasksThatReadThemOnGloo) {
  ExpectPostingOrder(PostingOrder(/*cuda=*/false), /*ahead=*/true);
}

// On NCCL receives are posted when their task needs them: NCCL connects a
// pair of ranks at its first operation, holding the host until the peer's
// matching one, so a first receive posted ahead could wait for a peer that
// waits for this rank (the emulation connects so too: posted ahead, the
// runs of Interleaved.TrainsOnNcclRanksAtThreeAndFourStages hang). The
// reverse of Gloo's order above.
TEST(PipelineReceives, AreNotPostedAheadOnNccl) {
  if (kernels::CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices (the emulation's in CI)";
  ExpectPostingOrder(PostingOrder(/*cuda=*/true), /*ahead=*/false);
}

// A stage that fails with a receive posted ahead that will never be
// answered aborts that channel and returns its own error at once, rather
// than waiting the receive out until the timeout (60 s here). Interleaved
// at pp = 2, V = 2: the first rank posts chunk 1's first input (from the
// last rank's chunk 0, on the wrap channel) before its first task, and
// that task, chunk 0's forward of micro-batch 0, refuses an id outside the
// vocabulary, so the last rank never gets an input to answer with.
TEST(PipelineReceives, AStageThatFailsWithAReceivePostedAheadReturnsAtOnce) {
  shardformer::testing::TinyOptions o;
  o.layers = 4;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("pipeline_fails_gpt2"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  const int micro = 4;
  std::vector<int64_t> bad = shardformer::testing::TokenIds(2 * micro, 8, o.vocab, 3).ToInt64s();
  bad[3] = o.vocab + 7;  // micro-batch 0: no such token
  const Tensor ids = *Tensor::FromInt64s({2 * micro, 8}, bad);
  const Tensor labels = shardformer::testing::TokenIds(2 * micro, 8, o.vocab, 5);
  shardformer::ShardConfig shard = TwoStages();
  shard.layout.set_virtual_stages(2);
  LocalRanksOptions options;
  options.timeout = absl::Seconds(60);
  std::vector<absl::Status> got(2);
  const absl::Time start = absl::Now();
  const absl::Status ran = RunLocalRanks(
      *DeviceMesh::FromShardConfig(shard.layout),
      [&](int rank, ProcessGroup& pg) -> absl::Status {
        ASSIGN_OR_RETURN(std::vector<std::unique_ptr<shardformer::ShardedModel>> owned,
                         shardformer::ShardFormer(shard, &pg).LoadChunks(gpt2->dir));
        std::vector<shardformer::ShardedModel*> models;
        std::vector<shardformer::NamedParam> params;
        for (const std::unique_ptr<shardformer::ShardedModel>& model : owned) {
          for (shardformer::NamedParam& p : model->Parameters()) params.push_back(p);
          models.push_back(model.get());
        }
        ASSIGN_OR_RETURN(std::unique_ptr<GradSync> sync, GradSync::Create(params, &pg, 64 << 10));
        got[rank] = RunPipelineStep(models, pg, *sync, ids, labels, micro, labels.numel()).status();
        return got[rank];
      },
      std::move(options));
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(20)) << ran;
  EXPECT_EQ(got[0].code(), absl::StatusCode::kInvalidArgument) << got[0];
  EXPECT_FALSE(got[1].ok());
  EXPECT_TRUE(absl::StartsWith(ran.message(), "rank 0")) << ran;
}

// A tiny tied GPT-2 of `layers` layers, 4 steps at pp with `micro`
// micro-batches.
TrainOptions PipelineRun(const std::string& name, int layers, int pp, int micro) {
  shardformer::testing::TinyOptions o = testing::TinyByteLevel();
  o.layers = layers;
  o.tie = true;
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath(name), o);
  EXPECT_TRUE(gpt2.ok()) << gpt2.status();
  TrainOptions run = testing::SmallRun(gpt2.ok() ? gpt2->dir : "", 1, 1, 4);
  run.shard.layout.set_pipeline_parallel_size(pp);
  run.micro_batches = micro;
  return run;
}

TrainOptions Chunked(TrainOptions run, int chunks) {
  run.shard.layout.set_virtual_stages(chunks);
  return run;
}

// The losses and gradient norms bit for bit; with `exact_norm` false the
// norm within f32 rounding (ZeRO: each dp rank's slices of a parameter are
// cut at the chunks' buckets, so its squares are grouped otherwise).
void ExpectBitwiseLosses(const std::vector<StepStats>& got, const std::vector<StepStats>& want,
                         const std::string& what, bool exact_norm = true) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].loss, want[i].loss) << what << " step " << want[i].step;
    if (exact_norm) {
      EXPECT_EQ(got[i].grad_norm, want[i].grad_norm) << what << " step " << want[i].step;
    } else {
      EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-6 * want[i].grad_norm) << what << " step " << want[i].step;
    }
  }
}

TEST(Interleaved, TrainsAsOneFOneB) {
  for (const auto& [pp, layers, micro] : std::vector<std::tuple<int, int, int>>{{2, 4, 4}, {4, 8, 8}}) {
    const std::string what = absl::StrCat("pp=", pp, " V=2 m=", micro);
    TrainOptions run = PipelineRun(absl::StrCat("interleaved_train_", layers), layers, pp, micro);
    run.clip_norm = 0;  // the norm only reported
    const std::vector<StepStats> plain = testing::Losses(run);
    ASSERT_EQ(plain.size(), 4u) << what;
    ExpectBitwiseLosses(testing::Losses(Chunked(run, 2)), plain, what);
    // Clipped: the norm adds the parameters' squares in one order whichever
    // ranks hold them (NormOrder), so the clipped updates are 1F1B's too.
    run.clip_norm = 1.0;
    ExpectBitwiseLosses(testing::Losses(Chunked(run, 2)), testing::Losses(run), what + ", clipped");
  }
}

// T5 (v1.0, its head tied) with 4 layers a stack: interleaved at pp=2
// (V=2) and pp=4 (V=2) gives the losses of 1F1B over the same stages (4,
// of 2 | 2 layers a stack, and 8 of one) bit for bit: the encoder's output
// and its gradient go between the decoder's virtual stages as between
// ranks, and each tied table (the shared embedding on three stages, the
// position biases on each stack's) sums in stage order wherever its
// holders are. (Over other stages only within f32 rounding: a stack's
// position bias table's gradient is summed a stage at a time.)
TEST(Interleaved, T5TrainsAsOneFOneBOverTheSameStages) {
  shardformer::testing::TinyOptions o = testing::TinyByteLevel();
  o.layers = 4;
  o.tie = true;
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("interleaved_t5"), o);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const testing::PairSet pairs = testing::WritePairs("interleaved_t5", t5->config.vocab_size);
  TrainOptions run = testing::OnExamples(testing::SmallRun(t5->dir, 1, 1, 4), pairs.inputs_path, pairs.targets_path);
  run.micro_batches = 8;  // clipped at 1 (SmallRun)
  for (const int pp : {2, 4}) {
    TrainOptions plain = run;
    plain.shard.layout.set_pipeline_parallel_size(2 * pp);
    const std::vector<StepStats> want = testing::Losses(plain);
    ASSERT_EQ(want.size(), 4u) << "pp=" << 2 * pp;
    TrainOptions interleaved = run;
    interleaved.shard.layout.set_pipeline_parallel_size(pp);
    ExpectBitwiseLosses(testing::Losses(Chunked(interleaved, 2)), want, absl::StrCat("t5 pp=", pp, " V=2"));
  }
  // Its checkpoints: a rank holds the shared embedding and a mirror of it
  // (rank 0: the first stage and the first decoder stage), each table
  // written once by its owner; interrupted after step 2 and resumed, the
  // uninterrupted losses, and 1F1B's final model byte for byte.
  TrainOptions plain = run;
  plain.shard.layout.set_pipeline_parallel_size(4);
  plain.final_dir = TempPath("interleaved_t5_final_1f1b");
  const std::vector<StepStats> want = testing::Losses(plain);
  TrainOptions first = run;
  first.shard.layout.set_pipeline_parallel_size(2);
  first = Chunked(first, 2);
  TrainOptions second = first;
  first.save_dir = TempPath("interleaved_t5_steps");
  first.save_every = 2;
  first.stop_after = 2;
  std::vector<StepStats> got = testing::Losses(first);
  ASSERT_EQ(got.size(), 2u);
  second.resume_dir = first.save_dir;
  second.final_dir = TempPath("interleaved_t5_final");
  for (const StepStats& s : testing::Losses(second)) got.push_back(s);
  ExpectBitwiseLosses(got, want, "t5 pp=2 V=2 interrupted after step 2");
  auto a = ReadFileToString(plain.final_dir + "/model.safetensors");
  auto b = ReadFileToString(second.final_dir + "/model.safetensors");
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_TRUE(*a == *b) << "t5's final model differs from 1F1B's";
}

// Virtual stages of the layers pipeline_stage_layers lists (pp * V of
// them, uneven): 1F1B's losses all the same.
TEST(Interleaved, TrainsAsOneFOneBOnUnevenVirtualStages) {
  TrainOptions run = PipelineRun("interleaved_uneven", 6, 2, 4);
  run.clip_norm = 0;
  const std::vector<StepStats> plain = testing::Losses(run);
  TrainOptions uneven = Chunked(run, 2);
  for (int n : {2, 1, 1, 2}) uneven.shard.layout.add_pipeline_stage_layers(n);
  ExpectBitwiseLosses(testing::Losses(uneven), plain, "pp=2 V=2 of 2+1+1+2 layers");
}

TEST(Interleaved, TrainsAsOneFOneBWithTensorAndDataParallelismAndEvaluates) {
  TrainOptions run = PipelineRun("interleaved_tp_dp", 4, 2, 2);
  run.shard.layout.set_tensor_parallel_size(2);
  run.shard.layout.set_data_parallel_size(2);
  run.clip_norm = 0;
  run.eval_split = 0.25;
  run.eval_every = 2;
  const std::vector<StepStats> plain = testing::Losses(run);
  const std::vector<StepStats> interleaved = testing::Losses(Chunked(run, 2));
  ExpectBitwiseLosses(interleaved, plain, "tp2 x pp2 x dp2");
  ASSERT_EQ(interleaved.size(), plain.size());
  int evaluated = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_EQ(interleaved[i].eval.has_value(), plain[i].eval.has_value()) << "step " << plain[i].step;
    if (!plain[i].eval.has_value()) continue;
    ++evaluated;
    EXPECT_EQ(interleaved[i].eval->loss, plain[i].eval->loss) << "step " << plain[i].step;
  }
  EXPECT_EQ(evaluated, 2);
  // ZeRO 1 over dp: each replica updates its partition of the chunks' state.
  run.eval_split = 0;
  run.eval_every = 0;
  run.zero_stage = 1;
  ExpectBitwiseLosses(testing::Losses(Chunked(run, 2)), testing::Losses(run), "tp2 x pp2 x dp2, ZeRO 1",
                      /*exact_norm=*/false);
  // ZeRO 2: no bucket spans two chunks (their backwards come at different
  // times); the chunks' sums are added in another order than 1F1B's.
  run.zero_stage = 2;
  testing::ExpectSameLosses(testing::Losses(Chunked(run, 2)), testing::Losses(run), 1e-5, "tp2 x pp2 x dp2, ZeRO 2");
  if (kernels::CudaDeviceCount() >= 2) {  // the emulation's 4 devices in CI; skipped only in the no-GPU default pass
    TrainOptions cuda = PipelineRun("interleaved_cuda", 4, 2, 2);
    cuda.clip_norm = 0;
    const std::vector<StepStats> cpu = testing::Losses(cuda);
    cuda.cuda = true;
    testing::ExpectSameLosses(testing::Losses(Chunked(cuda, 2)), cpu, 1e-4, "pp=2 V=2 on CUDA");
  }
}

// On NCCL ranks, where each rank's first send to a peer and first receive
// from it hold the host until the peer reaches the other end (the
// emulation's NCCL connects pairs so, as NCCL does): the interleaved
// schedule at pp=3 and pp=4, whose wrap channels and gradients first meet
// in the middle of the schedule, and 1F1B at pp=3, give the CPU run's
// losses. Receives are posted when needed there (pipeline.cc): posted
// ahead, a first receive would wait for a peer that waits for this rank.
TEST(Interleaved, TrainsOnNcclRanksAtThreeAndFourStages) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices (the emulation's in CI)";
  struct Case {
    int pp, chunks;
  };
  for (const Case c : {Case{4, 2}, Case{3, 2}, Case{3, 1}}) {
    const std::string what = absl::StrCat("pp=", c.pp, " V=", c.chunks, " on CUDA");
    TrainOptions run = PipelineRun(absl::StrCat("interleaved_nccl_", c.pp, "_", c.chunks), c.pp * 2, c.pp, c.pp);
    run.batch_size = 2 * c.pp;  // a micro-batch of 2 rows a stage
    run.clip_norm = 0;
    const std::vector<StepStats> cpu = testing::Losses(run);
    run.cuda = true;
    testing::ExpectSameLosses(testing::Losses(Chunked(run, c.chunks)), cpu, 1e-4, what);
  }
}

// An interleaved run's checkpoints: interrupted after step 2 and resumed
// from its checkpoint, it gives the uninterrupted run's losses bit for bit;
// its final model (every virtual stage's parameters, consolidated) is 1F1B's
// byte for byte; and its checkpoint resumes only at the virtual stages it
// was written at.
TEST(Interleaved, ResumesFromItsCheckpointsAndWritesItsFinalModel) {
  TrainOptions run = PipelineRun("interleaved_ck", 4, 2, 2);
  run.clip_norm = 0;
  TrainOptions plain = run;
  plain.final_dir = TempPath("interleaved_ck_final_1f1b");
  const std::vector<StepStats> want = testing::Losses(plain);
  ASSERT_EQ(want.size(), 4u);

  TrainOptions first = Chunked(run, 2);
  first.save_dir = TempPath("interleaved_ck_steps");
  first.save_every = 2;
  first.stop_after = 2;
  const std::vector<StepStats> before = testing::Losses(first);
  ASSERT_EQ(before.size(), 2u);
  EXPECT_EQ(before[1].checkpoint, StepDir(first.save_dir, 2));
  TrainOptions second = Chunked(run, 2);
  second.resume_dir = first.save_dir;
  second.final_dir = TempPath("interleaved_ck_final");
  std::vector<StepStats> got = before;
  for (const StepStats& s : testing::Losses(second)) got.push_back(s);
  ExpectBitwiseLosses(got, want, "interrupted after step 2");
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[2].step, 3);
  for (const char* file : {"model.safetensors", "config.json"}) {
    auto a = ReadFileToString(plain.final_dir + "/" + file), b = ReadFileToString(second.final_dir + "/" + file);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_TRUE(*a == *b) << file << " differs from 1F1B's";
  }
  // Its layout names the virtual stages: 1F1B does not resume from it.
  TrainOptions other = run;
  other.resume_dir = first.save_dir;
  const absl::Status s = Train(other, [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("virtual_stages"), std::string::npos) << s;
}

TEST(Interleaved, WhatTheTrainerCannotTakeIsRefused) {
  const TrainOptions run = PipelineRun("interleaved_refusals", 4, 2, 2);
  auto refused = [](TrainOptions o, const std::string& message) {
    const absl::Status s = Train(o, [](const StepStats&) {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(message), std::string::npos) << s;
  };
  refused(Chunked(run, -1), "virtual_stages must be in [0, 4096]");
  TrainOptions flat = Chunked(run, 2);
  flat.shard.layout.set_pipeline_parallel_size(1);
  refused(flat, "it needs pipeline_parallel_size >= 2");
  TrainOptions three = Chunked(run, 2);
  three.batch_size = 12;
  three.micro_batches = 3;
  refused(three, "micro_batches 3 is not a multiple of 2");
  TrainOptions uneven = Chunked(run, 2);
  for (int n : {2, 1, 1}) uneven.shard.layout.add_pipeline_stage_layers(n);
  refused(uneven, "pipeline_stage_layers lists 3 stages, not pipeline_parallel_size 2 x 2 virtual stages = 4");
  refused(Chunked(run, 3), "pipeline_parallel_size 2 x 3 virtual stages is more stages than the model's 4 layers");
}

}  // namespace
}  // namespace colod::train
