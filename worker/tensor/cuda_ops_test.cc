// Every layer kernel on a CUDA tensor against its CPU twin on random, never
// zero, inputs (DESIGN.md section 7). Skipped without a GPU.
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <link.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#ifdef COLOD_CUDA_EMULATION
#include <cublas_emu.h>
#include <cuda_emu.h>
#endif

#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/tensor/device_kernels.h"
#include "worker/tensor/ops.h"

namespace colod::ops {
namespace {

class CudaLayerOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  Tensor Dev(const Tensor& t) { return *t.To(Device::Cuda(0)); }
};

// Random normal shifted away from zero.
Tensor R(const Shape& shape, uint64_t seed, float scale = 1.0f) {
  Tensor t = *Tensor::RandomNormal(shape, seed);
  std::vector<float> v = t.ToFloats();
  for (float& x : v) x = scale * (x + (x >= 0 ? 0.1f : -0.1f));
  return *Tensor::FromFloats(shape, v);
}

void ExpectNear(const Tensor& gpu, const Tensor& cpu, double tol, const std::string& what) {
  ASSERT_EQ(gpu.device(), Device::Cuda(0)) << what;
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const std::vector<float> g = gpu.ToFloats(), c = cpu.ToFloats();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], c[i], tol * (1 + std::fabs(c[i]))) << what << " at " << i;
}

#if defined(COLOD_CUDA_EMULATION) && !defined(COLOD_CUDA_EMU_TSAN)
// (ThreadSanitizer keeps its own per-thread state in TLS.)
// The emulation's __shared__ arrays are static thread-local storage, which
// glibc places in every thread's stack: past about 1 MiB, threads with
// small stacks (civetweb's, serving a daemon's /metrics) fail to start. The
// kernels keep their tiles small under the emulation; this holds the
// process's static TLS to a budget.
int AddTls(struct dl_phdr_info* info, size_t, void* total) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) *static_cast<size_t*>(total) += info->dlpi_phdr[i].p_memsz;
  }
  return 0;
}

TEST(CudaEmulation, StaticThreadLocalStorageStaysWithinBudget) {
  size_t total = 0;
  dl_iterate_phdr(AddTls, &total);
  EXPECT_LT(total, size_t{512} << 10) << "static TLS of " << total << " bytes";
  EXPECT_GT(total, 0u);
}
#endif

// docs/TRAINING.md promises bitwise-identical resumed runs: the embedding
// gradient with ids repeated many times must not depend on the order threads
// add in. Each row's tokens are summed in token order, as on the CPU: the
// result equals the CPU kernel's bit for bit, on every run, also with a
// vocabulary shard (row_offset) that masks some ids.
TEST_F(CudaLayerOps, EmbeddingBackwardIsDeterministicWithRepeatedIds) {
  std::vector<int64_t> idv(4 * 256);
  for (size_t i = 0; i < idv.size(); ++i) idv[i] = static_cast<int64_t>((i * 7) % 5) + (i % 3 == 0 ? 30 : 0);
  const Tensor ids = *Tensor::FromInt64s({4, 256}, idv);
  const Tensor dy = R({4, 256, 24}, 21, 10.0f);
  for (int64_t offset : {0, 30}) {
    const Tensor cpu = *EmbeddingBackward(dy, ids, 40, offset);
    const Tensor first = *EmbeddingBackward(Dev(dy), Dev(ids), 40, offset);
    const Tensor second = *EmbeddingBackward(Dev(dy), Dev(ids), 40, offset);
    EXPECT_EQ(first.ToBytes(), second.ToBytes()) << "offset " << offset;
    EXPECT_EQ(first.ToBytes(), cpu.ToBytes()) << "offset " << offset;
  }
}

// In bf16 and f16 the embedding reads the table and writes its rows, and
// the backward reads dy and writes the gradient, in that type: the bits of
// the f32 computation rounded once (what converting the table and dy to
// f32 and the results back gave), on both devices, and on the emulation
// one launch forward (no conversion of the table) and one backward.
TEST_F(CudaLayerOps, HalfEmbeddingsCopyRowsAndRoundEachGradientOnce) {
  std::vector<int64_t> idv(3 * 50);
  for (size_t i = 0; i < idv.size(); ++i) idv[i] = static_cast<int64_t>((i * 11) % 37);
  const Tensor ids = *Tensor::FromInt64s({3, 50}, idv);
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Tensor table = *R({40, 24}, 41, 3.0f).ToDType(t), dy = *R({3, 50, 24}, 42, 5.0f).ToDType(t);
    const Tensor want = *Embedding(*table.ToDType(DType::kF32), ids, 4, true)->ToDType(t);
    const Tensor want_grad = *EmbeddingBackward(*dy.ToDType(DType::kF32), ids, 40, 4)->ToDType(t);
    for (bool gpu : {false, true}) {
      const std::string what = std::string(DTypeName(t)) + (gpu ? " cuda" : " cpu");
#ifdef COLOD_CUDA_EMULATION
      const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
      const Tensor got = *Embedding(gpu ? Dev(table) : table, ids, 4, true);
#ifdef COLOD_CUDA_EMULATION
      if (gpu) {
        EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before, 1u) << what;
      }
      const uint64_t before_grad = colod_cuda_emu::GetCounters().kernel_launches;
#endif
      const Tensor grad = *EmbeddingBackward(gpu ? Dev(dy) : dy, ids, 40, 4);
#ifdef COLOD_CUDA_EMULATION
      if (gpu) {
        EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before_grad, 1u) << what;
      }
#endif
      EXPECT_EQ(got.dtype(), t) << what;
      EXPECT_EQ(grad.dtype(), t) << what;
      EXPECT_EQ(got.ToBytes(), want.ToBytes()) << what;
      EXPECT_EQ(grad.ToBytes(), want_grad.ToBytes()) << what;
    }
  }
}

#ifdef COLOD_CUDA_EMULATION
// A device whose context a fault broke: reading a tensor back is the
// copy's error, returned (ReadFloats, ReadInt64s, ReadBytes), where the
// readers of tests and tools end the process; so is the copy a strided
// view needs (TryContiguous, and the ops and reads that take one).
TEST_F(CudaLayerOps, AReadFromAFaultedDeviceReturnsCudasError) {
  const Tensor f = Dev(*Tensor::FromFloats({3}, {1, 2, 3}));
  const Tensor i = Dev(*Tensor::FromInt64s({2}, {7, 8}));
  // A strided view: reading or using it takes a copy on the device first.
  const Tensor t = *Dev(*Tensor::FromFloats({2, 3}, {1, 2, 3, 4, 5, 6})).Transpose(0, 1);
  ASSERT_FALSE(t.is_contiguous());
  ASSERT_EQ(*f.ReadFloats(), (std::vector<float>{1, 2, 3}));
  ASSERT_EQ(*i.ReadInt64s(), (std::vector<int64_t>{7, 8}));
  colod_cuda_emu::FaultDeviceAtLaunch(0, 0);
  const absl::StatusOr<std::vector<float>> floats = f.ReadFloats();
  const absl::StatusOr<std::vector<int64_t>> ints = i.ReadInt64s();
  const absl::StatusOr<std::string> bytes = f.ReadBytes();
  const absl::StatusOr<Tensor> sum = Add(f, f);
  const absl::StatusOr<std::vector<float>> strided = t.ReadFloats();
  const absl::StatusOr<Tensor> dense = t.TryContiguous();
  const absl::StatusOr<Tensor> strided_sum = Add(t, t);
  const absl::StatusOr<Tensor> reshaped = t.Reshape({6});
  colod_cuda_emu::ClearDeviceFaults();
  for (const absl::Status& s : {floats.status(), ints.status(), bytes.status(), sum.status(), strided.status(),
                                dense.status(), strided_sum.status(), reshaped.status()}) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("illegal memory access"), std::string::npos) << s;
  }
  EXPECT_EQ(*f.ReadFloats(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(*t.ReadFloats(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}
#endif

// GEMMs from several threads share the device's one cuBLAS handle (a
// handle per thread leaked one, with its workspace, per job thread).
TEST_F(CudaLayerOps, OneCublasHandlePerDeviceWhateverTheThreads) {
  const Tensor a = R({16, 8}, 31), b = R({8, 4}, 32);
  const Tensor want = *MatMul(a, b);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] { ExpectNear(*MatMul(Dev(a), Dev(b)), want, 1e-5, "gemm on another thread"); });
  }
  for (auto& t : threads) t.join();
#ifdef COLOD_CUDA_EMULATION
  EXPECT_EQ(colod_cublas_emu::LiveHandles(), 1);  // device 0 only, however many threads
#endif
}

TEST_F(CudaLayerOps, GemmInEveryLayoutAndType) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const Tensor a = R(ta ? Shape{67, 45} : Shape{45, 67}, 1), b = R(tb ? Shape{33, 67} : Shape{67, 33}, 2);
      ExpectNear(*MatMul(Dev(a), Dev(b), ta, tb), *MatMul(a, b, ta, tb), 1e-5, "f32 gemm");  // TF32 off
    }
  }
  const Tensor a = *R({64, 96}, 3).ToDType(DType::kBF16), b = *R({96, 32}, 4).ToDType(DType::kBF16);
  ExpectNear(*MatMul(Dev(a), Dev(b)), *MatMul(a, b), 1e-2, "bf16 gemm");
  const Tensor ah = *R({64, 96}, 5).ToDType(DType::kF16), bh = *R({96, 32}, 6).ToDType(DType::kF16);
  ExpectNear(*MatMul(Dev(ah), Dev(bh)), *MatMul(ah, bh), 1e-3, "f16 gemm");
}

