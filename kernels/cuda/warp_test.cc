// The warp-level operations against their definitions: shuffles, votes and
// reductions against closed forms; mma.sync m16n8k16 against a double
// product through the fragment layouts kernels/cuda/warp.h documents;
// ldmatrix (and .trans) against the elements those layouts name; and a
// tensor-core GEMM built from them against a double product; cp.async's
// groups, zero fill and visibility against the copied words. On a GPU this
// checks warp.h's PTX and the layouts; under --config=cuda-emu the
// emulation's models of them, which the tensor-core kernels rely on in CI.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/warp_test_kernels.h"
#include "kernels/device.h"
#include "kernels/half.h"

namespace colod::kernels::cuda::warp_test {
namespace {

class WarpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = FloatToBF16(u(rng));
  return v;
}

TEST_F(WarpTest, ShufflesAndVotesMatchTheirDefinitions) {
  for (int threads : {32, 96}) {
    auto out = Shuffles(threads);
    ASSERT_TRUE(out.ok()) << out.status();
    int warp_sum = 0;
    for (int l = 0; l < 32; ++l) warp_sum += 3 * l + 1;
    uint32_t ballot = 0;
    for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
    for (int t = 0; t < threads; ++t) {
      const int lane = t % 32, v = 3 * lane + 1;
      const int64_t* o = out->data() + 9 * t;
      EXPECT_EQ(o[0], warp_sum) << "thread " << t;
      EXPECT_EQ(o[1], 3 * 5 + 1);
      EXPECT_EQ(o[2], lane == 31 ? v : v + 3);
      EXPECT_EQ(o[3], lane < 2 ? v : v - 6);
      EXPECT_EQ(static_cast<uint32_t>(o[4]), ballot);
      EXPECT_EQ(o[5], 1);
      EXPECT_EQ(o[6], 1);
      EXPECT_EQ(o[7], 0);
      int group = 0;
      for (int l = lane / 8 * 8; l < lane / 8 * 8 + 8; ++l) group += 3 * l + 1;
      EXPECT_EQ(o[8], group) << "thread " << t;
    }
  }
}

TEST_F(WarpTest, MmaComputesTheProductInTheDocumentedFragmentLayout) {
  std::mt19937 rng(7);
  for (bool f16 : {false, true}) {
    std::vector<uint16_t> a(256), b(128);
    std::vector<float> av(256), bv(128), c(128);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (int i = 0; i < 256; ++i) {
      a[i] = f16 ? FloatToF16(u(rng)) : FloatToBF16(u(rng));
      av[i] = f16 ? F16ToFloat(a[i]) : BF16ToFloat(a[i]);
    }
    for (int i = 0; i < 128; ++i) {
      b[i] = f16 ? FloatToF16(u(rng)) : FloatToBF16(u(rng));
      bv[i] = f16 ? F16ToFloat(b[i]) : BF16ToFloat(b[i]);
      c[i] = u(rng);
    }
    auto d = Mma(a, b, c, f16);
    ASSERT_TRUE(d.ok()) << d.status();
    for (int r = 0; r < 16; ++r) {
      for (int n = 0; n < 8; ++n) {
        double want = c[r * 8 + n], mag = std::fabs(c[r * 8 + n]);
        for (int k = 0; k < 16; ++k) {
          want += static_cast<double>(av[r * 16 + k]) * bv[n * 16 + k];
          mag += std::fabs(static_cast<double>(av[r * 16 + k]) * bv[n * 16 + k]);
        }
        // f32 accumulation of 17 terms (the tensor cores' order is theirs).
        EXPECT_NEAR((*d)[r * 8 + n], want, 1e-6 * mag + 1e-7) << (f16 ? "f16" : "bf16") << " D[" << r << "][" << n << "]";
      }
    }
  }
}

TEST_F(WarpTest, LdMatrixGivesTheFragmentsItsLayoutNames) {
  std::vector<uint16_t> tile(256);
  for (int i = 0; i < 256; ++i) tile[i] = static_cast<uint16_t>(1000 + i);  // element (r, c) = 1000 + 16 r + c
  for (bool trans : {false, true}) {
    auto regs = LdMatrix(tile, trans);
    ASSERT_TRUE(regs.ok()) << regs.status();
    for (int lane = 0; lane < 32; ++lane) {
      const int group = lane / 4, pair = lane % 4;
      for (int j = 0; j < 4; ++j) {
        // Matrix j: rows 8 (j % 2) .., columns 8 (j / 2) .. of the tile (lane l gave row l % 16, column 8 (l / 16)).
        const int r0 = 8 * (j % 2), c0 = 8 * (j / 2);
        uint32_t want;
        if (!trans) {  // A's fragment: row `group`, columns 2 pair, 2 pair + 1
          want = tile[(r0 + group) * 16 + c0 + 2 * pair] | static_cast<uint32_t>(tile[(r0 + group) * 16 + c0 + 2 * pair + 1]) << 16;
        } else {  // column `group` of rows 2 pair, 2 pair + 1
          want = tile[(r0 + 2 * pair) * 16 + c0 + group] |
                 static_cast<uint32_t>(tile[(r0 + 2 * pair + 1) * 16 + c0 + group]) << 16;
        }
        EXPECT_EQ((*regs)[lane * 4 + j], want) << (trans ? "trans " : "") << "lane " << lane << " register " << j;
      }
    }
  }
}

TEST_F(WarpTest, AsyncCopiesLandByGroupAndZeroFillWhatTheyDoNotRead) {
  std::vector<uint32_t> src(64 * 4);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0x01000000u + static_cast<uint32_t>(i) * 7919u;
  auto out = AsyncCopies(src);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int t = 0; t < 64; ++t) {
    SCOPED_TRACE("thread " + std::to_string(t));
    const uint32_t* o = out->data() + 14 * t;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(o[i], src[4 * t + i]) << "group 0 after its wait";
      EXPECT_EQ(o[8 + i], t % 3 != 0 ? src[4 * (63 - t) + i] : 0u) << "group 1 after its wait (zeros unread)";
#ifdef COLOD_CUDA_EMULATION
      // The emulation's model of a copy in flight (undefined on a GPU).
      EXPECT_EQ(o[4 + i], 0xffffffffu) << "group 1 before its wait";
#endif
    }
    EXPECT_EQ(o[12], src[4 * t]) << "the 4-byte copy";
    EXPECT_EQ(o[13], src[4 * ((t + 1) % 64)]) << "another thread's copy after the barrier";
  }
