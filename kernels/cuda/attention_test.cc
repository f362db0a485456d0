// The fused attention kernels (kernels/cuda/layer_ops.cu: FlashAttention,
// FlashAttentionBackward) called directly, against their CPU twin
// (kernels/cpu), on shapes small enough for ThreadSanitizer: the tensor-core
// forward at one and two row tiles a warp, the one-pass backward (dq by
// atomics) and the deterministic two-kernel one, at every tensor-core head
// dim, lengths off the tiles, grouped-query heads, causal and not; and the
// scalar kernels (f32). worker/nn's cuda_attention_test holds the model's
// attention to the per-head reference on larger shapes; this one runs in
// ./dev test's TSan pass too (//kernels/...), where each CUDA thread is a
// thread of its own to TSan ordered only by barriers, warp operations and
// block ends (docs/GPU.md): a missing __syncthreads or cp.async wait in
// these kernels is a reported race there.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cuda_emu.h>
#endif

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/cuda/layer_ops.h"
#include "kernels/cuda/stream.h"
#include "kernels/device.h"
#include "kernels/half.h"

namespace colod::kernels::cuda {
namespace {

struct Shape {
  ElemType type;
  int64_t b, s, hq, hkv, d;
  bool causal;
};

std::string Name(const Shape& a) {
  return absl::StrCat(a.type == ElemType::kF32    ? "f32"
                      : a.type == ElemType::kBF16 ? "bf16"
                                                  : "f16",
                      "_b", a.b, "_s", a.s, "_h", a.hq, "x", a.hkv, "_d", a.d, a.causal ? "_causal" : "");
}

size_t Bytes(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// n elements of `type` drawn from N(0, 1), as raw bytes.
std::vector<uint8_t> Random(ElemType type, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint8_t> out(static_cast<size_t>(n) * Bytes(type));
  for (int64_t i = 0; i < n; ++i) StoreF(out.data(), i, type, dist(rng));
  return out;
}

void* ToDevice(const void* host, size_t bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 1)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

std::vector<uint8_t> ToHost(const void* device, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// max |got - want| over max |want|, n elements of `type`.
double RelativeError(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, int64_t n, ElemType type) {
  double err = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    err = std::max(err, std::fabs(double{LoadF(got.data(), i, type)} - LoadF(want.data(), i, type)));
    scale = std::max(scale, std::fabs(double{LoadF(want.data(), i, type)}));
  }
  return err / std::max(scale, 1e-30);
}

// Sets an environment variable of the kernels' (read at each call) for a
// scope; nullptr unsets it. The kernels read it on the calling thread.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
      had_ = true;
    }
    Set(value);
  }
  ~ScopedEnv() { Set(had_ ? old_.c_str() : nullptr); }

 private:
  void Set(const char* value) {
    if (value != nullptr) {
      setenv(name_, value, 1);
    } else {
      unsetenv(name_);
    }
  }

  const char* name_;
  std::string old_;
  bool had_ = false;
};

// One forward and backward on the device, its results on the host.
struct Results {
  std::vector<uint8_t> out, dq, dk, dv;
  std::vector<float> lse;
};

// Whether the shape takes the tensor-core kernels: bf16 and f16 at head
// dims 64, 80, 96 and 128 (the cases' buffers are 16-byte aligned). Asked
// only under the emulation, which counts the mma.sync it runs.
[[maybe_unused]] bool TensorCores(const Shape& a) {
  return a.type != ElemType::kF32 && (a.d == 64 || a.d == 80 || a.d == 96 || a.d == 128);
}

