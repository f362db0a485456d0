// The fused attention kernel (kernels/cuda FlashAttention and its backward)
// on a CUDA device against the per-head reference (GEMMs and softmax) on the
// CPU, in values and in the gradients of q, k and v: causal and
// bidirectional masks, grouped-query heads, head dims 64, 80, 96 and 128 (the
// tensor-core kernels' in bf16 and f16) and 8 and 256 (the scalar ones'), and
// sequence lengths that are not multiples of the kernels' tiles (64 query
// rows a block, 128 in the tensor-core forward and dq kernels at head dim
// 64; 64, 32 or 16 keys a tile). CI runs it under the CUDA emulation.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include "gtest/gtest.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/device.h"
#include "worker/nn/functional.h"
#include "worker/tensor/ops.h"

namespace colod::nn {
namespace {

struct Case {
  int64_t batch, seq, hq, hkv, d;
  bool causal;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "b" << c.batch << " s" << c.seq << " hq" << c.hq << " hkv" << c.hkv << " d" << c.d
            << (c.causal ? " causal" : " bidirectional");
}

class CudaAttention : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

void ExpectNear(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.ToFloats(), w = want.ToFloats();
  ASSERT_GT(w.size(), 0u) << what;
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], tol * (1 + std::fabs(w[i]))) << what << " at " << i;
}

// For the half types: within tol * (|want| + 0.1 * want's largest magnitude),
// element by element (values near zero are held to units of the largest).
void ExpectNearOfLargest(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const std::vector<float> g = got.ToFloats(), w = want.ToFloats();
  ASSERT_EQ(g.size(), w.size()) << what;
  float largest = 0;
  for (float x : w) largest = std::max(largest, std::fabs(x));
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], w[i], tol * (std::fabs(w[i]) + 0.1 * largest)) << what << " at " << i;
  }
}

// The same values, bit for bit (a second run of a deterministic kernel).
void ExpectSameBits(const Tensor& first, const Tensor& second, const std::string& what) {
  const std::vector<float> x = first.ToFloats(), y = second.ToFloats();
  ASSERT_EQ(x.size(), y.size()) << what;
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << what;
}

// An attention's inputs, standard normal in `type`: q [batch, seq, hq, d],
// k and v [batch, seq, hkv, d], and r (out's gradient, as q), drawn with
// seeds seed .. seed + 3.
struct Inputs {
  Tensor q, k, v, r;
};
Inputs RandomInputs(const Case& c, uint64_t seed, DType type = DType::kF32) {
  auto make = [type](const Shape& shape, uint64_t s) { return *Tensor::RandomNormal(shape, s, type); };
  return {make({c.batch, c.seq, c.hq, c.d}, seed), make({c.batch, c.seq, c.hkv, c.d}, seed + 1),
          make({c.batch, c.seq, c.hkv, c.d}, seed + 2), make({c.batch, c.seq, c.hq, c.d}, seed + 3)};
}

struct Result {
  Tensor out, dq, dk, dv;
};

// out = Attention(q, k, v) on `dev` with `impl` (AlibiAttention with
// `slopes` where set), and the gradients of sum(out * r).
Result RunAttention(const Case& c, Device dev, AttentionImpl impl, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& r, const std::vector<float>& slopes = {}) {
  Variable vq(*q.To(dev), true), vk(*k.To(dev), true), vv(*v.To(dev), true);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  absl::StatusOr<Variable> out = slopes.empty() ? Attention(vq, vk, vv, scale, c.causal, impl)
                                                : AlibiAttention(vq, vk, vv, scale, slopes, impl);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  EXPECT_TRUE(Backward(*Sum(*Mul(*out, Variable(*r.To(dev))))).ok());
  return {*out->value().To(Device::Cpu()), *vq.grad()->To(Device::Cpu()), *vk.grad()->To(Device::Cpu()),
          *vv.grad()->To(Device::Cpu())};
}

TEST_P(CudaAttention, FusedKernelMatchesThePerHeadReferenceInValuesAndGradients) {
  const Case c = GetParam();
  const auto [q, k, v, r] = RandomInputs(c, 11);
  const Result want = RunAttention(c, Device::Cpu(), AttentionImpl::kPerHead, q, k, v, r);
  // kAuto: what the models run on a CUDA device (the fused kernel).
  const Result got = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
  ExpectNear(got.out, want.out, 1e-4, "out");
  ExpectNear(got.dq, want.dq, 2e-4, "dq");
  ExpectNear(got.dk, want.dk, 2e-4, "dk");
  ExpectNear(got.dv, want.dv, 2e-4, "dv");
  // No atomics: a second run repeats every gradient bit for bit.
  const Result again = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
  ExpectSameBits(got.dq, again.dq, "dq");
  ExpectSameBits(got.dk, again.dk, "dk");
  ExpectSameBits(got.dv, again.dv, "dv");
}

