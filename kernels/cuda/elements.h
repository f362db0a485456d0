// Device code shared by colod's .cu files: elements of any ElemType read and
// written as floats (f16/bf16 rounded to nearest even, as the CPU twins and
// kernels/half.h do), and the tensor lists of the multi-tensor kernels.
// Included by .cu files only (nvcc or the CUDA emulation).
#ifndef COLOD_KERNELS_CUDA_ELEMENTS_H_
#define COLOD_KERNELS_CUDA_ELEMENTS_H_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/launch.h"
#include "kernels/types.h"

namespace colod::kernels::cuda {

__host__ __device__ __forceinline__ uint16_t FloatToBF16Bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

__device__ __forceinline__ float LoadF(const void* base, int64_t i, ElemType t) {
  switch (t) {
    case ElemType::kF32: return static_cast<const float*>(base)[i];
    case ElemType::kBF16: return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
    case ElemType::kF16: return __half2float(__ushort_as_half(static_cast<const uint16_t*>(base)[i]));
    case ElemType::kI32: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
    case ElemType::kI64: return static_cast<float>(static_cast<const int64_t*>(base)[i]);
  }
  return 0;
}

__device__ __forceinline__ void StoreF(void* base, int64_t i, ElemType t, float v) {
  switch (t) {
    case ElemType::kF32: static_cast<float*>(base)[i] = v; return;
    case ElemType::kBF16: static_cast<uint16_t*>(base)[i] = FloatToBF16Bits(v); return;
    case ElemType::kF16: static_cast<uint16_t*>(base)[i] = __half_as_ushort(__float2half_rn(v)); return;
    case ElemType::kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case ElemType::kI64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
  }
}

__device__ __forceinline__ int64_t LoadI(const void* base, int64_t i, ElemType t) {
  return t == ElemType::kI32 ? static_cast<const int32_t*>(base)[i] : static_cast<const int64_t*>(base)[i];
}

__device__ __forceinline__ void StoreI(void* base, int64_t i, ElemType t, int64_t v) {
  if (t == ElemType::kI32) {
    static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
  } else {
    static_cast<int64_t*>(base)[i] = v;
  }
}

__host__ __device__ __forceinline__ int ElemSize(ElemType t) {
  return (t == ElemType::kBF16 || t == ElemType::kF16) ? 2 : (t == ElemType::kI64 ? 8 : 4);
}

__host__ __device__ __forceinline__ bool IsInt(ElemType t) { return t == ElemType::kI32 || t == ElemType::kI64; }

// The sum of v over the block's kThreads threads (blockDim.x == kThreads)
// by a fixed tree in `shared` (kThreads of T), returned to every thread; the
// block may call it again at once (it ends with a barrier).
template <typename T>
__device__ __forceinline__ T BlockSum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  const T total = shared[0];
  __syncthreads();
  return total;
}

// ---- Typed kernel operands ----
// A layer kernel is instantiated for each float type its tensors may have:
// float, or bf16/f16 held as bits (Bf16, F16). It reads In<T> and writes
// Out<T>, which widen to f32 and round back (to nearest even) element by
// element, so the kernel body computes in f32 as written for floats and a
// bf16 model's activations are never converted around the call.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

__device__ __forceinline__ float ToF32(float v) { return v; }
__device__ __forceinline__ float ToF32(Bf16 v) { return __uint_as_float(static_cast<uint32_t>(v.bits) << 16); }
__device__ __forceinline__ float ToF32(F16 v) { return __half2float(__ushort_as_half(v.bits)); }

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ Bf16 FromF32<Bf16>(float v) { return Bf16{FloatToBF16Bits(v)}; }
template <>
__device__ __forceinline__ F16 FromF32<F16>(float v) { return F16{__half_as_ushort(__float2half_rn(v))}; }

template <typename T>
struct In {
  const T* p;
  __device__ __forceinline__ float operator[](int64_t i) const { return ToF32(p[i]); }
  __device__ __forceinline__ In operator+(int64_t offset) const { return In{p + offset}; }
  __device__ __forceinline__ explicit operator bool() const { return p != nullptr; }
};

template <typename T>
struct OutRef {
  T* p;
  __device__ __forceinline__ void operator=(float v) const { *p = FromF32<T>(v); }
};

template <typename T>
struct Out {
  T* p;
  __device__ __forceinline__ OutRef<T> operator[](int64_t i) const { return OutRef<T>{p + i}; }
  __device__ __forceinline__ explicit operator bool() const { return p != nullptr; }
};

// ---- Packed element-wise kernels ----
// Where every operand is 16-byte aligned and the row length a multiple of
// kPack<T> (8 bf16 or f16, 4 f32), a thread moves kPack<T> elements through
// one 16-byte load or store each, and divides once per pack, in 32 bits,
// for the column (the scalar kernels divide in 64 bits per element and
// access 2 bytes at a time): at the device's copy bandwidth. The arithmetic
// is the scalar kernels', element by element in f32: the same bits.
template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <typename T>
struct alignas(16) Pack {
  T v[kPack<T>];
};

template <typename T>
__device__ __forceinline__ void LoadPack(const T* base, int64_t pack, float (&f)[kPack<T>]) {
  const Pack<T> in = reinterpret_cast<const Pack<T>*>(base)[pack];
#pragma unroll
  for (int k = 0; k < kPack<T>; ++k) f[k] = ToF32(in.v[k]);
}

