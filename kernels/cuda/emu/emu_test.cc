// The CUDA emulation itself, against closed forms and host references: every
// thread of a grid runs, __syncthreads is a barrier, streams run
// asynchronously and in order, the legacy stream and events order work, GEMM
// matches a naive triple loop through the row-major mapping colod uses, and
// the NCCL collectives match their definitions, including hangs and aborts.
#include <cublasLt.h>
#include <cublas_emu.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_emu.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_emu.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace {

using colod_cuda_emu::Launch;

__global__ void WriteIndex(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i;
}

__global__ void Write2D(int* out, int width) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  out[y * width + x] = 1000 * y + x;
}

// Each thread reads its right neighbour's write: right only with a barrier.
__global__ void Rotate(int* out) {
  __shared__ int s[128];
  const int t = threadIdx.x;
  s[t] = t * t;
  __syncthreads();
  out[blockIdx.x * blockDim.x + t] = s[(t + 1) % blockDim.x] + static_cast<int>(blockIdx.x);
}

// Rotate without its barrier: thread t reads the slot thread t + 1 writes
// (the last thread reads none, so only threads run one after the other race).
[[maybe_unused]] __global__ void RotateWithoutBarrier(int* out) {
  __shared__ int s[1024];
  const int t = threadIdx.x;
  s[t] = t * t;
  out[t] = t + 1 < static_cast<int>(blockDim.x) ? s[t + 1] : 0;
}

// After a first barrier each warp writes its half again and reads the other
// half before the second barrier: the read needs a barrier after the
// other warp's write. The fiber mode runs the last warp first after the
// first barrier, so it reads before the first warp writes; under
// ThreadSanitizer that write still races with the read, although the last
// warp had arrived at the second barrier when the first warp moved.
[[maybe_unused]] __global__ void ReadBeforeTheSecondBarrier(int* out) {
  __shared__ int s[64];
  const int t = threadIdx.x;
  s[t] = 0;
  __syncthreads();
  s[t] = t + 1;
  const int other = s[(t + 32) % 64];
  __syncthreads();
  out[t] = other;
}

// Each warp writes its slots after a barrier, then reads the other warp's
// without one: a race, whose outcome on a GPU depends on how far apart the
// warps run.
[[maybe_unused]] __global__ void ReadOtherWarpWithoutBarrier(int* out) {
  __shared__ int s[64];
  const int t = threadIdx.x;
  s[t] = 0;
  __syncthreads();
  s[t] = t + 1;
  __syncwarp();
  out[t] = s[(t + 32) % 64];
}

__global__ void DivergentBarrier(int* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void WaitForFlag(const std::atomic<int>* flag, int* out) {
  while (flag->load() == 0) std::this_thread::yield();
  *out = 7;
}

__global__ void Increment(int* x) {
  if (threadIdx.x == 0) *x += 1;
}

__global__ void AtomicSum(float* total, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(total, 1.0f);
}

// Lane 5 of each warp returns while the others shuffle: a GPU hangs.
__global__ void LaneReturnsBeforeAShuffle(int* out) {
  if (threadIdx.x % 32 == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

// Lanes 0-15 wait at __syncthreads while 16-31 shuffle: a GPU hangs.
__global__ void WarpSplitBetweenBarrierAndShuffle(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    v = __shfl_down_sync(0xffffffffu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// Warp 0 returns at once; warp 1 shuffles. Correct CUDA, which the fiber
// mode runs only where thread 0 reaches a warp-level operation or barrier.
__global__ void SecondWarpShufflesAlone(int* out) {
  if (threadIdx.x < 32) return;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 0);
}

// A warp-level reduction between barriers in every warp, and a warp's
// shuffles interleaved with another's in any order: a block-wide sum.
__global__ void BlockSumThroughWarps(const int* in, int* out) {
  __shared__ int partial[32];
  int v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    int w = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0;
    for (int offset = 16; offset > 0; offset /= 2) w += __shfl_down_sync(0xffffffffu, w, offset);
    if (threadIdx.x == 0) out[blockIdx.x] = w;
  }
}

// Each block writes 1000 * its index + i into word i of `words` ints of its
// dynamic shared memory (the launch's shared_bytes); after a barrier each
// thread sums the words after its own (another thread's writes).
__global__ void DynamicSharedRotate(int* out, int words) {
  int* shared = reinterpret_cast<int*>(colod_cuda_emu::DynamicShared());
  for (int i = threadIdx.x; i < words; i += blockDim.x) shared[i] = 1000 * static_cast<int>(blockIdx.x) + i;
  __syncthreads();
  int sum = 0;
  for (int i = threadIdx.x; i < words; i += blockDim.x) sum += shared[(i + 1) % words];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

TEST(CudaEmuKernels, EveryThreadOfEveryBlockRuns) {
  const int n = 1000;  // not a multiple of the block
  int* d = DeviceAlloc<int>(n);
  ASSERT_EQ(Launch(WriteIndex, dim3((n + 255) / 256), dim3(256), 0, cudaStreamPerThread, d, n), cudaSuccess);
  std::vector<int> h(n, -1);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(h[i], i);
  const int w = 48, hgt = 20;
  int* d2 = DeviceAlloc<int>(w * hgt);
  ASSERT_EQ(Launch(Write2D, dim3(w / 16, hgt / 4), dim3(16, 4), 0, cudaStreamPerThread, d2, w), cudaSuccess);
  std::vector<int> h2(w * hgt);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h2.data(), d2, h2.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int y = 0; y < hgt; ++y) {
    for (int x = 0; x < w; ++x) ASSERT_EQ(h2[y * w + x], 1000 * y + x);
  }
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(d2), cudaSuccess);
}

TEST(CudaEmuKernels, SyncthreadsIsABarrierAndSharedIsPerBlock) {
  const int blocks = 3, threads = 128;
  int* d = DeviceAlloc<int>(blocks * threads);
  ASSERT_EQ(Launch(Rotate, dim3(blocks), dim3(threads), 0, cudaStreamPerThread, d), cudaSuccess);
  std::vector<int> h(blocks * threads);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      const int r = (t + 1) % threads;
      ASSERT_EQ(h[b * threads + t], r * r + b) << "block " << b << " thread " << t;
    }
  }
  cudaFree(d);
}

TEST(CudaEmuKernels, AtomicAddCountsEveryThread) {
  float* d = DeviceAlloc<float>(1);
  ASSERT_EQ(cudaMemset(d, 0, sizeof(float)), cudaSuccess);
  ASSERT_EQ(Launch(AtomicSum, dim3(10), dim3(256), 0, cudaStreamPerThread, d, 2500), cudaSuccess);
  float h = 0;
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, 2500.0f);
  cudaFree(d);
}

TEST(CudaEmuKernelsDeathTest, ADivergentBarrierIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int));
        Launch(DivergentBarrier, dim3(1), dim3(64), 0, cudaStreamPerThread, d);
        cudaStreamSynchronize(cudaStreamPerThread);
      },
      "divergent barrier");
}

