// colod's one conversion of CUDA runtime errors to absl::Status, for the
// kernels (kernels/cuda/) and the NCCL backend (worker/comm/nccl/).
#ifndef COLOD_KERNELS_CUDA_STATUS_H_
#define COLOD_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"

namespace colod::kernels::cuda {

// FAILED_PRECONDITION for a missing or unusable device, INTERNAL otherwise,
// naming `what` and the CUDA error.
inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInvalidDevice ||
      e == cudaErrorMemoryAllocation) {
    return absl::FailedPreconditionError(msg);
  }
  return absl::InternalError(msg);
}

#define COLOD_RETURN_IF_CUDA(call)                                                  \
  do {                                                                              \
    absl::Status colod_cuda_s_ = ::colod::kernels::cuda::CudaStatus((call), #call); \
    if (!colod_cuda_s_.ok()) return colod_cuda_s_;                                  \
  } while (0)

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_STATUS_H_
