#ifndef COLOD_COMMON_SERVE_H_
#define COLOD_COMMON_SERVE_H_

#include <functional>
#include <string>

#include "absl/strings/string_view.h"

namespace colod {

// The tail of every daemon's main(), once the daemon serves: writes
// `grpc=...` and `metrics=...` to `ready_file` (unless empty), waits for
// SIGTERM, SIGINT or SIGHUP (BlockShutdownSignals() must have run first), calls
// `shutdown`, and returns the exit code: 0, or 1 if the ready file could not
// be written (the daemon is shut down then too).
int ServeUntilSignal(absl::string_view name, const std::string& ready_file, const std::string& grpc,
                     const std::string& metrics, const std::function<void()>& shutdown);

}  // namespace colod

#endif  // COLOD_COMMON_SERVE_H_
