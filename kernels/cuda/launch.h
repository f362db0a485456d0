// Shared by colod's .cu files: CUDA error to Status, launch geometry for
// grid-stride loops, the one kernel launch helper, and the synchronous finish
// every host entry point ends with (work runs on the calling thread's default
// stream).
#ifndef COLOD_KERNELS_CUDA_LAUNCH_H_
#define COLOD_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/status.h"

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

// Selects `device` for the calling thread.
inline absl::Status Begin(int device) { return CudaStatus(cudaSetDevice(device), "cudaSetDevice"); }

// Checks the launch and waits for the thread's default stream.
inline absl::Status Finish(const char* what) {
  COLOD_RETURN_IF_CUDA(cudaGetLastError());
  return CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), what);
}

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_LAUNCH_H_
