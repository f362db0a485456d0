// The coordinator's view of the cluster: registered workers and their leases.
#ifndef COLOD_SERVER_WORKER_REGISTRY_H_
#define COLOD_SERVER_WORKER_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/worker.pb.h"
#include "common/clock.h"
#include "common/limits.h"

namespace colod {

// Registered workers. A worker holds a lease that each heartbeat renews; a
// worker whose lease expired is LOST, and its next heartbeat is NOT_FOUND so
// that it registers again (its communicators must be rebuilt anyway). LOST
// workers stay listed for `forget_after` and are then dropped.
//
// Thread-safe. Time comes from the injected clock, so leases are testable.
class WorkerRegistry {
 public:
  struct Options {
    absl::Duration heartbeat_interval = absl::Seconds(2);
    absl::Duration lease_duration = absl::Seconds(10);
    absl::Duration forget_after = absl::Minutes(10);
    Clock* clock = Clock::Real();
    // Worker ids are PREFIX + a 6-digit counter. The coordinator puts a
    // random part in it per start, so that a worker registered with an
    // earlier coordinator cannot heartbeat under a new worker's id.
    std::string id_prefix = "worker-";
    // Workers held at once, LOST ones included. A registration past it
    // makes room by forgetting the worker lost longest, and is
    // RESOURCE_EXHAUSTED where none is lost; a worker registering again
    // under its address replaces itself.
    int max_workers = kDefaultMaxWorkers;
  };
  static constexpr int kDefaultMaxWorkers = 16384;

  explicit WorkerRegistry(Options options);

  struct Registration {
    std::string worker_id;
    absl::Duration heartbeat_interval;
    absl::Duration lease_duration;
    // A live worker registered at the address before with another key,
    // which this registration replaced (AtAddress::kProven); "" none.
    std::string replaced;
  };

  // What a registration's claim to its address rests on.
  enum class AtAddress {
    // Nothing: a live worker there with another key stays (CheckAddress).
    kClaimed,
    // The daemon at the address said a call carrying the registration's
    // key carried its own (ProveWorkerKey, GetStatusResponse.
    // worker_key_held): a worker process holds one key, so any worker
    // registered there with another is gone, and is replaced at once.
    kProven,
  };

  // OK where Register would take `info` and `key` (address HOST:PORT with
  // port 1..65535, device_ordinal >= 0, worker_id empty, the bounds of
  // common/limits.h, a key CheckWorkerKey takes or none); INVALID_ARGUMENT
  // naming the field otherwise. Checked before anything is sent to the
  // address (ProveWorkerKey).
  static absl::Status Validate(const v1::WorkerInfo& info, const std::string& key);

  // Validates `info` and `key` (Validate) and adds the worker. A
  // registration with the address of a known worker replaces it (the daemon
  // restarted), except as CheckAddress says where `at` is kClaimed.
  // INVALID_ARGUMENT naming the field otherwise; RESOURCE_EXHAUSTED past
  // max_workers. `key`: the worker's key (RegisterWorkerRequest.worker_key;
  // "" none), INVALID_ARGUMENT where it is empty and `at` kProven; kept,
  // never listed.
  absl::StatusOr<Registration> Register(const v1::WorkerInfo& info,
                                        const v1::WorkerStatus& status = v1::WorkerStatus(),
                                        const std::string& key = "", AtAddress at = AtAddress::kClaimed);

  // OK where a worker registering at `address` with `key` may replace the
  // one there: none is, it is lost, it registered with no key (an older
  // worker: nothing to prove), or with this key (the same daemon again).
  // ALREADY_EXISTS where a live worker there registered with another key:
  // the workers' token alone must not take a live worker's place (its job
  // would fail); a daemon restarted there that proves nothing registers
  // once the old lease ends, saying when.
  absl::Status CheckAddress(absl::string_view address, absl::string_view key);

  // The key `worker_id` registered with; "" for none, or an unknown id.
  std::string KeyOf(absl::string_view worker_id);
  // The key a call meant for `worker_id` carries (WorkerClient::Call::key):
  // its key; "" for one registered without (an older worker); and for an
  // unknown id (forgotten, or replaced by a worker restarted at its
  // address) a fresh one no process holds, so that whatever listens at its
  // address now refuses the call.
  std::string KeyToCall(absl::string_view worker_id);

  // Renews the lease and records `status`; returns the new expiry. NOT_FOUND
  // for an unknown worker or one whose lease already expired.
  absl::StatusOr<absl::Time> Heartbeat(absl::string_view worker_id, const v1::WorkerStatus& status);

  // The worker leaves now (it stops cleanly): LOST with `reason` ("left:
  // REASON"), as if its lease had expired. NOT_FOUND for an unknown id.
  absl::Status Deregister(absl::string_view worker_id, absl::string_view reason);

  // Why a LOST worker is lost ("no heartbeat within 10s", "left: ..."); for
  // a forgotten or unknown id, that it is no longer registered.
  std::string LostReason(absl::string_view worker_id);

  // Workers sorted by id; LOST ones only if include_lost.
  std::vector<v1::Worker> List(bool include_lost);
  // A page of List: the workers with ids after `after` ("" for the first
  // page), at most `limit`, ending after the one that brings the page to
  // `max_bytes` (their serialized size) or more; `more` when others follow.
  struct Page {
    std::vector<v1::Worker> workers;
    bool more = false;
  };
  Page ListPage(bool include_lost, absl::string_view after, int limit, size_t max_bytes);

  // Marks expired leases LOST and forgets long-lost workers. Returns the ids
  // that became LOST in this call. Called periodically by the coordinator;
  // List and Heartbeat also apply expiry, so callers never see a stale state.
  std::vector<std::string> Sweep();

  // Number of workers per state: idle, busy, lost (no heartbeat within the
  // lease) and left (deregistered: a clean stop, which pages no one), e.g.
  // {"idle": 2, "busy": 0, "lost": 1, "left": 0}.
  std::map<std::string, int> CountByState();

  // How the lost reason of a worker that left (DeregisterWorker) starts.
  static constexpr char kLeftPrefix[] = "left: ";

 private:
  struct Entry {
    v1::WorkerInfo info;
    v1::WorkerStatus status;
    bool lost = false;
    bool left = false;        // lost by its own DeregisterWorker (a clean stop)
    std::string lost_reason;  // once lost
    absl::Time register_time;
    absl::Time last_heartbeat;
    std::string key;  // Register's
  };
  std::vector<std::string> SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckAddressLocked(absl::string_view address, absl::string_view key, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Worker ToProto(const Entry& e) const;
  // The key `worker_id` registered with ("" for none); nullopt for an unknown id.
  std::optional<std::string> RegisteredKey(absl::string_view worker_id) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  absl::Mutex mu_;
  // Keyed by worker id; std::map keeps List() sorted.
  std::map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace colod

#endif  // COLOD_SERVER_WORKER_REGISTRY_H_
