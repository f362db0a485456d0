// Warp-level matrix instructions for colod's kernels: mma.sync m16n8k16 (bf16
// or f16 operands, f32 accumulators) and ldmatrix, and the asynchronous
// copies (cp.async) that stage their tiles, as inline PTX under nvcc
// and as the CUDA emulation's models of them (kernels/cuda/emu/warp.cc)
// under --config=cuda-emu, so a tensor-core kernel runs in CI against its CPU
// twin. Both need sm_80 or newer (the build's targets are sm_80 and sm_90).
//
// Fragment layouts (PTX ISA), with group = lane / 4 and pair = lane % 4:
//   A, 16 x 16, row-major: a[0] holds (group, 2 pair .. 2 pair + 1), a[1]
//     the same columns of row group + 8, a[2] and a[3] those of columns
//     8 + 2 pair .. 9 + 2 pair; the lower column in the low 16 bits.
//   B, 16 x 8 (k x n), "col": b[0] holds (2 pair .. 2 pair + 1, group),
//     b[1] rows 8 + 2 pair .. 9 + 2 pair of the same column.
//   C and D, 16 x 8 in f32: c[0], c[1] are (group, 2 pair .. 2 pair + 1),
//     c[2], c[3] the same columns of row group + 8.
// ldmatrix x4 gives exactly A's registers from a 16 x 16 tile in shared
// memory when lane l points at row l % 16, column 8 (l / 16) of it; for B
// (k x n stored as n rows of k, that is K-major like A) lanes 0-7 and 8-15
// point at rows n of columns 0 and 8 (x2, or x4 for two n-tiles).
//
// Thread-safety: device code; every lane of a warp must execute the
// matrix instructions together (they are .sync.aligned). The copies are
// per thread: a copy is visible to its own thread after its CpAsyncWait, and
// to the block's other threads after a __syncthreads that follows it.
#ifndef COLOD_KERNELS_CUDA_WARP_H_
#define COLOD_KERNELS_CUDA_WARP_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace colod::kernels::cuda {

// D = A B + C, bf16 operands.
__device__ __forceinline__ void MmaBf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::MmaM16N8K16(::colod_cuda_emu::MmaType::kBf16, d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

// D = A B + C, f16 operands.
__device__ __forceinline__ void MmaF16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::MmaM16N8K16(::colod_cuda_emu::MmaType::kF16, d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

// ldmatrix .x4 (four 8 x 8 matrices of 16-bit elements) from shared memory:
// `row` is this lane's row address (16-byte aligned), rows of matrix j from
// lanes 8j .. 8j + 7.
__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* row) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::LdMatrix(4, false, r, row);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// The same, each matrix transposed: lane l gets column l / 4 of rows
// 2 (l % 4) and 2 (l % 4) + 1 (B's fragment from a k x n row-major tile).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t r[4], const void* row) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::LdMatrix(4, true, r, row);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// ldmatrix .x2: two matrices, rows from lanes 0-15 (the other lanes'
// addresses are ignored but must be valid shared addresses).
__device__ __forceinline__ void LdMatrixX2(uint32_t r[2], const void* row) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::LdMatrix(2, false, r, row);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
#endif
}

__device__ __forceinline__ void LdMatrixX2Trans(uint32_t r[2], const void* row) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::LdMatrix(2, true, r, row);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
#endif
}

// ---- Asynchronous copies from global to shared memory (cp.async) ----
// A tile load that does not pass through registers and overlaps the
// computation issued after it: CpAsync16 starts a copy, CpAsyncCommit groups
// this thread's copies started since the last commit, CpAsyncWait<n> waits
// until at most n of its groups are in flight. Under the emulation the
// destination holds NaN bytes from the start until that wait, so reading a
// tile before it, or copying over a tile another warp still reads, shows.

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), or 16
// zero bytes without reading src where !valid (src must still be a global
// address). Bypasses L1 (.cg): the tiles are read once a block.
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::CpAsync(dst, src, 16, valid ? 16 : 0);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src), "r"(valid ? 16 : 0));
#endif
}

// 4 bytes (4-byte aligned), as CpAsync16.
__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid) {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::CpAsync(dst, src, 4, valid ? 4 : 0);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(src), "r"(valid ? 4 : 0));
#endif
}

__device__ __forceinline__ void CpAsyncCommit() {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::CpAsyncCommit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int kGroups>
__device__ __forceinline__ void CpAsyncWait() {
#ifdef COLOD_CUDA_EMULATION
  ::colod_cuda_emu::CpAsyncWait(kGroups);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kGroups) : "memory");
#endif
}

// ---- Dynamic shared memory and vector reductions to global memory ----

// The block's dynamic shared memory: the shared_bytes of its launch
// (LaunchShared, launch.h), 16-byte aligned. A kernel whose tiles need more
// than the 48 KiB of static shared memory takes them here.
__device__ __forceinline__ unsigned char* DynamicShared() {
#ifdef COLOD_CUDA_EMULATION
  return ::colod_cuda_emu::DynamicShared();
#else
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  return dynamic_shared;
#endif
}

// p[0] += a and p[1] += b atomically, each element on its own (p 8-byte
// aligned, in global memory), without reading the old values back: one
// red.global.add.v2.f32 on sm_90 (PTX ISA 8.1, CUDA 12.1), two float
// reductions elsewhere.
__device__ __forceinline__ void RedAddF32x2(float* p, float a, float b) {
#if defined(COLOD_CUDA_EMULATION) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900 || \
    __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1201
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#else
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#endif
}

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_WARP_H_
