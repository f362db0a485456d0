// What a GPU training step asks of the device, counted (issue: a step at the
// speed of the hardware). GPT-2 at tp=2 dp=2 on 4 devices: after warm-up a
// step takes no new device memory (tensors come from each device's pool,
// which keeps what it reserved). On the CUDA emulation the counters also give
// the host synchronizations, polls and kernel launches per step: work is
// stream ordered, so the host waits only where it reads a value.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <cstdio>
#include <string>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

struct Sample {
  uint64_t reserved = 0;  // the devices' pools, summed
#ifdef COLOD_CUDA_EMULATION
  colod_cuda_emu::Counters counters;  // the process's: the 4 ranks together
  colod_cuda_emu::Counters rank0;     // rank 0's own (its thread takes the sample)
#endif
};

// Host synchronizations per rank and warm step (the emulation counts them):
// one, the read of the loss and the grad norm together after the update is
// enqueued (the clipping factor is computed on the device).
constexpr uint64_t kMaxHostSyncsPerRankStep = 1;

Sample Take(int devices) {
  Sample s;
  for (int d = 0; d < devices; ++d) {
    cudaMemPool_t pool = nullptr;
    uint64_t v = 0;
    EXPECT_EQ(cudaDeviceGetDefaultMemPool(&pool, d), cudaSuccess);
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &v), cudaSuccess);
    s.reserved += v;
  }
#ifdef COLOD_CUDA_EMULATION
  s.counters = colod_cuda_emu::GetCounters();
  s.rank0 = colod_cuda_emu::GetThreadCounters();
#endif
  return s;
}

