#ifndef COLOD_TESTS_TESTING_FULL_DISK_H_
#define COLOD_TESTS_TESTING_FULL_DISK_H_

#include <signal.h>
#include <sys/resource.h>

#include <cstdint>

namespace colod::testing {

// While it lives, this process cannot write past `bytes` of any file: a
// write beyond fails EFBIG, as one on a full disk fails ENOSPC (both are a
// full disk to colod's code, common/atomic_file.h's FileError). It lowers
// RLIMIT_FSIZE's soft limit and ignores SIGXFSZ, and puts both back. For
// tests of what a full disk does; keep it short, since every file of the
// process is affected (a test's own log lines written meanwhile may be
// lost).
class FullDisk {
 public:
  explicit FullDisk(int64_t bytes = 0) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit small = saved_;
    small.rlim_cur = static_cast<rlim_t>(bytes);
    ::setrlimit(RLIMIT_FSIZE, &small);
  }
  ~FullDisk() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FullDisk(const FullDisk&) = delete;
  FullDisk& operator=(const FullDisk&) = delete;

 private:
  rlimit saved_{};
  sighandler_t old_handler_ = SIG_DFL;
};

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_FULL_DISK_H_
