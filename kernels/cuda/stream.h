// Each device's compute stream: where all of colod's kernels, copies,
// stream-ordered allocations and frees, and cuBLAS calls on that device run.
//
// Work is stream ordered: an op enqueues and returns, and the host waits only
// where it reads a value (a copy into host memory, `Synchronize`). One rank
// runs per device (NCCL's rule), so the device's stream is the rank's stream.
// All host threads that use a device share its stream, so a tensor made on
// one thread (a gRPC handler) and used or freed on another (the rank's thread)
// needs no handoff: the stream orders both. NCCL runs on each communicator's
// own stream, ordered against this one by events (worker/comm/nccl).
//
// The stream is created on first use with cudaStreamDefault flags (it
// synchronizes with the legacy default stream, so code that uses cudaMemcpy
// sees its results) and lives until the process exits: a freed tensor may
// still name it in a stream-ordered free.
//
// Thread-safe.
#ifndef COLOD_KERNELS_CUDA_STREAM_H_
#define COLOD_KERNELS_CUDA_STREAM_H_

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"

namespace colod::kernels::cuda {

// Selects `device` for the calling thread and returns its compute stream.
absl::StatusOr<cudaStream_t> ComputeStream(int device);

// Blocks until the device's compute stream has run everything enqueued so
// far; the error of an asynchronous failure (a faulting kernel) if any.
absl::Status Synchronize(int device);

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_STREAM_H_
