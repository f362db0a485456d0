// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), a counter-based generator: the value for (seed, counter) is a pure
// function, so CPU and CUDA code produce the same stream for the same seed
// and offsets, and any element can be generated independently (dropout masks,
// seeded initialization). Header-only; usable from host and device code.
#ifndef COLOD_KERNELS_PHILOX_H_
#define COLOD_KERNELS_PHILOX_H_

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace colod::kernels {

struct Philox4x32 {
  uint32_t v[4];
};

COLOD_HOST_DEVICE void MulHiLo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// The 10-round Philox4x32 bijection of `counter` under `key`.
COLOD_HOST_DEVICE Philox4x32 Philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t* c = counter.v;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += kW0;
      key1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo32(kM0, c[0], &hi0, &lo0);
    MulHiLo32(kM1, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ key0;
    const uint32_t n2 = hi0 ^ c[3] ^ key1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
  return counter;
}

// Four uint32 of the stream (seed, offset): counter = (offset, 0, 0), key = seed.
COLOD_HOST_DEVICE Philox4x32 PhiloxBlock(uint64_t seed, uint64_t offset) {
  Philox4x32 ctr = {{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32), 0u, 0u}};
  return Philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// A uint32 mapped to [0, 1) with 24 bits, exactly representable as a float.
COLOD_HOST_DEVICE float UniformFromBits(uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

// Element i of the uniform [0, 1) stream of `seed`.
COLOD_HOST_DEVICE float PhiloxUniform(uint64_t seed, uint64_t i) {
  return UniformFromBits(PhiloxBlock(seed, i / 4).v[i % 4]);
}

// Element i of the standard-normal stream of `seed`: Box-Muller on the first
// two words of block i/2, in double precision and rounded once to float, so
// host and device agree.
COLOD_HOST_DEVICE float PhiloxNormal(uint64_t seed, uint64_t i) {
  const Philox4x32 b = PhiloxBlock(seed, i / 2);
  const double u1 = (static_cast<double>(b.v[0] >> 8) + 1.0) * (1.0 / 16777216.0);  // (0, 1]
  const double u2 = static_cast<double>(b.v[1] >> 8) * (1.0 / 16777216.0);          // [0, 1)
  const double r = sqrt(-2.0 * log(u1));
  const double theta = 6.283185307179586 * u2;
  return static_cast<float>(i % 2 == 0 ? r * cos(theta) : r * sin(theta));
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_PHILOX_H_
