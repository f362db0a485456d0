#include "kernels/cuda/cudnn_attention.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/device.h"
#include "kernels/half.h"

namespace colod::kernels::cuda {
namespace {

// cuDNN checks its runtime compiler's prerequisites through the driver
// (libcuda.so.1). Where there is none, the toolkit's stub, whose soname
// that is, stands in: the compile then runs and stops at loading the
// kernel, which the stub cannot.
void LoadADriver() {
  if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) != nullptr) return;
  const char* root = std::getenv("COLOD_CUDA_ROOT");
  const std::string stub = std::string(root != nullptr ? root : "/usr/local/cuda") + "/lib64/stubs/libcuda.so";
  ASSERT_NE(dlopen(stub.c_str(), RTLD_NOW | RTLD_GLOBAL), nullptr) << dlerror();
}

CudnnAttentionShape Shape(ElemType type, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, bool causal,
                          AttentionLayout layout) {
  return {type, b, s, hq, hkv, d, causal, /*deterministic=*/false, layout};
}

struct Case {
  const char* name;
  CudnnAttentionShape shape;
};

// The families' attention shapes: GPT-2 124M's step, its q, k and v slices
// of the packed c_attn output; LLaMA-style GQA at head dim 128; a ViT's
// bidirectional 197 tokens in f16 (not a multiple of any tile); phi-style
// head dim 80.
std::vector<Case> FamilyCases() {
  const HeadRows packed{3 * 12 * 64, 64};
  return {
      {"gpt2_124m_packed", Shape(ElemType::kBF16, 8, 1024, 12, 12, 64, true, {packed, packed, packed, packed})},
      {"llama_gqa_d128", Shape(ElemType::kBF16, 2, 2048, 32, 8, 128, true, ContiguousAttention(32, 8, 128))},
      {"vit_f16_197", Shape(ElemType::kF16, 4, 197, 12, 12, 64, false, ContiguousAttention(12, 12, 64))},
      {"d80", Shape(ElemType::kBF16, 2, 300, 8, 8, 80, true, ContiguousAttention(8, 8, 80))},
  };
}

TEST(CudnnAttentionDeviceless, EveryFamilyShapeCompilesForAnH100ForwardAndBackward) {
  LoadADriver();
  for (const Case& c : FamilyCases()) {
    ASSERT_TRUE(CudnnAttentionServes(c.shape, {}).ok()) << c.name;
    for (bool backward : {false, true}) {
      absl::StatusOr<CudnnDevicelessPlan> plan = CudnnAttentionDeviceless(CudnnH100DeviceJson(), c.shape, backward);
      ASSERT_TRUE(plan.ok()) << c.name << (backward ? " backward: " : " forward: ") << plan.status();
      EXPECT_GT(plan->engines, 0) << c.name;
      EXPECT_GT(plan->configs, 0) << c.name << (backward ? " backward" : " forward")
                                  << ": cuDNN has no engine config for the graph on sm_90";
      EXPECT_TRUE(plan->compiled) << c.name;
      std::cerr << c.name << (backward ? " backward: " : " forward: ") << plan->engines << " engines, " << plan->configs
                << " configs; " << plan->engine << "\n";
    }
  }
}

TEST(CudnnAttentionDeviceless, TheDeterministicBackwardCompilesToo) {
  LoadADriver();
  CudnnAttentionShape a = FamilyCases().front().shape;
  a.deterministic = true;
  absl::StatusOr<CudnnDevicelessPlan> plan = CudnnAttentionDeviceless(CudnnH100DeviceJson(), a, true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->configs, 0);
  EXPECT_TRUE(plan->compiled);
}

// cuDNN's refusal reaches the caller with the call that failed.
TEST(CudnnAttentionDeviceless, MalformedDevicePropertiesAreAnErrorNamingTheField) {
  LoadADriver();
  absl::StatusOr<CudnnDevicelessPlan> plan =
      CudnnAttentionDeviceless(R"({"deviceName": "x"})", FamilyCases().front().shape, false);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), "device properties")) << plan.status();
}

