// ColoTensors in CUDA memory over NCCL process groups, one rank per GPU
// (NCCL refuses two ranks of a communicator on one device). Conversions are
// checked against slicing or summing the global tensor on the host. Skipped
// without a GPU; the multi-rank cases need two or more.
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/colo/colo_tensor.h"
#include "worker/colo/testing.h"

namespace colod {
namespace {

using ::colod::testing::RunCudaMesh;

DeviceMesh TpMesh(int tp) { return ::colod::testing::TpDpMesh(tp); }

Tensor IntTensor(const Shape& shape) {
  std::vector<float> v(NumElements(shape));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7) % 13) - 6.0f;
  return *Tensor::FromFloats(shape, v);
}

TEST(NcclColoTensor, OneGpuGroupRunsConversionsOnTheDevice) {
  if (kernels::CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  RunCudaMesh(TpMesh(1), [](int, ProcessGroup& pg) {
    const Tensor global = IntTensor({6, 5});
    auto p = ColoTensor::FromLocal(*global.To(Device::Cuda(0)), DistSpec().Set("tp", Placement::Partial()), &pg);
    ASSERT_TRUE(p.ok()) << p.status();
    auto r = p->ToReplicate();  // an all-reduce over one rank
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->local().device(), Device::Cuda(0));
    EXPECT_EQ(r->local().ToFloats(), global.ToFloats());
    // A host tensor cannot ride an NCCL group.
    auto host = ColoTensor::FromLocal(global, DistSpec().Set("tp", Placement::Partial()), &pg);
    EXPECT_EQ(host->ToReplicate().status().code(), absl::StatusCode::kFailedPrecondition);
  });
}

TEST(NcclColoTensor, EveryConversionOnSeveralGpus) {
  const int n = std::min(kernels::CudaDeviceCount(), 4);
  if (n < 2) GTEST_SKIP() << "needs two or more CUDA devices, found " << kernels::CudaDeviceCount();
  RunCudaMesh(TpMesh(n), [n](int rank, ProcessGroup& pg) {
    const Device gpu = Device::Cuda(rank);
    const Tensor global = IntTensor({12, 12, 5});
    const int k = *pg.tp_local_rank();
    auto tp = [](Placement p) { return DistSpec().Set("tp", std::move(p)); };
    auto s0 = ColoTensor::FromGlobal(*global.To(gpu), tp(Placement::Shard({0}, {n})), &pg, true);
    ASSERT_TRUE(s0.ok()) << s0.status();
    EXPECT_EQ(s0->local().ToFloats(), global.Chunk(0, n, k)->ToFloats());
    auto r = s0->ToReplicate();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->local().ToFloats(), global.ToFloats());
    auto s1 = s0->Redistribute(tp(Placement::Shard({1}, {n})));  // all-to-all
    ASSERT_TRUE(s1.ok()) << s1.status();
    EXPECT_EQ(s1->local().device(), gpu);
    EXPECT_EQ(s1->local().ToFloats(), global.Chunk(1, n, k)->ToFloats());
    // Backward of the all-to-all: the shard's gradient is W's dim-0 slice.
    const Tensor w = IntTensor({12, 12, 5});
    Variable loss = *Sum(*Mul(s1->variable(), Variable(*w.Chunk(1, n, k)->Contiguous().To(gpu))));
    ASSERT_TRUE(Backward(loss).ok());
    EXPECT_EQ(s0->variable().grad()->ToFloats(), w.Chunk(0, n, k)->ToFloats());
    // Partial: rank k holds (k+1) * global.
    auto p = ColoTensor::FromLocal(*Scale(*global.To(gpu), k + 1.0f), tp(Placement::Partial()), &pg);
    const Tensor total = *Scale(global, n * (n + 1) / 2.0f);
    EXPECT_EQ(p->ToReplicate()->local().ToFloats(), total.ToFloats());
    EXPECT_EQ(p->Redistribute(tp(Placement::Shard({1}, {n})))->local().ToFloats(), total.Chunk(1, n, k)->ToFloats());
  });
}

}  // namespace
}  // namespace colod
