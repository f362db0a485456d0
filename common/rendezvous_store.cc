#include "common/rendezvous_store.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace colod {

absl::Status RendezvousStore::ValidateScopeKey(absl::string_view scope, absl::string_view key) {
  if (scope.empty()) return absl::InvalidArgumentError("scope: must not be empty");
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (scope.size() > kMaxKeyBytes || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("scope/key: longer than ", kMaxKeyBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status RendezvousStore::ValidateTimeout(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration() || timeout > kMaxTimeout) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout: must be in (0, ", absl::FormatDuration(kMaxTimeout), "]"));
  }
  return absl::OkStatus();
}

namespace {

// The bookkeeping of a barrier entry besides kEntryOverheadBytes, and of
// each rank that arrived.
constexpr int64_t kBarrierOverheadBytes = 128;
constexpr int64_t kArrivalBytes = 48;
// Ranks a timed-out barrier names, at most.
constexpr int kMissingShown = 32;

int64_t EntryBytes(absl::string_view scope, absl::string_view key, size_t value) {
  return RendezvousStore::kEntryOverheadBytes + static_cast<int64_t>(scope.size() + key.size() + value);
}

}  // namespace

int64_t RendezvousStore::BarrierBytes(const std::pair<std::string, std::string>& key, const BarrierState& b) {
  return EntryBytes(key.first, key.second, 0) + kBarrierOverheadBytes +
         kArrivalBytes * static_cast<int64_t>(b.arrived.size());
}

absl::Status RendezvousStore::WaiterSlotLocked() const {
  if (waiters_ < limits_.max_waiters) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the rendezvous store already has ", waiters_,
                                             " callers waiting, its limit (the coordinator's ",
                                             "--max-store-waits); try again later"));
}

absl::Status RendezvousStore::RoomLocked(int64_t more) const {
  if (more <= 0 || bytes_ + more <= limits_.max_bytes) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the rendezvous store holds ", bytes_, " bytes; ", more,
                                             " more would pass its limit of ", limits_.max_bytes,
                                             " (the coordinator's --store-quota); try again later"));
}

int RendezvousStore::waiters() const {
  absl::MutexLock lock(&mu_);
  return waiters_;
}

int64_t RendezvousStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::Status RendezvousStore::Set(absl::string_view scope, absl::string_view key, std::string value) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, key));
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes is over the limit of ", kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));
  std::pair<std::string, std::string> k{std::string(scope), std::string(key)};
  auto it = kv_.find(k);
  const int64_t before = it == kv_.end() ? 0 : EntryBytes(scope, key, it->second.size());
  const int64_t after = EntryBytes(scope, key, value.size());
  RETURN_IF_ERROR(RoomLocked(after - before));
  bytes_ += after - before;
  if (it == kv_.end()) {
    kv_.emplace(std::move(k), std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousStore::Get(absl::string_view scope, absl::string_view key) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, key));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));  // a generation that ended is read no more
  auto it = kv_.find({std::string(scope), std::string(key)});
  if (it == kv_.end()) {
    return absl::NotFoundError(absl::StrCat("key '", key, "' is not set in scope '", scope, "'"));
  }
  return it->second;
}

