// The directories a worker lets jobs read and write (`--allow-path`): a
// client names paths in its job spec (model weights, training data,
// checkpoints, the final model, FORWARD inputs and logits), and the worker
// opens them with its own permissions, so it opens only those under its
// roots. No roots (the default) allows every path, which the daemon logs.
#ifndef COLOD_WORKER_DAEMON_PATH_POLICY_H_
#define COLOD_WORKER_DAEMON_PATH_POLICY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "colod/v1/job.pb.h"

namespace colod {

// Immutable once made (Create, then Reserve before it is shared);
// thread-safe.
class PathPolicy {
 public:
  // Every path allowed.
  PathPolicy() = default;
  // INVALID_ARGUMENT for a root that is not an absolute path to an existing
  // directory. Roots are resolved (symbolic links, "..") once here.
  static absl::StatusOr<PathPolicy> Create(const std::vector<std::string>& roots);

  bool unrestricted() const { return roots_.empty(); }
  const std::vector<std::string>& roots() const { return roots_; }

  // OK when `path`, resolved as the worker would open it (relative to its
  // working directory, through symbolic links and ".." of the parts that
  // exist), is a root or lies under one, and is not in the reserved
  // directory (whatever the roots, none included). PERMISSION_DENIED naming
  // `field`, the path and the roots otherwise, and for a path holding a NUL
  // byte (even with no roots: open() would stop at it).
  absl::Status Check(absl::string_view field, const std::string& path) const;

  // Every path `spec` names (empty ones are not paths): Check.
  absl::Status CheckJob(const v1::JobSpec& spec) const;

  // The worker's own directory (its --work-dir: the download cache, its
  // lock, rank directories, the flight recorder), which no job may name
  // even where a root holds it (a job's output written over a cached
  // upload would be loaded by the next job of that upload). Resolved here;
  // a root in it allows nothing, and is dropped with a warning. INVALID_ARGUMENT
  // where it does not exist, or where every root lies in it.
  absl::Status Reserve(const std::string& dir);
  const std::string& reserved() const { return reserved_; }

 private:
  std::vector<std::string> roots_;  // canonical, without a trailing '/'
  std::string reserved_;            // canonical; empty: none
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_PATH_POLICY_H_
