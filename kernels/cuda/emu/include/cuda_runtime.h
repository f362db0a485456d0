// colod's CUDA emulation: the subset of the CUDA runtime and execution model
// that colod's .cu sources use, compiled by the host compiler. Test-only in
// spirit (docs/GPU.md): `--config=cuda-emu` builds every target against it so
// the GPU path runs in CI without a GPU; the default build never links it.
//
// What it models:
//   - the execution model: kernels launched through colod's launch helper
//     (kernels/cuda/launch.h) run every thread of every block; a block's
//     threads are fibers on one host thread (under --config=cuda-emu-tsan
//     each a thread of its own to ThreadSanitizer), so
//     `__syncthreads` is a real barrier and `__shared__` storage is shared by
//     a block's threads only;
//   - streams and events: each stream is a host thread executing its work in
//     stream order, asynchronously to the caller, so a missing wait is a
//     visible bug; the legacy default stream synchronizes with blocking
//     streams as CUDA's does; cudaStreamPerThread is per host thread;
//   - memory: device allocations are host memory, tracked per device with a
//     capacity (COLOD_CUDA_EMU_MEMORY, bytes), so copies, frees and GEMM
//     operands are checked against them.
// What it cannot show: timing, CUDA's own math library (libm is used), the
// hardware memory model (warps, coalescing, memory fences), and faults of
// kernels that read host memory.
#ifndef COLOD_KERNELS_CUDA_EMU_CUDA_RUNTIME_H_
#define COLOD_KERNELS_CUDA_EMU_CUDA_RUNTIME_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define COLOD_CUDA_EMULATION 1
#define CUDART_VERSION 13000
#define CUDA_VERSION 13000

// Qualifiers: kernels and device functions are ordinary host functions.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// ThreadSanitizer's build (gcc's __SANITIZE_THREAD__, clang's feature).
#if defined(__SANITIZE_THREAD__)
#define COLOD_CUDA_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COLOD_CUDA_EMU_TSAN 1
#endif
#endif
// Per block: a block's threads run on one host thread, one block at a time.
#define __shared__ static thread_local

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
  cudaErrorUnknown = 999,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major;
  int minor;
  int multiProcessorCount;
  int pciBusID;
  int pciDeviceID;
};

// ---- The runtime API (kernels/cuda/emu/runtime.cc) ----
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaRuntimeGetVersion(int* version);

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMalloc(void** ptr, size_t size);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t size);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream);

// Each device's default memory pool, which cudaMallocAsync allocates from.
struct CUmemPoolHandle_st {
  int device;
};
typedef struct CUmemPoolHandle_st* cudaMemPool_t;
enum cudaMemPoolAttr {
  cudaMemPoolAttrReleaseThreshold = 4,
  cudaMemPoolAttrReservedMemCurrent = 5,
  cudaMemPoolAttrReservedMemHigh = 6,
  cudaMemPoolAttrUsedMemCurrent = 7,
  cudaMemPoolAttrUsedMemHigh = 8,
};
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device);
// Values are uint64_t (cuuint64_t), as in CUDA.
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
// Gives the pool's unused memory back until it reserves at most the bytes given.
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream = 0);
cudaError_t cudaMemset(void* ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream = 0);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0);

// Kernel attributes: the dynamic shared memory a launch may ask for beyond
// the default 48 KiB, up to the device's opt-in limit (227 KiB on sm_90).
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value);
template <typename T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = 0);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);

// ---- The execution model (kernels/cuda/emu/execution.cc) ----
namespace colod_cuda_emu {

// A cp.async the calling thread started and has not waited for (CpAsync).
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;      // copied: 4, 8 or 16
  int src_bytes;  // read from src, the rest zeros
};

struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  // The block's dynamic shared memory (the launch's shared_bytes; null for
  // none): one buffer a grid, since blocks run one at a time.
  unsigned char* dynamic_shared = nullptr;
  // The thread's cp.async copies: committed groups, oldest first, and those
  // started since the last commit (a new block starts without any).
  mutable std::vector<std::vector<AsyncCopy>> async_groups = {};
  mutable std::vector<AsyncCopy> async_open = {};
};

// The CUDA thread the calling host code runs as (set while a kernel runs).
// Read it through CurrentThread().
extern thread_local const ThreadContext* current_thread;