// A GEMM's dimensions are cuBLAS's (and BLAS's) ints: larger or negative
// ones are refused before anything is enqueued, by both twins alike.
TEST_F(CudaLayerOps, GemmRefusesDimensionsOutsideInt) {
  const int64_t big = int64_t{1} << 31;
  for (const DeviceKernels* kern : {&CpuKernels(), CudaKernels()}) {
    ASSERT_NE(kern, nullptr);
    for (const auto& [m, n, k] : {std::tuple{big, int64_t{1}, int64_t{1}}, std::tuple{int64_t{1}, big, int64_t{1}},
                                  std::tuple{int64_t{1}, int64_t{1}, big}, std::tuple{int64_t{1}, int64_t{1}, int64_t{-1}}}) {
      const absl::Status s = kern->Gemm(0, kernels::ElemType::kBF16, false, false, m, n, k, nullptr, nullptr, nullptr);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << m << " " << n << " " << k << ": " << s;
      const absl::Status f = kern->GemmF32Out(0, kernels::ElemType::kBF16, true, false, m, n, k, nullptr, nullptr,
                                              nullptr, true);
      EXPECT_EQ(f.code(), absl::StatusCode::kInvalidArgument) << m << " " << n << " " << k << ": " << f;
    }
  }
}

// Sets COLOD_GEMM_EPILOGUES (null: unset) for a scope, and restores it.
class ScopedGemmEpilogues {
 public:
  explicit ScopedGemmEpilogues(const char* value) {
    if (const char* old = getenv(kName); old != nullptr) saved_ = old;
    Set(value);
  }
  ~ScopedGemmEpilogues() { Set(saved_.has_value() ? saved_->c_str() : nullptr); }

 private:
  static void Set(const char* value) {
    if (value != nullptr) {
      setenv(kName, value, 1);
    } else {
      unsetenv(kName);
    }
  }
  static constexpr const char* kName = "COLOD_GEMM_EPILOGUES";
  std::optional<std::string> saved_;
};

