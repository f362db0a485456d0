// Shared by colod's .cu files: CUDA error to Status, launch geometry for
// grid-stride loops, the one kernel launch helper, and the begin and finish
// of every host entry point. Work runs on the device's compute stream
// (kernels/cuda/stream.h) and is stream ordered: entry points enqueue and
// return without waiting for the device.
#ifndef COLOD_KERNELS_CUDA_LAUNCH_H_
#define COLOD_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/status.h"
#include "kernels/cuda/stream.h"

namespace colod::kernels::cuda {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// Blocks for n elements handled by a grid-stride loop of kThreads threads.
inline unsigned Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// kernel<<<grid, block, 0, stream>>>(args...): every kernel of colod is
// launched here, so nvcc and the CUDA emulation (kernels/cuda/emu, which has
// no <<<>>>) compile the same sources unchanged. Returns the launch's error
// without clearing it (Finish reports it too).
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
#ifdef COLOD_CUDA_EMULATION
  return ::colod_cuda_emu::Launch(kernel, grid, block, 0, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
  return cudaPeekAtLastError();
#endif
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...) for a kernel that
// takes `shared_bytes` of dynamic shared memory (DynamicShared, warp.h):
// above the 48 KiB any launch may take, the kernel's limit is raised first
// (cudaFuncSetAttribute, a host-side call made before every such launch, as
// FlashAttention-2 makes it).
template <typename... Params, typename... Args>
cudaError_t LaunchShared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         Args&&... args) {
  if (shared_bytes > (48u << 10)) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (e != cudaSuccess) return e;
  }
#ifdef COLOD_CUDA_EMULATION
  return ::colod_cuda_emu::Launch(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
  return cudaPeekAtLastError();
#endif
}

// Declares `stream`, the compute stream of `device` (selected for the calling
// thread), or returns the error from the enclosing function.
#define COLOD_CUDA_BEGIN(stream, device)                                      \
  cudaStream_t stream = nullptr;                                              \
  do {                                                                        \
    absl::StatusOr<cudaStream_t> colod_stream_ = ComputeStream(device);       \
    if (!colod_stream_.ok()) return colod_stream_.status();                   \
    stream = *colod_stream_;                                                  \
  } while (0)

// Reports a failed launch (and clears it). Does not wait: an error the
// kernel hits while running surfaces at the next synchronization.
inline absl::Status Finish(const char* what) { return CudaStatus(cudaGetLastError(), what); }

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_LAUNCH_H_
