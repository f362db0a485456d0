#include "worker/comm/gloo/collective_algorithms.h"

#include <cstring>
#include <stdexcept>

#include "gloo/transport/unbound_buffer.h"

namespace colod::gloo_algorithms {

void TwoRankAllReduce(const Call& call, void* data, char* scratch) {
  const int rank = call.context->rank;
  const size_t bytes = call.count * call.element_bytes;
  const int peer = 1 - rank;
  auto into = call.context->createUnboundBuffer(scratch, bytes);
  auto from = call.context->createUnboundBuffer(data, bytes);
  into->recv(peer, call.slot);
  from->send(peer, call.slot);
  if (!into->waitRecv(call.timeout) || !from->waitSend(call.timeout)) {
    throw std::runtime_error("all-reduce exchange aborted");
  }
  const void* first = rank == 0 ? data : scratch;
  const void* second = rank == 0 ? scratch : data;
  call.reduce(data, first, second, call.count);
}

void RingReduceScatter(const Call& call, const void* in, void* out, char* scratch) {
  const int rank = call.context->rank, size = call.context->size;
  const size_t chunk = call.count * call.element_bytes;
  const char* input = static_cast<const char*>(in);
  if (size == 1) {
    std::memcpy(out, in, chunk);
    return;
  }
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  char* const sum = scratch;
  char* const incoming = sum + chunk;
  auto from_input = call.context->createUnboundBuffer(const_cast<char*>(input), chunk * size);
  auto from_sum = call.context->createUnboundBuffer(sum, chunk);
  auto into = call.context->createUnboundBuffer(incoming, chunk);
  for (int step = 0; step + 1 < size; ++step) {
    // Send the running sum of chunk r - step - 1 (at step 0, this rank's own
    // chunk), receive the left's of chunk r - step - 2.
    const size_t send_chunk = static_cast<size_t>((rank + 2 * size - step - 1) % size);
    const size_t recv_chunk = static_cast<size_t>((rank + 2 * size - step - 2) % size);
    into->recv(left, call.slot);
    gloo::transport::UnboundBuffer* sending = step == 0 ? from_input.get() : from_sum.get();
    if (step == 0) {
      sending->send(right, call.slot, send_chunk * chunk, chunk);
    } else {
      sending->send(right, call.slot);
    }
    if (!into->waitRecv(call.timeout) || !sending->waitSend(call.timeout)) {
      throw std::runtime_error("reduce-scatter step aborted");
    }
    void* dst = step + 2 == size ? out : sum;  // the last step leaves chunk r's sum
    call.reduce(dst, input + recv_chunk * chunk, incoming, call.count);
  }
}

}  // namespace colod::gloo_algorithms