// A linear layer's bias in its GEMMs (MatMulBias, LinearWeightGrads: on
// CUDA cuBLASLt's BIAS and BGRADB epilogues) against the CPU twins, in every
// layout and float type, fused and with COLOD_GEMM_EPILOGUES=0 (the GEMM and
// the bias kernels apart); the CPU's own against MatMul, BiasAdd and
// BiasGrad.
TEST_F(CudaLayerOps, GemmBiasEpiloguesMatchTheCpu) {
  for (const char* fuse : {static_cast<const char*>(nullptr), "0"}) {
    ScopedGemmEpilogues scope(fuse);
    const std::string mode = fuse == nullptr ? "fused" : "unfused";
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      const double tol = t == DType::kF32 ? 1e-5 : (t == DType::kBF16 ? 1e-2 : 2e-3);
      const std::string what = mode + " " + std::string(DTypeName(t));
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          const Tensor a = *R(ta ? Shape{40, 24} : Shape{24, 40}, 11).ToDType(t);
          const Tensor b = *R(tb ? Shape{36, 40} : Shape{40, 36}, 12).ToDType(t);
          const Tensor bias = *R({36}, 13).ToDType(t);
          const Tensor cpu = *MatMulBias(a, b, bias, ta, tb);
          ExpectNear(*MatMulBias(Dev(a), Dev(b), Dev(bias), ta, tb), cpu, tol, what + " gemm + bias");
          Tensor unfused = *MatMul(*a.ToDType(DType::kF32), *b.ToDType(DType::kF32), ta, tb);
          ASSERT_TRUE(BiasAddInPlace(unfused, *bias.ToDType(DType::kF32)).ok());
          ExpectNear(*Dev(cpu).ToDType(DType::kF32), unfused, tol, what + " cpu gemm + bias against f32");
        }
      }
      // Bias + tanh GELU in the epilogue: y from pre's f32 value, pre the
      // product plus the bias. 36 outputs run unfused on CUDA (cuBLASLt's
      // GELU input needs a leading dimension divisible by 8), 32 fused.
      for (int64_t n : {36, 32}) {
        const Tensor x = *R({2, 6, 40}, 26).ToDType(t), w = *R({n, 40}, 27).ToDType(t);
        const Tensor bias = *R({n}, 28).ToDType(t);
        const std::string gw = what + " n=" + std::to_string(n);
        const BiasGeluProduct cpu = *MatMulBiasGelu(x, w, bias, /*trans_b=*/true);
        const BiasGeluProduct gpu = *MatMulBiasGelu(Dev(x), Dev(w), Dev(bias), /*trans_b=*/true);
        ExpectNear(gpu.y, cpu.y, tol, gw + " gemm + bias + gelu");
        ExpectNear(gpu.pre, cpu.pre, tol, gw + " gemm + bias + gelu's input");
        const Tensor pre32 = *MatMul(*x.ToDType(DType::kF32), *w.ToDType(DType::kF32), false, true);
        Tensor want_pre = pre32;
        ASSERT_TRUE(BiasAddInPlace(want_pre, *bias.ToDType(DType::kF32)).ok());
        ExpectNear(*Dev(cpu.pre).ToDType(DType::kF32), want_pre, tol, gw + " cpu gelu's input against f32");
        ExpectNear(*Dev(cpu.y).ToDType(DType::kF32), *Gelu(want_pre, GeluApprox::kTanh), tol,
                   gw + " cpu gelu against f32");
      }
      // Rows [2, 5, ..] of a layer's output gradient and input; a bias of
      // f32 on bf16 rows converted as BiasAdd converts it.
      const Tensor dy = *R({2, 5, 24}, 14).ToDType(t), x = *R({2, 5, 40}, 15).ToDType(t);
      const LinearGrads cpu = *LinearWeightGrads(dy, x);
      const LinearGrads gpu = *LinearWeightGrads(Dev(dy), Dev(x));
      ExpectNear(gpu.dw, cpu.dw, tol, what + " dw");
      ExpectNear(gpu.db, cpu.db, tol, what + " db");
      const Tensor dy2 = *dy.Reshape({10, 24}), x2 = *x.Reshape({10, 40});
      ExpectNear(*Dev(cpu.dw).ToDType(DType::kF32),
                 *MatMul(*dy2.ToDType(DType::kF32), *x2.ToDType(DType::kF32), /*trans_a=*/true), tol,
                 what + " cpu dw against f32");
      ExpectNear(*Dev(cpu.db).ToDType(DType::kF32), *BiasGrad(*dy2.ToDType(DType::kF32)), tol,
                 what + " cpu db against f32");
      ExpectNear(*MatMulBias(Dev(R({3, 4, 40}, 16)), Dev(R({40, 36}, 17)), Dev(R({36}, 18))),
                 *MatMulBias(R({3, 4, 40}, 16), R({40, 36}, 17), R({36}, 18)), 1e-5, what + " rows [3, 4, 40]");
    }
  }
  // A bias of f32 on bf16 operands: converted to bf16, as BiasAdd converts it.
  {
    const Tensor a = *R({16, 40}, 34).ToDType(DType::kBF16), b = *R({40, 32}, 35).ToDType(DType::kBF16);
    const Tensor bias = R({32}, 36);
    const Tensor cpu = *MatMulBias(a, b, bias);
    ExpectNear(*MatMulBias(Dev(a), Dev(b), Dev(bias)), cpu, 1e-2, "an f32 bias on bf16 operands");
    Tensor want = *MatMul(*a.ToDType(DType::kF32), *b.ToDType(DType::kF32));
    ASSERT_TRUE(BiasAddInPlace(want, *bias.ToDType(DType::kBF16)->ToDType(DType::kF32)).ok());
    ExpectNear(*Dev(cpu).ToDType(DType::kF32), want, 1e-2, "the cpu's f32 bias on bf16 operands");
  }
  // Mixed dtypes and bad shapes: as MatMul and BiasAdd answer them.
  const Tensor a = R({4, 8}, 19), b = *R({8, 6}, 20).ToDType(DType::kBF16);
  ExpectNear(*MatMulBias(Dev(a), Dev(b), Dev(R({6}, 21))), *MatMulBias(a, b, R({6}, 21)), 1e-2, "mixed dtypes");
  EXPECT_EQ(MatMulBias(Dev(a), Dev(R({8, 6}, 22)), Dev(R({5}, 23))).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MatMulBias(Dev(a), Dev(R({8, 6}, 22)), R({6}, 23)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LinearWeightGrads(Dev(R({3, 4}, 24)), Dev(R({2, 5}, 25))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// An MLP's down projection's input gradient through the up projection's
// GELU in one GEMM (MatMulGeluBackward; on CUDA cuBLASLt's DGELU epilogue)
// against the CPU twin, in every float type, fused and with
// COLOD_GEMM_EPILOGUES=0 (the GEMM, then GELU's backward kernel); the
// CPU's against MatMul then GeluBackward: the same bits at f32, within a
// rounding of the half types (one rounding fewer). K = 36 runs unfused on
// CUDA (GELU's input needs a leading dimension divisible by 8), 32 fused,
// where the emulation launches no kernel of colod's.
TEST_F(CudaLayerOps, GeluBackwardInTheGemmMatchesTheCpu) {
  for (const char* fuse : {static_cast<const char*>(nullptr), "0"}) {
    ScopedGemmEpilogues scope(fuse);
    const bool fused = fuse == nullptr;
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      const double tol = t == DType::kF32 ? 1e-5 : (t == DType::kBF16 ? 1e-2 : 2e-3);
      for (int64_t kk : {36, 32}) {
        const std::string what = std::string(fused ? "fused " : "unfused ") + std::string(DTypeName(t)) +
                                 " K=" + std::to_string(kk);
        const Tensor dy = *R({2, 6, 40}, 61).ToDType(t), w = *R({40, kk}, 62).ToDType(t);
        const Tensor pre = *R({2, 6, kk}, 63).ToDType(t);
        const Tensor cpu = *MatMulGeluBackward(dy, w, pre);
        ASSERT_EQ(cpu.shape(), pre.shape()) << what;
        const Tensor ddy = Dev(dy), dw = Dev(w), dpre = Dev(pre);
#ifdef COLOD_CUDA_EMULATION
        const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
        const Tensor gpu = *MatMulGeluBackward(ddy, dw, dpre);
#ifdef COLOD_CUDA_EMULATION
        const uint64_t launches = colod_cuda_emu::GetCounters().kernel_launches - before;
        if (fused && kk == 32) {
          EXPECT_EQ(launches, 0u) << what << ": GELU's backward in cuBLASLt's epilogue";
        } else {
          EXPECT_GE(launches, 1u) << what << ": GELU's backward kernel after the GEMM";
        }
#endif
        ExpectNear(gpu, cpu, tol, what + " against the cpu");
        const Tensor apart = *GeluBackward(*MatMul(dy, w), pre, GeluApprox::kTanh);
        if (t == DType::kF32) {
          EXPECT_EQ(cpu.ToBytes(), apart.ToBytes()) << what << ": the cpu's bits of MatMul then GeluBackward";
        }
        const Tensor want = *GeluBackward(*MatMul(*dy.ToDType(DType::kF32), *w.ToDType(DType::kF32)),
                                          *pre.ToDType(DType::kF32), GeluApprox::kTanh);
        ExpectNear(*Dev(cpu).ToDType(DType::kF32), want, tol, what + " cpu against f32");
      }
    }
  }
  // Shapes and dtypes that do not chain: refused on both devices.
  const Tensor dy = R({2, 3, 8}, 64), w = R({8, 16}, 65), pre = R({2, 3, 16}, 66);
  for (bool cuda : {false, true}) {
    auto on = [&](const Tensor& t) { return cuda ? Dev(t) : t; };
    EXPECT_TRUE(MatMulGeluBackward(on(dy), on(w), on(pre)).ok());
    EXPECT_EQ(MatMulGeluBackward(on(dy), on(w), on(R({2, 3, 15}, 67))).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(MatMulGeluBackward(on(dy), on(w), on(R({3, 2, 16}, 67))).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(MatMulGeluBackward(on(dy), on(R({9, 16}, 68)), on(pre)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(MatMulGeluBackward(on(dy), on(*w.ToDType(DType::kBF16)), on(pre)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// The fused bias is added to the f32 products, and the sum rounded once: a
// bf16 product of 1 + 3 * 2^-9 plus a bias of -2^-9 is the tie 1 + 2^-8,
// which rounds to even, 1; the product rounded first (1 + 2^-7) plus the
// bias rounds to 1 + 2^-7. Under the emulation the fused GEMMs (bias; bias
// and GELU; the weight gradient) launch no kernel of colod's (cuBLASLt's
// epilogues did the adds, the GELU and the sums); apart, the bias, GELU and
// column-sum kernels run.
TEST_F(CudaLayerOps, AFusedBiasIsAddedToTheProductsBeforeTheOneRounding) {
  const Tensor a = *Tensor::FromFloats({1, 2}, {1.0f, 3 * std::ldexp(1.0f, -9)})->ToDType(DType::kBF16);
  const Tensor b = *Tensor::FromFloats({2, 1}, {1.0f, 1.0f})->ToDType(DType::kBF16);
  const Tensor bias = *Tensor::FromFloats({1}, {-std::ldexp(1.0f, -9)})->ToDType(DType::kBF16);
  EXPECT_EQ(MatMulBias(a, b, bias)->ToFloats(), std::vector<float>{1.0f}) << "the CPU rounds once";
  const Tensor da = Dev(a), db = Dev(b), dbias = Dev(bias);
  const Tensor dy = Dev(*R({64, 24}, 30).ToDType(DType::kBF16)), x = Dev(*R({64, 40}, 31).ToDType(DType::kBF16));
  for (const char* fuse : {static_cast<const char*>(nullptr), "0"}) {
    ScopedGemmEpilogues scope(fuse);
    const bool fused = fuse == nullptr;
#ifdef COLOD_CUDA_EMULATION
    const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    const Tensor y = *MatMulBias(da, db, dbias);
    ASSERT_TRUE(LinearWeightGrads(dy, x).ok());
    ASSERT_TRUE(MatMulBiasGelu(x, Dev(*R({24, 40}, 32).ToDType(DType::kBF16)),
                               Dev(*R({24}, 33).ToDType(DType::kBF16)), /*trans_b=*/true)
                    .ok());
    EXPECT_EQ(FusesGemmEpilogues(Device::Cuda(0)), fused);
#ifdef COLOD_CUDA_EMULATION
    const uint64_t launches = colod_cuda_emu::GetCounters().kernel_launches - before;
    if (fused) {
      EXPECT_EQ(launches, 0u) << "the bias and GELU in cuBLASLt's epilogues";
    } else {
      EXPECT_GE(launches, 4u) << "a bias add, a column sum, a bias add and a GELU";
    }
#endif
    EXPECT_EQ(y.ToFloats(), std::vector<float>{fused ? 1.0f : 1.0f + std::ldexp(1.0f, -7)})
        << (fused ? "fused" : "unfused");
  }
}

// x rounded to TF32 (10 mantissa bits), ties to even: frexp's mantissa
// scaled to 11 significant bits and rounded by the FPU's default mode.
[[maybe_unused]] float Tf32(float x) {  // used under the emulation only
  int e = 0;
  const double m = std::frexp(static_cast<double>(x), &e);
  return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(m, 11)), e - 11));
}

// SetAllowTf32 (--allow-tf32): f32 GEMMs on the device may round their
// operands to TF32. The product stays within TF32's bound of the exact one
// (each operand off by at most 2^-10 relative, whatever the rounding mode);
// under the emulation, which rounds to nearest even, it is the f32 product
// of the rounded operands and differs from the f32 GEMM. Turned off again,
// the device computes f32; the CPU computes f32 either way.
TEST_F(CudaLayerOps, Tf32GemmsRoundTheirOperandsOnlyWhenAllowed) {
  const int64_t m = 48, k = 256, n = 40;
  const Tensor a = R({m, k}, 31), b = R({k, n}, 32);
  const Tensor exact = *MatMul(a, b);
  ASSERT_TRUE(SetAllowTf32(Device::Cuda(0), true).ok());
  ASSERT_TRUE(SetAllowTf32(Device::Cpu(), true).ok());
  const Tensor tf32 = *MatMul(Dev(a), Dev(b));
  EXPECT_EQ(MatMul(a, b)->ToBytes(), exact.ToBytes()) << "the CPU has no TF32";
  ASSERT_TRUE(SetAllowTf32(Device::Cuda(0), false).ok());
  ASSERT_TRUE(SetAllowTf32(Device::Cpu(), false).ok());
  ExpectNear(*MatMul(Dev(a), Dev(b)), exact, 1e-5, "f32 gemm with TF32 off again");
  EXPECT_FALSE(SetAllowTf32(Device::Cuda(kernels::CudaDeviceCount()), true).ok());

  const std::vector<float> av = a.ToFloats(), bv = b.ToFloats(), got = tf32.ToFloats(), want = exact.ToFloats();
  double worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double abs_sum = 0;
      for (int64_t p = 0; p < k; ++p) abs_sum += std::fabs(av[i * k + p] * bv[p * n + j]);
      const double err = std::fabs(got[i * n + j] - want[i * n + j]);
      ASSERT_LE(err, std::ldexp(abs_sum, -9) + 1e-5 * (1 + std::fabs(want[i * n + j]))) << i << "," << j;
      worst = std::max(worst, err / (1 + std::fabs(want[i * n + j])));
    }
  }
#ifdef COLOD_CUDA_EMULATION
  std::vector<float> ar = av, br = bv;
  for (float& x : ar) x = Tf32(x);
  for (float& x : br) x = Tf32(x);
  ExpectNear(tf32, *MatMul(*Tensor::FromFloats({m, k}, ar), *Tensor::FromFloats({k, n}, br)), 1e-5,
             "TF32 gemm against the rounded operands' f32 product");
  EXPECT_GT(worst, 1e-4) << "TF32 changed nothing";
#endif
}

// Rows of 129 take the scalar kernels (a block a row for the norms); rows of
// 128 the packed ones (a warp a row, 16-byte packs: Packable in
// layer_ops.cu). Both equal the CPU.
TEST_F(CudaLayerOps, ElementwiseAndNormsMatchTheCpu) {
  for (int64_t n : {129, 128}) {
    SCOPED_TRACE(n);
    const Tensor x = R({37, n}, 7), dy = R({37, n}, 8), g = R({n}, 9), b = R({n}, 10);
    ExpectNear(*BiasAdd(Dev(x), Dev(b)), *BiasAdd(x, b), 1e-6, "bias_add");
    Tensor in_place = Dev(x);
    ASSERT_TRUE(BiasAddInPlace(in_place, Dev(b)).ok());
    ExpectNear(in_place, *BiasAdd(x, b), 1e-6, "bias_add in place");
    ExpectNear(*BiasGrad(Dev(dy)), *BiasGrad(dy), 1e-5, "bias_grad");
    for (GeluApprox a : {GeluApprox::kNone, GeluApprox::kTanh}) {
      ExpectNear(*Gelu(Dev(x), a), *Gelu(x, a), 1e-5, "gelu");
      ExpectNear(*GeluBackward(Dev(dy), Dev(x), a), *GeluBackward(dy, x, a), 1e-5, "gelu backward");
      ExpectNear(*BiasGelu(Dev(x), Dev(b), a), *BiasGelu(x, b, a), 1e-5, "bias_gelu");
      const BiasGeluGrads bg = *BiasGeluBackward(Dev(dy), Dev(x), Dev(b), a), want = *BiasGeluBackward(dy, x, b, a);
      ExpectNear(bg.dx, want.dx, 1e-5, "bias_gelu dx");
      ExpectNear(bg.db, want.db, 1e-4, "bias_gelu db");
    }
    for (ActivationKind act : {ActivationKind::kSilu, ActivationKind::kRelu}) {
      ExpectNear(*Activation(Dev(x), act), *Activation(x, act), 1e-5, "activation");
      ExpectNear(*ActivationBackward(Dev(dy), Dev(x), act), *ActivationBackward(dy, x, act), 1e-5,
                 "activation backward");
    }
    auto ln = LayerNorm(x, g, b, 1e-5f);
    auto dln = LayerNorm(Dev(x), Dev(g), Dev(b), 1e-5f);
    ASSERT_TRUE(dln.ok()) << dln.status();
    ExpectNear(dln->y, ln->y, 1e-5, "layer_norm");
    auto lg = LayerNormBackward(dy, x, g, ln->mean, ln->rstd);
    auto dlg = LayerNormBackward(Dev(dy), Dev(x), Dev(g), dln->mean, dln->rstd);
    ASSERT_TRUE(dlg.ok()) << dlg.status();
    ExpectNear(dlg->dx, lg->dx, 1e-4, "layer_norm dx");
    ExpectNear(dlg->dgamma, lg->dgamma, 1e-4, "layer_norm dgamma");
    ExpectNear(dlg->dbeta, lg->dbeta, 1e-4, "layer_norm dbeta");
    auto rn = RmsNorm(x, g, 1e-6f);
    auto drn = RmsNorm(Dev(x), Dev(g), 1e-6f);
    ExpectNear(drn->y, rn->y, 1e-5, "rms_norm");
    // With a residual: the sum and the norm in one kernel, as on the CPU.
    const LayerNormResult rln = *LayerNorm(x, g, b, 1e-5f, &dy);
    const Tensor ddy = Dev(dy);
    const LayerNormResult drln = *LayerNorm(Dev(x), Dev(g), Dev(b), 1e-5f, &ddy);
    ExpectNear(drln.sum, rln.sum, 1e-6, "residual sum");
    ExpectNear(drln.y, rln.y, 1e-5, "residual layer_norm");
    ExpectNear(drln.rstd, rln.rstd, 1e-5, "residual layer_norm rstd");
    const RmsNormResult rrn = *RmsNorm(x, g, 1e-6f, &dy), drrn = *RmsNorm(Dev(x), Dev(g), 1e-6f, &ddy);
    ExpectNear(drrn.sum, rrn.sum, 1e-6, "residual sum (rms)");
    ExpectNear(drrn.y, rrn.y, 1e-5, "residual rms_norm");
    auto rg = RmsNormBackward(dy, x, g, rn->rstd);
    auto drg = RmsNormBackward(Dev(dy), Dev(x), Dev(g), drn->rstd);
    ExpectNear(drg->dx, rg->dx, 1e-4, "rms_norm dx");
    ExpectNear(drg->dgamma, rg->dgamma, 1e-4, "rms_norm dgamma");
  }
}

// The element-wise kernels run in packs of 16 bytes where every operand is
// 16-byte aligned and the row a multiple of the pack (8 bf16, 4 f32), else
// element by element: both give the same bits, as they do the same f32
// arithmetic, and equal the CPU twin. A view one element into a buffer is
// misaligned, so it takes the scalar kernels. Same-type strided copies move
// words of up to 16 bytes: a head split (one of Q, K, V of [tokens, 3,
// heads, 64], heads first), aligned or not, and a transpose of the inner
// dimension equal the CPU's copies bit for bit.
TEST_F(CudaLayerOps, PackedElementwiseKernelsGiveTheScalarKernelsBits) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    const std::string name(DTypeName(t));
    auto low = [&](const Tensor& v) { return *v.ToDType(t); };
    auto misaligned = [&](const Tensor& v) {  // v's values on the device, one element into a buffer
      const Tensor buffer = *Tensor::Zeros({v.numel() + 1}, t, Device::Cuda(0));
      Tensor view = *(*buffer.Narrow(0, 1, v.numel())).Reshape(v.shape());
      EXPECT_TRUE(view.CopyFrom(Dev(low(v))).ok());
      return view;
    };
    auto same_bits = [&](const Tensor& packed, const Tensor& scalar, const Tensor& cpu, const std::string& what) {
      EXPECT_EQ(packed.ToBytes(), scalar.ToBytes()) << what << " " << name;
      const std::vector<float> g = packed.ToFloats(), c = cpu.ToFloats();
      ASSERT_EQ(g.size(), c.size()) << what;
      for (size_t i = 0; i < g.size(); ++i) {
        ASSERT_NEAR(g[i], c[i], 1e-5 * (1 + std::fabs(c[i]))) << what << " " << name << " at " << i;
      }
    };
    const Tensor x = low(R({24, 64}, 51)), dy = low(R({24, 64}, 52)), b = low(R({64}, 53));
    const Tensor dx = Dev(x), ddy = Dev(dy), db = Dev(b), mx = misaligned(x), mdy = misaligned(dy);
    same_bits(*BiasAdd(dx, db), *BiasAdd(mx, db), *BiasAdd(x, b), "bias_add");
    same_bits(*Add(dx, ddy), *Add(mx, mdy), *Add(x, dy), "add");
    for (GeluApprox a : {GeluApprox::kNone, GeluApprox::kTanh}) {
      same_bits(*Gelu(dx, a), *Gelu(mx, a), *Gelu(x, a), "gelu");
      same_bits(*BiasGelu(dx, db, a), *BiasGelu(mx, db, a), *BiasGelu(x, b, a), "bias_gelu");
      same_bits(*GeluBackward(ddy, dx, a), *GeluBackward(mdy, mx, a), *GeluBackward(dy, x, a), "gelu_backward");
    }
    const Tensor qkv = low(R({10, 3, 4, 64}, 54));
    auto head_split = [](const Tensor& v) {  // K, heads first
      return (*(*(*v.Narrow(1, 1, 1)).Reshape({10, 4, 64})).Transpose(0, 1)).Contiguous();
    };
    const Tensor want = head_split(qkv);
    EXPECT_EQ(head_split(Dev(qkv)).ToBytes(), want.ToBytes()) << "head split " << name;
    EXPECT_EQ(head_split(misaligned(qkv)).ToBytes(), want.ToBytes()) << "misaligned head split " << name;
    const Tensor inner = (*want.Transpose(1, 2)).Contiguous();
    EXPECT_EQ((*Dev(want).Transpose(1, 2)).Contiguous().ToBytes(), inner.ToBytes()) << "transpose " << name;
  }
}

// The norm backwards with the residual stream's gradient folded in (the
// warp kernels in 16-byte packs at n = 64, the block kernels at 70; a
// misaligned gradient too): dx has
// the bits of Add after the unfolded backward on the device, and the CPU
// twin's values; the parameter gradients are the unfolded ones.
TEST_F(CudaLayerOps, NormBackwardsFoldTheResidualGradientWithTheAddsBits) {
  for (int64_t n : {64, 70}) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(std::string(DTypeName(t)) + " n=" + std::to_string(n));
      auto in = [t](const Shape& shape, uint64_t seed) { return *R(shape, seed).ToDType(t); };
      const Tensor x = in({8, n}, 81), dy = in({8, n}, 82), acc = in({8, n}, 83), g = in({n}, 84),
                   b = in({n}, 85);
      const Tensor dx = Dev(x), ddy = Dev(dy), dacc = Dev(acc), dg = Dev(g), db = Dev(b);
      const LayerNormResult ln = *LayerNorm(dx, dg, db, 1e-5f);
      const LayerNormGrads plain = *LayerNormBackward(ddy, dx, dg, ln.mean, ln.rstd);
      auto folded = LayerNormBackward(ddy, dx, dg, ln.mean, ln.rstd, &dacc);
      ASSERT_TRUE(folded.ok()) << folded.status();
      EXPECT_EQ(folded->dx.ToBytes(), Add(dacc, plain.dx)->ToBytes());
      EXPECT_EQ(folded->dgamma.ToBytes(), plain.dgamma.ToBytes());
      EXPECT_EQ(folded->dbeta.ToBytes(), plain.dbeta.ToBytes());
      const LayerNormResult cln = *LayerNorm(x, g, b, 1e-5f);
      const double tol = t == DType::kF32 ? 1e-4 : (t == DType::kBF16 ? 4.0 / 128 : 4.0 / 1024);
      ExpectNear(folded->dx, LayerNormBackward(dy, x, g, cln.mean, cln.rstd, &acc)->dx, tol, "layer_norm dx");
      const RmsNormResult rn = *RmsNorm(dx, dg, 1e-6f);
      const RmsNormGrads rplain = *RmsNormBackward(ddy, dx, dg, rn.rstd);
      auto rfolded = RmsNormBackward(ddy, dx, dg, rn.rstd, &dacc);
      ASSERT_TRUE(rfolded.ok()) << rfolded.status();
      EXPECT_EQ(rfolded->dx.ToBytes(), Add(dacc, rplain.dx)->ToBytes());
      EXPECT_EQ(rfolded->dgamma.ToBytes(), rplain.dgamma.ToBytes());
      const RmsNormResult crn = *RmsNorm(x, g, 1e-6f);
      ExpectNear(rfolded->dx, RmsNormBackward(dy, x, g, crn.rstd, &acc)->dx, tol, "rms_norm dx");
      // The gradient as a view one element into a buffer (misaligned for the
      // packs): the row kernel the unfolded backward runs, then the add's
      // kernel; the same bits.
      const Tensor buffer = *Tensor::Zeros({acc.numel() + 1}, t, Device::Cuda(0));
      Tensor off = *(*buffer.Narrow(0, 1, acc.numel())).Reshape(acc.shape());
      ASSERT_TRUE(off.CopyFrom(dacc).ok());
      ASSERT_TRUE(FoldsInto(dx, off));
      EXPECT_EQ(LayerNormBackward(ddy, dx, dg, ln.mean, ln.rstd, &off)->dx.ToBytes(), folded->dx.ToBytes());
      EXPECT_EQ(RmsNormBackward(ddy, dx, dg, rn.rstd, &off)->dx.ToBytes(), rfolded->dx.ToBytes());
    }
  }
}

// The norm backwards give dgamma and dbeta from the pass that gives dx
// (NormBackwardFoldedKernel, layer_ops.cu) where a row's sums fit 64 f32
// registers a lane (LayerNorm's rows up to 1024, RMSNorm's up to 2048): one
// launch. Rows go to blocks of 32: one block (8 rows), 2 blocks in one group
// (40), 3 blocks in groups of 2 (70), 10 in groups of 4 (300), the last
// group part full; past 32768 rows
// a block takes rows / 1024 (33000: 1000 blocks of 33 in 32 groups; not
// under TSan). Widths of 1, 2, 3 (GPT-2's 768 in bf16), 4, 8 (LLaMA
// 1B's 2048 in bf16, RMSNorm; 768 in f32) and 16 (2048 in f32, RMSNorm)
// packs a lane; LayerNorm at 2048 is too wide and runs the row kernel and
// NormParamGrad's (2 launches). dx, dgamma and dbeta equal the CPU's and
// repeat bitwise, and dgamma and dbeta equal NormParamGrad's over the same
// row statistics within f32 rounding.
TEST_F(CudaLayerOps, NormBackwardsGiveTheParameterGradientsInTheSamePass) {
  struct Case {
    DType t;
    int64_t rows, n;
    uint64_t ln_launches, rms_launches;
  };
  std::vector<Case> cases = {Case{DType::kF32, 300, 64, 1, 1},  Case{DType::kBF16, 70, 768, 1, 1},
                             Case{DType::kBF16, 40, 2048, 2, 1}, Case{DType::kF16, 8, 136, 1, 1},
                             Case{DType::kF32, 40, 200, 1, 1},   Case{DType::kF32, 8, 512, 1, 1},
                             Case{DType::kF32, 40, 768, 1, 1},   Case{DType::kF32, 8, 2048, 2, 1}};
#ifndef COLOD_CUDA_EMU_TSAN  // 1000 blocks of 256 threads, each warp exchange checked byte by byte: minutes there
  cases.push_back(Case{DType::kF32, 33000, 8, 1, 1});
#endif
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(DTypeName(c.t)) + " " + std::to_string(c.rows) + " x " + std::to_string(c.n));
    auto in = [&](const Shape& shape, uint64_t seed) { return *R(shape, seed).ToDType(c.t); };
    const Tensor x = in({c.rows, c.n}, 91), dy = in({c.rows, c.n}, 92), g = in({c.n}, 93), b = in({c.n}, 94);
    const Tensor dx = Dev(x), ddy = Dev(dy), dg = Dev(g), db = Dev(b);
    const double tol = c.t == DType::kF32 ? 1e-4 : (c.t == DType::kBF16 ? 4.0 / 128 : 4.0 / 1024);
    // The parameter gradients are rounded to the type once: within 2 units.
    const double param_tol = c.t == DType::kF32 ? 1e-4 : (c.t == DType::kBF16 ? 2.0 / 128 : 2.0 / 1024);
    // The CPU's row statistics (no forward: its row kernel is slow in the
    // emulation at 33000 rows).
    const LayerNormResult cln = *LayerNorm(x, g, b, 1e-5f);
    const Tensor mean = Dev(cln.mean), rstd = Dev(cln.rstd);
#ifdef COLOD_CUDA_EMULATION
    uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    const LayerNormGrads got = *LayerNormBackward(ddy, dx, dg, mean, rstd);
#ifdef COLOD_CUDA_EMULATION
    EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before, c.ln_launches) << "layer_norm backward";
