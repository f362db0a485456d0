#include "kernels/cuda/layer_ops.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/elements.h"
#include "kernels/cuda/launch.h"
#include "kernels/activation.h"
#include "kernels/clip.h"
#include "kernels/cuda/tensor_ops.h"
#include "kernels/cuda/warp.h"
#include "kernels/gelu.h"
#include "kernels/philox.h"

namespace colod::kernels::cuda {
namespace {

absl::Status CudaCheck(cudaError_t e, const char* what) { return CudaStatus(e, what); }

absl::Status CublasCheck(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(s)));
}

#define RETURN_IF(expr)                    \
  do {                                     \
    absl::Status colod_s_ = (expr);        \
    if (!colod_s_.ok()) return colod_s_;   \
  } while (0)

unsigned RowBlocks(int64_t rows) { return static_cast<unsigned>(rows < 1 ? 1 : (rows > 65535 ? 65535 : rows)); }

#define GRID_STRIDE(i, n)                                                            \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

__device__ float BlockMax(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();
  return total;
}


template <typename T>
__global__ void BiasAddKernel(In<T> x, In<T> b, Out<T> y, int64_t total, int64_t n) {
  GRID_STRIDE(i, total) { y[i] = x[i] + b[i % n]; }
}

// The element-wise bias and GELU kernels' arithmetic for PackedRows (x, the
// row operand d, the bias b), as their scalar kernels do it.
struct BiasAddOp {
  __device__ float operator()(float x, float, float b) const { return x + b; }
};
struct GeluOp {
  bool bias, tanh_approx;
  __device__ float operator()(float x, float, float b) const { return GeluAt(bias ? x + b : x, tanh_approx); }
};
struct GeluBackwardOp {  // x: the input, d: dy
  bool bias, tanh_approx;
  __device__ float operator()(float x, float dy, float b) const {
    return dy * GeluSlopeAt(bias ? x + b : x, tanh_approx);
  }
};

// Column reductions (bias and norm-parameter gradients) over [rows, n], in
// two levels over a grid that fills the GPU: block (x, y) owns kColumns
// adjacent column groups (x) of a chunk of the rows (y), and its kThreads /
// kColumns row lanes split the chunk (lane l sums its rows l, l + lanes, ...);
// the lanes' partial sums are added in lane order (SumOverLanes). A column
// group is kP adjacent columns: one (a warp reads 32 adjacent elements of a
// row, 64 bytes of bf16), or where n and the operands allow (Packable) a
// 16-byte pack, kPack<T> columns a thread (a warp reads 512 bytes of a row
// in one instruction). With more than one chunk each block writes its sums
// to scratch, and the last block of a column block to finish (a counter)
// adds the chunks' in chunk order (CombineChunks). Sums run in double in an
// order fixed by the shape alone (each column's: its chunks in order, each
// the lanes' in order of their rows in order): deterministic, whichever
// block finishes last. GPT-2 124M's [8192, 768] bias gradient was 24 blocks
// of 8192 rows; then 24 x 43 of 191; packed, 3 x 128 of 64.
constexpr int kColumns = 32;
constexpr int kRowLanes = kThreads / kColumns;
constexpr int64_t kColumnTargetBlocks = 1024;  // a few waves of an H100's 132 SMs
constexpr int64_t kColumnMinChunkRows = 128;   // 16 rows a lane at least
constexpr int64_t kPackedMinChunkRows = 64;    // 8 packs a lane at least

unsigned ColumnBlocks(int64_t groups) {
  const int64_t b = (groups + kColumns - 1) / kColumns;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// Whether every pointer is 16-byte aligned (a null one is): what loads and
// stores in 16-byte packs, cp.async's and cuDNN's tensors need.
bool AllAligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Whether a row kernel (a column reduction, a norm) over rows of n elements
// of T runs in 16-byte packs: n a multiple of kPack<T> and every operand
// (null ones aside) 16-byte aligned.
template <typename T>
bool Packable(int64_t n, std::initializer_list<const void*> operands) {
  return n > 0 && n % kPack<T> == 0 && AllAligned16(operands);
}

// kP elements of T at base[i], i the first of kP adjacent columns: one
// 16-byte load where kP is the pack (i then a multiple of it).
template <typename T, int kP>
__device__ __forceinline__ void LoadColumns(const T* base, int64_t i, float (&f)[kP]) {
  static_assert(kP == 1 || kP == kPack<T>, "a column group is one element or one pack");
  if constexpr (kP == 1) {
    f[0] = ToF32(base[i]);
  } else {
    const Pack<T> in = *reinterpret_cast<const Pack<T>*>(base + i);
#pragma unroll
    for (int k = 0; k < kP; ++k) f[k] = ToF32(in.v[k]);
  }
}

template <typename T, int kP>
__device__ __forceinline__ void StoreColumns(T* base, int64_t i, const float (&f)[kP]) {
  if constexpr (kP == 1) {
    base[i] = FromF32<T>(f[0]);
  } else {
    StorePack(base + i, 0, f);
  }
}

// A two-level reduction's scratch (none with one chunk): `values` doubles per
// column and chunk, and a counter of finished chunks per column block.
struct ColumnScratch {
  double* partials = nullptr;
  unsigned* done = nullptr;
};

// The rows [r0, r1) of this block's chunk.
__device__ __forceinline__ void ChunkRows(int64_t rows, int64_t chunk_rows, int64_t& r0, int64_t& r1) {
  r0 = blockIdx.y * chunk_rows;
  r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
}

// This thread's first column: its group's.
template <int kP>
__device__ __forceinline__ int64_t GroupColumn() {
  return (blockIdx.x * static_cast<int64_t>(kColumns) + threadIdx.x % kColumns) * kP;
}

// p[0] + p[stride] + ... + p[(count - 1) stride], added in that order in
// double (the bits of a plain loop), loaded 4 at a time before they are
// added so that 4 loads are in flight where one was: the combining tails
// of the reductions below run alone, one block, at the memory's latency.
template <typename V>
__device__ __forceinline__ double SumInOrder(const volatile V* p, int64_t stride, int64_t count) {
  constexpr int kBatch = 4;
  double t = 0;
  int64_t i = 0;
  for (; i + kBatch <= count; i += kBatch) {
    V v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = p[(i + k) * stride];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) t += v[k];
  }
  for (; i < count; ++i) t += p[i * stride];
  return t;
}

// Whether this block is the last of `count` to reach the counter: its
// writes before and the others' after are visible (fences). Every thread of
// the block calls it; `flag` is in shared memory.
__device__ bool LastToFinish(unsigned* counter, int64_t count, unsigned* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == static_cast<unsigned>(count - 1) ? 1u : 0u;
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

// A column reduction's shared memory: the lanes' sums, and LastToFinish's
// flag.
struct ColumnShared {
  double sums[kThreads];
  unsigned flag;
};

// Adds the lanes' partials of this thread's column: lane 0 returns the total.
__device__ double SumOverLanes(double v, double* shared) {
  const int col = threadIdx.x % kColumns, lane = threadIdx.x / kColumns;
  shared[lane * kColumns + col] = v;
  __syncthreads();
  double total = 0;
  if (lane == 0) {
    for (int l = 0; l < kRowLanes; ++l) total += shared[l * kColumns + col];
  }
  __syncthreads();
  return total;
}

// SumOverLanes of each of this thread's kV x kP sums.
template <int kV, int kP>
__device__ void SumGroupOverLanes(double (&v)[kV][kP], double* shared) {
#pragma unroll
  for (int k = 0; k < kV; ++k) {
#pragma unroll
    for (int e = 0; e < kP; ++e) v[k][e] = SumOverLanes(v[k][e], shared);
  }
}

// The second level: v holds kV sums of each of this thread's kP columns (j
// the first) over the block's chunk (lane 0's, from SumGroupOverLanes). With
// one chunk they are the totals: true. Otherwise they go to the scratch, and
// the block of the column block that finishes last adds every chunk's in
// chunk order (the lanes split the chunks as they split rows) and returns
// true with the totals in v (lane 0's); the others return false. Every
// thread of the block calls it (it holds barriers).
template <int kV, int kP>
__device__ bool CombineChunks(double (&v)[kV][kP], ColumnShared& shared, const ColumnScratch& scratch, int64_t j,
                              int64_t n) {
  if (gridDim.y == 1) return true;
  const int lane = threadIdx.x / kColumns;
  const int64_t chunks = gridDim.y;
  if (lane == 0 && j < n) {
#pragma unroll
    for (int k = 0; k < kV; ++k) {
#pragma unroll
      for (int e = 0; e < kP; ++e) scratch.partials[(k * chunks + blockIdx.y) * n + j + e] = v[k][e];
    }
  }
  // The partials before the count, for the block that reads them.
  if (!LastToFinish(&scratch.done[blockIdx.x], chunks, &shared.flag)) return false;
  const volatile double* partials = scratch.partials;  // written by other blocks: not from a stale cache
  // Each chunk's kV x kP partials of this thread's columns are loaded
  // together (kP adjacent doubles each) before any is added, so that they
  // are in flight at once: one memory latency a chunk, where a pass per
  // column and sum took one per chunk, column and sum (kV x kP times as
  // many, and this tail runs alone). Each total still adds its chunks in
  // the same order.
  double t[kV][kP] = {};
  if (j < n) {
    for (int64_t c = lane; c < chunks; c += kRowLanes) {
      double p[kV][kP];
#pragma unroll
      for (int k = 0; k < kV; ++k) {
#pragma unroll
        for (int e = 0; e < kP; ++e) p[k][e] = partials[(k * chunks + c) * n + j + e];
      }
#pragma unroll
      for (int k = 0; k < kV; ++k) {
#pragma unroll
        for (int e = 0; e < kP; ++e) t[k][e] += p[k][e];
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kV; ++k) {
#pragma unroll
    for (int e = 0; e < kP; ++e) v[k][e] = SumOverLanes(t[k][e], shared.sums);
  }
  return true;
}

template <typename T, int kP>
__global__ void ColumnSumKernel(In<T> dy, Out<T> db, int64_t rows, int64_t n, int64_t chunk_rows,
                                ColumnScratch scratch) {
  __shared__ ColumnShared shared;
  const int64_t j = GroupColumn<kP>();
  int64_t r0, r1;
  ChunkRows(rows, chunk_rows, r0, r1);
  double s[1][kP] = {};
  if (j < n) {
    for (int64_t r = r0 + threadIdx.x / kColumns; r < r1; r += kRowLanes) {
      float v[kP];
      LoadColumns<T, kP>(dy.p, r * n + j, v);
#pragma unroll
      for (int e = 0; e < kP; ++e) s[0][e] += v[e];
    }
  }
  SumGroupOverLanes(s, shared.sums);
  if (!CombineChunks(s, shared, scratch, j, n)) return;
  if (j < n && threadIdx.x < kColumns) {
#pragma unroll
    for (int e = 0; e < kP; ++e) db[j + e] = static_cast<float>(s[0][e]);
  }
}

// y = GELU(x + b) over [total / n, n]; b null: GELU(x).
template <typename T>
__global__ void GeluKernel(In<T> x, In<T> b, Out<T> y, int64_t total, int64_t n, bool tanh_approx) {
  GRID_STRIDE(i, total) { y[i] = GeluAt(b ? x[i] + b[i % n] : x[i], tanh_approx); }
}

template <typename T>
__global__ void GeluBackwardKernel(In<T> dy, In<T> x, In<T> b, Out<T> dx, int64_t total, int64_t n,
                                   bool tanh_approx) {
  GRID_STRIDE(i, total) { dx[i] = dy[i] * GeluSlopeAt(b ? x[i] + b[i % n] : x[i], tanh_approx); }
}

// The backward with the bias gradient: dx as above and db = its column sums,
// in ColumnSumKernel's layout (the f32 values are summed, in double).
template <typename T, int kP>
__global__ void __launch_bounds__(kThreads, 4)
    GeluBackwardBiasKernel(In<T> dy, In<T> x, In<T> b, Out<T> dx, Out<T> db, int64_t rows, int64_t n,
                           bool tanh_approx, int64_t chunk_rows, ColumnScratch scratch) {
  __shared__ ColumnShared shared;
  const int64_t j = GroupColumn<kP>();
  int64_t r0, r1;
  ChunkRows(rows, chunk_rows, r0, r1);
  double s[1][kP] = {};
  if (j < n) {
    float bj[kP] = {};
    if (b) LoadColumns<T, kP>(b.p, j, bj);
    for (int64_t r = r0 + threadIdx.x / kColumns; r < r1; r += kRowLanes) {
      const int64_t i = r * n + j;
      float dyv[kP], xv[kP], g[kP];
      LoadColumns<T, kP>(dy.p, i, dyv);
      LoadColumns<T, kP>(x.p, i, xv);
#pragma unroll
      for (int e = 0; e < kP; ++e) g[e] = dyv[e] * GeluSlopeAt(xv[e] + bj[e], tanh_approx);
      StoreColumns<T, kP>(dx.p, i, g);
#pragma unroll
      for (int e = 0; e < kP; ++e) s[0][e] += g[e];
    }
  }
  SumGroupOverLanes(s, shared.sums);
  if (!CombineChunks(s, shared, scratch, j, n)) return;
  if (j < n && threadIdx.x < kColumns) {
#pragma unroll
    for (int e = 0; e < kP; ++e) db[j + e] = static_cast<float>(s[0][e]);
  }
}

template <typename T>
__global__ void ActivationKernel(ActivationKind kind, In<T> x, Out<T> y, int64_t n) {
  GRID_STRIDE(i, n) { y[i] = ActivationAt(x[i], kind); }
}

template <typename T>
__global__ void ActivationBackwardKernel(ActivationKind kind, In<T> dy, In<T> x, Out<T> dx, int64_t n) {
  GRID_STRIDE(i, n) { dx[i] = dy[i] * ActivationSlopeAt(x[i], kind); }
}

// A norm's first pass over row r: x, or with a residual x + residual, written
// to `sum` rounded to T; returns the row to read in the later passes (`sum`
// then: each thread reads back the elements it wrote, so no barrier). `f`
// sees each element as the later passes will.
template <typename T, typename F>
__device__ __forceinline__ In<T> FirstPass(In<T> x, In<T> residual, Out<T> sum, int64_t r, int64_t n, F f) {
  if (!residual) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) f(x[r * n + j]);
    return x + r * n;
  }
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = ToF32(FromF32<T>(x[r * n + j] + residual[r * n + j]));
    sum[r * n + j] = v;
    f(v);
  }
  return In<T>{sum.p + r * n};
}

template <typename T>
__global__ void LayerNormKernel(In<T> x, In<T> residual, In<T> g, In<T> b, float eps, Out<T> y, Out<T> sum,
                                float* mean, float* rstd, int64_t rows, int64_t n) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float s = 0;
    const In<T> row = FirstPass(x, residual, sum, r, n, [&](float v) { s += v; });
    const float mu = BlockSum(s, shared) / n;
    float v = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v += (row[j] - mu) * (row[j] - mu);
    const float rs = rsqrtf(BlockSum(v, shared) / n + eps);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) y[r * n + j] = (row[j] - mu) * rs * g[j] + b[j];
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// A backward's dx[i] = v, or with `acc` (the gradient a residual stream
// had) acc[i] + v with Add's bits: v rounded to T, the sum rounded once
// (never an FMA with the product that gave v).
template <typename T>
__device__ __forceinline__ float Folded(In<T> acc, int64_t i, float v) {
  return acc ? __fadd_rn(acc[i], ToF32(FromF32<T>(v))) : v;
}

template <typename T>
__global__ void LayerNormBackwardKernel(In<T> dy, In<T> x, In<T> g, const float* mean, const float* rstd, In<T> acc,
                                        Out<T> dx, int64_t rows, int64_t n) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float m = mean[r], rs = rstd[r];
    float a = 0, c = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float xhat = (x[r * n + j] - m) * rs, dxhat = dy[r * n + j] * g[j];
      a += dxhat;
      c += dxhat * xhat;
    }
    a = BlockSum(a, shared) / n;
    c = BlockSum(c, shared) / n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float xhat = (x[r * n + j] - m) * rs;
      dx[r * n + j] = Folded(acc, r * n + j, rs * (dy[r * n + j] * g[j] - a - xhat * c));
    }
  }
}

// ---- The norms a warp a row ----
// Where n is a multiple of kPack<T> and every operand 16-byte aligned
// (Packable's test), each warp of a block normalizes a row of its own in
// 16-byte packs (lane l the packs l, l + 32, ...), its sums a butterfly of
// shuffles: no barrier and no shared memory, kWarpRows rows a block. (A block
// a row spent most of its time in its two block-wide sums at GPT-2's 768.)
// The block kernels' arithmetic element by element; the sums in another
// fixed order, so the rows repeat bitwise. The later passes read the row
// again (from L1: the warp has just read it), as the block kernels do.
constexpr int kWarpRows = kThreads / 32;

__device__ __forceinline__ float WarpSum(float v) {
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

unsigned WarpRowBlocks(int64_t rows) { return RowBlocks((rows + kWarpRows - 1) / kWarpRows); }

// The packed FirstPass: row r of x, or of x + residual rounded to T and
// written to `sum`; f(values) sees each pack of the row as the later passes
// will read it; returns the row to read (each lane reads back the packs it
// wrote: no barrier).
template <typename T, typename F>
__device__ __forceinline__ const T* PackedFirstPass(const T* x, const T* residual, T* sum, int64_t r, int64_t n,
                                                    F f) {
  constexpr int kP = kPack<T>;
  const int64_t packs = n / kP;
  const T* xr = x + r * n;
  for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
    float v[kP];
    LoadPack(xr, p, v);
    if (residual != nullptr) {
      float rv[kP];
      LoadPack(residual + r * n, p, rv);
#pragma unroll
      for (int e = 0; e < kP; ++e) v[e] = ToF32(FromF32<T>(v[e] + rv[e]));
      StorePack(sum + r * n, p, v);
    }
    f(v);
  }
  return residual != nullptr ? sum + r * n : xr;
}

// This warp's rows: r, r + the grid's warps, ...
#define WARP_ROWS(r, rows)                                                                                      \
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpRows + threadIdx.x / 32; r < (rows);               \
       r += static_cast<int64_t>(gridDim.x) * kWarpRows)

template <typename T>
__global__ void LayerNormWarpKernel(const T* x, const T* residual, const T* g, const T* b, float eps, T* y, T* sum,
                                    float* mean, float* rstd, int64_t rows, int64_t n) {
  constexpr int kP = kPack<T>;
  const int64_t packs = n / kP;
  WARP_ROWS(r, rows) {
    float s = 0;
    const T* row = PackedFirstPass(x, residual, sum, r, n, [&](const float (&v)[kP]) {
#pragma unroll
      for (int e = 0; e < kP; ++e) s += v[e];
    });
    const float mu = WarpSum(s) / n;
    float q = 0;
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float v[kP];
      LoadPack(row, p, v);
#pragma unroll
      for (int e = 0; e < kP; ++e) q += (v[e] - mu) * (v[e] - mu);
    }
    const float rs = rsqrtf(WarpSum(q) / n + eps);
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float v[kP], gv[kP], bv[kP], out[kP];
      LoadPack(row, p, v);
      LoadPack(g, p, gv);
      LoadPack(b, p, bv);
#pragma unroll
      for (int e = 0; e < kP; ++e) out[e] = (v[e] - mu) * rs * gv[e] + bv[e];
      StorePack(y + r * n, p, out);
    }
    if (threadIdx.x % 32 == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// A norm backward's pack p of row r of dy and x, and of the gain g.
template <typename T>
__device__ __forceinline__ void LoadBackwardPacks(const T* dy, const T* x, const T* g, int64_t r, int64_t n,
                                                  int64_t p, float (&dyv)[kPack<T>], float (&xv)[kPack<T>],
                                                  float (&gv)[kPack<T>]) {
  LoadPack(dy + r * n, p, dyv);
  LoadPack(x + r * n, p, xv);
  LoadPack(g, p, gv);
}

// Pack p of row r of a backward's dx: out, or with `acc` acc + out with
// Add's bits (out rounded to T, the sum rounded once by the store; never an
// FMA with the product that gave out).
template <typename T>
__device__ __forceinline__ void StoreFoldedPack(const T* acc, T* dx, int64_t r, int64_t n, int64_t p,
                                                float (&out)[kPack<T>]) {
  if (acc != nullptr) {
    float av[kPack<T>];
    LoadPack(acc + r * n, p, av);
#pragma unroll
    for (int e = 0; e < kPack<T>; ++e) out[e] = __fadd_rn(av[e], ToF32(FromF32<T>(out[e])));
  }
  StorePack(dx + r * n, p, out);
}

template <typename T>
__global__ void LayerNormBackwardWarpKernel(const T* dy, const T* x, const T* g, const float* mean, const float* rstd,
                                            const T* acc, T* dx, int64_t rows, int64_t n) {
  constexpr int kP = kPack<T>;
  const int64_t packs = n / kP;
  WARP_ROWS(r, rows) {
    const float m = mean[r], rs = rstd[r];
    float a = 0, c = 0;
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float dyv[kP], xv[kP], gv[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) {
        const float xhat = (xv[e] - m) * rs, dxhat = dyv[e] * gv[e];
        a += dxhat;
        c += dxhat * xhat;
      }
    }
    a = WarpSum(a) / n;
    c = WarpSum(c) / n;
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float dyv[kP], xv[kP], gv[kP], out[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) {
        const float xhat = (xv[e] - m) * rs;
        out[e] = rs * (dyv[e] * gv[e] - a - xhat * c);
      }
      StoreFoldedPack(acc, dx, r, n, p, out);
    }
  }
}

