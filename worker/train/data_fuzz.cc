// Token data files on arbitrary bytes, in every format (the first byte
// picks it: uint16 .bin, uint32, .npy, text, jsonl, a Megatron .idx + .bin):
// TokenCorpus::Open refuses them, or every token reads and lies in its
// format's range, the documents start in order inside the corpus, and a
// sampler over the corpus yields batches inside it.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "worker/train/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  using colod::train::DataFormat;
  const DataFormat formats[] = {DataFormat::kU16,  DataFormat::kU32,   DataFormat::kNpy,
                                DataFormat::kText, DataFormat::kJsonl, DataFormat::kMegatron};
  const DataFormat format = formats[data[0] % 6];
  static const std::string path = [] {
    const char* dir = std::getenv("TEST_TMPDIR");
    return std::string(dir != nullptr ? dir : "/tmp") + "/fuzz-" + std::to_string(::getpid()) + ".tokens";
  }();
  auto write = [](const std::string& file, const uint8_t* bytes, size_t n) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes), static_cast<std::streamsize>(n));
  };
  if (format == DataFormat::kMegatron) {
    // A Megatron dataset: bytes 1-2 (little-endian) say how many of the
    // rest are the .idx; the others are the .bin.
    if (size < 3) return 0;
    const size_t idx = std::min<size_t>(size - 3, size_t{data[1]} | (size_t{data[2]} << 8));
    write(path + ".idx", data + 3, idx);
    write(path + ".bin", data + 3 + idx, size - 3 - idx);
  } else {
    write(path, data + 1, size - 1);
  }
  auto corpus = colod::train::TokenCorpus::Open(path, format);
  if (!corpus.ok()) return 0;
  const int64_t n = (*corpus)->size();
  if (n < 1) std::abort();  // an empty corpus is refused
  const std::vector<int64_t>& docs = (*corpus)->documents();
  if (docs.empty() || docs[0] != 0) std::abort();
  for (size_t i = 1; i < docs.size(); ++i) {
    if (docs[i] < docs[i - 1] || docs[i] > n) std::abort();
  }
  const int64_t limit = format == DataFormat::kU16 ? (int64_t{1} << 16) : format == DataFormat::kU32 ? (int64_t{1} << 32)
                        : colod::train::IsTextFormat(format) ? 257 : INT64_MAX;
  std::vector<int64_t> tokens(static_cast<size_t>(n));
  if (!(*corpus)->Read(0, n, tokens.data()).ok()) std::abort();
  for (const int64_t t : tokens) {
    if (format != DataFormat::kNpy && format != DataFormat::kMegatron && (t < 0 || t >= limit)) std::abort();
  }
  auto window = (*corpus)->Window(0, n);
  if (!window.ok() || window->numel() != n) std::abort();
  if ((*corpus)->Window(n - 1, 2).ok()) std::abort();  // past the end
  auto sampler = colod::train::BatchSampler::Create(n, 1, 2, 1, 7);
  if (sampler.ok()) {
    colod::Tensor inputs, labels;
    if (!sampler->Batch(**corpus, 3, 0, &inputs, &labels).ok()) std::abort();
  }
  return 0;
}
