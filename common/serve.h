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

// For a daemon's shutdown, once whatever takes the signals itself is done
// (a worker's drain takes the second): a shutdown signal from now on ends
// the process at once, exiting 128 + its number with one log line naming
// `name`, without finishing the shutdown (a second Ctrl-C for one that
// hangs, as at SIGKILL: what the daemons keep on disk is written whole or
// not at all). Starts a thread that waits for it; where none can be
// started, says so and returns.
void ExitOnNextShutdownSignal(absl::string_view name);

// The first call of every daemon's main(): an exception that escapes every
// handler (one thrown on a library's own thread, as Gloo's event loop does
// when a peer resets a connection mid-handshake) or any other std::terminate
// ends the process with kExitUncaughtException (common/exit_codes.h) and one
// log line naming `name`, the thread, the exception's type and its message
// (escaped, at most 1 KiB), in place of the runtime's abort and core dump.
// Nothing is shut down: the process's state is unknown, and its supervisor
// starts a new one. Thread-safe; the last call's name wins.
void ExitOnUncaughtExceptions(absl::string_view name);

}  // namespace colod

#endif  // COLOD_COMMON_SERVE_H_