// bf16 (the GPU default) and f16 operands are read by the kernels as they
// are and accumulated in f32: out and the gradients come in that dtype,
// within its rounding of the per-head reference computed in f32 on the same
// (widened) values. The gradients read the rounded out (as flash-attention's
// do), so they are held to a few ulps of the largest gradient.
TEST_P(CudaAttention, HalfOperandsStayHalfAndMatchTheF32Reference) {
  const Case c = GetParam();
  for (DType t : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(t));
    const double ulp = t == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
    const auto [q, k, v, r] = RandomInputs(c, 21, t);
    auto wide = [](const Tensor& x) { return *x.ToDType(DType::kF32); };
    const Result want = RunAttention(c, Device::Cpu(), AttentionImpl::kPerHead, wide(q), wide(k), wide(v), wide(r));
    const Result got = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    const std::pair<const Tensor*, const Tensor*> pairs[] = {
        {&got.out, &want.out}, {&got.dq, &want.dq}, {&got.dk, &want.dk}, {&got.dv, &want.dv}};
    const char* names[] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; ++i) {
      const auto& [g, w] = pairs[i];
      ASSERT_EQ(g->dtype(), t) << names[i];
      // out: rounding of the inputs, of P before P V (the tensor-core path
      // multiplies P in the operand type, as FlashAttention-2 does) and of
      // the output; the gradients: and of out, and of P and dS before the
      // products that give dv, dq and dk.
      ExpectNearOfLargest(*g, *w, i == 0 ? 2 * ulp : 4 * ulp, names[i]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Values(Case{1, 67, 4, 4, 64, true}, Case{1, 67, 4, 4, 64, false},
                      Case{1, 200, 4, 2, 64, true},    // GQA; two 128-row blocks of the forward, one partial
                      Case{2, 100, 4, 2, 128, true},   // GQA, 2 query heads a kv head
                      Case{1, 100, 8, 2, 128, false},  // GQA, 4 a kv head
                      Case{1, 70, 4, 2, 80, true},     // the tensor-core path's other head dims
                      Case{2, 90, 3, 3, 96, false},
                      Case{2, 45, 3, 1, 8, true},      // multi-query, a small head
                      Case{1, 130, 2, 2, 256, true}),  // the largest fused head dim
    [](const auto& info) {
      const Case& c = info.param;
      return "s" + std::to_string(c.seq) + "_hq" + std::to_string(c.hq) + "_hkv" + std::to_string(c.hkv) + "_d" +
             std::to_string(c.d) + (c.causal ? "_causal" : "_bidirectional");
    });

// Sets the environment variable `name` to `value` (nullptr: unset) for its
// scope, and puts back what the environment had: COLOD_ATTENTION_ROW_TILES
// (1: one row tile a warp), COLOD_DETERMINISTIC (1: the two-kernel backward
// without atomics).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = getenv(name_);
    if (old != nullptr) saved_ = old;
    Set(value);
  }
  ~ScopedEnv() { Set(saved_.has_value() ? saved_->c_str() : nullptr); }
  void Set(const char* value) {
    if (value != nullptr) {
      setenv(name_, value, 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

class ScopedRowTiles : public ScopedEnv {
 public:
  explicit ScopedRowTiles(const char* value) : ScopedEnv("COLOD_ATTENTION_ROW_TILES", value) {}
};

class ScopedDeterministic : public ScopedEnv {
 public:
  explicit ScopedDeterministic(const char* value) : ScopedEnv("COLOD_DETERMINISTIC", value) {}
};

// A second run's gradients against the first's. dk and dv (and the bias's
// gradient) come out of a fixed order either way: the same bits. dq too on
// the scalar kernels and under COLOD_DETERMINISTIC=1; the one-pass
// tensor-core backward adds its dq in an order the GPU's scheduling sets,
// so there within one unit of `type` (an f32 sum's last bits, rounded).
void ExpectRepeats(const Result& first, const Result& second, DType type) {
  ExpectSameBits(first.dk, second.dk, "dk");
  ExpectSameBits(first.dv, second.dv, "dv");
  const char* det = getenv("COLOD_DETERMINISTIC");
  if (type == DType::kF32 || (det != nullptr && std::string(det) == "1")) {
    ExpectSameBits(first.dq, second.dq, "dq");
  } else {
    ExpectNearOfLargest(first.dq, second.dq, type == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024, "dq");
  }
}

// At head dim 64 the tensor-core forward and dq kernels give each warp two
// row tiles of 16 (128-row blocks; dq walks keys in tiles of 16), at 128 the
// forward (Q's fragments read from shared memory at each key tile, keys in
// tiles of 32); with COLOD_ATTENTION_ROW_TILES=1, one (64-row blocks, 64-key
// tiles: the kernels as they were, which bench:layers compares on a GPU). At
// 64 a row's products and sums are the same either way, in the same order
// (keys in steps of 16), so out and every gradient agree bit for bit, in
// bf16 and f16, causal or not, over row blocks of either size that end past
// the sequence (the backward's under COLOD_DETERMINISTIC=1, the dq kernel's
// row tiles). At 128 the online softmax rescales every 32 keys where it
// rescaled every 64, so P, rounded to the half type before P V, is rounded
// from other values: the two agree as each agrees with the f32 reference
// (HalfOperandsStayHalfAndMatchTheF32Reference), within two units of the
// half type for out and four for the gradients (of the largest value, for
// those near zero).
TEST(CudaAttentionTensorCores, TwoRowTilesAWarpGiveOneTilesBits) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const auto& [t, c] : {std::pair{DType::kBF16, Case{1, 200, 4, 2, 64, true}},
                             std::pair{DType::kF16, Case{1, 150, 2, 1, 64, false}},
                             std::pair{DType::kBF16, Case{2, 140, 2, 1, 128, true}},
                             std::pair{DType::kF16, Case{1, 100, 4, 2, 128, false}}}) {
    SCOPED_TRACE(std::string(DTypeName(t)) + " d" + std::to_string(c.d) + (c.causal ? " causal" : " bidirectional"));
    const auto [q, k, v, r] = RandomInputs(c, 31, t);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t copies_before = colod_cuda_emu::GetCounters().async_copies;
#endif
    ScopedRowTiles tiles(nullptr);
    ScopedDeterministic deterministic("1");  // the dq kernel's row tiles
    const Result two = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    tiles.Set("1");
#ifdef COLOD_CUDA_EMULATION
    const uint64_t copies_between = colod_cuda_emu::GetCounters().async_copies;
#endif
    const Result one = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
#ifdef COLOD_CUDA_EMULATION
    // The two ran different kernels: 128-row blocks stage each K and V tile
    // half as often.
    const uint64_t copies_after = colod_cuda_emu::GetCounters().async_copies;
    EXPECT_LT(copies_between - copies_before, copies_after - copies_between);
#endif
    if (c.d == 64) {
      ExpectSameBits(two.out, one.out, "out");
      ExpectSameBits(two.dq, one.dq, "dq");
      ExpectSameBits(two.dk, one.dk, "dk");
      ExpectSameBits(two.dv, one.dv, "dv");
    } else {
      const double ulp = t == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
      ExpectNearOfLargest(two.out, one.out, 2 * ulp, "out");
      ExpectNearOfLargest(two.dq, one.dq, 4 * ulp, "dq");
      ExpectNearOfLargest(two.dk, one.dk, 4 * ulp, "dk");
      ExpectNearOfLargest(two.dv, one.dv, 4 * ulp, "dv");
    }
  }
}

// The one-pass tensor-core backward (the default) against the two kernels
// of COLOD_DETERMINISTIC=1: the same walk, products and order for dk and
// dv, so the same bits; dq summed over the key blocks by f32 reductions in
// another order, so within one unit of the half type of the deterministic
// kernel's, element by element (plus a hundredth of a unit of the largest,
// for sums that cancel). At every tensor-core head dim, causal or not, GQA,
// lengths off the 64-key blocks and the query tiles.
TEST(CudaAttentionTensorCores, OnePassBackwardMatchesTheDeterministicKernels) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const auto& [t, c] : {std::pair{DType::kBF16, Case{1, 200, 4, 2, 64, true}},
                             std::pair{DType::kF16, Case{2, 67, 2, 2, 64, false}},
                             std::pair{DType::kBF16, Case{1, 70, 4, 2, 80, true}},
                             std::pair{DType::kF16, Case{2, 90, 3, 3, 96, false}},
                             std::pair{DType::kBF16, Case{1, 100, 8, 2, 128, false}},
                             std::pair{DType::kF16, Case{2, 100, 4, 2, 128, true}}}) {
    SCOPED_TRACE(::testing::PrintToString(c) + " " + std::string(DTypeName(t)));
    const auto [q, k, v, r] = RandomInputs(c, 51, t);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t launches = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    ScopedDeterministic mode("1");
    const Result two = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    mode.Set(nullptr);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t between = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    const Result one = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
#ifdef COLOD_CUDA_EMULATION
    // The one-pass backward launches 3 kernels (delta and the zeroed
    // buffer, the pass, dq's rounding) where the deterministic one launches
    // 2 (dq, then dk and dv).
    EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - between, between - launches + 1);
