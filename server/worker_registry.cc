#include "server/worker_registry.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/auth.h"
#include "common/limits.h"
#include "common/net.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "common/text.h"

namespace colod {

namespace {

// What a heartbeat's status may hold, whatever the worker sends: every
// worker's status is listed in one ListWorkers reply (4 MiB), and a 3 MiB
// last_error from one broke it for everyone. A rank has a few groups (its
// mesh axes and sub-meshes); their names are a few bytes.
constexpr int kMaxCollectiveGroups = 64;

v1::WorkerStatus Bounded(const v1::WorkerStatus& status) {
  v1::WorkerStatus out = status;
  if (out.last_error().size() > kMaxReportedMessageBytes) {
    out.set_last_error(Utf8Prefix(out.last_error(), kMaxReportedMessageBytes));
  }
  if (out.job_id().size() > kMaxWorkerText) out.set_job_id(Utf8Prefix(out.job_id(), kMaxWorkerText));
  if (out.ended_job_id().size() > kMaxWorkerText) out.set_ended_job_id(Utf8Prefix(out.ended_job_id(), kMaxWorkerText));
  if (out.collectives_size() > kMaxCollectiveGroups) {
    out.mutable_collectives()->DeleteSubrange(kMaxCollectiveGroups, out.collectives_size() - kMaxCollectiveGroups);
  }
  for (v1::CollectiveProgress& c : *out.mutable_collectives()) {
    if (c.group().size() > kMaxWorkerText) c.set_group(Utf8Prefix(c.group(), kMaxWorkerText));
    if (c.pending_op().size() > kMaxWorkerText) c.set_pending_op(Utf8Prefix(c.pending_op(), kMaxWorkerText));
  }
  return out;
}

// HOST:PORT whose host is a name (letters, digits, '.', '-', '_'), an IPv4
// literal or a bracketed IPv6 one: the coordinator dials it, and compares
// it as text (a host with '%', '/', '?', '@' or '#' would reach a place
// other than it reads as, or one address under two spellings).
absl::Status CheckWorkerAddress(const std::string& address, const char* field) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address, field, /*allow_zero_port=*/false));
  const bool v6 = absl::StartsWith(address, "[");
  for (char c : hp.host) {
    const unsigned char u = static_cast<unsigned char>(c);
    const bool ok = v6 ? absl::ascii_isxdigit(u) || c == ':' || c == '.'
                       : absl::ascii_isalnum(u) || c == '.' || c == '-' || c == '_';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": '", Utf8Prefix(address, 300), "': a host is a name (letters, digits, '.', '-', '_'), an IPv4 "
          "address or a bracketed IPv6 one"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

WorkerRegistry::WorkerRegistry(Options options) : options_(options) {}

absl::Status WorkerRegistry::Validate(const v1::WorkerInfo& info, const std::string& key) {
  RETURN_IF_ERROR(CheckWorkerKey(key));
  if (!info.worker_id().empty()) {
    return absl::InvalidArgumentError(
        "worker.worker_id: must be empty; the coordinator assigns worker ids");
  }
  // What the registry keeps of a worker is bounded, so that every
  // ListWorkers answer, heartbeat and placement stays small however many
  // workers register (a host name is at most 253 bytes).
  const std::pair<const char*, const std::string*> texts[] = {
      {"address", &info.address()}, {"metrics_address", &info.metrics_address()},
      {"host", &info.host()},       {"device_name", &info.device_name()},
      {"version", &info.version()}, {"peak.source", &info.peak().source()}};
  for (const auto& [name, text] : texts) {
    if (text->size() > kMaxWorkerText) {
      return absl::InvalidArgumentError(absl::StrCat("worker.", name, ": ", text->size(), " bytes, more than ",
                                                     kMaxWorkerText));
    }
  }
  RETURN_IF_ERROR(CheckWorkerAddress(info.address(), "worker.address"));
  if (!info.metrics_address().empty()) {
    RETURN_IF_ERROR(CheckWorkerAddress(info.metrics_address(), "worker.metrics_address"));
  }
  if (info.device_ordinal() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker.device_ordinal: must be >= 0, got ", info.device_ordinal()));
  }
  if (info.memory_bytes() < 0) {
    return absl::InvalidArgumentError("worker.memory_bytes: must be >= 0");
  }
  if (info.labels_size() > kMaxLabels) {
    return absl::InvalidArgumentError(absl::StrCat("worker.labels: ", info.labels_size(), " labels, more than ",
                                                   kMaxLabels));
  }
  for (const auto& [key, value] : info.labels()) {
    if (key.empty() || key.size() > kMaxLabelKeyBytes || value.size() > kMaxLabelValueBytes) {
      return absl::InvalidArgumentError(absl::StrCat("worker.labels: keys take 1 to ", kMaxLabelKeyBytes,
                                                     " bytes and values at most ", kMaxLabelValueBytes, "; '",
                                                     key.substr(0, 64), "' does not fit"));
    }
  }
  // A device's peak, 0 (unknown) or up to 1e18 FLOP/s (a thousand times
  // the largest GPU's): what a job's MFU divides by.
  const std::pair<const char*, double> peaks[] = {{"f32", info.peak().f32()},
                                                  {"tf32", info.peak().tf32()},
                                                  {"bf16", info.peak().bf16()},
                                                  {"f16", info.peak().f16()}};
  for (const auto& [name, flops] : peaks) {
    if (!(flops == 0 || (flops >= 1e6 && flops <= 1e18))) {
      return absl::InvalidArgumentError(absl::StrCat("worker.peak.", name,
                                                     ": must be 0 (unknown) or in [1e6, 1e18] FLOP/s, got ", flops));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<WorkerRegistry::Registration> WorkerRegistry::Register(const v1::WorkerInfo& info,
                                                                     const v1::WorkerStatus& status,
                                                                     const std::string& key, AtAddress at) {
  RETURN_IF_ERROR(Validate(info, key));
  if (at == AtAddress::kProven && key.empty()) {
    return absl::InvalidArgumentError("worker_key: a registration proven at its address has a key");
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock->Now();
  SweepLocked(now);
  if (at == AtAddress::kClaimed) RETURN_IF_ERROR(CheckAddressLocked(info.address(), key, now));
  std::string replaced;
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second.info.address() == info.address()) {
      if (!it->second.lost && it->second.key != key) replaced = it->first;
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  if (workers_.size() >= static_cast<size_t>(options_.max_workers)) {
    // Room is made by forgetting the worker lost longest, as the sweep
    // would later; live ones are never dropped.
    auto oldest = workers_.end();
    for (auto it = workers_.begin(); it != workers_.end(); ++it) {
      if (it->second.lost && (oldest == workers_.end() || it->second.last_heartbeat < oldest->second.last_heartbeat)) {
        oldest = it;
      }
    }
    if (oldest == workers_.end()) {
      return absl::ResourceExhaustedError(absl::StrCat(workers_.size(), " workers are registered, none of them lost: "
                                                       "the coordinator's --max-workers (", options_.max_workers,
                                                       ")"));
    }
    workers_.erase(oldest);
  }
  Entry e;
  e.info = info;
  e.info.set_worker_id(absl::StrFormat("%s%06d", options_.id_prefix, next_id_++));
  if (e.info.host().empty()) {
    e.info.set_host(ParseHostPort(info.address(), "", false)->host);
  }
  e.status = Bounded(status);
  if (e.status.state() == v1::WORKER_STATE_UNSPECIFIED) e.status.set_state(v1::WORKER_STATE_IDLE);
  e.register_time = now;
  e.last_heartbeat = now;
  e.key = key;
  Registration out{e.info.worker_id(), options_.heartbeat_interval, options_.lease_duration, std::move(replaced)};
  workers_.emplace(e.info.worker_id(), std::move(e));
  return out;
}

absl::Status WorkerRegistry::CheckAddress(absl::string_view address, absl::string_view key) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock->Now();
  SweepLocked(now);
  return CheckAddressLocked(address, key, now);
}

absl::Status WorkerRegistry::CheckAddressLocked(absl::string_view address, absl::string_view key, absl::Time now) {
  for (const auto& [id, e] : workers_) {
    if (e.info.address() != address || e.lost || e.key.empty() || e.key == key) continue;
    const absl::Duration left = std::max(e.last_heartbeat + options_.lease_duration - now, absl::ZeroDuration());
    return absl::AlreadyExistsError(absl::StrCat(
        id, " is registered at ", address, " with another key and is live (its lease runs another ",
        absl::FormatDuration(absl::Ceil(left, absl::Seconds(1))),
        ", or until it deregisters): a worker restarted at this address registers once that lease ends"));
  }
  return absl::OkStatus();
}

std::optional<std::string> WorkerRegistry::RegisteredKey(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(std::string(worker_id));
  if (it == workers_.end()) return std::nullopt;
  return it->second.key;
}

std::string WorkerRegistry::KeyOf(absl::string_view worker_id) { return RegisteredKey(worker_id).value_or(""); }

std::string WorkerRegistry::KeyToCall(absl::string_view worker_id) {
  std::optional<std::string> key = RegisteredKey(worker_id);
  return key.has_value() ? *std::move(key) : NewWorkerKey();
}

absl::StatusOr<absl::Time> WorkerRegistry::Heartbeat(absl::string_view worker_id,
                                                     const v1::WorkerStatus& status) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock->Now();
  SweepLocked(now);
  auto it = workers_.find(std::string(worker_id));
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker '", worker_id, "': register again"));
  }
  if (it->second.lost) {
    workers_.erase(it);
    return absl::NotFoundError(absl::StrCat("worker '", worker_id,
                                            "' lost its lease: register again"));
  }
  it->second.last_heartbeat = now;
  it->second.status = Bounded(status);
  if (it->second.status.state() == v1::WORKER_STATE_UNSPECIFIED ||
      it->second.status.state() == v1::WORKER_STATE_LOST) {
    it->second.status.set_state(v1::WORKER_STATE_IDLE);
  }
  return now + options_.lease_duration;
}

absl::Status WorkerRegistry::Deregister(absl::string_view worker_id, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock->Now());
  auto it = workers_.find(std::string(worker_id));
  if (it == workers_.end()) return absl::NotFoundError(absl::StrCat("unknown worker '", worker_id, "'"));
  if (!it->second.lost) {
    it->second.lost = true;
    it->second.left = true;
    it->second.lost_reason = absl::StrCat(kLeftPrefix, reason.empty() ? "deregistered" : reason);
  }
  return absl::OkStatus();
}

std::string WorkerRegistry::LostReason(absl::string_view worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(std::string(worker_id));
  if (it == workers_.end()) return "no longer registered";
  return it->second.lost ? it->second.lost_reason : "not lost";
}

std::vector<v1::Worker> WorkerRegistry::List(bool include_lost) {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock->Now());
  std::vector<v1::Worker> out;
  for (const auto& [id, e] : workers_) {
    if (e.lost && !include_lost) continue;
    out.push_back(ToProto(e));
  }
  return out;
}

