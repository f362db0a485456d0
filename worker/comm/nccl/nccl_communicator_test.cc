// NCCL on the machine's GPUs. On a single GPU NCCL refuses two ranks of one
// communicator on the same device, so these tests use one rank plus the init,
// split, timeout and abort paths (DESIGN.md section 7). Skipped without a GPU.
#include "worker/comm/nccl/nccl_communicator.h"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/comm/store.h"

namespace colod {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

TEST(Nccl, BadRanksAreRefusedBeforeTouchingTheGpu) {
  InMemoryStore store;
  EXPECT_EQ(NcclCommunicator::Create(store, 2, 2, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(store, 0, 0, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

class NcclGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NcclGpu, OneRankCollectivesMatchTheHostValues) {
  InMemoryStore store;
  auto comm = NcclCommunicator::Create(store, 0, 1, {});
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int n = 1000;
  std::vector<float> host(n);
  for (int i = 0; i < n; ++i) host[i] = 0.25f * (i % 17) - 1.5f;
  float *dev = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    ASSERT_TRUE((*comm)->AllReduce(dev, n, DType::kF32, op)->Wait(kWait).ok());
  }
  ASSERT_TRUE((*comm)->AllGather(dev, out, n, DType::kF32)->Wait(kWait).ok());
  ASSERT_TRUE((*comm)->Barrier()->Wait(kWait).ok());
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, host);  // one rank: every reduction is the identity
  EXPECT_TRUE((*comm)->AsyncError().ok());

  auto sub = (*comm)->Split(/*color=*/0, /*key=*/0);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ((*sub)->size(), 1);
  ASSERT_TRUE((*sub)->AllReduce(dev, n, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());

  (*comm)->Abort(absl::CancelledError("job cancelled"));
  absl::Status after = (*comm)->AllReduce(dev, n, DType::kF32, ReduceOp::kSum)->Wait(kWait);
  EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
  EXPECT_EQ((*comm)->AsyncError().code(), absl::StatusCode::kAborted);
  cudaFree(dev);
  cudaFree(out);
}

TEST_F(NcclGpu, APeerThatNeverJoinsIsDeadlineExceeded) {
  InMemoryStore store;
  NcclCommunicator::Options o;
  o.timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  auto comm = NcclCommunicator::Create(store, 0, 2, o);  // rank 1 never comes
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_LT(absl::Now() - start, o.timeout + absl::Seconds(1));
  InMemoryStore empty;
  auto waiting = NcclCommunicator::Create(empty, 1, 2, o);  // rank 0 never publishes the id
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kDeadlineExceeded) << waiting.status();
}

}  // namespace
}  // namespace colod
