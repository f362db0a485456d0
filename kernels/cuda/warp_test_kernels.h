// Test kernels of the warp-level operations (kernels/cuda/warp.h and the
// CUDA intrinsics __shfl_*_sync, __ballot_sync, __any_sync, __all_sync) and
// of warp.h's asynchronous copies,
// behind a host API without CUDA types, for //kernels:cuda_warp_test: on a
// GPU they check warp.h's inline PTX and the fragment layouts it documents,
// and under --config=cuda-emu the emulation's models of the same
// instructions. Each call allocates, copies, runs one kernel on device 0's
// compute stream and waits for it.
//
// Thread-safety: as the CUDA runtime; tests call them from one thread.
#ifndef COLOD_KERNELS_CUDA_WARP_TEST_KERNELS_H_
#define COLOD_KERNELS_CUDA_WARP_TEST_KERNELS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace colod::kernels::cuda::warp_test {

// One block of `threads` threads (whole warps); thread t's value is
// v = 3 t + 1 within its warp's lane numbering. Per thread, 8 outputs:
//   0: the warp's sum of v by a __shfl_xor_sync butterfly (16, 8, 4, 2, 1)
//   1: v of lane 5 (__shfl_sync)
//   2: v of lane + 1, or its own at lane 31 (__shfl_down_sync by 1)
//   3: v of lane - 2, or its own below lane 2 (__shfl_up_sync by 2)
//   4: __ballot_sync of lane % 3 == 0, as a bit pattern
//   5: __any_sync of lane == 7; 6: __all_sync of v > 0; 7: __all_sync of lane < 31
//   8: the sum of v over groups of 8 lanes (__shfl_xor_sync width 8)
absl::StatusOr<std::vector<int64_t>> Shuffles(int threads);

// One warp: each lane loads its fragments of A (16 x 16, row-major), B
// (16 x 8, given as b[n * 16 + k]) and C (16 x 8, row-major) from global
// memory by the layouts warp.h documents, runs one mma.sync m16n8k16
// (bf16 operands, or f16 with `f16`) and stores D (16 x 8, row-major) by
// the same layout. a and b hold 16-bit patterns.
absl::StatusOr<std::vector<float>> Mma(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                                       const std::vector<float>& c, bool f16);

// One warp loads a 16 x 16 tile of 16-bit patterns (row-major) into shared
// memory and reads it with ldmatrix .x4 (or .x4.trans with `trans`), lane l
// giving row l % 16, column 8 (l / 16); returns each lane's 4 registers
// (lane-major, 32 x 4).
absl::StatusOr<std::vector<uint32_t>> LdMatrix(const std::vector<uint16_t>& tile, bool trans);

// C (m x n, f32) = A (m x k, bf16, row-major) times B, where B is given as
// n x k row-major (C = A B^T, ldmatrix) or, with `b_k_major` false, as k x n
// row-major (C = A B, ldmatrix .trans): blocks of 4 warps over 32 x 32
// tiles of C, k in steps of 16 through shared memory, any m, n, k (the tiles
// are zero-padded).
absl::StatusOr<std::vector<float>> TileGemm(int m, int n, int k, const std::vector<uint16_t>& a,
                                            const std::vector<uint16_t>& b, bool b_k_major);

// One block of 64 threads stages 16-byte chunks of `src` (64 x 4 words) into
// shared memory by cp.async in two groups: group 0 thread t's chunk t, group
// 1 chunk 63 - t where t % 3 != 0 (zeros elsewhere) and, by a 4-byte copy,
// word 0 of chunk t. Per thread, 14 words: [0, 4) its group-0 chunk after
// CpAsyncWait<1>; [4, 8) its group-1 chunk read before its CpAsyncWait<0>
// (undefined on a GPU; the emulation's 0xff bytes); [8, 12) the same after
// that wait; [12] the 4-byte copy after it; [13] word 0 of thread (t + 1) %
// 64's group-0 chunk after a __syncthreads.
absl::StatusOr<std::vector<uint32_t>> AsyncCopies(const std::vector<uint32_t>& src);

}  // namespace colod::kernels::cuda::warp_test

#endif  // COLOD_KERNELS_CUDA_WARP_TEST_KERNELS_H_
