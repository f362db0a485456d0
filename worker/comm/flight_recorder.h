// A rank's flight recorder: the last collectives each of its communicators
// (groups) was given, in order, with their sequence numbers, sizes, times and
// states, after PyTorch's NCCL flight recorder. The worker reports each
// group's progress in its heartbeat so that the coordinator can name the
// ranks that have not entered a collective their peers wait in
// (server/hang_detector.h), and dumps the record to its work dir when a rank
// fails.
#ifndef COLOD_WORKER_COMM_FLIGHT_RECORDER_H_
#define COLOD_WORKER_COMM_FLIGHT_RECORDER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/worker.pb.h"

namespace colod {

// Thread-safe; every call is short (no I/O under the lock).
class FlightRecorder {
 public:
  // kAbandoned: its communicator was destroyed before anyone saw it end
  // (the rank stopped waiting after an earlier failure).
  enum class State { kPending, kCompleted, kFailed, kAbandoned };
  struct Entry {
    std::string group;
    int64_t sequence = 0;  // per group, from 1
    std::string op;
    int64_t bytes = 0;
    absl::Time enqueued;
    // When the group's communicator could start it: collectives of one group
    // run in submission order, so the later of its enqueue and the previous
    // one's end (an upper bound of the real start).
    absl::Time started;
    absl::Time ended = absl::InfinitePast();  // while pending
    State state = State::kPending;
  };

  // Keeps the last `capacity` entries (pending ones are never dropped
  // from the per-group progress, only from Entries()).
  explicit FlightRecorder(size_t capacity = 2048);

  // A collective submitted on `group`; returns its sequence number there.
  int64_t Enqueue(const std::string& group, const std::string& op, int64_t bytes);
  // The collective `sequence` of `group` ended (at most once; later calls do
  // nothing).
  void End(const std::string& group, int64_t sequence, bool ok);
  // The group's communicator is gone: its pending collectives are abandoned.
  void CloseGroup(const std::string& group);

  // Oldest first.
  std::vector<Entry> Entries() const;
  // Per group: collectives entered, and the oldest one not ended (its
  // sequence, op and age at `now`), for the heartbeat.
  std::vector<v1::CollectiveProgress> Progress(absl::Time now) const;
  // The entries as JSON lines' worth of an array, for the dump.
  std::string ToJson() const;

  static const char* StateName(State s);

 private:
  struct Group {
    int64_t entered = 0;
    absl::Time last_end = absl::InfinitePast();
    // Pending collectives: sequence -> (op, enqueued).
    std::map<int64_t, std::pair<std::string, absl::Time>> pending;
  };
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_FLIGHT_RECORDER_H_
