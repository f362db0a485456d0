#include "common/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"

namespace colod {
namespace {

// The first number in the first file of `paths` that holds one; 0 for none
// ("max", v2's no limit, does not parse).
int64_t FirstNumber(std::initializer_list<const char*> paths) {
  for (const char* path : paths) {
    const absl::StatusOr<std::string> text = ReadFileToString(path);
    if (!text.ok()) continue;
    int64_t v = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v) && v > 0) return v;
  }
  return 0;
}

int64_t PhysicalBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : 0;
}

// The cgroup's memory limit where it is below `physical`; 0 otherwise (none,
// or v1's "no limit", a huge number).
int64_t CgroupLimitBelow(int64_t physical) {
  const int64_t limit = FirstNumber({"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"});
  return limit > 0 && limit < physical ? limit : 0;
}

}  // namespace

int64_t HostMemoryBytes() {
  const int64_t physical = PhysicalBytes(), limit = CgroupLimitBelow(physical);
  return limit > 0 ? limit : physical;
}

int64_t AvailableHostMemoryBytes() {
  const int64_t physical = PhysicalBytes();
  int64_t available = physical;
  if (const absl::StatusOr<std::string> info = ReadFileToString("/proc/meminfo"); info.ok()) {
    for (absl::string_view line : absl::StrSplit(*info, '\n')) {
      if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
      int64_t kib = 0;
      if (absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kib)) available = kib << 10;
    }
  }
  if (const int64_t limit = CgroupLimitBelow(physical); limit > 0) {
    const int64_t used = FirstNumber({"/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"});
    available = std::min(available, std::max<int64_t>(0, limit - used));
  }
  return available;
}

}  // namespace colod