#endif
    const LayerNormGrads again = *LayerNormBackward(ddy, dx, dg, mean, rstd);
    EXPECT_EQ(got.dx.ToBytes(), again.dx.ToBytes());
    EXPECT_EQ(got.dgamma.ToBytes(), again.dgamma.ToBytes());
    EXPECT_EQ(got.dbeta.ToBytes(), again.dbeta.ToBytes());
    const LayerNormGrads want = *LayerNormBackward(dy, x, g, cln.mean, cln.rstd);
    ExpectNear(got.dx, want.dx, tol, "layer_norm dx");
    ExpectNear(got.dgamma, want.dgamma, param_tol, "layer_norm dgamma");
    ExpectNear(got.dbeta, want.dbeta, param_tol, "layer_norm dbeta");
    const NormParamGrads two = *NormParamGrad(ddy, dx, mean, rstd, /*beta=*/true);
    ExpectNear(got.dgamma, *two.dgamma.To(Device::Cpu()), param_tol, "layer_norm dgamma, NormParamGrad's");
    ExpectNear(got.dbeta, *two.dbeta->To(Device::Cpu()), param_tol, "layer_norm dbeta, NormParamGrad's");

    const RmsNormResult crn = *RmsNorm(x, g, 1e-6f);
    const Tensor rms_rstd = Dev(crn.rstd);
