#include "server/hang_detector.h"

#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/proto_time.h"

namespace colod {
namespace {

// The ranks a group's name lists after its axis ("tp/0_1" -> {0, 1}); empty
// if it lists none.
std::set<int> Members(const std::string& group) {
  std::set<int> out;
  const size_t slash = group.rfind('/');
  if (slash == std::string::npos) return out;
  for (absl::string_view part : absl::StrSplit(absl::string_view(group).substr(slash + 1), '_')) {
    int r = 0;
    if (!absl::SimpleAtoi(part, &r)) return {};
    out.insert(r);
  }
  return out;
}

}  // namespace

std::vector<v1::HangReport> FindHangs(const std::vector<RankReport>& ranks, absl::Duration threshold) {
  // group -> rank -> its progress there.
  std::map<std::string, std::map<int, const v1::CollectiveProgress*>> groups;
  std::map<int, const RankReport*> by_rank;
  for (const RankReport& r : ranks) {
    by_rank[r.rank] = &r;
    for (const v1::CollectiveProgress& p : r.collectives) groups[p.group()][r.rank] = &p;
  }
  // Ranks waiting past the threshold somewhere: "group #seq" of their
  // longest wait. A missing rank that itself waits elsewhere is a victim of
  // the hang, not its cause, and the message says so.
  std::map<int, std::pair<absl::Duration, std::string>> waits;
  for (const auto& [group, progress] : groups) {
    for (const auto& [rank, p] : progress) {
      if (p->pending_sequence() == 0) continue;
      const absl::Duration pending = FromProtoDuration(p->pending_for());
      if (pending < threshold) continue;
      auto& w = waits[rank];
      if (w.second.empty() || pending > w.first) w = {pending, absl::StrCat(group, " #", p->pending_sequence())};
    }
  }
  std::vector<v1::HangReport> out;
  for (const auto& [group, progress] : groups) {
    const v1::CollectiveProgress* longest = nullptr;
    absl::Duration longest_for = absl::ZeroDuration();
    std::vector<int> waiting;
    for (const auto& [rank, p] : progress) {
      if (p->pending_sequence() == 0) continue;
      const absl::Duration pending = FromProtoDuration(p->pending_for());
      if (pending < threshold) continue;
      waiting.push_back(rank);
      if (longest == nullptr || pending > longest_for) {
        longest = p;
        longest_for = pending;
      }
    }
    if (longest == nullptr) continue;
    const int64_t seq = longest->pending_sequence();
    std::set<int> members = Members(group);
    if (members.empty()) {
      for (const auto& [rank, p] : progress) members.insert(rank);
    }
    v1::HangReport h;
    h.set_group(group);
    h.set_sequence(seq);
    h.set_op(longest->pending_op());
    for (int r : waiting) h.add_waiting_ranks(r);
    *h.mutable_pending_for() = ToProtoDuration(longest_for);
    std::vector<std::string> missing, silent;
    for (int m : members) {
      auto p = progress.find(m);
      const int64_t entered = p == progress.end() ? 0 : p->second->entered();
      auto known = by_rank.find(m);
      const std::string name = known != by_rank.end() ? known->second->name : absl::StrCat("rank ", m);
      if (entered < seq) {
        h.add_missing_ranks(m);
        auto w = waits.find(m);
        missing.push_back(absl::StrCat(name, " (entered #", entered,
                                       w == waits.end() ? "" : absl::StrCat("; itself waiting in ", w->second.second),
                                       ")"));
      }
      const absl::Duration quiet = known != by_rank.end() ? known->second->silent_for : absl::InfiniteDuration();
      if (quiet >= threshold) {
        h.add_silent_ranks(m);
        silent.push_back(quiet == absl::InfiniteDuration()
                             ? absl::StrCat(name, " has not reported")
                             : absl::StrCat(name, " has not reported for ", absl::FormatDuration(absl::Trunc(quiet, absl::Milliseconds(100)))));
      }
    }
    std::string msg = absl::StrCat("collective #", seq, " (", h.op(), ") of group ", group, " pending for ",
                                   absl::FormatDuration(absl::Trunc(longest_for, absl::Milliseconds(100))),
                                   " on ranks ", absl::StrJoin(waiting, ", "));
    if (!missing.empty()) {
      absl::StrAppend(&msg, "; not entered by ", absl::StrJoin(missing, ", "));
    } else {
      absl::StrAppend(&msg, "; every rank of the group entered it");
    }
    if (!silent.empty()) absl::StrAppend(&msg, "; ", absl::StrJoin(silent, "; "));
    h.set_message(std::move(msg));
    out.push_back(std::move(h));
  }
  return out;
}

}  // namespace colod
