// Fault injection for colod's NCCL emulation (include/nccl.h), for tests.
// Also read once from the environment, for tests that run daemons:
//   COLOD_NCCL_EMU_FAULT=KIND:RANK:OP[:COMM_SIZE]
// KIND is `hang` (the rank's OP-th operation never enters: its peers wait)
// or `error` (the rank's communicator reports ncclRemoteError from its OP-th
// operation on); OP counts the collectives and point-to-point calls of one
// communicator from 1; COMM_SIZE, if given, restricts the fault to
// communicators of that many ranks.
#ifndef COLOD_KERNELS_CUDA_EMU_NCCL_EMU_H_
#define COLOD_KERNELS_CUDA_EMU_NCCL_EMU_H_

namespace colod_nccl_emu {

enum class FaultKind { kNone, kHang, kError };

struct Fault {
  FaultKind kind = FaultKind::kNone;
  int rank = 0;       // rank within the communicator
  long op = 1;        // the communicator's op sequence number, from 1
  int comm_size = 0;  // 0: any
};

// Replaces the process's fault (kNone clears it). Applies to operations
// enqueued after the call.
void SetFault(const Fault& fault);

// Pauses the thread that ends a non-blocking connection for `ms` between its
// two marks of the end (the connection made, the communicator's state), for
// a test that a caller who sees the state change may call at once. 0 (the
// default) pauses nothing.
void SetConnectEndPause(int ms);

// Makes every ncclCommAbort that starts after the call take at least `ms`
// before it aborts anything, as a real abort may while NCCL's network
// threads stop, for a test that nothing else waits on a slow abort. 0 (the
// default) pauses nothing.
void SetAbortPause(int ms);

// How many calls of ncclCommAbort this process has begun.
long AbortsBegun();

}  // namespace colod_nccl_emu

#endif  // COLOD_KERNELS_CUDA_EMU_NCCL_EMU_H_