#endif
    ExpectSameBits(one.out, two.out, "out");
    ExpectSameBits(one.dk, two.dk, "dk");
    ExpectSameBits(one.dv, two.dv, "dv");
    const double ulp = t == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
    const std::vector<float> got = one.dq.ToFloats(), want = two.dq.ToFloats();
    ASSERT_EQ(got.size(), want.size());
    float largest = 0;
    for (float x : want) largest = std::max(largest, std::fabs(x));
    ASSERT_GT(largest, 0.0f);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], ulp * std::fabs(want[i]) + 0.01 * ulp * largest) << "dq at " << i;
    }
  }
}

#ifdef COLOD_CUDA_EMULATION
// Where the one-pass backward's f32 dQ buffer cannot be allocated (a full
// device: the emulation fails that one cudaMallocAsync), the backward runs
// the two kernels of COLOD_DETERMINISTIC=1 instead: their launches and
// their bits, dq's too; the failed allocation leaves no error behind, and
// the next backward gets its buffer and runs in one pass again.
TEST(CudaAttentionTensorCores, OnePassBackwardWithoutItsBufferRunsTheTwoKernels) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const auto& [t, c] : {std::pair{DType::kBF16, Case{1, 70, 4, 2, 64, true}},
                             std::pair{DType::kF16, Case{2, 40, 2, 2, 128, false}}}) {
    SCOPED_TRACE(::testing::PrintToString(c) + " " + std::string(DTypeName(t)));
    const auto [q, k, v, r] = RandomInputs(c, 61, t);
    const size_t buffer_bytes = static_cast<size_t>(c.batch * c.seq * c.hq * c.d) * sizeof(float);
    auto launches = [] { return colod_cuda_emu::GetCounters().kernel_launches; };
    ScopedDeterministic mode(nullptr);
    const uint64_t l0 = launches();
    const Result one_pass = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    const uint64_t l1 = launches();
    mode.Set("1");
    const Result two = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    mode.Set(nullptr);
    const uint64_t l2 = launches();
    ASSERT_EQ(l1 - l0, l2 - l1 + 1);  // 3 backward kernels, 2 deterministic
    colod_cuda_emu::FailNextAsyncAllocation(buffer_bytes);
    const Result fallback = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    const uint64_t l3 = launches();
    EXPECT_FALSE(colod_cuda_emu::AsyncAllocationFailureArmed()) << "nothing asked for the buffer";
    colod_cuda_emu::FailNextAsyncAllocation(0);
    EXPECT_EQ(l3 - l2, l2 - l1);
    ExpectSameBits(fallback.out, two.out, "out");
    ExpectSameBits(fallback.dq, two.dq, "dq");
    ExpectSameBits(fallback.dk, two.dk, "dk");
    ExpectSameBits(fallback.dv, two.dv, "dv");
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    const Result again = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
    EXPECT_EQ(launches() - l3, l1 - l0);
    ExpectSameBits(again.dk, one_pass.dk, "dk, one pass again");
  }
}
#endif

// COLOD_ATTENTION=cudnn: cuDNN's fused attention serves the forward and
// the backward where it can be had, a GPU with libcudnn.so.9 (then both are
// counted, and a missing library is a failure saying why); under the
// emulation, which has no cuDNN, colod's kernels run instead. Either way
// out and the gradients are the per-head reference's within bf16's
// rounding (P and dS rounded before their products, as the tensor-core
// kernels do); ALiBi is not cuDNN's, so it always runs on colod's kernels.
TEST(CudaAttentionCudnn, RequestedCudnnMatchesTheReferenceOrColodsKernelsRunInstead) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Restore {
    ~Restore() { unsetenv("COLOD_ATTENTION"); }
  } restore;
  setenv("COLOD_ATTENTION", "cudnn", 1);
  const double ulp = 1.0 / 128;
  for (const Case& c : {Case{2, 100, 4, 2, 64, true}, Case{1, 70, 4, 4, 128, false}}) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const auto [q, k, v, r] = RandomInputs(c, 31, DType::kBF16);
    auto wide = [](const Tensor& x) { return *x.ToDType(DType::kF32); };
    const Result want = RunAttention(c, Device::Cpu(), AttentionImpl::kPerHead, wide(q), wide(k), wide(v), wide(r));
    const int64_t calls = kernels::cuda::CudnnAttentionCalls();
    const Result got = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
#ifdef COLOD_CUDA_EMULATION
    EXPECT_EQ(kernels::cuda::CudnnAttentionCalls(), calls) << "the emulation has no cuDNN";
#else
    EXPECT_EQ(kernels::cuda::CudnnAttentionCalls(), calls + 2) << "cuDNN did not serve the forward and backward "
                                                                   "(its reason is on stderr)";
#endif
    ExpectNearOfLargest(got.out, want.out, 2 * ulp, "out");
    ExpectNearOfLargest(got.dq, want.dq, 4 * ulp, "dq");
    ExpectNearOfLargest(got.dk, want.dk, 4 * ulp, "dk");
    ExpectNearOfLargest(got.dv, want.dv, 4 * ulp, "dv");
  }
  const Case c{1, 40, 2, 2, 64, true};
  const auto [q, k, v, r] = RandomInputs(c, 41, DType::kBF16);
  const int64_t calls = kernels::cuda::CudnnAttentionCalls();
  RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r, {0.5f, 0.25f});
  EXPECT_EQ(kernels::cuda::CudnnAttentionCalls(), calls) << "ALiBi runs on colod's kernels";
}