class CudaAttentionKernels : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const Shape& a = GetParam();
    qn_ = a.b * a.s * a.hq * a.d;
    kvn_ = a.b * a.s * a.hkv * a.d;
    rows_ = a.b * a.hq * a.s;
    scale_ = 1.0f / std::sqrt(static_cast<float>(a.d));
    q_ = Random(a.type, qn_, 1);
    k_ = Random(a.type, kvn_, 2);
    v_ = Random(a.type, kvn_, 3);
    dout_ = Random(a.type, qn_, 4);
  }

  AttentionLayout Layout() const {
    const Shape& a = GetParam();
    return ContiguousAttention(a.hq, a.hkv, a.d);
  }

  // The CPU twin's, from the same operands.
  Results Reference() const {
    const Shape& a = GetParam();
    Results r;
    r.out.resize(qn_ * Bytes(a.type));
    r.dq.resize(qn_ * Bytes(a.type));
    r.dk.resize(kvn_ * Bytes(a.type));
    r.dv.resize(kvn_ * Bytes(a.type));
    r.lse.resize(rows_);
    std::vector<float> delta(rows_);
    EXPECT_TRUE(cpu::FlashAttention(0, a.type, q_.data(), k_.data(), v_.data(), r.out.data(), r.lse.data(), a.b, a.s,
                                    a.hq, a.hkv, a.d, scale_, a.causal, {}, Layout())
                    .ok());
    EXPECT_TRUE(cpu::FlashAttentionBackward(0, a.type, q_.data(), k_.data(), v_.data(), r.out.data(), dout_.data(),
                                            r.lse.data(), delta.data(), r.dq.data(), r.dk.data(), r.dv.data(), a.b, a.s,
                                            a.hq, a.hkv, a.d, scale_, a.causal, {}, Layout())
                    .ok());
    return r;
  }

  // Under the emulation it also checks that the tensor-core shapes
  // multiplied on mma.sync and the others did not.
  Results OnDevice() const {
    const Shape& a = GetParam();
#ifdef COLOD_CUDA_EMULATION
    const uint64_t mmas_before = colod_cuda_emu::GetCounters().warp_mmas;
#endif
    const size_t qb = qn_ * Bytes(a.type), kvb = kvn_ * Bytes(a.type), lb = rows_ * sizeof(float);
    void* q = ToDevice(q_.data(), qb);
    void* k = ToDevice(k_.data(), kvb);
    void* v = ToDevice(v_.data(), kvb);
    void* dout = ToDevice(dout_.data(), qb);
    const std::vector<uint8_t> zeros(std::max(qb, kvb), 0);
    void* out = ToDevice(zeros.data(), qb);
    void* dq = ToDevice(zeros.data(), qb);
    void* dk = ToDevice(zeros.data(), kvb);
    void* dv = ToDevice(zeros.data(), kvb);
    void* lse = ToDevice(zeros.data(), lb);
    void* delta = ToDevice(zeros.data(), lb);
    const absl::Status fwd = FlashAttention(0, a.type, q, k, v, out, static_cast<float*>(lse), a.b, a.s, a.hq, a.hkv,
                                            a.d, scale_, a.causal, {}, Layout());
    EXPECT_TRUE(fwd.ok()) << fwd;
    const absl::Status bwd = FlashAttentionBackward(0, a.type, q, k, v, out, dout, static_cast<const float*>(lse),
                                                    static_cast<float*>(delta), dq, dk, dv, a.b, a.s, a.hq, a.hkv, a.d,
                                                    scale_, a.causal, {}, Layout());
    EXPECT_TRUE(bwd.ok()) << bwd;
    const absl::Status synced = Synchronize(0);
    EXPECT_TRUE(synced.ok()) << synced;
    Results r;
    r.out = ToHost(out, qb);
    r.dq = ToHost(dq, qb);
    r.dk = ToHost(dk, kvb);
    r.dv = ToHost(dv, kvb);
    const std::vector<uint8_t> l = ToHost(lse, lb);
    r.lse.resize(rows_);
    std::copy(l.begin(), l.end(), reinterpret_cast<uint8_t*>(r.lse.data()));
    for (void* p : {q, k, v, dout, out, dq, dk, dv, lse, delta}) EXPECT_EQ(cudaFree(p), cudaSuccess);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t mmas = colod_cuda_emu::GetCounters().warp_mmas - mmas_before;
    if (TensorCores(a)) {
      EXPECT_GT(mmas, 0u) << "the tensor-core kernels did not run";
    } else {
      EXPECT_EQ(mmas, 0u) << "the scalar kernels multiplied on mma.sync";
    }
#endif
    return r;
  }

  // The device's values within what its arithmetic allows of the twin's:
  // f32 to rounding; bf16 and f16 with P and dS rounded to the operand
  // type before their products (as FlashAttention-2 does; the twin keeps
  // them in f32), as worker/nn's tests and cuDNN's allow.
  void ExpectNear(const Results& got, const Results& want, const std::string& what) const {
    const Shape& a = GetParam();
    const bool f32 = a.type == ElemType::kF32;
    const double out_tol = f32 ? 1e-5 : 2e-2, grad_tol = f32 ? 1e-4 : 3e-2;
    double lse_err = 0;
    for (int64_t i = 0; i < rows_; ++i) lse_err = std::max(lse_err, double{std::fabs(got.lse[i] - want.lse[i])});
    EXPECT_LT(lse_err, f32 ? 1e-5 : 2e-2) << what << ": lse";
    EXPECT_LT(RelativeError(got.out, want.out, qn_, a.type), out_tol) << what << ": out";
    EXPECT_LT(RelativeError(got.dq, want.dq, qn_, a.type), grad_tol) << what << ": dq";
    EXPECT_LT(RelativeError(got.dk, want.dk, kvn_, a.type), grad_tol) << what << ": dk";
    EXPECT_LT(RelativeError(got.dv, want.dv, kvn_, a.type), grad_tol) << what << ": dv";
  }

  int64_t qn_ = 0, kvn_ = 0, rows_ = 0;
  float scale_ = 1;
  std::vector<uint8_t> q_, k_, v_, dout_;
};