#ifndef COLOD_CUDA_EMU_TSAN
// The fiber mode runs a warp on to its next __syncthreads before the next
// warp moves: one warp reads the other's slots before they were written,
// where warps in lock step would both read the other's writes (a race the
// fiber mode makes show; under ThreadSanitizer it is a reported race, the
// test below).
TEST(CudaEmuKernels, WarpsRunApartUntilABlockBarrier) {
  int* d = DeviceAlloc<int>(64);
  ASSERT_EQ(cudaMemset(d, 0xff, 64 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(Launch(ReadOtherWarpWithoutBarrier, dim3(1), dim3(64), 0, cudaStreamPerThread, d), cudaSuccess);
  std::vector<int> h(64);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  // One warp ran to its end first: it read zeros, the other its writes.
  const int early = h[0] == 0 ? 0 : 1;
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(h[t], t / 32 == early ? 0 : (t + 32) % 64 + 1) << "thread " << t;
  }
  cudaFree(d);
}
#endif

#ifdef COLOD_CUDA_EMU_TSAN
// Under --config=cuda-emu-tsan each of a block's threads is a thread of its
// own to ThreadSanitizer, ordered by barriers only, so the dropped
// __syncthreads is a data race it reports (the configuration sets
// halt_on_error).
// In blocks of 256 and 1,024 threads too: more fibers than the stream's
// host thread and the test's together, each still a thread of its own.
TEST(CudaEmuKernelsDeathTest, AMissingBarrierIsADataRaceUnderThreadSanitizer) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const unsigned threads : {128u, 256u, 1024u}) {
    SCOPED_TRACE(threads);
    EXPECT_DEATH(
        {
          int* d = nullptr;
          cudaMalloc(reinterpret_cast<void**>(&d), threads * sizeof(int));
          Launch(RotateWithoutBarrier, dim3(1), dim3(threads), 0, cudaStreamPerThread, d);
          cudaStreamSynchronize(cudaStreamPerThread);
        },
        "ThreadSanitizer: data race");
  }
}

// Each barrier's happens-before edges are its own (execution.cc's barrier
// parity): a warp that passed the next barrier first does not order what it
// did after this one before the other warps' accesses.
TEST(CudaEmuKernelsDeathTest, AReadBeforeTheSecondBarrierIsADataRaceUnderThreadSanitizer) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int));
        Launch(ReadBeforeTheSecondBarrier, dim3(1), dim3(64), 0, cudaStreamPerThread, d);
        cudaStreamSynchronize(cudaStreamPerThread);
      },
      "ThreadSanitizer: data race");
}
#endif

TEST(CudaEmuKernels, WarpShufflesBetweenBarriersSumABlock) {
  const int blocks = 3, threads = 256;
  std::vector<int> h(blocks * threads);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<int>(i * 7 % 13) - 6;
  int* in = DeviceAlloc<int>(h.size());
  int* out = DeviceAlloc<int>(blocks);
  ASSERT_EQ(cudaMemcpy(in, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(Launch(BlockSumThroughWarps, dim3(blocks), dim3(threads), 0, cudaStreamPerThread, in, out), cudaSuccess);
  std::vector<int> sums(blocks);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(sums.data(), out, blocks * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    int want = 0;
    for (int t = 0; t < threads; ++t) want += h[b * threads + t];
    EXPECT_EQ(sums[b], want) << "block " << b;
  }
  cudaFree(in);
  cudaFree(out);
}

TEST(CudaEmuKernelsDeathTest, ALaneThatReturnsBeforeItsWarpsShuffleIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int));
        Launch(LaneReturnsBeforeAShuffle, dim3(1), dim3(64), 0, cudaStreamPerThread, d);
        cudaStreamSynchronize(cudaStreamPerThread);
      },
      "divergent warp");
}

TEST(CudaEmuKernelsDeathTest, AWarpSplitBetweenABarrierAndAShuffleIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int));
        Launch(WarpSplitBetweenBarrierAndShuffle, dim3(1), dim3(64), 0, cudaStreamPerThread, d);
        cudaStreamSynchronize(cudaStreamPerThread);
      },
      "divergent warp");
}

// (Under ThreadSanitizer every thread has a fiber, so the shuffle runs.)
#ifndef COLOD_CUDA_EMU_TSAN
TEST(CudaEmuKernelsDeathTest, AShuffleAfterThreadZeroReturnedWithoutOneIsRefusedInFiberMode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        int* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(int));
        Launch(SecondWarpShufflesAlone, dim3(1), dim3(64), 0, cudaStreamPerThread, d);
        cudaStreamSynchronize(cudaStreamPerThread);
      },
      "thread 0 of its block returned without one");
}
#else
TEST(CudaEmuKernels, UnderThreadSanitizerOneWarpMayShuffleWhileAnotherReturned) {
  int* d = DeviceAlloc<int>(64);
  ASSERT_EQ(Launch(SecondWarpShufflesAlone, dim3(1), dim3(64), 0, cudaStreamPerThread, d), cudaSuccess);
  std::vector<int> h(64);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int t = 32; t < 64; ++t) EXPECT_EQ(h[t], 32);
  cudaFree(d);
}
#endif

TEST(CudaEmuKernels, BadLaunchConfigurationsFail) {
  int* d = DeviceAlloc<int>(1);
  EXPECT_EQ(Launch(Increment, dim3(1), dim3(2048), 0, cudaStreamPerThread, d), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // cleared
  EXPECT_EQ(Launch(Increment, dim3(0), dim3(1), 0, cudaStreamPerThread, d), cudaErrorInvalidConfiguration);
  cudaGetLastError();
  cudaFree(d);
}

// Dynamic shared memory as CUDA gives it: up to 48 KiB a block without
// asking, more (up to sm_90's 227 KiB) once cudaFuncSetAttribute raised the
// kernel's limit; a block's threads share it, and a launch past the limit,
// or a limit past 227 KiB, is refused.
TEST(CudaEmuKernels, DynamicSharedMemoryIsTheBlocksAndAbove48KiBNeedsTheAttribute) {
  const int blocks = 3, threads = 64;
  int* d = DeviceAlloc<int>(blocks * threads);
  const auto check = [&](int words) {
    std::vector<int> h(blocks * threads);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h.data(), d, h.size() * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
      for (int t = 0; t < threads; ++t) {
        int want = 0;
        for (int i = t; i < words; i += threads) want += 1000 * b + (i + 1) % words;
        ASSERT_EQ(h[b * threads + t], want) << "block " << b << " thread " << t << " words " << words;
      }
    }
  };
  const int small = 1000, large = 30000;  // 4000 bytes; 120,000 bytes
  // The attribute is the process's: back to the default, for --gtest_repeat.
  ASSERT_EQ(cudaFuncSetAttribute(DynamicSharedRotate, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 << 10),
            cudaSuccess);
  ASSERT_EQ(Launch(DynamicSharedRotate, dim3(blocks), dim3(threads), small * sizeof(int), cudaStreamPerThread, d,
                   small),
            cudaSuccess);
  check(small);
  EXPECT_EQ(Launch(DynamicSharedRotate, dim3(blocks), dim3(threads), large * sizeof(int), cudaStreamPerThread, d,
                   large),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaFuncSetAttribute(DynamicSharedRotate, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  ASSERT_EQ(cudaFuncSetAttribute(DynamicSharedRotate, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(large * sizeof(int))),
            cudaSuccess);
  ASSERT_EQ(Launch(DynamicSharedRotate, dim3(blocks), dim3(threads), large * sizeof(int), cudaStreamPerThread, d,
                   large),
            cudaSuccess);
  check(large);
  EXPECT_EQ(Launch(DynamicSharedRotate, dim3(blocks), dim3(threads), large * sizeof(int) + 16, cudaStreamPerThread,
                   d, large),
            cudaErrorInvalidConfiguration);
  cudaGetLastError();
  cudaFree(d);
}

TEST(CudaEmuStreams, WorkRunsAsynchronouslyInStreamOrder) {
  std::atomic<int> flag{0};
  int* d = DeviceAlloc<int>(1);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 0, sizeof(int), s), cudaSuccess);
  ASSERT_EQ(Launch(WaitForFlag, dim3(1), dim3(1), 0, s, &flag, d), cudaSuccess);
  ASSERT_EQ(Launch(Increment, dim3(1), dim3(32), 0, s, d), cudaSuccess);
  // The launch returned while the kernel waits: the stream is busy.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  cudaEvent_t e;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
  flag = 1;
  ASSERT_EQ(cudaEventSynchronize(e), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
  int h = 0;
  ASSERT_EQ(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, s), cudaSuccess);  // pageable: synchronous
  EXPECT_EQ(h, 8);  // 7, then incremented after: stream order
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(e), cudaErrorInvalidResourceHandle);
  cudaGetLastError();
  cudaFree(d);
}

