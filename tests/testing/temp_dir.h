#ifndef COLOD_TESTS_TESTING_TEMP_DIR_H_
#define COLOD_TESTS_TESTING_TEMP_DIR_H_

#include <cstdlib>
#include <string>

namespace colod::testing {

// A path under the test's private temporary directory ($TEST_TMPDIR under
// Bazel, /tmp otherwise).
inline std::string TempPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + name;
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_TEMP_DIR_H_
