// The dry-run planner (spec/plan.h) against real training
// steps of a tiny GPT-2 and LLaMA in 1D (with sequence parallelism and
// micro-batches), 2D, 2.5D and 3D, BERT, ViT and OPT's projections in other
// modes, pipeline stages (T5's encoder and decoder stages too; the fullest
// stage's ranks), with and without dp, and with ZeRO 1 and 2 (the tied
// table across stages kept whole): the bytes each rank
// holds (what colod_tensor_bytes reports) and the bytes each process group
// moves by each collective (what InstrumentedCommunicator counts) are the
// plan's within 5 %, and each tensor-parallel group's calls are the plan's.
#include "spec/plan.h"

#include <cmath>
#include <map>
#include <mutex>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/data.h"
#include "worker/train/job_options.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

constexpr char kText[] = "/usr/share/common-licenses/GPL-3";

struct Case {
  std::string name;
  std::string family;  // gpt2, llama, bert, opt, bloom, vit, t5
  int tp, dp;
  bool sp;
  int micro;
  v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D;
  int depth = 0;
  int pp = 1;
  int zero = 0;
  int accum = 1;  // gradient accumulation passes
  int v = 1;      // model chunks a pipeline rank holds (interleaved 1F1B)
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class PlanAgainstARun : public ::testing::TestWithParam<Case> {};

TEST_P(PlanAgainstARun, MemoryAndEachGroupsBytesAreThePlans) {
  const Case& c = GetParam();
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = kByteVocab;  // 257: the 1D vocabulary gets padding
  tiny.hidden = 64;
  tiny.heads = 4;
  tiny.kv_heads = 2;
  tiny.positions = 32;
  tiny.layers = std::max<int64_t>(tiny.layers, int64_t{c.pp} * c.v);
  if (c.family == "opt") {
    tiny.embed_dim = 32;  // project_in on the first stage, project_out on the last
    tiny.tie = true;      // and the last stage's mirror of the table
  }
  if (c.family == "t5") tiny.tie = true;  // the shared embedding on the first, first decoder and last stages
  auto model = c.family == "gpt2"    ? shardformer::testing::WriteTinyGpt2(TempPath("plan_" + c.name), tiny)
               : c.family == "bert"  ? shardformer::testing::WriteTinyBert(TempPath("plan_" + c.name), tiny)
               : c.family == "opt"   ? shardformer::testing::WriteTinyOpt(TempPath("plan_" + c.name), tiny)
               : c.family == "bloom" ? shardformer::testing::WriteTinyBloom(TempPath("plan_" + c.name), tiny)
               : c.family == "vit"   ? shardformer::testing::WriteTinyVit(TempPath("plan_" + c.name), tiny)
               : c.family == "t5"    ? shardformer::testing::WriteTinyT5(TempPath("plan_" + c.name), tiny)
                                     : shardformer::testing::WriteTinyLlama(TempPath("plan_" + c.name), tiny);
  ASSERT_TRUE(model.ok()) << model.status();

  TrainOptions o;
  o.model_dir = model->dir;
  o.data_path = kText;
  o.steps = 1;
  o.batch_size = 8;
  o.seq_len = 32;
  o.micro_batches = c.micro;
  o.seed = 3;
  o.shard.layout.set_tensor_parallel_size(c.tp);
  o.shard.layout.set_data_parallel_size(c.dp);
  o.shard.layout.set_tensor_parallel_mode(c.mode);
  o.shard.layout.set_depth(c.depth);
  o.shard.layout.set_sequence_parallel(c.sp);
  o.shard.layout.set_pipeline_parallel_size(c.pp);
  o.shard.layout.set_virtual_stages(c.v);
  o.bucket_bytes = 64 << 10;  // several buckets
  o.zero_stage = c.zero;
  o.grad_accum = c.accum;
  if (c.family == "bert") o.mask_token_id = tiny.vocab - 1;  // a masked language model
  if (c.family == "vit") {  // labelled images
    const testing::ImageSet images = testing::WriteImages("plan_" + c.name, tiny);
    o = testing::OnExamples(o, images.images_path, images.labels_path);
  }
  if (c.family == "t5") {  // pairs of seq_len tokens each way, as the plan takes them
    const std::string inputs = TempPath("plan_" + c.name + "_inputs.npy");
    const std::string targets = TempPath("plan_" + c.name + "_targets.npy");
    ASSERT_TRUE(
        WriteNpy(inputs, *shardformer::testing::TokenIds(16, o.seq_len, tiny.vocab, 11).ToDType(DType::kI32)).ok());
    ASSERT_TRUE(WriteNpy(targets, shardformer::testing::TokenIds(16, o.seq_len, tiny.vocab, 13)).ok());
    o = testing::OnExamples(o, inputs, targets);
  }
  auto prepared = PrepareTrain(o);
  ASSERT_TRUE(prepared.ok()) << prepared.status();

  const v1::JobSpec spec = SpecFromTrainOptions(o);
  auto plan = PlanJob(model->config, spec);
  ASSERT_TRUE(plan.ok()) << plan.status();

  auto mesh = DeviceMesh::FromShardConfig(o.shard.layout);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::mutex mu;
  std::map<int, StepStats> stats;
  std::map<int, std::map<std::pair<std::string, std::string>, InstrumentedCommunicator::OpStats>> moved;  // rank -> (group, op)
  colod::testing::RunMesh(
      *mesh,
      [&](int rank, ProcessGroup& pg) {
        RankHooks hooks;
        StepStats last;
        hooks.on_step = [&](const StepStats& st) { last = st; };
        const absl::Status s = RunTrainRank(**prepared, rank, pg, o.shard, hooks);
        ASSERT_TRUE(s.ok()) << s;
        std::map<std::pair<std::string, std::string>, InstrumentedCommunicator::OpStats> mine;
        for (const std::string axis : {"tp", "tp_row", "tp_col", "tp_dep", "tp_output", "tp_input", "tp_weight", "dp",
                                       "pp", "pp#f0", "pp#f1", "pp#b0", "pp#b1", "pp#fw", "pp#bw"}) {
          const std::string base = axis.substr(0, axis.find('#'));
          if (!pg.AxisSize(base).ok() || *pg.AxisSize(base) < 2) continue;
          for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"}) {
            const InstrumentedCommunicator::OpStats st = colod::testing::Stats(pg, axis, op);
            if (st.bytes > 0) mine[{axis, op}] = st;
          }
        }
        std::lock_guard<std::mutex> lock(mu);
        stats[rank] = last;
        moved[rank] = std::move(mine);
      },
      /*instrument=*/true);

