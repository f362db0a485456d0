// Exit codes a colod daemon ends with that its supervisor acts on.
#ifndef COLOD_COMMON_EXIT_CODES_H_
#define COLOD_COMMON_EXIT_CODES_H_

namespace colod {

// A CUDA worker whose device a fault left broken (sysexits' EX_SOFTWARE): it
// deregistered and asks to be restarted, a new process getting a new CUDA
// context. coloctl local restarts it; Kubernetes and systemd (Restart=
// on-failure) do too.
inline constexpr int kExitDeviceLost = 70;

}  // namespace colod

#endif  // COLOD_COMMON_EXIT_CODES_H_
