// Finding a colod program that another one starts (the daemons that
// `coloctl demo` runs, the SentencePiece helper a worker runs).
//
// Thread-safety: a pure function of the file system and $PATH.
#ifndef COLOD_COMMON_FIND_BINARY_H_
#define COLOD_COMMON_FIND_BINARY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace colod {

// The executable `name`, looked for in `self`'s directory (`self` is a
// program path; empty means this process's, /proc/self/exe), then in each
// of `relative_dirs` under that directory (Bazel's output tree puts
// programs in their packages' folders), then on $PATH. The canonical path
// of the first one that is executable; NOT_FOUND naming where it looked.
absl::StatusOr<std::string> FindBinary(const std::string& name, const std::vector<std::string>& relative_dirs,
                                       std::string self = "");

}  // namespace colod

#endif  // COLOD_COMMON_FIND_BINARY_H_
