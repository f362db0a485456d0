#ifndef COLOD_TESTS_TESTING_RAW_SAFETENSORS_H_
#define COLOD_TESTS_TESTING_RAW_SAFETENSORS_H_

#include <cstdint>
#include <string>

namespace colod::testing {

// A safetensors file's bytes built by hand from the format: an 8-byte
// little-endian length, the JSON `header`, then `data`. For malformed files
// and dtypes colod's writer does not make (BOOL, U8).
inline std::string RawSafetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_RAW_SAFETENSORS_H_
