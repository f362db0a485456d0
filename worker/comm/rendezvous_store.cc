#include "worker/comm/rendezvous_store.h"

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

absl::Status RendezvousStore::Set(absl::string_view scope, absl::string_view key, std::string value) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, key));
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes is over the limit of ", kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));
  kv_[{std::string(scope), std::string(key)}] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousStore::Get(absl::string_view scope, absl::string_view key) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, key));
  absl::MutexLock lock(&mu_);
  auto it = kv_.find({std::string(scope), std::string(key)});
  if (it == kv_.end()) {
    return absl::NotFoundError(absl::StrCat("key '", key, "' is not set in scope '", scope, "'"));
  }
  return it->second;
}

absl::StatusOr<std::vector<std::string>> RendezvousStore::Wait(absl::string_view scope,
                                                               const std::vector<std::string>& keys,
                                                               absl::Duration timeout) {
  if (keys.empty()) return absl::InvalidArgumentError("keys: at least one key is required");
  for (const std::string& k : keys) RETURN_IF_ERROR(ValidateScopeKey(scope, k));
  RETURN_IF_ERROR(ValidateTimeout(timeout));
  const std::string s(scope);
  auto all_set = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_ || cancelled_.count(s)) return true;
    for (const std::string& k : keys) {
      if (kv_.find({s, k}) == kv_.end()) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&all_set), timeout);
  RETURN_IF_ERROR(OpenLocked(scope));
  std::vector<std::string> values;
  std::vector<std::string> missing;
  for (const std::string& k : keys) {
    auto it = kv_.find({s, k});
    if (it == kv_.end()) {
      missing.push_back(k);
    } else {
      values.push_back(it->second);
    }
  }
  if (!missing.empty()) {
    return absl::DeadlineExceededError(absl::StrCat("after ", absl::FormatDuration(timeout),
                                                    " still missing in scope '", scope,
                                                    "': ", absl::StrJoin(missing, ", ")));
  }
  return values;
}

absl::Status RendezvousStore::Barrier(absl::string_view scope, absl::string_view name, int rank,
                                      int world_size, absl::Duration timeout) {
  RETURN_IF_ERROR(ValidateScopeKey(scope, name));
  if (world_size < 1) return absl::InvalidArgumentError("world_size: must be >= 1");
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is outside [0, ", world_size, ")"));
  }
  RETURN_IF_ERROR(ValidateTimeout(timeout));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(OpenLocked(scope));
  BarrierState& b = barriers_[{std::string(scope), std::string(name)}];
  if (b.world_size == 0) b.world_size = world_size;
  if (b.world_size != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: ", world_size,
                                                   " differs from the barrier's ", b.world_size));
  }
  if (b.released) return absl::OkStatus();
  b.arrived.insert(rank);
  if (static_cast<int>(b.arrived.size()) == b.world_size) b.released = true;
  const std::string s(scope);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return b.released || closed_ || cancelled_.count(s) > 0; };
  ++b.waiters;
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  --b.waiters;
  if (b.released) return absl::OkStatus();
  RETURN_IF_ERROR(OpenLocked(scope));
  std::vector<int> missing;
  for (int r = 0; r < b.world_size; ++r) {
    if (!b.arrived.count(r)) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat("barrier '", name, "' in scope '", scope,
                                                  "': after ", absl::FormatDuration(timeout),
                                                  " ranks still missing: ",
                                                  absl::StrJoin(missing, ", ")));
}

absl::Status RendezvousStore::OpenLocked(absl::string_view scope) const {
  if (closed_) return absl::CancelledError("rendezvous store is shutting down");
  if (cancelled_.count(std::string(scope))) {
    return absl::CancelledError(absl::StrCat("scope '", scope, "' was aborted (the job generation stopped)"));
  }
  return absl::OkStatus();
}

void RendezvousStore::CancelScope(absl::string_view scope) {
  absl::MutexLock lock(&mu_);
  cancelled_.insert(std::string(scope));
}

void RendezvousStore::DeleteScope(absl::string_view scope) {
  absl::MutexLock lock(&mu_);
  const std::string s(scope);
  cancelled_.erase(s);
  for (auto it = kv_.lower_bound({s, ""}); it != kv_.end() && it->first.first == s;) {
    it = kv_.erase(it);
  }
  for (auto it = barriers_.lower_bound({s, ""}); it != barriers_.end() && it->first.first == s;) {
    // A barrier with blocked callers stays until they time out.
    it = it->second.waiters == 0 ? barriers_.erase(it) : std::next(it);
  }
}

void RendezvousStore::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace colod