TEST(CudnnAttentionServes, RefusesWhatItsGraphsDoNotExpress) {
  const CudnnAttentionShape ok = FamilyCases().front().shape;
  EXPECT_TRUE(CudnnAttentionServes(ok, {}).ok());
  auto refused = [&](CudnnAttentionShape a, AttentionBias extra, const char* says) {
    const absl::Status st = CudnnAttentionServes(a, extra);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << says;
    EXPECT_TRUE(absl::StrContains(st.message(), says)) << st;
  };
  const float slopes[12] = {};
  refused(ok, {slopes, nullptr, nullptr}, "ALiBi");
  CudnnAttentionShape a = ok;
  a.type = ElemType::kF32;
  refused(a, {}, "bf16 or f16");
  a = ok;
  a.d = 100;
  refused(a, {}, "head dim 100");
  a.d = 256;
  refused(a, {}, "head dim 256");
  a = ok;
  a.hkv = 5;
  refused(a, {}, "hq a multiple of hkv");
  a = ok;
  a.layout.q.token = 3 * 768 + 4;
  refused(a, {}, "16 bytes");
  a = ok;
  a.b = int64_t{1} << 50;
  refused(a, {}, "overflows");
  a = ok;
  a.b = 1;
  a.s = int64_t{1} << 31;
  refused(a, {}, "the scores' extent overflows");
}

// A library that is missing, or is not cuDNN, leaves the call UNAVAILABLE
// (the caller's cue to run its own kernels) saying why, before anything
// touches a device; the next call with cuDNN back works.
TEST(CudnnAttentionLibrary, AMissingOrForeignLibraryIsUnavailableNamingIt) {
  struct Restore {
    ~Restore() { unsetenv("COLOD_CUDNN_LIBRARY"); }
  } restore;
  const CudnnAttentionShape a = FamilyCases().front().shape;
  for (const auto& [library, says] : {std::pair<const char*, const char*>{"/nonexistent/libcudnn.so.9", "cannot load"},
                                      {"libz.so.1", "has no cudnnGetVersion"}}) {
    setenv("COLOD_CUDNN_LIBRARY", library, 1);
    const absl::Status fwd = CudnnAttentionForward(0, nullptr, a, nullptr, nullptr, nullptr, nullptr, nullptr, 1.0f);
    EXPECT_EQ(fwd.code(), absl::StatusCode::kUnavailable) << fwd;
    EXPECT_TRUE(absl::StrContains(fwd.message(), says)) << fwd;
    EXPECT_TRUE(absl::StrContains(fwd.message(), library)) << fwd;
    const absl::Status bwd = CudnnAttentionBackward(0, nullptr, a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                    nullptr, nullptr, nullptr, 1.0f);
    EXPECT_EQ(bwd.code(), absl::StatusCode::kUnavailable) << bwd;
    absl::StatusOr<CudnnDevicelessPlan> plan = CudnnAttentionDeviceless(CudnnH100DeviceJson(), a, false);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << plan.status();
  }
  unsetenv("COLOD_CUDNN_LIBRARY");
  LoadADriver();
  EXPECT_TRUE(CudnnAttentionDeviceless(CudnnH100DeviceJson(), a, false).ok());
}

// On a GPU: cuDNN's values and gradients against the CPU twin's, from the
// same bf16 operands.
class CudnnAttentionOnAGpu : public ::testing::TestWithParam<Case> {};

