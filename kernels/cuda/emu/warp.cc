// The warp-level matrix instructions of colod's CUDA emulation, on
// WarpExchange (execution.cc): mma.sync m16n8k16 and ldmatrix, with PTX's
// fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16" and
// "ldmatrix"). Each lane contributes its registers, gets the warp's, and
// computes its own outputs from them. Also the per-thread asynchronous copies
// (cp.async): NaN bytes at the start, the data at the thread's wait.
//
// Thread-safety: called by the CUDA threads of a running block, as the
// hardware instructions are; the copies in flight are the calling CUDA
// thread's (its ThreadContext), no state of this file's own.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/emu/runtime_internal.h"

namespace colod_cuda_emu {
namespace {

float Element(MmaType type, unsigned reg, int half) {
  const unsigned short bits = static_cast<unsigned short>(half == 0 ? reg & 0xffffu : reg >> 16);
  return type == MmaType::kBf16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
}

}  // namespace

void MmaM16N8K16(MmaType type, float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
  struct Lane {
    unsigned a[4];
    unsigned b[2];
  } mine, all[32];
  memcpy(mine.a, a, sizeof mine.a);
  memcpy(mine.b, b, sizeof mine.b);
  WarpExchange(&mine, sizeof mine, 0xffffffffu, all);
  const int lane = LaneId();
  if (lane == 0) CountWarpMma();
  // A (16 x 16, row-major fragments): element (r, k) is in lane
  // 4 (r % 8) + (k % 8) / 2, register r / 8 + 2 (k / 8), half k % 2.
  // B (16 x 8, column-major fragments): element (k, n) is in lane
  // 4 n + (k % 8) / 2, register k / 8, half k % 2.
  // C, D (16 x 8): lane l holds rows l / 4 and l / 4 + 8, columns
  // 2 (l % 4) and 2 (l % 4) + 1: d[i] at row l / 4 + 8 (i / 2), column
  // 2 (l % 4) + i % 2.
  const int group = lane / 4, pair = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = group + 8 * (i / 2), col = 2 * pair + i % 2;
    float acc = c[i];
    for (int k = 0; k < 16; ++k) {
      const float x = Element(type, all[4 * (row % 8) + (k % 8) / 2].a[row / 8 + 2 * (k / 8)], k % 2);
      const float y = Element(type, all[4 * col + (k % 8) / 2].b[k / 8], k % 2);
      acc += x * y;  // exact product (11 or 8 significant bits each)
    }
    out[i] = acc;
  }
  memcpy(d, out, sizeof out);  // d may alias c
}

void LdMatrix(int matrices, bool trans, unsigned* r, const void* row) {
  if (matrices != 1 && matrices != 2 && matrices != 4) Fatal("ldmatrix of " + std::to_string(matrices) + " matrices");
  uintptr_t mine = reinterpret_cast<uintptr_t>(row), all[32];
  WarpExchange(&mine, sizeof mine, 0xffffffffu, all);
  const int lane = LaneId();
  for (int j = 0; j < matrices; ++j) {
    for (int i = 0; i < 8; ++i) {
      if (all[8 * j + i] % 16 != 0) {
        Fatal("ldmatrix: the address of row " + std::to_string(i) + " of matrix " + std::to_string(j) +
              " is not 16-byte aligned, which faults on a GPU");
      }
    }
    unsigned short lo, hi;
    const int group = lane / 4, pair = lane % 4;
    if (!trans) {
      const unsigned short* p = reinterpret_cast<const unsigned short*>(all[8 * j + group]);
      lo = p[2 * pair];
      hi = p[2 * pair + 1];
    } else {
      lo = reinterpret_cast<const unsigned short*>(all[8 * j + 2 * pair])[group];
      hi = reinterpret_cast<const unsigned short*>(all[8 * j + 2 * pair + 1])[group];
    }
    r[j] = static_cast<unsigned>(lo) | static_cast<unsigned>(hi) << 16;
  }
}

void CpAsync(void* dst, const void* src, int bytes, int src_bytes) {
  if (CurrentThread() == nullptr) Fatal("cp.async called outside a kernel");
  if (bytes != 4 && bytes != 8 && bytes != 16) Fatal("cp.async of " + std::to_string(bytes) + " bytes");
  if (src_bytes < 0 || src_bytes > bytes) {
    Fatal("cp.async reading " + std::to_string(src_bytes) + " of " + std::to_string(bytes) + " bytes");
  }
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 || reinterpret_cast<uintptr_t>(src) % bytes != 0) {
    Fatal("cp.async of " + std::to_string(bytes) + " bytes between addresses not aligned to it, which faults on a GPU");
  }
  // Until the wait the destination holds neither its old contents nor the
  // copy's for sure: NaN bytes there make a read before the wait, or a copy
  // over a tile another warp still reads, show in the results.
  memset(dst, 0xff, static_cast<size_t>(bytes));
  CurrentThread()->async_open.push_back(AsyncCopy{dst, src, bytes, src_bytes});
  CountAsyncCopy();
}

void CpAsyncCommit() {
  if (CurrentThread() == nullptr) Fatal("cp.async.commit_group called outside a kernel");
  CurrentThread()->async_groups.push_back(std::move(CurrentThread()->async_open));
  CurrentThread()->async_open.clear();
}

void CpAsyncWait(int groups) {
  if (CurrentThread() == nullptr) Fatal("cp.async.wait_group called outside a kernel");
  if (groups < 0) Fatal("cp.async.wait_group " + std::to_string(groups));
  std::vector<std::vector<AsyncCopy>>& pending = CurrentThread()->async_groups;
  if (pending.size() <= static_cast<size_t>(groups)) return;
  const size_t land = pending.size() - static_cast<size_t>(groups);
  for (size_t g = 0; g < land; ++g) {
    for (const AsyncCopy& c : pending[g]) {
      memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
      memset(static_cast<char*>(c.dst) + c.src_bytes, 0, static_cast<size_t>(c.bytes - c.src_bytes));
    }
  }
  pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(land));
}

}  // namespace colod_cuda_emu