// The default kernels: the forward at two row tiles a warp where the head
// dim takes them (64, 128), the one-pass backward on tensor cores.
TEST_P(CudaAttentionKernels, DefaultKernelsMatchTheCpuTwin) {
  ScopedEnv tiles("COLOD_ATTENTION_ROW_TILES", nullptr), det("COLOD_DETERMINISTIC", nullptr),
      cudnn("COLOD_ATTENTION", nullptr);
  ExpectNear(OnDevice(), Reference(), "default");
}

// COLOD_DETERMINISTIC=1's two-kernel backward and the forward's 64-row
// blocks (their bitwise repetition: worker/nn's cuda_attention_test).
TEST_P(CudaAttentionKernels, DeterministicKernelsMatchTheCpuTwin) {
  ScopedEnv tiles("COLOD_ATTENTION_ROW_TILES", "1"), det("COLOD_DETERMINISTIC", "1"), cudnn("COLOD_ATTENTION", nullptr);
  ExpectNear(OnDevice(), Reference(), "deterministic");
}

// Lengths off every tile (the tensor-core kernels' 64 and 128 rows, their
// 32 and 64 keys, the scalar kernels' tiles), grouped-query heads (2 query
// heads a kv head), causal and bidirectional, every tensor-core head dim,
// f16 beside bf16, and the scalar kernels in f32. Small: the TSan pass runs
// each CUDA thread as a fiber.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionKernels,
    ::testing::Values(Shape{ElemType::kBF16, 1, 80, 2, 1, 64, true}, Shape{ElemType::kBF16, 1, 72, 1, 1, 128, false},
                      Shape{ElemType::kBF16, 1, 40, 2, 1, 128, true}, Shape{ElemType::kF16, 1, 70, 2, 2, 80, true},
                      Shape{ElemType::kBF16, 1, 50, 2, 2, 96, false}, Shape{ElemType::kF32, 1, 45, 2, 1, 32, true}),
    [](const ::testing::TestParamInfo<Shape>& info) { return Name(info.param); });

}  // namespace
}  // namespace colod::kernels::cuda