// Pinned (cudaMallocHost) memory is not staged: a copy from it reads the
// source when the stream reaches it, and a copy into it does not block the
// host. A copy from pageable memory reads it at the call (and is counted).
TEST(CudaEmuStreams, PinnedCopiesAreAsynchronousPageableOnesStaged) {
  std::atomic<int> flag{0};
  int* d = DeviceAlloc<int>(2);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  int* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 2 * sizeof(int)), cudaSuccess);
  int pageable = 5;
  pinned[0] = 1;
  const colod_cuda_emu::Counters a = colod_cuda_emu::GetThreadCounters();
  ASSERT_EQ(Launch(WaitForFlag, dim3(1), dim3(1), 0, s, &flag, d + 1), cudaSuccess);  // holds the stream
  ASSERT_EQ(cudaMemcpyAsync(d, pinned, sizeof(int), cudaMemcpyHostToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d + 1, &pageable, sizeof(int), cudaMemcpyHostToDevice, s), cudaSuccess);
  pinned[0] = 2;  // before the stream reaches the copy: it sees 2
  pageable = 6;   // staged at the call: the device sees 5
  const colod_cuda_emu::Counters b = colod_cuda_emu::GetThreadCounters();
  EXPECT_EQ(b.pageable_uploads - a.pageable_uploads, 1u);
  flag = 1;
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, 2 * sizeof(int), cudaMemcpyDeviceToHost, s), cudaSuccess);  // no wait
  EXPECT_EQ(colod_cuda_emu::GetThreadCounters().host_synchronizations, b.host_synchronizations);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(pinned[0], 2);
  EXPECT_EQ(pinned[1], 5);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaErrorInvalidValue);  // not (any longer) pinned
  cudaGetLastError();
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  cudaFree(d);
}

TEST(CudaEmuStreams, StreamWaitEventOrdersTwoStreams) {
  std::atomic<int> flag{0};
  int* d = DeviceAlloc<int>(1);
  cudaStream_t a, b;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e;
  ASSERT_EQ(cudaEventCreate(&e), cudaSuccess);
  ASSERT_EQ(Launch(WaitForFlag, dim3(1), dim3(1), 0, a, &flag, d), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
  ASSERT_EQ(Launch(Increment, dim3(1), dim3(1), 0, b, d), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaStreamQuery(b), cudaErrorNotReady);  // held back by the event
  flag = 1;
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  int h = 0;
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, 8);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaEventDestroy(e);
  cudaFree(d);
}

// An event belongs to the device current at its creation: CUDA records it
// only on that device's streams, and any device's stream may wait for it.
TEST(CudaEmuStreams, AnEventIsRecordedOnlyOnItsOwnDevicesStreams) {
  ASSERT_EQ(cudaSetDevice(2), cudaSuccess);
  cudaEvent_t event = nullptr;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);
  cudaStream_t on2 = nullptr;
  ASSERT_EQ(cudaStreamCreate(&on2), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t on0 = nullptr;
  ASSERT_EQ(cudaStreamCreate(&on0), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(event, on0), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventRecord(event, on2), cudaSuccess);
  EXPECT_EQ(cudaStreamWaitEvent(on0, event, 0), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(on0), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(event), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(event), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(on0), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(on2), cudaSuccess);
}

TEST(CudaEmuStreams, TheLegacyStreamWaitsForBlockingStreams) {
  std::atomic<int> flag{0};
  int* d = DeviceAlloc<int>(1);
  ASSERT_EQ(cudaMemset(d, 0, sizeof(int)), cudaSuccess);
  ASSERT_EQ(Launch(WaitForFlag, dim3(1), dim3(1), 0, cudaStreamPerThread, &flag, d), cudaSuccess);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    flag = 1;
  });
  int h = 0;
  // cudaMemcpy runs on the legacy stream, after the per-thread stream's kernel.
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, 7);
  release.join();
  cudaFree(d);
}

TEST(CudaEmuMemory, CopiesAndFreesAreChecked) {
  int* d = DeviceAlloc<int>(4);
  std::vector<int> h(4, 1);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 4 * sizeof(int), cudaMemcpyDeviceToHost), cudaErrorInvalidMemcpyDirection);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 5 * sizeof(int), cudaMemcpyHostToDevice), cudaErrorInvalidValue);  // past the end
  EXPECT_EQ(cudaMemcpy(d, h.data(), 4 * sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(d + 1), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidValue);  // double free
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  void* huge = nullptr;
  EXPECT_EQ(cudaMalloc(&huge, total + 1), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaSetDevice(1000), cudaErrorInvalidDevice);
  cudaGetLastError();
}