RendezvousStore::Awaited RendezvousStore::AwaitLocked(const absl::Condition& cond, absl::Duration timeout,
                                                      const std::function<bool()>& gone) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return cond.Eval() ? Awaited::kMet : Awaited::kTimedOut;
    if (mu_.AwaitWithTimeout(cond, gone ? std::min(left, kGoneSlice) : left)) return Awaited::kMet;
    if (gone && gone()) return Awaited::kGone;
  }
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Wait(absl::string_view scope,
                                                               const std::vector<std::string>& keys,
                                                               absl::Duration timeout,
                                                               const std::function<bool()>& gone) {
  if (keys.empty()) return absl::InvalidArgumentError("keys: at least one key is required");
  if (keys.size() > kMaxWaitKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: ", keys.size(), " is over the limit of ", kMaxWaitKeys, " in one wait"));
  }
  // What a blocked wait holds, outside the store's quota, is bounded too.
  size_t key_bytes = 0;
  for (const std::string& k : keys) key_bytes += k.size();
  if (key_bytes > kMaxWaitKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("keys: ", key_bytes, " bytes of keys is over the limit of ", kMaxWaitKeyBytes, " in one wait"));
  }
  for (const std::string& k : keys) RETURN_IF_ERROR(ValidateScopeKey(scope, k));
  {
    std::set<absl::string_view> seen;
    for (const std::string& k : keys) {
      if (!seen.insert(k).second) return absl::InvalidArgumentError(absl::StrCat("keys: '", k, "' is named twice"));
    }
  }
  RETURN_IF_ERROR(ValidateTimeout(timeout));
  const std::string s(scope);
  // Evaluated each time the store's mutex is released, for every waiter:
  // the keys before `next` are set (a key is never unset but by its scope's
  // end, which ends the wait), so each evaluation looks up one key, not all.
  size_t next = 0;
  std::pair<std::string, std::string> probe{s, ""};
  auto all_set = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_ || cancelled_.count(s) || ended_.count(s)) return true;
    for (; next < keys.size(); ++next) {
      probe.second = keys[next];
      if (kv_.find(probe) == kv_.end()) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));  // (and again below, for a scope that closed while waited on)
  if (!all_set()) {
    RETURN_IF_ERROR(WaiterSlotLocked());
    ++waiters_;
    const Awaited awaited = AwaitLocked(absl::Condition(&all_set), timeout, gone);
    --waiters_;
    if (awaited == Awaited::kGone) {
      return absl::CancelledError(absl::StrCat("the wait in scope '", scope, "' was given up: its caller went away"));
    }
  }
  RETURN_IF_ERROR(OpenLocked(scope));
  std::vector<const std::string*> found;
  std::vector<absl::string_view> missing;
  int64_t reply_bytes = 0;
  for (const std::string& k : keys) {
    auto it = kv_.find({s, k});
    if (it == kv_.end()) {
      missing.push_back(k);
    } else {
      found.push_back(&it->second);
      reply_bytes += static_cast<int64_t>(it->second.size());
    }
  }
  if (!missing.empty()) {
    constexpr size_t kMissingKeysShown = 32;
    const size_t more = missing.size() > kMissingKeysShown ? missing.size() - kMissingKeysShown : 0;
    missing.resize(missing.size() - more);
    return absl::DeadlineExceededError(absl::StrCat(
        "after ", absl::FormatDuration(timeout), " still missing in scope '", scope, "': ",
        absl::StrJoin(missing, ", "), more > 0 ? absl::StrCat(" and ", more, " more") : ""));
  }
  if (reply_bytes > kMaxWaitReplyBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the values of these ", keys.size(), " keys total ", reply_bytes,
                                                     " bytes, over the limit of ", kMaxWaitReplyBytes,
                                                     " in one reply; wait for fewer keys at once"));
  }
  std::vector<std::string> values;
  values.reserve(found.size());
  for (const std::string* v : found) values.push_back(*v);
  return values;
}

