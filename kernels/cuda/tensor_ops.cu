#include "kernels/cuda/tensor_ops.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/launch.h"
#include "kernels/philox.h"

namespace colod::kernels::cuda {
namespace {

#define RETURN_IF_CUDA(call) COLOD_RETURN_IF_CUDA(call)

__host__ __device__ __forceinline__ uint16_t FloatToBF16Bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

__device__ __forceinline__ float LoadF(const char* p, int64_t i, ElemType t) {
  switch (t) {
    case ElemType::kF32: return reinterpret_cast<const float*>(p)[i];
    case ElemType::kBF16: return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
    case ElemType::kF16: return __half2float(__ushort_as_half(reinterpret_cast<const uint16_t*>(p)[i]));
    case ElemType::kI32: return static_cast<float>(reinterpret_cast<const int32_t*>(p)[i]);
    case ElemType::kI64: return static_cast<float>(reinterpret_cast<const int64_t*>(p)[i]);
  }
  return 0;
}

__device__ __forceinline__ void StoreF(char* p, int64_t i, ElemType t, float v) {
  switch (t) {
    case ElemType::kF32: reinterpret_cast<float*>(p)[i] = v; return;
    case ElemType::kBF16: reinterpret_cast<uint16_t*>(p)[i] = FloatToBF16Bits(v); return;
    case ElemType::kF16: reinterpret_cast<uint16_t*>(p)[i] = __half_as_ushort(__float2half_rn(v)); return;
    case ElemType::kI32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case ElemType::kI64: reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); return;
  }
}

__device__ __forceinline__ int64_t LoadI(const char* p, int64_t i, ElemType t) {
  return t == ElemType::kI32 ? reinterpret_cast<const int32_t*>(p)[i] : reinterpret_cast<const int64_t*>(p)[i];
}

__device__ __forceinline__ void StoreI(char* p, int64_t i, ElemType t, int64_t v) {
  if (t == ElemType::kI32) {
    reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
  } else {
    reinterpret_cast<int64_t*>(p)[i] = v;
  }
}

__host__ __device__ __forceinline__ int ElemSize(ElemType t) {
  return (t == ElemType::kBF16 || t == ElemType::kF16) ? 2 : (t == ElemType::kI64 ? 8 : 4);
}

__host__ __device__ __forceinline__ bool IsInt(ElemType t) { return t == ElemType::kI32 || t == ElemType::kI64; }

__global__ void StridedCopyKernel(const char* src, Layout sl, ElemType st, char* dst, Layout dl, ElemType dt,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rem = i, so = 0, dof = 0;
    for (int d = sl.ndim - 1; d >= 0; --d) {
      const int64_t idx = rem % sl.shape[d];
      rem /= sl.shape[d];
      so += idx * sl.strides[d];
      dof += idx * dl.strides[d];
    }
    if (st == dt) {
      const int es = ElemSize(st);
      for (int b = 0; b < es; ++b) dst[dof * es + b] = src[so * es + b];
    } else if (IsInt(st) && IsInt(dt)) {
      StoreI(dst, dof, dt, LoadI(src, so, st));
    } else {
      StoreF(dst, dof, dt, LoadF(src, so, st));
    }
  }
}

__global__ void FillRandomKernel(char* p, ElemType t, int64_t n, uint64_t seed, bool normal) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = normal ? PhiloxNormal(seed, static_cast<uint64_t>(i)) : PhiloxUniform(seed, static_cast<uint64_t>(i));
    StoreF(p, i, t, v);
  }
}

template <typename T>
__device__ __forceinline__ T Apply(BinaryOp op, T x, T y) {
  switch (op) {
    case BinaryOp::kAdd: return x + y;
    case BinaryOp::kSub: return x - y;
    case BinaryOp::kMul: return x * y;
  }
  return x;
}

