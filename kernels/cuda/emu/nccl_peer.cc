// A rank of the emulated NCCL in a process of its own, for
// nccl_processes_test.cc (test code):
//   nccl_peer collectives ID RANK NRANKS  RunCollectives; exit 0 if all held
//   nccl_peer join ID RANK NRANKS         joins, connects, prints "joined", waits for a signal
//   nccl_peer host NRANKS                 makes an id and prints it, joins as rank 0,
//                                         connects, prints "joined", waits for a signal
//   nccl_peer abort ID RANK NRANKS        joins, connects, enters an all-reduce its peers
//                                         never enter, aborts after 300 ms, prints "released"
//   nccl_peer exit ID RANK NRANKS         joins, takes part in one all-reduce of 1.0
//                                         each, and exits without destroying anything
// To connect is to take part in one all-reduce with every rank: a
// communicator's first collective connects its ranks, holding each host
// until all arrived, so the all-reduces that wait for a lost peer come
// after it. IDs are hex (IdToHex).
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cuda/emu/nccl_ranks.h"

namespace {

int Fail(const std::string& why) {
  fprintf(stderr, "nccl_peer: %s\n", why.c_str());
  return 1;
}

void Say(const char* line) {
  printf("%s\n", line);
  fflush(stdout);
}

[[noreturn]] void WaitForSignal() {
  for (;;) pause();
}

}  // namespace

int main(int argc, char** argv) {
  using colod_nccl_emu_test::Connect;
  using colod_nccl_emu_test::IdFromHex;
  using colod_nccl_emu_test::IdToHex;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (cudaSetDevice(0) != cudaSuccess) return Fail("no device 0");
  if (mode == "host" && argc == 3) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != ncclSuccess) return Fail("ncclGetUniqueId");
    Say(IdToHex(id).c_str());
    ncclComm_t comm;
    if (ncclCommInitRank(&comm, atoi(argv[2]), id, 0) != ncclSuccess) return Fail("ncclCommInitRank");
    if (!Connect(comm)) return Fail("the first all-reduce");
    Say("joined");
    WaitForSignal();
  }
  ncclUniqueId id;
  if (argc != 5 || !IdFromHex(argv[2], &id)) {
    return Fail("usage: nccl_peer collectives|join|abort ID RANK NRANKS, or nccl_peer host NRANKS");
  }
  const int rank = atoi(argv[3]), nranks = atoi(argv[4]);
  if (mode == "collectives") {
    const std::string errors = colod_nccl_emu_test::RunCollectives(id, rank, nranks, 0);
    if (!errors.empty()) return Fail(errors);
    return 0;
  }
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, nranks, id, rank) != ncclSuccess) return Fail("ncclCommInitRank");
  if ((mode == "join" || mode == "abort") && !Connect(comm)) return Fail("the first all-reduce");
  if (mode == "join") {
    Say("joined");
    WaitForSignal();
  }
  if (mode == "exit") {
    float* x = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float));
    const float one = 1.0f;
    cudaMemcpy(x, &one, sizeof one, cudaMemcpyHostToDevice);
    if (ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread) != ncclSuccess) {
      return Fail("ncclAllReduce");
    }
    if (cudaStreamSynchronize(cudaStreamPerThread) != cudaSuccess) return Fail("the stream failed");
    return 0;  // the process ends; the communicator with it
  }
  if (mode == "abort") {
    float* x = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float));
    if (ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread) != ncclSuccess) {
      return Fail("ncclAllReduce");
    }
    usleep(300 * 1000);
    if (cudaStreamQuery(cudaStreamPerThread) != cudaErrorNotReady) return Fail("the all-reduce completed alone");
    ncclCommAbort(comm);
    if (cudaStreamSynchronize(cudaStreamPerThread) != cudaSuccess) return Fail("the stream failed");
    Say("released");
    return 0;
  }
  return Fail("unknown mode " + mode);
}