// A device fault breaks its device's context for good, as an illegal
// address does on a GPU: the faulting launch succeeds (the fault is
// asynchronous), every later call on the device fails with it and reading
// the error does not clear it; another device runs on.
TEST(CudaEmuMemory, AFaultedDeviceFailsEveryCallUntilTheFaultsAreCleared) {
  constexpr int kDevice = 1;  // faulted only within this test
  struct Mend {  // whatever fails here, the next test's devices are sound
    ~Mend() {
      colod_cuda_emu::ClearDeviceFaults();
      cudaSetDevice(0);
    }
  } mend;
  ASSERT_EQ(cudaSetDevice(kDevice), cudaSuccess);
  int* d = DeviceAlloc<int>(64);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  ASSERT_EQ(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
  // A group's kernels launch at its end: one the fault breaks meanwhile fails there.
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(d, d, 64, ncclInt32, ncclSum, comm, stream), ncclSuccess);
  colod_cuda_emu::FaultDeviceAtLaunch(kDevice, 2);
  EXPECT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, stream, d, 64), cudaSuccess);
  EXPECT_FALSE(colod_cuda_emu::DeviceFaulted(kDevice));
  EXPECT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, stream, d, 64), cudaSuccess) << "the fault is asynchronous";
  EXPECT_TRUE(colod_cuda_emu::DeviceFaulted(kDevice));
  EXPECT_EQ(ncclGroupEnd(), ncclUnhandledCudaError);
  EXPECT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, stream, d, 64), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorIllegalAddress);
  int h[64] = {};
  EXPECT_EQ(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaMemsetAsync(d, 0, sizeof h, stream), cudaErrorIllegalAddress);
  void* more = nullptr;
  EXPECT_EQ(cudaMallocAsync(&more, 64, stream), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress) << "reading the error cleared it";
  cudaEvent_t event = nullptr;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(event, stream), cudaErrorIllegalAddress);
  // NCCL's kernel launch fails too.
  EXPECT_EQ(ncclAllReduce(d, d, 64, ncclInt32, ncclSum, comm, stream), ncclUnhandledCudaError);
  EXPECT_EQ(ncclSend(d, 64, ncclInt32, 0, comm, stream), ncclUnhandledCudaError);
  // Another device is untouched (the thread's last error, read here, was
  // the failed calls' on the faulted device; not sticky on this one).
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // The faulted device's event fails wherever it is asked from.
  EXPECT_EQ(cudaEventQuery(event), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaEventSynchronize(event), cudaErrorIllegalAddress);
  cudaGetLastError();
  int* other = DeviceAlloc<int>(64);
  EXPECT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, cudaStreamLegacy, other, 64), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h, other, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[63], 63);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(other);
  // Cleared (a test's mend: no context on a GPU recovers), the device runs again.
  colod_cuda_emu::ClearDeviceFaults();
  ASSERT_EQ(cudaSetDevice(kDevice), cudaSuccess);
  EXPECT_FALSE(colod_cuda_emu::DeviceFaulted(kDevice));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, stream, d, 64), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[63], 63);
  EXPECT_EQ(ncclAllReduce(d, d, 64, ncclInt32, ncclSum, comm, stream), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
  cudaEventDestroy(event);
  cudaStreamDestroy(stream);
  cudaFree(d);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// Device 3 alone is used here, so other tests' pools do not interfere.
TEST(CudaEmuMemory, ThePoolKeepsFreedBlocksUpToItsReleaseThreshold) {
  ASSERT_EQ(cudaSetDevice(3), cudaSuccess);
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 3), cudaSuccess);
  auto attr = [&](cudaMemPoolAttr a) {
    uint64_t v = 0;
    EXPECT_EQ(cudaMemPoolGetAttribute(pool, a, &v), cudaSuccess);
    return v;
  };
  cudaStream_t s = cudaStreamPerThread;
  auto alloc_free = [&](size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMallocAsync(&p, n, s), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(p, 0, n, s), cudaSuccess);  // the whole size is usable, no more
    EXPECT_EQ(cudaMemsetAsync(p, 0, n + 1, s), cudaErrorInvalidValue);
    cudaGetLastError();
    EXPECT_EQ(cudaFreeAsync(p, s), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  };
  // CUDA's default threshold is 0: a freed block goes back to the device.
  EXPECT_EQ(attr(cudaMemPoolAttrReleaseThreshold), 0u);
  const uint64_t before = colod_cuda_emu::GetCounters().device_allocations;
  alloc_free(1000);
  alloc_free(1000);
  EXPECT_EQ(colod_cuda_emu::GetCounters().device_allocations - before, 2u);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 0u);
  // Kept: the same size again is the pool's block, not new device memory.
  uint64_t keep_all = UINT64_MAX;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all), cudaSuccess);
  alloc_free(1000);
  const uint64_t warm = colod_cuda_emu::GetCounters().device_allocations;
  for (int i = 0; i < 5; ++i) alloc_free(900);  // the same 512-byte-rounded block
  EXPECT_EQ(colod_cuda_emu::GetCounters().device_allocations, warm);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 1024u);
  EXPECT_EQ(attr(cudaMemPoolAttrUsedMemCurrent), 0u);
  EXPECT_EQ(attr(cudaMemPoolAttrUsedMemHigh), 1024u);
  uint64_t zero = 0;
  EXPECT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &zero), cudaErrorInvalidValue);
  cudaGetLastError();
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  EXPECT_EQ(attr(cudaMemPoolAttrReservedMemCurrent), 0u);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &zero), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// CUDA lets the freeing stream reuse a block at once (its later work comes
// after the free) but other streams only once the free has been reached.
TEST(CudaEmuMemory, AFreedBlockIsReusedInStreamOrder) {
  ASSERT_EQ(cudaSetDevice(2), cudaSuccess);
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 2), cudaSuccess);
  uint64_t keep_all = UINT64_MAX, zero = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all), cudaSuccess);
  cudaStream_t a, b;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  std::atomic<int> flag{0};
  int* out = DeviceAlloc<int>(1);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 4096, a), cudaSuccess);
  ASSERT_EQ(Launch(WaitForFlag, dim3(1), dim3(1), 0, a, &flag, out), cudaSuccess);  // holds stream a
  ASSERT_EQ(cudaFreeAsync(p, a), cudaSuccess);
  void* on_b = nullptr;
  ASSERT_EQ(cudaMallocAsync(&on_b, 4096, b), cudaSuccess);
  EXPECT_NE(on_b, p);  // a has not reached the free
  void* on_a = nullptr;
  ASSERT_EQ(cudaMallocAsync(&on_a, 4096, a), cudaSuccess);
  EXPECT_EQ(on_a, p);  // after the free in a's order
  flag = 1;
  ASSERT_EQ(cudaFreeAsync(on_a, a), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  void* again = nullptr;
  ASSERT_EQ(cudaMallocAsync(&again, 4096, b), cudaSuccess);
  EXPECT_EQ(again, p);  // reached: any stream
  ASSERT_EQ(cudaFreeAsync(again, b), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(on_b, b), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &zero), cudaSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  uint64_t reserved = 1;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved), cudaSuccess);
  EXPECT_EQ(reserved, 0u);
  EXPECT_EQ(cudaStreamDestroy(a), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(b), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaFree(out);
}

TEST(CudaEmuCounters, SynchronizationsQueriesAndLaunchesAreCounted) {
  int* d = DeviceAlloc<int>(64);
  const colod_cuda_emu::Counters a = colod_cuda_emu::GetCounters();
  ASSERT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, cudaStreamPerThread, d, 64), cudaSuccess);
  ASSERT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, cudaStreamPerThread, d, 64), cudaSuccess);
  (void)cudaStreamQuery(cudaStreamPerThread);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  int h[64];
  ASSERT_EQ(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, cudaStreamPerThread), cudaSuccess);  // pageable
  const colod_cuda_emu::Counters b = colod_cuda_emu::GetCounters();
  EXPECT_EQ(b.kernel_launches - a.kernel_launches, 2u);
  EXPECT_EQ(b.stream_queries - a.stream_queries, 1u);
  EXPECT_EQ(b.host_synchronizations - a.host_synchronizations, 2u);
  EXPECT_EQ(b.device_allocations, a.device_allocations);
  EXPECT_EQ(h[63], 63);
  cudaFree(d);
}

// A thread's own counters see its calls and none of another thread's.
TEST(CudaEmuCounters, EachHostThreadCountsItsOwnCalls) {
  int* d = DeviceAlloc<int>(64);
  const colod_cuda_emu::Counters mine = colod_cuda_emu::GetThreadCounters();
  colod_cuda_emu::Counters theirs_before, theirs_after;
  std::thread other([&] {
    theirs_before = colod_cuda_emu::GetThreadCounters();
    for (int i = 0; i < 3; ++i) ASSERT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, cudaStreamPerThread, d, 64), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    theirs_after = colod_cuda_emu::GetThreadCounters();
  });
  other.join();
  ASSERT_EQ(Launch(WriteIndex, dim3(1), dim3(64), 0, cudaStreamPerThread, d, 64), cudaSuccess);
  (void)cudaStreamQuery(cudaStreamPerThread);
  const colod_cuda_emu::Counters now = colod_cuda_emu::GetThreadCounters();
  EXPECT_EQ(now.kernel_launches - mine.kernel_launches, 1u);
  EXPECT_EQ(now.stream_queries - mine.stream_queries, 1u);
  EXPECT_EQ(now.host_synchronizations, mine.host_synchronizations);
  EXPECT_EQ(theirs_after.kernel_launches - theirs_before.kernel_launches, 3u);
  EXPECT_EQ(theirs_after.host_synchronizations - theirs_before.host_synchronizations, 1u);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  cudaFree(d);
}