template <typename T>
__global__ void RmsNormWarpKernel(const T* x, const T* residual, const T* g, float eps, T* y, T* sum, float* rstd,
                                  int64_t rows, int64_t n) {
  constexpr int kP = kPack<T>;
  const int64_t packs = n / kP;
  WARP_ROWS(r, rows) {
    float s = 0;
    const T* row = PackedFirstPass(x, residual, sum, r, n, [&](const float (&v)[kP]) {
#pragma unroll
      for (int e = 0; e < kP; ++e) s += v[e] * v[e];
    });
    const float rs = rsqrtf(WarpSum(s) / n + eps);
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float v[kP], gv[kP], out[kP];
      LoadPack(row, p, v);
      LoadPack(g, p, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) out[e] = v[e] * rs * gv[e];
      StorePack(y + r * n, p, out);
    }
    if (threadIdx.x % 32 == 0) rstd[r] = rs;
  }
}

template <typename T>
__global__ void RmsNormBackwardWarpKernel(const T* dy, const T* x, const T* g, const float* rstd, const T* acc, T* dx,
                                          int64_t rows, int64_t n) {
  constexpr int kP = kPack<T>;
  const int64_t packs = n / kP;
  WARP_ROWS(r, rows) {
    const float rs = rstd[r];
    float dot = 0;
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float dyv[kP], xv[kP], gv[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) dot += dyv[e] * gv[e] * xv[e];
    }
    const float c = WarpSum(dot) / n * rs * rs;
    for (int64_t p = threadIdx.x % 32; p < packs; p += 32) {
      float dyv[kP], xv[kP], gv[kP], out[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) out[e] = rs * (dyv[e] * gv[e] - xv[e] * c);
      StoreFoldedPack(acc, dx, r, n, p, out);
    }
  }
}

#undef WARP_ROWS

// ---- A norm's backward with its parameter gradients, in one kernel ----
// LayerNormBackwardWarpKernel's (kLayer) or RmsNormBackwardWarpKernel's dx,
// row by row with the same arithmetic, and in the same pass over dy and x
// the terms of dgamma (dy * xhat) and dbeta (dy) that NormParamGradKernel
// would read both again for: GPT-2 124M's [8192, 768] bf16 is 25 MB a norm.
// Block b owns the rows [b * chunk_rows, ...) and its warp w their rows w,
// w + kWarpRows, ...; lane l holds the sums of its packs l, l + 32, ... (at
// most kLanePacks: registers), over its warp's rows in f32. The block adds
// its warps' sums in warp order (double), and with one block those are the
// totals. Otherwise each block writes its sums to scratch (f32), blocks come
// in groups of scratch.group, the last of a group to finish (a counter) adds
// its group's in block order, and the last group to finish adds the groups'
// in group order and writes dgamma and dbeta (double, rounded to T once).
// Every column's sum runs in an order fixed by the shape alone: the bits
// repeat, whichever block finishes last.
struct FoldedNormScratch {
  float* partials = nullptr;     // [blocks, values, n]
  double* group_sums = nullptr;  // [groups, values, n]
  unsigned* done = nullptr;      // [groups + 1]: each group's finished blocks, then the finished groups
  int64_t group = 1;             // blocks a group
};

template <typename T, bool kLayer, int kLanePacks>
__global__ void __launch_bounds__(kThreads, 2)
    NormBackwardFoldedKernel(const T* dy, const T* x, const T* g, const float* mean, const float* rstd, const T* acc,
                             T* dx, T* dg, T* db, int64_t rows, int64_t n, int64_t chunk_rows,
                             FoldedNormScratch scratch) {
  constexpr int kP = kPack<T>;
  constexpr int kV = kLayer ? 2 : 1;
  // Dynamic shared memory (FoldedNormShared): a flag, then [kV, n] sums.
  unsigned* flag = reinterpret_cast<unsigned*>(DynamicShared());
  double* shared = reinterpret_cast<double*>(DynamicShared() + 16);
  const int64_t packs = n / kP;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float s[kV][kLanePacks][kP] = {};
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  for (int64_t r = r0 + warp; r < r1; r += kWarpRows) {
    const float m = kLayer ? mean[r] : 0.0f, rs = rstd[r];
    float a = 0, c = 0;
#pragma unroll
    for (int k = 0; k < kLanePacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      float dyv[kP], xv[kP], gv[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) {
        if constexpr (kLayer) {
          const float xhat = (xv[e] - m) * rs, dxhat = dyv[e] * gv[e];
          a += dxhat;
          c += dxhat * xhat;
        } else {
          c += dyv[e] * gv[e] * xv[e];
        }
      }
    }
    if constexpr (kLayer) {
      a = WarpSum(a) / n;
      c = WarpSum(c) / n;
    } else {
      c = WarpSum(c) / n * rs * rs;
    }
#pragma unroll
    for (int k = 0; k < kLanePacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      float dyv[kP], xv[kP], gv[kP], out[kP];
      LoadBackwardPacks(dy, x, g, r, n, p, dyv, xv, gv);
#pragma unroll
      for (int e = 0; e < kP; ++e) {
        const float xhat = (xv[e] - m) * rs;
        if constexpr (kLayer) {
          out[e] = rs * (dyv[e] * gv[e] - a - xhat * c);
          s[1][k][e] += dyv[e];
        } else {
          out[e] = rs * (dyv[e] * gv[e] - xv[e] * c);
        }
        s[0][k][e] += dyv[e] * xhat;
      }
      StoreFoldedPack(acc, dx, r, n, p, out);
    }
  }
  // The block's sums: its warps' in warp order.
  for (int w = 0; w < kWarpRows; ++w) {
    if (warp == w) {
#pragma unroll
      for (int v = 0; v < kV; ++v) {
#pragma unroll
        for (int k = 0; k < kLanePacks; ++k) {
          const int64_t p = lane + 32 * k;
          if (p >= packs) continue;
#pragma unroll
          for (int e = 0; e < kP; ++e) {
            double& t = shared[v * n + p * kP + e];
            t = (w == 0 ? 0.0 : t) + s[v][k][e];
          }
        }
      }
    }
    __syncthreads();
  }
  const int64_t cols = kV * n, blocks = gridDim.x;
  auto put = [&](int64_t c, double total) {  // column c of [dgamma | dbeta]
    const T v = FromF32<T>(static_cast<float>(total));
    if (c < n) {
      dg[c] = v;
    } else if (db != nullptr) {
      db[c - n] = v;
    }
  };
  if (blocks == 1) {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) put(c, shared[c]);
    return;
  }
  float* mine = scratch.partials + blockIdx.x * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) mine[c] = static_cast<float>(shared[c]);
  const int64_t group = blockIdx.x / scratch.group, groups = (blocks + scratch.group - 1) / scratch.group;
  const int64_t first = group * scratch.group;
  const int64_t members = first + scratch.group < blocks ? scratch.group : blocks - first;
  if (!LastToFinish(&scratch.done[group], members, flag)) return;
  const volatile float* parts = scratch.partials;  // written by other blocks: not from a stale cache
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    scratch.group_sums[group * cols + c] = SumInOrder(parts + first * cols + c, cols, members);
  }
  if (!LastToFinish(&scratch.done[groups], groups, flag)) return;
  const volatile double* sums = scratch.group_sums;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) put(c, SumInOrder(sums + c, cols, groups));
}

// dgamma[j] = sum_r dy * xhat, dbeta[j] = sum_r dy (xhat from mean/rstd, or
// x * rstd for RMSNorm when mean is null); columns split as ColumnSumKernel.
template <typename T, typename G, int kP>
__global__ void NormParamGradKernel(In<T> dy, In<T> x, const float* mean, const float* rstd, Out<G> dg, Out<G> db,
                                    int64_t rows, int64_t n, int64_t chunk_rows, ColumnScratch scratch) {
  __shared__ ColumnShared shared;
  const int64_t j = GroupColumn<kP>();
  int64_t r0, r1;
  ChunkRows(rows, chunk_rows, r0, r1);
  double s[2][kP] = {};  // dgamma's, dbeta's
  if (j < n) {
    for (int64_t r = r0 + threadIdx.x / kColumns; r < r1; r += kRowLanes) {
      float dyv[kP], xv[kP];
      LoadColumns<T, kP>(dy.p, r * n + j, dyv);
      LoadColumns<T, kP>(x.p, r * n + j, xv);
      const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
#pragma unroll
      for (int e = 0; e < kP; ++e) {
        const float xhat = (xv[e] - m) * rs;
        s[0][e] += static_cast<double>(dyv[e]) * xhat;
        s[1][e] += dyv[e];
      }
    }
  }
  SumGroupOverLanes(s, shared.sums);
  if (!CombineChunks(s, shared, scratch, j, n)) return;
  if (j < n && threadIdx.x < kColumns) {
#pragma unroll
    for (int e = 0; e < kP; ++e) {
      dg[j + e] = static_cast<float>(s[0][e]);
      if (db) db[j + e] = static_cast<float>(s[1][e]);
    }
  }
}

// ---- The sharded norms' passes (a row's hidden dim split over ranks) ----
// One block per row (grid-strided), sums in double by a fixed tree.
template <typename T>
__global__ void NormRowSumsKernel(In<T> x, const float* center, bool square, int64_t rows, int64_t n, float* sums) {
  __shared__ double shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float c = center ? center[r] : 0.0f;
    double s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float v = x[r * n + j] - c;
      s += square ? static_cast<double>(v) * v : v;
    }
    const double total = BlockSum(s, shared);
    if (threadIdx.x == 0) sums[r] = static_cast<float>(total);
  }
}

template <typename T>
__global__ void NormApplyKernel(In<T> x, In<T> g, In<T> b, const float* mean, const float* sq_sums, float inv_h,
                                float eps, int64_t rows, int64_t n, Out<T> y, float* rstd) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float m = mean ? mean[r] : 0.0f;
    const float rs = rsqrtf(sq_sums[r] * inv_h + eps);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      y[r * n + j] = (x[r * n + j] - m) * rs * g[j] + (b ? b[j] : 0.0f);
    }
    if (threadIdx.x == 0) rstd[r] = rs;
  }
}

template <typename T>
__global__ void NormBackwardSumsKernel(In<T> dy, In<T> x, In<T> g, const float* mean, const float* rstd,
                                       int64_t rows, int64_t n, float* sums) {
  __shared__ double shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
    double a = 0, c = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float dxhat = dy[r * n + j] * g[j];
      a += dxhat;
      c += static_cast<double>(dxhat) * ((x[r * n + j] - m) * rs);
    }
    const double ta = BlockSum(a, shared);
    const double tc = BlockSum(c, shared);
    if (threadIdx.x == 0) {
      sums[r] = static_cast<float>(ta);
      sums[rows + r] = static_cast<float>(tc);
    }
  }
}

template <typename T>
__global__ void NormBackwardApplyKernel(In<T> dy, In<T> x, In<T> g, const float* mean, const float* rstd,
                                        const float* sums, float inv_h, int64_t rows, int64_t n, Out<T> dx) {
  GRID_STRIDE(i, rows * n) {
    const int64_t r = i / n, j = i % n;
    const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
    const float a = mean ? sums[r] * inv_h : 0.0f, c = sums[rows + r] * inv_h;
    dx[i] = rs * (dy[i] * g[j] - a - (x[i] - m) * rs * c);
  }
}

template <typename T>
__global__ void RmsNormKernel(In<T> x, In<T> residual, In<T> g, float eps, Out<T> y, Out<T> sum, float* rstd,
                              int64_t rows, int64_t n) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float s = 0;
    const In<T> row = FirstPass(x, residual, sum, r, n, [&](float v) { s += v * v; });
    const float rs = rsqrtf(BlockSum(s, shared) / n + eps);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) y[r * n + j] = row[j] * rs * g[j];
    if (threadIdx.x == 0) rstd[r] = rs;
  }
}

template <typename T>
__global__ void RmsNormBackwardKernel(In<T> dy, In<T> x, In<T> g, const float* rstd, In<T> acc, Out<T> dx,
                                      int64_t rows, int64_t n) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r];
    float dot = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += dy[r * n + j] * g[j] * x[r * n + j];
    const float c = BlockSum(dot, shared) / n * rs * rs;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      dx[r * n + j] = Folded(acc, r * n + j, rs * (dy[r * n + j] * g[j] - x[r * n + j] * c));
    }
  }
}

__global__ void SoftmaxKernel(const float* x, float* y, int64_t rows, int64_t k, int64_t causal_q) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t visible = causal_q > 0 ? (r % causal_q) + (k - causal_q) + 1 : k;
    const float* row = x + r * k;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) m = fmaxf(m, row[j]);
    m = BlockMax(m, shared);
    float s = 0;
    for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) s += expf(row[j] - m);
    const float inv = 1.0f / BlockSum(s, shared);
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) y[r * k + j] = j < visible ? expf(row[j] - m) * inv : 0.0f;
  }
}

__global__ void SoftmaxBackwardKernel(const float* dy, const float* y, float* dx, int64_t rows, int64_t k) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float dot = 0;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) dot += dy[r * k + j] * y[r * k + j];
    dot = BlockSum(dot, shared);
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) dx[r * k + j] = y[r * k + j] * (dy[r * k + j] - dot);
  }
}

__global__ void DropoutKernel(const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset) {
  const float scale = 1.0f / (1.0f - p);
  GRID_STRIDE(i, n) { y[i] = PhiloxUniform(seed, offset + static_cast<uint64_t>(i)) >= p ? x[i] * scale : 0.0f; }
}

template <typename T>
__global__ void EmbeddingKernel(In<T> table, const int64_t* ids, Out<T> out, int64_t count, int64_t rows, int64_t h,
                                int64_t row_offset) {
  GRID_STRIDE(i, count * h) {
    const int64_t id = ids[i / h];  // compared before subtracting: a hostile id must not overflow
    out[i] = (id >= row_offset && id < row_offset + rows) ? table[(id - row_offset) * h + i % h] : 0.0f;
  }
}

// One thread per (row with tokens, column): the row's tokens in token order,
// summed in double. No two threads write one element: deterministic.
template <typename T>
__global__ void EmbeddingBackwardKernel(In<T> dy, const int64_t* seg_rows, const int64_t* seg_starts,
                                        const int64_t* tokens, int64_t segments, int64_t h, Out<T> dtable) {
  GRID_STRIDE(i, segments * h) {
    const int64_t s = i / h, j = i % h;
    double acc = 0;
    for (int64_t k = seg_starts[s]; k < seg_starts[s + 1]; ++k) acc += dy[tokens[k] * h + j];
    dtable[seg_rows[s] * h + j] = static_cast<float>(acc);  // rounded to f32, then to T
  }
}

// One block per row: lse, target logit and mean logit.
__device__ void RowStats(const float* row, int64_t v, float* shared, float* lse, float* mean_logit) {
  float m = -INFINITY, total = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    m = fmaxf(m, row[j]);
    total += row[j];
  }
  m = BlockMax(m, shared);
  *mean_logit = BlockSum(total, shared) / v;
  float s = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) s += expf(row[j] - m);
  *lse = m + logf(BlockSum(s, shared));
}

__global__ void CrossEntropyKernel(const float* logits, const int64_t* labels, float* loss, int64_t n, int64_t v,
                                   float smoothing, int64_t ignore_index) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    float lse, mean_logit;
    RowStats(logits + r * v, v, shared, &lse, &mean_logit);
    if (threadIdx.x == 0) {
      const int64_t label = labels[r];
      loss[r] = label == ignore_index
                    ? 0.0f
                    : lse - (1.0f - smoothing) * logits[r * v + label] - smoothing * mean_logit;
    }
  }
}

__global__ void CrossEntropyBackwardKernel(const float* dloss, const float* logits, const int64_t* labels,
                                           float* dlogits, int64_t n, int64_t v, float smoothing,
                                           int64_t ignore_index) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    float lse, mean_logit;
    RowStats(logits + r * v, v, shared, &lse, &mean_logit);
    const int64_t label = labels[r];
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const float target = smoothing / v + (j == label ? 1.0f - smoothing : 0.0f);
      dlogits[r * v + j] = label == ignore_index ? 0.0f : dloss[r] * (expf(logits[r * v + j] - lse) - target);
    }
  }
}

// f(j, z[r, j]) for this thread's share of row r's real columns [0, real):
// packs of kPack<T> (pack p to thread p % blockDim.x) where `packed` (width
// a multiple of the pack and z 16-byte aligned, so no pack crosses a row or
// the buffer's end), else element j to thread j % blockDim.x.
template <typename T, typename F>
__device__ __forceinline__ void ForRealColumns(const T* z, int64_t r, int64_t width, int64_t real, bool packed,
                                               F f) {
  const T* row = z + r * width;
  if (packed) {
    constexpr int kN = kPack<T>;
    for (int64_t p = threadIdx.x; p * kN < real; p += blockDim.x) {
      float v[kN];
      LoadPack(row, p, v);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if (p * kN + k < real) f(p * kN + k, v[k]);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < real; j += blockDim.x) f(j, ToF32(row[j]));
  }
}

template <typename T>
bool PackedLogits(const void* z, int64_t width) {
  return width % kPack<T> == 0 && AllAligned16({z});
}

// A block a row: the row's max, then against it the sums, where a kernel
// for each pass read the whole [rows, width] from memory twice. The second
// walk over the row (a GPT-2 row is 100 KB of bf16) may find it in L2: with
// about a thousand rows in flight on an H200, about 100 MB, not all of it
// does. Not yet measured (ncu's DRAM bytes would tell).
template <typename T>
__global__ void VocabShardStatsKernel(const T* z, const int64_t* labels, int64_t rows, int64_t width, int64_t real,
                                      int64_t start, int64_t ignore_index, bool packed, float* mx, float* stats) {
  __shared__ float shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float m = -INFINITY;
    ForRealColumns(z, r, width, real, packed, [&](int64_t, float v) { m = fmaxf(m, v); });
    m = BlockMax(m, shared);
    if (threadIdx.x == 0) mx[r] = m;
    float se = 0, sl = 0;
    ForRealColumns(z, r, width, real, packed, [&](int64_t, float v) {
      se += expf(v - m);
      sl += v;
    });
    se = BlockSum(se, shared);
    sl = BlockSum(sl, shared);
    if (threadIdx.x == 0) {
      const int64_t label = labels[r], t = label - start;
      stats[r] = se;
      stats[2 * rows + r] = sl;
      stats[rows + r] = label != ignore_index && label >= start && t < real ? ToF32(z[r * width + t]) : 0.0f;
    }
  }
}

__global__ void VocabShardCombineKernel(const float* gathered, int64_t shards, int64_t rows, float* mx,
                                        float* stats) {
  GRID_STRIDE(r, rows) {
    float m = -INFINITY;
    for (int64_t k = 0; k < shards; ++k) m = fmaxf(m, gathered[k * 4 * rows + r]);
    float se = 0, target = 0, sl = 0;
    for (int64_t k = 0; k < shards; ++k) {
      const float* g = gathered + k * 4 * rows;
      se += g[rows + r] * expf(g[r] - m);
      target += g[2 * rows + r];
      sl += g[3 * rows + r];
    }
    mx[r] = m;
    stats[r] = se;
    stats[rows + r] = target;
    stats[2 * rows + r] = sl;
  }
}

__global__ void VocabShardLossKernel(const float* mx, const float* stats, const int64_t* labels, int64_t rows,
                                     int64_t vocab, float smoothing, int64_t ignore_index, float* lse, float* loss) {
  GRID_STRIDE(r, rows) {
    lse[r] = mx[r] + logf(stats[r]);
    loss[r] = labels[r] == ignore_index ? 0.0f
                                        : lse[r] - (1.0f - smoothing) * stats[rows + r] -
                                              smoothing * stats[2 * rows + r] / static_cast<float>(vocab);
  }
}

