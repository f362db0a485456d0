// Introspection of colod's CUDA emulation, for tests of what the GPU path
// does: how often it asks the device for memory, waits on the host, polls and
// launches (issue: a training step's properties checked without a GPU).
//
// Thread-safe: process-wide counters, read atomically one by one, and each
// host thread's own (what the calling thread asked for), which a test of one
// rank among several in the process reads without the other ranks' noise.
#ifndef COLOD_KERNELS_CUDA_EMU_CUDA_EMU_H_
#define COLOD_KERNELS_CUDA_EMU_CUDA_EMU_H_

#include <cstddef>
#include <cstdint>

namespace colod_cuda_emu {

struct Counters {
  // New device memory: cudaMalloc, and cudaMallocAsync when its pool has no
  // free block of the size (a pool's reuse is not counted).
  uint64_t device_allocations = 0;
  // Calls that block the host until device work is done: cudaStreamSynchronize,
  // cudaEventSynchronize, cudaDeviceSynchronize, cudaFree, cudaMemcpy and
  // cudaMemset, and copies to pageable host memory.
  uint64_t host_synchronizations = 0;
  // cudaStreamQuery and cudaEventQuery calls (host polling).
  uint64_t stream_queries = 0;
  uint64_t kernel_launches = 0;
  // cudaMemcpyAsync from pageable (not cudaMallocHost) host memory to a
  // device: CUDA stages it, and may wait for the stream to do so.
  uint64_t pageable_uploads = 0;
  // Warp-level matrix multiply-accumulates (mma.sync, one per warp): counted
  // for the process only (they run on streams' threads), 0 in
  // GetThreadCounters.
  uint64_t warp_mmas = 0;
  // Asynchronous copies to shared memory (cp.async, one per thread and
  // copy), counted as warp_mmas are.
  uint64_t async_copies = 0;
};

Counters GetCounters();
// The calls the calling host thread made (a kernel launch counts on the
// thread that launched it, not on the stream that runs it).
Counters GetThreadCounters();

// A test's full device, once: the next cudaMallocAsync (any thread, any
// device) asking for at least `min_bytes` fails with
// cudaErrorMemoryAllocation, as a device without that much free memory
// would, and the hook disarms; 0 disarms it. Whether it is still armed:
// AsyncAllocationFailureArmed().
void FailNextAsyncAllocation(size_t min_bytes);
bool AsyncAllocationFailureArmed();

// A test's device fault: the `launch`-th kernel launched on `device` from now
// (any thread; 1 is the next, 0 faults the device at once) breaks its
// context, as a kernel's illegal address does on a GPU. That launch itself
// returns success (the fault is asynchronous); from then on every kernel
// launch, copy, set, allocation, free, synchronization, stream creation and
// query, and event record and wait on the device's streams (an event query
// or synchronization: on the calling thread's current device), cuBLAS's
// calls on its streams (NCCL's collectives and
// sends fail ncclUnhandledCudaError), and cudaGetLastError and
// cudaPeekAtLastError on a thread whose current device it is, return
// cudaErrorIllegalAddress, and nothing the program does clears it (only a
// new process would). ClearDeviceFaults() disarms and mends every device,
// for the next test, and clears the calling thread's last error. A process
// started with COLOD_CUDA_EMU_FAULT_AT_LAUNCH=DEVICE:N arms
// FaultDeviceAtLaunch(DEVICE, N) at its first kernel launch on DEVICE (with
// COLOD_CUDA_EMU_FAULT_ONCE=PATH too, only the first process that gets
// there and creates PATH does: a daemon restarted after the fault runs
// sound).
void FaultDeviceAtLaunch(int device, uint64_t launch);
void ClearDeviceFaults();
bool DeviceFaulted(int device);

}  // namespace colod_cuda_emu

#endif  // COLOD_KERNELS_CUDA_EMU_CUDA_EMU_H_
