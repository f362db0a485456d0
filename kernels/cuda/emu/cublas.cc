// cuBLAS in colod's CUDA emulation (include/cublas_v2.h): GEMMs checked as
// cuBLAS checks them, then run in stream order by OpenBLAS's column-major
// sgemm, with bf16/f16 operands widened to f32 and the result rounded back
// (round to nearest even), as cuBLAS does with CUBLAS_COMPUTE_32F.
//
// Thread-safety: a handle may be used from several threads (the stream it
// names is resolved for the calling thread), but, as with cuBLAS, not
// destroyed while in use.
#include <cblas.h>
#include <cublas_emu.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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