// A block a row (no 64-bit division per element): dz in TD, f32 or z's T.
template <typename T, typename TD>
__global__ void VocabShardBackwardKernel(const T* z, const int64_t* labels, const float* lse, const float* dloss,
                                         int64_t rows, int64_t width, int64_t real, int64_t start, int64_t vocab,
                                         float smoothing, int64_t ignore_index, bool packed, TD* dz) {
  const float smooth = smoothing / static_cast<float>(vocab);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t label = labels[r];
    const bool ignored = label == ignore_index;
    const float l = lse[r], d = dloss[r];
    TD* out = dz + r * width;
    auto grad = [&](int64_t j, float v) {
      if (ignored || j >= real) return 0.0f;
      const float target = smooth + (start + j == label ? 1.0f - smoothing : 0.0f);
      return d * (expf(v - l) - target);
    };
    if (packed) {  // whole packs of the row, padding columns included (they get 0)
      constexpr int kN = kPack<T>;
      for (int64_t p = threadIdx.x; p * kN < width; p += blockDim.x) {
        float v[kN];
        LoadPack(z + r * width, p, v);
        float g[kN];
#pragma unroll
        for (int k = 0; k < kN; ++k) g[k] = grad(p * kN + k, v[k]);
        constexpr int kOut = kPack<TD>;  // kN or kN / 2 (TD f32, T 16-bit): one or two 16-byte stores
#pragma unroll
        for (int q = 0; q < kN / kOut; ++q) StorePack(out + p * kN, q, g + q * kOut);
      }
    } else {
      for (int64_t j = threadIdx.x; j < width; j += blockDim.x) out[j] = FromF32<TD>(grad(j, ToF32(z[r * width + j])));
    }
  }
}

__global__ void RopeKernel(const float* x, float* y, int64_t b, int64_t s, int64_t heads, int64_t d, float theta,
                           int64_t position_offset, float sign) {
  const int64_t half = d / 2;
  GRID_STRIDE(idx, b * s * heads * half) {
    const int64_t i = idx % half, row = idx / half;  // row = (bi * s + t) * heads + hh
    const int64_t t = (row / heads) % s;
    const float inv_freq = 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(d));
    const float angle = static_cast<float>(position_offset + t) * inv_freq;
    const float c = cosf(angle), sn = sign * sinf(angle);
    const float x1 = x[row * d + i], x2 = x[row * d + i + half];
    y[row * d + i] = x1 * c - x2 * sn;
    y[row * d + i + half] = x2 * c + x1 * sn;
  }
}

// ---- AdamW over lists of tensors (kernels/cuda/elements.h's TensorList) ----
__global__ void AdamWKernel(TensorList<AdamWTensor> list, AdamWHyper h) {
  int64_t begin = 0, end = 0;
  const AdamWTensor& x = BlockTensor(list, &begin, &end);
  const float grad_scale = h.grad_scale_at != nullptr ? *h.grad_scale_at : h.grad_scale;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float g = LoadF(x.grad, i, x.grad_type) * grad_scale;
    float p = x.master[i];
    p -= h.lr * h.weight_decay * p;
    const float m = h.beta1 * x.m[i] + (1.0f - h.beta1) * g;
    const float v = h.beta2 * x.v[i] + (1.0f - h.beta2) * g * g;
    p -= h.lr * (m / h.bias_correction1) / (sqrtf(v / h.bias_correction2) + h.eps);
    x.master[i] = p;
    x.m[i] = m;
    x.v[i] = v;
    if (x.param != nullptr) StoreF(x.param, i, x.param_type, p);
  }
}

// GradNormClip's one thread: the CPU twin's code (kernels/clip.h).
__global__ void GradNormClipKernel(const float* squares, int64_t n, double max_norm, double loss_scale,
                                   float* out) {
  NormAndClipFactor(squares, n, max_norm, loss_scale, out);
}

// ---- Fused attention (FlashAttention, FlashAttentionBackward) ----
// One thread per query row (forward, dq) or key row (dk, dv), kAttnRows rows
// a block; the block's rows share each tile of the other side's rows, staged
// in shared memory. kD is the head dim rounded up to an instantiation (rows
// padded with zeros, which add nothing to a dot product), so a thread's
// vectors are indexed by constants; kTile rows keep the staged tiles within
// 32 KiB of shared memory. Scalar FMAs in f32: what f32 operands and the
// head dims without a tensor-core instantiation (MmaHeadDim) run.
constexpr int kAttnRows = 64;

template <int kD>
constexpr int kAttnTile =
#ifdef COLOD_CUDA_EMULATION
    // The emulation's __shared__ is static thread-local storage, which every
    // thread of an emulated binary carries in its stack (threads with small
    // stacks, civetweb's, then fail to start): a quarter of the tile there,
    // the same code walking more, smaller tiles.
    (kD <= 64 ? 64 : 4096 / kD) / 4;
#else
    kD <= 64 ? 64 : 4096 / kD;
#endif

// tile[r][c] <- row j0 + r of a [s, stride]-strided head (zero past s or d).
template <int kD, int kT, typename Src>
__device__ void StageRows(float (*tile)[kD], Src base, int64_t stride, int64_t j0, int64_t s, int d) {
  for (int t = threadIdx.x; t < kT * kD; t += blockDim.x) {
    const int r = t / kD, c = t % kD;
    const int64_t j = j0 + r;
    tile[r][c] = (j < s && c < d) ? base[j * stride + c] : 0.0f;
  }
}

// Where head h of batch element bi starts in an operand laid out as `rows`
// (its s rows then `rows.token` apart).
__device__ __forceinline__ int64_t HeadBase(HeadRows rows, int64_t bi, int64_t s, int64_t h) {
  return bi * s * rows.token + h * rows.head;
}

// The keys query row i sees (all, or j <= i when causal) for the block of
// kAttnRows query rows it is in: stages each tile of kv head (bi, kvh)'s k
// and v rows (laid out as kv) in ks and vs, then calls visit(r, j) for each row r of the tile
// that row i sees, key j = j0 + r (none for an inactive thread). Every thread of the block
// calls it: it holds the block's barriers.
template <int kD, int kT, typename T, typename Visit>
__device__ __forceinline__ void ForEachVisibleKey(float (*ks)[kD], float (*vs)[kD], In<T> k, In<T> v,
                                                  int64_t bi, int64_t kvh, HeadRows kv, int64_t i, int64_t s, int d,
                                                  bool causal, bool active, Visit visit) {
  const int64_t block_end = static_cast<int64_t>(blockIdx.x + 1) * kAttnRows;
  const int64_t keys = causal && block_end < s ? block_end : s;
  const In<T> kb = k + HeadBase(kv, bi, s, kvh);
  const In<T> vb = v + HeadBase(kv, bi, s, kvh);
  for (int64_t j0 = 0; j0 < keys; j0 += kT) {
    StageRows<kD, kT>(ks, kb, kv.token, j0, s, d);
    StageRows<kD, kT>(vs, vb, kv.token, j0, s, d);
    __syncthreads();
    int64_t n = s - j0 < kT ? s - j0 : kT;
    if (causal && i - j0 + 1 < n) n = i - j0 + 1;
    for (int r = 0; active && r < n; ++r) visit(r, j0 + r);
    __syncthreads();
  }
}

// What score (i, j) of head h (i, j < s) gains after the scaling
// (kernels/types.h's AttentionBias); slope is extra.alibi[h] or 0.
__device__ __forceinline__ float AddedScore(const AttentionBias& extra, float slope, int64_t h, int64_t s, int64_t i,
                                            int64_t j) {
  float a = slope * static_cast<float>(j - i);
  if (extra.bias != nullptr) a += extra.bias[(h * s + i) * s + j];
  return a;
}

__device__ __forceinline__ float SlopeOf(const AttentionBias& extra, int64_t h) {
  return extra.alibi != nullptr ? extra.alibi[h] : 0.0f;
}

constexpr float kLog2e = 1.4426950408889634f;  // the tensor-core kernels' scores are in base 2

// 2^x on the special-function unit with a denormal result flushed to zero
// (ex2.approx.ftz.f32, what exp2f becomes under --use_fast_math, as
// FlashAttention is built): exp2f's ex2.approx.f32 adds a denormal fix-up
// to every call. Relative error about 2^-22. The emulation flushes as the
// hardware does.
__device__ __forceinline__ float Exp2Ftz(float x) {
#ifdef COLOD_CUDA_EMULATION
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;  // below FLT_MIN
#else
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

// Whether the mask hides key `key` from query `query` (either past s, or
// the key after the query when causal).
__device__ __forceinline__ bool Hidden(int64_t query, int64_t key, int64_t s, bool causal) {
  return query >= s || key >= s || (causal && key > query);
}

// The tensor-core kernels' score (query, key) of head h in base 2, from the
// accumulated product q . k: dot * scale2 (scale log2 e) and, times log2 e,
// what `extra` adds. For a (query, key) the mask does not hide.
__device__ __forceinline__ float Base2Score(float dot, float scale2, const AttentionBias& extra, float slope,
                                            int64_t h, int64_t s, int64_t query, int64_t key) {
  float x = dot * scale2;
  if (extra.alibi != nullptr || extra.bias != nullptr) x += AddedScore(extra, slope, h, s, query, key) * kLog2e;
  return x;
}

// Grid (row blocks, hq, b). Online softmax over the key tiles: m is the
// running max, l the running sum of exp(score - m), acc the running sum of
// exp(score - m) v; a larger score rescales both.
template <int kD, typename T>
__global__ void FlashForwardKernel(In<T> q, In<T> k, In<T> v, Out<T> out, float* lse, int64_t s, int64_t hq,
                                   int64_t hkv, int d, float scale, bool causal, AttentionBias extra,
                                   AttentionLayout layout) {
  constexpr int kT = kAttnTile<kD>;
  __shared__ float ks[kT][kD];
  __shared__ float vs[kT][kD];
  const int64_t h = blockIdx.y, bi = blockIdx.z, kvh = h / (hq / hkv);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kAttnRows + threadIdx.x;
  const bool active = i < s;
  const int64_t row = (bi * s + i) * hq + h;
  const In<T> qrow = q + HeadBase(layout.q, bi, s, h) + i * layout.q.token;
  float qi[kD], acc[kD];
#pragma unroll
  for (int c = 0; c < kD; ++c) {
    qi[c] = (active && c < d) ? qrow[c] * scale : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const float slope = SlopeOf(extra, h);
  ForEachVisibleKey<kD, kT, T>(ks, vs, k, v, bi, kvh, layout.kv, i, s, d, causal, active, [&](int r, int64_t j) {
    float sc = AddedScore(extra, slope, h, s, i, j);
#pragma unroll
    for (int c = 0; c < kD; ++c) sc += qi[c] * ks[r][c];
    if (sc > m) {
      const float corr = expf(m - sc);
      l *= corr;
#pragma unroll
      for (int c = 0; c < kD; ++c) acc[c] *= corr;
      m = sc;
    }
    const float p = expf(sc - m);
    l += p;
#pragma unroll
    for (int c = 0; c < kD; ++c) acc[c] += p * vs[r][c];
  });
  if (active) {
    const float inv = 1.0f / l;
#pragma unroll
    for (int c = 0; c < kD; ++c) {
      if (c < d) out[row * d + c] = acc[c] * inv;
    }
    lse[(bi * hq + h) * s + i] = m + logf(l);
  }
}

// ---- The tensor-core forward: FlashAttention-2's algorithm on mma.sync ----
// For bf16 and f16 operands at the head dims MmaHeadDim names. A block of 4 warps takes
// 64 kTiles query rows, 16 kTiles a warp (kTiles = 2 at head dim 64, where
// the registers allow it, as FlashAttention-2's 128-row blocks; 1 above),
// and walks the keys in tiles of 64 staged in
// shared memory: S = Q K^T by mma.sync m16n8k16 (Q's fragments loaded once
// into registers by ldmatrix, K's by ldmatrix from the tile), the online
// softmax in base 2 on S's accumulator fragments (each lane holds two rows'
// values; a row's max and sum over its 4 lanes by shuffles), then O += P V
// with P's accumulator fragments, rounded to the operand type, reused as
// the A operand (the layouts coincide) and V's fragments by ldmatrix.trans.
// f32 accumulators throughout; P's row sums are taken of the rounded P the
// product uses. Rows of the shared tiles are padded by 16 bytes, so the
// eight rows an ldmatrix reads fall in different banks. Tiles arrive by
// cp.async (warp.h), FlashAttention-2's pipeline on one buffer each: V's
// tile is in flight while S = Q K^T runs, the next K tile while P V runs.
// Only tiles that cross the causal diagonal or the sequence's end are
// masked.
constexpr int kMmaRows = 64;  // query rows a block at one row tile a warp (kAttnRows: AttnGrid's blocks)
constexpr int kMmaKeys = 64;  // keys a tile
constexpr int kMmaThreads = 128;
constexpr int kMmaPad = 8;  // elements of padding a shared row
constexpr int kMmaMaxD = 128;
static_assert(kMmaRows == kAttnRows, "at one row tile a warp the tensor-core kernels use AttnGrid's blocks");

// Whether the tensor-core kernels serve head dim d (their instantiations):
// the dims of the families (GPT-2 64, LLaMA 64 and 128, phi-style 80, 96).
constexpr bool MmaHeadDim(int64_t d) { return d == 64 || d == 80 || d == 96 || d == 128; }

// fn(std::integral_constant<int, d>) for a head dim MmaHeadDim serves.
template <typename Fn>
absl::Status ByMmaHeadDim(int64_t d, Fn fn) {
  switch (d) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 80: return fn(std::integral_constant<int, 80>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    default: return absl::InternalError("no tensor-core attention kernel for head dim " + std::to_string(d));
  }
}

// Row tiles of 16 a warp in the tensor-core forward (head dims 64 and 128)
// and dq (64) kernels: 2 (128-row blocks), or 1 (64-row blocks, the kernels
// before) where the environment sets COLOD_ATTENTION_ROW_TILES=1, for
// bench:layers' rows that compare the two on one GPU. Read at each call.
// Other head dims take 1.
bool OneRowTileRequested() {
  const char* v = getenv("COLOD_ATTENTION_ROW_TILES");
  return v != nullptr && std::string_view(v) == "1";
}

// fn(std::integral_constant<int, tiles>) for the dq kernel's row tiles a
// warp at head dim kD (two at 64: at 128 its Q and dout fragments and dQ's
// accumulators would not fit the registers twice).
template <int kD, typename Fn>
absl::Status ByRowTiles(Fn fn) {
  if constexpr (kD == 64) {
    if (!OneRowTileRequested()) return fn(std::integral_constant<int, 2>{});
  }
  return fn(std::integral_constant<int, 1>{});
}

// The forward's: two at head dims 64 and 128 (at 128 Q is read from shared
// memory at each key tile, so that the output's accumulators fit twice).
template <int kD, typename Fn>
absl::Status ByForwardRowTiles(Fn fn) {
  if constexpr (kD == 64 || kD == 128) {
    if (!OneRowTileRequested()) return fn(std::integral_constant<int, 2>{});
  }
  return fn(std::integral_constant<int, 1>{});
}

// Whether the forward at head dim kD and kTiles row tiles reads Q's
// fragments from shared memory at each key tile instead of keeping them in
// registers (then its tiles are in dynamic shared memory: Q's kTiles 64
// rows, K's and V's kForwardKeys each, kForwardShared bytes).
template <int kD, int kTiles>
constexpr bool kQFromShared = kD == 128 && kTiles == 2;
// The forward's key tile: 64 keys, 32 where Q comes from shared memory (two
// row tiles at head dim 128: the scores of 64 keys beside the output's
// accumulators spilled).
template <int kD, int kTiles>
constexpr int kForwardKeys = kQFromShared<kD, kTiles> ? 32 : kMmaKeys;
template <int kD, int kTiles>
constexpr int kForwardShared = 2 * (kMmaRows * kTiles + 2 * kForwardKeys<kD, kTiles>) * (kD + kMmaPad);

// The kernel's shared memory: one array for every instantiation (a
// __shared__ in a device function is per block on a GPU; under the
// emulation one thread-local array instead of one per instantiation). Two
// tiles of 64 rows at the largest head dim, or the backward's four tiles of
// kBwdTile rows (64 rows at head dim 64).
constexpr int kMmaSharedElements = 2 * kMmaKeys * (kMmaMaxD + kMmaPad) > 4 * 64 * (64 + kMmaPad)
                                       ? 2 * kMmaKeys * (kMmaMaxD + kMmaPad)
                                       : 4 * 64 * (64 + kMmaPad);
__device__ __forceinline__ uint16_t* MmaShared() {
  alignas(16) __shared__ uint16_t tiles[kMmaSharedElements];
  return tiles;
}
// A kernel's tiles: its dynamic shared memory (kDynamic: the kernels that
// need more than MmaShared's, launched by LaunchShared) or MmaShared().
template <bool kDynamic>
__device__ __forceinline__ uint16_t* TileBase() {
  if constexpr (kDynamic) {
    return reinterpret_cast<uint16_t*>(DynamicShared());
  } else {
    return MmaShared();
  }
}

// Starts the copies tile[r][...] <- row r0 + r of a [s, stride]-strided head
// of kD elements, 16 bytes each by cp.async (zeros past s). The caller
// commits, waits and synchronizes before the block reads the tile.
template <int kD, int kRows = kMmaKeys>
__device__ __forceinline__ void StageMmaTile(uint16_t (*tile)[kD + kMmaPad], const uint16_t* base, int64_t stride,
                                             int64_t r0, int64_t s) {
  constexpr int kChunks = kD / 8;
#pragma unroll
  for (int t = threadIdx.x; t < kRows * kChunks; t += kMmaThreads) {
    const int r = t / kChunks, c = t % kChunks;
    const bool valid = r0 + r < s;
    CpAsync16(&tile[r][8 * c], base + (valid ? (r0 + r) * stride : 0) + 8 * c, valid);
  }
}

// The row block a block of the forward or dq kernel takes: under a causal
// mask the last first, since later rows see more keys (the GPU starts blocks
// in index order, so the longest start first and the short ones fill the
// tail).
__device__ __forceinline__ int64_t RowBlockOf(bool causal) {
  return causal ? static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x : static_cast<int64_t>(blockIdx.x);
}

// Every key of the tile [j0, j0 + keys) visible to every row of [row0, row0 +
// rows): no element of the tile needs the mask (a block-uniform test).
__device__ __forceinline__ bool TileUnmasked(int64_t row0, int rows, int64_t j0, int keys, int64_t s, bool causal) {
  return row0 + rows <= s && j0 + keys <= s && (!causal || j0 + keys - 1 <= row0);
}

template <typename T>
__device__ __forceinline__ void MmaOf(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  if constexpr (std::is_same_v<T, Bf16>) {
    MmaBf16(d, a, b, c);
  } else {
    MmaF16(d, a, b, c);
  }
}

template <typename T>
__device__ __forceinline__ uint16_t BitsOf(float v) {
  return FromF32<T>(v).bits;
}

// Rounds lo and hi to T in place and packs them (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t RoundPack(float& lo, float& hi) {
  const uint16_t a = BitsOf<T>(lo), b = BitsOf<T>(hi);
  lo = ToF32(T{a});
  hi = ToF32(T{b});
  return static_cast<uint32_t>(a) | static_cast<uint32_t>(b) << 16;
}

// Each warp's A fragments of its kTiles row tiles of 16 (warp w's rows 16
// (kTiles w + t) .. + 16 in f[t]) of a tile of 64 kTiles rows.
template <int kD, int kTiles>
__device__ __forceinline__ void LoadRowTileFragments(uint32_t (*f)[kD / 16][4], uint16_t (*tile)[kD + kMmaPad]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      LdMatrixX4(f[t][kk], &tile[16 * (kTiles * warp + t) + lane % 16][16 * kk + 8 * (lane / 16)]);
    }
  }
}

// Each warp's A fragments of 16 rows (16 w .. 16 w + 16) of a 64-row tile.
template <int kD>
__device__ __forceinline__ void LoadRowFragments(uint32_t (*f)[4], uint16_t (*tile)[kD + kMmaPad]) {
  LoadRowTileFragments<kD, 1>(reinterpret_cast<uint32_t(*)[kD / 16][4]>(f), tile);
}

// acc[t][kN / 8][4] += A_t (16 x kD, fragments a[t]) times tile^T for each
// of kTiles row tiles, tile holding kN rows of kD (a row-major n x k
// operand: ldmatrix). Each B fragment read from shared memory feeds 2 kTiles
// products.
template <int kD, int kN, typename T, int kTiles>
__device__ __forceinline__ void MmaTilesByTileT(float (*acc)[kN / 8][4], const uint32_t (*a)[kD / 16][4],
                                                uint16_t (*tile)[kD + kMmaPad]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
    for (int nt = 0; nt < kN / 16; ++nt) {
      uint32_t b[4];
      LdMatrixX4(b, &tile[16 * nt + lane % 8 + 8 * (lane / 16)][16 * kk + 8 * ((lane / 8) % 2)]);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        MmaOf<T>(acc[t][2 * nt], a[t][kk], b, acc[t][2 * nt]);
        MmaOf<T>(acc[t][2 * nt + 1], a[t][kk], b + 2, acc[t][2 * nt + 1]);
      }
    }
  }
}