__global__ void BinaryKernel(BinaryOp op, ElemType t, const char* a, const char* b, char* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t == ElemType::kI32) {
      reinterpret_cast<int32_t*>(out)[i] =
          Apply(op, reinterpret_cast<const int32_t*>(a)[i], reinterpret_cast<const int32_t*>(b)[i]);
    } else if (t == ElemType::kI64) {
      reinterpret_cast<int64_t*>(out)[i] =
          Apply(op, reinterpret_cast<const int64_t*>(a)[i], reinterpret_cast<const int64_t*>(b)[i]);
    } else {
      StoreF(out, i, t, Apply(op, LoadF(a, i, t), LoadF(b, i, t)));
    }
  }
}

__global__ void ScaleKernel(ElemType t, const char* a, float s, char* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StoreF(out, i, t, LoadF(a, i, t) * s);
  }
}

// Pass 1: block b sums the elements b*kThreads + t + k*gridDim*kThreads in a
// fixed order and tree; pass 2 sums the partials in block order.
// With `square`, of the elements' squares.
__global__ void SumPartialsKernel(ElemType t, const char* a, int64_t n, bool square, double* partials) {
  __shared__ double acc[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = IsInt(t) ? static_cast<double>(LoadI(a, i, t)) : static_cast<double>(LoadF(a, i, t));
    s += square ? v * v : v;
  }
  acc[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) acc[threadIdx.x] += acc[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = acc[0];
}

__global__ void SumFinalKernel(const double* partials, int count, double* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < count; ++i) s += partials[i];
    *out = s;
  }
}

// acc[0] += the partials summed in block order, in f32.
__global__ void AddSumKernel(const double* partials, int count, float* acc) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < count; ++i) s += partials[i];
    acc[0] += static_cast<float>(s);
  }
}

// The device's default memory pool, set to keep what it has reserved (CUDA's
// default release threshold, 0, gives freed memory back at every
// synchronization): after the first training step, tensors reuse the pool's
// memory and no step asks the device for more.
absl::StatusOr<cudaMemPool_t> KeptPool(int device) {
  static std::mutex mu;
  static std::set<int>* configured = new std::set<int>;
  cudaMemPool_t pool = nullptr;
  RETURN_IF_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
  std::lock_guard<std::mutex> lock(mu);  // two non-blocking calls, once per device
  if (configured->insert(device).second) {
    uint64_t keep_all = UINT64_MAX;
    const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (e != cudaSuccess) configured->erase(device);
    RETURN_IF_CUDA(e);
  }
  return pool;
}

}  // namespace

// Stream ordered on the device's compute stream: the memory is usable by
// work enqueued there from now on. Another stream (a communicator's) must
// wait on an event of the compute stream before it touches the memory, as
// NcclCommunicator does before every collective.
absl::StatusOr<void*> Malloc(int device, size_t nbytes) {
  COLOD_CUDA_BEGIN(stream, device);
  const absl::StatusOr<cudaMemPool_t> pool = KeptPool(device);
  if (!pool.ok()) return pool.status();
  void* p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, nbytes == 0 ? 1 : nbytes, stream);
  if (e == cudaErrorMemoryAllocation) {
    // The pool may hold freed blocks of other sizes: give them back and retry once.
    cudaGetLastError();
    RETURN_IF_CUDA(cudaStreamSynchronize(stream));
    RETURN_IF_CUDA(cudaMemPoolTrimTo(*pool, 0));
    e = cudaMallocAsync(&p, nbytes == 0 ? 1 : nbytes, stream);
  }
  RETURN_IF_CUDA(e);
  return p;
}

void Free(int device, void* p) {
  if (p == nullptr) return;
  absl::StatusOr<cudaStream_t> stream = ComputeStream(device);
  if (stream.ok()) cudaFreeAsync(p, *stream);  // in stream order: after every use enqueued so far
}

absl::Status Memset0(int device, void* p, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  RETURN_IF_CUDA(cudaMemsetAsync(p, 0, nbytes, stream));
  return Finish("cudaMemsetAsync");
}

