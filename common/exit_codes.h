// Exit codes a colod daemon ends with that its supervisor acts on.
#ifndef COLOD_COMMON_EXIT_CODES_H_
#define COLOD_COMMON_EXIT_CODES_H_

namespace colod {

// A CUDA worker whose device a fault left broken (sysexits' EX_SOFTWARE): it
// deregistered and asks to be restarted, a new process getting a new CUDA
// context. coloctl local restarts it; Kubernetes and systemd (Restart=
// on-failure) do too.
inline constexpr int kExitDeviceLost = 70;

// A daemon ended by an exception that nothing of colod's could catch: one
// thrown on a library's own thread (Gloo's event loop throws when a peer
// resets a TCP connection in the middle of its handshake), or any other call
// of std::terminate (ExitOnUncaughtExceptions, common/serve.h). The process's
// state is unknown, so it logs the exception and exits at once, without a
// clean shutdown; a new process is sound, and supervisors restart it as after
// kExitDeviceLost (sysexits' EX_OSERR, the next code).
inline constexpr int kExitUncaughtException = 71;

// Whether a daemon's exit code asks its supervisor for a new process.
inline constexpr bool AsksForRestart(int exit_code) {
  return exit_code == kExitDeviceLost || exit_code == kExitUncaughtException;
}

}  // namespace colod

#endif  // COLOD_COMMON_EXIT_CODES_H_
