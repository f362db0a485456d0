#include "bench/peak.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/device.h"
#include "worker/tensor/ops.h"

namespace colod::bench {

double MatMulFlops(int64_t m, int64_t k, int64_t n) { return 2.0 * static_cast<double>(m) * k * n; }

double SgemmPeak(int threads, int64_t m, int64_t k, int64_t n, int tries) {
  kernels::cpu::SetBlasThreads(threads);
  const Tensor a = *Tensor::RandomNormal({m, k}, 1), b = *Tensor::RandomNormal({k, n}, 2);
  (void)ops::MatMul(a, b);  // warm-up: pages, OpenBLAS's buffers
  double best = 0;
  for (int i = 0; i < tries; ++i) {
    const absl::Time t0 = absl::Now();
    (void)ops::MatMul(a, b);
    best = std::max(best, MatMulFlops(m, k, n) / absl::ToDoubleSeconds(absl::Now() - t0));
  }
  return best;
}

absl::StatusOr<double> CublasBf16Peak(int ordinal, int64_t m, int64_t k, int64_t n, int reps) {
  const Device gpu = Device::Cuda(ordinal);
  ASSIGN_OR_RETURN(Tensor a, Tensor::RandomNormal({m, k}, 1, DType::kBF16, gpu));
  ASSIGN_OR_RETURN(Tensor b, Tensor::RandomNormal({k, n}, 2, DType::kBF16, gpu));
  ASSIGN_OR_RETURN(Tensor warm, ops::MatMul(a, b));  // cuBLAS's handle and workspace
  RETURN_IF_ERROR(kernels::CudaSynchronize(ordinal));
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<Tensor> outs;  // alive until the device is done with them
    const absl::Time t0 = absl::Now();
    for (int i = 0; i < reps; ++i) {
      ASSIGN_OR_RETURN(Tensor c, ops::MatMul(a, b));
      outs.push_back(std::move(c));
    }
    RETURN_IF_ERROR(kernels::CudaSynchronize(ordinal));
    best = std::max(best, reps * MatMulFlops(m, k, n) / absl::ToDoubleSeconds(absl::Now() - t0));
  }
  return best;
}

}  // namespace colod::bench