// current_thread. Under ThreadSanitizer a relaxed atomic load: the fiber
// mode's scheduler sets it for each fiber it resumes, and TSan sees each
// fiber as a thread of its own (execution.cc), so a plain read would be a
// race with the scheduler's next write; a relaxed one is neither reported
// nor orders anything.
inline const ThreadContext* CurrentThread() {
#ifdef COLOD_CUDA_EMU_TSAN
  return __atomic_load_n(&current_thread, __ATOMIC_RELAXED);
#else
  return current_thread;
#endif
}

// __syncthreads: every thread of the block waits here until all have arrived.
void SyncThreads();

// Enqueues `thread` to run as each of grid x block CUDA threads on `stream`,
// with `shared_bytes` of dynamic shared memory a block (DynamicShared).
// Records and returns cudaErrorInvalidConfiguration for an empty grid or
// block, more than 1024 threads per block, grid dimensions CUDA refuses, or
// more than 48 KiB of dynamic shared memory unless cudaFuncSetAttribute
// raised `kernel`'s cudaFuncAttributeMaxDynamicSharedMemorySize that far.
cudaError_t LaunchGrid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, const void* kernel,
                       std::function<void()> thread);

// kernel<<<grid, block, shared_bytes, stream>>>(args...): the arguments are
// copied and converted to the kernel's parameter types at launch, as CUDA does.
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "kernel launched with the wrong number of arguments");
  auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
  return LaunchGrid(grid, block, shared_bytes, stream, reinterpret_cast<const void*>(kernel),
                    [kernel, params] { std::apply(kernel, *params); });
}

// The running block's dynamic shared memory (`extern __shared__` under
// nvcc): the launch's shared_bytes, 16-byte aligned, filled with 0xff bytes
// (NaN as f32, bf16 and f16) when the grid starts, since a GPU leaves it
// uninitialized.
inline unsigned char* DynamicShared() { return CurrentThread()->dynamic_shared; }

}  // namespace colod_cuda_emu

#define threadIdx (::colod_cuda_emu::CurrentThread()->thread_idx)
#define blockIdx (::colod_cuda_emu::CurrentThread()->block_idx)
#define blockDim (::colod_cuda_emu::CurrentThread()->block_dim)
#define gridDim (::colod_cuda_emu::CurrentThread()->grid_dim)

inline void __syncthreads() { ::colod_cuda_emu::SyncThreads(); }

// ---- Device intrinsics colod uses ----
inline float __uint_as_float(unsigned int u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  memcpy(&i, &f, sizeof i);
  return i;
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float x, float y) { return x / y; }
// An add the compiler never contracts into an FMA with a product before it
// (nvcc contracts a * b + c unless told; the host build is ISO C++, which does
// not).
inline float __fadd_rn(float x, float y) { return x + y; }

