#include "kernels/device.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#ifdef COLOD_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace colod::kernels {

DevicePeakFlops KnownCudaPeak(const std::string& name) {
  // The words of the name: "NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB.
  const std::vector<std::string> words = absl::StrSplit(name, absl::ByAnyChar(" -_"), absl::SkipEmpty());
  if (words.size() < 2 || words[0] != "NVIDIA") return {};
  const std::string& model = words[1];
  auto has = [&](const char* word) { return std::find(words.begin() + 2, words.end(), word) != words.end(); };
  // NVIDIA's datasheets, dense TFLOP/s (the sparse figures halved).
  struct Row {
    const char* model;
    const char* variant;  // a further word of the name, or nullptr: any other
    const char* label;
    double f32, tf32, bf16, f16;
  };
  static constexpr Row kRows[] = {
      {"A100", nullptr, "A100", 19.5, 156, 312, 312},
      {"A10", nullptr, "A10", 31.2, 62.5, 125, 125},
      {"L4", nullptr, "L4", 30.3, 60, 121, 121},
      {"L40", nullptr, "L40", 90.5, 90.5, 181, 181},
      {"L40S", nullptr, "L40S", 91.6, 183, 362, 362},
      {"H100", "NVL", "H100 NVL", 60, 417.5, 835.5, 835.5},
      {"H100", "PCIe", "H100 PCIe", 51, 378, 756, 756},
      {"H100", nullptr, "H100 SXM", 67, 494.7, 989.4, 989.4},
      {"H200", "NVL", "H200 NVL", 60, 417.5, 835.5, 835.5},
      {"H200", nullptr, "H200 SXM", 67, 494.7, 989.4, 989.4},
      {"B200", nullptr, "B200", 75, 1125, 2250, 2250},
  };
  for (const Row& r : kRows) {
    if (model != r.model || (r.variant != nullptr && !has(r.variant))) continue;
    DevicePeakFlops p;
    p.f32 = r.f32 * 1e12;
    p.tf32 = r.tf32 * 1e12;
    p.bf16 = r.bf16 * 1e12;
    p.f16 = r.f16 * 1e12;
    p.source = absl::StrCat("datasheet: NVIDIA ", r.label);
    return p;
  }
  return {};
}

int CudaDeviceCount() {
#ifdef COLOD_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver/no device" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

absl::StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int ordinal) {
#ifdef COLOD_WITH_CUDA
  const int n = CudaDeviceCount();
  if (ordinal < 0 || ordinal >= n) {
    return absl::NotFoundError(absl::StrCat("no CUDA device ", ordinal, " (", n, " visible)"));
  }
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, ordinal);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGetDeviceProperties(", ordinal,
                                            "): ", cudaGetErrorString(err)));
  }
  CudaDeviceInfo info;
  info.name = prop.name;
  info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  return info;
#else
  (void)ordinal;
  return absl::UnimplementedError("this colod build has no CUDA support");
#endif
}

absl::StatusOr<CudaPoolBytes> GetCudaPoolBytes(int ordinal) {
#ifdef COLOD_WITH_CUDA
  cudaMemPool_t pool = nullptr;
  cudaError_t err = cudaDeviceGetDefaultMemPool(&pool, ordinal);
  uint64_t reserved = 0, used = 0, used_high = 0;
  if (err == cudaSuccess) err = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
  if (err == cudaSuccess) err = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used);
  if (err == cudaSuccess) err = cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_high);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("the memory pool of CUDA device ", ordinal, ": ", cudaGetErrorString(err)));
  }
  return CudaPoolBytes{static_cast<int64_t>(reserved), static_cast<int64_t>(used), static_cast<int64_t>(used_high)};
#else
  (void)ordinal;
  return absl::UnimplementedError("this colod build has no CUDA support");
#endif
}

absl::Status ResetCudaPoolPeak(int ordinal) {
#ifdef COLOD_WITH_CUDA
  cudaMemPool_t pool = nullptr;
  cudaError_t err = cudaDeviceGetDefaultMemPool(&pool, ordinal);
  uint64_t zero = 0;  // CUDA takes only 0: the high-water mark restarts at the current use
  if (err == cudaSuccess) err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("resetting the memory pool peak of CUDA device ", ordinal, ": ",
                                            cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  (void)ordinal;
  return absl::UnimplementedError("this colod build has no CUDA support");
#endif
}

absl::Status CudaSynchronize(int ordinal) {
#ifdef COLOD_WITH_CUDA
  cudaError_t err = cudaSetDevice(ordinal);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("synchronizing CUDA device ", ordinal, ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
#else
  (void)ordinal;
  return absl::UnimplementedError("this colod build has no CUDA support");
#endif
}

absl::Status CudaDeviceUsable(int ordinal) {
#ifdef COLOD_WITH_CUDA
  // A broken context fails every call; these wait for nothing (a fresh
  // non-blocking stream has no work to wait for).
  size_t free_bytes = 0, total_bytes = 0;
  cudaStream_t probe = nullptr;
  cudaError_t err = cudaSetDevice(ordinal);
  if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = cudaStreamQuery(probe);
    if (err == cudaErrorNotReady) err = cudaSuccess;
    const cudaError_t destroyed = cudaStreamDestroy(probe);
    if (err == cudaSuccess) err = destroyed;
  }
  // A full device is a usable one (the error is not sticky).
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::OkStatus();
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("CUDA device ", ordinal, " is unusable: ", cudaGetErrorName(err), " (",
                                            cudaGetErrorString(err), ")"));
  }
  return absl::OkStatus();
#else
  (void)ordinal;
  return absl::UnimplementedError("this colod build has no CUDA support");
#endif
}

absl::StatusOr<int> NcclVersion() {
#ifdef COLOD_WITH_CUDA
  int version = 0;
  ncclResult_t r = ncclGetVersion(&version);
  if (r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetVersion: ", ncclGetErrorString(r)));
  }
  return version;
#else
  return absl::UnimplementedError("this colod build has no CUDA/NCCL support");
#endif
}

}  // namespace colod::kernels
