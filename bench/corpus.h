// The benchmarks' training data: random tokens.
#ifndef COLOD_BENCH_CORPUS_H_
#define COLOD_BENCH_CORPUS_H_

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace colod::bench {

// `tokens` random uint16 tokens below `vocab` (nanoGPT's .bin layout) at
// `path`, unless it exists already.
inline absl::Status WriteRandomCorpus(const std::string& path, int64_t vocab, int64_t tokens) {
  if (std::filesystem::exists(path)) return absl::OkStatus();
  std::vector<uint16_t> t(static_cast<size_t>(tokens));
  std::mt19937_64 rng(7);
  for (uint16_t& x : t) x = static_cast<uint16_t>(rng() % static_cast<uint64_t>(vocab));
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * sizeof(uint16_t)));
  if (!out.good()) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace colod::bench

#endif  // COLOD_BENCH_CORPUS_H_
