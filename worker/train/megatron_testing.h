// Tests' writer of Megatron-LM indexed datasets, byte by byte as its
// MMapIndexedDataset builder writes them (megatron/core/datasets/
// indexed_dataset.py): the .idx header "MMIDIDX\0\0", version 1 (u64), the
// dtype code (u8), the sequence and document counts (u64), then lengths
// (i32), byte pointers (i64) and document boundaries (i64), little-endian;
// the .bin the sequences back to back. Independent of data.cc's reader.
#ifndef COLOD_WORKER_TRAIN_MEGATRON_TESTING_H_
#define COLOD_WORKER_TRAIN_MEGATRON_TESTING_H_

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace colod::train::testing {

struct MegatronDataset {
  int code = 8;   // Megatron's DType code: 8 uint16, 1 uint8, 4 int32, 5 int64, ...
  int width = 2;  // its bytes
  std::vector<std::vector<int64_t>> sequences;
  std::vector<int64_t> doc_bounds;  // sequence indices, 0 ... sequences.size()
};

inline std::string LittleEndian(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}

// Writes PREFIX.bin and PREFIX.idx.
inline void WriteMegatronDataset(const std::string& prefix, const MegatronDataset& m) {
  std::string bin, idx("MMIDIDX\0\0", 9);
  idx += LittleEndian(1, 8) + LittleEndian(m.code, 1) + LittleEndian(m.sequences.size(), 8) +
         LittleEndian(m.doc_bounds.size(), 8);
  std::string lengths, pointers;
  for (const auto& seq : m.sequences) {
    lengths += LittleEndian(seq.size(), 4);
    pointers += LittleEndian(bin.size(), 8);
    for (int64_t t : seq) bin += LittleEndian(static_cast<uint64_t>(t), m.width);
  }
  idx += lengths + pointers;
  for (int64_t b : m.doc_bounds) idx += LittleEndian(b, 8);
  std::ofstream(prefix + ".bin", std::ios::binary) << bin;
  std::ofstream(prefix + ".idx", std::ios::binary) << idx;
}

}  // namespace colod::train::testing

#endif  // COLOD_WORKER_TRAIN_MEGATRON_TESTING_H_