// BLOOM's ALiBi on the fused kernels (the slopes passed to them): f32 on the
// scalar kernels, bf16 on the tensor-core ones (head dims 64 and 128), a
// head count that is not a power of two (BLOOM's second slope series), GQA,
// against the per-head path's bias on the CPU in f32; the backward repeats
// (ExpectRepeats).
TEST(CudaAttentionAlibi, FusedKernelsMatchThePerHeadReference) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const Case& c : {Case{2, 70, 6, 6, 64, true}, Case{1, 100, 4, 2, 128, true}}) {
    const std::vector<float> slopes = AlibiSlopes(c.hq);
    for (DType t : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::PrintToString(c) + " " + std::string(DTypeName(t)));
      const auto [q, k, v, r] = RandomInputs(c, 31, t);
      auto wide = [](const Tensor& x) { return *x.ToDType(DType::kF32); };
      const Result want =
          RunAttention(c, Device::Cpu(), AttentionImpl::kPerHead, wide(q), wide(k), wide(v), wide(r), slopes);
      const Result plain = RunAttention(c, Device::Cpu(), AttentionImpl::kPerHead, wide(q), wide(k), wide(v), wide(r));
      const Result got = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r, slopes);
      const double ulp = t == DType::kBF16 ? 1.0 / 128 : 0.0;
      const std::pair<const Tensor*, const Tensor*> pairs[] = {
          {&got.out, &want.out}, {&got.dq, &want.dq}, {&got.dk, &want.dk}, {&got.dv, &want.dv}};
      const char* names[] = {"out", "dq", "dk", "dv"};
      for (int i = 0; i < 4; ++i) {
        if (t == DType::kF32) {
          ExpectNear(*pairs[i].first, *pairs[i].second, 2e-4, names[i]);
        } else {
          ExpectNearOfLargest(*pairs[i].first, *pairs[i].second, (i == 0 ? 2 : 4) * ulp, names[i]);
        }
      }
      // The slopes matter: the output moves far beyond the tolerance.
      const std::vector<float> biased = want.out.ToFloats(), unbiased = plain.out.ToFloats();
      double moved = 0;
      for (size_t j = 0; j < biased.size(); ++j) moved = std::max(moved, double{std::fabs(biased[j] - unbiased[j])});
      EXPECT_GT(moved, 0.1);
      const Result again = RunAttention(c, Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r, slopes);
      ExpectRepeats(got, again, t);
    }
  }
}

// T5's learned relative position bias on the fused kernels (self-attention,
// encoder bidirectional and decoder causal): f32 on the scalar kernels, bf16
// and f16 on the tensor-core ones, against the per-head path's bias on the
// CPU in f32, in values, the gradients of q, k, v and of the bias (the
// scores' gradients summed over the batch); the backward repeats
// (ExpectRepeats; the bias's gradient bit for bit).
// The half types' gradients are held to 8 units of their precision: a
// unit-variance bias sharpens the rows (and the first causal rows see few
// keys), so the rounding of P and dS weighs more than in the unbiased cases
// above; measured at head dim 128, causal, dq's worst was 7.4 bf16 units and
// 3.8 f16 units, errors that shrink with the precision as rounding does (a
// mistake in the kernels would not).
TEST(CudaAttentionBias, FusedKernelsMatchThePerHeadReference) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const Case& c : {Case{2, 70, 4, 4, 64, false}, Case{2, 67, 2, 2, 128, true}}) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::PrintToString(c) + " " + std::string(DTypeName(t)));
      const auto [q, k, v, r] = RandomInputs(c, 41, t);
      const Tensor bias = *Tensor::RandomNormal({c.hq, c.seq, c.seq}, 45);  // f32, as T5's table gives it
      auto wide = [](const Tensor& x) { return *x.ToDType(DType::kF32); };
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
      struct Run {
        Tensor out, dq, dk, dv, dbias;
      };
      auto run = [&](Device dev, AttentionImpl impl, const Tensor& qt, const Tensor& kt, const Tensor& vt,
                     const Tensor& rt) -> Run {
        Variable vq(*qt.To(dev), true), vk(*kt.To(dev), true), vv(*vt.To(dev), true), vb(*bias.To(dev), true);
        absl::StatusOr<Variable> out = BiasedAttention(vq, vk, vv, scale, c.causal, vb, impl);
        EXPECT_TRUE(out.ok()) << out.status();
        if (!out.ok()) return {};
        EXPECT_TRUE(Backward(*Sum(*Mul(*out, Variable(*rt.To(dev))))).ok());
        auto cpu = [](const Tensor& x) { return *x.To(Device::Cpu()); };
        return {cpu(out->value()), cpu(*vq.grad()), cpu(*vk.grad()), cpu(*vv.grad()), cpu(*vb.grad())};
      };
      const Run want = run(Device::Cpu(), AttentionImpl::kPerHead, wide(q), wide(k), wide(v), wide(r));
      const Run got = run(Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
      const double ulp = t == DType::kBF16 ? 1.0 / 128 : 1.0 / 1024;
      const std::pair<const Tensor*, const Tensor*> pairs[] = {{&got.out, &want.out}, {&got.dq, &want.dq},
                                                               {&got.dk, &want.dk},   {&got.dv, &want.dv},
                                                               {&got.dbias, &want.dbias}};
      const char* names[] = {"out", "dq", "dk", "dv", "dbias"};
      for (int i = 0; i < 5; ++i) {
        if (t == DType::kF32) {
          ExpectNear(*pairs[i].first, *pairs[i].second, 2e-4, names[i]);
        } else {
          ExpectNearOfLargest(*pairs[i].first, *pairs[i].second, (i == 0 ? 2 : 8) * ulp, names[i]);
        }
      }
      const Run again = run(Device::Cuda(0), AttentionImpl::kAuto, q, k, v, r);
      ExpectRepeats({got.out, got.dq, got.dk, got.dv}, {again.out, again.dq, again.dk, again.dv}, t);
      ExpectSameBits(got.dbias, again.dbias, "dbias");
    }
  }
}