// The same product with the A fragments read from shared memory at each kk
// (the registers they would hold go to other accumulators): A_t the warp's
// row tile t of `rows`, rows 16 (kTiles w + t) .. + 16 as in
// LoadRowTileFragments, in MmaTilesByTileT's order of products.
template <int kD, int kN, typename T, int kTiles>
__device__ __forceinline__ void MmaSharedTilesByTileT(float (*acc)[kN / 8][4], uint16_t (*rows)[kD + kMmaPad],
                                                      uint16_t (*tile)[kD + kMmaPad]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[kTiles][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      LdMatrixX4(a[t], &rows[16 * (kTiles * warp + t) + lane % 16][16 * kk + 8 * (lane / 16)]);
    }
#pragma unroll
    for (int nt = 0; nt < kN / 16; ++nt) {
      uint32_t b[4];
      LdMatrixX4(b, &tile[16 * nt + lane % 8 + 8 * (lane / 16)][16 * kk + 8 * ((lane / 8) % 2)]);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        MmaOf<T>(acc[t][2 * nt], a[t], b, acc[t][2 * nt]);
        MmaOf<T>(acc[t][2 * nt + 1], a[t], b + 2, acc[t][2 * nt + 1]);
      }
    }
  }
}

// acc[kN / 8][4] += A (16 x kD, fragments a) times tile^T: one row tile.
template <int kD, int kN, typename T>
__device__ __forceinline__ void MmaRowsByTileT(float (*acc)[4], const uint32_t (*a)[4],
                                               uint16_t (*tile)[kD + kMmaPad]) {
  MmaTilesByTileT<kD, kN, T, 1>(reinterpret_cast<float(*)[kN / 8][4]>(acc),
                                reinterpret_cast<const uint32_t(*)[kD / 16][4]>(a), tile);
}

// acc[t][kD / 8][4] += X_t (16 x kK, the accumulator fragments x[t][kK /
// 8][4], rounded to T in place) times tile (kK rows of kD: a row-major k x n
// operand: ldmatrix.trans), for each of kTiles row tiles; each B fragment
// feeds 2 kTiles products.
template <int kD, int kK, typename T, int kTiles>
__device__ __forceinline__ void MmaTilesAccByTile(float (*acc)[kD / 8][4], float (*x)[kK / 8][4],
                                                  uint16_t (*tile)[kD + kMmaPad]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kTiles][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      a[t][0] = RoundPack<T>(x[t][2 * kk][0], x[t][2 * kk][1]);
      a[t][1] = RoundPack<T>(x[t][2 * kk][2], x[t][2 * kk][3]);
      a[t][2] = RoundPack<T>(x[t][2 * kk + 1][0], x[t][2 * kk + 1][1]);
      a[t][3] = RoundPack<T>(x[t][2 * kk + 1][2], x[t][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dt = 0; dt < kD / 16; ++dt) {
      uint32_t b[4];
      LdMatrixX4Trans(b, &tile[16 * kk + lane % 16][16 * dt + 8 * (lane / 16)]);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        MmaOf<T>(acc[t][2 * dt], a[t], b, acc[t][2 * dt]);
        MmaOf<T>(acc[t][2 * dt + 1], a[t], b + 2, acc[t][2 * dt + 1]);
      }
    }
  }
}

// acc[kD / 8][4] += X (16 x kK, fragments x[kK / 8][4]) times tile: one row
// tile.
template <int kD, int kK, typename T>
__device__ __forceinline__ void MmaAccByTile(float (*acc)[4], float (*x)[4], uint16_t (*tile)[kD + kMmaPad]) {
  MmaTilesAccByTile<kD, kK, T, 1>(reinterpret_cast<float(*)[kD / 8][4]>(acc), reinterpret_cast<float(*)[kK / 8][4]>(x),
                                  tile);
}

// Stores acc (16 rows of the warp, kD columns) * factor to rows [row0 + 16
// warp, ...) of a [s, stride] head, rows below s.
template <int kD, typename T>
__device__ __forceinline__ void StoreRows(T* base, int64_t stride, int64_t row0, int64_t s, float (*acc)[4],
                                          float factor) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, pair = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + 16 * warp + group + 8 * r;
    if (row >= s) continue;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      const uint32_t bits = static_cast<uint32_t>(BitsOf<T>(acc[j][2 * r] * factor)) |
                            static_cast<uint32_t>(BitsOf<T>(acc[j][2 * r + 1] * factor)) << 16;
      *reinterpret_cast<uint32_t*>(base + row * stride + 8 * j + 2 * pair) = bits;
    }
  }
}

// Grid (row blocks of 64 kTiles rows, hq, b), kMmaThreads threads. q, k, v,
// out as FlashAttention's, 16-byte aligned. Each warp takes kTiles row tiles
// of 16 (FlashAttention-2's 128-row blocks at kTiles = 2): every K and V
// fragment read from shared memory then feeds kTiles times as many
// mma.sync, which halves the shared-memory reads a product, for kTiles
// times the registers of Q's fragments, the scores and the output.
template <int kD, typename T, int kTiles>
__global__ void __launch_bounds__(kMmaThreads)
    FlashForwardMmaKernel(const T* q, const T* k, const T* v, T* out, float* lse, int64_t s, int64_t hq, int64_t hkv,
                          float scale, bool causal, AttentionBias extra, AttentionLayout layout) {
  constexpr int kStride = kD + kMmaPad, kRows = kMmaRows * kTiles;
  constexpr bool kQShared = kQFromShared<kD, kTiles>;
  constexpr int kKeys = kForwardKeys<kD, kTiles>;
  static_assert(kD % 16 == 0 && kD <= kMmaMaxD, "head dim");
  static_assert(kQShared || kRows <= 2 * kKeys, "the block's query rows are staged through ks and vs");
  // Q's rows (kQShared only), then K's and V's tiles.
  uint16_t* shared = TileBase<kQShared>();
  uint16_t(*qs)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(shared);
  uint16_t* kv = kQShared ? shared + kRows * kStride : shared;
  uint16_t(*ks)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(kv);
  uint16_t(*vs)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(kv + kKeys * kStride);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, pair = lane % 4;
  const int64_t h = blockIdx.y, bi = blockIdx.z, kvh = h / (hq / hkv);
  const int64_t row0 = RowBlockOf(causal) * kRows;
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + HeadBase(layout.q, bi, s, h);
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k) + HeadBase(layout.kv, bi, s, kvh);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v) + HeadBase(layout.kv, bi, s, kvh);

  // The block's query rows: kept in qs (kQShared), their fragments read at
  // each key tile; or through ks (and vs, which follows it), each warp
  // keeping its row tiles' A fragments.
  uint32_t qf[kQShared ? 1 : kTiles][kD / 16][4];
  if constexpr (kQShared) {
    StageMmaTile<kD, kRows>(qs, qb, layout.q.token, row0, s);
    CpAsyncCommit();  // waited for with K's first tile
  } else {
    StageMmaTile<kD, kRows>(ks, qb, layout.q.token, row0, s);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    LoadRowTileFragments<kD, kTiles>(qf, ks);
    __syncthreads();
  }

  // This lane's rows of row tile t: rows[t][0] = group, rows[t][1] = group + 8
  // of the tile's 16.
  int64_t rows[kTiles][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    rows[t][0] = row0 + 16 * (kTiles * warp + t) + group;
    rows[t][1] = rows[t][0] + 8;
  }
  float o[kTiles][kD / 8][4];
  float m[kTiles][2], l[kTiles][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) o[t][j][0] = o[t][j][1] = o[t][j][2] = o[t][j][3] = 0.0f;
    m[t][0] = m[t][1] = -INFINITY;
    l[t][0] = l[t][1] = 0.0f;
  }
  const float scale2 = scale * kLog2e;
  const float slope = SlopeOf(extra, h);
  const int64_t keys = causal && row0 + kRows < s ? row0 + kRows : s;
  StageMmaTile<kD, kKeys>(ks, kb, layout.kv.token, 0, s);
  CpAsyncCommit();
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    CpAsyncWait<0>();  // this K tile
    __syncthreads();   // ... visible; every warp is done with vs
    StageMmaTile<kD, kKeys>(vs, vb, layout.kv.token, j0, s);
    CpAsyncCommit();
    float sc[kTiles][kKeys / 8][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) sc[t][j][0] = sc[t][j][1] = sc[t][j][2] = sc[t][j][3] = 0.0f;
    }
    if constexpr (kQShared) {  // S = Q K^T
      MmaSharedTilesByTileT<kD, kKeys, T, kTiles>(sc, qs, ks);
    } else {
      MmaTilesByTileT<kD, kKeys, T, kTiles>(sc, qf, ks);
    }
    // Scale and mask; each row's max over its 4 lanes.
    float mx[kTiles][2];
    auto scores = [&](auto masked) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        mx[t][0] = m[t][0];
        mx[t][1] = m[t][1];
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t key = j0 + 8 * j + 2 * pair + i % 2;
            const float x = decltype(masked)::value && Hidden(rows[t][i / 2], key, s, causal)
                                ? -INFINITY
                                : Base2Score(sc[t][j][i], scale2, extra, slope, h, s, rows[t][i / 2], key);
            sc[t][j][i] = x;
            mx[t][i / 2] = fmaxf(mx[t][i / 2], x);
          }
        }
      }
    };
    if (TileUnmasked(row0, kRows, j0, kKeys, s, causal)) {
      scores(std::false_type{});
    } else {
      scores(std::true_type{});
    }
    float ref[kTiles][2];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[t][r] = fmaxf(mx[t][r], __shfl_xor_sync(0xffffffffu, mx[t][r], 1));
        mx[t][r] = fmaxf(mx[t][r], __shfl_xor_sync(0xffffffffu, mx[t][r], 2));
        ref[t][r] = mx[t][r] == -INFINITY ? 0.0f : mx[t][r];  // a row without a visible key yet
        const float corr = Exp2Ftz(m[t][r] - ref[t][r]);
        m[t][r] = mx[t][r];
        l[t][r] *= corr;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          o[t][j][2 * r] *= corr;
          o[t][j][2 * r + 1] *= corr;
        }
      }
    }
    CpAsyncWait<0>();  // this V tile
    __syncthreads();   // ... visible; every warp is done with ks
    if (j0 + kKeys < keys) StageMmaTile<kD, kKeys>(ks, kb, layout.kv.token, j0 + kKeys, s);
    CpAsyncCommit();
    // P = 2^(x - max); O += P V rounds P to T in place, and the row sums
    // are of that P.
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[t][j][i] = Exp2Ftz(sc[t][j][i] - ref[t][i / 2]);
      }
    }
    MmaTilesAccByTile<kD, kKeys, T, kTiles>(o, sc, vs);
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        l[t][0] += sc[t][j][0] + sc[t][j][1];
        l[t][1] += sc[t][j][2] + sc[t][j][3];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 1);
      l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 2);
    }
  }
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (rows[t][r] >= s) continue;
      const float inv = 1.0f / l[t][r];
      T* orow = out + ((bi * s + rows[t][r]) * hq + h) * kD;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        const uint32_t bits = static_cast<uint32_t>(BitsOf<T>(o[t][j][2 * r] * inv)) |
                              static_cast<uint32_t>(BitsOf<T>(o[t][j][2 * r + 1] * inv)) << 16;
        *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * pair) = bits;
      }
      if (pair == 0) lse[(bi * hq + h) * s + rows[t][r]] = (m[t][r] + log2f(l[t][r])) * 0.6931471805599453f;
    }
  }
}

// ---- The tensor-core backward (FlashAttention-2's, deterministic) ----
// Two kernels as the scalar backward: dq (and delta) per 64 query rows (128
// at head dim 64: kDqKeyTile) over the key tiles, then dk and dv per 64 key rows over the query tiles of each
// query head of the kv head, in a fixed order without atomics. Both
// recompute P from the forward's log-sum-exp; the other side's tiles are
// kBwdTile rows (32 above head dim 64, so the accumulators fit the
// registers). P and dS are rounded to the operand type before the products
// that take them (dV += P^T dout, dQ += dS K, dK += dS^T Q), as
// FlashAttention-2 does; every accumulation is in f32, and each output is
// summed in one fixed order (no atomics), so the gradients repeat bit for bit.
// The streamed tiles (K and V for dq; Q, dout and the rows' statistics for
// dk and dv) are double-buffered: the next tile's cp.async copies are in
// flight while this one's products run, one barrier a tile (after the wait
// for this tile, which also ends every warp's reads of the other buffer).
template <int kD>
constexpr int kBwdTile = kD <= 64 ? 64 : 32;

// Tile `which` (0 or 1) of buffer b (0 or 1) of the backward's double-
// buffered streamed tiles, kBwdTile rows each (K and V for dq; Q and dout
// for dk/dv): buffer b's two tiles from row 2 b kBwdTile of MmaShared.
template <int kD>
__device__ __forceinline__ auto StreamedTile(int b, int which) {
  constexpr int kStride = kD + kMmaPad;
  return reinterpret_cast<uint16_t(*)[kStride]>(MmaShared() + (2 * b + which) * kBwdTile<kD> * kStride);
}

// The dq kernel's key tile: kBwdTile<kD> rows at one row tile a warp; 16 at
// two, so the scores and dP of both fit the registers (at 32 they spilled).
template <int kD, int kTiles>
constexpr int kDqKeyTile = kTiles == 1 ? kBwdTile<kD> : 16;

// Grid (row blocks of 64 kTiles rows, hq, b), kMmaThreads threads: dq and
// delta of the block's query rows, kTiles row tiles of 16 a warp (as the
// forward: each K and V fragment read from shared memory feeds kTiles times
// the products).
template <int kD, typename T, int kTiles>
__global__ void __launch_bounds__(kMmaThreads)
    FlashBackwardDqMmaKernel(const T* q, const T* k, const T* v, const T* out, const T* dout, const float* lse,
                             float* delta, T* dq, int64_t s, int64_t hq, int64_t hkv, float scale, bool causal,
                             AttentionBias extra, AttentionLayout layout) {
  constexpr int kStride = kD + kMmaPad, kN = kDqKeyTile<kD, kTiles>, kRows = kMmaRows * kTiles;
  static_assert(kN <= kBwdTile<kD>, "the streamed tiles' buffers hold kBwdTile rows");
  static_assert(2 * kRows * kStride <= kMmaSharedElements, "Q's and dout's rows are staged together");
  __shared__ float row_delta[kRows];
  uint16_t(*tile_a)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(MmaShared());
  uint16_t(*tile_b)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(MmaShared() + kRows * kStride);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, pair = lane % 4;
  const int64_t h = blockIdx.y, bi = blockIdx.z, kvh = h / (hq / hkv);
  const int64_t row0 = RowBlockOf(causal) * kRows;
  // out's and dout's head (contiguous), q's and dq's, k's and v's.
  const int64_t ooff = (bi * s * hq + h) * kD, qoff = HeadBase(layout.q, bi, s, h);
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k) + HeadBase(layout.kv, bi, s, kvh);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v) + HeadBase(layout.kv, bi, s, kvh);

  // delta = rowsum(dout * out) of the block's rows: two threads a row, each
  // summing its half in column order, read in 16-byte packs (kD / 2 is a
  // multiple of 8 at every tensor-core head dim; the rows are 16-byte
  // aligned).
  static_assert(kD / 2 % kPack<T> == 0, "half a row is whole 16-byte packs");
  for (int r = threadIdx.x / 2; r < kRows; r += kMmaThreads / 2) {
    const int half = threadIdx.x % 2;
    const int64_t row = row0 + r;
    float sum = 0.0f;
    if (row < s) {
      const T* o = out + ooff + row * hq * kD + half * kD / 2;
      const T* g = dout + ooff + row * hq * kD + half * kD / 2;
#pragma unroll
      for (int p = 0; p < kD / 2 / kPack<T>; ++p) {
        float ov[kPack<T>], gv[kPack<T>];
        LoadPack(o, p, ov);
        LoadPack(g, p, gv);
#pragma unroll
        for (int c = 0; c < kPack<T>; ++c) sum += ov[c] * gv[c];
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0) {
      row_delta[r] = sum;
      if (row < s) delta[(bi * hq + h) * s + row] = sum;
    }
  }
  // Q's and dout's fragments of each warp's row tiles, through the shared tiles.
  StageMmaTile<kD, kRows>(tile_a, reinterpret_cast<const uint16_t*>(q) + qoff, layout.q.token, row0, s);
  StageMmaTile<kD, kRows>(tile_b, reinterpret_cast<const uint16_t*>(dout) + ooff, hq * kD, row0, s);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  uint32_t qf[kTiles][kD / 16][4], gf[kTiles][kD / 16][4];
  LoadRowTileFragments<kD, kTiles>(qf, tile_a);
  LoadRowTileFragments<kD, kTiles>(gf, tile_b);
  int64_t rows[kTiles][2];
  float lse2[kTiles][2], dlt[kTiles][2];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = 16 * (kTiles * warp + t) + group + 8 * r;
      rows[t][r] = row0 + local;
      lse2[t][r] = rows[t][r] < s ? lse[(bi * hq + h) * s + rows[t][r]] * kLog2e : 0.0f;
      dlt[t][r] = row_delta[local];
    }
  }
  __syncthreads();
  float acc[kTiles][kD / 8][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.0f;
  }
  const float scale2 = scale * kLog2e;
  const float slope = SlopeOf(extra, h);
  const int64_t keys = causal && row0 + kRows < s ? row0 + kRows : s;
  StageMmaTile<kD, kN>(StreamedTile<kD>(0, 0), kb, layout.kv.token, 0, s);
  StageMmaTile<kD, kN>(StreamedTile<kD>(0, 1), vb, layout.kv.token, 0, s);
  CpAsyncCommit();
  for (int64_t j0 = 0, b = 0; j0 < keys; j0 += kN, b ^= 1) {
    CpAsyncWait<0>();  // this tile's copies
    __syncthreads();   // ... visible; every warp is done with the other buffer (the last tile)
    if (j0 + kN < keys) {
      StageMmaTile<kD, kN>(StreamedTile<kD>(static_cast<int>(b ^ 1), 0), kb, layout.kv.token, j0 + kN, s);
      StageMmaTile<kD, kN>(StreamedTile<kD>(static_cast<int>(b ^ 1), 1), vb, layout.kv.token, j0 + kN, s);
    }
    CpAsyncCommit();
    uint16_t(*ks)[kStride] = StreamedTile<kD>(static_cast<int>(b), 0);
    uint16_t(*vs)[kStride] = StreamedTile<kD>(static_cast<int>(b), 1);
    float sc[kTiles][kN / 8][4], dp[kTiles][kN / 8][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        sc[t][j][0] = sc[t][j][1] = sc[t][j][2] = sc[t][j][3] = 0.0f;
        dp[t][j][0] = dp[t][j][1] = dp[t][j][2] = dp[t][j][3] = 0.0f;
      }
    }
    MmaTilesByTileT<kD, kN, T, kTiles>(sc, qf, ks);  // S = Q K^T
    MmaTilesByTileT<kD, kN, T, kTiles>(dp, gf, vs);  // dP = dout V^T
    // dS = P (dP - delta), P = 2^(S scale2 - lse2), 0 where masked.
    auto grads = [&](auto masking) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t key = j0 + 8 * j + 2 * pair + i % 2, row = rows[t][i / 2];
            const bool masked = decltype(masking)::value && Hidden(row, key, s, causal);
            const float p =
                masked ? 0.0f
                       : Exp2Ftz(Base2Score(sc[t][j][i], scale2, extra, slope, h, s, row, key) - lse2[t][i / 2]);
            sc[t][j][i] = p * (dp[t][j][i] - dlt[t][i / 2]);
            if (extra.dbias != nullptr && !masked) extra.dbias[((bi * hq + h) * s + row) * s + key] = sc[t][j][i];
          }
        }
      }
    };
    if (TileUnmasked(row0, kRows, j0, kN, s, causal)) {
      grads(std::false_type{});
    } else {
      grads(std::true_type{});
    }
    MmaTilesAccByTile<kD, kN, T, kTiles>(acc, sc, ks);  // dQ += dS K
  }
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    // StoreRows writes a warp's 16 rows from row0 + 16 warp: tile t's are
    // 16 (kTiles - 1) warp + 16 t further on.
    StoreRows<kD>(dq + HeadBase(layout.dq, bi, s, h), layout.dq.token, row0 + 16 * ((kTiles - 1) * warp + t), s,
                  acc[t], scale);
  }
}

// ---- The dk/dv kernel, and the backward in one pass (FlashAttention-2's, with atomics) ----
// The default backward (unless COLOD_DETERMINISTIC=1) is the dk/dv kernel
// (FlashBackwardKvMmaKernel) with kDq, which also gives dQ: each block
// writes its dS^T tile (rounded
// to T, as the deterministic kernels round it) to shared memory, and dQ's
// share of the tile's queries, dS K over the block's 64 keys, is added to an
// f32 [b, s, hq, d] buffer by red.global.add (one reduction for two
// adjacent columns). So S, P and dP are computed once, where the two-kernel
// backward computes them twice (7 products a tile against 5), at the price
// of the reductions, whose order the GPU's scheduling sets: the last bits
// of dq may differ between runs (dk and dv do not). Before it,
// FlashBackwardPrepKernel writes delta and zeroes the buffer; after it,
// FlashDqConvertKernel rounds buffer * scale to dq.
// Dynamic shared memory (kFusedShared<kD> bytes, over 48 KiB at head dims
// 64 and 128): K's 64 rows, kept for dS K, the double-buffered Q and dout
// tiles, and dS^T, [key][query].
template <int kD>
constexpr int kFusedShared =
    2 * ((kMmaRows + 4 * kBwdTile<kD>) * (kD + kMmaPad) + kMmaRows * (kBwdTile<kD> + kMmaPad));

