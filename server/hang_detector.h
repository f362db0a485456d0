// Hang blame: from the ranks' flight-recorder progress (their workers'
// heartbeats), the collectives that ranks wait in for longer than a
// threshold, and the ranks of the group that have not entered them.
#ifndef COLOD_SERVER_HANG_DETECTOR_H_
#define COLOD_SERVER_HANG_DETECTOR_H_

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/worker.pb.h"

namespace colod {

// What the coordinator last heard of one rank of a running job.
struct RankReport {
  int rank = 0;
  std::string name;  // "rank 2 (worker w2 at host:port)"
  // Since its worker's last heartbeat (infinite if its worker is not listed
  // or reports another job).
  absl::Duration silent_for = absl::InfiniteDuration();
  std::vector<v1::CollectiveProgress> collectives;
};

// One report per group in which some rank has waited at least `threshold`
// in its oldest pending collective: the collective (the longest waiter's),
// the ranks waiting in it, the group's ranks that have not entered it (by
// their last report; a group's members are the ranks its name lists,
// "tp/0_1"), and the ranks not heard from for `threshold`. Pure function.
std::vector<v1::HangReport> FindHangs(const std::vector<RankReport>& ranks, absl::Duration threshold);

}  // namespace colod

#endif  // COLOD_SERVER_HANG_DETECTOR_H_