// Trains a tiny GPT-2 of `layers` layers at tp=2 dp=2 on 4 devices for
// `steps` steps; after[i] is sampled on rank 0's thread when it finished
// step i + 1.
// `drains`: as a worker daemon's rank of a job that saves checkpoints
// (save_dir set, none saved but the last step's), taking part in drains
// (RankHooks::drain), none asked.
void TrainTiny(int64_t layers, int64_t steps, std::vector<Sample>& after, std::vector<StepStats>& stats,
               DType dtype = DType::kF32, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D,
               bool drains = false) {
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = kByteVocab;
  tiny.positions = 32;
  tiny.layers = layers;
  auto model = shardformer::testing::WriteTinyGpt2(colod::testing::TempPath("gpu_step_" + std::to_string(layers)), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o;
  o.model_dir = model->dir;
  o.data_path = "/usr/share/common-licenses/GPL-3";
  o.steps = steps;
  o.batch_size = 8;
  o.seq_len = 32;
  o.lr = 3e-3;
  o.clip_norm = 1.0;
  o.seed = 7;
  o.cuda = true;
  o.bucket_bytes = 64 << 10;
  const bool two_d = mode == v1::TENSOR_PARALLEL_MODE_2D;  // tp=4 as a 2x2 mesh, else tp=2 dp=2
  o.shard.layout.set_tensor_parallel_size(two_d ? 4 : 2);
  o.shard.layout.set_data_parallel_size(two_d ? 1 : 2);
  o.shard.layout.set_tensor_parallel_mode(mode);
  o.shard.param_dtype = dtype;
  if (!drains) {
    ASSERT_TRUE(Train(o, [&](const StepStats& st) {
                  after.push_back(Take(4));
                  stats.push_back(st);
                }).ok());
  } else {
    o.save_dir = colod::testing::TempPath("gpu_step_drains");
    o.save_every = 1000;
    auto run = PrepareTrain(o);
    ASSERT_TRUE(run.ok()) << run.status();
    RankHooks hooks;
    hooks.on_step = [&](const StepStats& st) {
      if (st.rank != 0) return;
      after.push_back(Take(4));
      stats.push_back(st);
    };
    hooks.drain = [] { return false; };
    const absl::Status s = shardformer::RunOnLocalRanks(
        o.shard, true,
        [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
          return RunTrainRank(**run, rank, pg, shard, hooks);
        },
        o.comm_timeout);
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_EQ(after.size(), static_cast<size_t>(steps));
}

TEST(GpuStep, AfterWarmUpAStepTakesNoNewDeviceMemory) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  std::vector<Sample> after;  // after[i]: when rank 0 finished step i + 1
  std::vector<StepStats> stats;
  TrainTiny(/*layers=*/2, /*steps=*/10, after, stats);
  if (HasFatalFailure()) return;
  // Each step reports its device's pool (the worker's colod_device_pool_bytes).
  ASSERT_EQ(stats.size(), 10u);
  EXPECT_TRUE(stats[9].cuda);
  EXPECT_GT(stats[9].pool_reserved_bytes, 0);
  EXPECT_GE(stats[9].pool_reserved_bytes, stats[9].pool_used_bytes);
  EXPECT_GE(stats[9].pool_used_bytes, stats[9].param_bytes);
  // The host's wait in the step's one read is part of the step.
  for (const StepStats& st : stats) {
    EXPECT_GE(st.device_wait_seconds, 0.0);
    EXPECT_LE(st.device_wait_seconds, st.seconds) << "step " << st.step;
    EXPECT_GT(st.enqueue_seconds, 0.0) << "step " << st.step;
  }
  ASSERT_EQ(after.size(), 10u);
  // Steps 1 and 2 warm up (the optimizer's state appears in step 1); the
  // other ranks are at most a step behind rank 0, so steps 4 to 10 are warm
  // on every rank.
  EXPECT_GT(after[0].reserved, 0u);
  EXPECT_EQ(after[9].reserved, after[2].reserved) << "a warm step grew the devices' pools";
#ifdef COLOD_CUDA_EMULATION
  EXPECT_EQ(after[9].counters.device_allocations, after[2].counters.device_allocations)
      << "a warm step asked a device for memory";
  // Rank 0's own calls, step by step: exact, whatever the other ranks do.
  for (size_t i = 3; i < after.size(); ++i) {
    EXPECT_EQ(after[i].rank0.device_allocations, after[i - 1].rank0.device_allocations) << "step " << i + 1;
    // Before stream order every op synchronized: about 700 per rank and
    // step. Then the host read the loss at the end of forward and the grad
    // norm before the update, and the device drained twice a step; now it
    // reads both once, after the update is enqueued.
    EXPECT_LE(after[i].rank0.host_synchronizations - after[i - 1].rank0.host_synchronizations,
              kMaxHostSyncsPerRankStep)
        << "rank 0's host synchronizations in step " << i + 1;
    // Token ids, labels and the embedding's index arrays go up through the
    // pinned staging buffers: no copy from pageable memory, which a driver
    // may serve by waiting for the stream.
    EXPECT_EQ(after[i].rank0.pageable_uploads, after[i - 1].rank0.pageable_uploads) << "step " << i + 1;
  }
  const auto per_step = [&](uint64_t colod_cuda_emu::Counters::*field) {
    return (after[9].counters.*field - after[2].counters.*field) / 7;
  };
  std::printf("per step, 4 ranks (GPT-2 tiny, 2 layers): %llu host synchronizations, %llu polls, %llu launches\n",
              static_cast<unsigned long long>(per_step(&colod_cuda_emu::Counters::host_synchronizations)),
              static_cast<unsigned long long>(per_step(&colod_cuda_emu::Counters::stream_queries)),
              static_cast<unsigned long long>(per_step(&colod_cuda_emu::Counters::kernel_launches)));
#endif
}

#ifdef COLOD_CUDA_EMULATION
// 2D (tp=4 as a 2x2 mesh): the sharded LayerNorms compute their statistics
// on the devices and all-reduce them there, so a warm step still reads only
// the loss and the grad norm on the host, once, and takes no device memory.
TEST(GpuStep, TwoDimensionalStepsReadOnlyTheLossAndTheNorm) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  std::vector<Sample> after;
  std::vector<StepStats> stats;
  TrainTiny(/*layers=*/2, /*steps=*/6, after, stats, DType::kF32, v1::TENSOR_PARALLEL_MODE_2D);
  if (HasFatalFailure()) return;
  for (size_t i = 3; i < after.size(); ++i) {
    EXPECT_EQ(after[i].rank0.device_allocations, after[i - 1].rank0.device_allocations) << "step " << i + 1;
    EXPECT_LE(after[i].rank0.host_synchronizations - after[i - 1].rank0.host_synchronizations,
              kMaxHostSyncsPerRankStep)
        << "rank 0's host synchronizations in 2d step " << i + 1;
  }
}