// delta [b, hq, s] = rowsum(dout * out), the two halves of a row summed in
// column order and then added (the dq kernel's order): a thread per (b,
// row, head), rows in 16-byte packs (kD / 2 is whole packs at every
// tensor-core head dim); and the f32 dQ buffer [b, s, hq, kD] zeroed, a
// 16-byte pack a thread, consecutive threads on consecutive packs.
template <int kD, typename T>
__global__ void FlashBackwardPrepKernel(const T* out, const T* dout, float* delta, float* dq_acc, int64_t b,
                                        int64_t s, int64_t hq) {
  static_assert(kD / 2 % kPack<T> == 0 && kD % kPack<float> == 0, "whole 16-byte packs");
  const int64_t rows = b * s * hq;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = r % hq, row = (r / hq) % s, bi = r / (hq * s);
    float half_sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const T* o = out + r * kD + half * kD / 2;
      const T* g = dout + r * kD + half * kD / 2;
#pragma unroll
      for (int p = 0; p < kD / 2 / kPack<T>; ++p) {
        float ov[kPack<T>], gv[kPack<T>];
        LoadPack(o, p, ov);
        LoadPack(g, p, gv);
#pragma unroll
        for (int c = 0; c < kPack<T>; ++c) half_sums[half] += ov[c] * gv[c];
      }
    }
    delta[(bi * hq + h) * s + row] = half_sums[0] + half_sums[1];
  }
  const float zeros[kPack<float>] = {};
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < rows * (kD / kPack<float>);
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StorePack(dq_acc, p, zeros);
  }
}

// dq = acc * scale rounded to T, n elements (a multiple of kPack<T>), in
// 16-byte packs: acc is contiguous [b, s, hq, kD], dq laid out as `rows`
// (whose strides are whole packs).
template <int kD, typename T>
__global__ void FlashDqConvertKernel(const float* acc, T* dq, int64_t n, float scale, int64_t hq, HeadRows rows) {
  constexpr int kN = kPack<T>, kF = kPack<float>;
  static_assert(kN % kF == 0, "a pack of T is whole packs of f32");
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n / kN;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[kN];
#pragma unroll
    for (int i = 0; i < kN / kF; ++i) {
      float f[kF];
      LoadPack(acc, p * (kN / kF) + i, f);
#pragma unroll
      for (int c = 0; c < kF; ++c) v[kF * i + c] = f[c] * scale;
    }
    const int64_t e = p * kN, row = e / kD;  // row (b s + i) hq + h
    StorePack(dq + row / hq * rows.token + row % hq * rows.head + e % kD, 0, v);
  }
}

// Grid (key blocks of 64, hkv, b), kMmaThreads threads: dk and dv of the
// block's 64 keys, over the query tiles of every query head of the kv head,
// in order. With kDq (the one pass) also each tile's dQ share, added to
// dq_acc (unscaled), and the scores' gradients to extra.dbias; its tiles
// are in kFusedShared<kD> bytes of dynamic shared memory, and K's fragments
// are read from ks at each tile (their registers go to dQ's accumulators),
// in the order the registers' product takes: dk and dv are the same bits
// either way. Without kDq (COLOD_DETERMINISTIC=1, after the dq kernel) the
// static tiles of MmaShared, the streamed ones over K's and V's.
template <int kD, typename T, bool kDq>
__global__ void __launch_bounds__(kMmaThreads)
    FlashBackwardKvMmaKernel(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                             float* dq_acc, T* dk, T* dv, int64_t s, int64_t hq, int64_t hkv, float scale,
                             bool causal, AttentionBias extra, AttentionLayout layout) {
  constexpr int kStride = kD + kMmaPad, kN = kBwdTile<kD>, kDsStride = kN + kMmaPad;
  // dQ's tile [kN queries, kD] among the 4 warps: kN / 16 row tiles, each
  // split over kSplit warps by 16-column chunks (kPer a warp, the last
  // warp's fewer where they do not divide).
  constexpr int kRowTiles = kN / 16, kSplit = 4 / kRowTiles, kChunks = kD / 16;
  constexpr int kPer = (kChunks + kSplit - 1) / kSplit;
  static_assert(kRowTiles * kSplit == 4, "dQ's tile is shared by the 4 warps");
  alignas(16) __shared__ float tile_lse2[2][kN];
  alignas(16) __shared__ float tile_delta[2][kN];
  // K's 64 rows at the start, V's after them; the streamed tiles after K's
  // (kDq: K stays) or from the start (V's and K's fragments are loaded
  // before the walk); then, with kDq, dS^T.
  uint16_t* shared = TileBase<kDq>();
  uint16_t(*ks)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(shared);
  uint16_t(*vs)[kStride] = reinterpret_cast<uint16_t(*)[kStride]>(shared + kMmaRows * kStride);
  uint16_t* streamed = kDq ? shared + kMmaRows * kStride : shared;
  auto streamed_tile = [&](int b, int which) {
    return reinterpret_cast<uint16_t(*)[kStride]>(streamed + (2 * b + which) * kN * kStride);
  };
  uint16_t(*ds)[kDsStride] = reinterpret_cast<uint16_t(*)[kDsStride]>(streamed + 4 * kN * kStride);  // kDq only
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, pair = lane % 4;
  const int64_t kvh = blockIdx.y, bi = blockIdx.z, heads = hq / hkv;
  const int64_t key0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int64_t kvoff = HeadBase(layout.kv, bi, s, kvh);
  static_assert(4 * kN >= kMmaRows, "with kDq V's rows are staged through the streamed tiles");
  static_assert(kDq || (2 * kMmaRows * kStride <= kMmaSharedElements && 4 * kN * kStride <= kMmaSharedElements),
                "K's and V's tiles, and then the streamed ones, fit the static tiles");
  StageMmaTile<kD, kMmaRows>(ks, reinterpret_cast<const uint16_t*>(k) + kvoff, layout.kv.token, key0, s);
  StageMmaTile<kD, kMmaRows>(vs, reinterpret_cast<const uint16_t*>(v) + kvoff, layout.kv.token, key0, s);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  [[maybe_unused]] uint32_t kf[kDq ? 1 : kD / 16][4];
  uint32_t vf[kD / 16][4];
  if constexpr (!kDq) LoadRowFragments<kD>(kf, ks);
  LoadRowFragments<kD>(vf, vs);
  __syncthreads();
  const int64_t keys[2] = {key0 + 16 * warp + group, key0 + 16 * warp + group + 8};
  float dk_acc[kD / 8][4], dv_acc[kD / 8][4];
#pragma unroll
  for (int j = 0; j < kD / 8; ++j) {
    dk_acc[j][0] = dk_acc[j][1] = dk_acc[j][2] = dk_acc[j][3] = 0.0f;
    dv_acc[j][0] = dv_acc[j][1] = dv_acc[j][2] = dv_acc[j][3] = 0.0f;
  }
  const float scale2 = scale * kLog2e;
  const int64_t first = causal ? key0 : 0, h_end = (kvh + 1) * heads;
  auto stage = [&](int64_t h, int64_t i0, int b) {
    StageMmaTile<kD, kN>(streamed_tile(b, 0), reinterpret_cast<const uint16_t*>(q) + HeadBase(layout.q, bi, s, h),
                         layout.q.token, i0, s);
    StageMmaTile<kD, kN>(streamed_tile(b, 1), reinterpret_cast<const uint16_t*>(dout) + (bi * s * hq + h) * kD,
                         hq * kD, i0, s);
    for (int t = threadIdx.x; t < kN; t += kMmaThreads) {
      const bool valid = i0 + t < s;
      CpAsync4(&tile_lse2[b][t], lse + (bi * hq + h) * s + (valid ? i0 + t : 0), valid);
      CpAsync4(&tile_delta[b][t], delta + (bi * hq + h) * s + (valid ? i0 + t : 0), valid);
    }
  };
  auto advance = [&](int64_t& h, int64_t& i0) {
    i0 += kN;
    if (i0 >= s) {
      i0 = first;
      ++h;
    }
  };
  int64_t next_h = kvh * heads, next_i0 = first;
  if (first < s) {
    stage(next_h, next_i0, 0);
    advance(next_h, next_i0);
  }
  CpAsyncCommit();
  for (int64_t h = kvh * heads, i0 = first, b = 0; first < s && h < h_end; advance(h, i0), b ^= 1) {
    CpAsyncWait<0>();  // this tile's copies
    for (int t = threadIdx.x; t < kN; t += kMmaThreads) tile_lse2[b][t] *= kLog2e;
    // ... visible; every warp is done with the other buffer and with ds (the
    // last tile's dQ products)
    __syncthreads();
    if (next_h < h_end) {
      stage(next_h, next_i0, static_cast<int>(b ^ 1));
      advance(next_h, next_i0);
    }
    CpAsyncCommit();
    const float slope = SlopeOf(extra, h);
    uint16_t(*qs)[kStride] = streamed_tile(static_cast<int>(b), 0);
    uint16_t(*gs)[kStride] = streamed_tile(static_cast<int>(b), 1);
    float st[kN / 8][4], dpt[kN / 8][4];
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.0f;
      dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.0f;
    }
    // S^T = K Q^T, the warp's 16 rows of K as A fragments from ks (kDq) or
    // the registers.
    if constexpr (!kDq) {
      MmaRowsByTileT<kD, kN, T>(st, kf, qs);
    } else {
      MmaSharedTilesByTileT<kD, kN, T, 1>(reinterpret_cast<float(*)[kN / 8][4]>(st), ks, qs);
    }
    MmaRowsByTileT<kD, kN, T>(dpt, vf, gs);  // dP^T = V dout^T
    auto grads = [&](auto masking) {
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int col = 8 * j + 2 * pair + i % 2;
          const int64_t query = i0 + col;
          const bool masked = decltype(masking)::value && Hidden(query, keys[i / 2], s, causal);
          const float p =
              masked ? 0.0f
                     : Exp2Ftz(Base2Score(st[j][i], scale2, extra, slope, h, s, query, keys[i / 2]) -
                               tile_lse2[b][col]);
          st[j][i] = p;
          dpt[j][i] = p * (dpt[j][i] - tile_delta[b][col]);
          if (kDq && extra.dbias != nullptr && !masked) {  // else the dq kernel's
            extra.dbias[((bi * hq + h) * s + query) * s + keys[i / 2]] = dpt[j][i];
          }
        }
      }
    };
    if (TileUnmasked(i0, kN, key0, kMmaRows, s, causal)) {
      grads(std::false_type{});
    } else {
      grads(std::true_type{});
    }
    MmaAccByTile<kD, kN, T>(dv_acc, st, gs);   // dV += P^T dout
    MmaAccByTile<kD, kN, T>(dk_acc, dpt, qs);  // dK += dS^T Q (rounds dS^T in place)
    if constexpr (kDq) {
      // dS^T, rounded, to ds[key][query]: this warp's 16 keys.
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint16_t* pair_of = &ds[16 * warp + group + 8 * r][8 * j + 2 * pair];  // 4-byte aligned: one store
          pair_of[0] = BitsOf<T>(dpt[j][2 * r]);
          pair_of[1] = BitsOf<T>(dpt[j][2 * r + 1]);
        }
      }
      __syncthreads();  // every warp's dS^T
      // dQ[row tile qt, chunk c0 + c] += dS (16 queries x the 64 keys) K, a
      // 16-column chunk at a time (8 accumulators: the registers are dk's and
      // dv's), added to dq_acc as soon as it is done: dS read transposed from
      // ds, K (a row-major k x n operand) from ks.
      const int qt = warp % kRowTiles, c0 = (warp / kRowTiles) * kPer;
      const int64_t query_rows[2] = {i0 + 16 * qt + group, i0 + 16 * qt + group + 8};
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        if (kChunks % kSplit == 0 || c0 + c < kChunks) {  // warp-uniform; always where the chunks divide
          const int col0 = 16 * (c0 + c);
          float acc[2][4] = {};
#pragma unroll
          for (int kk = 0; kk < kMmaRows / 16; ++kk) {
            uint32_t a[4], bf[4];
            LdMatrixX4Trans(a, &ds[16 * kk + lane % 8 + 8 * (lane / 16)][16 * qt + 8 * ((lane / 8) % 2)]);
            LdMatrixX4Trans(bf, &ks[16 * kk + lane % 16][col0 + 8 * (lane / 16)]);
            MmaOf<T>(acc[0], a, bf, acc[0]);
            MmaOf<T>(acc[1], a, bf + 2, acc[1]);
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (query_rows[r] >= s) continue;
            float* row = dq_acc + ((bi * s + query_rows[r]) * hq + h) * kD + col0 + 2 * pair;
            RedAddF32x2(row, acc[0][2 * r], acc[0][2 * r + 1]);
            RedAddF32x2(row + 8, acc[1][2 * r], acc[1][2 * r + 1]);
          }
        }
      }
    }
  }
  const int64_t dkvoff = HeadBase(layout.dkv, bi, s, kvh);
  StoreRows<kD>(dk + dkvoff, layout.dkv.token, key0, s, dk_acc, scale);
  StoreRows<kD>(dv + dkvoff, layout.dkv.token, key0, s, dv_acc, 1.0f);
}

// Grid (row blocks, hq, b): dq of each query row, over the key tiles; writes
// delta = rowsum(dout * out) for the dk/dv kernel that follows in the stream.
template <int kD, typename T>
__global__ void FlashBackwardDqKernel(In<T> q, In<T> k, In<T> v, In<T> out, In<T> dout, const float* lse, float* delta,
                                      Out<T> dq, int64_t s, int64_t hq, int64_t hkv, int d, float scale,
                                      bool causal, AttentionBias extra, AttentionLayout layout) {
  constexpr int kT = kAttnTile<kD>;
  __shared__ float ks[kT][kD];
  __shared__ float vs[kT][kD];
  const int64_t h = blockIdx.y, bi = blockIdx.z, kvh = h / (hq / hkv);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kAttnRows + threadIdx.x;
  const bool active = i < s;
  const int64_t row = (bi * s + i) * hq + h;
  const int64_t qrow = HeadBase(layout.q, bi, s, h) + i * layout.q.token;
  float qi[kD], doi[kD], dqi[kD];
  float di = 0.0f;
#pragma unroll
  for (int c = 0; c < kD; ++c) {
    qi[c] = (active && c < d) ? q[qrow + c] : 0.0f;
    doi[c] = (active && c < d) ? dout[row * d + c] : 0.0f;
    di += (active && c < d) ? doi[c] * out[row * d + c] : 0.0f;
    dqi[c] = 0.0f;
  }
  const float li = active ? lse[(bi * hq + h) * s + i] : 0.0f;
  if (active) delta[(bi * hq + h) * s + i] = di;
  const float slope = SlopeOf(extra, h);
  ForEachVisibleKey<kD, kT, T>(ks, vs, k, v, bi, kvh, layout.kv, i, s, d, causal, active, [&](int r, int64_t j) {
    float sc = 0.0f, dp = 0.0f;
#pragma unroll
    for (int c = 0; c < kD; ++c) {
      sc += qi[c] * ks[r][c];
      dp += doi[c] * vs[r][c];
    }
    const float ds = expf(scale * sc + AddedScore(extra, slope, h, s, i, j) - li) * (dp - di);
    if (extra.dbias != nullptr) extra.dbias[((bi * hq + h) * s + i) * s + j] = ds;
#pragma unroll
    for (int c = 0; c < kD; ++c) dqi[c] += ds * ks[r][c];
  });
  if (active) {
#pragma unroll
    for (int c = 0; c < kD; ++c) {
      if (c < d) dq[HeadBase(layout.dq, bi, s, h) + i * layout.dq.token + c] = dqi[c] * scale;
    }
  }
}

// Grid (row blocks, hkv, b): dk and dv of each key row, over the query tiles
// of every query head of its kv head, in a fixed order.
template <int kD, typename T>
__global__ void FlashBackwardDkvKernel(In<T> q, In<T> k, In<T> v, In<T> dout, const float* lse, const float* delta,
                                       Out<T> dk, Out<T> dv, int64_t s, int64_t hq, int64_t hkv, int d, float scale,
                                       bool causal, AttentionBias extra, AttentionLayout layout) {
  constexpr int kT = kAttnTile<kD>;
  __shared__ float qs[kT][kD];
  __shared__ float dos[kT][kD];
  __shared__ float ls[kT];
  __shared__ float deltas[kT];
  const int64_t kvh = blockIdx.y, bi = blockIdx.z, group = hq / hkv;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kAttnRows + threadIdx.x;
  const bool active = j < s;
  const int64_t krow = HeadBase(layout.kv, bi, s, kvh) + j * layout.kv.token;
  float kj[kD], vj[kD], dkj[kD], dvj[kD];
#pragma unroll
  for (int c = 0; c < kD; ++c) {
    kj[c] = (active && c < d) ? k[krow + c] : 0.0f;
    vj[c] = (active && c < d) ? v[krow + c] : 0.0f;
    dkj[c] = 0.0f;
    dvj[c] = 0.0f;
  }
  // Causal: queries before the block's first key see none of its keys.
  const int64_t first = causal ? static_cast<int64_t>(blockIdx.x) * kAttnRows : 0;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    const In<T> qb = q + HeadBase(layout.q, bi, s, h);
    const In<T> dob = dout + (bi * s * hq + h) * d;
    const float* lb = lse + (bi * hq + h) * s;
    const float* db = delta + (bi * hq + h) * s;
    const float slope = SlopeOf(extra, h);
    for (int64_t i0 = first; i0 < s; i0 += kT) {
      StageRows<kD, kT>(qs, qb, layout.q.token, i0, s, d);
      StageRows<kD, kT>(dos, dob, hq * d, i0, s, d);
      for (int t = threadIdx.x; t < kT; t += blockDim.x) {
        ls[t] = i0 + t < s ? lb[i0 + t] : 0.0f;
        deltas[t] = i0 + t < s ? db[i0 + t] : 0.0f;
      }
      __syncthreads();
      const int64_t n = s - i0 < kT ? s - i0 : kT;
      for (int r = 0; active && r < n; ++r) {
        if (causal && i0 + r < j) continue;
        float sc = 0.0f, dp = 0.0f;
#pragma unroll
        for (int c = 0; c < kD; ++c) {
          sc += qs[r][c] * kj[c];
          dp += dos[r][c] * vj[c];
        }
        const float p = expf(scale * sc + AddedScore(extra, slope, h, s, i0 + r, j) - ls[r]);
        const float ds = p * (dp - deltas[r]);
#pragma unroll
        for (int c = 0; c < kD; ++c) {
          dvj[c] += p * dos[r][c];
          dkj[c] += ds * qs[r][c];
        }
      }
      __syncthreads();
    }
  }
  if (active) {
#pragma unroll
    for (int c = 0; c < kD; ++c) {
      if (c < d) {
        const int64_t at = HeadBase(layout.dkv, bi, s, kvh) + j * layout.dkv.token + c;
        dk[at] = dkj[c] * scale;
        dv[at] = dvj[c];
      }
    }
  }
}

// fn(std::integral_constant<int, kD>) for the smallest instantiation >= d.
template <typename Fn>
absl::Status ByHeadDim(int64_t d, Fn fn) {
  if (d <= 16) return fn(std::integral_constant<int, 16>{});
  if (d <= 32) return fn(std::integral_constant<int, 32>{});
  if (d <= 64) return fn(std::integral_constant<int, 64>{});
  if (d <= 128) return fn(std::integral_constant<int, 128>{});
  return fn(std::integral_constant<int, 256>{});
}

// The most batch elements one launch of the attention kernels takes (the
// grid's z); FlashAttention and FlashAttentionBackward run a larger batch
// in parts of at most this many.
constexpr int64_t kMaxAttnBatch = 65535;

// The launch grid of the attention kernels, after checking the sizes.
absl::StatusOr<dim3> AttnGrid(int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, const char* op) {
  if (hkv < 1 || hq % hkv != 0 || d < 1 || d > kMaxFusedHeadDim) {
    return absl::InvalidArgumentError(std::string(op) + ": " + std::to_string(hq) + " query heads over " +
                                      std::to_string(hkv) + " kv heads of dim " + std::to_string(d) +
                                      " (at most " + std::to_string(kMaxFusedHeadDim) + ")");
  }
  const int64_t blocks = (s + kAttnRows - 1) / kAttnRows;
  if (blocks > 0x7fffffff || hq > 65535 || b > kMaxAttnBatch) {
    return absl::InvalidArgumentError(std::string(op) + ": batch " + std::to_string(b) + ", " + std::to_string(hq) +
                                      " heads or sequence " + std::to_string(s) + " exceed the launch grid");
  }
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(hq), static_cast<unsigned>(b));
}

