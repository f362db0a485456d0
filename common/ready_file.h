#ifndef COLOD_COMMON_READY_FILE_H_
#define COLOD_COMMON_READY_FILE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace colod {

// Atomically (temporary file + rename) writes "key=value" lines to `path`, so
// a script or test that waits for the file never reads it half-written.
// Daemons use it with --ready-file to publish the ports they bound.
absl::Status WriteReadyFile(const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& entries);

}  // namespace colod

#endif  // COLOD_COMMON_READY_FILE_H_
