// cuBLAS in colod's CUDA emulation (include/cublas_v2.h): GEMMs checked as
// cuBLAS checks them, then run in stream order by OpenBLAS's column-major
// sgemm, with bf16/f16 operands widened to f32 and the result rounded back
// (round to nearest even), as cuBLAS does with CUBLAS_COMPUTE_32F. cuBLASLt
// (include/cublasLt.h) the same way, with its bias and bias-gradient
// epilogues applied to the f32 products before D is rounded.
//
// Thread-safety: a handle may be used from several threads (the stream it
// names is resolved for the calling thread), but, as with cuBLAS, not
// destroyed while in use.
#include <cblas.h>
#include <cublasLt.h>
#include <cublas_emu.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/emu/runtime_internal.h"

struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;  // the legacy stream, as cuBLAS's default
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

namespace {

std::mutex handles_mu;
std::set<cublasContext*>& Handles() {
  static auto* handles = new std::set<cublasContext*>();
  return *handles;
}

bool Valid(cublasHandle_t h) {
  std::lock_guard<std::mutex> l(handles_mu);
  return Handles().count(h) > 0;
}

size_t ElemBytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
  }
}

float Load(const void* p, size_t i, cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16BF: return __bfloat162float(__ushort_as_bfloat16(static_cast<const uint16_t*>(p)[i]));
    case CUDA_R_16F: return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
    default: return 0;
  }
}

void Store(void* p, size_t i, cudaDataType_t t, float v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[i] = v; return;
    case CUDA_R_16BF: static_cast<uint16_t*>(p)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v)); return;
    case CUDA_R_16F: static_cast<uint16_t*>(p)[i] = __half_as_ushort(__float2half_rn(v)); return;
    default: return;
  }
}

// A column-major rows x cols operand with leading dimension ld: its extent
// in elements is (cols - 1) * ld + rows.
bool InDeviceMemory(const void* p, int64_t rows, int64_t cols, int64_t ld, size_t elem, int device) {
  if (rows == 0 || cols == 0) return true;
  const size_t extent = static_cast<size_t>((cols - 1) * ld + rows) * elem;
  auto range = colod_cuda_emu::FindDeviceRange(p, extent);
  return range.has_value() && range->device == device;
}

// The operand as a dense column-major f32 matrix (rows x cols, ld = rows).
std::vector<float> Widen(const void* p, int64_t rows, int64_t cols, int64_t ld, cudaDataType_t t) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) out[c * rows + r] = Load(p, static_cast<size_t>(c * ld + r), t);
  }
  return out;
}

// x with its mantissa rounded to TF32's 10 bits, to nearest even: what
// tensor cores multiply under CUBLAS_COMPUTE_32F_FAST_TF32 (NVIDIA leaves
// the rounding mode of its conversion unspecified; the model takes the
// nearest).
float RoundToTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf and NaN stay
  u += 0xfffu + ((u >> 13) & 1u);
  u &= ~0x1fffu;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace

int colod_cublas_emu::LiveHandles() {
  std::lock_guard<std::mutex> l(handles_mu);
  return static_cast<int>(Handles().size());
}

namespace {
std::set<cublasLtContext*>& LtHandles();
}  // namespace