// One cuBLAS handle per device for the whole process (a thread_local one
// leaked a handle and its workspace per job thread), bound to the device's
// compute stream, and destroyed at exit. `mu` serializes the enqueues on a
// handle (a cuBLAS handle is not thread-safe); the GEMMs run in stream order.
// A std::mutex, as everywhere in kernels/cuda: ThreadSanitizer (the
// emulation under --config=cuda-emu-tsan) sees pthread locks, not Debian's uninstrumented
// absl::Mutex, and reported the map read after another thread's insert.
struct CublasHandles {
  std::mutex mu;
  std::map<int, cublasHandle_t> by_device ABSL_GUARDED_BY(mu);
  std::map<int, bool> allow_tf32 ABSL_GUARDED_BY(mu);  // SetAllowTf32, per device
  ~CublasHandles() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [device, h] : by_device) {
      if (cudaSetDevice(device) == cudaSuccess) cublasDestroy(h);  // a driver already gone only fails here
    }
  }
};

CublasHandles& Handles() {
  static CublasHandles handles;  // destroyed at exit
  return handles;
}

// The device's handle; creates it on first use. Requires Handles().mu.
absl::StatusOr<cublasHandle_t> HandleLocked(CublasHandles& handles, int device, cudaStream_t stream)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(handles.mu) {
  auto it = handles.by_device.find(device);
  if (it != handles.by_device.end()) return it->second;
  cublasHandle_t h = nullptr;
  RETURN_IF(CublasCheck(cublasCreate(&h), "cublasCreate"));
  // TF32 is chosen per call, by the compute type (SetAllowTf32).
  absl::Status s = CublasCheck(cublasSetStream(h, stream), "cublasSetStream");
  if (s.ok()) s.Update(CublasCheck(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  if (!s.ok()) {
    cublasDestroy(h);
    return s;
  }
  handles.by_device[device] = h;
  return h;
}

cudaDataType_t CudaType(ElemType t) {
  switch (t) {
    case ElemType::kBF16: return CUDA_R_16BF;
    case ElemType::kF16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

}  // namespace

namespace {

// Every GEMM's checks (GemmEx's and cuBLASLt's), as the CPU twin's
// CheckGemm: a float type, and dimensions cuBLAS's ints hold.
absl::Status CheckGemm(ElemType type, int64_t m, int64_t n, int64_t k, const char* op) {
  if (type != ElemType::kF32 && type != ElemType::kBF16 && type != ElemType::kF16) {
    return absl::InvalidArgumentError(std::string(op) + ": f32, bf16 or f16 only");
  }
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return absl::InvalidArgumentError(std::string(op) + ": [" + std::to_string(m) + ", " + std::to_string(k) +
                                      "] @ [" + std::to_string(k) + ", " + std::to_string(n) +
                                      "] exceeds cuBLAS's int dimensions");
  }
  return absl::OkStatus();
}

// Row-major C (c_type: `type`, or f32) = op(A) op(B) + beta C, A and B of
// `type`, on cuBLAS with f32 accumulation.
absl::Status GemmEx(int device, ElemType type, ElemType c_type, float beta, bool trans_a, bool trans_b, int64_t m,
                    int64_t n, int64_t k, const void* a, const void* b, void* c) {
  RETURN_IF(CheckGemm(type, m, n, k, "Gemm"));
  if (m == 0 || n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  const float one = 1.0f;
  const int lda = static_cast<int>(trans_a ? m : k), ldb = static_cast<int>(trans_b ? k : n);
  {
    CublasHandles& handles = Handles();
    std::lock_guard<std::mutex> lock(handles.mu);  // held for the enqueue only, not for the GEMM
    absl::StatusOr<cublasHandle_t> h = HandleLocked(handles, device, stream);
    if (!h.ok()) return h.status();
    const auto tf32 = handles.allow_tf32.find(device);
    const cublasComputeType_t compute = type == ElemType::kF32 && tf32 != handles.allow_tf32.end() && tf32->second
                                            ? CUBLAS_COMPUTE_32F_FAST_TF32
                                            : CUBLAS_COMPUTE_32F;
    RETURN_IF(CublasCheck(
        cublasGemmEx(*h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                     static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one, b, CudaType(type), ldb, a,
                     CudaType(type), lda, &beta, c, CudaType(c_type), static_cast<int>(n), compute,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx"));
  }
  return Finish("cublasGemmEx");
}

}  // namespace

absl::Status Gemm(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  const void* a, const void* b, void* c) {
  return GemmEx(device, type, type, 0.0f, trans_a, trans_b, m, n, k, a, b, c);
}

absl::Status GemmF32Out(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                        const void* a, const void* b, float* c, bool accumulate) {
  return GemmEx(device, type, ElemType::kF32, accumulate ? 1.0f : 0.0f, trans_a, trans_b, m, n, k, a, b, c);
}

absl::Status SetAllowTf32(int device, bool allow) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return absl::InvalidArgumentError("SetAllowTf32: no CUDA device " + std::to_string(device));
  }
  CublasHandles& handles = Handles();
  std::lock_guard<std::mutex> lock(handles.mu);
  handles.allow_tf32[device] = allow;
  return absl::OkStatus();
}

// ---- GEMMs with the bias in cuBLASLt's epilogue ----
namespace {

// Whether GemmBias and GemmBiasGrad put the bias (its add, its gradient) in
// the GEMM's epilogue: yes unless COLOD_GEMM_EPILOGUES=0, read at each call,
// which runs them as the GEMM and the bias kernel apart (bench:layers's A/B
// rows; the same values up to the one rounding the fused add saves).
bool EpiloguesFromEnv() {
  const char* v = getenv("COLOD_GEMM_EPILOGUES");
  return v == nullptr || std::string_view(v) != "0";
}

// The largest power of two up to 256 that divides p's address: what
// cuBLASLt's heuristic is told of each operand (it assumes 256 bytes unless
// told less, and an algorithm chosen for more would fault).
uint32_t Alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// A cuBLASLt problem: the algorithm its heuristic chose depends on nothing
// else.
struct LtKey {
  int device;
  ElemType type;
  bool trans_a, trans_b;
  int64_t m, n, k;
  uint32_t epilogue;
  uint32_t align[5];  // A, B, C (= D), the vector, the auxiliary output
  bool operator<(const LtKey& o) const {
    return std::tie(device, type, trans_a, trans_b, m, n, k, epilogue, align[0], align[1], align[2], align[3],
                    align[4]) < std::tie(o.device, o.type, o.trans_a, o.trans_b, o.m, o.n, o.k, o.epilogue,
                                         o.align[0], o.align[1], o.align[2], o.align[3], o.align[4]);
  }
};

// cuBLASLt's state for the process: a handle and a workspace per device (8
// MiB of cudaMalloc, outside the pool, as cuBLAS keeps its own; none where
// that failed), and the heuristic's algorithm per problem (none where it
// found none or cuBLASLt refused the call: those GEMMs run unfused), so that
// a step asks the heuristic nothing after its first. `mu` serializes the
// enqueues as Handles().mu does cuBLAS's; the workspace is used by the
// device's compute stream alone, in stream order.
constexpr size_t kLtWorkspaceBytes = size_t{8} << 20;
constexpr size_t kLtMaxAlgos = 4096;  // problems remembered; a job has a few dozen

struct LtState {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles ABSL_GUARDED_BY(mu);
  std::map<int, std::pair<void*, size_t>> workspaces ABSL_GUARDED_BY(mu);
  std::map<LtKey, std::optional<cublasLtMatmulAlgo_t>> algos ABSL_GUARDED_BY(mu);
  ~LtState() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [device, h] : handles) {
      if (cudaSetDevice(device) != cudaSuccess) continue;  // a driver already gone only fails here
      cublasLtDestroy(h);
      auto w = workspaces.find(device);
      if (w != workspaces.end() && w->second.first != nullptr) cudaFree(w->second.first);
    }
  }
};

LtState& Lt() {
  static LtState state;  // destroyed at exit
  return state;
}

// The descriptors of one cuBLASLt call, destroyed with it.
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c}) {
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    }
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

// Row-major C [m, n] = op(A) op(B) of `type` with `epilogue` (BIAS: `vector`
// [n] added; GELU_AUX_BIAS: that, then GELU, `aux` [m, n] <- GELU's input;
// DGELU: times GELU's slope at `aux` [m, n], no vector; BGRADB: `vector`
// [m] <- op(A)'s row sums), enqueued on the device's
// compute stream. false, with nothing enqueued, where cuBLASLt has no
// algorithm for the problem (the caller runs it unfused).
absl::StatusOr<bool> LtGemm(int device, cudaStream_t stream, ElemType type, bool trans_a, bool trans_b, int64_t m,
                            int64_t n, int64_t k, const void* a, const void* b, void* c, cublasLtEpilogue_t epilogue,
                            const void* vector, void* aux = nullptr) {
  // Column-major C^T [n, m] = op(B)^T op(A)^T: cuBLASLt's A is our b, its B
  // our a, stored as the transposes of our row-major operands.
  const LtKey key{device,       type, trans_a, trans_b, m, n, k, static_cast<uint32_t>(epilogue),
                  {Alignment(b), Alignment(a), Alignment(c), Alignment(vector), Alignment(aux)}};
  const cudaDataType_t t = CudaType(type);
  LtCall call;
  RETURN_IF(CublasCheck(cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                        "cublasLtMatmulDescCreate"));
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint32_t epi = epilogue;
  RETURN_IF(CublasCheck(cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
                        "cublasLtMatmulDescSetAttribute"));
  RETURN_IF(CublasCheck(cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
                        "cublasLtMatmulDescSetAttribute"));
  RETURN_IF(CublasCheck(cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi),
                        "cublasLtMatmulDescSetAttribute"));
  RETURN_IF(CublasCheck(
      cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vector, sizeof vector),
      "cublasLtMatmulDescSetAttribute"));
  if (aux != nullptr) {  // GELU's input, laid out as C (written by GELU_AUX_BIAS, read by DGELU)
    const int64_t aux_ld = n;
    RETURN_IF(CublasCheck(
        cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
        "cublasLtMatmulDescSetAttribute"));
    RETURN_IF(CublasCheck(
        cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld),
        "cublasLtMatmulDescSetAttribute"));
  }
  const uint64_t a_rows = static_cast<uint64_t>(trans_b ? k : n), a_cols = static_cast<uint64_t>(trans_b ? n : k);
  const uint64_t b_rows = static_cast<uint64_t>(trans_a ? m : k), b_cols = static_cast<uint64_t>(trans_a ? k : m);
  RETURN_IF(CublasCheck(cublasLtMatrixLayoutCreate(&call.a, t, a_rows, a_cols, static_cast<int64_t>(a_rows)),
                        "cublasLtMatrixLayoutCreate"));
  RETURN_IF(CublasCheck(cublasLtMatrixLayoutCreate(&call.b, t, b_rows, b_cols, static_cast<int64_t>(b_rows)),
                        "cublasLtMatrixLayoutCreate"));
  RETURN_IF(CublasCheck(cublasLtMatrixLayoutCreate(&call.c, t, static_cast<uint64_t>(n), static_cast<uint64_t>(m), n),
                        "cublasLtMatrixLayoutCreate"));
  const float one = 1.0f, zero = 0.0f;
  LtState& lt = Lt();
  std::lock_guard<std::mutex> lock(lt.mu);  // held for the enqueue only, not for the GEMM
  auto h = lt.handles.find(device);
  if (h == lt.handles.end()) {
    cublasLtHandle_t handle = nullptr;
    RETURN_IF(CublasCheck(cublasLtCreate(&handle), "cublasLtCreate"));
    void* workspace = nullptr;
    if (cudaMalloc(&workspace, kLtWorkspaceBytes) == cudaSuccess) {
      lt.workspaces[device] = {workspace, kLtWorkspaceBytes};
    } else {
      (void)cudaGetLastError();  // a full device: the algorithms that need no workspace
      lt.workspaces[device] = {nullptr, 0};
    }
    h = lt.handles.emplace(device, handle).first;
  }
  const auto [workspace, workspace_bytes] = lt.workspaces[device];
  auto found = lt.algos.find(key);
  if (found == lt.algos.end()) {
    RETURN_IF(CublasCheck(cublasLtMatmulPreferenceCreate(&call.pref), "cublasLtMatmulPreferenceCreate"));
    const uint64_t bytes = workspace_bytes;
    RETURN_IF(CublasCheck(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &bytes, sizeof bytes),
                          "cublasLtMatmulPreferenceSetAttribute"));
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      const uint32_t align = key.align[i < 3 ? i : 2];  // D is C
      RETURN_IF(CublasCheck(cublasLtMatmulPreferenceSetAttribute(call.pref, aligns[i], &align, sizeof align),
                            "cublasLtMatmulPreferenceSetAttribute"));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h->second, call.desc, call.a, call.b, call.c, call.c,
                                                             call.pref, 1, &result, &count);
    // Whatever the heuristic answers short of an algorithm (no algorithm,
    // NOT_SUPPORTED, INVALID_VALUE for a rule of cuBLASLt's not modelled
    // here), the problem runs unfused.
    std::optional<cublasLtMatmulAlgo_t> algo;
    if (st == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
        result.workspaceSize <= workspace_bytes) {
      algo = result.algo;
    }
    if (lt.algos.size() >= kLtMaxAlgos) lt.algos.clear();
    found = lt.algos.emplace(key, algo).first;
  }
  if (!found->second.has_value()) return false;
  const cublasStatus_t st = cublasLtMatmul(h->second, call.desc, &one, b, call.a, a, call.b, &zero, c, call.c, c,
                                           call.c, &*found->second, workspace, workspace_bytes, stream);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    found->second.reset();  // refused before anything ran: unfused from now on
    return false;
  }
  RETURN_IF(CublasCheck(st, "cublasLtMatmul"));
  RETURN_IF(Finish("cublasLtMatmul"));
  return true;
}

// Whether the f32 GEMMs of `device` run in TF32 (SetAllowTf32): cuBLASLt's
// calls above compute in f32, so those GEMMs take cuBLAS's path.
bool Tf32Allowed(int device) {
  CublasHandles& handles = Handles();
  std::lock_guard<std::mutex> lock(handles.mu);
  const auto it = handles.allow_tf32.find(device);
  return it != handles.allow_tf32.end() && it->second;
}

// Whether a GEMM of `type` on `device` asks cuBLASLt for its epilogue: the
// switch is on and the GEMM computes in f32 or its half type, not TF32.
bool TryEpilogue(int device, ElemType type) {
  return EpiloguesFromEnv() && !(type == ElemType::kF32 && Tf32Allowed(device));
}

}  // namespace

bool GemmEpilogues(int) { return EpiloguesFromEnv(); }

absl::Status GemmBias(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                      const void* a, const void* b, const void* bias, void* c) {
  RETURN_IF(CheckGemm(type, m, n, k, "GemmBias"));
  if (m == 0 || n == 0) return absl::OkStatus();
  if (k > 0 && TryEpilogue(device, type)) {
    COLOD_CUDA_BEGIN(stream, device);
    absl::StatusOr<bool> fused =
        LtGemm(device, stream, type, trans_a, trans_b, m, n, k, a, b, c, CUBLASLT_EPILOGUE_BIAS, bias);
    if (!fused.ok()) return fused.status();
    if (*fused) return absl::OkStatus();
  }
  RETURN_IF(Gemm(device, type, trans_a, trans_b, m, n, k, a, b, c));
  return BiasAdd(device, type, c, bias, c, m, n);
}

absl::Status GemmBiasGelu(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          const void* a, const void* b, const void* bias, void* c, void* pre) {
  RETURN_IF(CheckGemm(type, m, n, k, "GemmBiasGelu"));
  if (m == 0 || n == 0) return absl::OkStatus();
  // cuBLASLt's auxiliary output needs a leading dimension divisible by 8.
  if (k > 0 && n % 8 == 0 && TryEpilogue(device, type)) {
    COLOD_CUDA_BEGIN(stream, device);
    absl::StatusOr<bool> fused =
        LtGemm(device, stream, type, trans_a, trans_b, m, n, k, a, b, c, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre);
    if (!fused.ok()) return fused.status();
    if (*fused) return absl::OkStatus();
  }
  // Apart: pre = the product plus the bias, then c = GELU(pre).
  RETURN_IF(GemmBias(device, type, trans_a, trans_b, m, n, k, a, b, bias, pre));
  return Gelu(device, type, pre, nullptr, c, m, n, /*tanh_approx=*/true);
}

absl::Status GemmDGelu(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                       const void* a, const void* b, const void* pre, void* c) {
  RETURN_IF(CheckGemm(type, m, n, k, "GemmDGelu"));
  if (m == 0 || n == 0) return absl::OkStatus();
  // GELU's input as the auxiliary input: a leading dimension divisible by 8,
  // as GemmBiasGelu's output.
  if (k > 0 && n % 8 == 0 && TryEpilogue(device, type)) {
    COLOD_CUDA_BEGIN(stream, device);
    absl::StatusOr<bool> fused = LtGemm(device, stream, type, trans_a, trans_b, m, n, k, a, b, c,
                                        CUBLASLT_EPILOGUE_DGELU, /*vector=*/nullptr, const_cast<void*>(pre));
    if (!fused.ok()) return fused.status();
    if (*fused) return absl::OkStatus();
  }
  // Apart: the product rounded to `type`, then GELU's backward over it in
  // place.
  RETURN_IF(Gemm(device, type, trans_a, trans_b, m, n, k, a, b, c));
  return GeluBackward(device, type, c, pre, /*bias=*/nullptr, c, /*db=*/nullptr, 1, m * n, /*tanh_approx=*/true);
}

absl::Status GemmBiasGrad(int device, ElemType type, int64_t m, int64_t n, int64_t k, const void* dy, const void* x,
                          void* dw, void* db) {
  RETURN_IF(CheckGemm(type, m, n, k, "GemmBiasGrad"));
  if (m > 0 && n > 0 && k > 0 && TryEpilogue(device, type)) {
    COLOD_CUDA_BEGIN(stream, device);
    // dw^T = x^T dy in cuBLASLt's terms: its B is dy, whose sums over k are
    // BGRADB's.
    absl::StatusOr<bool> fused = LtGemm(device, stream, type, /*trans_a=*/true, /*trans_b=*/false, m, n, k, dy, x, dw,
                                        CUBLASLT_EPILOGUE_BGRADB, db);
    if (!fused.ok()) return fused.status();
    if (*fused) return absl::OkStatus();
  }
  RETURN_IF(Gemm(device, type, /*trans_a=*/true, /*trans_b=*/false, m, n, k, dy, x, dw));
  return BiasGrad(device, type, dy, db, k, m);
}

absl::Status BiasAdd(int device, ElemType type, const void* x, const void* bias, void* out, int64_t rows,
                     int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "BiasAdd", [&](auto t) {
    using T = decltype(t);
    if (PackedRows<T>(stream, BiasAddOp{}, x, nullptr, bias, out, rows * n, n)) return Finish("PackedRowsKernel");
    Launch(BiasAddKernel<T>, Blocks(rows * n), kThreads, stream, InOf<T>(x), InOf<T>(bias), OutOf<T>(out), rows * n,
           n);
    return Finish("BiasAddKernel");
  });
}

// Launches a column reduction over [rows, n] of T of `values` sums per
// column: launch(kP, grid, chunk_rows, scratch), kP a std::integral_constant
// of the column group's width (kPack<T> where `packed`, else 1), on the grid
// of ColumnSumKernel's comment, with its scratch allocated and the counters
// zeroed before, and freed after it in stream order (the pool's blocks are
// reused from the second step on).
template <typename T, typename LaunchFn>
absl::Status ColumnReduce(cudaStream_t stream, int64_t rows, int64_t n, int values, bool packed, const char* name,
                          LaunchFn launch) {
  const int64_t pack = packed ? kPack<T> : 1;
  const unsigned x = ColumnBlocks(n / pack);
  const int64_t min_rows = packed ? kPackedMinChunkRows : kColumnMinChunkRows;
  int64_t chunks = (rows + min_rows - 1) / min_rows;
  const int64_t fill = (kColumnTargetBlocks + x - 1) / x;
  if (chunks > fill) chunks = fill;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  const int64_t chunk_rows = chunks == 1 ? rows : (rows + chunks - 1) / chunks;
  if (chunks > 1) chunks = (rows + chunk_rows - 1) / chunk_rows;  // none empty
  ColumnScratch scratch;
  if (chunks > 1) {
    // chunks <= (rows + 63) / 64 and n * rows elements exist: no overflow.
    RETURN_IF(CudaCheck(cudaMallocAsync(reinterpret_cast<void**>(&scratch.partials),
                                        static_cast<size_t>(values * chunks * n) * sizeof(double), stream),
                        "cudaMallocAsync"));
    absl::Status s = CudaCheck(cudaMallocAsync(reinterpret_cast<void**>(&scratch.done), x * sizeof(unsigned), stream),
                               "cudaMallocAsync");
    if (s.ok()) s.Update(CudaCheck(cudaMemsetAsync(scratch.done, 0, x * sizeof(unsigned), stream), "cudaMemsetAsync"));
    if (!s.ok()) {
      cudaFreeAsync(scratch.partials, stream);
      if (scratch.done != nullptr) cudaFreeAsync(scratch.done, stream);
      return s;
    }
  }
  const dim3 grid(x, static_cast<unsigned>(chunks));
  if (packed) {
    launch(std::integral_constant<int, kPack<T>>{}, grid, chunk_rows, scratch);
  } else {
    launch(std::integral_constant<int, 1>{}, grid, chunk_rows, scratch);
  }
  absl::Status s = Finish(name);
  if (chunks > 1) {  // after the kernel, in stream order
    cudaFreeAsync(scratch.partials, stream);
    cudaFreeAsync(scratch.done, stream);
  }
  return s;
}

