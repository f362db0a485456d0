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

// The datasheet figures (dense), by the names the driver reports; a name
// that only begins like a known one is not taken for it.
TEST(Device, KnownPeaksAreTheDatasheets) {
  const DevicePeakFlops h100 = KnownCudaPeak("NVIDIA H100 80GB HBM3");
  EXPECT_DOUBLE_EQ(h100.bf16, 989.4e12);
  EXPECT_DOUBLE_EQ(h100.tf32, 494.7e12);
  EXPECT_DOUBLE_EQ(h100.f32, 67e12);
  EXPECT_EQ(h100.source, "datasheet: NVIDIA H100 SXM");
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA H100 PCIe").bf16, 756e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA H100 NVL").bf16, 835.5e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA H200").bf16, 989.4e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA H200 NVL").f16, 835.5e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA A100-SXM4-80GB").bf16, 312e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA A100 80GB PCIe").tf32, 156e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA L40S").bf16, 362e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA L40").bf16, 181e12);
  EXPECT_DOUBLE_EQ(KnownCudaPeak("NVIDIA L4").bf16, 121e12);
  for (const char* unknown : {"NVIDIA A10G", "NVIDIA H1000", "NVIDIA GeForce RTX 4090", "cpu", "", "NVIDIA",
                              "H100 80GB HBM3", "colod CUDA emulation"}) {
    const DevicePeakFlops p = KnownCudaPeak(unknown);
    EXPECT_EQ(p.f32 + p.tf32 + p.bf16 + p.f16, 0) << unknown;
    EXPECT_TRUE(p.source.empty()) << unknown;
  }
}

}  // namespace
}  // namespace colod::kernels