#ifdef COLOD_CUDA_EMULATION
    before = colod_cuda_emu::GetCounters().kernel_launches;
#endif
    const RmsNormGrads rgot = *RmsNormBackward(ddy, dx, dg, rms_rstd);
#ifdef COLOD_CUDA_EMULATION
    EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before, c.rms_launches) << "rms_norm backward";
#endif
    const RmsNormGrads ragain = *RmsNormBackward(ddy, dx, dg, rms_rstd);
    EXPECT_EQ(rgot.dx.ToBytes(), ragain.dx.ToBytes());
    EXPECT_EQ(rgot.dgamma.ToBytes(), ragain.dgamma.ToBytes());
    const RmsNormGrads rwant = *RmsNormBackward(dy, x, g, crn.rstd);
    ExpectNear(rgot.dx, rwant.dx, tol, "rms_norm dx");
    ExpectNear(rgot.dgamma, rwant.dgamma, param_tol, "rms_norm dgamma");
  }
}

// The column reductions (bias gradients, GELU backward with the bias
// gradient, the norms' parameter gradients) over enough rows that the
// kernels split them into chunks and add the chunks' sums in a second level
// (300 rows: 3 chunks of 100; 520: 5 of 104; the chunks are at least 128
// rows, so small shapes keep one level): equal to the CPU's sums, and
// bitwise the same on a second run. Small, for the emulation under TSan,
// where every access to memory is checked.
TEST_F(CudaLayerOps, ColumnReductionsInTwoLevelsMatchTheCpuAndRepeat) {
  for (const Shape& shape : {Shape{300, 70}, Shape{520, 33}}) {
    SCOPED_TRACE(ShapeToString(shape));
    const int64_t n = shape[1];
    const Tensor x = R(shape, 21), dy = R(shape, 22), g = R({n}, 23), b = R({n}, 24);
    const Tensor dx = Dev(x), ddy = Dev(dy), db = Dev(b);
    auto twice = [](auto run, const std::string& what) {
      const std::vector<float> first = run().ToFloats(), second = run().ToFloats();
      ASSERT_EQ(first.size(), second.size());
      EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0) << what;
    };
    ExpectNear(*BiasGrad(ddy), *BiasGrad(dy), 1e-5, "bias_grad");
    twice([&] { return *BiasGrad(ddy); }, "bias_grad");
    const BiasGeluGrads bg = *BiasGeluBackward(ddy, dx, db, GeluApprox::kTanh);
    const BiasGeluGrads bg_cpu = *BiasGeluBackward(dy, x, b, GeluApprox::kTanh);
    ExpectNear(bg.db, bg_cpu.db, 1e-5, "bias_gelu db");
    ExpectNear(bg.dx, bg_cpu.dx, 1e-5, "bias_gelu dx");
    twice([&] { return BiasGeluBackward(ddy, dx, db, GeluApprox::kTanh)->db; }, "bias_gelu db");
    // The norms' parameter gradients (LayerNormBackward's and
    // RmsNormBackward's second kernel) from the CPU's row statistics: no
    // row kernel, whose one block per row is slow under TSan.
    const LayerNormResult ln = *LayerNorm(x, g, b, 1e-5f);
    const Tensor mean = Dev(ln.mean), rstd = Dev(ln.rstd);
    const NormParamGrads pg = *NormParamGrad(ddy, dx, mean, rstd, /*beta=*/true);
    const NormParamGrads pg_cpu = *NormParamGrad(dy, x, ln.mean, ln.rstd, /*beta=*/true);
    ExpectNear(pg.dgamma, pg_cpu.dgamma, 1e-4, "norm_param_grad dgamma");
    ExpectNear(*pg.dbeta, *pg_cpu.dbeta, 1e-5, "norm_param_grad dbeta");
    twice([&] { return NormParamGrad(ddy, dx, mean, rstd, /*beta=*/true)->dgamma; }, "norm_param_grad dgamma");
    ExpectNear(NormParamGrad(ddy, dx, std::nullopt, rstd, /*beta=*/false)->dgamma,
               NormParamGrad(dy, x, std::nullopt, ln.rstd, /*beta=*/false)->dgamma, 1e-4, "rms dgamma");
  }
}

