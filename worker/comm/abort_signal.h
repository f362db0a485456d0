// A one-shot abort that reaches communicators still being made. A process
// group hands one to its factory: communicators created with it check it
// while they wait (init, split) and the NCCL watchdog aborts every
// communicator whose signal fired, so ProcessGroup::Abort also ends a
// rendezvous in progress and the world communicator a factory keeps.
// Blocking calls that cannot poll (a gRPC download) register a callback
// that cancels them (OnAbort).
#ifndef COLOD_WORKER_COMM_ABORT_SIGNAL_H_
#define COLOD_WORKER_COMM_ABORT_SIGNAL_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace colod {

// Thread-safe. Abort never blocks, apart from running the callbacks.
class AbortSignal {
 public:
  // Keeps a callback registered; destroying it unregisters the callback and
  // waits for it if it is running, so what it captures may die afterwards.
  class Registration {
   public:
    ~Registration() {
      absl::MutexLock lock(&signal_->callbacks_mu_);  // held by Abort while callbacks run
      signal_->callbacks_.erase(id_);
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    friend class AbortSignal;
    Registration(AbortSignal* signal, int id) : signal_(signal), id_(id) {}
    AbortSignal* const signal_;
    const int id_;
  };

  // The first reason wins; later calls change nothing. Runs the registered
  // callbacks on this thread.
  void Abort(const absl::Status& reason) {
    {
      absl::MutexLock lock(&mu_);
      if (fired_) return;
      reason_ = reason.ok() ? absl::AbortedError("aborted") : reason;
      fired_.store(true);
    }
    absl::MutexLock lock(&callbacks_mu_);
    for (auto& [id, fn] : callbacks_) fn();
  }
  bool fired() const { return fired_.load(); }
  // OK, or the abort's reason.
  absl::Status Check() const {
    if (!fired_.load()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    return reason_;
  }
  // Runs `fn` when the signal fires (at once, here, if it has), unless the
  // registration is gone by then. `fn` must not block (it cancels: e.g.
  // grpc::ClientContext::TryCancel) nor register or unregister callbacks.
  // The signal must outlive the registration.
  [[nodiscard]] std::unique_ptr<Registration> OnAbort(std::function<void()> fn) {
    absl::MutexLock lock(&callbacks_mu_);
    const int id = next_id_++;
    // Under callbacks_mu_, so that an Abort in progress either has run its
    // callbacks already (fired) or will see this one.
    if (fired_.load()) {
      fn();
    } else {
      callbacks_.emplace(id, std::move(fn));
    }
    return std::unique_ptr<Registration>(new Registration(this, id));
  }

 private:
  mutable absl::Mutex mu_;
  std::atomic<bool> fired_{false};
  absl::Status reason_ ABSL_GUARDED_BY(mu_);
  // Held while callbacks run (they never block), so that unregistering waits
  // for a callback in progress.
  absl::Mutex callbacks_mu_;
  std::map<int, std::function<void()>> callbacks_ ABSL_GUARDED_BY(callbacks_mu_);
  int next_id_ ABSL_GUARDED_BY(callbacks_mu_) = 0;
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_ABORT_SIGNAL_H_
