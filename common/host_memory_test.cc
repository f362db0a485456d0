#include "common/host_memory.h"

#include <unistd.h>

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(HostMemory, IsThePhysicalMemoryOrLessAndSomeIsAvailable) {
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  EXPECT_GT(HostMemoryBytes(), int64_t{64} << 20);
  EXPECT_LE(HostMemoryBytes(), physical);
  EXPECT_GT(AvailableHostMemoryBytes(), 0);
  EXPECT_LE(AvailableHostMemoryBytes(), HostMemoryBytes());
}

}  // namespace
}  // namespace colod