// Atomics on device memory: the block's threads are fibers, but blocks of
// concurrent kernels (other streams) run on other host threads.
inline float atomicAdd(float* address, float value) {
  unsigned int* word = reinterpret_cast<unsigned int*>(address);
  unsigned int old = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(word, &old, __float_as_uint(__uint_as_float(old) + value), true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return __uint_as_float(old);
}
inline double atomicAdd(double* address, double value) {
  unsigned long long* word = reinterpret_cast<unsigned long long*>(address);
  unsigned long long old = __atomic_load_n(word, __ATOMIC_RELAXED);
  for (;;) {
    double d;
    memcpy(&d, &old, sizeof d);
    d += value;
    unsigned long long next;
    memcpy(&next, &d, sizeof next);
    if (__atomic_compare_exchange_n(word, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) break;
  }
  double prev;
  memcpy(&prev, &old, sizeof prev);
  return prev;
}
inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_RELAXED); }
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline int atomicMax(int* address, int value) {
  int old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < value &&
         !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
inline int atomicCAS(int* address, int compare, int value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- Warp-level operations (execution.cc, warp.cc) ----
// A warp is 32 consecutive threads of the block in linear thread order
// (x fastest). Every warp-level operation is executed by whole warps: its
// mask must name every lane the warp has, and a lane that returns, or waits
// at __syncthreads, while others of its warp wait at one is reported as the
// hang it is on a GPU.
namespace colod_cuda_emu {

// The exchange under every warp-level operation: each lane of the calling
// thread's warp puts `bytes` (at most 64) from `mine`, waits until every lane
// of the warp has, and gets the 32 lanes' contributions in lane order in
// `all` (32 * bytes; zeros for lanes a partial last warp does not have).
void WarpExchange(const void* mine, size_t bytes, unsigned mask, void* all);

// The calling thread's lane: its linear index in the block, modulo 32.
inline int LaneId() {
  const ThreadContext& c = *CurrentThread();
  return static_cast<int>((c.thread_idx.x + c.block_dim.x * (c.thread_idx.y + c.block_dim.y * c.thread_idx.z)) %
                          32);
}

// `var` of the lane src_of(own lane) names, or the caller's own `var` where
// it names -1.
template <typename T, typename SrcOf>
T WarpShuffle(unsigned mask, T var, SrcOf src_of) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 16, "shuffles move up to 16 bytes");
  unsigned char all[32 * sizeof(T)];
  WarpExchange(&var, sizeof(T), mask, all);
  const int src = src_of(LaneId());
  if (src < 0 || src > 31) return var;
  T out;
  memcpy(&out, all + src * sizeof(T), sizeof(T));
  return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 by the
// calling warp: D = A B + C with A 16x16 (row-major fragments a[4]), B 16x8
// (column-major fragments b[2]), C and D 16x8 in f32, in PTX's fragment
// layout (kernels/cuda/warp.h). Products are exact in f32 and are summed in
// f32 in k order onto C.
enum class MmaType { kBf16, kF16 };
void MmaM16N8K16(MmaType type, float d[4], const unsigned a[4], const unsigned b[2], const float c[4]);

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16 by the calling
// warp: `matrices` 8x8 matrices of 16-bit elements, the rows of matrix j at
// the addresses lanes 8j..8j+7 give (each 16-byte aligned); lane l gets in
// r[j] row l/4's elements 2(l%4) and 2(l%4)+1 (the low half first), or with
// `trans` column l/4's elements of rows 2(l%4) and 2(l%4)+1.
void LdMatrix(int matrices, bool trans, unsigned* r, const void* row);

// cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes by the
// calling thread: `bytes` (4, 8 or 16; dst and src aligned to it) from global
// src to shared dst, src_bytes of them read and the rest zeros. On a GPU the
// destination is undefined from the start until the thread's wait for the
// group (CpAsyncWait): here it holds 0xff bytes (NaN as f32, bf16 and f16)
// until that wait, which makes the copy. So a kernel that reads a tile
// before its wait, or starts a copy over a tile another warp still reads,
// computes with NaNs.
void CpAsync(void* dst, const void* src, int bytes, int src_bytes);
// cp.async.commit_group: the copies started since the last commit become a
// group.
void CpAsyncCommit();
// cp.async.wait_group n: makes the copies of all but the newest n committed
// groups (copies not yet committed are not waited for).
void CpAsyncWait(int groups);

}  // namespace colod_cuda_emu

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return colod_cuda_emu::WarpShuffle(mask, var, [=](int lane) { return (lane & ~(width - 1)) + (src_lane & (width - 1)); });
}
// Lanes of a later group of `width` get their own value, as on a GPU.
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return colod_cuda_emu::WarpShuffle(mask, var, [=](int lane) {
    const int src = lane ^ lane_mask;
    return (src & ~(width - 1)) > (lane & ~(width - 1)) ? -1 : src;
  });
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return colod_cuda_emu::WarpShuffle(mask, var, [=](int lane) {
    const int src = lane + static_cast<int>(delta);
    return (src & ~(width - 1)) != (lane & ~(width - 1)) ? -1 : src;
  });
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return colod_cuda_emu::WarpShuffle(mask, var, [=](int lane) {
    const int src = lane - static_cast<int>(delta);
    return src < (lane & ~(width - 1)) ? -1 : src;
  });
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const unsigned char mine = predicate != 0;
  unsigned char all[32];
  colod_cuda_emu::WarpExchange(&mine, 1, mask, all);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(all[l]) << l;
  return bits & mask;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  const unsigned char mine = predicate != 0 ? 1 : 2;  // 0: a lane the warp does not have
  unsigned char all[32];
  colod_cuda_emu::WarpExchange(&mine, 1, mask, all);
  for (int l = 0; l < 32; ++l) {
    if (all[l] == 2 && ((mask >> l) & 1u)) return 0;
  }
  return 1;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  const unsigned char mine = 0;
  unsigned char all[32];
  colod_cuda_emu::WarpExchange(&mine, 1, mask, all);
}

#endif  // COLOD_KERNELS_CUDA_EMU_CUDA_RUNTIME_H_
