#include "worker/comm/flight_recorder.h"

#include <algorithm>

#include "common/proto_time.h"
#include "nlohmann/json.hpp"

namespace colod {

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}

const char* FlightRecorder::StateName(State s) {
  switch (s) {
    case State::kPending:
      return "pending";
    case State::kCompleted:
      return "completed";
    case State::kFailed:
      return "failed";
    case State::kAbandoned:
      return "abandoned";
  }
  return "unknown";
}

int64_t FlightRecorder::Enqueue(const std::string& group, const std::string& op, int64_t bytes) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  Group& g = groups_[group];
  const int64_t seq = ++g.entered;
  // The previous collective of the group still pending: this one starts
  // after it (at an unknown time, reported as its enqueue until then).
  g.pending.emplace(seq, std::make_pair(op, now));
  Entry e;
  e.group = group;
  e.sequence = seq;
  e.op = op;
  e.bytes = bytes;
  e.enqueued = now;
  // Unknown while an earlier one of the group is pending (End fills it in).
  e.started = g.pending.size() == 1 ? std::max(now, g.last_end) : absl::InfinitePast();
  entries_.push_back(std::move(e));
  while (entries_.size() > capacity_) entries_.pop_front();
  return seq;
}

void FlightRecorder::End(const std::string& group, int64_t sequence, bool ok) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto g = groups_.find(group);
  if (g == groups_.end() || g->second.pending.erase(sequence) == 0) return;
  g->second.last_end = std::max(g->second.last_end, now);
  const int64_t next = g->second.pending.empty() ? 0 : g->second.pending.begin()->first;
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    if (it->group != group) continue;
    if (it->sequence == next && it->started == absl::InfinitePast()) it->started = now;  // its turn now
    if (it->sequence == sequence) {
      it->ended = now;
      it->state = ok ? State::kCompleted : State::kFailed;
    }
    if (it->sequence <= sequence) break;
  }
}

void FlightRecorder::CloseGroup(const std::string& group) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto g = groups_.find(group);
  if (g == groups_.end() || g->second.pending.empty()) return;
  for (Entry& e : entries_) {
    if (e.group != group || e.state != State::kPending) continue;
    e.state = State::kAbandoned;
    e.ended = now;
  }
  g->second.pending.clear();
}

std::vector<FlightRecorder::Entry> FlightRecorder::Entries() const {
  absl::MutexLock lock(&mu_);
  return std::vector<Entry>(entries_.begin(), entries_.end());
}

std::vector<v1::CollectiveProgress> FlightRecorder::Progress(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::CollectiveProgress> out;
  for (const auto& [name, g] : groups_) {
    v1::CollectiveProgress& p = out.emplace_back();
    p.set_group(name);
    p.set_entered(g.entered);
    if (g.pending.empty()) continue;
    const auto& [seq, pending] = *g.pending.begin();
    p.set_pending_sequence(seq);
    p.set_pending_op(pending.first);
    *p.mutable_pending_for() = ToProtoDuration(now - pending.second);
  }
  return out;
}

std::string FlightRecorder::ToJson() const {
  nlohmann::json all = nlohmann::json::array();
  for (const Entry& e : Entries()) {
    nlohmann::json j;
    j["group"] = e.group;
    j["sequence"] = e.sequence;
    j["op"] = e.op;
    j["bytes"] = e.bytes;
    j["enqueued"] = absl::FormatTime(e.enqueued, absl::UTCTimeZone());
    if (e.started != absl::InfinitePast()) j["started"] = absl::FormatTime(e.started, absl::UTCTimeZone());
    if (e.state != State::kPending) j["ended"] = absl::FormatTime(e.ended, absl::UTCTimeZone());
    j["state"] = StateName(e.state);
    all.push_back(std::move(j));
  }
  return all.dump(1);
}

}  // namespace colod
