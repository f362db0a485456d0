// Test kernels of the warp-level operations (warp_test_kernels.h).
#include "kernels/cuda/warp_test_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/status.h"
#include "kernels/cuda/stream.h"
#include "kernels/cuda/warp.h"

namespace colod::kernels::cuda::warp_test {
namespace {

// A device copy of a host vector, freed at scope exit.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  absl::Status Init(size_t n, const T* host = nullptr) {
    COLOD_RETURN_IF_CUDA(cudaMalloc(reinterpret_cast<void**>(&p_), (n == 0 ? 1 : n) * sizeof(T)));
    n_ = n;
    if (host != nullptr && n > 0) COLOD_RETURN_IF_CUDA(cudaMemcpy(p_, host, n * sizeof(T), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<T>> Read() const {
    std::vector<T> out(n_);
    if (n_ > 0) {
      absl::Status s = CudaStatus(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
      if (!s.ok()) return s;
    }
    return out;
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

absl::Status Wait(cudaStream_t stream, const char* what) {
  COLOD_RETURN_IF_CUDA(cudaGetLastError());
  COLOD_RETURN_IF_CUDA(cudaStreamSynchronize(stream));
  return Finish(what);
}

__global__ void ShufflesKernel(int64_t* out) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = 3 * lane + 1;
  int sum = v;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  int64_t* o = out + 9 * t;
  o[0] = sum;
  o[1] = __shfl_sync(0xffffffffu, v, 5);
  o[2] = __shfl_down_sync(0xffffffffu, v, 1);
  o[3] = __shfl_up_sync(0xffffffffu, v, 2);
  o[4] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  o[5] = __any_sync(0xffffffffu, lane == 7);
  o[6] = __all_sync(0xffffffffu, v > 0);
  o[7] = __all_sync(0xffffffffu, lane < 31);
  int group = v;
  for (int offset = 4; offset > 0; offset /= 2) group += __shfl_xor_sync(0xffffffffu, group, offset, 8);
  o[8] = group;
}

__device__ uint32_t Pair(const uint16_t* m, int lo, int hi) {
  return static_cast<uint32_t>(m[lo]) | static_cast<uint32_t>(m[hi]) << 16;
}

__global__ void MmaKernel(const uint16_t* a, const uint16_t* b, const float* c, float* d, bool f16) {
  const int lane = threadIdx.x, group = lane / 4, pair = lane % 4;
  uint32_t fa[4], fb[2];
  fa[0] = Pair(a, group * 16 + 2 * pair, group * 16 + 2 * pair + 1);
  fa[1] = Pair(a, (group + 8) * 16 + 2 * pair, (group + 8) * 16 + 2 * pair + 1);
  fa[2] = Pair(a, group * 16 + 8 + 2 * pair, group * 16 + 9 + 2 * pair);
  fa[3] = Pair(a, (group + 8) * 16 + 8 + 2 * pair, (group + 8) * 16 + 9 + 2 * pair);
  fb[0] = Pair(b, group * 16 + 2 * pair, group * 16 + 2 * pair + 1);  // b[n][k]: n = group
  fb[1] = Pair(b, group * 16 + 8 + 2 * pair, group * 16 + 9 + 2 * pair);
  float fc[4], fd[4];
  for (int i = 0; i < 4; ++i) fc[i] = c[(group + 8 * (i / 2)) * 8 + 2 * pair + i % 2];
  if (f16) {
    MmaF16(fd, fa, fb, fc);
  } else {
    MmaBf16(fd, fa, fb, fc);
  }
  for (int i = 0; i < 4; ++i) d[(group + 8 * (i / 2)) * 8 + 2 * pair + i % 2] = fd[i];
}

__global__ void LdMatrixKernel(const uint16_t* tile, uint32_t* out, bool trans) {
  alignas(16) __shared__ uint16_t s[16 * 16];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) s[i] = tile[i];
  __syncwarp();
  uint32_t r[4];
  const uint16_t* row = &s[(lane % 16) * 16 + 8 * (lane / 16)];
  if (trans) {
    LdMatrixX4Trans(r, row);
  } else {
    LdMatrixX4(r, row);
  }
  for (int j = 0; j < 4; ++j) out[lane * 4 + j] = r[j];
}

// 32 x 32 tiles of C per block of 4 warps; warp w computes rows
// 16 (w / 2) .. +16 and columns 16 (w % 2) .. +16 as two n8 tiles. Rows of
// the shared tiles are padded by 8 elements (16 bytes) so that ldmatrix's
// eight rows fall in different banks.
constexpr int kTile = 32, kStep = 16, kPad = 8;

__global__ void TileGemmKernel(int m, int n, int k, const uint16_t* a, const uint16_t* b, bool b_k_major,
                               float* c) {
  alignas(16) __shared__ uint16_t sa[kTile][kStep + kPad];
  // B's tile: n rows of k (b_k_major) or k rows of n.
  alignas(16) __shared__ uint16_t sb[kTile][kTile + kPad];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  const int wr = 16 * (warp / 2), wc = 16 * (warp % 2);
  float acc[2][4] = {};
  for (int k0 = 0; k0 < k; k0 += kStep) {
    for (int i = t; i < kTile * kStep; i += blockDim.x) {
      const int r = i / kStep, kk = i % kStep;
      sa[r][kk] = row0 + r < m && k0 + kk < k ? a[static_cast<int64_t>(row0 + r) * k + k0 + kk] : 0;
      if (b_k_major) {
        sb[r][kk] = col0 + r < n && k0 + kk < k ? b[static_cast<int64_t>(col0 + r) * k + k0 + kk] : 0;
      } else {
        const int kr = i / kTile, cc = i % kTile;  // kStep rows of kTile columns
        sb[kr][cc] = k0 + kr < k && col0 + cc < n ? b[static_cast<int64_t>(k0 + kr) * n + col0 + cc] : 0;
      }
    }
    __syncthreads();
    uint32_t fa[4], fb[4];
    LdMatrixX4(fa, &sa[wr + lane % 16][8 * (lane / 16)]);
    if (b_k_major) {
      // lanes 0-7: n rows 0-7 at k 0; 8-15: the same rows at k 8; 16-31: n rows 8-15.
      LdMatrixX4(fb, &sb[wc + lane % 8 + 8 * (lane / 16)][8 * ((lane / 8) % 2)]);
    } else {
      // lanes 0-7: k rows 0-7 at n 0; 8-15: k rows 8-15 at n 0; 16-31: the same at n 8.
      LdMatrixX4Trans(fb, &sb[lane % 16][wc + 8 * (lane / 16)]);
    }
    MmaBf16(acc[0], fa, fb, acc[0]);
    MmaBf16(acc[1], fa, fb + 2, acc[1]);
    __syncthreads();
  }
  const int group = lane / 4, pair = lane % 4;
  for (int j = 0; j < 2; ++j) {
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + wr + group + 8 * (i / 2), col = col0 + wc + 8 * j + 2 * pair + i % 2;
      if (r < m && col < n) c[static_cast<int64_t>(r) * n + col] = acc[j][i];
    }
  }
}

__global__ void AsyncCopiesKernel(const uint32_t* src, uint32_t* out) {
  alignas(16) __shared__ uint32_t first[64][4];
  alignas(16) __shared__ uint32_t second[64][4];
  alignas(16) __shared__ uint32_t word[64];
  const int t = threadIdx.x;
  uint32_t* o = out + 14 * t;
  CpAsync16(first[t], src + 4 * t, true);
  CpAsyncCommit();
  const int back = 63 - t;
  CpAsync16(second[t], src + 4 * back, t % 3 != 0);
  CpAsync4(&word[t], src + 4 * t, true);
  CpAsyncCommit();
  CpAsyncWait<1>();
  for (int i = 0; i < 4; ++i) o[i] = first[t][i];
  for (int i = 0; i < 4; ++i) o[4 + i] = second[t][i];
  CpAsyncWait<0>();
  for (int i = 0; i < 4; ++i) o[8 + i] = second[t][i];
  o[12] = word[t];
  __syncthreads();
  o[13] = first[(t + 1) % 64][0];
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> Shuffles(int threads) {
  if (threads <= 0 || threads % 32 != 0 || threads > 1024) {
    return absl::InvalidArgumentError("Shuffles: threads must be whole warps, at most 1024");
  }
  COLOD_CUDA_BEGIN(stream, 0);
  Buffer<int64_t> out;
  if (absl::Status s = out.Init(9 * static_cast<size_t>(threads)); !s.ok()) return s;
  Launch(ShufflesKernel, dim3(1), dim3(threads), stream, out.get());
  if (absl::Status s = Wait(stream, "ShufflesKernel"); !s.ok()) return s;
  return out.Read();
}

absl::StatusOr<std::vector<float>> Mma(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                                       const std::vector<float>& c, bool f16) {
  if (a.size() != 256 || b.size() != 128 || c.size() != 128) return absl::InvalidArgumentError("Mma: A 16x16, B, C 16x8");
  COLOD_CUDA_BEGIN(stream, 0);
  Buffer<uint16_t> da, db;
  Buffer<float> dc, dd;
  for (absl::Status s : {da.Init(a.size(), a.data()), db.Init(b.size(), b.data()), dc.Init(c.size(), c.data()),
                         dd.Init(128)}) {
    if (!s.ok()) return s;
  }
  Launch(MmaKernel, dim3(1), dim3(32), stream, da.get(), db.get(), dc.get(), dd.get(), f16);
  if (absl::Status s = Wait(stream, "MmaKernel"); !s.ok()) return s;
  return dd.Read();
}

absl::StatusOr<std::vector<uint32_t>> LdMatrix(const std::vector<uint16_t>& tile, bool trans) {
  if (tile.size() != 256) return absl::InvalidArgumentError("LdMatrix: a 16x16 tile");
  COLOD_CUDA_BEGIN(stream, 0);
  Buffer<uint16_t> dt;
  Buffer<uint32_t> out;
  for (absl::Status s : {dt.Init(tile.size(), tile.data()), out.Init(128)}) {
    if (!s.ok()) return s;
  }
  Launch(LdMatrixKernel, dim3(1), dim3(32), stream, dt.get(), out.get(), trans);
  if (absl::Status s = Wait(stream, "LdMatrixKernel"); !s.ok()) return s;
  return out.Read();
}

absl::StatusOr<std::vector<float>> TileGemm(int m, int n, int k, const std::vector<uint16_t>& a,
                                            const std::vector<uint16_t>& b, bool b_k_major) {
  if (m <= 0 || n <= 0 || k <= 0 || m > (1 << 16) || n > (1 << 16) || k > (1 << 16) ||
      a.size() != static_cast<size_t>(m) * k || b.size() != static_cast<size_t>(n) * k) {
    return absl::InvalidArgumentError("TileGemm: A m x k, B n x k, each dimension in [1, 65536]");
  }
  COLOD_CUDA_BEGIN(stream, 0);
  Buffer<uint16_t> da, db;
  Buffer<float> dc;
  for (absl::Status s : {da.Init(a.size(), a.data()), db.Init(b.size(), b.data()),
                         dc.Init(static_cast<size_t>(m) * n)}) {
    if (!s.ok()) return s;
  }
  Launch(TileGemmKernel, dim3((n + kTile - 1) / kTile, (m + kTile - 1) / kTile), dim3(128), stream, m, n, k,
         da.get(), db.get(), b_k_major, dc.get());
  if (absl::Status s = Wait(stream, "TileGemmKernel"); !s.ok()) return s;
  return dc.Read();
}

absl::StatusOr<std::vector<uint32_t>> AsyncCopies(const std::vector<uint32_t>& src) {
  if (src.size() != 64 * 4) return absl::InvalidArgumentError("AsyncCopies: 64 chunks of 4 words");
  COLOD_CUDA_BEGIN(stream, 0);
  Buffer<uint32_t> ds, out;
  for (absl::Status s : {ds.Init(src.size(), src.data()), out.Init(64 * 14)}) {
    if (!s.ok()) return s;
  }
  Launch(AsyncCopiesKernel, dim3(1), dim3(64), stream, ds.get(), out.get());
  if (absl::Status s = Wait(stream, "AsyncCopiesKernel"); !s.ok()) return s;
  return out.Read();
}

}  // namespace colod::kernels::cuda::warp_test
