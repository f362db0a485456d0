// Job files on arbitrary text, as JSON and as YAML (coloctl submit -f): a
// JobSpec or INVALID_ARGUMENT, never a crash or an exception escaping.
#include <cstdint>
#include <string>

#include "client/job_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)colod::ParseJobSpec(text, /*yaml=*/false);
  (void)colod::ParseJobSpec(text, /*yaml=*/true);
  return 0;
}
