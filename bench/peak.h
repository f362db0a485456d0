// The physical limits a benchmark row is set beside, measured in the same
// run: OpenBLAS sgemm on the CPU and cuBLAS bf16 GEMM on a CUDA device.
//
// Thread-compatible: each call sets the process's BLAS threads or uses the
// device; call them from one thread, between the benchmark's rows.
#ifndef COLOD_BENCH_PEAK_H_
#define COLOD_BENCH_PEAK_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace colod::bench {

// Floating-point operations of an [m, k] x [k, n] product.
double MatMulFlops(int64_t m, int64_t k, int64_t n);

// Best of `tries` f32 GEMMs [m, k] x [k, n] on the CPU with `threads` BLAS
// threads, in FLOP/s. Leaves the process at `threads` BLAS threads.
double SgemmPeak(int threads, int64_t m, int64_t k, int64_t n, int tries = 5);

// cuBLAS bf16 GEMMs [m, k] x [k, n] (f32 accumulation) on CUDA device
// `ordinal`: `reps` GEMMs enqueued back to back and timed until the device
// finished them (ops only enqueue), best of 3 rounds, in FLOP/s.
absl::StatusOr<double> CublasBf16Peak(int ordinal, int64_t m, int64_t k, int64_t n, int reps = 20);

}  // namespace colod::bench

#endif  // COLOD_BENCH_PEAK_H_