TEST(CudaEmuFp16, ConversionsRoundToNearestEven) {
  EXPECT_EQ(__half_as_ushort(__float2half_rn(1.0f)), 0x3c00);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(-2.0f)), 0xc000);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(65504.0f)), 0x7bff);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(65519.0f)), 0x7bff);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(65520.0f)), 0x7c00);  // rounds to inf
  EXPECT_EQ(__half_as_ushort(__float2half_rn(std::ldexp(1.0f, -24))), 0x0001);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(std::ldexp(1.0f, -25))), 0x0000);      // tie: to even (0)
  EXPECT_EQ(__half_as_ushort(__float2half_rn(std::ldexp(3.0f, -25))), 0x0002);      // tie: to even (2)
  EXPECT_EQ(__half_as_ushort(__float2half_rn(0.1f)), 0x2e66);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(1.0f + std::ldexp(1.0f, -11))), 0x3c00);  // tie: to even
  EXPECT_EQ(__half_as_ushort(__float2half_rn(1.0f + std::ldexp(3.0f, -11))), 0x3c02);
  // Every finite half survives the round trip through float exactly.
  for (uint32_t u = 0; u < 0x10000; ++u) {
    const __half h = __ushort_as_half(static_cast<unsigned short>(u));
    const float f = __half2float(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(__half_as_ushort(__float2half_rn(f)), u) << std::hex << u;
  }
  EXPECT_TRUE(std::isnan(__half2float(__ushort_as_half(0x7e00))));
  EXPECT_EQ(__half2float(__ushort_as_half(0x0001)), std::ldexp(1.0f, -24));
}

TEST(CudaEmuBf16, ConversionsRoundToNearestEven) {
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(1.0f)), 0x3f80);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(1.0f + std::ldexp(1.0f, -8))), 0x3f80);  // tie: to even
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(1.0f + std::ldexp(3.0f, -8))), 0x3f82);  // tie: to even
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(-2.5f)), 0xc020);
  EXPECT_TRUE(std::isnan(__bfloat162float(__float2bfloat16_rn(std::nanf("")))));
  for (uint32_t u = 0; u < 0x10000; ++u) {  // every finite bf16 round-trips
    const float f = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(u)));
    if (std::isnan(f)) continue;
    ASSERT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(f)), u) << std::hex << u;
  }
}

// Row-major C[m x n] = op(A) op(B), as kernels/cuda/layer_ops.cu maps it:
// column-major C^T = op(B)^T op(A)^T.
void RowMajorGemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, const float* a, const float* b, float* c) {
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &one, b,
                         CUDA_R_32F, tb ? k : n, a, CUDA_R_32F, ta ? m : k, &zero, c, CUDA_R_32F, n,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
}

TEST(CudaEmuCublas, GemmMatchesANaiveProductInEveryTransposition) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(h, cudaStreamPerThread), CUBLAS_STATUS_SUCCESS);
  const int m = 7, n = 5, k = 3;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> a(m * k), b(k * n);
  for (float& v : a) v = dist(rng);
  for (float& v : b) v = dist(rng);
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      // Stored transposed where op is T: A is k x m, B is n x k.
      std::vector<float> as(a.size()), bs(b.size());
      for (int i = 0; i < m; ++i) {
        for (int p = 0; p < k; ++p) (ta ? as[p * m + i] : as[i * k + p]) = a[i * k + p];
      }
      for (int p = 0; p < k; ++p) {
        for (int j = 0; j < n; ++j) (tb ? bs[j * k + p] : bs[p * n + j]) = b[p * n + j];
      }
      float* da = DeviceAlloc<float>(as.size());
      float* db = DeviceAlloc<float>(bs.size());
      float* dc = DeviceAlloc<float>(m * n);
      cudaMemcpy(da, as.data(), as.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(db, bs.data(), bs.size() * 4, cudaMemcpyHostToDevice);
      RowMajorGemm(h, ta, tb, m, n, k, da, db, dc);
      std::vector<float> c(m * n);
      ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
      cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double want = 0;
          for (int p = 0; p < k; ++p) want += double{a[i * k + p]} * b[p * n + j];
          EXPECT_NEAR(c[i * n + j], want, 1e-5) << "ta=" << ta << " tb=" << tb << " at " << i << "," << j;
        }
      }
      cudaFree(da);
      cudaFree(db);
      cudaFree(dc);
    }
  }
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
}

TEST(CudaEmuCublas, LeadingDimensionsAreChecked) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  float* d = DeviceAlloc<float>(64);
  const float one = 1, zero = 0;
  // lda < rows of A (m for OP_N)
  EXPECT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 3, d, 4, &zero, d, 4),
            CUBLAS_STATUS_INVALID_VALUE);
  // ldb < rows of B (n for OP_T)
  EXPECT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, 4, 5, 4, &one, d, 4, d, 4, &zero, d, 4),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 4, d, 4, &zero, d, 3),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  cudaFree(d);
}

TEST(CudaEmuCublasDeathTest, AnOperandPastItsAllocationIsAnIllegalAddress) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        cublasHandle_t h;
        cublasCreate(&h);
        float* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 16 * sizeof(float));
        const float one = 1;
        const float zero = 0;
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 8, &one, d, 4, d, 8, &zero, d, 4);  // A is 4 x 8
      },
      "illegal address");
}

// ---- cuBLASLt ----

// D [m x n] (column-major, f32) = op(A) op(B) with `epilogue` through
// cuBLASLt as colod calls it: descriptor, layouts, preference with the
// given alignment, heuristic, matmul. Returns the heuristic's or matmul's
// status.
cublasStatus_t LtMatmul(cublasLtHandle_t h, cublasLtEpilogue_t epilogue, bool ta, bool tb, int m, int n, int k,
                        const float* a, const float* b, float* d, float* bias, uint32_t align, float* aux = nullptr) {
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  const uint32_t e = epilogue;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
  if (bias != nullptr) cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  if (aux != nullptr) {
    const int64_t aux_ld = m;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld);
  }
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, ta ? k : m, ta ? m : k, ta ? k : m);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, tb ? n : k, tb ? k : n, tb ? n : k);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, m);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
  }
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &result, &found);
  if (st == CUBLAS_STATUS_SUCCESS && found == 1) {
    const float one = 1, zero = 0;
    st = cublasLtMatmul(h, desc, &one, a, la, b, lb, &zero, d, lc, d, lc, &result.algo, nullptr, 0,
                        cudaStreamPerThread);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  return st;
}

