// The rendezvous key-value store and barriers that Gloo and NCCL use to find
// each other (addresses, unique ids), scoped per job and generation.
#ifndef COLOD_COMMON_RENDEZVOUS_STORE_H_
#define COLOD_COMMON_RENDEZVOUS_STORE_H_

#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/limits.h"

namespace colod {

// What the store holds at most, so that a misbehaving client cannot exhaust
// the coordinator's threads or memory (the coordinator's --max-store-waits
// and --store-quota).
struct RendezvousStoreLimits {
  // Wait and Barrier calls blocked at once (each holds a server thread);
  // more are UNAVAILABLE (for now: workers ask again within their deadline). Every rank of a job may wait at once, so
  // it must exceed the largest job's world size.
  int max_waiters = 8192;
  // Bytes of keys, values and barrier state together; a Set past it is
  // UNAVAILABLE (for now: a job's scope is deleted when its generation ends,
  // and workers ask again within their deadline; never a refusal that would
  // fail another job for good).
  int64_t max_bytes = int64_t{1} << 30;
  // Whether only the scopes opened with OpenScope take sets, waits and
  // barriers (the coordinator's store: a job generation's scope, from
  // its placement until it ends), so that no client can fill the store
  // under a scope of its own that no job's end deletes; the others are
  // FAILED_PRECONDITION. Off, any scope is open until it is deleted.
  bool placed_scopes_only = false;
};

// Thread-safe. Waits block the calling thread (one gRPC handler thread each)
// until the keys arrive, the timeout passes, or Close() is called.
class RendezvousStore {
 public:
  // Limits that keep a misbehaving client from exhausting the coordinator.
  static constexpr size_t kMaxKeyBytes = 1024;
  // A value, and the values one Wait returns together, fit one gRPC message
  // of the default 4 MiB with room for the rest of it (scope, key, and each
  // value's framing: a KvSet or KvWait at the bounds goes through; a larger
  // message could not be received anyway).
  static constexpr size_t kMaxValueBytes = (4 << 20) - (64 << 10);
  static constexpr absl::Duration kMaxTimeout = absl::Minutes(30);
  static constexpr size_t kMaxWaitKeys = 4096;
  // The keys one wait names, together: what a blocked wait holds (for up to
  // kMaxTimeout) outside max_bytes.
  static constexpr size_t kMaxWaitKeyBytes = 256 << 10;
  static constexpr int64_t kMaxWaitReplyBytes = kMaxValueBytes;
  // What the store counts for each key or barrier besides its bytes: the
  // map's node, the strings' headers.
  static constexpr int64_t kEntryOverheadBytes = 128;
  static constexpr size_t kMaxEndedScopes = 65536;

  explicit RendezvousStore(RendezvousStoreLimits limits = {}) : limits_(limits) {}

  absl::Status Set(absl::string_view scope, absl::string_view key, std::string value);
  // NOT_FOUND if unset; as Set for a scope that is not open (CANCELLED once
  // its generation was cancelled or ended).
  absl::StatusOr<std::string> Get(absl::string_view scope, absl::string_view key);
  // Wait and Barrier look at `gone` (a gRPC caller that went away: its
  // call was cancelled) every kGoneSlice while they block, and return
  // CANCELLED once it says so, giving their thread and waiter slot back.
  static constexpr absl::Duration kGoneSlice = absl::Milliseconds(200);
  // The values of `keys` once all are set. DEADLINE_EXCEEDED after `timeout`
  // naming the missing keys; CANCELLED after Close(). INVALID_ARGUMENT for
  // no keys, more than kMaxWaitKeys or a key named twice;
  // INVALID_ARGUMENT too for keys of more than kMaxWaitKeyBytes together;
  // RESOURCE_EXHAUSTED when the values total over kMaxWaitReplyBytes.
  absl::StatusOr<std::vector<std::string>> Wait(absl::string_view scope,
                                                const std::vector<std::string>& keys,
                                                absl::Duration timeout,
                                                const std::function<bool()>& gone = {});
  // Returns once `world_size` distinct ranks entered barrier `name` of
  // `scope`. A barrier name is single-use: once released, later arrivals
  // return at once. INVALID_ARGUMENT for a rank outside [0, world_size), a
  // world_size outside [1, kMaxWorldSize] or one that differs from the first
  // caller's.
  absl::Status Barrier(absl::string_view scope, absl::string_view name, int rank, int world_size,
                       absl::Duration timeout, const std::function<bool()>& gone = {});
  // `scope` (a job generation that was placed) takes sets, waits and
  // barriers until DeleteScope: what placed_scopes_only asks for.
  void OpenScope(absl::string_view scope);
  // Drops every key and barrier of `scope` (a job generation that ended)
  // and closes it: later sets, waits and barriers in it fail CANCELLED, so
  // that a rank that outlived its generation (its worker was lost but still
  // runs) cannot fill it again. The newest kMaxEndedScopes closed scopes are
  // remembered; an older one is forgotten (open again, unless
  // placed_scopes_only).
  void DeleteScope(absl::string_view scope);
  // The generation of `scope` was aborted: its waiters wake with CANCELLED
  // (so a rank blocked in its rendezvous is free at once, not at its
  // timeout), and later sets, waits and barriers in it fail CANCELLED, until
  // DeleteScope (which keeps it closed).
  void CancelScope(absl::string_view scope);
  // Wakes every waiter with CANCELLED; later waits fail at once.
  void Close();

  // Calls blocked in Wait or Barrier now, and the bytes held (for tests and
  // metrics).
  int waiters() const;
  int64_t bytes() const;

 private:
  struct BarrierState {
    int world_size = 0;
    std::set<int> arrived;
    bool released = false;
    // Callers blocked in this barrier; DeleteScope keeps a barrier until it
    // is 0, waking them, and the last one out removes it.
    int waiters = 0;
    bool deleted = false;
  };
  static absl::Status ValidateScopeKey(absl::string_view scope, absl::string_view key);
  // Waits for `cond` up to `timeout`, looking at `gone` every kGoneSlice.
  enum class Awaited { kMet, kTimedOut, kGone };
  Awaited AwaitLocked(const absl::Condition& cond, absl::Duration timeout, const std::function<bool()>& gone)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status ValidateTimeout(absl::Duration timeout);
  // CANCELLED once closed or once `scope` was cancelled or deleted;
  // FAILED_PRECONDITION for one never opened where placed_scopes_only.
  absl::Status OpenLocked(absl::string_view scope) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE when no more callers may block.
  absl::Status WaiterSlotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE when `more` bytes would pass max_bytes.
  absl::Status RoomLocked(int64_t more) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a barrier entry holds besides its arrivals, and each arrival.
  static int64_t BarrierBytes(const std::pair<std::string, std::string>& key, const BarrierState& b);

  const RendezvousStoreLimits limits_;
  mutable absl::Mutex mu_;
  // (scope, key) -> value.
  std::map<std::pair<std::string, std::string>, std::string> kv_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, BarrierState> barriers_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> cancelled_ ABSL_GUARDED_BY(mu_);  // scopes
  std::set<std::string> opened_ ABSL_GUARDED_BY(mu_);     // OpenScope's, until DeleteScope
  // Scopes DeleteScope closed, and the order they were closed in (the
  // oldest is forgotten past kMaxEndedScopes).
  std::set<std::string> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
  int waiters_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of kv_ and barriers_ (BarrierBytes)
};

}  // namespace colod

#endif  // COLOD_COMMON_RENDEZVOUS_STORE_H_
