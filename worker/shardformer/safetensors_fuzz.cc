// SafetensorsFile on arbitrary bytes (the header, its shapes and offsets):
// Open refuses it, or every tensor it lists reads whole and in slices
// without reading outside the file, and each tensor of a dtype it does not
// read is there and INVALID_ARGUMENT when read.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "worker/shardformer/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* dir = std::getenv("TEST_TMPDIR");
    return std::string(dir != nullptr ? dir : "/tmp") + "/fuzz-" + std::to_string(::getpid()) + ".safetensors";
  }();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  absl::StatusOr<std::unique_ptr<colod::shardformer::SafetensorsFile>> f =
      colod::shardformer::SafetensorsFile::Open(path);
  if (!f.ok()) return 0;
  for (const auto& [name, info] : (*f)->tensors()) {
    absl::StatusOr<colod::Tensor> t = (*f)->Read(name);
    if (!t.ok()) continue;
    // The second half of dim 0, when there is one.
    if (t->dim() >= 1 && t->shape()[0] >= 2) {
      std::vector<int64_t> starts(t->dim(), 0), lengths(t->shape().begin(), t->shape().end());
      starts[0] = t->shape()[0] / 2;
      lengths[0] = t->shape()[0] - starts[0];
      absl::StatusOr<colod::Tensor> half = (*f)->ReadSlice(name, starts, lengths);
      if (!half.ok()) std::abort();
    }
  }
  // A tensor of a dtype colod does not read is there, and refused only
  // when read.
  for (const auto& [name, dtype] : (*f)->unreadable()) {
    if (!(*f)->Has(name) || (*f)->Read(name).status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  }
  return 0;
}
