#ifndef COLOD_TESTS_TESTING_NO_RENAME_EXCHANGE_H_
#define COLOD_TESTS_TESTING_NO_RENAME_EXCHANGE_H_

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace colod::testing {

// Runs `fn` on a thread of its own on which renameat2 with RENAME_EXCHANGE
// fails EINVAL, as it does on a file system that cannot exchange (vfat,
// older NFS and overlayfs). The kernel does it: a seccomp filter of that
// thread, which the threads it starts inherit (a test's ranks); the rest of
// the process is untouched. The filter ends with the thread and with those
// it started (one that outlives it, a pool started lazily by `fn`, keeps it).
// Plain renames pass. UNIMPLEMENTED or FAILED_PRECONDITION where the filter
// cannot be installed (another architecture, a kernel without seccomp
// filters), and `fn` does not run.
inline absl::Status WithoutRenameExchange(const std::function<void()>& fn) {
#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__x86_64__)
  constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#else
  constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#endif
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_renameat2, 0, 3),
      // The flags: the low word of the fifth argument (little-endian).
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args) + 4 * sizeof(uint64_t)),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, RENAME_EXCHANGE, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EINVAL & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  absl::Status installed;
  std::thread t([&] {
    // Both are the calling thread's own (no SECCOMP_FILTER_FLAG_TSYNC).
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
      installed = absl::FailedPreconditionError(
          absl::StrCat("cannot install a seccomp filter on this thread: ", std::strerror(errno)));
      return;
    }
    fn();
  });
  t.join();
  return installed;
#else
  return absl::UnimplementedError("WithoutRenameExchange knows x86-64 and aarch64 only");
#endif
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_NO_RENAME_EXCHANGE_H_