TEST(CudaEmuCublasLt, BiasGeluAndBiasGradientEpiloguesMatchANaiveProduct) {
  cublasLtHandle_t h;
  ASSERT_EQ(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(colod_cublas_emu::LiveLtHandles(), 1);
  const int m = 8, n = 5, k = 4;  // m: the GELU input's leading dimension, divisible by 8
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      // Column-major storage as cuBLASLt reads it: A is m x k (k x m where
      // transposed), B is k x n (n x k).
      std::vector<float> a(m * k), b(k * n), bias(m);
      for (float& v : a) v = dist(rng);
      for (float& v : b) v = dist(rng);
      for (float& v : bias) v = dist(rng);
      auto opa = [&](int i, int p) { return ta ? a[i * k + p] : a[p * m + i]; };
      auto opb = [&](int p, int j) { return tb ? b[p * n + j] : b[j * k + p]; };
      float* da = DeviceAlloc<float>(a.size());
      float* db = DeviceAlloc<float>(b.size());
      float* dd = DeviceAlloc<float>(m * n);
      float* dv = DeviceAlloc<float>(std::max(m, n));
      float* daux = DeviceAlloc<float>(m * n);
      cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(dv, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice);
      ASSERT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_BIAS, ta, tb, m, n, k, da, db, dd, dv, 16), CUBLAS_STATUS_SUCCESS);
      std::vector<float> d(m * n);
      ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
      cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double want = bias[i];  // the bias runs along D's rows
          for (int p = 0; p < k; ++p) want += double{opa(i, p)} * opb(p, j);
          EXPECT_NEAR(d[j * m + i], want, 1e-5) << "bias ta=" << ta << " tb=" << tb << " at " << i << "," << j;
        }
      }
      // Bias, then GELU (the tanh approximation), its input to aux.
      ASSERT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, ta, tb, m, n, k, da, db, dd, dv, 16, daux),
                CUBLAS_STATUS_SUCCESS);
      std::vector<float> aux(m * n);
      ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
      cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(aux.data(), daux, aux.size() * 4, cudaMemcpyDeviceToHost);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double z = bias[i];
          for (int p = 0; p < k; ++p) z += double{opa(i, p)} * opb(p, j);
          const double gelu = 0.5 * z * (1 + std::tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
          EXPECT_NEAR(aux[j * m + i], z, 1e-5) << "gelu's input at " << i << "," << j;
          EXPECT_NEAR(d[j * m + i], gelu, 1e-5) << "gelu at " << i << "," << j;
        }
      }
      ASSERT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_BGRADB, ta, tb, m, n, k, da, db, dd, dv, 16), CUBLAS_STATUS_SUCCESS);
      std::vector<float> grad(n);
      ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
      cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(grad.data(), dv, grad.size() * 4, cudaMemcpyDeviceToHost);
      for (int j = 0; j < n; ++j) {
        double want = 0;  // op(B)'s column j summed over k
        for (int p = 0; p < k; ++p) want += opb(p, j);
        EXPECT_NEAR(grad[j], want, 1e-6) << "bgradb ta=" << ta << " tb=" << tb << " at " << j;
        for (int i = 0; i < m; ++i) {
          double prod = 0;
          for (int p = 0; p < k; ++p) prod += double{opa(i, p)} * opb(p, j);
          EXPECT_NEAR(d[j * m + i], prod, 1e-5) << "bgradb's product at " << i << "," << j;
        }
      }
      for (float* p : {da, db, dd, dv, daux}) cudaFree(p);
    }
  }
  float* d = DeviceAlloc<float>(64);
  // Epilogues the emulation does not model are refused, not run wrong; and a
  // bias epilogue needs its vector.
  EXPECT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_DGELU_BGRAD, false, false, 4, 4, 4, d, d, d, d, 16),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, false, 4, 4, 4, d, d, d, d, 16),
            CUBLAS_STATUS_INVALID_VALUE)
      << "GELU_AUX_BIAS without its auxiliary output";
  EXPECT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, false, false, 4, 4, 4, d, d, d, d, 16, d + 32),
            CUBLAS_STATUS_NOT_SUPPORTED)
      << "GELU's input with a leading dimension of 4";
  EXPECT_EQ(LtMatmul(h, CUBLASLT_EPILOGUE_BIAS, false, false, 4, 4, 4, d, d, d, nullptr, 16),
            CUBLAS_STATUS_INVALID_VALUE);
  cudaFree(d);
  EXPECT_EQ(cublasLtDestroy(h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(colod_cublas_emu::LiveLtHandles(), 0);
}

TEST(CudaEmuCublasLtDeathTest, AnOperandLessAlignedThanTheHeuristicWasToldFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        cublasLtHandle_t h;
        cublasLtCreate(&h);
        float* d = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&d), 256 * sizeof(float));
        // A starts 4 bytes into the allocation; the preference promised 16.
        LtMatmul(h, CUBLASLT_EPILOGUE_DEFAULT, false, false, 4, 4, 4, d + 1, d + 64, d + 128, nullptr, 16);
      },
      "A is 4-byte aligned");
}

// ---- NCCL ----

// Runs fn(rank) on `n` threads, each with device `rank`.
void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      fn(r);
    });
  }
  for (auto& t : threads) t.join();
}

std::vector<float> ToHost(const float* d, size_t n) {
  std::vector<float> h(n);
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

float* ToDevice(const std::vector<float>& h) {
  float* d = DeviceAlloc<float>(h.size());
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

TEST(CudaEmuNccl, CollectivesMatchTheirDefinitions) {
  const int n = 4;
  const size_t count = 6;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto value = [](int r, size_t i) { return static_cast<float>(10 * r + i); };
  OnRanks(n, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess);
    int rank = -1, size = -1;
    ncclCommUserRank(comm, &rank);
    ncclCommCount(comm, &size);
    EXPECT_EQ(rank, r);
    EXPECT_EQ(size, n);
    std::vector<float> mine(count * n);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = value(r, i);
    float* in = ToDevice(mine);
    float* out = DeviceAlloc<float>(count * n);
    // AllReduce (in place)
    float* ar = ToDevice(std::vector<float>(mine.begin(), mine.begin() + count));
    ASSERT_EQ(ncclAllReduce(ar, ar, count, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
    std::vector<float> got = ToHost(ar, count);
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[i], value(0, i) + value(1, i) + value(2, i) + value(3, i));
    // AllGather
    ASSERT_EQ(ncclAllGather(in, out, count, ncclFloat32, comm, cudaStreamPerThread), ncclSuccess);
    got = ToHost(out, count * n);
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[j * count + i], value(j, i));
    }
    // ReduceScatter: rank r gets the sum of every rank's r-th chunk.
    ASSERT_EQ(ncclReduceScatter(in, out, count, ncclFloat32, ncclMax, comm, cudaStreamPerThread), ncclSuccess);
    got = ToHost(out, count);
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[i], value(n - 1, r * count + i));
    // Broadcast from rank 2
    ASSERT_EQ(ncclBroadcast(in, out, count, ncclFloat32, 2, comm, cudaStreamPerThread), ncclSuccess);
    got = ToHost(out, count);
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[i], value(2, i));
    // AlltoAll: chunk j of rank r's output is chunk r of rank j's input.
    ASSERT_EQ(ncclAlltoAll(in, out, count, ncclFloat32, comm, cudaStreamPerThread), ncclSuccess);
    got = ToHost(out, count * n);
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[j * count + i], value(j, r * count + i));
    }
    // Host memory is refused, as NCCL refuses it.
    std::vector<float> host(count);
    EXPECT_EQ(ncclAllReduce(host.data(), host.data(), count, ncclFloat32, ncclSum, comm, cudaStreamPerThread),
              ncclInvalidArgument);
    EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
    cudaFree(in);
    cudaFree(out);
    cudaFree(ar);
  });
}

TEST(CudaEmuNccl, SplitGroupsRanksByColorOrderedByKey) {
  const int n = 4;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  OnRanks(n, [&](int r) {
    ncclComm_t comm, sub = nullptr;
    ASSERT_EQ(ncclCommInitRank(&comm, n, id, r), ncclSuccess);
    // Colors {0, 1, 0, 1}; keys reverse the order.
    ASSERT_EQ(ncclCommSplit(comm, r % 2, -r, &sub, nullptr), ncclSuccess);
    ASSERT_NE(sub, nullptr);
    int rank = -1, size = -1;
    ncclCommUserRank(sub, &rank);
    ncclCommCount(sub, &size);
    EXPECT_EQ(size, 2);
    EXPECT_EQ(rank, r < 2 ? 1 : 0);
    float* x = ToDevice({static_cast<float>(r)});
    ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, sub, cudaStreamPerThread), ncclSuccess);
    EXPECT_EQ(ToHost(x, 1)[0], r % 2 == 0 ? 0 + 2 : 1 + 3);
    ncclComm_t none = reinterpret_cast<ncclComm_t>(0x1);
    ASSERT_EQ(ncclCommSplit(comm, r == 0 ? 0 : NCCL_SPLIT_NOCOLOR, 0, &none, nullptr), ncclSuccess);
    EXPECT_EQ(none == nullptr, r != 0);
    if (none != nullptr) ncclCommDestroy(none);
    ncclCommDestroy(sub);
    ncclCommDestroy(comm);
    cudaFree(x);
  });
}

