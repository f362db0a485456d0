// An injectable clock, so that leases and timeouts are testable without sleeping.
#ifndef COLOD_COMMON_CLOCK_H_
#define COLOD_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace colod {

// A retry's wait after `times` failures in a row: `first`, doubled at each,
// at most `most` (a wait that stops growing once it reaches it).
inline absl::Duration DoubledWait(absl::Duration first, int times, absl::Duration most) {
  absl::Duration wait = first;
  for (int i = 0; i < times && wait < most; ++i) wait *= 2;
  return wait < most ? wait : most;
}

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process-wide real clock.
  static Clock* Real();
};

// A clock that moves only when told to. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24 * 365 * 50)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_COMMON_CLOCK_H_