// The kernels read q, k and v where they are (kernels::AttentionLayout):
// the slices of GPT-2's packed [B, S, 3, H, D] and BLOOM's [B, S, H, 3, D],
// and grouped-query q, k and v packed apart (q a BLOOM-style slice, k and v
// GPT-2-style ones), and write dq, dk and dv into the slices of packed
// buffers (ops::AttentionGradPlaces; in the grouped-query case dq's place
// contiguous and dk's and dv's BLOOM-style: every layout of the four
// differs there): the same out and lse bits as over contiguous copies, the
// same gradients (ExpectRepeats: dq of the one-pass tensor-core backward
// within a unit), and on the emulation no launch but the attention's. The
// scalar kernels (f32, head dim 16) and the tensor-core ones (bf16, 64;
// 128, whose forward reads Q from shared memory), the one-pass backward and
// the two kernels of COLOD_DETERMINISTIC=1. And gradients written over q, k
// and v themselves.
TEST(CudaAttentionLayouts, PackedSlicesAreReadAndWrittenInPlace) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::Cuda(0);
  // A tensor and which slice of which dim an operand is (dim -1: the tensor).
  struct Slice {
    Shape shape;
    int64_t dim, index;
  };
  struct Packing {
    const char* name;
    Slice q, k, v, dq, dk, dv;  // the gradients' places alike
  };
  for (const auto& [type, d] : {std::pair{DType::kF32, int64_t{16}}, std::pair{DType::kBF16, int64_t{64}},
                                std::pair{DType::kBF16, int64_t{128}}}) {
    const Shape gpt2{2, 70, 3, 2, d}, bloom{2, 70, 2, 3, d};
    const Shape q_apart{2, 70, 4, 2, d}, kv_apart{2, 70, 2, 2, d}, dq_apart{2, 70, 4, d};
    for (const Packing& p :
         {Packing{"gpt2", {gpt2, 2, 0}, {gpt2, 2, 1}, {gpt2, 2, 2}, {gpt2, 2, 0}, {gpt2, 2, 1}, {gpt2, 2, 2}},
          Packing{"bloom", {bloom, 3, 0}, {bloom, 3, 1}, {bloom, 3, 2}, {bloom, 3, 0}, {bloom, 3, 1}, {bloom, 3, 2}},
          Packing{"gqa", {q_apart, 3, 1}, {kv_apart, 2, 0}, {kv_apart, 2, 1}, {dq_apart, -1, 0}, {kv_apart, 3, 0},
                  {kv_apart, 3, 1}}}) {
      for (const char* det : {"1", static_cast<const char*>(nullptr)}) {
        ScopedDeterministic mode(det);
        SCOPED_TRACE(std::string(DTypeName(type)) + " d" + std::to_string(d) + " " + p.name +
                     (det != nullptr ? " deterministic" : " one pass"));
        // The operands from their tensors (one each; q, k and v share the
        // packed one where their shapes agree), seeds 101.. .
        std::vector<std::pair<Shape, Tensor>> sources, buffers;
        const auto tensor_of = [&](std::vector<std::pair<Shape, Tensor>>& pool, const Shape& shape, bool random) {
          for (const auto& [sh, t] : pool) {
            if (sh == shape) return t;
          }
          const uint64_t seed = 101 + pool.size();
          pool.emplace_back(shape, random ? *Tensor::RandomNormal(shape, seed, type, dev)
                                          : *Tensor::Empty(shape, type, dev));
          return pool.back().second;
        };
        const auto view = [&](std::vector<std::pair<Shape, Tensor>>& pool, const Slice& sl, bool random) {
          const Tensor t = tensor_of(pool, sl.shape, random);
          return sl.dim < 0 ? t : *t.Select(sl.dim, sl.index);
        };
        const Tensor q = view(sources, p.q, true), k = view(sources, p.k, true), v = view(sources, p.v, true);
        ASSERT_TRUE(ops::AttentionReadsInPlace(q) && ops::AttentionReadsInPlace(k));
        ASSERT_FALSE(q.is_contiguous() || k.is_contiguous());
        const Tensor dout = *Tensor::RandomNormal(q.shape(), 110, type, dev);
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const absl::StatusOr<ops::AttentionForward> want =
            ops::FusedAttention(q.Contiguous(), k.Contiguous(), v.Contiguous(), scale, true);
        ASSERT_TRUE(want.ok()) << want.status();
        const absl::StatusOr<ops::AttentionGrads> g_want =
            ops::FusedAttentionBackward(dout, q.Contiguous(), k.Contiguous(), v.Contiguous(), *want, scale, true);
        ASSERT_TRUE(g_want.ok()) << g_want.status();

        ops::AttentionGradPlaces places;
        places.dq = view(buffers, p.dq, false);
        places.dk = view(buffers, p.dk, false);
        places.dv = view(buffers, p.dv, false);
#ifdef COLOD_CUDA_EMULATION
        const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
        const absl::StatusOr<ops::AttentionForward> f = ops::FusedAttention(q, k, v, scale, true);
        ASSERT_TRUE(f.ok()) << f.status();
#ifdef COLOD_CUDA_EMULATION
        const uint64_t forward = colod_cuda_emu::GetCounters().kernel_launches - before;
#endif
        const absl::StatusOr<ops::AttentionGrads> g =
            ops::FusedAttentionBackward(dout, q, k, v, *f, scale, true, {}, places);
        ASSERT_TRUE(g.ok()) << g.status();
#ifdef COLOD_CUDA_EMULATION
        const uint64_t backward = colod_cuda_emu::GetCounters().kernel_launches - before - forward;
        EXPECT_EQ(forward, 1u);
        EXPECT_EQ(backward, det != nullptr || type == DType::kF32 ? 2u : 3u)
            << "dq (or delta and the dQ buffer), dk and dv (and dQ's share), dq's rounding: no copies";
#endif
        EXPECT_EQ(g->dq.raw_data(), places.dq->raw_data());
        EXPECT_EQ(g->dk.raw_data(), places.dk->raw_data());
        ExpectSameBits(*f->out.To(Device::Cpu()), *want->out.To(Device::Cpu()), "out");
        ExpectSameBits(*f->lse.To(Device::Cpu()), *want->lse.To(Device::Cpu()), "lse");
        const auto host = [](const ops::AttentionGrads& x) {
          return Result{Tensor(), *x.dq.To(Device::Cpu()), *x.dk.To(Device::Cpu()), *x.dv.To(Device::Cpu())};
        };
        ExpectRepeats(host(*g), host(*g_want), type);
      }
    }
    // Gradients written over q, k and v themselves (places in the storage
    // the kernels read): copied in after the kernels, so the two-kernel
    // backward's second kernel still reads q, not dq.
    ScopedDeterministic mode("1");
    SCOPED_TRACE(std::string(DTypeName(type)) + " d" + std::to_string(d) + " over q, k and v");
    const Tensor qkv = *Tensor::RandomNormal(gpt2, 120, type, dev), dout = *Tensor::RandomNormal({2, 70, 2, d}, 121, type, dev);
    std::vector<Tensor> parts;
    for (int i = 0; i < 3; ++i) parts.push_back(*qkv.Select(2, i));
    const absl::StatusOr<ops::AttentionForward> f = ops::FusedAttention(parts[0], parts[1], parts[2], 0.3f, true);
    ASSERT_TRUE(f.ok()) << f.status();
    const absl::StatusOr<ops::AttentionGrads> want = ops::FusedAttentionBackward(
        dout, parts[0].Contiguous(), parts[1].Contiguous(), parts[2].Contiguous(), *f, 0.3f, true);
    ASSERT_TRUE(want.ok()) << want.status();
    ops::AttentionGradPlaces over;
    over.dq = parts[0];
    over.dk = parts[1];
    over.dv = parts[2];
    ASSERT_TRUE(ops::FusedAttentionBackward(dout, parts[0], parts[1], parts[2], *f, 0.3f, true, {}, over).ok());
    ExpectSameBits(*parts[0].To(Device::Cpu()), *want->dq.To(Device::Cpu()), "dq over q");
    ExpectSameBits(*parts[1].To(Device::Cpu()), *want->dk.To(Device::Cpu()), "dk over k");
    ExpectSameBits(*parts[2].To(Device::Cpu()), *want->dv.To(Device::Cpu()), "dv over v");
  }
}

