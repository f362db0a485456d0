// The process's heap in use, for tests and benchmarks that measure what a
// computation keeps alive (the activations the autograd tape holds).
#ifndef COLOD_TESTS_TESTING_HEAP_H_
#define COLOD_TESTS_TESTING_HEAP_H_

#include <malloc.h>

#include <cstdint>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLOD_TESTING_HEAP_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define COLOD_TESTING_HEAP_ASAN 1
#endif
#ifdef COLOD_TESTING_HEAP_ASAN
#include <sanitizer/allocator_interface.h>
#endif

namespace colod::testing {

// Heap bytes in use by the process: glibc's count (every arena, and
// mmapped chunks), or AddressSanitizer's where it owns the heap.
inline int64_t HeapInUse() {
#ifdef COLOD_TESTING_HEAP_ASAN
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
#endif
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_HEAP_H_