absl::Status BiasGrad(int device, ElemType type, const void* dy, void* db, int64_t rows, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "BiasGrad", [&](auto t) {
    using T = decltype(t);
    return ColumnReduce<T>(stream, rows, n, 1, Packable<T>(n, {dy}), "ColumnSumKernel",
                           [&](auto p, dim3 grid, int64_t chunk_rows, ColumnScratch s) {
                             Launch(ColumnSumKernel<T, decltype(p)::value>, grid, kThreads, stream, InOf<T>(dy),
                                    OutOf<T>(db), rows, n, chunk_rows, s);
                           });
  });
}

absl::Status Gelu(int device, ElemType type, const void* x, const void* bias, void* y, int64_t rows, int64_t n,
                  bool tanh_approx) {
  if (rows * n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "Gelu", [&](auto t) {
    using T = decltype(t);
    if (PackedRows<T>(stream, GeluOp{bias != nullptr, tanh_approx}, x, nullptr, bias, y, rows * n, n)) {
      return Finish("PackedRowsKernel");
    }
    Launch(GeluKernel<T>, Blocks(rows * n), kThreads, stream, InOf<T>(x), InOf<T>(bias), OutOf<T>(y), rows * n, n,
           tanh_approx);
    return Finish("GeluKernel");
  });
}

absl::Status GeluBackward(int device, ElemType type, const void* dy, const void* x, const void* bias, void* dx,
                          void* db, int64_t rows, int64_t n, bool tanh_approx) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "GeluBackward", [&](auto t) {
    using T = decltype(t);
    if (db != nullptr) {
      return ColumnReduce<T>(stream, rows, n, 1, Packable<T>(n, {dy, x, bias, dx}), "GeluBackwardBiasKernel",
                             [&](auto p, dim3 grid, int64_t chunk_rows, ColumnScratch s) {
                               Launch(GeluBackwardBiasKernel<T, decltype(p)::value>, grid, kThreads, stream,
                                      InOf<T>(dy), InOf<T>(x), InOf<T>(bias), OutOf<T>(dx), OutOf<T>(db), rows, n,
                                      tanh_approx, chunk_rows, s);
                             });
    }
    if (rows == 0) return absl::OkStatus();
    if (PackedRows<T>(stream, GeluBackwardOp{bias != nullptr, tanh_approx}, x, dy, bias, dx, rows * n, n)) {
      return Finish("PackedRowsKernel");
    }
    Launch(GeluBackwardKernel<T>, Blocks(rows * n), kThreads, stream, InOf<T>(dy), InOf<T>(x), InOf<T>(bias),
           OutOf<T>(dx), rows * n, n, tanh_approx);
    return Finish("GeluBackwardKernel");
  });
}

absl::Status Activation(int device, ElemType type, ActivationKind kind, const void* x, void* y, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "Activation", [&](auto t) {
    using T = decltype(t);
    Launch(ActivationKernel<T>, Blocks(n), kThreads, stream, kind, InOf<T>(x), OutOf<T>(y), n);
    return Finish("ActivationKernel");
  });
}

absl::Status ActivationBackward(int device, ElemType type, ActivationKind kind, const void* dy, const void* x,
                                void* dx, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "ActivationBackward", [&](auto t) {
    using T = decltype(t);
    Launch(ActivationBackwardKernel<T>, Blocks(n), kThreads, stream, kind, InOf<T>(dy), InOf<T>(x), OutOf<T>(dx),
           n);
    return Finish("ActivationBackwardKernel");
  });
}

absl::Status LayerNorm(int device, ElemType type, const void* x, const void* residual, const void* g, const void* b,
                       float eps, void* y, void* sum, float* mean, float* rstd, int64_t rows, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "LayerNorm", [&](auto t) {
    using T = decltype(t);
    if (Packable<T>(n, {x, residual, g, b, y, sum})) {
      Launch(LayerNormWarpKernel<T>, WarpRowBlocks(rows), kThreads, stream, static_cast<const T*>(x),
             static_cast<const T*>(residual), static_cast<const T*>(g), static_cast<const T*>(b), eps,
             static_cast<T*>(y), static_cast<T*>(sum), mean, rstd, rows, n);
      return Finish("LayerNormWarpKernel");
    }
    Launch(LayerNormKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(x), InOf<T>(residual), InOf<T>(g),
           InOf<T>(b), eps, OutOf<T>(y), OutOf<T>(sum), mean, rstd, rows, n);
    return Finish("LayerNormKernel");
  });
}

// NormBackwardFoldedKernel's dynamic shared memory: at most 16 KiB and 16
// bytes (n <= 1024 for LayerNorm's two sums, 2048 for RMSNorm's one:
// FoldedNormBackward).
size_t FoldedNormShared(int64_t values, int64_t n) { return 16 + static_cast<size_t>(values * n) * sizeof(double); }

// NormBackwardFoldedKernel's rows a block (4 a warp) and its most blocks
// (rows beyond give a block more; the second level's groups are then 32).
constexpr int64_t kFoldedChunkRows = 4 * kWarpRows;
constexpr int64_t kFoldedMaxBlocks = 1024;

// Runs NormBackwardFoldedKernel (kLayer: LayerNorm's, else RMSNorm's) and
// returns true where a row's sums fit its lanes' registers, 64 f32 a lane
// (LayerNorm's two sums of rows up to 1024 elements, RMSNorm's one of rows
// up to 2048, in any type: GPT-2's and LLaMA 1B's rows), with its scratch
// allocated and the counters zeroed before, and freed after it in stream
// order; false, launching nothing, where they do not. dx, dy, x and g are
// packable; acc is packable or null.
template <typename T, bool kLayer>
absl::StatusOr<bool> FoldedNormBackward(cudaStream_t stream, const void* dy, const void* x, const void* g,
                                        const float* mean, const float* rstd, const T* acc, void* dx, void* dg,
                                        void* db, int64_t rows, int64_t n) {
  constexpr int64_t kMaxLanePacks = 64 / ((kLayer ? 2 : 1) * kPack<T>);  // 4, 8 or 16
  const int64_t lane_packs = (n / kPack<T> + 31) / 32;
  if (lane_packs > kMaxLanePacks) return false;
  int64_t chunk = kFoldedChunkRows;
  if (rows > chunk * kFoldedMaxBlocks) chunk = (rows + kFoldedMaxBlocks - 1) / kFoldedMaxBlocks;
  const int64_t blocks = rows <= chunk ? 1 : (rows + chunk - 1) / chunk;
  FoldedNormScratch scratch;
  void* buffer = nullptr;
  if (blocks > 1) {
    while (scratch.group * scratch.group < blocks) ++scratch.group;
    const int64_t groups = (blocks + scratch.group - 1) / scratch.group;
    const int64_t cols = (kLayer ? 2 : 1) * n;  // n <= 2048: no overflow below
    const size_t sums = static_cast<size_t>(groups * cols) * sizeof(double);
    const size_t parts = (static_cast<size_t>(blocks * cols) * sizeof(float) + 7) / 8 * 8;
    const size_t done = static_cast<size_t>(groups + 1) * sizeof(unsigned);
    RETURN_IF(CudaCheck(cudaMallocAsync(&buffer, sums + parts + done, stream), "cudaMallocAsync"));
    char* base = static_cast<char*>(buffer);
    scratch.group_sums = reinterpret_cast<double*>(base);
    scratch.partials = reinterpret_cast<float*>(base + sums);
    scratch.done = reinterpret_cast<unsigned*>(base + sums + parts);
    if (absl::Status s = CudaCheck(cudaMemsetAsync(scratch.done, 0, done, stream), "cudaMemsetAsync"); !s.ok()) {
      cudaFreeAsync(buffer, stream);
      return s;
    }
  }
  auto launch = [&](auto lane_packs_c) {
    LaunchShared(NormBackwardFoldedKernel<T, kLayer, decltype(lane_packs_c)::value>, static_cast<unsigned>(blocks),
                 kThreads, FoldedNormShared(kLayer ? 2 : 1, n), stream, static_cast<const T*>(dy),
                 static_cast<const T*>(x), static_cast<const T*>(g), mean, rstd, acc, static_cast<T*>(dx),
                 static_cast<T*>(dg), static_cast<T*>(db), rows, n, chunk, scratch);
  };
  if (lane_packs <= 1) {
    launch(std::integral_constant<int, 1>{});
  } else if (lane_packs <= 2) {
    launch(std::integral_constant<int, 2>{});
  } else if (lane_packs <= 3) {  // GPT-2's 768 in bf16: fewer registers than 4
    launch(std::integral_constant<int, 3>{});
  } else if (lane_packs <= 4) {
    launch(std::integral_constant<int, 4>{});
  } else if constexpr (kMaxLanePacks >= 8) {
    if (lane_packs <= 8) {
      launch(std::integral_constant<int, 8>{});
    } else if constexpr (kMaxLanePacks >= 16) {
      launch(std::integral_constant<int, 16>{});
    }
  }
  absl::Status s = Finish("NormBackwardFoldedKernel");
  if (buffer != nullptr) cudaFreeAsync(buffer, stream);  // after the kernel, in stream order
  if (!s.ok()) return s;
  return true;
}

absl::Status LayerNormBackward(int device, ElemType type, const void* dy, const void* x, const void* g,
                               const float* mean, const float* rstd, const void* acc, void* dx, void* dg, void* db,
                               int64_t rows, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "LayerNormBackward", [&](auto t) {
    using T = decltype(t);
    if (Packable<T>(n, {dy, x, g, dx})) {  // the kernel the unfolded backward runs
      const bool in_pass = Packable<T>(n, {acc});
      const T* pass_acc = static_cast<const T*>(in_pass ? acc : nullptr);
      absl::StatusOr<bool> folded =
          FoldedNormBackward<T, true>(stream, dy, x, g, mean, rstd, pass_acc, dx, dg, db, rows, n);
      if (!folded.ok()) return folded.status();
      if (!*folded) {
        Launch(LayerNormBackwardWarpKernel<T>, WarpRowBlocks(rows), kThreads, stream, static_cast<const T*>(dy),
               static_cast<const T*>(x), static_cast<const T*>(g), mean, rstd, pass_acc, static_cast<T*>(dx), rows,
               n);
        RETURN_IF(Finish("LayerNormBackwardWarpKernel"));
      }
      if (!in_pass) RETURN_IF(Binary(device, BinaryOp::kAdd, type, acc, dx, dx, rows * n));  // a misaligned acc
      if (*folded) return absl::OkStatus();
    } else {
      Launch(LayerNormBackwardKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(dy), InOf<T>(x), InOf<T>(g),
             mean, rstd, InOf<T>(acc), OutOf<T>(dx), rows, n);
      RETURN_IF(Finish("LayerNormBackwardKernel"));
    }
    return ColumnReduce<T>(stream, rows, n, 2, Packable<T>(n, {dy, x}), "NormParamGradKernel",
                           [&](auto p, dim3 grid, int64_t chunk_rows, ColumnScratch s) {
                             Launch(NormParamGradKernel<T, T, decltype(p)::value>, grid, kThreads, stream,
                                    InOf<T>(dy), InOf<T>(x), mean, rstd, OutOf<T>(dg), OutOf<T>(db), rows, n,
                                    chunk_rows, s);
                           });
  });
}

absl::Status RmsNorm(int device, ElemType type, const void* x, const void* residual, const void* g, float eps,
                     void* y, void* sum, float* rstd, int64_t rows, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "RmsNorm", [&](auto t) {
    using T = decltype(t);
    if (Packable<T>(n, {x, residual, g, y, sum})) {
      Launch(RmsNormWarpKernel<T>, WarpRowBlocks(rows), kThreads, stream, static_cast<const T*>(x),
             static_cast<const T*>(residual), static_cast<const T*>(g), eps, static_cast<T*>(y), static_cast<T*>(sum),
             rstd, rows, n);
      return Finish("RmsNormWarpKernel");
    }
    Launch(RmsNormKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(x), InOf<T>(residual), InOf<T>(g), eps,
           OutOf<T>(y), OutOf<T>(sum), rstd, rows, n);
    return Finish("RmsNormKernel");
  });
}

absl::Status RmsNormBackward(int device, ElemType type, const void* dy, const void* x, const void* g,
                             const float* rstd, const void* acc, void* dx, void* dg, int64_t rows, int64_t n) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "RmsNormBackward", [&](auto t) {
    using T = decltype(t);
    if (Packable<T>(n, {dy, x, g, dx})) {  // the kernel the unfolded backward runs
      const bool in_pass = Packable<T>(n, {acc});
      const T* pass_acc = static_cast<const T*>(in_pass ? acc : nullptr);
      absl::StatusOr<bool> folded =
          FoldedNormBackward<T, false>(stream, dy, x, g, nullptr, rstd, pass_acc, dx, dg, nullptr, rows, n);
      if (!folded.ok()) return folded.status();
      if (!*folded) {
        Launch(RmsNormBackwardWarpKernel<T>, WarpRowBlocks(rows), kThreads, stream, static_cast<const T*>(dy),
               static_cast<const T*>(x), static_cast<const T*>(g), rstd, pass_acc, static_cast<T*>(dx), rows, n);
        RETURN_IF(Finish("RmsNormBackwardWarpKernel"));
      }
      if (!in_pass) RETURN_IF(Binary(device, BinaryOp::kAdd, type, acc, dx, dx, rows * n));  // a misaligned acc
      if (*folded) return absl::OkStatus();
    } else {
      Launch(RmsNormBackwardKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(dy), InOf<T>(x), InOf<T>(g), rstd,
             InOf<T>(acc), OutOf<T>(dx), rows, n);
      RETURN_IF(Finish("RmsNormBackwardKernel"));
    }
    return ColumnReduce<T>(stream, rows, n, 2, Packable<T>(n, {dy, x}), "NormParamGradKernel",
                           [&](auto p, dim3 grid, int64_t chunk_rows, ColumnScratch s) {
                             Launch(NormParamGradKernel<T, T, decltype(p)::value>, grid, kThreads, stream,
                                    InOf<T>(dy), InOf<T>(x), static_cast<const float*>(nullptr), rstd, OutOf<T>(dg),
                                    Out<T>{nullptr}, rows, n, chunk_rows, s);
                           });
  });
}

absl::Status NormRowSums(int device, ElemType type, const void* x, const float* center, bool square, int64_t rows,
                         int64_t n, float* sums) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "NormRowSums", [&](auto t) {
    using T = decltype(t);
    Launch(NormRowSumsKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(x), center, square, rows, n, sums);
    return Finish("NormRowSumsKernel");
  });
}

absl::Status NormApply(int device, ElemType type, const void* x, const void* g, const void* b, const float* mean,
                       const float* sq_sums, int64_t h, float eps, int64_t rows, int64_t n, void* y, float* rstd) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "NormApply", [&](auto t) {
    using T = decltype(t);
    Launch(NormApplyKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(x), InOf<T>(g), InOf<T>(b), mean, sq_sums,
           1.0f / static_cast<float>(h), eps, rows, n, OutOf<T>(y), rstd);
    return Finish("NormApplyKernel");
  });
}

absl::Status NormBackwardSums(int device, ElemType type, const void* dy, const void* x, const void* g,
                              const float* mean, const float* rstd, int64_t rows, int64_t n, float* sums) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "NormBackwardSums", [&](auto t) {
    using T = decltype(t);
    Launch(NormBackwardSumsKernel<T>, RowBlocks(rows), kThreads, stream, InOf<T>(dy), InOf<T>(x), InOf<T>(g), mean,
           rstd, rows, n, sums);
    return Finish("NormBackwardSumsKernel");
  });
}

absl::Status NormBackwardApply(int device, ElemType type, const void* dy, const void* x, const void* g,
                               const float* mean, const float* rstd, const float* sums, int64_t h, int64_t rows,
                               int64_t n, void* dx) {
  if (rows * n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "NormBackwardApply", [&](auto t) {
    using T = decltype(t);
    Launch(NormBackwardApplyKernel<T>, Blocks(rows * n), kThreads, stream, InOf<T>(dy), InOf<T>(x), InOf<T>(g), mean,
           rstd, sums, 1.0f / static_cast<float>(h), rows, n, OutOf<T>(dx));
    return Finish("NormBackwardApplyKernel");
  });
}

absl::Status NormParamGrad(int device, ElemType type, const void* dy, const void* x, const float* mean,
                           const float* rstd, int64_t rows, int64_t n, float* dg, float* db) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "NormParamGrad", [&](auto t) {
    using T = decltype(t);
    return ColumnReduce<T>(stream, rows, n, 2, Packable<T>(n, {dy, x}), "NormParamGradKernel",
                           [&](auto p, dim3 grid, int64_t chunk_rows, ColumnScratch s) {
                             Launch(NormParamGradKernel<T, float, decltype(p)::value>, grid, kThreads, stream,
                                    InOf<T>(dy), InOf<T>(x), mean, rstd, Out<float>{dg}, Out<float>{db}, rows, n,
                                    chunk_rows, s);
                           });
  });
}

absl::Status Softmax(int device, const float* x, float* y, int64_t rows, int64_t k, int64_t causal_q) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(SoftmaxKernel, RowBlocks(rows), kThreads, stream, x, y, rows, k, causal_q);
  return Finish("SoftmaxKernel");
}

absl::Status SoftmaxBackward(int device, const float* dy, const float* y, float* dx, int64_t rows, int64_t k) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(SoftmaxBackwardKernel, RowBlocks(rows), kThreads, stream, dy, y, dx, rows, k);
  return Finish("SoftmaxBackwardKernel");
}

absl::Status Dropout(int device, const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(DropoutKernel, Blocks(n), kThreads, stream, x, y, n, p, seed, offset);
  return Finish("DropoutKernel");
}

absl::Status Embedding(int device, ElemType type, const void* table, const int64_t* ids, void* out, int64_t count,
                       int64_t rows, int64_t h, int64_t row_offset) {
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "Embedding", [&](auto t) {
    using T = decltype(t);
    Launch(EmbeddingKernel<T>, Blocks(count * h), kThreads, stream, InOf<T>(table), ids, OutOf<T>(out), count, rows,
           h, row_offset);
    return Finish("EmbeddingKernel");
  });
}

absl::Status EmbeddingBackward(int device, ElemType type, const void* dy, const std::vector<int64_t>& seg_rows,
                               const std::vector<int64_t>& seg_starts, const std::vector<int64_t>& tokens,
                               void* dtable, int64_t rows, int64_t h) {
  const int64_t segments = static_cast<int64_t>(seg_rows.size());
  if (seg_starts.size() != seg_rows.size() + 1 || seg_starts.back() != static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError("EmbeddingBackward: inconsistent token segments");
  }
  COLOD_CUDA_BEGIN(stream, device);
  if (type != ElemType::kF32 && type != ElemType::kBF16 && type != ElemType::kF16) {
    return absl::InvalidArgumentError("EmbeddingBackward: float types only");
  }
  const size_t size = static_cast<size_t>(ElemSize(type));
  RETURN_IF(CudaCheck(cudaMemsetAsync(dtable, 0, rows * h * size, stream), "cudaMemsetAsync"));  // 0.0 in each
  if (segments == 0) return Finish("EmbeddingBackward");
  // The three index arrays in one stream-ordered allocation, uploaded in
  // one staged copy (tensor_ops.h's Upload: the host does not wait).
  const size_t n_index = seg_rows.size() + seg_starts.size() + tokens.size();
  std::vector<int64_t> packed;
  packed.reserve(n_index);
  packed.insert(packed.end(), seg_rows.begin(), seg_rows.end());
  packed.insert(packed.end(), seg_starts.begin(), seg_starts.end());
  packed.insert(packed.end(), tokens.begin(), tokens.end());
  int64_t* index = nullptr;
  RETURN_IF(CudaCheck(cudaMallocAsync(reinterpret_cast<void**>(&index), n_index * sizeof(int64_t), stream),
                      "cudaMallocAsync"));
  int64_t* d_rows = index;
  int64_t* d_starts = d_rows + seg_rows.size();
  int64_t* d_tokens = d_starts + seg_starts.size();
  const absl::Status uploaded = Upload(device, index, packed.data(), n_index * sizeof(int64_t));
  cudaError_t e = uploaded.ok() ? cudaSuccess : cudaErrorUnknown;
  absl::Status typed;
  if (e == cudaSuccess) {
    // Update, not =: nvcc warns that operator='s Status& result goes unused.
    typed.Update(ByFloatType(type, "EmbeddingBackward", [&](auto t) {
      using T = decltype(t);
      e = Launch(EmbeddingBackwardKernel<T>, Blocks(segments * h), kThreads, stream, InOf<T>(dy), d_rows, d_starts,
                 d_tokens, segments, h, OutOf<T>(dtable));
      return absl::OkStatus();
    }));
  }
  cudaFreeAsync(index, stream);  // after the kernel, in stream order
  RETURN_IF(uploaded);
  RETURN_IF(typed);
  RETURN_IF(CudaCheck(e, "EmbeddingBackward"));
  return Finish("EmbeddingBackwardKernel");
}

