// Command-line parsing shared by the colod binaries (Abseil flags).
#ifndef COLOD_COMMON_FLAGS_H_
#define COLOD_COMMON_FLAGS_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace colod {

// Parses argv with Abseil flags. --help / -h prints `usage` followed by the
// binary's own flags (not Abseil's internal ones) and exits 0; --version
// prints the colod version and exits 0; an unknown or malformed flag prints
// an error and exits 1. Returns the positional arguments, argv[0] excluded.
std::vector<std::string> ParseFlags(int argc, char** argv, absl::string_view usage);

}  // namespace colod

#endif  // COLOD_COMMON_FLAGS_H_