// A batch past one launch's grid (65535 elements, the grid's z) runs in
// parts (kernels/cuda's FlashAttention and its backward; the CPU runs any
// batch): out, lse and every gradient equal the CPU twin's, with q, k and v
// slices of GPT-2's packed [B, S, 3, H, D] (each part's operands start at
// its first element of their layout) and T5's learned bias, whose gradient
// is per element too. The scalar kernels (f32, head dim 16): the parts are
// made alike for every kernel, and the tensor-core ones, emulated, take
// longer over 65538 elements than this test has. On the emulation, two
// launches forward (the grid checked as a GPU does: it refused the batch
// before).
TEST(CudaAttentionBatches, ABatchPastOneLaunchsGridRunsInParts) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t b = 65535 + 3, s = 2, h = 1, d = 16;
  const Tensor qkv = *Tensor::RandomNormal({b, s, 3, h, d}, 131);
  const Tensor dout = *Tensor::RandomNormal({b, s, h, d}, 132);
  const Tensor bias = *Tensor::RandomNormal({h, s, s}, 133);
  const auto run = [&](Device dev) -> std::vector<Tensor> {
    const Tensor packed = *qkv.To(dev);
    const Tensor q = *packed.Select(2, 0), k = *packed.Select(2, 1), v = *packed.Select(2, 2);
    ops::AttentionExtras extras;
    extras.bias = *bias.To(dev);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    const absl::StatusOr<ops::AttentionForward> f = ops::FusedAttention(q, k, v, 0.25f, /*causal=*/true, extras);
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok()) return {};
#ifdef COLOD_CUDA_EMULATION
    if (dev.is_cuda()) EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before, 2u) << "two parts";
#endif
    const absl::StatusOr<ops::AttentionGrads> g =
        ops::FusedAttentionBackward(*dout.To(dev), q, k, v, *f, 0.25f, /*causal=*/true, extras);
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok() || !g->dbias.has_value()) return {};
    std::vector<Tensor> out;
    for (const Tensor* t : {&f->out, &f->lse, &g->dq, &g->dk, &g->dv, &*g->dbias}) out.push_back(*t->To(Device::Cpu()));
    return out;
  };
  const std::vector<Tensor> want = run(Device::Cpu()), got = run(Device::Cuda(0));
  ASSERT_EQ(want.size(), 6u);
  ASSERT_EQ(got.size(), 6u);
  const char* names[] = {"out", "lse", "dq", "dk", "dv", "dbias"};
  for (int i = 0; i < 6; ++i) ExpectNear(got[i], want[i], 1e-5, names[i]);
}

#ifdef COLOD_CUDA_EMULATION
// One launch forward and two backward per attention call (the per-head path
// launched about 6 per (batch, head) forward and 12 backward).
// In bf16 too: no conversions around the kernels.
TEST(CudaAttentionLaunches, OneKernelForwardTwoBackward) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    const Device dev = Device::Cuda(0);
    Variable q(*Tensor::RandomNormal({2, 40, 4, 16}, 1, t, dev), true);
    Variable k(*Tensor::RandomNormal({2, 40, 2, 16}, 2, t, dev), true);
    Variable v(*Tensor::RandomNormal({2, 40, 2, 16}, 3, t, dev), true);
    const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
    absl::StatusOr<Variable> out = Attention(q, k, v, 0.25f, /*causal=*/true);
    ASSERT_TRUE(out.ok()) << out.status();
    const uint64_t forward = colod_cuda_emu::GetCounters().kernel_launches - before;
    const Tensor dout = *Tensor::RandomNormal(out->value().shape(), 4, t, dev);
    const uint64_t before_backward = colod_cuda_emu::GetCounters().kernel_launches;
    ASSERT_TRUE(Backward(*out, dout).ok());
    const uint64_t backward = colod_cuda_emu::GetCounters().kernel_launches - before_backward;
    EXPECT_EQ(forward, 1u);
    EXPECT_EQ(backward, 2u);
  }
}

// Attention over packed q, k and v (PackedQkv: GPT-2's c_attn output)
// reads the slices in place and writes the packed tensor's gradient slice
// by slice: the attention's own launches and no more (three Selects' zeroed
// gradients, which Backward adds, take more), and the same values; the
// forward is one launch either way, the slices read in place.
TEST(CudaAttentionLaunches, PackedQkvGradientIsOneBufferNotThreeAdded) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    const Device dev = Device::Cuda(0);
    const Tensor qkv = *Tensor::RandomNormal({2, 40, 3, 4, 64}, 5, t, dev);
    const Tensor dout = *Tensor::RandomNormal({2, 40, 4, 64}, 6, t, dev);
    uint64_t forward[2], backward[2];
    Variable grads[2];
    Tensor outs[2];
    for (int packed = 0; packed < 2; ++packed) {
      grads[packed] = Variable(qkv, true);
      const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
      absl::StatusOr<Variable> out;
      if (packed == 1) {
        out = CausalAttention(PackedQkv{grads[packed], 2}, 0.125f);
      } else {
        Variable parts[3];
        for (int i = 0; i < 3; ++i) parts[i] = *Select(grads[packed], 2, i);
        out = CausalAttention(parts[0], parts[1], parts[2], 0.125f);
      }
      ASSERT_TRUE(out.ok()) << out.status();
      forward[packed] = colod_cuda_emu::GetCounters().kernel_launches - before;
      outs[packed] = out->value();
      const uint64_t before_backward = colod_cuda_emu::GetCounters().kernel_launches;
      ASSERT_TRUE(Backward(*out, dout).ok());
      backward[packed] = colod_cuda_emu::GetCounters().kernel_launches - before_backward;
    }
    // The attention's own launches over contiguous q, k and v.
    Variable q(qkv.Select(2, 0)->Contiguous(), true), k(qkv.Select(2, 1)->Contiguous(), true),
        v(qkv.Select(2, 2)->Contiguous(), true);
    absl::StatusOr<Variable> plain = CausalAttention(q, k, v, 0.125f);
    ASSERT_TRUE(plain.ok()) << plain.status();
    const uint64_t before_plain = colod_cuda_emu::GetCounters().kernel_launches;
    ASSERT_TRUE(Backward(*plain, dout).ok());
    const uint64_t kernels_alone = colod_cuda_emu::GetCounters().kernel_launches - before_plain;
    EXPECT_EQ(outs[1].ToBytes(), outs[0].ToBytes());
    EXPECT_EQ(grads[1].grad()->ToFloats(), grads[0].grad()->ToFloats());
    EXPECT_EQ(forward[0], 1u) << "q, k and v read in place from the strided slices";
    EXPECT_EQ(forward[1], 1u) << "q, k and v read in place from the strided slices";
    EXPECT_EQ(backward[1], kernels_alone) << "dq, dk and dv written into the packed buffer's slices";
    EXPECT_GT(backward[0], backward[1]) << "the Selects' zeroed buffers and adds";
  }
}

