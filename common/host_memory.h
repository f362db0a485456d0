// This host's memory as a process here sees it: lowered to its cgroup's
// limit inside a container, which /proc and sysconf do not show.
//
// Thread-safe (no shared state).
#ifndef COLOD_COMMON_HOST_MEMORY_H_
#define COLOD_COMMON_HOST_MEMORY_H_

#include <cstdint>

namespace colod {

// The physical memory (sysconf), or the cgroup's limit (v2 memory.max, v1
// memory.limit_in_bytes) when that is lower; 0 where neither can be read.
// What a CPU worker reports.
int64_t HostMemoryBytes();

// What could be allocated now without swapping: /proc/meminfo's
// MemAvailable, or the cgroup's limit less its usage when that is lower
// (a container is killed at its limit, whatever the host has free). The
// physical memory where /proc/meminfo cannot be read.
int64_t AvailableHostMemoryBytes();

}  // namespace colod

#endif  // COLOD_COMMON_HOST_MEMORY_H_