absl::Status RendezvousStore::Barrier(absl::string_view scope, absl::string_view name, int rank,
                                      int world_size, absl::Duration timeout, const std::function<bool()>& gone) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, name));
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: ", world_size, " is outside [1, ", kMaxWorldSize, "]"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", world_size, ")"));
  }
  RETURN_IF_ERROR(ValidateTimeout(timeout));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));
  std::pair<std::string, std::string> key{std::string(scope), std::string(name)};
  auto it = barriers_.find(key);
  if (it == barriers_.end()) {
    BarrierState fresh;
    fresh.world_size = world_size;
    const int64_t more = BarrierBytes(key, fresh);
    RETURN_IF_ERROR(RoomLocked(more));
    bytes_ += more;
    it = barriers_.emplace(std::move(key), std::move(fresh)).first;
  }
  BarrierState& b = it->second;
  if (b.world_size != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: ", world_size,
                                                   " differs from the barrier's ", b.world_size));
  }
  if (b.released) return absl::OkStatus();
  if (!b.arrived.count(rank)) {
    // A caller that would block is refused before it counts as arrived.
    if (static_cast<int>(b.arrived.size()) + 1 < b.world_size) RETURN_IF_ERROR(WaiterSlotLocked());
    RETURN_IF_ERROR(RoomLocked(kArrivalBytes));
    bytes_ += kArrivalBytes;
    b.arrived.insert(rank);
  } else if (static_cast<int>(b.arrived.size()) < b.world_size) {
    RETURN_IF_ERROR(WaiterSlotLocked());
  }
  if (static_cast<int>(b.arrived.size()) == b.world_size) b.released = true;
  const std::string s(scope);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return b.released || b.deleted || closed_ || cancelled_.count(s) > 0;
  };
  ++b.waiters;
  ++waiters_;
  const Awaited awaited = AwaitLocked(absl::Condition(&done), timeout, gone);
  --waiters_;
  --b.waiters;
  if (b.deleted) {
    if (b.waiters == 0) {
      bytes_ -= BarrierBytes(it->first, b);
      barriers_.erase(it);
    }
    return absl::CancelledError(absl::StrCat("scope '", scope, "' was deleted (the job generation ended)"));
  }
  if (b.released) return absl::OkStatus();
  RETURN_IF_ERROR(OpenLocked(scope));
  if (awaited == Awaited::kGone) {
    return absl::CancelledError(
        absl::StrCat("barrier '", name, "' in scope '", scope, "' was given up: its caller went away"));
  }
  std::vector<int> missing;
  int more = 0;
  for (int r = 0; r < b.world_size; ++r) {
    if (b.arrived.count(r)) continue;
    if (missing.size() < kMissingShown) {
      missing.push_back(r);
    } else {
      ++more;
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("barrier '", name, "' in scope '", scope,
                                                  "': after ", absl::FormatDuration(timeout),
                                                  " ranks still missing: ", absl::StrJoin(missing, ", "),
                                                  more > 0 ? absl::StrCat(" and ", more, " more") : ""));
}

absl::Status RendezvousStore::OpenLocked(absl::string_view scope) const {
  if (closed_) return absl::CancelledError("rendezvous store is shutting down");
  if (cancelled_.count(std::string(scope))) {
    return absl::CancelledError(absl::StrCat("scope '", scope, "' was aborted (the job generation stopped)"));
  }
  if (ended_.count(std::string(scope))) {
    return absl::CancelledError(absl::StrCat("scope '", scope, "' ended (its job generation is over)"));
  }
  if (limits_.placed_scopes_only && opened_.count(std::string(scope)) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("scope '", scope, "' is no placed job generation's (JOB/gen-N, from the job's AssignJob until "
                     "its generation ends): the store takes nothing for it"));
  }
  return absl::OkStatus();
}

void RendezvousStore::OpenScope(absl::string_view scope) {
  absl::MutexLock lock(&mu_);
  opened_.insert(std::string(scope));
}

void RendezvousStore::CancelScope(absl::string_view scope) {
  absl::MutexLock lock(&mu_);
  cancelled_.insert(std::string(scope));
}

void RendezvousStore::DeleteScope(absl::string_view scope) {
  absl::MutexLock lock(&mu_);
  const std::string s(scope);
  cancelled_.erase(s);
  opened_.erase(s);
  if (ended_.insert(s).second) {
    ended_order_.push_back(s);
    if (ended_order_.size() > kMaxEndedScopes) {
      ended_.erase(ended_order_.front());
      ended_order_.pop_front();
    }
  }
  for (auto it = kv_.lower_bound({s, ""}); it != kv_.end() && it->first.first == s;) {
    bytes_ -= EntryBytes(it->first.first, it->first.second, it->second.size());
    it = kv_.erase(it);
  }
  for (auto it = barriers_.lower_bound({s, ""}); it != barriers_.end() && it->first.first == s;) {
    // A barrier with blocked callers wakes them; the last one out removes it.
    if (it->second.waiters == 0) {
      bytes_ -= BarrierBytes(it->first, it->second);
      it = barriers_.erase(it);
    } else {
      it->second.deleted = true;
      it = std::next(it);
    }
  }
}

void RendezvousStore::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace colod