TEST(CudaEmuNccl, NonBlockingInitIsInProgressUntilEveryRankJoined) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c0 = nullptr, c1 = nullptr;
  ASSERT_EQ(ncclCommInitRankConfig(&c0, 2, id, 0, &config), ncclSuccess);
  ncclResult_t state = ncclSuccess;
  ASSERT_EQ(ncclCommGetAsyncError(c0, &state), ncclSuccess);
  EXPECT_EQ(state, ncclInProgress);
  ASSERT_EQ(ncclCommInitRankConfig(&c1, 2, id, 1, &config), ncclSuccess);
  ASSERT_EQ(ncclCommGetAsyncError(c0, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);
  ncclComm_t dup = nullptr;
  EXPECT_EQ(ncclCommInitRankConfig(&dup, 2, id, 1, &config), ncclInvalidUsage);  // an id serves one communicator
  ncclUniqueId foreign;
  memset(&foreign, 0, sizeof foreign);
  snprintf(foreign.internal, sizeof foreign.internal, "colod-nccl-emu:1:1:0");
  EXPECT_EQ(ncclCommInitRankConfig(&dup, 2, foreign, 0, &config), ncclInvalidUsage);  // another process's id
  ncclCommDestroy(c0);
  ncclCommDestroy(c1);
}

TEST(CudaEmuNccl, UngroupedExchangeDeadlocksGroupedOneCompletes) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  OnRanks(2, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, 2, id, r), ncclSuccess);
    const int peer = 1 - r;
    float* out = ToDevice({static_cast<float>(r + 1)});
    float* in = ToDevice({0});
    // Grouped: both ranks send then receive, fused: completes.
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    ASSERT_EQ(ncclSend(out, 1, ncclFloat32, peer, comm, cudaStreamPerThread), ncclSuccess);
    ASSERT_EQ(ncclRecv(in, 1, ncclFloat32, peer, comm, cudaStreamPerThread), ncclSuccess);
    ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
    EXPECT_EQ(ToHost(in, 1)[0], static_cast<float>(peer + 1));
    // Ungrouped on one stream each: each Send waits for a Recv queued behind it.
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(ncclSend(out, 1, ncclFloat32, peer, comm, s), ncclSuccess);
    ASSERT_EQ(ncclRecv(in, 1, ncclFloat32, peer, comm, s), ncclSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
    // Abort frees the stream: its waits end.
    ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaStreamDestroy(s);
    cudaFree(out);
    cudaFree(in);
  });
}

// ---- Connections at first use (nccl.cc) ----

// ncclCommGetAsyncError of `comm`.
ncclResult_t StateOf(ncclComm_t comm) {
  ncclResult_t state = ncclInternalError;
  EXPECT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  return state;
}

// Polls until `comm` leaves ncclInProgress, at most 10 s.
ncclResult_t Settle(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  for (int i = 0; i < 1000 && (state = StateOf(comm)) == ncclInProgress; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return state;
}

TEST(CudaEmuNccl, AFirstSendHoldsTheHostUntilItsPeerReceivesALaterOneDoesNot) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::atomic<int> sent{0};
  OnRanks(2, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, 2, id, r), ncclSuccess);  // blocking
    float* x = ToDevice({static_cast<float>(r + 1), static_cast<float>(r + 2)});
    if (r == 0) {
      ASSERT_EQ(ncclSend(x, 1, ncclFloat32, 1, comm, cudaStreamPerThread), ncclSuccess);  // connects 0 -> 1
      sent = 1;
      ASSERT_EQ(ncclSend(x + 1, 1, ncclFloat32, 1, comm, cudaStreamPerThread), ncclSuccess);  // connected
      sent = 2;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      EXPECT_EQ(sent, 0) << "the first send returned before its peer's receive connected the pair";
      ASSERT_EQ(ncclRecv(x, 1, ncclFloat32, 0, comm, cudaStreamPerThread), ncclSuccess);
      for (int i = 0; i < 1000 && sent != 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      EXPECT_EQ(sent, 2) << "the second send waited for its receive on the host";
      ASSERT_EQ(ncclRecv(x + 1, 1, ncclFloat32, 0, comm, cudaStreamPerThread), ncclSuccess);
      EXPECT_EQ(ToHost(x, 2), (std::vector<float>{1, 2}));
    }
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    ncclCommDestroy(comm);
    cudaFree(x);
  });
}

TEST(CudaEmuNccl, ANonBlockingFirstUseIsInProgressUntilEveryEndArrived) {
  // Both ranks on this thread: non-blocking calls return at once.
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c[2];
  float* x[2];
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(ncclCommInitRankConfig(&c[r], 2, id, r, &config), ncclSuccess);
    x[r] = ToDevice({static_cast<float>(r + 1)});
  }
  ASSERT_EQ(Settle(c[0]), ncclSuccess);
  // The first collective connects the ranks: in progress until both called it.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(ncclAllReduce(x[0], x[0], 1, ncclFloat32, ncclSum, c[0], cudaStreamPerThread), ncclInProgress);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(StateOf(c[0]), ncclInProgress);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(ncclAllReduce(x[1], x[1], 1, ncclFloat32, ncclSum, c[1], cudaStreamPerThread), ncclInProgress);
  EXPECT_EQ(Settle(c[0]), ncclSuccess);
  EXPECT_EQ(Settle(c[1]), ncclSuccess);
  // The next one is enqueued at once.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(ncclAllReduce(x[0], x[0], 1, ncclFloat32, ncclSum, c[0], cudaStreamPerThread), ncclSuccess);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(ncclAllReduce(x[1], x[1], 1, ncclFloat32, ncclSum, c[1], cudaStreamPerThread), ncclSuccess);
  // A first receive (1 from 0): in progress until rank 0's first send to 1.
  EXPECT_EQ(ncclRecv(x[1], 1, ncclFloat32, 0, c[1], cudaStreamPerThread), ncclInProgress);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(StateOf(c[1]), ncclInProgress);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(ncclSend(x[0], 1, ncclFloat32, 1, c[0], cudaStreamPerThread), ncclInProgress);
  EXPECT_EQ(Settle(c[0]), ncclSuccess);
  EXPECT_EQ(Settle(c[1]), ncclSuccess);
  // 1 + 2 twice summed is 6 on both; rank 1 then receives rank 0's 6.
  EXPECT_EQ(ToHost(x[0], 1)[0], 6.0f);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(ToHost(x[1], 1)[0], 6.0f);
  for (int r = 0; r < 2; ++r) {
    ncclCommDestroy(c[r]);
    cudaFree(x[r]);
  }
}