// The column reductions in 16-byte packs (n a multiple of the pack, 4 f32
// or 8 bf16, and the operands aligned) and element by element (the same
// values in a misaligned view). Within one chunk of rows both add each
// column's values in the same order, so they give the same bits; over
// chunks (packed, 64 rows a chunk at least: 300 rows are 5 chunks of 60)
// both equal the CPU's sums. 136 and 264 columns leave the last column
// block part empty.
TEST_F(CudaLayerOps, PackedColumnReductionsMatchTheScalarKernels) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    const std::string name(DTypeName(t));
    const double tol = t == DType::kF32 ? 1e-5 : 1.0 / 128;
    auto low = [&](const Tensor& v) { return *v.ToDType(t); };
    auto misaligned = [&](const Tensor& v) {  // v on the device, one element into a buffer
      const Tensor buffer = *Tensor::Zeros({v.numel() + 1}, v.dtype(), Device::Cuda(0));
      Tensor view = *(*buffer.Narrow(0, 1, v.numel())).Reshape(v.shape());
      EXPECT_TRUE(view.CopyFrom(Dev(v)).ok());
      return view;
    };
    for (const Shape& shape : {Shape{40, 136}, Shape{300, 264}}) {
      SCOPED_TRACE(name + " " + ShapeToString(shape));
      const bool one_chunk = shape[0] <= 64;
      const int64_t n = shape[1];
      const Tensor x = low(R(shape, 61)), dy = low(R(shape, 62)), b = low(R({n}, 63));
      const Tensor dx = Dev(x), ddy = Dev(dy), db = Dev(b), mx = misaligned(x), mdy = misaligned(dy);
      auto compare = [&](const Tensor& packed, const Tensor& scalar, const Tensor& cpu, const std::string& what) {
        if (one_chunk) {
          EXPECT_EQ(packed.ToBytes(), scalar.ToBytes()) << what;
        }
        for (const Tensor* got : {&packed, &scalar}) {
          const std::vector<float> g = got->ToFloats(), c = cpu.ToFloats();
          ASSERT_EQ(g.size(), c.size()) << what;
          for (size_t i = 0; i < g.size(); ++i) {
            ASSERT_NEAR(g[i], c[i], tol * (1 + std::fabs(c[i]))) << what << " at " << i;
          }
        }
      };
      compare(*BiasGrad(ddy), *BiasGrad(mdy), *BiasGrad(dy), "bias_grad");
      const BiasGeluGrads bg = *BiasGeluBackward(ddy, dx, db, GeluApprox::kTanh);
      const BiasGeluGrads sg = *BiasGeluBackward(mdy, mx, misaligned(b), GeluApprox::kTanh);
      const BiasGeluGrads cg = *BiasGeluBackward(dy, x, b, GeluApprox::kTanh);
      compare(bg.db, sg.db, cg.db, "bias_gelu db");
      EXPECT_EQ(bg.dx.ToBytes(), sg.dx.ToBytes()) << "bias_gelu dx";
      compare(bg.dx, sg.dx, cg.dx, "bias_gelu dx");
      const LayerNormResult ln = *LayerNorm(*x.ToDType(DType::kF32), *R({n}, 64).ToDType(DType::kF32),
                                            *R({n}, 65).ToDType(DType::kF32), 1e-5f);
      const Tensor mean = Dev(ln.mean), rstd = Dev(ln.rstd);
      const NormParamGrads pg = *NormParamGrad(ddy, dx, mean, rstd, /*beta=*/true);
      const NormParamGrads ps = *NormParamGrad(mdy, mx, mean, rstd, /*beta=*/true);
      const NormParamGrads pc = *NormParamGrad(dy, x, ln.mean, ln.rstd, /*beta=*/true);
      compare(pg.dgamma, ps.dgamma, pc.dgamma, "norm_param_grad dgamma");
      compare(*pg.dbeta, *ps.dbeta, *pc.dbeta, "norm_param_grad dbeta");
      compare(NormParamGrad(ddy, dx, std::nullopt, rstd, /*beta=*/false)->dgamma,
              NormParamGrad(mdy, mx, std::nullopt, rstd, /*beta=*/false)->dgamma,
              NormParamGrad(dy, x, std::nullopt, ln.rstd, /*beta=*/false)->dgamma, "rms dgamma");
    }
  }
}

// The bias, activation and norm kernels read and write bf16 and f16 tensors
// themselves (no conversions around the call): outputs in the input's dtype,
// equal to the f32 computation on the widened inputs rounded once, so within
// one rounding of it (2^-8 relative for bf16, 2^-11 for f16; the reductions
// of the norms and bias gradients add a little). The CPU twin gives the same.
TEST_F(CudaLayerOps, HalfTypesAreComputedInF32AndRoundedOnce) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    const double tol = (t == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048) * 1.01;
    const std::string name(DTypeName(t));
    auto low = [&](const Tensor& x) { return *x.ToDType(t); };
    auto wide = [](const Tensor& x) { return *x.ToDType(DType::kF32); };
    const Tensor x = low(R({6, 40}, 41)), dy = low(R({6, 40}, 42)), bias = low(R({40}, 43));
    const Tensor g = low(R({40}, 44)), b = low(R({40}, 45));
    const auto check = [&](const Tensor& got, const Tensor& want_f32, const std::string& what) {
      ASSERT_EQ(got.dtype(), t) << what << " " << name;
      ASSERT_EQ(got.shape(), want_f32.shape()) << what;
      const std::vector<float> a = got.ToFloats(), w = want_f32.ToFloats();
      float scale = 0;
      for (float v : w) scale = std::max(scale, std::fabs(v));
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_NEAR(a[i], w[i], tol * std::fabs(w[i]) + 1e-5 * scale) << what << " " << name << " at " << i;
      }
    };
    for (bool on_gpu : {true, false}) {
      auto in = [&](const Tensor& v) { return on_gpu ? Dev(v) : v; };
      const std::string where = on_gpu ? "cuda" : "cpu";
      check(*BiasAdd(in(x), in(bias)), *BiasAdd(wide(x), wide(bias)), where + " bias_add");
      check(*BiasGrad(in(dy)), *BiasGrad(wide(dy)), where + " bias_grad");
      check(*Gelu(in(x), GeluApprox::kTanh), *Gelu(wide(x), GeluApprox::kTanh), where + " gelu");
      check(*GeluBackward(in(dy), in(x), GeluApprox::kNone), *GeluBackward(wide(dy), wide(x), GeluApprox::kNone),
            where + " gelu_backward");
      check(*BiasGelu(in(x), in(bias), GeluApprox::kNone), *BiasGelu(wide(x), wide(bias), GeluApprox::kNone),
            where + " bias_gelu");
      const BiasGeluGrads bg = *BiasGeluBackward(in(dy), in(x), in(bias), GeluApprox::kTanh);
      const BiasGeluGrads bg32 = *BiasGeluBackward(wide(dy), wide(x), wide(bias), GeluApprox::kTanh);
      check(bg.dx, bg32.dx, where + " bias_gelu dx");
      check(bg.db, bg32.db, where + " bias_gelu db");
      for (ActivationKind act : {ActivationKind::kSilu, ActivationKind::kRelu}) {
        check(*Activation(in(x), act), *Activation(wide(x), act), where + " activation");
        check(*ActivationBackward(in(dy), in(x), act), *ActivationBackward(wide(dy), wide(x), act),
              where + " activation_backward");
      }
      const LayerNormResult ln = *LayerNorm(in(x), in(g), in(b), 1e-5f);
      const LayerNormResult ln32 = *LayerNorm(wide(x), wide(g), wide(b), 1e-5f);
      check(ln.y, ln32.y, where + " layer_norm");
      // With a residual the sum is rounded before the norm, as by an add:
      // the same as the add then the norm on the device too.
      const Tensor res = in(dy);
      const LayerNormResult rln = *LayerNorm(in(x), in(g), in(b), 1e-5f, &res);
      const Tensor added = *(*Add(in(x), res)).To(Device::Cpu());
      EXPECT_EQ(rln.sum.ToBytes(), added.ToBytes()) << where << " " << name;
      check(rln.y, (*LayerNorm(wide(added), wide(g), wide(b), 1e-5f)).y, where + " residual layer_norm");
      const RmsNormResult rrn = *RmsNorm(in(x), in(g), 1e-6f, &res);
      EXPECT_EQ(rrn.sum.ToBytes(), added.ToBytes()) << where << " " << name;
      check(rrn.y, (*RmsNorm(wide(added), wide(g), 1e-6f)).y, where + " residual rms_norm");
      EXPECT_EQ(ln.rstd.dtype(), DType::kF32);
      const LayerNormGrads lg = *LayerNormBackward(in(dy), in(x), in(g), ln.mean, ln.rstd);
      const LayerNormGrads lg32 = *LayerNormBackward(wide(dy), wide(x), wide(g), ln32.mean, ln32.rstd);
      check(lg.dx, lg32.dx, where + " layer_norm dx");
      check(lg.dgamma, lg32.dgamma, where + " layer_norm dgamma");
      check(lg.dbeta, lg32.dbeta, where + " layer_norm dbeta");
      const RmsNormResult rn = *RmsNorm(in(x), in(g), 1e-6f);
      const RmsNormResult rn32 = *RmsNorm(wide(x), wide(g), 1e-6f);
      check(rn.y, rn32.y, where + " rms_norm");
      const RmsNormGrads rg = *RmsNormBackward(in(dy), in(x), in(g), rn.rstd);
      const RmsNormGrads rg32 = *RmsNormBackward(wide(dy), wide(x), wide(g), rn32.rstd);
      check(rg.dx, rg32.dx, where + " rms_norm dx");
      check(rg.dgamma, rg32.dgamma, where + " rms_norm dgamma");
    }
  }
}