// A rank that takes part in drains (a worker daemon's, of a job that saves
// checkpoints) adds one all-reduce of one element a mesh axis to each step,
// made and reduced on the devices: a warm step still synchronizes the host
// once, uploads nothing from pageable memory and takes no device memory.
TEST(GpuStep, ADrainsAgreementAddsNoHostSynchronization) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  std::vector<Sample> after;
  std::vector<StepStats> stats;
  TrainTiny(/*layers=*/2, /*steps=*/7, after, stats, DType::kF32, v1::TENSOR_PARALLEL_MODE_1D, /*drains=*/true);
  if (HasFatalFailure()) return;
  for (size_t i = 3; i + 1 < after.size(); ++i) {  // steps 4 to 6: the last saves its checkpoint
    EXPECT_EQ(after[i].rank0.device_allocations, after[i - 1].rank0.device_allocations) << "step " << i + 1;
    EXPECT_LE(after[i].rank0.host_synchronizations - after[i - 1].rank0.host_synchronizations, kMaxHostSyncsPerRankStep)
        << "rank 0's host synchronizations in step " << i + 1;
    EXPECT_EQ(after[i].rank0.pageable_uploads, after[i - 1].rank0.pageable_uploads) << "step " << i + 1;
  }
}

// The host runs a step ahead of the device: it reads step n (its loss and
// grad norm) once it has enqueued step n + 1, so the device starts a step
// without waiting for the host's report, batch and launches. The last step
// is read at once. Rank 0's counters at each report: the report of step 4
// comes after step 5's launches (as many as step 4's, between the reports
// of 2 and 3), and the report of step 5 after no launch, one synchronization.
TEST(GpuStep, TheHostEnqueuesTheNextStepBeforeItReadsOne) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  std::vector<Sample> after;
  std::vector<StepStats> stats;
  TrainTiny(/*layers=*/2, /*steps=*/5, after, stats);
  if (HasFatalFailure()) return;
  const auto launches = [&](size_t from, size_t to) {
    return after[to].rank0.kernel_launches - after[from].rank0.kernel_launches;
  };
  const uint64_t step_launches = launches(1, 2);
  EXPECT_GT(step_launches, 0u);
  EXPECT_EQ(launches(2, 3), step_launches) << "between the reports of steps 3 and 4 rank 0 enqueued step 5";
  EXPECT_EQ(launches(3, 4), 0u) << "the last step was not enqueued before step 4 was read";
  EXPECT_EQ(after[4].rank0.host_synchronizations - after[3].rank0.host_synchronizations, 1u);
  for (size_t i = 0; i < stats.size(); ++i) {
    EXPECT_EQ(stats[i].step, static_cast<int64_t>(i) + 1);
    EXPECT_GT(stats[i].seconds, 0.0) << "step " << i + 1;
  }
}

// A device fault in the middle of a run (an illegal address: the device's
// context is broken for good) fails the run with CUDA's error, at the next
// call that touches the device, and ends neither the process nor in a hang.
TEST(GpuStep, ADeviceFaultFailsTheRunWithCudasError) {
#ifndef COLOD_CUDA_EMULATION
  GTEST_SKIP() << "the fault is the emulation's (FaultDeviceAtLaunch); a GPU has none to inject";
#else
  shardformer::testing::TinyOptions tiny;
  tiny.vocab = kByteVocab;
  tiny.positions = 32;
  tiny.layers = 2;
  auto model = shardformer::testing::WriteTinyGpt2(colod::testing::TempPath("gpu_step_fault"), tiny);
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o;
  o.model_dir = model->dir;
  o.data_path = "/usr/share/common-licenses/GPL-3";
  o.steps = 6;
  o.batch_size = 4;
  o.seq_len = 32;
  o.cuda = true;
  o.seed = 7;
  o.clip_norm = 1.0;
  o.shard.layout.set_tensor_parallel_size(1);
  o.shard.layout.set_data_parallel_size(1);
  int reported = 0;
  const absl::Status s = Train(o, [&](const StepStats&) {
    // Mid-step: the next step's launches are under way (the host is a step ahead).
    if (++reported == 2) colod_cuda_emu::FaultDeviceAtLaunch(0, 30);
  });
  const bool faulted = colod_cuda_emu::DeviceFaulted(0);
  colod_cuda_emu::ClearDeviceFaults();
  EXPECT_TRUE(faulted);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("illegal memory access"), std::string::npos) << s;
  EXPECT_GE(reported, 2);
  EXPECT_LT(reported, 6) << "steps after the fault were reported";
