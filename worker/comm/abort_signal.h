// A one-shot abort that reaches communicators still being made. A process
// group hands one to its factory: communicators created with it check it
// while they wait (init, split) and the NCCL watchdog aborts every
// communicator whose signal fired, so ProcessGroup::Abort also ends a
// rendezvous in progress and the world communicator a factory keeps.
#ifndef COLOD_WORKER_COMM_ABORT_SIGNAL_H_
#define COLOD_WORKER_COMM_ABORT_SIGNAL_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace colod {

// Thread-safe; never blocks.
class AbortSignal {
 public:
  // The first reason wins; later calls change nothing.
  void Abort(const absl::Status& reason) {
    absl::MutexLock lock(&mu_);
    if (fired_) return;
    reason_ = reason.ok() ? absl::AbortedError("aborted") : reason;
    fired_.store(true);
  }
  bool fired() const { return fired_.load(); }
  // OK, or the abort's reason.
  absl::Status Check() const {
    if (!fired_.load()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    return reason_;
  }

 private:
  mutable absl::Mutex mu_;
  std::atomic<bool> fired_{false};
  absl::Status reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_ABORT_SIGNAL_H_