// A call issued the moment ncclCommGetAsyncError leaves ncclInProgress is
// legal, as on NCCL. The emulation once ended a connection by publishing the
// state before clearing its own mark of a connection being made, and such a
// call died between the two (a pp=2 CLI test hit it in CI). The pause holds
// the connecting thread between its two marks.
TEST(CudaEmuNccl, ACallRightAfterTheConnectionSettlesIsAccepted) {
  constexpr int kComms = 3;
  ncclUniqueId ids[kComms];
  for (auto& id : ids) ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  colod_nccl_emu::SetConnectEndPause(100);
  OnRanks(2, [&](int r) {
    float* x = ToDevice({static_cast<float>(r + 1)});
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    for (int i = 0; i < kComms; ++i) {
      ncclComm_t comm = nullptr;
      ASSERT_EQ(ncclCommInitRankConfig(&comm, 2, ids[i], r, &config), ncclSuccess);
      ASSERT_EQ(Settle(comm), ncclSuccess);
      const ncclResult_t first = ncclAllReduce(x, x, 1, ncclFloat32, ncclMax, comm, cudaStreamPerThread);
      ASSERT_TRUE(first == ncclSuccess || first == ncclInProgress) << first;
      // Polled without sleeping, at most 10 s.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      ncclResult_t state = ncclInProgress;
      while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
      }
      ASSERT_EQ(state, ncclSuccess);
      // At once: the connection is made.
      ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclMax, comm, cudaStreamPerThread), ncclSuccess);
      ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
      ncclCommDestroy(comm);
    }
    EXPECT_EQ(ToHost(x, 1)[0], 2.0f);  // the max of 1 and 2
    cudaFree(x);
  });
  colod_nccl_emu::SetConnectEndPause(0);
}

// One thread's group over both ranks of a communicator (as one process
// driving two devices does): each communicator connects on its own, so the
// group connects and runs. Blocking and non-blocking communicators in one
// group are refused, as NCCL refuses them.
TEST(CudaEmuNccl, AGroupOverSeveralCommunicatorsConnectsEachOnItsOwn) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c[2];
  float* x[2];
  cudaStream_t s[2];
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(ncclCommInitRankConfig(&c[r], 2, id, r, &config), ncclSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking), cudaSuccess);
    x[r] = ToDevice({static_cast<float>(10 * (r + 1))});
  }
  ASSERT_EQ(Settle(c[0]), ncclSuccess);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(x[0], 1, ncclFloat32, 1, c[0], s[0]), ncclSuccess);
  ASSERT_EQ(ncclRecv(x[1], 1, ncclFloat32, 0, c[1], s[1]), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInProgress);
  EXPECT_EQ(Settle(c[0]), ncclSuccess);
  EXPECT_EQ(Settle(c[1]), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s[1]), cudaSuccess);
  float got = 0;
  ASSERT_EQ(cudaMemcpy(&got, x[1], sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, 10.0f);
  ASSERT_EQ(cudaStreamSynchronize(s[0]), cudaSuccess);
  // A blocking communicator beside the non-blocking ones.
  ncclUniqueId solo_id;
  ASSERT_EQ(ncclGetUniqueId(&solo_id), ncclSuccess);
  ncclComm_t solo;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(ncclCommInitRank(&solo, 1, solo_id, 0), ncclSuccess);
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(x[0], x[0], 1, ncclFloat32, ncclSum, solo, s[0]), ncclSuccess);
  ASSERT_EQ(ncclAllReduce(x[0], x[0], 1, ncclFloat32, ncclSum, c[0], s[0]), ncclSuccess);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
  for (int r = 0; r < 2; ++r) {
    cudaStreamDestroy(s[r]);
    ncclCommDestroy(c[r]);
    cudaFree(x[r]);
  }
  ncclCommDestroy(solo);
}

// Three ranks each send to the next, then receive from the previous, on
// streams of their own, each call alone: every first send waits for a
// receive its peer makes only after its own first send, so the hosts hang
// as on GPUs, where the data path alone would not (the streams differ);
// the same exchange in one group connects. An abort ends the wait.
TEST(CudaEmuNccl, FirstUsesThatWaitInACycleHangOnTheHostGroupedTheyConnect) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const int n = 3;
  OnRanks(n, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRankConfig(&comm, n, id, r, &config), ncclSuccess);
    ASSERT_EQ(Settle(comm), ncclSuccess);
    float* x = ToDevice({static_cast<float>(r)});
    EXPECT_EQ(ncclSend(x, 1, ncclFloat32, (r + 1) % n, comm, cudaStreamPerThread), ncclInProgress);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(StateOf(comm), ncclInProgress) << "rank " << r;  // its receive never comes
    ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);  // nothing was enqueued
    cudaFree(x);
  });
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  OnRanks(n, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRankConfig(&comm, n, id, r, &config), ncclSuccess);
    ASSERT_EQ(Settle(comm), ncclSuccess);
    float* out = ToDevice({static_cast<float>(r)});
    float* in = ToDevice({-1});
    cudaStream_t recv_stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&recv_stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(ncclGroupStart(), ncclSuccess);
    ASSERT_EQ(ncclSend(out, 1, ncclFloat32, (r + 1) % n, comm, cudaStreamPerThread), ncclSuccess);
    ASSERT_EQ(ncclRecv(in, 1, ncclFloat32, (r + n - 1) % n, comm, recv_stream), ncclSuccess);
    EXPECT_EQ(ncclGroupEnd(), ncclInProgress);
    EXPECT_EQ(Settle(comm), ncclSuccess);
    ASSERT_EQ(cudaStreamSynchronize(recv_stream), cudaSuccess);
    float got = 0;
    ASSERT_EQ(cudaMemcpy(&got, in, sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, static_cast<float>((r + n - 1) % n));
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    cudaStreamDestroy(recv_stream);
    ncclCommDestroy(comm);
    cudaFree(out);
    cudaFree(in);
  });
}

TEST(CudaEmuNccl, ARankThatNeverEntersBlocksItsPeersUntilAbort) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  colod_nccl_emu::SetFault({colod_nccl_emu::FaultKind::kHang, /*rank=*/1, /*op=*/2, /*comm_size=*/3});
  OnRanks(3, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, 3, id, r), ncclSuccess);
    float* x = ToDevice({1});
    ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);  // op 1 completes
    ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(cudaStreamQuery(cudaStreamPerThread), cudaErrorNotReady) << "rank " << r;
    ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    cudaFree(x);
  });
  colod_nccl_emu::SetFault({});
}

TEST(CudaEmuNccl, AnInjectedErrorIsReportedAsync) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  colod_nccl_emu::SetFault({colod_nccl_emu::FaultKind::kError, /*rank=*/0, /*op=*/1, /*comm_size=*/2});
  OnRanks(2, [&](int r) {
    ncclComm_t comm;
    ASSERT_EQ(ncclCommInitRank(&comm, 2, id, r), ncclSuccess);
    float* x = ToDevice({1});
    ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
    if (r == 0) {
      ncclResult_t state = ncclSuccess;
      for (int i = 0; i < 200 && state == ncclSuccess; ++i) {
        ncclCommGetAsyncError(comm, &state);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_EQ(state, ncclRemoteError);
    }
    ncclCommAbort(comm);
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    cudaFree(x);
  });
  colod_nccl_emu::SetFault({});
}

// Rank 0 sends twice on a non-blocking communicator whose rank 1 never
// receives: the second call comes while the first still connects.
void SendWhileTheFirstSendConnects() {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c0, c1;
  ncclCommInitRankConfig(&c0, 2, id, 0, &config);
  ncclCommInitRankConfig(&c1, 2, id, 1, &config);
  float* x = DeviceAlloc<float>(1);
  ncclSend(x, 1, ncclFloat32, 1, c0, cudaStreamPerThread);
  ncclSend(x, 1, ncclFloat32, 1, c0, cudaStreamPerThread);
}

TEST(CudaEmuNcclDeathTest, ACallWhileTheLastIsInProgressIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(SendWhileTheFirstSendConnects(), "last call is in progress");
}

TEST(CudaEmuNcclDeathTest, UseAfterAbortIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        ncclUniqueId id;
        ncclGetUniqueId(&id);
        ncclComm_t comm;
        ncclCommInitRank(&comm, 1, id, 0);
        ncclCommAbort(comm);
        ncclResult_t state;
        ncclCommGetAsyncError(comm, &state);
      },
      "use after free");
}

}  // namespace