template <typename T>
__device__ __forceinline__ void StorePack(T* base, int64_t pack, const float* f) {  // f: kPack<T> values
  Pack<T> out;
#pragma unroll
  for (int k = 0; k < kPack<T>; ++k) out.v[k] = FromF32<T>(f[k]);
  reinterpret_cast<Pack<T>*>(base)[pack] = out;
}

// y = op(x, d, bias) element by element over [packs * kPack / n, n]: x and d
// row-major like y (d null: op sees 0), bias one row of n broadcast down the
// columns (null: op sees 0). Packs of kPack<T>; `row_packs` = n / kPack<T>;
// packs < 2^31 (PackedRows checks it), so the 32-bit index cannot wrap.
template <typename T, typename Op>
__global__ void PackedRowsKernel(Op op, const T* x, const T* d, const T* bias, T* y, uint32_t packs,
                                 uint32_t row_packs) {
  constexpr int kN = kPack<T>;
  for (uint32_t p = blockIdx.x * blockDim.x + threadIdx.x; p < packs; p += gridDim.x * blockDim.x) {
    float xv[kN], dv[kN] = {}, bv[kN] = {}, out[kN];
    LoadPack(x, p, xv);
    if (d != nullptr) LoadPack(d, p, dv);
    if (bias != nullptr) LoadPack(bias, p % row_packs, bv);
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = op(xv[k], dv[k], bv[k]);
    StorePack(y, p, out);
  }
}

// Launches PackedRowsKernel over [total / n, n] where it applies (n and
// total multiples of the pack, the pointers that are not null 16-byte
// aligned, fewer than 2^31 packs) and returns true; false, launching
// nothing, where the caller's scalar kernel must run.
template <typename T, typename Op>
bool PackedRows(cudaStream_t stream, Op op, const void* x, const void* d, const void* bias, void* y, int64_t total,
                int64_t n) {
  constexpr int64_t kN = kPack<T>;
  if (n <= 0 || total <= 0 || n % kN != 0 || total % n != 0 || total / kN >= (int64_t{1} << 31)) return false;
  for (const void* p : {x, d, bias, static_cast<const void*>(y)}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  Launch(PackedRowsKernel<T, Op>, Blocks(total / kN), kThreads, stream, op, static_cast<const T*>(x),
         static_cast<const T*>(d), static_cast<const T*>(bias), static_cast<T*>(y),
         static_cast<uint32_t>(total / kN), static_cast<uint32_t>(n / kN));
  return true;
}

// fn(T{}) for the kernel type of `type` (float, Bf16 or F16);
// INVALID_ARGUMENT naming `op` for an integer type.
template <typename Fn>
absl::Status ByFloatType(ElemType type, const char* op, Fn fn) {
  switch (type) {
    case ElemType::kF32: return fn(float{});
    case ElemType::kBF16: return fn(Bf16{});
    case ElemType::kF16: return fn(F16{});
    default: return absl::InvalidArgumentError(std::string(op) + ": float types only");
  }
}

template <typename T>
In<T> InOf(const void* p) {
  return In<T>{static_cast<const T*>(p)};
}
template <typename T>
Out<T> OutOf(void* p) {
  return Out<T>{static_cast<T*>(p)};
}

// ---- Multi-tensor launches ----
// A launch carries up to kMaxTensorsPerLaunch tensors in its parameters (by
// value, as PyTorch's multi_tensor_apply does) and one block per kMultiChunk
// elements of each: block b works on tensor t where first_block[t] <= b <
// first_block[t + 1], on elements [(b - first_block[t]) * kMultiChunk, ...).
constexpr int64_t kMultiChunk = 8 * kThreads;

template <typename T>
struct TensorList {
  T tensors[kMaxTensorsPerLaunch];
  int64_t first_block[kMaxTensorsPerLaunch + 1];
  int count;
};

// The tensor of this block and its element range [*begin, *end).
template <typename T>
__device__ __forceinline__ const T& BlockTensor(const TensorList<T>& list, int64_t* begin, int64_t* end) {
  int t = 0;
  while (t + 1 < list.count && list.first_block[t + 1] <= static_cast<int64_t>(blockIdx.x)) ++t;
  const T& x = list.tensors[t];
  *begin = (static_cast<int64_t>(blockIdx.x) - list.first_block[t]) * kMultiChunk;
  *end = *begin + kMultiChunk < x.n ? *begin + kMultiChunk : x.n;
  return x;
}

// Packs the non-empty items (T has a member n) into launches of at most
// kMaxTensorsPerLaunch tensors and calls fn(list, blocks) for each, in the
// items' order.
template <typename T, typename Fn>
absl::Status ForEachLaunch(const std::vector<T>& items, Fn fn) {
  constexpr int64_t kMaxGrid = int64_t{1} << 30;
  TensorList<T> list{};
  int64_t blocks = 0;
  auto flush = [&]() -> absl::Status {
    if (list.count == 0) return absl::OkStatus();
    list.first_block[list.count] = blocks;
    absl::Status s = fn(list, blocks);
    list = TensorList<T>{};
    blocks = 0;
    return s;
  };
  for (const T& item : items) {
    if (item.n <= 0) continue;
    const int64_t chunks = (item.n + kMultiChunk - 1) / kMultiChunk;
    if (chunks > kMaxGrid) return absl::InvalidArgumentError("multi-tensor kernel: a tensor is too large");
    if (list.count == kMaxTensorsPerLaunch || blocks + chunks > kMaxGrid) {
      absl::Status s = flush();
      if (!s.ok()) return s;
    }
    list.tensors[list.count] = item;
    list.first_block[list.count] = blocks;
    ++list.count;
    blocks += chunks;
  }
  return flush();
}

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_ELEMENTS_H_
