// Stand-in for CUDA's cuda_fp16.h in the host simulation (cuda_sim.h): the half type and
// the two functions the device code uses, as the CUDA Math API defines them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

struct __half {
  unsigned short bits;
};

inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }

// cvt.f32.f16: every binary16 value is a binary32 value, so the conversion is exact;
// computed here from the fields (sign, biased exponent, fraction), not from bit moves,
// so that it is a second derivation beside the CPU's (sampling_math.h fp16_to_float).
inline float __half2float(__half h) {
  const bool negative = (h.bits & 0x8000u) != 0;
  const int exponent = (h.bits >> 10) & 0x1f;
  const int fraction = h.bits & 0x3ff;
  float magnitude;
  if (exponent == 0x1f) {
    magnitude = fraction == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(fraction), -24);  // subnormal: f * 2^-24
  } else {
    magnitude = std::ldexp(static_cast<float>(1024 + fraction), exponent - 25);
  }
  return negative ? -magnitude : magnitude;
}
