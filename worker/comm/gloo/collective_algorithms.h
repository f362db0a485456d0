// colod's own collectives over a Gloo context's pairs, where the Gloo that
// Debian ships has none (a reduce-scatter: its options API lacks one) or a
// slower one (an all-reduce of two ranks: halving-doubling makes two
// exchanges where one does). GlooCommunicator picks them behind the
// Communicator interface; they know nothing of colod's dtypes, only element
// bytes and Gloo's reduce function.
//
// Each runs on the calling thread and throws what Gloo throws (an
// IoException for a failed pair), or std::runtime_error when a wait was
// aborted (UnboundBuffer::abortWaitRecv/abortWaitSend, GlooCommunicator's
// Abort). Not thread-safe: one call at a time per context, as Gloo's own
// collectives.
#ifndef COLOD_WORKER_COMM_GLOO_COLLECTIVE_ALGORITHMS_H_
#define COLOD_WORKER_COMM_GLOO_COLLECTIVE_ALGORITHMS_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "gloo/allreduce.h"
#include "gloo/context.h"

namespace colod::gloo_algorithms {

// What every algorithm needs of the call: the context (its rank and size),
// the slot its messages use, how long a wait may take, and `count` elements
// of `element_bytes` each reduced with `reduce`.
struct Call {
  const std::shared_ptr<gloo::Context>& context;
  uint64_t slot;
  std::chrono::milliseconds timeout;
  size_t count;
  size_t element_bytes;
  gloo::AllreduceOptions::Func reduce;
};

// An all-reduce of `data` between exactly two ranks in one exchange: both
// send their whole buffer and reduce it with the other's, as op(rank 0's,
// rank 1's), so both hold the same bits even where the reduction is not
// commutative (a max with a NaN). `scratch` holds count * element_bytes.
void TwoRankAllReduce(const Call& call, void* data, char* scratch);

// A ring reduce-scatter: `in` holds size chunks of `count` elements; chunk
// r's reduction over the ranks ends in rank r's `out`. In size - 1 steps each
// rank sends one chunk to its right neighbour and reduces the one from its
// left into its running sum: (size - 1) / size of its input on the wire, as
// NCCL's ring. `scratch` holds 2 * count * element_bytes. One rank copies.
void RingReduceScatter(const Call& call, const void* in, void* out, char* scratch);

}  // namespace colod::gloo_algorithms

#endif  // COLOD_WORKER_COMM_GLOO_COLLECTIVE_ALGORITHMS_H_
