#include "kernels/device.h"

#include "gtest/gtest.h"

namespace colod::kernels {
namespace {

TEST(Device, BuildFlavourIsWhatBazelDetected) {
#ifdef COLOD_WITH_CUDA
  EXPECT_TRUE(BuiltWithCuda());
#else
  EXPECT_FALSE(BuiltWithCuda());
  EXPECT_EQ(CudaDeviceCount(), 0);
  EXPECT_EQ(GetCudaDeviceInfo(0).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(NcclVersion().status().code(), absl::StatusCode::kUnimplemented);
#endif
}

TEST(Device, MissingOrdinalIsNotFoundOrUnimplemented) {
  auto info = GetCudaDeviceInfo(CudaDeviceCount());
  EXPECT_FALSE(info.ok());
  EXPECT_TRUE(info.status().code() == absl::StatusCode::kNotFound ||
              info.status().code() == absl::StatusCode::kUnimplemented)
      << info.status();
}

TEST(Device, SynchronizeNeedsADevice) {
  if (CudaDeviceCount() > 0) {
    EXPECT_TRUE(CudaSynchronize(0).ok());
  }
  EXPECT_FALSE(CudaSynchronize(CudaDeviceCount()).ok());
#ifndef COLOD_WITH_CUDA
  EXPECT_EQ(CudaSynchronize(0).code(), absl::StatusCode::kUnimplemented);
#endif
}

TEST(Device, HostMemoryIsReported) {
  EXPECT_GT(HostMemoryBytes(), int64_t{64} << 20);
}

}  // namespace
}  // namespace colod::kernels