std::vector<uint16_t> RandomBf16(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) StoreF(out.data(), i, ElemType::kBF16, dist(rng));
  return out;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> ToHost(const T* device, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  EXPECT_EQ(cudaMemcpy(out.data(), device, out.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// max |got - want| over max |want|, got and want of n elements of `type`.
double RelativeError(const void* got, const void* want, int64_t n, ElemType type) {
  double err = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    err = std::max(err, std::fabs(double{LoadF(got, i, type)} - LoadF(want, i, type)));
    scale = std::max(scale, std::fabs(double{LoadF(want, i, type)}));
  }
  return err / std::max(scale, 1e-30);
}

TEST_P(CudnnAttentionOnAGpu, ValuesAndGradientsMatchTheCpuTwin) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const CudnnAttentionShape& a = GetParam().shape;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const int64_t qn = a.b * a.s * a.hq * a.d, kvn = a.b * a.s * a.hkv * a.d, rows = a.b * a.hq * a.s;
  ASSERT_EQ(a.layout.q.token, a.hq * a.d) << "the cases are contiguous";
  const std::vector<uint16_t> q = RandomBf16(qn, 1), k = RandomBf16(kvn, 2), v = RandomBf16(kvn, 3),
                              dout = RandomBf16(qn, 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  // The reference: the CPU twin.
  std::vector<uint16_t> out_ref(qn), dq_ref(qn), dk_ref(kvn), dv_ref(kvn);
  std::vector<float> lse_ref(rows), delta(rows);
  ASSERT_TRUE(cpu::FlashAttention(0, a.type, q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(), a.b, a.s,
                                  a.hq, a.hkv, a.d, scale, a.causal, {}, a.layout)
                  .ok());
  ASSERT_TRUE(cpu::FlashAttentionBackward(0, a.type, q.data(), k.data(), v.data(), out_ref.data(), dout.data(),
                                          lse_ref.data(), delta.data(), dq_ref.data(), dk_ref.data(), dv_ref.data(),
                                          a.b, a.s, a.hq, a.hkv, a.d, scale, a.causal, {}, a.layout)
                  .ok());
  // cuDNN, on the device's default stream.
  uint16_t *dq_d = ToDevice(std::vector<uint16_t>(qn)), *dk_d = ToDevice(std::vector<uint16_t>(kvn)),
           *dv_d = ToDevice(std::vector<uint16_t>(kvn)), *out_d = ToDevice(std::vector<uint16_t>(qn));
  uint16_t *q_d = ToDevice(q), *k_d = ToDevice(k), *v_d = ToDevice(v), *dout_d = ToDevice(dout);
  float* lse_d = ToDevice(std::vector<float>(rows));
  const int64_t calls = CudnnAttentionCalls();
  const absl::Status fwd = CudnnAttentionForward(0, nullptr, a, q_d, k_d, v_d, out_d, lse_d, scale);
  ASSERT_TRUE(fwd.ok()) << fwd;
  const absl::Status bwd =
      CudnnAttentionBackward(0, nullptr, a, q_d, k_d, v_d, out_d, dout_d, lse_d, dq_d, dk_d, dv_d, scale);
  ASSERT_TRUE(bwd.ok()) << bwd;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(CudnnAttentionCalls(), calls + 2);
  const std::vector<float> lse = ToHost(lse_d, rows);
  double lse_err = 0;
  for (int64_t i = 0; i < rows; ++i) lse_err = std::max(lse_err, double{std::fabs(lse[i] - lse_ref[i])});
  EXPECT_LT(lse_err, 2e-2) << "lse: natural log, as the own kernels write it";
  // bf16 outputs: P rounded to bf16 before P V (and dS before its
  // products), as the own tensor-core kernels do.
  EXPECT_LT(RelativeError(ToHost(out_d, qn).data(), out_ref.data(), qn, a.type), 2e-2) << "out";
  EXPECT_LT(RelativeError(ToHost(dq_d, qn).data(), dq_ref.data(), qn, a.type), 3e-2) << "dq";
  EXPECT_LT(RelativeError(ToHost(dk_d, kvn).data(), dk_ref.data(), kvn, a.type), 3e-2) << "dk";
  EXPECT_LT(RelativeError(ToHost(dv_d, kvn).data(), dv_ref.data(), kvn, a.type), 3e-2) << "dv";
  // Deterministic on request (COLOD_DETERMINISTIC=1's graph: dQ without
  // atomics): two runs give the same bits, and the same values as above.
  CudnnAttentionShape det = a;
  det.deterministic = true;
  std::vector<std::vector<uint16_t>> runs;
  for (int run = 0; run < 2; ++run) {
    const absl::Status st =
        CudnnAttentionBackward(0, nullptr, det, q_d, k_d, v_d, out_d, dout_d, lse_d, dq_d, dk_d, dv_d, scale);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    runs.push_back(ToHost(dq_d, qn));
    const std::vector<uint16_t> dk = ToHost(dk_d, kvn), dv = ToHost(dv_d, kvn);
    runs.back().insert(runs.back().end(), dk.begin(), dk.end());
    runs.back().insert(runs.back().end(), dv.begin(), dv.end());
  }
  EXPECT_EQ(runs[0], runs[1]) << "the deterministic backward's dq, dk and dv differ between runs";
  EXPECT_LT(RelativeError(runs[0].data(), dq_ref.data(), qn, a.type), 3e-2) << "deterministic dq";
  for (void* p : std::initializer_list<void*>{dq_d, dk_d, dv_d, out_d, q_d, k_d, v_d, dout_d, lse_d}) cudaFree(p);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudnnAttentionOnAGpu,
                         ::testing::Values(Case{"causal_gqa_d64", Shape(ElemType::kBF16, 2, 200, 4, 2, 64, true,
                                                                        ContiguousAttention(4, 2, 64))},
                                           Case{"bidirectional_d128", Shape(ElemType::kBF16, 1, 130, 2, 2, 128, false,
                                                                            ContiguousAttention(2, 2, 128))}),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace colod::kernels::cuda