absl::Status Memcpy(int device, void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  // Into pageable host memory (colod allocates no pinned memory) CUDA returns
  // once the copy has completed, after the work enqueued before it: the
  // caller may read `dst` at once. From pageable memory CUDA stages the source
  // before it returns, so the caller may reuse `src` at once.
  RETURN_IF_CUDA(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream));
  return Finish("cudaMemcpyAsync");
}

absl::Status StridedCopy(int device, const void* src, const Layout& src_layout, ElemType src_type, void* dst,
                         const Layout& dst_layout, ElemType dst_type) {
  if (src_layout.ndim != dst_layout.ndim || src_layout.ndim > kMaxDims) {
    return absl::InvalidArgumentError("StridedCopy: layouts differ in rank or exceed kMaxDims");
  }
  int64_t n = 1;
  for (int d = 0; d < src_layout.ndim; ++d) {
    if (src_layout.shape[d] != dst_layout.shape[d]) return absl::InvalidArgumentError("StridedCopy: shapes differ");
    n *= src_layout.shape[d];
  }
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(StridedCopyKernel, Blocks(n), kThreads, stream,
      static_cast<const char*>(src), src_layout, src_type, static_cast<char*>(dst), dst_layout, dst_type, n);
  return Finish("StridedCopyKernel");
}

absl::Status FillRandom(int device, void* p, ElemType type, int64_t n, uint64_t seed, bool normal) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(FillRandomKernel, Blocks(n), kThreads, stream, static_cast<char*>(p), type, n, seed, normal);
  return Finish("FillRandomKernel");
}

absl::Status Binary(int device, BinaryOp op, ElemType type, const void* a, const void* b, void* out, int64_t n) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(BinaryKernel, Blocks(n), kThreads, stream,
      op, type, static_cast<const char*>(a), static_cast<const char*>(b), static_cast<char*>(out), n);
  return Finish("BinaryKernel");
}

absl::Status Scale(int device, ElemType type, const void* a, float s, void* out, int64_t n) {
  if (IsInt(type)) return absl::InvalidArgumentError("Scale: float types only");
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(ScaleKernel, Blocks(n), kThreads, stream, type, static_cast<const char*>(a), s,
                                                               static_cast<char*>(out), n);
  return Finish("ScaleKernel");
}

absl::StatusOr<double> Sum(int device, ElemType type, const void* a, int64_t n) {
  if (n == 0) return 0.0;
  COLOD_CUDA_BEGIN(stream, device);
  const unsigned blocks = Blocks(n);
  double* buf = nullptr;
  RETURN_IF_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&buf), (blocks + 1) * sizeof(double), stream));
  Launch(SumPartialsKernel, blocks, kThreads, stream, type, static_cast<const char*>(a), n, false, buf);
  Launch(SumFinalKernel, 1, 1, stream, buf, static_cast<int>(blocks), buf + blocks);
  double result = 0;
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(&result, buf + blocks, sizeof(double), cudaMemcpyDeviceToHost, stream);
  }
  // Into pageable memory: complete when cudaMemcpyAsync returns.
  cudaFreeAsync(buf, stream);
  RETURN_IF_CUDA(e);
  return result;
}

absl::Status AccumulateSum(int device, ElemType type, const void* a, int64_t n, bool square, float* acc) {
  if (IsInt(type)) return absl::InvalidArgumentError("AccumulateSum: float types only");
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  const unsigned blocks = Blocks(n);
  double* partials = nullptr;
  RETURN_IF_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&partials), blocks * sizeof(double), stream));
  Launch(SumPartialsKernel, blocks, kThreads, stream, type, static_cast<const char*>(a), n, square, partials);
  Launch(AddSumKernel, 1, 1, stream, partials, static_cast<int>(blocks), acc);
  cudaFreeAsync(partials, stream);  // after the kernels, in stream order
  return Finish("AccumulateSum");
}

}  // namespace colod::kernels::cuda
