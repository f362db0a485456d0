// A .npy file whose header says `shape` of `descr` and whose array is a
// hole (ftruncate): as large as a test needs, on no disk, for readers that
// must refuse it from its header before they read it.
#ifndef COLOD_TESTS_TESTING_SPARSE_NPY_H_
#define COLOD_TESTS_TESTING_SPARSE_NPY_H_

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/npy_header.h"
#include "gtest/gtest.h"

namespace colod::testing {

inline void WriteSparseNpy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
                           int64_t element_bytes) {
  const std::string header = NpyHeader(descr, shape);
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ASSERT_EQ(::write(fd, header.data(), header.size()), static_cast<ssize_t>(header.size()));
  ASSERT_EQ(::ftruncate(fd, static_cast<int64_t>(header.size()) + elements * element_bytes), 0) << std::strerror(errno);
  ::close(fd);
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_SPARSE_NPY_H_