// An all-gather between `n` threads, each calling Gather once with its
// shard's tensor: out <- the shards' tensors in shard order.
class ThreadAllGather {
 public:
  explicit ThreadAllGather(int n) : n_(n), parts_(n) {}
  absl::Status Gather(int k, const Tensor& in, Tensor& out) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      parts_[k] = *in.To(Device::Cpu());
      ++arrived_;
      cv_.notify_all();
      if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return arrived_ == n_; })) {
        return absl::DeadlineExceededError("a shard never arrived");
      }
    }
    for (int j = 0; j < n_; ++j) {
      absl::StatusOr<Tensor> dst = out.Narrow(0, j, 1);
      if (!dst.ok()) return dst.status();
      absl::Status s = dst->CopyFrom(*parts_[j].Reshape(dst->shape()));
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::vector<Tensor> parts_;
};

// The vocab-parallel passes over 1 to 4 shards of a 40-word vocabulary padded
// to 64 columns (4 shards: 16, 16, 8 and 0 real columns, so one shard holds
// only padding), each shard on its own thread, combined through one
// all-gather: every shard's loss is the plain cross-entropy's, with the same
// bits on every shard, and its gradient the plain one's columns, on both
// devices.
TEST_F(CudaLayerOps, VocabShardsCombinedFromOneAllGatherEqualThePlainCrossEntropy) {
  const Tensor logits = R({6, 40}, 31, 3.0f), labels = *Tensor::FromInt64s({6}, {0, 39, -100, 7, 35, 20});
  const Tensor dloss = R({6}, 32);
  const Tensor padded = *Tensor::Cat({logits, R({6, 24}, 33, 50.0f)}, 1);
  for (int shards : {1, 2, 4}) {
    for (float sm : {0.0f, 0.1f}) {
      for (bool gpu : {false, true}) {
        const std::string what = std::string(gpu ? "cuda" : "cpu") + ", " + std::to_string(shards) +
                                 " shards, smoothing " + std::to_string(sm);
        const int64_t width = 64 / shards;
        ThreadAllGather gather(shards);
        std::vector<std::vector<float>> loss(shards), grad(shards);
        std::vector<absl::Status> status(shards);
        std::vector<std::thread> threads;
        for (int k = 0; k < shards; ++k) {
          threads.emplace_back([&, k] {
            const int64_t start = k * width, real = std::clamp<int64_t>(40 - start, 0, width);
            const Tensor part = padded.Narrow(1, start, width)->Contiguous();
            const Tensor z = gpu ? *part.To(Device::Cuda(0)) : part;
            const Tensor lab = gpu ? *labels.To(Device::Cuda(0)) : labels;
            auto fwd = VocabShardCrossEntropy(
                z, lab, real, start, 40, sm, -100, shards,
                [&](const Tensor& in, Tensor& out) { return gather.Gather(k, in, out); });
            if (!fwd.ok()) {
              status[k] = fwd.status();
              return;
            }
            loss[k] = fwd->loss.ToFloats();
            auto dz = VocabShardCrossEntropyBackward(gpu ? *dloss.To(Device::Cuda(0)) : dloss, *fwd, lab, real,
                                                     start, 40, sm, -100, DType::kF32);
            if (!dz.ok()) {
              status[k] = dz.status();
              return;
            }
            grad[k] = dz->ToFloats();
          });
        }
        for (std::thread& t : threads) t.join();
        const std::vector<float> want = CrossEntropy(logits, labels, sm)->ToFloats();
        const std::vector<float> want_grad = CrossEntropyBackward(dloss, logits, labels, sm)->ToFloats();
        for (int k = 0; k < shards; ++k) {
          ASSERT_TRUE(status[k].ok()) << what << ": " << status[k];
          EXPECT_EQ(loss[k], loss[0]) << what << ": shard " << k << " differs from shard 0";
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_NEAR(loss[k][i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << what << " row " << i;
          }
          for (int64_t r = 0; r < 6; ++r) {
            for (int64_t j = 0; j < width; ++j) {
              const int64_t col = k * width + j;
              const float w = col < 40 ? want_grad[r * 40 + col] : 0.0f;
              ASSERT_NEAR(grad[k][r * width + j], w, 1e-5 * (1 + std::fabs(w))) << what << " at " << r << "," << col;
            }
          }
        }
      }
    }
  }
#ifdef COLOD_CUDA_EMULATION
  // The forward is three kernels: a shard's max and sums (one read of each
  // row: VocabShardStats), the shards' combined, the loss.
  const Tensor z = *padded.To(Device::Cuda(0)), lab = *labels.To(Device::Cuda(0));
  const uint64_t before = colod_cuda_emu::GetCounters().kernel_launches;
  const auto identity = [](const Tensor& in, Tensor& out) { return out.CopyFrom(*in.Reshape(out.shape())); };
  ASSERT_TRUE(VocabShardCrossEntropy(z, lab, 40, 0, 40, 0.0f, -100, 1, identity).ok());
  EXPECT_EQ(colod_cuda_emu::GetCounters().kernel_launches - before, 3u);
#endif
}

TEST_F(CudaLayerOps, SoftmaxDropoutEmbeddingCrossEntropyRopeAdamW) {
  const Tensor s = R({3, 5, 9}, 11, 2.0f), ds = R({3, 5, 9}, 12);
  for (bool causal : {false, true}) {
    ExpectNear(*Softmax(Dev(s), causal), *Softmax(s, causal), 1e-6, "softmax");
  }
  const Tensor y = *Softmax(s, true);
  ExpectNear(*SoftmaxBackward(Dev(ds), Dev(y)), *SoftmaxBackward(ds, y), 1e-6, "softmax backward");
  // The same (seed, offset) gives the same mask on both devices, bit for bit.
  const Tensor x = R({33, 65}, 13);
  EXPECT_EQ(Dropout(Dev(x), 0.25f, 7, 1000)->ToBytes(), Dropout(x, 0.25f, 7, 1000)->ToBytes());
  const Tensor table = R({50, 16}, 14), ids = *Tensor::FromInt64s({2, 3}, {0, 17, 49, 17, 3, 31});
  ExpectNear(*Embedding(Dev(table), Dev(ids)), *Embedding(table, ids), 0, "embedding");
  ExpectNear(*Embedding(Dev(table), Dev(ids), 16, true), *Embedding(table, ids, 16, true), 0, "masked embedding");
  // Host ids for a device table: checked on the host, copied up.
  ExpectNear(*Embedding(Dev(table), ids), *Embedding(table, ids), 0, "embedding of host ids");
  EXPECT_EQ(Embedding(Dev(table), *Tensor::FromInt64s({1}, {50})).status().code(), absl::StatusCode::kInvalidArgument);
  const Tensor de = R({2, 3, 16}, 15);
  ExpectNear(*EmbeddingBackward(Dev(de), Dev(ids), 50), *EmbeddingBackward(de, ids, 50), 1e-6, "embedding backward");
  ExpectNear(*EmbeddingBackward(Dev(de), ids, 50), *EmbeddingBackward(de, ids, 50), 1e-6, "embedding backward, host ids");
  const Tensor logits = R({6, 40}, 16, 3.0f), labels = *Tensor::FromInt64s({6}, {0, 39, -100, 7, 7, 20});
  const Tensor dloss = R({6}, 17);
  for (float sm : {0.0f, 0.1f}) {
    ExpectNear(*CrossEntropy(Dev(logits), Dev(labels), sm), *CrossEntropy(logits, labels, sm), 1e-5, "cross entropy");
    ExpectNear(*CrossEntropyBackward(Dev(dloss), Dev(logits), Dev(labels), sm),
               *CrossEntropyBackward(dloss, logits, labels, sm), 1e-5, "cross entropy backward");
    // Host labels with device logits: checked on the host, copied up.
    ExpectNear(*CrossEntropy(Dev(logits), labels, sm), *CrossEntropy(logits, labels, sm), 1e-5, "host labels");
    ExpectNear(*CrossEntropyBackward(Dev(dloss), Dev(logits), labels, sm),
               *CrossEntropyBackward(dloss, logits, labels, sm), 1e-5, "host labels backward");
  }
  EXPECT_EQ(CrossEntropy(Dev(logits), *Tensor::FromInt64s({6}, {0, 40, 1, 1, 1, 1})).status().code(),
            absl::StatusCode::kInvalidArgument);  // a host label past the vocabulary
  // The vocab-parallel passes, with the whole vocabulary in one shard whose
  // last 8 columns are padding (large values that must not count): the loss
  // and gradient of the plain cross-entropy, on both devices; none on the
  // padding. With one shard the all-gather is a copy.
  const Tensor padded = *Tensor::Cat({logits, R({6, 8}, 22, 50.0f)}, 1);
  const auto identity = [](const Tensor& in, Tensor& out) { return out.CopyFrom(*in.Reshape(out.shape())); };
  for (float sm : {0.0f, 0.1f}) {
    for (bool gpu : {false, true}) {
      const std::string what = std::string(gpu ? "cuda" : "cpu") + " vocab shard, smoothing " + std::to_string(sm);
      const Tensor z = gpu ? Dev(padded) : padded, lab = gpu ? Dev(labels) : labels;
      auto fwd = VocabShardCrossEntropy(z, lab, 40, 0, 40, sm, -100, 1, identity);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      const Tensor want = *CrossEntropy(logits, labels, sm);
      const std::vector<float> got = fwd->loss.ToFloats(), w = want.ToFloats();
      for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(got[i], w[i], 1e-5 * (1 + std::fabs(w[i]))) << what;
      auto dz = VocabShardCrossEntropyBackward(gpu ? Dev(dloss) : dloss, *fwd, lab, 40, 0, 40, sm, -100,
                                               DType::kF32);
      ASSERT_TRUE(dz.ok()) << dz.status();
      const std::vector<float> g = dz->ToFloats(), dw = CrossEntropyBackward(dloss, logits, labels, sm)->ToFloats();
      for (int64_t r = 0; r < 6; ++r) {
        for (int64_t j = 0; j < 48; ++j) {
          const float want_g = j < 40 ? dw[r * 40 + j] : 0.0f;
          ASSERT_NEAR(g[r * 48 + j], want_g, 1e-5 * (1 + std::fabs(want_g))) << what << " at " << r << "," << j;
        }
      }
    }
  }
  // bf16 logits, read as they are (no f32 copy): in 16-byte packs where the
  // width is a multiple of 8 (48; the 37 real columns end inside a pack), else
  // element by element (45); the gradient in bf16 (one rounding of the f32
  // value) or in f32. The plain cross-entropy of the same values widened is
  // the reference.
  const Tensor labels37 = *Tensor::FromInt64s({6}, {0, 36, -100, 7, 7, 20});
  for (int64_t width : {48, 45}) {
    const Tensor zb = *(*padded.Narrow(1, 0, width)).ToDType(DType::kBF16);
    const Tensor wide = (*(*zb.ToDType(DType::kF32)).Narrow(1, 0, 37)).Contiguous();
    const Tensor want = *CrossEntropy(wide, labels37, 0.1f);
    const std::vector<float> dwant = CrossEntropyBackward(dloss, wide, labels37, 0.1f)->ToFloats();
    for (bool gpu : {false, true}) {
      const std::string what = std::string(gpu ? "cuda" : "cpu") + " bf16 vocab shard, width " + std::to_string(width);
      const Tensor lab = gpu ? Dev(labels37) : labels37;
      auto fwd = VocabShardCrossEntropy(gpu ? Dev(zb) : zb, lab, 37, 0, 37, 0.1f, -100, 1, identity);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      EXPECT_EQ(fwd->z.dtype(), DType::kBF16) << what;
      const std::vector<float> got = fwd->loss.ToFloats(), w = want.ToFloats();
      for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(got[i], w[i], 1e-5 * (1 + std::fabs(w[i]))) << what;
      for (DType dt : {DType::kBF16, DType::kF32}) {
        auto dz = VocabShardCrossEntropyBackward(gpu ? Dev(dloss) : dloss, *fwd, lab, 37, 0, 37, 0.1f, -100, dt);
        ASSERT_TRUE(dz.ok()) << dz.status();
        ASSERT_EQ(dz->dtype(), dt) << what;
        const double rel = dt == DType::kBF16 ? 1.0 / 256 : 1e-5;
        const std::vector<float> g = dz->ToFloats();
        for (int64_t r = 0; r < 6; ++r) {
          for (int64_t j = 0; j < width; ++j) {
            const float want_g = j < 37 ? dwant[r * 37 + j] : 0.0f;
            ASSERT_NEAR(g[r * width + j], want_g, rel * std::fabs(want_g) + 1e-6)
                << what << " " << DTypeName(dt) << " at " << r << "," << j;
          }
        }
      }
    }
  }
  const auto bad = VocabShardCrossEntropy(padded, labels, 49, 0, 40, 0.0f, -100, 1, identity);  // past the shard
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  const Tensor q = R({2, 7, 3, 8}, 18);
  ExpectNear(*Rope(Dev(q), 10000.0f, 4), *Rope(q, 10000.0f, 4), 1e-5, "rope");
  ExpectNear(*RopeBackward(Dev(q), 10000.0f, 4), *RopeBackward(q, 10000.0f, 4), 1e-5, "rope backward");
  // AdamW over 40 parameters (two launches of at most 32), f32 and mixed
  // bf16, sizes around the chunk of a block, gradients scaled: every
  // parameter, moment and held copy as the CPU's.
  std::vector<AdamWParam> host, dev;
  for (int i = 0; i < 40; ++i) {
    const int64_t n = i % 5 == 0 ? 2048 * 2 + 3 : 1 + 97 * i;
    const bool mixed = i % 2 == 1;
    AdamWParam h;
    h.master = R({n}, 100 + i);
    h.m = *Tensor::Zeros({n}, DType::kF32);
    h.v = *Tensor::Zeros({n}, DType::kF32);
    h.grad = mixed ? *R({n}, 200 + i).ToDType(DType::kBF16) : R({n}, 200 + i);
    if (mixed) h.held = *h.master.ToDType(DType::kBF16);
    AdamWParam d{Dev(h.master), std::nullopt, Dev(h.grad), Dev(h.m), Dev(h.v)};
    if (mixed) d.held = Dev(*h.held);
    host.push_back(h);
    dev.push_back(d);
  }
  AdamWOptions o;
  o.grad_scale = 0.25f;
  o.weight_decay = 0.1f;
  // The device's step from a factor on the device (the trainer's, computed
  // there by GradNormClip): the host's from grad_scale.
  AdamWOptions od = o;
  od.grad_scale = 3.0f;  // not read
  od.grad_scale_at = Dev(*Tensor::FromFloats({1}, {0.25f}));
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(AdamW(host, step, o).ok());
    ASSERT_TRUE(AdamW(dev, step, od).ok());
  }
  for (size_t i = 0; i < host.size(); ++i) {
    const std::string what = "adamw parameter " + std::to_string(i);
    ExpectNear(dev[i].master, host[i].master, 1e-5, what);
    ExpectNear(dev[i].m, host[i].m, 1e-5, what + " m");
    ExpectNear(dev[i].v, host[i].v, 1e-5, what + " v");
    if (host[i].held.has_value()) {
      EXPECT_EQ(dev[i].held->ToBytes(), host[i].master.ToDType(DType::kBF16)->ToBytes()) << what;
    }
  }
}