  ASSERT_EQ(stats.size(), static_cast<size_t>(c.tp * c.pp * c.dp));
  // With pipeline stages the plan is its fullest stage's ranks'.
  if (c.pp > 1) {
    ASSERT_GE(plan->pipeline_stage, 0);
    for (auto it = stats.begin(); it != stats.end();) {
      it = *mesh->LocalRank("pp", it->first) == plan->pipeline_stage ? std::next(it) : stats.erase(it);
    }
    ASSERT_FALSE(stats.empty());
  }
  auto within = [](int64_t got, int64_t want) { return std::abs(static_cast<double>(got - want)) <= 0.05 * want; };
  std::map<std::pair<std::string, std::string>, PlanComm> planned;
  for (const PlanComm& pc : plan->comm) planned[{pc.group, pc.op}] = pc;
  for (const auto& [rank, st] : stats) {
    // A pipeline's NormOrder all-gathers the parameters' names' hashes over
    // pp once, at the start of a run: not a step's, and not planned.
    if (c.pp > 1) {
      const InstrumentedCommunicator::OpStats names = moved[rank][{"pp", "all_gather"}];
      EXPECT_EQ(names.calls, 2) << "rank " << rank << ": the count and the hashes";
      moved[rank].erase({"pp", "all_gather"});
    }
    EXPECT_PRED2(within, st.param_bytes, plan->param_bytes) << "rank " << rank << " parameters";
    EXPECT_PRED2(within, st.grad_bytes, plan->grad_bytes) << "rank " << rank << " gradients";
    EXPECT_PRED2(within, st.optimizer_bytes, plan->optimizer_bytes) << "rank " << rank << " optimizer state";
    for (const auto& [key, st] : moved[rank]) {
      EXPECT_TRUE(planned.count(key)) << "rank " << rank << " moved " << st.bytes << " bytes in " << st.calls
                                      << " calls by " << key.second
                                      << " over " << key.first << ", which the plan does not have";
    }
    for (const auto& [key, pc] : planned) {
      const InstrumentedCommunicator::OpStats got = moved[rank].count(key) ? moved[rank][key] : InstrumentedCommunicator::OpStats();
      EXPECT_PRED2(within, got.bytes, pc.bytes) << "rank " << rank << ": " << key.second << " over " << key.first;
      // The tensor-parallel calls are the layers' own; the dp buckets split by parameters, about as planned.
      if (key.first != "dp") {
        EXPECT_EQ(got.calls, pc.calls) << "rank " << rank << ": " << key.second << " over " << key.first;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PlanAgainstARun,
    ::testing::Values(Case{"gpt2_tp2_dp2", "gpt2", 2, 2, false, 1}, Case{"gpt2_tp2_sp", "gpt2", 2, 1, true, 1},
                      Case{"gpt2_tp2_micro2", "gpt2", 2, 1, false, 2}, Case{"gpt2_dp2", "gpt2", 1, 2, false, 1},
                      Case{"llama_tp2_dp2", "llama", 2, 2, false, 1},
                      Case{"gpt2_2d", "gpt2", 4, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2D},
                      Case{"llama_2d_dp2", "llama", 4, 2, false, 1, v1::TENSOR_PARALLEL_MODE_2D},
                      Case{"gpt2_2p5d", "gpt2", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2P5D, 2},
                      Case{"gpt2_3d", "gpt2", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_3D},
                      Case{"llama_3d_micro2", "llama", 8, 1, false, 2, v1::TENSOR_PARALLEL_MODE_3D},
                      Case{"bert_3d", "bert", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_3D},
                      Case{"bert_2d", "bert", 4, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2D},
                      Case{"bert_tp2_sp", "bert", 2, 1, true, 1},
                      Case{"gpt2_tp2_pp2_micro4", "gpt2", 2, 1, false, 4, v1::TENSOR_PARALLEL_MODE_1D, 0, 2},
                      Case{"llama_pp2_dp2_micro2", "llama", 1, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2},
                      // Each family's stages from its table: the embeddings
                      // on the first, the heads (and a tied table's mirror)
                      // on the last.
                      Case{"opt_tp2_pp2_micro2", "opt", 2, 1, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2},
                      Case{"bloom_pp2_dp2_micro2", "bloom", 1, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2},
                      Case{"bert_2d_pp2_micro2", "bert", 4, 1, false, 2, v1::TENSOR_PARALLEL_MODE_2D, 0, 2},
                      // GPT-2's fused q|k|v: three parameters in 2D (the norm's slots).
                      Case{"gpt2_2d_pp2_micro2", "gpt2", 4, 1, false, 2, v1::TENSOR_PARALLEL_MODE_2D, 0, 2},
                      // A classifier: its logits replicated over the
                      // tensor-parallel ranks, the loss reduced over dp only;
                      // OPT's project_in/out under sequence parallelism.
                      Case{"vit_tp2_dp2", "vit", 2, 2, false, 1}, Case{"vit_2d", "vit", 4, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2D},
                      Case{"vit_2p5d", "vit", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2P5D, 2},
                      Case{"vit_3d", "vit", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_3D},
                      Case{"opt_tp2_sp", "opt", 2, 1, true, 1},
                      Case{"gpt2_tp2_dp2_zero1", "gpt2", 2, 2, false, 1, v1::TENSOR_PARALLEL_MODE_1D, 0, 1, 1},
                      Case{"llama_tp2_dp2_zero2_micro2", "llama", 2, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 1, 2},
                      Case{"gpt2_pp2_dp2_zero2_micro2", "gpt2", 1, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2, 2},
                      // Accumulation: the dp buckets reduced once a step, the
                      // passes' collectives each pass, the loss over pp each pass.
                      Case{"gpt2_tp2_dp2_accum2", "gpt2", 2, 2, false, 1, v1::TENSOR_PARALLEL_MODE_1D, 0, 1, 0, 2},
                      Case{"gpt2_pp2_dp2_micro2_accum2", "gpt2", 1, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2, 0,
                           2},
                      // Interleaved 1F1B: V chunks a rank, the wrap channels
                      // between the last rank and the first.
                      Case{"gpt2_pp2_v2_micro4", "gpt2", 1, 1, false, 4, v1::TENSOR_PARALLEL_MODE_1D, 0, 2, 0, 1, 2},
                      Case{"llama_tp2_pp2_v2_dp2_micro2", "llama", 2, 2, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2, 0, 1,
                           2},
                      Case{"gpt2_pp4_v2_micro4", "gpt2", 1, 1, false, 4, v1::TENSOR_PARALLEL_MODE_1D, 0, 4, 0, 1, 2},
                      // T5's encoder and decoder stages: the decoder's stream and the encoder's output
                      // between decoder stages; the shared embedding on three stages, each stack's
                      // position bias on two (ZeRO keeps them whole); an interleaved rank holding the
                      // shared embedding twice.
                      Case{"t5_tp2_pp2_micro2", "t5", 2, 1, false, 2, v1::TENSOR_PARALLEL_MODE_1D, 0, 2},
                      // and in 2D and 3D, each stack's position bias's gradient over tp.
                      Case{"t5_2d", "t5", 4, 1, false, 1, v1::TENSOR_PARALLEL_MODE_2D},
                      Case{"t5_3d", "t5", 8, 1, false, 1, v1::TENSOR_PARALLEL_MODE_3D},
                      Case{"t5_pp4_dp2_zero1_micro4", "t5", 1, 2, false, 4, v1::TENSOR_PARALLEL_MODE_1D, 0, 4, 1},
                      Case{"t5_pp2_v2_micro4", "t5", 1, 1, false, 4, v1::TENSOR_PARALLEL_MODE_1D, 0, 2, 0, 1, 2}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace colod::train
