// Internals of colod's CUDA emulation shared by its runtime, execution model
// and cuBLAS/NCCL emulations: stream resolution and enqueueing, device
// memory lookup. Not for use outside kernels/cuda/emu.
#ifndef COLOD_KERNELS_CUDA_EMU_RUNTIME_INTERNAL_H_
#define COLOD_KERNELS_CUDA_EMU_RUNTIME_INTERNAL_H_

#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace colod_cuda_emu {

class Stream;

// The stream a handle names for the calling thread (0 and cudaStreamLegacy:
// the current device's legacy stream; cudaStreamPerThread: this thread's
// stream on the current device); nullptr for an unknown handle.
std::shared_ptr<Stream> Resolve(cudaStream_t handle);

// Runs `fn` on `s` in stream order, after what the legacy-stream rules order
// before it.
void Enqueue(const std::shared_ptr<Stream>& s, std::function<void()> fn);

// The device of a stream.
int DeviceOf(const Stream& s);

// Waits for all work of `device` (cudaDeviceSynchronize).
void SynchronizeDevice(int device);

// Records `e` as the calling thread's last error (cudaGetLastError).
void SetLastError(cudaError_t e);

// The calling thread's current device (cudaSetDevice).
int CurrentDevice();

struct DeviceRange {
  int device;
  void* base;
  size_t size;
};

// The device allocation that holds all of [p, p + size), if one does.
std::optional<DeviceRange> FindDeviceRange(const void* p, size_t size);

// Reports a bug the hardware would turn into a fault or a hang, and aborts.
[[noreturn]] void Fatal(const std::string& what);

// cudaErrorIllegalAddress where `device`'s context is broken
// (FaultDeviceAtLaunch), else cudaSuccess.
cudaError_t StickyError(int device);
// Counts a launch on `device` towards an armed fault.
void NoteLaunch(int device);

// The counters of cuda_emu.h.
void CountHostSynchronization();
void CountKernelLaunch();
void CountWarpMma();
void CountAsyncCopy();

// The most bytes a lane puts in one WarpExchange (cuda_runtime.h).
constexpr size_t kWarpSlotBytes = 64;

}  // namespace colod_cuda_emu

#endif  // COLOD_KERNELS_CUDA_EMU_RUNTIME_INTERNAL_H_
