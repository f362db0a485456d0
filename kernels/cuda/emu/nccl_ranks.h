// What one rank of the emulated NCCL's cross-process tests does
// (nccl_processes_test.cc), in the test's process or in a peer process
// (nccl_peer.cc). Test code.
#ifndef COLOD_KERNELS_CUDA_EMU_NCCL_RANKS_H_
#define COLOD_KERNELS_CUDA_EMU_NCCL_RANKS_H_

#include <nccl.h>

#include <string>

namespace colod_nccl_emu_test {

// An id as hex and back (ids travel in argv and pipes).
std::string IdToHex(const ncclUniqueId& id);
bool IdFromHex(const std::string& hex, ncclUniqueId* id);

// One all-reduce of `comm` with every rank, waited for: a communicator's
// first collective connects its ranks, holding each host until all
// arrived, so a test whose later collective waits for a lost peer makes
// this one first. False if it failed.
bool Connect(ncclComm_t comm);

// Rank `rank` of `nranks` on `id`, on `device` of its process (ranks that
// share a process need devices of their own: a synchronous copy waits for
// every stream of its device, a peer's waiting collective included), runs every
// collective, a grouped ring exchange, a split and a bf16 all-reduce on
// inputs that tell the ranks apart, and checks each output against its
// definition. "" if all held, else what did not.
std::string RunCollectives(const ncclUniqueId& id, int rank, int nranks, int device);

}  // namespace colod_nccl_emu_test

#endif  // COLOD_KERNELS_CUDA_EMU_NCCL_RANKS_H_