#endif
}

// Kernel launches per rank and step grow with the layers by a bounded
// amount: rank 0's launches in a warm step of a 2-layer and a 4-layer GPT-2
// (tp=2 dp=2) give the launches per transformer layer and the rest
// (embeddings, head, loss, grad norm, optimizer).
// The optimizer (AdamW with the casts of mixed precision) and the grad norm
// are multi-tensor kernels: a launch or two per step, not 3 to 6 per
// parameter as before (79 per layer and 36 outside at f32, 85 and 41 at
// bf16). In bf16 (mixed precision, the GPU default) the layer kernels read
// and write bf16 themselves, so a layer launches what it does in f32, and
// since the embeddings copy and sum in the table's type, so does the rest
// (it added 8 conversions of the embeddings' tables, rows and gradients).
// The MLP's bias and GELU are one kernel each way (32 -> 30), and
// the residual add before ln_2 is in ln_2's kernel (30 -> 29); later 26,
// and the residual stream's gradient adds in the norms' backward (26 -> 24),
// GELU's backward in the down projection's GEMM (24 -> 23), and q, k and
// v's gradients written into one buffer of c_attn's output, where three
// Selects' zeroed buffers were added (23 -> 21), and the attention reading
// q, k and v, and writing their gradients, in place in the packed tensors
// where each was copied out and back (21 -> 15), and the norms' parameter
// gradients taken in their backward's pass (15 -> 13; outside the layers,
// ln_f's: 21 -> 20).
struct LaunchBound {
  uint64_t per_layer, outside;
};
LaunchBound MaxLaunches(DType dtype) {
  if (dtype == DType::kBF16) return {14, 22};  // measured: 13, 20
  return {14, 22};                             // measured: 13, 20
}

class GpuStepLaunches : public ::testing::TestWithParam<DType> {};

TEST_P(GpuStepLaunches, KernelLaunchesPerLayerAreBounded) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  uint64_t launches[2] = {0, 0};  // a warm step's, rank 0, at 2 and 4 layers
  for (int i = 0; i < 2; ++i) {
    std::vector<Sample> after;
    std::vector<StepStats> stats;
    TrainTiny(/*layers=*/2 + 2 * i, /*steps=*/5, after, stats, GetParam());
    if (HasFatalFailure()) return;
    // Step n is reported once step n + 1 is enqueued: between the reports
    // of steps 3 and 4 rank 0 enqueued step 5, between 2 and 3 step 4.
    launches[i] = after[3].rank0.kernel_launches - after[2].rank0.kernel_launches;
    // Every warm step launches the same kernels.
    EXPECT_EQ(after[2].rank0.kernel_launches - after[1].rank0.kernel_launches, launches[i]);
  }
  ASSERT_GT(launches[1], launches[0]);
  const uint64_t per_layer = (launches[1] - launches[0]) / 2, rest = launches[0] - 2 * per_layer;
  std::printf("rank 0, a warm %s step: %llu launches per layer, %llu outside the layers\n",
              std::string(DTypeName(GetParam())).c_str(), static_cast<unsigned long long>(per_layer),
              static_cast<unsigned long long>(rest));
  EXPECT_EQ(launches[1] - launches[0], 2 * per_layer) << "the two extra layers launched different kernels";
  EXPECT_LE(per_layer, MaxLaunches(GetParam()).per_layer);
  EXPECT_LE(rest, MaxLaunches(GetParam()).outside);
}

INSTANTIATE_TEST_SUITE_P(Precisions, GpuStepLaunches, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });
#endif

}  // namespace
}  // namespace colod::train