absl::Status CrossEntropy(int device, const float* logits, const int64_t* labels, float* loss, int64_t n, int64_t v,
                          float smoothing, int64_t ignore_index) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(CrossEntropyKernel, RowBlocks(n), kThreads, stream, logits, labels, loss, n, v, smoothing,
                                                                          ignore_index);
  return Finish("CrossEntropyKernel");
}

absl::Status CrossEntropyBackward(int device, const float* dloss, const float* logits, const int64_t* labels,
                                  float* dlogits, int64_t n, int64_t v, float smoothing, int64_t ignore_index) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(CrossEntropyBackwardKernel, RowBlocks(n), kThreads, stream, dloss, logits, labels, dlogits, n, v,
                                                                                  smoothing, ignore_index);
  return Finish("CrossEntropyBackwardKernel");
}

absl::Status VocabShardStats(int device, ElemType type, const void* z, const int64_t* labels, int64_t rows,
                             int64_t width, int64_t real, int64_t start, int64_t ignore_index, float* mine) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "VocabShardStats", [&](auto t) {
    using T = decltype(t);
    Launch(VocabShardStatsKernel<T>, RowBlocks(rows), kThreads, stream, static_cast<const T*>(z), labels, rows, width,
           real, start, ignore_index, PackedLogits<T>(z, width), mine, mine + rows);
    return Finish("VocabShardStatsKernel");
  });
}

absl::Status VocabShardCombine(int device, const float* gathered, int64_t shards, int64_t rows, float* mx,
                               float* stats) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(VocabShardCombineKernel, Blocks(rows), kThreads, stream, gathered, shards, rows, mx, stats);
  return Finish("VocabShardCombineKernel");
}

absl::Status VocabShardLoss(int device, const float* mx, const float* stats, const int64_t* labels, int64_t rows,
                            int64_t vocab, float smoothing, int64_t ignore_index, float* lse, float* loss) {
  if (rows == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(VocabShardLossKernel, Blocks(rows), kThreads, stream, mx, stats, labels, rows, vocab, smoothing,
         ignore_index, lse, loss);
  return Finish("VocabShardLossKernel");
}

absl::Status VocabShardBackward(int device, ElemType type, const void* z, const int64_t* labels, const float* lse,
                                const float* dloss, int64_t rows, int64_t width, int64_t real, int64_t start,
                                int64_t vocab, float smoothing, int64_t ignore_index, ElemType dz_type, void* dz) {
  if (dz_type != ElemType::kF32 && dz_type != type) {
    return absl::InvalidArgumentError("VocabShardBackward: dz must be f32 or the logits' type");
  }
  if (rows * width == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  return ByFloatType(type, "VocabShardBackward", [&](auto t) {
    using T = decltype(t);
    const bool packed = PackedLogits<T>(z, width) && AllAligned16({dz});
    if (dz_type == ElemType::kF32) {
      Launch(VocabShardBackwardKernel<T, float>, RowBlocks(rows), kThreads, stream, static_cast<const T*>(z), labels,
             lse, dloss, rows, width, real, start, vocab, smoothing, ignore_index, packed, static_cast<float*>(dz));
    } else {
      Launch(VocabShardBackwardKernel<T, T>, RowBlocks(rows), kThreads, stream, static_cast<const T*>(z), labels, lse,
             dloss, rows, width, real, start, vocab, smoothing, ignore_index, packed, static_cast<T*>(dz));
    }
    return Finish("VocabShardBackwardKernel");
  });
}

absl::Status Rope(int device, const float* x, float* y, int64_t b, int64_t s, int64_t heads, int64_t d, float theta,
                  int64_t position_offset, float sign) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(RopeKernel, Blocks(b * s * heads * (d / 2)), kThreads, stream, x, y, b, s, heads, d, theta,
                                                                                     position_offset, sign);
  return Finish("RopeKernel");
}


// Whether the tensor-core kernels can stage rows laid out as `layout` (16
// bytes at a time: strides of whole 8-element packs).
static bool RowsInPacks(const AttentionLayout& layout) {
  for (const HeadRows& r : {layout.q, layout.kv, layout.dq, layout.dkv}) {
    if (r.token % 8 != 0 || r.head % 8 != 0) return false;
  }
  return true;
}

// The call as cuDNN's attention takes it (cudnn_attention.h), where the
// environment asks for cuDNN (COLOD_ATTENTION=cudnn) and its graphs express
// the call with every pointer 16-byte aligned; nullopt otherwise.
static std::optional<CudnnAttentionShape> CudnnShapeFor(ElemType type, int64_t b, int64_t s, int64_t hq, int64_t hkv,
                                                        int64_t d, bool causal, bool deterministic,
                                                        const AttentionBias& extra, const AttentionLayout& layout,
                                                        std::initializer_list<const void*> pointers) {
  if (!CudnnAttentionRequested()) return std::nullopt;
  const CudnnAttentionShape shape{type, b, s, hq, hkv, d, causal, deterministic, layout};
  if (!CudnnAttentionServes(shape, extra).ok() || !AllAligned16(pointers)) return std::nullopt;
  return shape;
}

// `p` advanced by `elements` elements of `size` bytes (null stays null).
constexpr int64_t kF32Size = sizeof(float);
template <typename P>
static P* Advanced(P* p, int64_t elements, int64_t size) {
  if (p == nullptr) return p;
  using Byte = std::conditional_t<std::is_const_v<P>, const char, char>;
  return reinterpret_cast<P*>(reinterpret_cast<Byte*>(p) + elements * size);
}

// Runs `part(b0, n)` over the batch: at once where it fits one launch, else
// in parts of kAttnBatchPart elements (a multiple of 16, so that every
// part's operands keep the alignment of the whole's, which the tensor-core
// kernels and cuDNN ask of them), stopping at the first error.
constexpr int64_t kAttnBatchPart = kMaxAttnBatch / 16 * 16;
template <typename Part>
static absl::Status ByBatchParts(int64_t b, Part part) {
  if (b <= kMaxAttnBatch) return part(int64_t{0}, b);
  for (int64_t b0 = 0; b0 < b; b0 += kAttnBatchPart) {
    RETURN_IF(part(b0, std::min(kAttnBatchPart, b - b0)));
  }
  return absl::OkStatus();
}

// One launch's worth of FlashAttention (b <= kMaxAttnBatch).
static absl::Status FlashAttentionPart(int device, ElemType type, const void* q, const void* k, const void* v,
                                       void* out, float* lse, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                                       float scale, bool causal, AttentionBias extra, AttentionLayout layout);
static absl::Status FlashAttentionBackwardPart(int device, ElemType type, const void* q, const void* k, const void* v,
                                               const void* out, const void* dout, const float* lse, float* delta,
                                               void* dq, void* dk, void* dv, int64_t b, int64_t s, int64_t hq,
                                               int64_t hkv, int64_t d, float scale, bool causal, AttentionBias extra,
                                               AttentionLayout layout);

// A batch past one launch's grid runs in parts: each part's operands start
// at its first element (row b0 s of each operand's layout; out, dout and the
// row statistics contiguous; dbias [b, hq, s, s]), the bias and slopes the
// same for every element.
absl::Status FlashAttention(int device, ElemType type, const void* q, const void* k, const void* v, void* out,
                            float* lse, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, float scale,
                            bool causal, AttentionBias extra, AttentionLayout layout) {
  if (b < 0 || s < 0 || hq < 0 || d < 0) return absl::InvalidArgumentError("FlashAttention: a negative size");
  const int64_t size = ElemSize(type);
  return ByBatchParts(b, [&](int64_t b0, int64_t n) {
    return FlashAttentionPart(device, type, Advanced(q, b0 * s * layout.q.token, size),
                              Advanced(k, b0 * s * layout.kv.token, size), Advanced(v, b0 * s * layout.kv.token, size),
                              Advanced(out, b0 * s * hq * d, size), Advanced(lse, b0 * hq * s, kF32Size), n, s, hq, hkv,
                              d, scale, causal, extra, layout);
  });
}

absl::Status FlashAttentionBackward(int device, ElemType type, const void* q, const void* k, const void* v,
                                    const void* out, const void* dout, const float* lse, float* delta, void* dq,
                                    void* dk, void* dv, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                                    float scale, bool causal, AttentionBias extra, AttentionLayout layout) {
  if (b < 0 || s < 0 || hq < 0 || d < 0) {
    return absl::InvalidArgumentError("FlashAttentionBackward: a negative size");
  }
  const int64_t size = ElemSize(type);
  return ByBatchParts(b, [&](int64_t b0, int64_t n) {
    AttentionBias part = extra;
    part.dbias = Advanced(extra.dbias, b0 * hq * s * s, kF32Size);
    return FlashAttentionBackwardPart(
        device, type, Advanced(q, b0 * s * layout.q.token, size), Advanced(k, b0 * s * layout.kv.token, size),
        Advanced(v, b0 * s * layout.kv.token, size), Advanced(out, b0 * s * hq * d, size),
        Advanced(dout, b0 * s * hq * d, size), Advanced(lse, b0 * hq * s, kF32Size),
        Advanced(delta, b0 * hq * s, kF32Size), Advanced(dq, b0 * s * layout.dq.token, size),
        Advanced(dk, b0 * s * layout.dkv.token, size), Advanced(dv, b0 * s * layout.dkv.token, size), n, s, hq, hkv, d,
        scale, causal, part, layout);
  });
}

static absl::Status FlashAttentionPart(int device, ElemType type, const void* q, const void* k, const void* v,
                                       void* out, float* lse, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                                       float scale, bool causal, AttentionBias extra, AttentionLayout layout) {
  absl::StatusOr<dim3> grid = AttnGrid(b, s, hq, hkv, d, "FlashAttention");
  if (!grid.ok()) return grid.status();
  if (!StridesPositive(layout)) return absl::InvalidArgumentError("FlashAttention: a stride below 1");
  if (b * s == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  if (const std::optional<CudnnAttentionShape> shape =
          CudnnShapeFor(type, b, s, hq, hkv, d, causal, false, extra, layout, {q, k, v, out, lse})) {
    // UNAVAILABLE (no library, no plan for the shape; said once on stderr):
    // colod's kernels below.
    const absl::Status st = CudnnAttentionForward(device, stream, *shape, q, k, v, out, lse, scale);
    if (!absl::IsUnavailable(st)) return st;
  }
  if (type != ElemType::kF32 && MmaHeadDim(d) && AllAligned16({q, k, v, out}) && RowsInPacks(layout)) {
    return ByFloatType(type, "FlashAttention", [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float>) {
        return absl::InternalError("FlashAttention: no tensor-core kernel for f32");
      } else {
        return ByMmaHeadDim(d, [&](auto dim) {
          constexpr int kD = decltype(dim)::value;
          // Two row tiles a warp where their registers fit (head dims 64 and
          // 128, Q read from shared memory at 128).
          return ByForwardRowTiles<kD>([&](auto tiles) {
            constexpr int kTiles = decltype(tiles)::value;
            dim3 tiles_grid = *grid;
            tiles_grid.x = static_cast<unsigned>((s + kMmaRows * kTiles - 1) / (kMmaRows * kTiles));
            const size_t shared_bytes = kQFromShared<kD, kTiles> ? kForwardShared<kD, kTiles> : 0;
            const cudaError_t launched =
                LaunchShared(FlashForwardMmaKernel<kD, T, kTiles>, tiles_grid, kMmaThreads, shared_bytes, stream,
                             static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                             static_cast<T*>(out), lse, s, hq, hkv, scale, causal, extra, layout);
            RETURN_IF(Finish("FlashForwardMmaKernel"));
            return CudaCheck(launched, "FlashForwardMmaKernel");
          });
        });
      }
    });
  }
  return ByFloatType(type, "FlashAttention", [&](auto t) {
    using T = decltype(t);
    return ByHeadDim(d, [&](auto dim) {
      Launch(FlashForwardKernel<decltype(dim)::value, T>, *grid, kAttnRows, stream, InOf<T>(q), InOf<T>(k),
             InOf<T>(v), OutOf<T>(out), lse, s, hq, hkv, static_cast<int>(d), scale, causal, extra, layout);
      return Finish("FlashForwardKernel");
    });
  });
}

// Whether the environment asks for bitwise-repeatable kernels
// (COLOD_DETERMINISTIC=1): the attention backward then runs the two
// kernels without atomics. Read at each call.
bool DeterministicRequested() {
  const char* v = getenv("COLOD_DETERMINISTIC");
  return v != nullptr && std::string_view(v) == "1";
}

// The one-pass tensor-core backward: delta and the zeroed f32 dQ buffer
// dq_acc ([b, s, hq, kD], from the stream's pool; given back here after the
// last kernel that reads it), the fused kernel, dq rounded from the buffer.
template <int kD, typename T>
absl::Status FusedBackward(cudaStream_t stream, const T* q, const T* k, const T* v, const T* out, const T* dout,
                           const float* lse, float* delta, T* dq, T* dk, T* dv, int64_t b, int64_t s, int64_t hq,
                           int64_t hkv, float scale, bool causal, AttentionBias extra, AttentionLayout layout,
                           dim3 kv_grid, float* dq_acc) {
  const int64_t rows = b * s * hq, n = rows * kD;
  auto run = [&]() -> absl::Status {
    Launch(FlashBackwardPrepKernel<kD, T>, Blocks(n / kPack<float>), kThreads, stream, out, dout, delta, dq_acc, b, s,
           hq);
    RETURN_IF(Finish("FlashBackwardPrepKernel"));
    // A refused cudaFuncSetAttribute is reported too (Finish clears it).
    const cudaError_t launched =
        LaunchShared(FlashBackwardKvMmaKernel<kD, T, true>, kv_grid, kMmaThreads, kFusedShared<kD>, stream, q, k, v,
                     dout, lse, static_cast<const float*>(delta), dq_acc, dk, dv, s, hq, hkv, scale, causal, extra,
                     layout);
    RETURN_IF(Finish("FlashBackwardKvMmaKernel"));
    RETURN_IF(CudaCheck(launched, "FlashBackwardKvMmaKernel"));
    Launch(FlashDqConvertKernel<kD, T>, Blocks(n / kPack<T>), kThreads, stream, static_cast<const float*>(dq_acc), dq,
           n, scale, hq, layout.dq);
    return Finish("FlashDqConvertKernel");
  };
  const absl::Status st = run();
  const absl::Status freed = CudaCheck(cudaFreeAsync(dq_acc, stream), "FlashAttentionBackward's dQ buffer");
  return st.ok() ? freed : st;
}

static absl::Status FlashAttentionBackwardPart(int device, ElemType type, const void* q, const void* k, const void* v,
                                               const void* out, const void* dout, const float* lse, float* delta,
                                               void* dq, void* dk, void* dv, int64_t b, int64_t s, int64_t hq,
                                               int64_t hkv, int64_t d, float scale, bool causal, AttentionBias extra,
                                               AttentionLayout layout) {
  absl::StatusOr<dim3> grid = AttnGrid(b, s, hq, hkv, d, "FlashAttentionBackward");
  if (!grid.ok()) return grid.status();
  if (!StridesPositive(layout)) return absl::InvalidArgumentError("FlashAttentionBackward: a stride below 1");
  if (b * s == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  if (const std::optional<CudnnAttentionShape> shape =
          CudnnShapeFor(type, b, s, hq, hkv, d, causal, DeterministicRequested(), extra, layout,
                        {q, k, v, out, dout, lse, dq, dk, dv})) {
    const absl::Status st =
        CudnnAttentionBackward(device, stream, *shape, q, k, v, out, dout, lse, dq, dk, dv, scale);
    if (!absl::IsUnavailable(st)) return st;
  }
  const dim3 kv_grid(grid->x, static_cast<unsigned>(hkv), grid->z);
  if (type != ElemType::kF32 && MmaHeadDim(d) && AllAligned16({q, k, v, out, dout, dq, dk, dv}) &&
      RowsInPacks(layout)) {
    return ByFloatType(type, "FlashAttentionBackward", [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float>) {
        return absl::InternalError("FlashAttentionBackward: no tensor-core kernel for f32");
      } else {
        return ByMmaHeadDim(d, [&](auto dim) {
          constexpr int kD = decltype(dim)::value;
          // The one-pass backward unless asked for repeatable bits, or where
          // its f32 dQ buffer cannot be had (the two kernels need none).
          void* buffer = nullptr;
          if (!DeterministicRequested()) {
            if (cudaMallocAsync(&buffer, static_cast<size_t>(b * s * hq * kD) * sizeof(float), stream) ==
                cudaSuccess) {
              return FusedBackward<kD, T>(stream, static_cast<const T*>(q), static_cast<const T*>(k),
                                          static_cast<const T*>(v), static_cast<const T*>(out),
                                          static_cast<const T*>(dout), lse, delta, static_cast<T*>(dq),
                                          static_cast<T*>(dk), static_cast<T*>(dv), b, s, hq, hkv, scale, causal,
                                          extra, layout, kv_grid, static_cast<float*>(buffer));
            }
            (void)cudaGetLastError();  // not sticky: the failed allocation only
          }
          // Two row tiles a warp at head dim 64, as the forward.
          RETURN_IF(ByRowTiles<kD>([&](auto tiles) {
            constexpr int kTiles = decltype(tiles)::value;
            dim3 dq_grid = *grid;
            dq_grid.x = static_cast<unsigned>((s + kMmaRows * kTiles - 1) / (kMmaRows * kTiles));
            Launch(FlashBackwardDqMmaKernel<kD, T, kTiles>, dq_grid, kMmaThreads, stream, static_cast<const T*>(q),
                   static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(out),
                   static_cast<const T*>(dout), lse, delta, static_cast<T*>(dq), s, hq, hkv, scale, causal, extra,
                   layout);
            return Finish("FlashBackwardDqMmaKernel");
          }));
          Launch(FlashBackwardKvMmaKernel<kD, T, false>, kv_grid, kMmaThreads, stream, static_cast<const T*>(q),
                 static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(dout), lse,
                 static_cast<const float*>(delta), static_cast<float*>(nullptr), static_cast<T*>(dk),
                 static_cast<T*>(dv), s, hq, hkv, scale, causal, extra, layout);
          return Finish("FlashBackwardKvMmaKernel");
        });
      }
    });
  }
  return ByFloatType(type, "FlashAttentionBackward", [&](auto t) {
    using T = decltype(t);
    return ByHeadDim(d, [&](auto dim) {
      constexpr int kD = decltype(dim)::value;
      Launch(FlashBackwardDqKernel<kD, T>, *grid, kAttnRows, stream, InOf<T>(q), InOf<T>(k), InOf<T>(v),
             InOf<T>(out), InOf<T>(dout), lse, delta, OutOf<T>(dq), s, hq, hkv, static_cast<int>(d), scale, causal,
             extra, layout);
      RETURN_IF(Finish("FlashBackwardDqKernel"));
      Launch(FlashBackwardDkvKernel<kD, T>, kv_grid, kAttnRows, stream, InOf<T>(q), InOf<T>(k), InOf<T>(v),
             InOf<T>(dout), lse, static_cast<const float*>(delta), OutOf<T>(dk), OutOf<T>(dv), s, hq, hkv,
             static_cast<int>(d), scale, causal, extra, layout);
      return Finish("FlashBackwardDkvKernel");
    });
  });
}

absl::Status AdamW(int device, const std::vector<AdamWTensor>& tensors, const AdamWHyper& h) {
  COLOD_CUDA_BEGIN(stream, device);
  return ForEachLaunch(tensors, [&](const TensorList<AdamWTensor>& list, int64_t blocks) {
    Launch(AdamWKernel, static_cast<unsigned>(blocks), kThreads, stream, list, h);
    return Finish("AdamWKernel");
  });
}

absl::Status GradNormClip(int device, const float* squares, int64_t n, double max_norm, double loss_scale,
                          float* out) {
  COLOD_CUDA_BEGIN(stream, device);
  Launch(GradNormClipKernel, 1, 1, stream, squares, n, max_norm, loss_scale, out);
  return Finish("GradNormClipKernel");
}

}  // namespace colod::kernels::cuda
