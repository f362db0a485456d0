// The header of a NumPy .npy file, format version 1.0: the magic string, the
// version, the header length and the dict {'descr', 'fortran_order': False,
// 'shape'}, padded so that the array starts at a multiple of 64 bytes. The
// worker's tensors (worker/tensor/npy.h) and coloctl's `tensor get --out`
// write their arrays after it.
//
// Thread-safety: a pure function.
#ifndef COLOD_COMMON_NPY_HEADER_H_
#define COLOD_COMMON_NPY_HEADER_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace colod {

// `descr` is NumPy's type string ("<f4", "<f2", "<i8", "<i4"); `shape` in C
// order. Throws nothing; a header longer than 65535 bytes (a shape of
// thousands of dimensions) is the caller's to avoid.
std::string NpyHeader(absl::string_view descr, absl::Span<const int64_t> shape);

}  // namespace colod

#endif  // COLOD_COMMON_NPY_HEADER_H_
