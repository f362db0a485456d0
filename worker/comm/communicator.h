// The collective-communication interface (c10d's Backend and Work, in
// colod's terms). Backends: gloo/ (CPU tensors over TCP) and nccl/ (CUDA).
#ifndef COLOD_WORKER_COMM_COMMUNICATOR_H_
#define COLOD_WORKER_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "worker/tensor/dtype.h"

namespace colod {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// One submitted collective. Thread-safe.
class Work {
 public:
  virtual ~Work() = default;
  // Waits for completion: OK, the op's error, or DEADLINE_EXCEEDED after
  // `timeout`, having aborted the communicator (every later op fails) and
  // waited for the op to stop, so that in every case the op's buffers may
  // be freed once Wait returned (on a device: once the stream drained).
  // Never waits forever.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
  // Orders the device work the caller issues next after this op, without
  // blocking the host where the backend runs on a device stream (NCCL: the
  // device's compute stream waits for the op's completion event). Buffers of
  // the op may then be reused, or freed in stream order, by later device work.
  // Returns an error already known (a failed submission, an aborted
  // communicator); a failure that happens later is sticky on the communicator
  // and is reported by AsyncError, which callers check after they next read a
  // result on the host. Backends without streams (Gloo) wait as Wait does.
  virtual absl::Status WaitOnDevice(absl::Duration timeout) { return Wait(timeout); }
  virtual bool IsCompleted() = 0;
};

// A group of `size()` ranks. Collectives are asynchronous: each returns a Work
// at once and runs in submission order, so every rank must submit the same
// collectives in the same order (as with NCCL). Buffers must stay valid and
// untouched until the Work completes. Counts are elements, not bytes.
//
// Thread-safe: submission from several threads is serialized, but the order
// then depends on the threads, so ranks usually submit from one thread.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "gloo" or "nccl": named in every error the backend returns.
  virtual std::string backend() const = 0;

  // data[i] <- reduce over ranks of data[i]. kAvg on integers truncates.
  virtual std::shared_ptr<Work> AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) = 0;
  // out = concatenation over ranks of in (count elements each); out holds size()*count.
  virtual std::shared_ptr<Work> AllGather(const void* in, void* out, int64_t count, DType dtype) = 0;
  // in holds size()*count elements; out (count) <- this rank's chunk of the reduction.
  virtual std::shared_ptr<Work> ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                              ReduceOp op) = 0;
  // data <- root's data.
  virtual std::shared_ptr<Work> Broadcast(void* data, int64_t count, DType dtype, int root) = 0;
  // in and out hold size()*count elements; out chunk j <- rank j's in chunk rank().
  virtual std::shared_ptr<Work> AllToAll(const void* in, void* out, int64_t count, DType dtype) = 0;
  // Point to point; `tag` pairs a Send with its Recv.
  virtual std::shared_ptr<Work> Send(const void* data, int64_t count, DType dtype, int dst, uint32_t tag) = 0;
  virtual std::shared_ptr<Work> Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) = 0;
  virtual std::shared_ptr<Work> Barrier() = 0;

  // Fails every collective not yet started with `reason` (ABORTED) and every
  // later one, and ends the one in flight (Gloo: its pairs close and its
  // waits end; NCCL: ncclCommAbort).
  virtual void Abort(const absl::Status& reason) = 0;
  // The first error any collective hit, or OK: errors are sticky, because
  // ranks that disagree about a failed collective cannot continue together.
  virtual absl::Status AsyncError() = 0;
};

// The check every backend makes before it derives a size from a count:
// count >= 0, and count x `chunks` elements (the most a buffer of the call
// holds: size() for AllGather's output, ReduceScatter's input and AllToAll's
// buffers, 1 otherwise) of `dtype` is a byte size that fits in int64_t.
// INVALID_ARGUMENT names `what` ("gloo AllReduce") otherwise.
inline absl::Status CheckCollectiveCount(const char* what, int64_t count, DType dtype, int64_t chunks) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": count must be >= 0, got ", count));
  const int64_t element = static_cast<int64_t>(SizeOf(dtype));
  if (element == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": unknown dtype"));
  if (chunks < 1 || count > std::numeric_limits<int64_t>::max() / element / chunks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", count, " x ", chunks, " elements of ", element, " bytes overflow a size"));
  }
  return absl::OkStatus();
}

}  // namespace colod

#endif  // COLOD_WORKER_COMM_COMMUNICATOR_H_