// q, k and v the kernels cannot read in place (transposed views of [B, H,
// S, D]) are copied once, in the forward, and the node keeps the copies:
// its backward launches what it does over contiguous q, k and v, and gives
// the same values, bit for bit (S = 40 is one key block, so dq's atomic
// adds come from one block).
TEST(CudaAttentionLaunches, ViewsCopiedForTheForwardAreNotCopiedAgainForTheBackward) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    const Device dev = Device::Cuda(0);
    const Tensor dout = *Tensor::RandomNormal({2, 40, 4, 64}, 6, t, dev);
    Variable views[3], plain[3];
    for (int i = 0; i < 3; ++i) {
      const Tensor heads_first = *Tensor::RandomNormal({2, 4, 40, 64}, 7 + i, t, dev);
      views[i] = Variable(*heads_first.Transpose(1, 2), true);
      plain[i] = Variable(views[i].value().Contiguous(), true);
    }
    ASSERT_FALSE(ops::AttentionReadsInPlace(views[0].value()));
    uint64_t forward[2], backward[2];
    Tensor outs[2];
    for (int contiguous = 0; contiguous < 2; ++contiguous) {
      Variable* in = contiguous == 1 ? plain : views;
      const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
      absl::StatusOr<Variable> out = CausalAttention(in[0], in[1], in[2], 0.125f);
      ASSERT_TRUE(out.ok()) << out.status();
      forward[contiguous] = colod_cuda_emu::GetCounters().kernel_launches - before;
      outs[contiguous] = out->value();
      const uint64_t before_backward = colod_cuda_emu::GetCounters().kernel_launches;
      ASSERT_TRUE(Backward(*out, dout).ok());
      backward[contiguous] = colod_cuda_emu::GetCounters().kernel_launches - before_backward;
    }
    EXPECT_EQ(forward[1], 1u);
    EXPECT_EQ(forward[0], 4u) << "q, k and v copied, then the kernel";
    EXPECT_EQ(backward[0], backward[1]) << "the forward's copies kept, not made again";
    EXPECT_EQ(outs[0].ToBytes(), outs[1].ToBytes());
    for (int i = 0; i < 3; ++i) EXPECT_EQ(views[i].grad()->ToBytes(), plain[i].grad()->ToBytes()) << i;
  }
}