WorkerRegistry::Page WorkerRegistry::ListPage(bool include_lost, absl::string_view after, int limit,
                                              size_t max_bytes) {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock->Now());
  Page page;
  size_t bytes = 0;
  for (auto it = workers_.upper_bound(std::string(after)); it != workers_.end(); ++it) {
    if (it->second.lost && !include_lost) continue;
    if (static_cast<int>(page.workers.size()) >= limit || bytes >= max_bytes) {
      page.more = true;
      break;
    }
    page.workers.push_back(ToProto(it->second));
    bytes += page.workers.back().ByteSizeLong();
  }
  return page;
}

std::vector<std::string> WorkerRegistry::Sweep() {
  absl::MutexLock lock(&mu_);
  return SweepLocked(options_.clock->Now());
}

std::vector<std::string> WorkerRegistry::SweepLocked(absl::Time now) {
  std::vector<std::string> newly_lost;
  for (auto it = workers_.begin(); it != workers_.end();) {
    Entry& e = it->second;
    const absl::Duration silent = now - e.last_heartbeat;
    if (e.lost && silent > options_.lease_duration + options_.forget_after) {
      it = workers_.erase(it);
      continue;
    }
    if (!e.lost && silent > options_.lease_duration) {
      e.lost = true;
      e.lost_reason = absl::StrCat("no heartbeat within ", absl::FormatDuration(options_.lease_duration));
      newly_lost.push_back(it->first);
    }
    ++it;
  }
  return newly_lost;
}

std::map<std::string, int> WorkerRegistry::CountByState() {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock->Now());
  std::map<std::string, int> counts = {{"idle", 0}, {"busy", 0}, {"lost", 0}, {"left", 0}};
  for (const auto& [id, e] : workers_) {
    if (e.left) {
      ++counts["left"];
    } else if (e.lost) {
      ++counts["lost"];
    } else if (e.status.state() == v1::WORKER_STATE_BUSY) {
      ++counts["busy"];
    } else {
      ++counts["idle"];
    }
  }
  return counts;
}

v1::Worker WorkerRegistry::ToProto(const Entry& e) const {
  v1::Worker w;
  *w.mutable_info() = e.info;
  *w.mutable_status() = e.status;
  w.set_state(e.lost ? v1::WORKER_STATE_LOST : e.status.state());
  if (e.lost) {
    w.mutable_status()->set_state(v1::WORKER_STATE_LOST);
    w.set_lost_reason(e.lost_reason);
  }
  *w.mutable_register_time() = ToProtoTimestamp(e.register_time);
  *w.mutable_last_heartbeat_time() = ToProtoTimestamp(e.last_heartbeat);
  return w;
}

}  // namespace colod