#ifdef COLOD_CUDA_EMULATION
  EXPECT_GE(colod_cuda_emu::GetCounters().async_copies, 64u * 3);
#endif
}

TEST_F(WarpTest, ATensorCoreGemmFromThemMatchesADoubleProduct) {
  std::mt19937 rng(11);
  struct Shape {
    int m, n, k;
  };
  // Whole tiles, and edges in every dimension (not multiples of 32, 32, 16).
  for (Shape s : {Shape{64, 64, 64}, Shape{37, 45, 23}, Shape{1, 70, 129}}) {
    for (bool b_k_major : {true, false}) {
      const std::vector<uint16_t> a = RandomBf16(static_cast<size_t>(s.m) * s.k, rng);
      const std::vector<uint16_t> b = RandomBf16(static_cast<size_t>(s.n) * s.k, rng);
#ifdef COLOD_CUDA_EMULATION
      const uint64_t mmas_before = colod_cuda_emu::GetCounters().warp_mmas;
#endif
      auto c = TileGemm(s.m, s.n, s.k, a, b, b_k_major);
      ASSERT_TRUE(c.ok()) << c.status();
#ifdef COLOD_CUDA_EMULATION
      // Every product went through mma.sync: two per warp per k step, four warps per 32 x 32 tile.
      const uint64_t tiles = static_cast<uint64_t>((s.m + 31) / 32) * ((s.n + 31) / 32);
      EXPECT_EQ(colod_cuda_emu::GetCounters().warp_mmas - mmas_before, tiles * 4 * 2 * ((s.k + 15) / 16));
#endif
      for (int i = 0; i < s.m; ++i) {
        for (int j = 0; j < s.n; ++j) {
          double want = 0, mag = 0;
          for (int p = 0; p < s.k; ++p) {
            const double x = BF16ToFloat(a[static_cast<size_t>(i) * s.k + p]);
            const double y = BF16ToFloat(b_k_major ? b[static_cast<size_t>(j) * s.k + p] : b[static_cast<size_t>(p) * s.n + j]);
            want += x * y;
            mag += std::fabs(x * y);
          }
          ASSERT_NEAR((*c)[static_cast<size_t>(i) * s.n + j], want, 2e-6 * mag + 1e-6)
              << s.m << "x" << s.n << "x" << s.k << (b_k_major ? " B^T" : " B") << " C[" << i << "][" << j << "]";
        }
      }
    }
  }
}

TEST_F(WarpTest, BadShapesAreRefused) {
  EXPECT_EQ(Shuffles(48).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TileGemm(0, 4, 4, {}, {}, true).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TileGemm(2, 2, 2, std::vector<uint16_t>(3), std::vector<uint16_t>(4), true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod::kernels::cuda::warp_test
