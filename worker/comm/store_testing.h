// Stores that misbehave as a coordinator can, for the communicators' tests.
#ifndef COLOD_WORKER_COMM_STORE_TESTING_H_
#define COLOD_WORKER_COMM_STORE_TESTING_H_

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "worker/comm/store.h"

namespace colod::testing {

// A store whose waits overrun their timeout by `overrun`, as over a
// coordinator that stalls, and then time out; a wait of no time (or less)
// it refuses INVALID_ARGUMENT, as the coordinator's store does. Sets and
// gets are an InMemoryStore's.
class OverrunningStore final : public Store {
 public:
  explicit OverrunningStore(absl::Duration overrun) : overrun_(overrun) {}
  absl::Status Set(absl::string_view key, std::string value) override { return inner_.Set(key, std::move(value)); }
  absl::StatusOr<std::string> Get(absl::string_view key) override { return inner_.Get(key); }
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>&, absl::Duration timeout) override {
    if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be in (0, 30m]");
    absl::SleepFor(overrun_);
    return absl::DeadlineExceededError("still missing");
  }

 private:
  const absl::Duration overrun_;
  InMemoryStore inner_;
};

}  // namespace colod::testing

#endif  // COLOD_WORKER_COMM_STORE_TESTING_H_