// MatMulF32Into on cuBLAS (bf16 operands, f32 output, beta 1 the second
// time): the CPU twin's sums.
TEST_F(CudaLayerOps, MatMulF32IntoMatchesTheCpu) {
  const Tensor a0 = *R({33, 20}, 81).ToDType(DType::kBF16), b0 = *R({33, 12}, 82).ToDType(DType::kBF16);
  const Tensor a1 = *R({33, 20}, 83).ToDType(DType::kBF16), b1 = *R({33, 12}, 84).ToDType(DType::kBF16);
  Tensor host = *Tensor::Zeros({20, 12}, DType::kF32), dev = Dev(host);
  for (bool accumulate : {false, true}) {
    const Tensor& a = accumulate ? a1 : a0;
    const Tensor& b = accumulate ? b1 : b0;
    ASSERT_TRUE(MatMulF32Into(a, b, true, false, host, accumulate).ok());
    ASSERT_TRUE(MatMulF32Into(Dev(a), Dev(b), true, false, dev, accumulate).ok());
  }
  ExpectNear(dev, host, 1e-5, "matmul into f32");
}

// ScaleBy: a times a factor that lives on the tensors' device, rounded once
// into the output's dtype: the CPU twin's bits on CUDA, f32 -> bf16 within
// a rounding of the f32 product (one rounding, not two), and the factor
// refused unless it is one f32 on a's device.
TEST_F(CudaLayerOps, ScaleByAFactorOnTheDeviceMatchesTheCpu) {
  const Tensor a = R({37, 11}, 91);
  const Tensor s = *Tensor::FromFloats({}, {-0.3f});
  for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(out));
    const Tensor host = *ScaleBy(a, s, out);
    const Tensor dev = *ScaleBy(Dev(a), Dev(s), out);
    ASSERT_EQ(dev.dtype(), out);
    EXPECT_EQ(dev.To(Device::Cpu())->ToBytes(), host.ToBytes());
    const std::vector<float> x = a.ToFloats(), y = host.ToFloats();
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = x[i] * -0.3f;
      EXPECT_EQ(y[i], *Tensor::FromFloats({1}, {want})->ToDType(out)->ToFloats().data()) << i;
    }
  }
  EXPECT_EQ(ScaleBy(Dev(a), s, DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);  // on the host
  EXPECT_EQ(ScaleBy(a, *Tensor::FromFloats({2}, {1, 2}), DType::kF32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ScaleBy(a, *s.ToDType(DType::kBF16), DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ScaleBy(a, s, DType::kI64).status().code(), absl::StatusCode::kInvalidArgument);
}

// GradNormClip on the device: the CPU twin's bits (the same sum in double,
// the same factor), clipping or not.
TEST_F(CudaLayerOps, GradNormClipHasTheCpuTwinsBits) {
  std::vector<float> sq;
  for (int i = 0; i < 37; ++i) sq.push_back(0.37f * static_cast<float>(i * i % 11) + 1e-6f * static_cast<float>(i));
  const Tensor squares = *Tensor::FromFloats({37}, sq);
  for (double max_norm : {0.0, 1.0, 5.0, 1e3}) {
    for (double loss_scale : {1.0, 65536.0}) {  // (fp16's scale unscales the norm and the factor)
      const absl::StatusOr<Tensor> cpu = GradNormClip(squares, max_norm, loss_scale);
      const absl::StatusOr<Tensor> gpu = GradNormClip(Dev(squares), max_norm, loss_scale);
      ASSERT_TRUE(cpu.ok() && gpu.ok()) << cpu.status() << gpu.status();
      EXPECT_TRUE(gpu->device().is_cuda());
      EXPECT_EQ(gpu->ToBytes(), cpu->ToBytes()) << "max_norm " << max_norm << " loss scale " << loss_scale;
    }
  }
}

}  // namespace
}  // namespace colod::ops
