// Device discovery (kernels/device.h) where the build has CUDA: the toolkit
// and a GPU, or the emulation.
#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/device.h"

namespace colod::kernels {
namespace {

TEST(CudaDevice, NcclLibraryMatchesItsHeader) {
  // Needs no GPU: the linked libnccl.so.2 must be the release nccl.h describes.
  auto v = NcclVersion();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_GE(*v, 20000);
}

TEST(CudaDevice, DescribesEveryVisibleDevice) {
  const int n = CudaDeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  for (int i = 0; i < n; ++i) {
    auto info = GetCudaDeviceInfo(i);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_FALSE(info->name.empty());
    EXPECT_GT(info->memory_bytes, int64_t{1} << 30);
    EXPECT_GE(info->compute_major, 7);
  }
  EXPECT_EQ(GetCudaDeviceInfo(n).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace colod::kernels
