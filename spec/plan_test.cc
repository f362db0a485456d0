// The planner's parameters per rank against real sharded models: every
// family, loaded by ShardFormer on every rank of 1D, sequence-parallel, 2D
// and 2.5D layouts, holds exactly the elements the plan says; the plan
// refuses the layouts the policies refuse; and layouts rank by their
// communication.
#include "spec/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kernels/types.h"
#include "tests/testing/heap.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/testing.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;
using Writer = std::function<absl::StatusOr<testing::TinyModel>(const std::string&, const testing::TinyOptions&)>;

struct Case {
  std::string name;
  Writer write;
  testing::TinyOptions options;
  int tp, dp;
  v1::TensorParallelMode mode;
  int depth;
  bool sp;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

testing::TinyOptions Untied() {
  testing::TinyOptions o;
  o.tie = false;
  return o;
}
testing::TinyOptions OptProjected() {
  testing::TinyOptions o;
  o.embed_dim = 32;  // project_in / project_out
  o.tie = true;
  return o;
}

class PlannedParameters : public ::testing::TestWithParam<Case> {};

TEST_P(PlannedParameters, EveryRankHoldsThePlannedElements) {
  const Case& c = GetParam();
  auto model = c.write(TempPath("plan_" + c.name), c.options);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_FORWARD);
  v1::ShardConfig& layout = *spec.mutable_shard();
  layout.set_tensor_parallel_size(c.tp);
  layout.set_data_parallel_size(c.dp);
  layout.set_tensor_parallel_mode(c.mode);
  layout.set_depth(c.depth);
  layout.set_sequence_parallel(c.sp);
  auto plan = PlanJob(model->config, spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto count = ParameterCount(model->config);
  ASSERT_TRUE(count.ok()) << count.status();
  int64_t written = 0;
  for (const auto& [name, t] : model->tensors) written += t.numel();
  EXPECT_EQ(*count, written) << "the plan's leaves are the checkpoint's tensors";
  EXPECT_EQ(plan->parameters, written);

  ShardConfig shard;
  shard.layout = layout;
  auto mesh = DeviceMesh::FromShardConfig(layout);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::mutex mu;
  std::map<int, int64_t> held;
  colod::testing::RunMesh(*mesh, [&](int rank, ProcessGroup& pg) {
    ShardFormer sf(shard, &pg);
    auto sharded = sf.Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    int64_t n = 0;
    for (const NamedParam& p : (*sharded)->Parameters()) n += p.bound.param.local().numel();
    std::lock_guard<std::mutex> lock(mu);
    held[rank] = n;
  });
  ASSERT_EQ(held.size(), static_cast<size_t>(c.tp * c.dp));
  for (const auto& [rank, n] : held) EXPECT_EQ(n, plan->rank_parameters) << "rank " << rank;
  EXPECT_EQ(plan->param_bytes, plan->rank_parameters * 4);
  EXPECT_EQ(plan->grad_bytes, 0) << "a forward job keeps no gradients";
}

constexpr auto k1D = v1::TENSOR_PARALLEL_MODE_1D;
constexpr auto k2D = v1::TENSOR_PARALLEL_MODE_2D;
constexpr auto k2P5D = v1::TENSOR_PARALLEL_MODE_2P5D;
constexpr auto k3D = v1::TENSOR_PARALLEL_MODE_3D;

INSTANTIATE_TEST_SUITE_P(
    Families, PlannedParameters,
    ::testing::Values(Case{"gpt2_tp1", testing::WriteTinyGpt2, {}, 1, 1, k1D, 0, false},
                      Case{"gpt2_tp2_dp2", testing::WriteTinyGpt2, {}, 2, 2, k1D, 0, false},
                      Case{"gpt2_tp4_sp", testing::WriteTinyGpt2, {}, 4, 1, k1D, 0, true},
                      Case{"gpt2_2d", testing::WriteTinyGpt2, {}, 4, 1, k2D, 0, false},
                      Case{"gpt2_2p5d", testing::WriteTinyGpt2, {}, 8, 1, k2P5D, 2, false},
                      Case{"llama_tp2", testing::WriteTinyLlama, Untied(), 2, 1, k1D, 0, false},
                      Case{"llama_2d", testing::WriteTinyLlama, Untied(), 4, 1, k2D, 0, false},
                      Case{"gpt2_3d", testing::WriteTinyGpt2, {}, 8, 1, k3D, 0, false},
                      Case{"llama_3d_dp2", testing::WriteTinyLlama, Untied(), 8, 2, k3D, 0, false},
                      Case{"bert_tp2", testing::WriteTinyBert, {}, 2, 1, k1D, 0, false},
                      Case{"bert_3d", testing::WriteTinyBert, {}, 8, 1, k3D, 0, false},
                      Case{"bert_2d", testing::WriteTinyBert, {}, 4, 1, k2D, 0, false},
                      Case{"opt_tp2", testing::WriteTinyOpt, OptProjected(), 2, 1, k1D, 0, false},
                      Case{"opt_2d", testing::WriteTinyOpt, OptProjected(), 4, 1, k2D, 0, false},
                      Case{"opt_3d", testing::WriteTinyOpt, OptProjected(), 8, 1, k3D, 0, false},
                      Case{"bloom_tp2", testing::WriteTinyBloom, Untied(), 2, 1, k1D, 0, false},
                      Case{"bloom_2p5d", testing::WriteTinyBloom, {}, 8, 1, k2P5D, 2, false},
                      Case{"bloom_3d", testing::WriteTinyBloom, Untied(), 8, 1, k3D, 0, false},
                      Case{"vit_tp2", testing::WriteTinyVit, {}, 2, 1, k1D, 0, false},
                      Case{"vit_2d", testing::WriteTinyVit, {}, 4, 1, k2D, 0, false},
                      Case{"vit_3d", testing::WriteTinyVit, {}, 8, 1, k3D, 0, false},
                      Case{"t5_tp2", testing::WriteTinyT5, testing::TinyFlanT5(), 2, 1, k1D, 0, false},
                      Case{"t5_2d", testing::WriteTinyT5, testing::TinyFlanT5(), 4, 1, k2D, 0, false},
                      Case{"t5_3d", testing::WriteTinyT5, testing::TinyFlanT5(), 8, 1, k3D, 0, false}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Pipeline stages of every family that has them (tp2 x pp2): the stages together hold every parameter of the unsplit
// model once (a tied table's mirror apart), and the fullest stage's ranks
// hold the elements the plan says.
TEST(PlannedParameters, EveryFamilysStagesHoldTheModelAndThePlannedElements) {
  struct Family {
    std::string name;
    Writer write;
    testing::TinyOptions options;
  };
  for (const Family& f : std::vector<Family>{{"gpt2", testing::WriteTinyGpt2, {}},
                                             {"llama", testing::WriteTinyLlama, Untied()},
                                             {"bert", testing::WriteTinyBert, {}},
                                             {"opt", testing::WriteTinyOpt, OptProjected()},
                                             {"bloom", testing::WriteTinyBloom, Untied()},
                                             {"vit", testing::WriteTinyVit, {}}}) {
    const std::string& name = f.name;
    testing::TinyOptions o = f.options;
    o.layers = 3;
    auto model = f.write(TempPath("plan_stages_" + name), o);
    ASSERT_TRUE(model.ok()) << model.status();
    auto names_of = [&](const v1::ShardConfig& layout) {
      std::mutex mu;
      std::map<int, std::pair<int64_t, std::set<std::string>>> held;  // rank -> elements, names
      ShardConfig shard;
      shard.layout = layout;
      auto mesh = DeviceMesh::FromShardConfig(layout);
      if (!mesh.ok()) {
        ADD_FAILURE() << mesh.status();
        return held;
      }
      colod::testing::RunMesh(*mesh, [&](int rank, ProcessGroup& pg) {
        auto sharded = ShardFormer(shard, &pg).Load(model->dir);
        ASSERT_TRUE(sharded.ok()) << name << ": " << sharded.status();
        int64_t n = 0;
        std::set<std::string> names;
        for (const NamedParam& p : (*sharded)->Parameters()) {
          n += p.bound.param.local().numel();
          if (!p.mirror) names.insert(p.name);
        }
        std::lock_guard<std::mutex> lock(mu);
        held[rank] = {n, names};
      });
      return held;
    };
    v1::ShardConfig whole;
    whole.set_tensor_parallel_size(2);
    whole.set_data_parallel_size(1);
    const std::set<std::string> all = names_of(whole)[0].second;
    // Stages of 2 and 1 layers, and of 1 and 2: the first stage the
    // fullest, then the last (with a tied table's mirror).
    for (const std::vector<int>& split : {std::vector<int>{2, 1}, std::vector<int>{1, 2}}) {
      v1::ShardConfig staged = whole;
      staged.set_pipeline_parallel_size(2);
      for (int n : split) staged.add_pipeline_stage_layers(n);
      const std::string what = absl::StrCat(name, " stages of ", split[0], " and ", split[1], " layers");
      std::set<std::string> together;
      int64_t fullest = 0;
      for (const auto& [rank, h] : names_of(staged)) {
        fullest = std::max(fullest, h.first);
        for (const std::string& n : h.second) {
          EXPECT_TRUE(all.count(n)) << what << ": rank " << rank << " holds " << n << ", which the model has not";
          together.insert(n);
        }
      }
      EXPECT_EQ(together, all) << what;
      auto planned = RankParameters(model->config, staged);
      ASSERT_TRUE(planned.ok()) << planned.status();
      EXPECT_EQ(*planned, fullest) << what;
    }
  }
}

v1::JobSpec Train(int tp, int dp, v1::TensorParallelMode mode = k1D);

using ::colod::testing::HeapInUse;

struct ActivationCase {
  std::string name;
  Writer write;
  int tp;
  bool sp = false;
  v1::TensorParallelMode mode = k1D;
  v1::Recompute recompute = v1::RECOMPUTE_NONE;
};
void PrintTo(const ActivationCase& c, std::ostream* os) { *os << c.name; }

class PlannedActivations : public ::testing::TestWithParam<ActivationCase> {};

// One training forward's loss, as the trainer computes it for the family
// (an image classifier reads `images` and takes ids[:, 0] as labels).
absl::StatusOr<LmLoss> ForwardLoss(ShardedModel& model, const Tensor& ids, const Tensor& images) {
  const std::string& type = model.config().model_type;
  if (model.config().takes_images()) {
    ASSIGN_OR_RETURN(ColoTensor logits, model.Forward(images));
    ASSIGN_OR_RETURN(Tensor first, ids.Narrow(1, 0, 1));
    ASSIGN_OR_RETURN(Tensor labels, first.Contiguous().Reshape({ids.shape()[0]}));
    return model.ClassificationLoss(logits, labels);
  }
  if (type == "t5") {
    ASSIGN_OR_RETURN(ColoTensor logits, model.Forward(ids, ids));
    return model.TokenLoss(logits, ids);
  }
  ASSIGN_OR_RETURN(ColoTensor logits, model.Forward(ids));
  if (type == "bert") return model.TokenLoss(logits, ids);
  return model.NextTokenLoss(logits, ids);
}

// The models the activation estimates are measured on: wide and long
// enough that the activations dwarf the allocator's rounding.
testing::TinyOptions ActivationModel() {
  testing::TinyOptions o;
  o.vocab = 512;
  o.hidden = 128;
  o.heads = 4;
  o.layers = 2;
  o.positions = 128;
  o.kv_heads = 2;
  o.intermediate = 384;
  o.tie = true;
  o.image = 32;  // ViT: 64 patches of 4 x 4 and the CLS token
  o.patch = 4;
  o.labels = 10;
  return o;
}

// What a training forward leaves alive for its backward (the tape's saved
// tensors, the logits and the loss), measured as the heap's growth from
// before the forward to after the loss on every rank, against the plan's
// estimate.
TEST_P(PlannedActivations, TheEstimateIsNearWhatTheTapeHolds) {
  const ActivationCase& c = GetParam();
  const testing::TinyOptions o = ActivationModel();
  auto model = c.write(TempPath("plan_act_" + c.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t batch = 4, seq = 128;
  v1::JobSpec spec = Train(c.tp, 1, c.mode);
  spec.mutable_train()->set_batch_size(batch);
  spec.mutable_train()->set_seq_len(seq);
  spec.mutable_shard()->set_sequence_parallel(c.sp);
  spec.mutable_train()->set_recompute(c.recompute);
  auto plan = PlanJob(model->config, spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ShardConfig shard;
  shard.layout = spec.shard();
  shard.recompute = c.recompute == v1::RECOMPUTE_FULL        ? Recompute::kFull
                    : c.recompute == v1::RECOMPUTE_SELECTIVE ? Recompute::kSelective
                                                             : Recompute::kNone;
  auto mesh = DeviceMesh::FromShardConfig(shard.layout);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const Tensor ids = testing::TokenIds(batch, seq, model->config.takes_images() ? o.labels : o.vocab, 5);
  auto images = Tensor::RandomNormal({batch, o.channels, o.image, o.image}, 9);
  ASSERT_TRUE(images.ok()) << images.status();
  int64_t before = 0, after = 0;
  colod::testing::RunMesh(*mesh, [&](int rank, ProcessGroup& pg) {
    ShardFormer sf(shard, &pg);
    auto sharded = sf.Load(model->dir);
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    {  // a first step makes the communicators and the gradients
      auto loss = ForwardLoss(**sharded, ids, *images);
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(Backward(loss->loss).ok());
    }
    ASSERT_TRUE(pg.Barrier().ok());
    if (rank == 0) before = HeapInUse();
    ASSERT_TRUE(pg.Barrier().ok());
    auto loss = ForwardLoss(**sharded, ids, *images);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(pg.Barrier().ok());
    if (rank == 0) after = HeapInUse();
    ASSERT_TRUE(pg.Barrier().ok());
    ASSERT_TRUE(Backward(loss->loss).ok());
  });
  const double held = static_cast<double>(after - before) / c.tp;
  const double planned = static_cast<double>(plan->activation_bytes);
  std::cerr << c.name << ": held " << held << " bytes a rank, planned " << planned << " (" << planned / held
            << ")\n";
  // Every op's output is counted, a few copies are not (in 2D and 3D the
  // blocks' gathers and partial products): the estimate is low, never
  // high, which the admission floor relies on.
  EXPECT_LE(planned, held);
  EXPECT_GE(planned, (c.mode == k1D ? 0.95 : 0.8) * held);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PlannedActivations,
    ::testing::Values(ActivationCase{"gpt2_tp1", testing::WriteTinyGpt2, 1},
                      ActivationCase{"gpt2_tp2", testing::WriteTinyGpt2, 2},
                      ActivationCase{"gpt2_tp2_sp", testing::WriteTinyGpt2, 2, true},
                      ActivationCase{"gpt2_2d", testing::WriteTinyGpt2, 4, false, k2D},
                      ActivationCase{"llama_tp1", testing::WriteTinyLlama, 1},
                      ActivationCase{"llama_tp2", testing::WriteTinyLlama, 2},
                      ActivationCase{"llama_2d", testing::WriteTinyLlama, 4, false, k2D},
                      ActivationCase{"gpt2_3d", testing::WriteTinyGpt2, 8, false, k3D},
                      ActivationCase{"llama_3d", testing::WriteTinyLlama, 8, false, k3D},
                      ActivationCase{"bert_tp2", testing::WriteTinyBert, 2},
                      ActivationCase{"bert_3d", testing::WriteTinyBert, 8, false, k3D},
                      ActivationCase{"opt_tp2", testing::WriteTinyOpt, 2},
                      ActivationCase{"bloom_tp2", testing::WriteTinyBloom, 2},
                      ActivationCase{"t5_tp2", testing::WriteTinyT5, 2},
                      ActivationCase{"vit_tp2", testing::WriteTinyVit, 2},
                      ActivationCase{"gpt2_full", testing::WriteTinyGpt2, 1, false, k1D, v1::RECOMPUTE_FULL},
                      ActivationCase{"gpt2_selective", testing::WriteTinyGpt2, 1, false, k1D, v1::RECOMPUTE_SELECTIVE},
                      ActivationCase{"llama_tp2_full", testing::WriteTinyLlama, 2, false, k1D, v1::RECOMPUTE_FULL},
                      ActivationCase{"gpt2_tp2_sp_full", testing::WriteTinyGpt2, 2, true, k1D, v1::RECOMPUTE_FULL}),
    [](const ::testing::TestParamInfo<ActivationCase>& info) { return info.param.name; });

// The same on CUDA devices (the emulation in CI): what a training forward
// leaves in each rank's device pool (colod_device_pool_bytes' used bytes)
// against the plan for CUDA workers, whose fused attention keeps no
// probabilities. The CPU plan of the same job is far above it.
class PlannedActivationsOnCuda : public ::testing::TestWithParam<ActivationCase> {};

TEST_P(PlannedActivationsOnCuda, TheEstimateIsNearWhatTheDevicePoolHolds) {
  static_assert(kPlanMaxFusedHeadDim == kernels::kMaxFusedHeadDim, "the planner's fused head dims are the kernel's");
  const ActivationCase& c = GetParam();
  if (kernels::CudaDeviceCount() < c.tp) GTEST_SKIP() << "needs " << c.tp << " CUDA devices";
  const testing::TinyOptions o = ActivationModel();
  auto model = c.write(TempPath("plan_cuda_" + c.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t batch = 4, seq = 128;
  v1::JobSpec spec = Train(c.tp, 1, c.mode);
  spec.mutable_train()->set_batch_size(batch);
  spec.mutable_train()->set_seq_len(seq);
  auto plan = PlanJob(model->config, spec, PlanDevice::kCuda);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto cpu_plan = PlanJob(model->config, spec, PlanDevice::kCpu);
  ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();
  ShardConfig shard;
  shard.layout = spec.shard();
  const Tensor ids = testing::TokenIds(batch, seq, o.vocab, 5);
  std::mutex mu;
  int64_t held = 0;  // over the ranks
  const absl::Status ran = RunOnLocalRanks(
      shard, /*cuda=*/true,
      [&](int rank, ProcessGroup& pg, const ShardConfig& on_device) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> sharded, ShardFormer(on_device, &pg).Load(model->dir));
        {  // a first step makes the communicators, the gradients and the kernels' workspaces
          ASSIGN_OR_RETURN(LmLoss loss, ForwardLoss(*sharded, ids, Tensor()));
          RETURN_IF_ERROR(Backward(loss.loss));
        }
        RETURN_IF_ERROR(pg.Barrier());
        ASSIGN_OR_RETURN(kernels::CudaPoolBytes before, kernels::GetCudaPoolBytes(rank));
        ASSIGN_OR_RETURN(LmLoss loss, ForwardLoss(*sharded, ids, Tensor()));
        ASSIGN_OR_RETURN(kernels::CudaPoolBytes after, kernels::GetCudaPoolBytes(rank));
        {
          std::lock_guard<std::mutex> lock(mu);
          held += after.used - before.used;
        }
        RETURN_IF_ERROR(pg.Barrier());
        return Backward(loss.loss);
      },
      absl::Minutes(2));
  ASSERT_TRUE(ran.ok()) << ran;
  const double per_rank = static_cast<double>(held) / c.tp;
  const double planned = static_cast<double>(plan->activation_bytes);
  std::cerr << c.name << ": held " << per_rank << " device bytes a rank, planned " << planned << " ("
            << planned / per_rank << "), planned for CPU workers " << cpu_plan->activation_bytes << "\n";
  EXPECT_LE(planned, per_rank);
  EXPECT_GE(planned, 0.95 * per_rank);
  EXPECT_GT(cpu_plan->activation_bytes, plan->activation_bytes) << "the per-head attention keeps the probabilities";
}

// Gradient accumulation: N passes of B sequences communicate what one step
// on N x B sequences in N micro-batches does (the same micro-batches), and
// keep one micro-batch's activations, as a single pass of B does.
TEST(Plan, GradientAccumulationPlansAsTheLargerBatchInMicroBatches) {
  testing::TinyOptions o;
  auto model = testing::WriteTinyGpt2(TempPath("plan_accum"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::JobSpec one = Train(2, 2);  // 16 sequences
  v1::JobSpec accum = one;
  accum.mutable_train()->set_grad_accum(2);
  v1::JobSpec micro = one;
  micro.mutable_train()->set_batch_size(32);
  micro.mutable_train()->set_micro_batches(2);
  auto p1 = PlanJob(model->config, one);
  auto pa = PlanJob(model->config, accum);
  auto pm = PlanJob(model->config, micro);
  ASSERT_TRUE(p1.ok() && pa.ok() && pm.ok()) << p1.status() << pa.status() << pm.status();
  EXPECT_EQ(pa->grad_accum, 2);
  EXPECT_EQ(pa->activation_bytes, p1->activation_bytes);
  EXPECT_EQ(pa->total_bytes, p1->total_bytes);
  EXPECT_EQ(pa->wire_bytes, pm->wire_bytes);
  ASSERT_EQ(pa->comm.size(), pm->comm.size());
  for (size_t i = 0; i < pa->comm.size(); ++i) {
    EXPECT_EQ(pa->comm[i].group, pm->comm[i].group);
    EXPECT_EQ(pa->comm[i].op, pm->comm[i].op);
    EXPECT_EQ(pa->comm[i].calls, pm->comm[i].calls) << pa->comm[i].group << " " << pa->comm[i].op;
    EXPECT_EQ(pa->comm[i].bytes, pm->comm[i].bytes) << pa->comm[i].group << " " << pa->comm[i].op;
  }
  EXPECT_GT(pa->wire_bytes, p1->wire_bytes);
}

// Selective recomputation drops the probabilities, which the fused CUDA
// attention never keeps: on CUDA workers it plans as the plain run; on the
// CPU it saves exactly the f32 [b, heads, s, s] of each attention.
TEST(Plan, SelectiveRecomputationSavesTheProbabilitiesOnlyWhereTheyAreKept) {
  testing::TinyOptions o;
  auto model = testing::WriteTinyGpt2(TempPath("plan_selective_cuda"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::JobSpec plain = Train(1, 1);
  v1::JobSpec selective = plain;
  selective.mutable_train()->set_recompute(v1::RECOMPUTE_SELECTIVE);
  auto bytes = [&](const v1::JobSpec& spec, PlanDevice device) {
    auto plan = PlanJob(model->config, spec, device);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? plan->activation_bytes : 0;
  };
  EXPECT_EQ(bytes(selective, PlanDevice::kCuda), bytes(plain, PlanDevice::kCuda));
  const int64_t probs = model->config.num_layers * 16 * model->config.num_heads * 16 * 16 * 4;  // batch 16, seq 16
  EXPECT_EQ(bytes(plain, PlanDevice::kCpu) - bytes(selective, PlanDevice::kCpu), probs);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PlannedActivationsOnCuda,
    ::testing::Values(ActivationCase{"gpt2_tp1", testing::WriteTinyGpt2, 1},
                      ActivationCase{"gpt2_tp2", testing::WriteTinyGpt2, 2},
                      ActivationCase{"llama_tp1", testing::WriteTinyLlama, 1},
                      ActivationCase{"bloom_tp1", testing::WriteTinyBloom, 1}),
    [](const ::testing::TestParamInfo<ActivationCase>& info) { return info.param.name; });

v1::JobSpec Train(int tp, int dp, v1::TensorParallelMode mode) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  spec.mutable_shard()->set_tensor_parallel_size(tp);
  spec.mutable_shard()->set_data_parallel_size(dp);
  spec.mutable_shard()->set_tensor_parallel_mode(mode);
  spec.mutable_train()->set_batch_size(16);
  spec.mutable_train()->set_seq_len(16);  // the tiny models' positions
  return spec;
}

// TrainFlopsPerToken against the models' own tensors: 6 times every
// weight and bias a token's matrix multiplies read (the file's tensors
// less the embedding tables and the norms, a tied head's table counted as
// the head), plus 12 L S H; and against GPT-2 124M's closed form.
TEST(Plan, TrainFlopsPerTokenCountsEveryMatrixMultiplyOfTheFile) {
  auto matmul = [](const testing::TinyModel& m, const std::vector<std::string>& not_matmul) {
    double n = 0;
    for (const auto& entry : m.tensors) {
      const std::string& name = entry.first;  // (a structured binding cannot be captured in C++17)
      const bool skip = std::any_of(not_matmul.begin(), not_matmul.end(),
                                    [&](const std::string& part) { return name.find(part) != std::string::npos; });
      if (!skip) n += static_cast<double>(entry.second.numel());
    }
    return n;
  };
  testing::TinyOptions tied;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("flops_gpt2"), tied);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  const ModelConfig& g = gpt2->config;
  const double head = static_cast<double>(g.vocab_size * g.hidden_size);
  auto flops = TrainFlopsPerToken(g, 16);
  ASSERT_TRUE(flops.ok()) << flops.status();
  EXPECT_DOUBLE_EQ(*flops, 6 * (matmul(*gpt2, {"wte", "wpe", "ln_"}) + head) + 12.0 * g.num_layers * 16 * g.hidden_size);

  auto llama = testing::WriteTinyLlama(TempPath("flops_llama"), Untied());
  ASSERT_TRUE(llama.ok()) << llama.status();
  const ModelConfig& l = llama->config;
  flops = TrainFlopsPerToken(l, 16);
  ASSERT_TRUE(flops.ok()) << flops.status();
  EXPECT_DOUBLE_EQ(*flops, 6 * matmul(*llama, {"embed_tokens", "norm"}) + 12.0 * l.num_layers * 16 * l.hidden_size);

  // ViT: per image, its S = patches + 1 tokens through the layers, the
  // patches' convolution on each patch and the classifier once.
  auto vit = testing::WriteTinyVit(TempPath("flops_vit"), {});
  ASSERT_TRUE(vit.ok()) << vit.status();
  const ModelConfig& v = vit->config;
  const double s = static_cast<double>(v.max_positions);
  const double layers = matmul(*vit, {"embeddings", "layernorm", "classifier"});
  const double patch = matmul(*vit, {"cls_token", "position_embeddings", "encoder", "layernorm", "classifier"});
  const double classifier = matmul(*vit, {"embeddings", "encoder", "layernorm"});
  flops = TrainFlopsPerToken(v, 1);
  ASSERT_TRUE(flops.ok()) << flops.status();
  EXPECT_DOUBLE_EQ(*flops, s * (6 * layers + 12.0 * v.num_layers * s * v.hidden_size) + (s - 1) * 6 * patch +
                               6 * classifier);

  // GPT-2 124M at 1024 tokens: 6 (12 L h^2 + 9 L h + V h) + 12 L S h.
  ModelConfig small = g;
  small.vocab_size = 50257;
  small.hidden_size = 768;
  small.num_layers = 12;
  small.num_heads = 12;
  small.intermediate_size = 3072;
  small.max_positions = 1024;
  flops = TrainFlopsPerToken(small, 1024);
  ASSERT_TRUE(flops.ok()) << flops.status();
  const double h = 768, L = 12;
  EXPECT_DOUBLE_EQ(*flops, 6 * (12 * L * h * h + 9 * L * h + 50257 * h) + 12 * L * 1024 * h);
  EXPECT_NEAR(*flops / 1e9, 0.8549, 1e-4) << "about 7 x 124M";

  auto t5 = testing::WriteTinyT5(TempPath("flops_t5"), {});
  ASSERT_TRUE(t5.ok()) << t5.status();
  EXPECT_EQ(TrainFlopsPerToken(t5->config, 16).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(TrainFlopsPerToken(g, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// The peak MFU divides by: the devices' sum for the spec's dtype, or 0
// as soon as one is not known (no MFU rather than a wrong one).
TEST(Plan, PeakFlopsAreTheDevicesSumForTheJobsDtype) {
  auto device = [](v1::DeviceKind kind, double f32, double tf32, double bf16, double f16) {
    v1::WorkerInfo w;
    w.set_device_kind(kind);
    w.mutable_peak()->set_f32(f32);
    w.mutable_peak()->set_tf32(tf32);
    w.mutable_peak()->set_bf16(bf16);
    w.mutable_peak()->set_f16(f16);
    return w;
  };
  const v1::WorkerInfo gpu = device(v1::DEVICE_KIND_CUDA, 67e12, 494.7e12, 989.4e12, 989.4e12);
  v1::JobSpec spec = Train(2, 1);
  EXPECT_DOUBLE_EQ(PeakFlopsOf(spec, {gpu, gpu}), 2 * 989.4e12) << "a GPU's default: bf16";
  spec.mutable_train()->set_precision(v1::PRECISION_FP32);
  EXPECT_DOUBLE_EQ(PeakFlopsOf(spec, {gpu, gpu}), 2 * 67e12);
  spec.mutable_train()->set_allow_tf32(true);
  EXPECT_DOUBLE_EQ(PeakFlopsOf(spec, {gpu, gpu}), 2 * 494.7e12);
  spec.mutable_train()->set_precision(v1::PRECISION_FP16_MIXED);
  EXPECT_DOUBLE_EQ(PeakFlopsOf(spec, {gpu}), 989.4e12);
  spec = Train(2, 1);
  const v1::WorkerInfo cpu = device(v1::DEVICE_KIND_CPU, 1e12, 1e12, 1e12, 1e12);
  EXPECT_DOUBLE_EQ(PeakFlopsOf(spec, {cpu, cpu, cpu}), 3e12) << "a CPU's default: f32";
  EXPECT_EQ(PeakFlopsOf(spec, {cpu, v1::WorkerInfo()}), 0) << "one device not known";
  EXPECT_EQ(PeakFlopsOf(spec, {cpu, device(v1::DEVICE_KIND_CPU, -1, 0, 0, 0)}), 0);
  EXPECT_EQ(PeakFlopsOf(spec, {cpu, device(v1::DEVICE_KIND_CPU, std::nan(""), 0, 0, 0)}), 0);
  EXPECT_EQ(PeakFlopsOf(spec, {device(v1::DEVICE_KIND_CPU, 1e308, 0, 0, 0), device(v1::DEVICE_KIND_CPU, 1e308, 0, 0, 0)}),
            0)
      << "an overflowing sum";
  EXPECT_EQ(PeakFlopsOf(spec, {}), 0);
}

// Pipeline stages: RankParameters is the fullest stage's count, which the
// admission floor uses (GPT-2's last stage holds the tied head's table too).
TEST(Plan, PipelineStagesHoldTheFullestStagesParameters) {
  testing::TinyOptions o;
  o.layers = 4;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("plan_pp_gpt2"), o);
  o.tie = false;
  auto llama = testing::WriteTinyLlama(TempPath("plan_pp_llama"), o);
  ASSERT_TRUE(gpt2.ok() && llama.ok());
  struct PpCase {
    const testing::TinyModel* model;
    int tp, pp;
    std::vector<int> layers;
  };
  for (const PpCase& c : {PpCase{&*gpt2, 2, 2, {3, 1}}, PpCase{&*gpt2, 1, 4, {}}, PpCase{&*llama, 2, 2, {1, 3}}}) {
    ShardConfig shard;
    shard.layout.set_tensor_parallel_size(c.tp);
    shard.layout.set_data_parallel_size(1);
    shard.layout.set_pipeline_parallel_size(c.pp);
    for (int n : c.layers) shard.layout.add_pipeline_stage_layers(n);
    auto planned = RankParameters(c.model->config, shard.layout);
    ASSERT_TRUE(planned.ok()) << planned.status();
    std::mutex mu;
    int64_t most = 0;
    colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
      auto sharded = ShardFormer(shard, &pg).Load(c.model->dir);
      ASSERT_TRUE(sharded.ok()) << sharded.status();
      int64_t n = 0;
      for (const NamedParam& p : (*sharded)->Parameters()) n += p.bound.param.local().numel();
      std::lock_guard<std::mutex> lock(mu);
      most = std::max(most, n);
    });
    EXPECT_EQ(most, *planned) << c.model->config.model_type << " tp" << c.tp << " pp" << c.pp;
  }
  // PlanJob plans the fullest stage: its parameters are RankParameters'.
  v1::JobSpec spec = Train(2, 1);
  spec.mutable_shard()->set_pipeline_parallel_size(2);
  auto plan = PlanJob(gpt2->config, spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->rank_parameters, *RankParameters(gpt2->config, spec.shard()));
  EXPECT_GE(plan->pipeline_stage, 0);
  spec.set_kind(v1::JOB_KIND_FORWARD);
  EXPECT_EQ(PlanJob(gpt2->config, spec).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Plan, MemoryFollowsPrecisionAndOptimizerAndActivationsShrinkWithTp) {
  testing::TinyOptions o;
  auto model = testing::WriteTinyGpt2(TempPath("plan_memory"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::JobSpec spec = Train(1, 1);
  auto f32 = PlanJob(model->config, spec);
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(f32->seq_len, 16);
  EXPECT_EQ(f32->batch_size, 16);
  EXPECT_EQ(f32->rank_parameters, f32->parameters) << "tp = 1 holds everything, unpadded";
  EXPECT_EQ(f32->param_bytes, 4 * f32->parameters);
  EXPECT_EQ(f32->grad_bytes, 4 * f32->parameters);
  EXPECT_EQ(f32->optimizer_bytes, 8 * f32->parameters) << "AdamW: two f32 moments";
  EXPECT_TRUE(f32->comm.empty()) << "one rank moves nothing";
  spec.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
  spec.mutable_train()->set_optimizer(v1::OPTIMIZER_SGD);
  auto bf16 = PlanJob(model->config, spec);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->param_bytes, 2 * f32->parameters);
  EXPECT_EQ(bf16->optimizer_bytes, 8 * f32->parameters) << "SGD: an f32 momentum and an f32 master copy";
  EXPECT_LT(bf16->activation_bytes, f32->activation_bytes) << "activations in the parameters' dtype (logits stay f32)";

  auto tp2 = PlanJob(model->config, Train(2, 1));
  ASSERT_TRUE(tp2.ok()) << tp2.status();
  EXPECT_LT(tp2->activation_bytes, f32->activation_bytes);
  EXPECT_GT(tp2->activation_bytes, f32->activation_bytes / 2) << "the replicated inputs stay whole";
  v1::JobSpec sp = Train(2, 1);
  sp.mutable_shard()->set_sequence_parallel(true);
  auto with_sp = PlanJob(model->config, sp);
  ASSERT_TRUE(with_sp.ok()) << with_sp.status();
  // Sequence parallelism splits the norms and residuals by rows and keeps
  // neither a column-parallel layer's gathered input nor a row-parallel
  // product before its reduce-scatter (nn::GatheredLinear, ScatteredLinear):
  // less than 1D alone (PlannedActivations holds both against the tape).
  EXPECT_LT(with_sp->activation_bytes, tp2->activation_bytes);
  // Full recomputation keeps the blocks' inputs only; selective all but the
  // probabilities.
  v1::JobSpec full = Train(2, 1);
  full.mutable_train()->set_recompute(v1::RECOMPUTE_FULL);
  auto recomputed = PlanJob(model->config, full);
  ASSERT_TRUE(recomputed.ok()) << recomputed.status();
  EXPECT_LT(3 * recomputed->activation_bytes, tp2->activation_bytes);
  full.mutable_train()->set_recompute(v1::RECOMPUTE_SELECTIVE);
  auto selective = PlanJob(model->config, full);
  ASSERT_TRUE(selective.ok()) << selective.status();
  EXPECT_LT(selective->activation_bytes, tp2->activation_bytes);
  EXPECT_GT(selective->activation_bytes, recomputed->activation_bytes);
}

TEST(Plan, RefusesWhatThePoliciesRefuse) {
  testing::TinyOptions o;
  auto gpt2 = testing::WriteTinyGpt2(TempPath("plan_refuse_gpt2"), o);
  auto bert = testing::WriteTinyBert(TempPath("plan_refuse_bert"), o);
  ASSERT_TRUE(gpt2.ok() && bert.ok());
  auto heads = PlanJob(gpt2->config, Train(8, 1));  // 4 heads
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.status().message().find("heads"), std::string::npos) << heads.status();
  auto vit = testing::WriteTinyVit(TempPath("plan_refuse_vit"), o);
  ASSERT_TRUE(vit.ok()) << vit.status();
  v1::JobSpec vit_sp = Train(2, 1);
  vit_sp.mutable_shard()->set_sequence_parallel(true);
  auto vit_refused = PlanJob(vit->config, vit_sp);
  EXPECT_NE(vit_refused.status().message().find("the vit policy has no sequence_parallel: its sequence"),
            std::string::npos)
      << vit_refused.status();
  auto opt = testing::WriteTinyOpt(TempPath("plan_refuse_opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  auto t5 = testing::WriteTinyT5(TempPath("plan_refuse_t5"), testing::TinyFlanT5());
  ASSERT_TRUE(t5.ok()) << t5.status();
  EXPECT_TRUE(PlanJob(t5->config, Train(4, 1, k2D)).ok());
  v1::JobSpec stages = Train(1, 1);
  stages.mutable_shard()->set_pipeline_parallel_size(2);
  EXPECT_TRUE(PlanJob(opt->config, stages).ok()) << "every single-stack family has stages";
  EXPECT_TRUE(PlanJob(t5->config, stages).ok()) << "t5 has encoder and decoder stages";
  stages.mutable_shard()->add_pipeline_stage_layers(1);  // the encoder's 2 layers and the decoder's 2
  stages.mutable_shard()->add_pipeline_stage_layers(3);
  auto across = PlanJob(t5->config, stages);
  EXPECT_NE(across.status().message().find("holds both the encoder's and the decoder's"), std::string::npos)
      << across.status();
  v1::JobSpec sp_3d = Train(8, 1, k3D);
  sp_3d.mutable_shard()->set_sequence_parallel(true);
  EXPECT_EQ(PlanJob(gpt2->config, sp_3d).status().code(), absl::StatusCode::kInvalidArgument);
  v1::JobSpec uneven = Train(1, 3);
  auto batch = PlanJob(gpt2->config, uneven);  // 16 rows over 3 replicas
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(batch.status().message().find("batch_size"), std::string::npos) << batch.status();
  v1::JobSpec huge = Train(1, 1);
  huge.mutable_train()->set_batch_size(2147483647);
  huge.mutable_train()->set_seq_len(16);
  auto overflow = PlanJob(gpt2->config, huge);
  EXPECT_TRUE(overflow.ok() || overflow.status().code() == absl::StatusCode::kInvalidArgument) << overflow.status();
}

// A pipeline stage posts each channel's next receive ahead of the task that
// reads it (worker/train/pipeline.cc): one block of the stream [rows, seq,
// hidden] held besides the micro-batches' activations. The first stage (the
// fullest: the embeddings, and under 1F1B at pp = 2 two micro-batches
// alive) keeps A + b over one micro-batch of R rows and 2 A + b over two:
// twice the first plan less the second is the block, exactly.
TEST(Plan, APipelineStagePlansTheReceivesItPostsAhead) {
  testing::TinyOptions o;
  auto model = testing::WriteTinyGpt2(TempPath("plan_posted"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  auto plan_of = [&](int micro) {
    v1::JobSpec spec = Train(1, 1);
    spec.mutable_shard()->set_pipeline_parallel_size(2);
    spec.mutable_train()->set_micro_batches(micro);
    spec.mutable_train()->set_batch_size(4 * micro);  // 4 rows a micro-batch
    auto plan = PlanJob(model->config, spec);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : JobPlan();
  };
  const JobPlan one = plan_of(1), two = plan_of(2);
  const int64_t block = 4 * 16 * o.hidden * 4;  // rows x seq x hidden, f32
  ASSERT_EQ(one.pipeline_stage, 0);
  ASSERT_EQ(two.pipeline_stage, 0);
  EXPECT_EQ(2 * one.activation_bytes - two.activation_bytes, block);
}

// Interleaved 1F1B: a pipeline rank holds its V chunks' layers (as many
// as at V = 1 with even stages), V times the micro-batches' sends, the
// bubble (p - 1) / (V m + p - 1), and the warm-up's chunk forwards alive:
// min(2 (p - s - 1) + (V - 1) p + 1, V m) of a V-th of a micro-batch's
// activations through all of its chunks.
TEST(Plan, AnInterleavedPipelineHoldsItsChunksAndCutsTheBubble) {
  testing::TinyOptions o;
  o.layers = 8;
  auto model = testing::WriteTinyGpt2(TempPath("plan_interleaved"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  auto plan_of = [&](int v) {
    v1::JobSpec spec = Train(1, 1);
    spec.mutable_shard()->set_pipeline_parallel_size(2);
    spec.mutable_shard()->set_virtual_stages(v);
    spec.mutable_train()->set_micro_batches(4);
    auto plan = PlanJob(model->config, spec);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : JobPlan();
  };
  const JobPlan plain = plan_of(1), interleaved = plan_of(2);
  EXPECT_DOUBLE_EQ(plain.bubble_fraction, 1.0 / 5);
  EXPECT_DOUBLE_EQ(interleaved.bubble_fraction, 1.0 / 9);
  ASSERT_EQ(plain.pipeline_stage, interleaved.pipeline_stage);
  EXPECT_EQ(interleaved.rank_parameters, plain.rank_parameters);
  // Rank 0 (the fullest: it holds the embeddings): 1F1B keeps 2 micro-batches
  // through its 4 layers; the interleaved schedule 2 (p - 1) + (V - 1) p + 1
  // = 5 chunk forwards, 3 of chunk 0 (the embeddings and 2 layers) and 2 of
  // chunk 1 (2 layers): 10 layers' activations against 8, 3 embeddings'
  // against 2.
  ASSERT_EQ(plain.pipeline_stage, 0);
  EXPECT_GT(interleaved.activation_bytes, plain.activation_bytes * 5 / 4);
  EXPECT_LT(interleaved.activation_bytes, plain.activation_bytes * 3 / 2);
  std::map<std::pair<std::string, std::string>, int64_t> calls;
  for (const PlanComm& c : interleaved.comm) calls[{c.group, c.op}] = c.calls;
  // Both chunks' forwards on to rank 1, chunk 1's inputs from rank 1's
  // chunk 0 on the wrap channel; the tied table's owner takes the last
  // stage's gradient once and sends the sum back once.
  EXPECT_EQ((calls[{"pp#f0", "send"}]), 2 * 4);
  EXPECT_EQ((calls[{"pp#f0", "recv"}]), 1);
  EXPECT_EQ((calls[{"pp#fw", "recv"}]), 4);
  EXPECT_EQ((calls[{"pp#bw", "send"}]), 4);
  EXPECT_EQ((calls[{"pp#b1", "recv"}]), 2 * 4);
  EXPECT_EQ((calls[{"pp#b1", "send"}]), 1);
  v1::ShardConfig layout;
  layout.set_tensor_parallel_size(1);
  layout.set_data_parallel_size(1);
  layout.set_pipeline_parallel_size(2);
  layout.set_virtual_stages(2);
  EXPECT_EQ(LayoutName(layout), "tp1 x pp2v2 x dp1 1d");
  // Micro-batches the schedule cannot group by the stages are refused, as
  // the coordinator refuses them; a layout search keeps V for its pipelined
  // layouts only.
  v1::JobSpec three = Train(1, 1);
  three.mutable_shard()->set_pipeline_parallel_size(2);
  three.mutable_shard()->set_virtual_stages(2);
  three.mutable_train()->set_batch_size(12);
  three.mutable_train()->set_micro_batches(3);
  auto refused = PlanJob(model->config, three);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("micro_batches 3 is not a multiple of 2"), std::string::npos)
      << refused.status();
  v1::JobSpec search = Train(1, 1);
  search.mutable_shard()->set_virtual_stages(2);
  search.mutable_train()->set_micro_batches(4);
  auto all = RankLayouts(model->config, search, 4, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  int interleaved_fits = 0;
  for (const RankedLayout& l : all->fits) {
    EXPECT_EQ(l.shard.virtual_stages() > 1, l.shard.pipeline_parallel_size() > 1) << LayoutName(l.shard);
    interleaved_fits += l.shard.virtual_stages() > 1;
  }
  EXPECT_GT(interleaved_fits, 0);
}

TEST(Plan, RanksLayoutsByCommunicationAndLeavesOutWhatDoesNotFit) {
  testing::TinyOptions o;
  o.heads = 4;
  auto model = testing::WriteTinyGpt2(TempPath("plan_rank"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::JobSpec spec = Train(1, 1);
  auto all = RankLayouts(model->config, spec, 4, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  for (const std::string& r : all->refused) std::cerr << "refused: " << r << "\n";
  std::vector<std::string> names;
  for (const RankedLayout& l : all->fits) names.push_back(LayoutName(l.shard));
  // tp4 x dp1 1d, tp2 x dp2 1d, tp1 x dp4 1d and tp4 x dp1 2d; with two
  // stages (the model's 2 layers) tp2 x pp2 x dp1 1d and tp1 x pp2 x dp2 1d.
  ASSERT_EQ(all->fits.size(), 6u) << ::testing::PrintToString(names);
  for (const RankedLayout& l : all->fits) {
    const int pp = std::max(1, l.shard.pipeline_parallel_size());
    EXPECT_EQ(l.shard.tensor_parallel_size() * pp * l.shard.data_parallel_size(), 4) << LayoutName(l.shard);
    // One micro-batch: the 1F1B bubble of 2 stages is half the step.
    EXPECT_DOUBLE_EQ(l.plan.bubble_fraction, pp == 1 ? 0.0 : 0.5) << LayoutName(l.shard);
    EXPECT_EQ(l.plan.pipeline_stage >= 0, pp > 1) << LayoutName(l.shard);
    // Each is the plan PlanJob makes of it.
    v1::JobSpec one = spec;
    *one.mutable_shard() = l.shard;
    auto direct = PlanJob(model->config, one);
    ASSERT_TRUE(direct.ok()) << direct.status();
    EXPECT_EQ(direct->wire_bytes, l.plan.wire_bytes) << LayoutName(l.shard);
    EXPECT_EQ(direct->total_bytes, l.plan.total_bytes) << LayoutName(l.shard);
  }
  EXPECT_NE(std::find(names.begin(), names.end(), "tp2 x pp2 x dp1 1d"), names.end())
      << ::testing::PrintToString(names);
  bool refused_pp4 = false;
  for (const std::string& r : all->refused) {
    refused_pp4 = refused_pp4 || (r.find("pp4") != std::string::npos && r.find("more stages") != std::string::npos);
  }
  EXPECT_TRUE(refused_pp4) << ::testing::PrintToString(all->refused);
  // More micro-batches shrink the bubble: (P - 1) / (M + P - 1).
  v1::JobSpec micro = spec;
  micro.mutable_train()->set_micro_batches(4);
  auto four_micro = RankLayouts(model->config, micro, 4, 0);
  ASSERT_TRUE(four_micro.ok()) << four_micro.status();
  for (const RankedLayout& l : four_micro->fits) {
    if (l.shard.pipeline_parallel_size() == 2) {
      EXPECT_DOUBLE_EQ(l.plan.bubble_fraction, 1.0 / 5);
    }
  }
  // An encoder-decoder's layouts include its encoder and decoder stages.
  auto t5 = testing::WriteTinyT5(TempPath("plan_rank_t5"), testing::TinyFlanT5());
  ASSERT_TRUE(t5.ok()) << t5.status();
  auto t5_layouts = RankLayouts(t5->config, spec, 4, 0);
  ASSERT_TRUE(t5_layouts.ok()) << t5_layouts.status();
  bool t5_staged = false;
  for (const RankedLayout& l : t5_layouts->fits) t5_staged = t5_staged || l.shard.pipeline_parallel_size() == 2;
  EXPECT_TRUE(t5_staged) << ::testing::PrintToString(t5_layouts->refused);
  auto bert = testing::WriteTinyBert(TempPath("plan_rank_bert"), o);
  ASSERT_TRUE(bert.ok()) << bert.status();
  auto bert_layouts = RankLayouts(bert->config, spec, 4, 0);
  ASSERT_TRUE(bert_layouts.ok()) << bert_layouts.status();
  bool bert_staged = false;
  for (const RankedLayout& l : bert_layouts->fits) bert_staged = bert_staged || l.shard.pipeline_parallel_size() == 2;
  EXPECT_TRUE(bert_staged) << "bert has pipeline stages";
  v1::JobSpec forward = spec;
  forward.set_kind(v1::JOB_KIND_FORWARD);
  auto forward_layouts = RankLayouts(model->config, forward, 4, 0);
  ASSERT_TRUE(forward_layouts.ok()) << forward_layouts.status();
  EXPECT_EQ(forward_layouts->fits.size(), 4u);
  for (const RankedLayout& l : forward_layouts->fits) EXPECT_LE(l.shard.pipeline_parallel_size(), 1);
  for (size_t i = 1; i < all->fits.size(); ++i) {
    EXPECT_LE(all->fits[i - 1].plan.wire_bytes, all->fits[i].plan.wire_bytes) << ::testing::PrintToString(names);
  }
  // Each layout's wire bytes are its collectives' (the ring formulas).
  for (const RankedLayout& l : all->fits) {
    int64_t sum = 0;
    for (const PlanComm& c : l.plan.comm) sum += c.wire_bytes;
    EXPECT_EQ(l.plan.wire_bytes, sum) << LayoutName(l.shard);
  }
  bool refused_3d = false;
  for (const std::string& r : all->refused) refused_3d = refused_3d || r.find("3d") != std::string::npos;
  EXPECT_FALSE(refused_3d) << "4 ranks make no cube: 3d is not a candidate";
  // 8 ranks: 3d (q = 2) is one of the layouts that fit.
  auto eight = RankLayouts(model->config, spec, 8, 0);
  ASSERT_TRUE(eight.ok()) << eight.status();
  bool has_3d = false;
  for (const RankedLayout& l : eight->fits) has_3d = has_3d || LayoutName(l.shard) == "tp8 x dp1 3d";
  EXPECT_TRUE(has_3d) << ::testing::PrintToString(eight->refused);
  // A budget between the smallest and the largest footprint leaves some out, with the reason.
  int64_t least = INT64_MAX, most = 0;
  for (const RankedLayout& l : all->fits) {
    least = std::min(least, l.plan.total_bytes);
    most = std::max(most, l.plan.total_bytes);
  }
  ASSERT_LT(least, most);
  auto some = RankLayouts(model->config, spec, 4, least);
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_LT(some->fits.size(), all->fits.size());
  for (const RankedLayout& l : some->fits) EXPECT_LE(l.plan.total_bytes, least);
  ASSERT_FALSE(some->refused.empty());
  EXPECT_NE(some->refused.back().find("per rank, more than"), std::string::npos) << some->refused.back();
}

}  // namespace
}  // namespace colod::shardformer