// bf16 and f16 at head dims 64, 80, 96 and 128 compute on the tensor-core path:
// every product by mma.sync: per warp, row tile of 16 and 64-key tile,
// (d / 16) * 8 for S = Q K^T (16 x 64) and as many for P V (16 x d), 4
// warps a row block, a row tile each (two at head dim 64, 128-row blocks);
// f32 and other head dims stay on the scalar kernel.
//
// The backward too: the dq kernel per warp, row tile of 16 query rows (two
// at d 64, as the forward) and tile of n keys (16 at d 64, 32 above): S = Q K^T and dP = dout V^T, (d / 16)
// (n / 8) each, and dQ += dS K, as many; the dk/dv kernel per warp (16 keys)
// and tile of n queries of each query head: S^T, dP^T, dV += P^T dout and
// dK += dS^T Q, (d / 16) (n / 8) each (under COLOD_DETERMINISTIC=1; the
// one-pass backward is the dk/dv kernel's walk and dQ's share of each tile).
// Causal: row block r of the dq kernel
// walks the keys up to its last row, the dk/dv kernel's key block r the
// queries from its first key on.
// The products on mma.sync, from tiles that cp.async staged once each.
TEST(CudaAttentionTensorCores, HalfOperandsMultiplyOnMmaSyncFromTilesStagedByCpAsync) {
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ScopedRowTiles default_tiles(nullptr);  // the counts below are the default kernels
  struct Run {
    DType t;
    int64_t d;
    uint64_t forward, backward, forward_copies, backward_copies;
  };
  // b 1, s 100, hq 2, hkv 1, causal. The forward's warps take two row tiles
  // of 16 at head dims 64 and 128 (one row block of 128, which walks two
  // 64-key tiles), one at 80 and 96 (two row blocks of 64: block 0 walks one
  // key tile, block 1 two); the dq kernel's two at 64 only.
  constexpr int64_t kSeq = 100, kHeads = 2, kWarps = 4;
  // At 128 the forward's key tiles are 32 keys (Q read from shared memory).
  const auto fwd_row_tiles = [](int64_t d) -> int64_t { return d == 64 || d == 128 ? 2 : 1; };
  const auto fwd_keys = [](int64_t d) -> int64_t { return d == 128 ? 32 : 64; };
  const auto row_tiles = [](int64_t d) -> int64_t { return d == 64 ? 2 : 1; };
  const auto key_tile_walks = [&](int64_t d) {
    const int64_t rows = 64 * fwd_row_tiles(d), n = fwd_keys(d);
    int64_t walks = 0;
    for (int64_t row0 = 0; row0 < kSeq; row0 += rows) walks += (std::min(kSeq, row0 + rows) + n - 1) / n;
    return walks;
  };
  const auto forward = [&](int64_t d) {
    return static_cast<uint64_t>(kHeads * key_tile_walks(d) * kWarps * fwd_row_tiles(d) * (d / 16) *
                                 (fwd_keys(d) / 8) * 2);
  };
  // The dq kernel's row blocks of 64 row_tiles(d) rows, its key tiles 16 at two
  // row tiles a warp; the dk/dv kernel's key blocks of 64 and query tiles of
  // n.
  const auto dq_key_tile = [&](int64_t d) -> int64_t { return row_tiles(d) == 2 ? 16 : (d <= 64 ? 64 : 32); };
  const auto dq_key_tiles = [&](int64_t d) {
    const int64_t rows = 64 * row_tiles(d), n = dq_key_tile(d);
    int64_t walks = 0;
    for (int64_t row0 = 0; row0 < kSeq; row0 += rows) walks += (std::min(kSeq, row0 + rows) + n - 1) / n;
    return walks;
  };
  const auto backward = [&](int64_t d) {
    const int64_t n = d <= 64 ? 64 : 32, unit = (d / 16) * (n / 8);
    const int64_t dq_unit = (d / 16) * (dq_key_tile(d) / 8) * row_tiles(d);
    const auto tiles = [n](int64_t from, int64_t to) { return (to - from + n - 1) / n; };
    const int64_t dkv_tiles = tiles(0, kSeq) + tiles(64, kSeq);    // key blocks 0 and 1
    return static_cast<uint64_t>(kHeads * kWarps * (dq_key_tiles(d) * 3 * dq_unit + dkv_tiles * 4 * unit));
  };
  // 16-byte copies of a tile of `rows` rows; forward: per head, the row
  // blocks' Q tiles (the rows of the sequence rounded up to the blocks) and
  // a K and a V tile a walk.
  const auto chunks = [](int64_t rows, int64_t d) { return rows * (d / 8); };
  const auto forward_copies = [&](int64_t d) {
    const int64_t rows = 64 * fwd_row_tiles(d), q_rows = (kSeq + rows - 1) / rows * rows;
    return static_cast<uint64_t>(kHeads * (chunks(q_rows, d) + 2 * key_tile_walks(d) * chunks(fwd_keys(d), d)));
  };
  // dq: per head and row block Q and dout, then K and V tiles; dk/dv: per
  // key block K and V, then per head and query tile Q, dout and the rows'
  // log-sum-exp and delta (4 bytes a row each).
  const auto backward_copies = [&](int64_t d) {
    const int64_t n = d <= 64 ? 64 : 32;
    const auto tiles = [n](int64_t from, int64_t to) { return (to - from + n - 1) / n; };
    const int64_t rows = 64 * row_tiles(d), q_rows = (kSeq + rows - 1) / rows * rows;
    const int64_t dq = 2 * chunks(q_rows, d) + dq_key_tiles(d) * 2 * chunks(dq_key_tile(d), d);
    const int64_t dkv_tiles = tiles(0, kSeq) + tiles(64, kSeq);
    const int64_t dkv = 2 * 2 * chunks(64, d) + kHeads * dkv_tiles * (2 * chunks(n, d) + 2 * n);
    return static_cast<uint64_t>(kHeads * dq + dkv);
  };
  // The one-pass backward (the default): the dk/dv kernel's walk and
  // copies, and per tile dQ's share, n queries by d over the block's 64 keys
  // (n d / 32 mma.sync).
  const auto one_pass = [&](int64_t d) {
    const int64_t n = d <= 64 ? 64 : 32, unit = (d / 16) * (n / 8);
    const auto tiles = [n](int64_t from, int64_t to) { return (to - from + n - 1) / n; };
    const int64_t dkv_tiles = tiles(0, kSeq) + tiles(64, kSeq);
    return static_cast<uint64_t>(kHeads * dkv_tiles * (kWarps * 4 * unit + n * d / 32));
  };
  const auto one_pass_copies = [&](int64_t d) {
    const int64_t n = d <= 64 ? 64 : 32;
    const auto tiles = [n](int64_t from, int64_t to) { return (to - from + n - 1) / n; };
    const int64_t dkv_tiles = tiles(0, kSeq) + tiles(64, kSeq);
    return static_cast<uint64_t>(2 * 2 * chunks(64, d) + kHeads * dkv_tiles * (2 * chunks(n, d) + 2 * n));
  };
  for (const bool deterministic : {true, false}) {
    ScopedDeterministic mode(deterministic ? "1" : nullptr);
    const auto bwd = [&](int64_t d) { return deterministic ? backward(d) : one_pass(d); };
    const auto bwd_copies = [&](int64_t d) { return deterministic ? backward_copies(d) : one_pass_copies(d); };
    for (Run r : {Run{DType::kBF16, 64, forward(64), bwd(64), forward_copies(64), bwd_copies(64)},
                  Run{DType::kF16, 128, forward(128), bwd(128), forward_copies(128), bwd_copies(128)},
                  Run{DType::kBF16, 96, forward(96), bwd(96), forward_copies(96), bwd_copies(96)},
                  Run{DType::kBF16, 80, forward(80), bwd(80), forward_copies(80), bwd_copies(80)},
                  Run{DType::kF32, 64, 0, 0, 0, 0}, Run{DType::kBF16, 32, 0, 0, 0, 0}}) {
      SCOPED_TRACE(std::string(DTypeName(r.t)) + " d" + std::to_string(r.d) +
                   (deterministic ? " COLOD_DETERMINISTIC=1" : " one pass"));
      const Device dev = Device::Cuda(0);
      Variable q(*Tensor::RandomNormal({1, kSeq, kHeads, r.d}, 1, r.t, dev), true);
      Variable k(*Tensor::RandomNormal({1, kSeq, 1, r.d}, 2, r.t, dev), true);
      Variable v(*Tensor::RandomNormal({1, kSeq, 1, r.d}, 3, r.t, dev), true);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const colod_cuda_emu::Counters before = colod_cuda_emu::GetCounters();
      absl::StatusOr<Variable> out = Attention(q, k, v, 0.125f, /*causal=*/true);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const colod_cuda_emu::Counters after_forward = colod_cuda_emu::GetCounters();
      EXPECT_EQ(after_forward.warp_mmas - before.warp_mmas, r.forward);
      EXPECT_EQ(after_forward.async_copies - before.async_copies, r.forward_copies);
      const Tensor dout = *Tensor::RandomNormal(out->value().shape(), 4, r.t, dev);
      ASSERT_TRUE(Backward(*out, dout).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const colod_cuda_emu::Counters after_backward = colod_cuda_emu::GetCounters();
      EXPECT_EQ(after_backward.warp_mmas - after_forward.warp_mmas, r.backward);
      EXPECT_EQ(after_backward.async_copies - after_forward.async_copies, r.backward_copies);
    }
  }
}
#endif

}  // namespace
}  // namespace colod::nn