int colod_cublas_emu::LiveLtHandles() {
  std::lock_guard<std::mutex> l(handles_mu);
  return static_cast<int>(LtHandles().size());
}

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* h = new cublasContext();
  h->device = colod_cuda_emu::CurrentDevice();
  std::lock_guard<std::mutex> l(handles_mu);
  Handles().insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  {
    std::lock_guard<std::mutex> l(handles_mu);
    if (Handles().erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  // cublasDestroy synchronizes the device before it releases the handle.
  colod_cuda_emu::SynchronizeDevice(handle->device);
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (!Valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (!Valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!Valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (!Valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  if (!Valid(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  // The checks cuBLAS documents for cublas<t>gemm / cublasGemmEx.
  if (transa > CUBLAS_OP_C || transb > CUBLAS_OP_C || m < 0 || n < 0 || k < 0 || alpha == nullptr ||
      beta == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  // op(A) is m x k: A is m x k (N) or k x m (T), column-major.
  const int a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int b_rows = tb ? n : k, b_cols = tb ? k : n;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (computeType != CUBLAS_COMPUTE_32F && computeType != CUBLAS_COMPUTE_32F_PEDANTIC &&
      computeType != CUBLAS_COMPUTE_32F_FAST_TF32 && computeType != CUBLAS_COMPUTE_32F_FAST_16BF &&
      computeType != CUBLAS_COMPUTE_32F_FAST_16F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (ElemBytes(Atype) == 0 || Atype != Btype || (Ctype != Atype && Ctype != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  (void)algo;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  // Every operand inside one allocation of the handle's device: a wrong
  // leading dimension or transpose reads or writes out of bounds on a GPU.
  const int device = colod_cuda_emu::CurrentDevice();
  if ((k > 0 && !InDeviceMemory(A, a_rows, a_cols, lda, ElemBytes(Atype), device)) ||
      (k > 0 && !InDeviceMemory(B, b_rows, b_cols, ldb, ElemBytes(Btype), device)) ||
      !InDeviceMemory(C, m, n, ldc, ElemBytes(Ctype), device)) {
    colod_cuda_emu::Fatal("cublasGemmEx: an operand reaches outside the device allocation it starts in "
                          "(m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                          " lda=" + std::to_string(lda) + " ldb=" + std::to_string(ldb) +
                          " ldc=" + std::to_string(ldc) + "): an illegal address on a GPU");
  }
  const float a_scale = *static_cast<const float*>(alpha), b_scale = *static_cast<const float*>(beta);
  std::shared_ptr<colod_cuda_emu::Stream> s = colod_cuda_emu::Resolve(handle->stream);
  if (s == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // A broken context fails cuBLAS's launch.
  if (colod_cuda_emu::StickyError(colod_cuda_emu::DeviceOf(*s)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  const bool tf32 = computeType == CUBLAS_COMPUTE_32F_FAST_TF32 && Atype == CUDA_R_32F;
  colod_cuda_emu::Enqueue(s, [=] {
    if (Atype == CUDA_R_32F && Ctype == CUDA_R_32F && !tf32) {
      cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, a_scale,
                  static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, b_scale,
                  static_cast<float*>(C), ldc);
      return;
    }
    std::vector<float> a = Widen(A, a_rows, a_cols, lda, Atype);
    std::vector<float> b = Widen(B, b_rows, b_cols, ldb, Btype);
    if (tf32) {
      for (float& x : a) x = RoundToTf32(x);
      for (float& x : b) x = RoundToTf32(x);
    }
    std::vector<float> c = Widen(C, m, n, ldc, Ctype);
    cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, a_scale,
                a.data(), std::max(1, a_rows), b.data(), std::max(1, b_rows), b_scale, c.data(), m);
    for (int64_t col = 0; col < n; ++col) {
      for (int64_t row = 0; row < m; ++row) Store(C, static_cast<size_t>(col * ldc + row), Ctype, c[col * m + row]);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                           const float* beta, float* C, int ldc) {
  return cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C,
                      CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// ---- cuBLASLt ----

struct cublasLtContext {
  int device = 0;
};

namespace {

std::set<cublasLtContext*>& LtHandles() {
  static auto* handles = new std::set<cublasLtContext*>();
  return *handles;
}

bool ValidLt(cublasLtHandle_t h) {
  std::lock_guard<std::mutex> l(handles_mu);
  return LtHandles().count(h) > 0;
}

struct LtDesc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  int32_t bias_type = -1;  // -1: D's type
  void* aux = nullptr;     // GELU's input, of D's type: GELU_AUX_BIAS writes it, DGELU reads it
  int64_t aux_ld = 0;
};

struct LtLayout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};

struct LtPreference {
  uint64_t max_workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D
};

LtDesc* Desc(cublasLtMatmulDesc_t d) { return reinterpret_cast<LtDesc*>(d); }
LtLayout* Layout(cublasLtMatrixLayout_t l) { return reinterpret_cast<LtLayout*>(l); }
LtPreference* Preference(cublasLtMatmulPreference_t p) { return reinterpret_cast<LtPreference*>(p); }

// What an emulated algorithm records: the alignments it was chosen for (the
// preference's, and the bias pointer's at the heuristic) and the epilogue.
constexpr uint64_t kAlgoMagic = 0xc01dc0b1a5u;
enum AlgoField { kMagic, kAlignA, kAlignB, kAlignC, kAlignD, kAlignBias, kAlignAux, kEpilogue };

// The largest power of two up to 256 that divides p's address.
uint32_t AlignmentOf(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// The problem a descriptor and its layouts state, checked as cuBLASLt
// documents it: op(A) [m, k], op(B) [k, n], C and D [m, n] column-major.
struct LtProblem {
  int64_t m, n, k;
  bool ta, tb;
  cudaDataType_t ab, d;
  cudaDataType_t bias;  // the bias (or bias gradient) vector's type
};

cublasStatus_t CheckProblem(const LtDesc* desc, const LtLayout* a, const LtLayout* b, const LtLayout* c,
                            const LtLayout* d, LtProblem* out) {
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (desc->transa > CUBLAS_OP_T || desc->transb > CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  LtProblem p;
  p.ta = desc->transa == CUBLAS_OP_T;
  p.tb = desc->transb == CUBLAS_OP_T;
  p.m = static_cast<int64_t>(p.ta ? a->cols : a->rows);
  p.k = static_cast<int64_t>(p.ta ? a->rows : a->cols);
  const int64_t bk = static_cast<int64_t>(p.tb ? b->cols : b->rows);
  p.n = static_cast<int64_t>(p.tb ? b->rows : b->cols);
  if (bk != p.k || static_cast<int64_t>(c->rows) != p.m || static_cast<int64_t>(c->cols) != p.n ||
      static_cast<int64_t>(d->rows) != p.m || static_cast<int64_t>(d->cols) != p.n) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (const LtLayout* l : {a, b, c, d}) {
    if (l->ld < std::max<int64_t>(1, static_cast<int64_t>(l->rows))) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (ElemBytes(a->type) == 0 || a->type != b->type || c->type != d->type ||
      (d->type != a->type && d->type != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc->scale != CUDA_R_32F ||
      (desc->compute != CUBLAS_COMPUTE_32F && desc->compute != CUBLAS_COMPUTE_32F_PEDANTIC &&
       desc->compute != CUBLAS_COMPUTE_32F_FAST_TF32)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  p.ab = a->type;
  p.d = d->type;
  // The epilogues the emulation has: the others are for cuBLASLt alone.
  if (desc->epilogue != CUBLASLT_EPILOGUE_DEFAULT && desc->epilogue != CUBLASLT_EPILOGUE_BIAS &&
      desc->epilogue != CUBLASLT_EPILOGUE_GELU_AUX_BIAS && desc->epilogue != CUBLASLT_EPILOGUE_DGELU &&
      desc->epilogue != CUBLASLT_EPILOGUE_BGRADB) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || desc->epilogue == CUBLASLT_EPILOGUE_DGELU) {
    if (desc->aux == nullptr || desc->aux_ld < p.m) return CUBLAS_STATUS_INVALID_VALUE;
    if (desc->aux_ld % 8 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;  // cuBLASLt: "must be divisible by 8"
  }
  // The vector is of D's type (cuBLASLt's rule outside IMMA and fp8).
  p.bias = desc->bias_type == -1 ? d->type : static_cast<cudaDataType_t>(desc->bias_type);
  if (desc->epilogue != CUBLASLT_EPILOGUE_DEFAULT && desc->epilogue != CUBLASLT_EPILOGUE_DGELU) {  // DGELU: no vector
    if (desc->bias == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (p.bias != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  *out = p;
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* h = new cublasLtContext();
  h->device = colod_cuda_emu::CurrentDevice();
  std::lock_guard<std::mutex> l(handles_mu);
  LtHandles().insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  {
    std::lock_guard<std::mutex> l(handles_mu);
    if (LtHandles().erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* d = new LtDesc();
  d->compute = compute;
  d->scale = scale;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete Desc(desc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  LtDesc* d = Desc(desc);
  if (d == nullptr || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto take = [&](auto& field) {
    if (size != sizeof(field)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return take(d->transa);
    case CUBLASLT_MATMUL_DESC_TRANSB: return take(d->transb);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return take(d->epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return take(d->bias);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return take(d->bias_type);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return take(d->aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return take(d->aux_ld);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;  // none the emulation models
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (layout == nullptr || rows > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) ||
      cols > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(new LtLayout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete Layout(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new LtPreference());
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete Preference(pref);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t size) {
  LtPreference* p = Preference(pref);
  if (p == nullptr || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->max_workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && attr <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATMUL_PREF_SEARCH_MODE) return CUBLAS_STATUS_SUCCESS;
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int* returned) {
  if (!ValidLt(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (pref == nullptr || requested < 1 || results == nullptr || returned == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *returned = 0;
  LtProblem p;
  const cublasStatus_t st = CheckProblem(Desc(desc), Layout(a), Layout(b), Layout(c), Layout(d), &p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const LtPreference* pr = Preference(pref);
  for (uint32_t align : pr->align) {
    if (align == 0 || (align & (align - 1)) != 0) return CUBLAS_STATUS_INVALID_VALUE;
  }
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[kMagic] = kAlgoMagic;
  for (int i = 0; i < 4; ++i) r.algo.data[kAlignA + i] = pr->align[i];
  r.algo.data[kAlignBias] = Desc(desc)->bias == nullptr ? 1 : AlignmentOf(Desc(desc)->bias);
  r.algo.data[kAlignAux] = Desc(desc)->aux == nullptr ? 1 : AlignmentOf(Desc(desc)->aux);
  r.algo.data[kEpilogue] = Desc(desc)->epilogue;
  r.workspaceSize = 0;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc_handle, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a_layout, const void* B,
                              cublasLtMatrixLayout_t b_layout, const void* beta, const void* C,
                              cublasLtMatrixLayout_t c_layout, void* D, cublasLtMatrixLayout_t d_layout,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  (void)workspace;
  (void)workspace_bytes;  // the emulated algorithms need none
  if (!ValidLt(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  LtProblem p;
  const cublasStatus_t st =
      CheckProblem(Desc(desc_handle), Layout(a_layout), Layout(b_layout), Layout(c_layout), Layout(d_layout), &p);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const LtDesc desc = *Desc(desc_handle);
  const LtLayout la = *Layout(a_layout), lb = *Layout(b_layout), lc = *Layout(c_layout), ld = *Layout(d_layout);
  // The algorithm (cuBLASLt's own heuristic where null, for 256-byte operands)
  // was chosen for this epilogue and these alignments.
  uint64_t align[6] = {256, 256, 256, 256, 1, 1};
  if (algo != nullptr) {
    if (algo->data[kMagic] != kAlgoMagic || algo->data[kEpilogue] != desc.epilogue) return CUBLAS_STATUS_INVALID_VALUE;
    for (int i = 0; i < 6; ++i) align[i] = algo->data[kAlignA + i];
  }
  const bool gelu = desc.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool dgelu = desc.epilogue == CUBLASLT_EPILOGUE_DGELU;
  const bool vector_used = desc.epilogue != CUBLASLT_EPILOGUE_DEFAULT && !dgelu;
  const void* ptrs[6] = {A, B, C, D, vector_used ? desc.bias : nullptr, gelu || dgelu ? desc.aux : nullptr};
  const char* names[6] = {"A", "B", "C", "D", "the bias vector", "the auxiliary matrix"};
  for (int i = 0; i < 6; ++i) {
    if (ptrs[i] != nullptr && AlignmentOf(ptrs[i]) < align[i]) {
      colod_cuda_emu::Fatal(std::string("cublasLtMatmul: ") + names[i] + " is " +
                            std::to_string(AlignmentOf(ptrs[i])) + "-byte aligned, the algorithm was chosen for " +
                            std::to_string(align[i]) + ": a misaligned access on a GPU");
    }
  }
  const int64_t m = p.m, n = p.n, k = p.k;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const int device = colod_cuda_emu::CurrentDevice();
  const size_t ab = ElemBytes(p.ab), db = ElemBytes(p.d);
  const int64_t vector = desc.epilogue == CUBLASLT_EPILOGUE_BGRADB ? n : m;
  if ((k > 0 && !InDeviceMemory(A, static_cast<int64_t>(la.rows), static_cast<int64_t>(la.cols), la.ld, ab, device)) ||
      (k > 0 && !InDeviceMemory(B, static_cast<int64_t>(lb.rows), static_cast<int64_t>(lb.cols), lb.ld, ab, device)) ||
      !InDeviceMemory(C, m, n, lc.ld, db, device) || !InDeviceMemory(D, m, n, ld.ld, db, device) ||
      (vector_used && !InDeviceMemory(desc.bias, vector, 1, vector, db, device)) ||
      ((gelu || dgelu) && !InDeviceMemory(desc.aux, m, n, desc.aux_ld, db, device))) {
    colod_cuda_emu::Fatal("cublasLtMatmul: an operand reaches outside the device allocation it starts in (m=" +
                          std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                          "): an illegal address on a GPU");
  }
  const float a_scale = *static_cast<const float*>(alpha), b_scale = *static_cast<const float*>(beta);
  std::shared_ptr<colod_cuda_emu::Stream> s = colod_cuda_emu::Resolve(stream);
  if (s == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // A broken context fails cuBLAS's launch.
  if (colod_cuda_emu::StickyError(colod_cuda_emu::DeviceOf(*s)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  const bool tf32 = desc.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && p.ab == CUDA_R_32F;
  colod_cuda_emu::Enqueue(s, [=] {
    const int64_t a_rows = static_cast<int64_t>(la.rows), a_cols = static_cast<int64_t>(la.cols);
    const int64_t b_rows = static_cast<int64_t>(lb.rows), b_cols = static_cast<int64_t>(lb.cols);
    std::vector<float> wa = Widen(A, a_rows, a_cols, la.ld, p.ab);
    std::vector<float> wb = Widen(B, b_rows, b_cols, lb.ld, p.ab);
    if (desc.epilogue == CUBLASLT_EPILOGUE_BGRADB) {  // op(B)'s column sums over k, in double, in order
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += wb[p.tb ? i * b_rows + j : j * b_rows + i];
        Store(desc.bias, static_cast<size_t>(j), p.d, static_cast<float>(sum));
      }
    }
    if (tf32) {
      for (float& x : wa) x = RoundToTf32(x);
      for (float& x : wb) x = RoundToTf32(x);
    }
    std::vector<float> c = b_scale == 0.0f ? std::vector<float>(static_cast<size_t>(m * n), 0.0f)
                                           : Widen(C, m, n, lc.ld, p.d);
    if (k > 0) {
      cblas_sgemm(CblasColMajor, p.ta ? CblasTrans : CblasNoTrans, p.tb ? CblasTrans : CblasNoTrans,
                  static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), a_scale, wa.data(),
                  static_cast<int>(std::max<int64_t>(1, a_rows)), wb.data(),
                  static_cast<int>(std::max<int64_t>(1, b_rows)), b_scale, c.data(), static_cast<int>(m));
    }
    if (desc.epilogue == CUBLASLT_EPILOGUE_BIAS || gelu) {  // bias[row], added before D is rounded
      for (int64_t col = 0; col < n; ++col) {
        for (int64_t row = 0; row < m; ++row) c[col * m + row] += Load(desc.bias, static_cast<size_t>(row), p.d);
      }
    }
    if (gelu) {  // GELU's input to the auxiliary output, then the tanh-approximated GELU, in f32
      for (int64_t col = 0; col < n; ++col) {
        for (int64_t row = 0; row < m; ++row) {
          float& v = c[col * m + row];
          Store(desc.aux, static_cast<size_t>(col * desc.aux_ld + row), p.d, v);
          v = 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        }
      }
    }
    if (dgelu) {  // the f32 result times the tanh-approximated GELU's slope at the auxiliary input
      for (int64_t col = 0; col < n; ++col) {
        for (int64_t row = 0; row < m; ++row) {
          const float v = Load(desc.aux, static_cast<size_t>(col * desc.aux_ld + row), p.d);
          const float t = std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v));
          const float slope =
              0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
          c[col * m + row] *= slope;
        }
      }
    }
    for (int64_t col = 0; col < n; ++col) {
      for (int64_t row = 0; row < m; ++row) Store(D, static_cast<size_t>(col * ld.ld + row), p.d, c[col * m + row]);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}
