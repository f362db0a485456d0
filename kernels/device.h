// What compute devices this process can use.
#ifndef COLOD_KERNELS_DEVICE_H_
#define COLOD_KERNELS_DEVICE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/built_with_cuda.h"

namespace colod::kernels {

// True when this binary was built with CUDA (the toolkit, or the emulation
// under --config=cuda-emu; bazel/cuda_rules.bzl).
using ::colod::BuiltWithCuda;

// Number of CUDA devices visible to this process; 0 when built without CUDA,
// without a driver, or without a GPU. Never fails.
int CudaDeviceCount();

struct CudaDeviceInfo {
  std::string name;
  int64_t memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

// NOT_FOUND for an ordinal without a device; UNIMPLEMENTED without CUDA.
absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int ordinal);

// The memory pool of CUDA device `ordinal` that tensors come from
// (cudaMallocAsync's default pool): what it has reserved from the device and
// what of that is in use, now and at most since the last ResetCudaPoolPeak
// (or the start). UNIMPLEMENTED without CUDA.
struct CudaPoolBytes {
  int64_t reserved = 0;
  int64_t used = 0;
  int64_t used_high = 0;
};
absl::StatusOr<CudaPoolBytes> GetCudaPoolBytes(int ordinal);
// Starts the pool's used_high over from what is in use now.
absl::Status ResetCudaPoolPeak(int ordinal);

// Blocks until every stream of CUDA device `ordinal` finished its work
// (cudaDeviceSynchronize): for timing device work, which ops only enqueue.
// UNIMPLEMENTED without CUDA.
absl::Status CudaSynchronize(int ordinal);

// OK where CUDA device `ordinal` still takes work; INTERNAL naming CUDA's
// error where its context is broken (a kernel's illegal address, an Xid):
// such a device fails every call until the process ends. Does not wait for
// the device's work. UNIMPLEMENTED without CUDA.
absl::Status CudaDeviceUsable(int ordinal);

// NCCL's runtime version code (e.g. 22703 for 2.27.3); UNIMPLEMENTED without CUDA.
absl::StatusOr<int> NcclVersion();

// A device's dense peak FLOP/s (no structured sparsity) by the type its
// GEMMs run in; 0 where not known.
struct DevicePeakFlops {
  double f32 = 0;   // f32 without TF32
  double tf32 = 0;  // f32 GEMMs on TF32 tensor cores (allow_tf32)
  double bf16 = 0;
  double f16 = 0;
  std::string source;  // "datasheet: NVIDIA H100 SXM"; empty when unknown
};

// The datasheet peak of the GPU called `name` (cudaDeviceProp::name, e.g.
// "NVIDIA H100 80GB HBM3"): A100, A10, L4, L40, L40S, H100 SXM/PCIe/NVL,
// H200 (SXM and NVL) and B200, matched by model and variant word, never by
// prefix (an "A10G" is not an "A10"). All zero for any other name: an MFU is
// then not computed rather than computed against a guess.
DevicePeakFlops KnownCudaPeak(const std::string& name);

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_DEVICE_H_
