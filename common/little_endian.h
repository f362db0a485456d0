// Little-endian integers in byte buffers (file formats: .npy headers,
// Megatron indexes, token files), read byte by byte so the host's byte
// order does not matter.
#ifndef COLOD_COMMON_LITTLE_ENDIAN_H_
#define COLOD_COMMON_LITTLE_ENDIAN_H_

#include <cstdint>

namespace colod {

// The unsigned integer in p[0 .. bytes), 1 <= bytes <= 8; the caller has
// checked that they are there.
inline uint64_t LoadLittleEndian(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The same bytes as a two's complement integer of that width.
inline int64_t LoadLittleEndianSigned(const unsigned char* p, int bytes) {
  uint64_t v = LoadLittleEndian(p, bytes);
  if (bytes < 8 && (v >> (8 * bytes - 1)) != 0) v |= ~uint64_t{0} << (8 * bytes);  // sign-extend
  return static_cast<int64_t>(v);
}

}  // namespace colod

#endif  // COLOD_COMMON_LITTLE_ENDIAN_H_
