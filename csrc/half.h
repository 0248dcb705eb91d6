// IEEE binary16 and bfloat16 <-> float conversions. MPI has no 16-bit float
// types, so reductions on them run in our own MPI user ops (reductions.cc),
// which compute in float and round back with these functions.
#pragma once

#include <cstdint>
#include <cstring>

namespace mpijax {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal or zero: mantissa * 2^-24 is exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return BitsFloat(sign | FloatBits(magnitude));
}

// Round to nearest, ties to even; overflow gives infinity, NaN stays NaN.
inline uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (x >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16: infinity
  if (x < 0x38800000u) {                        // below 2^-14: subnormal
    // Adding 0.5 (whose ulp is 2^-24, the half subnormal step) makes the FPU
    // round to the subnormal grid with ties to even.
    const uint32_t rounded = FloatBits(BitsFloat(x) + 0.5f) - 0x3f000000u;
    return sign | static_cast<uint16_t>(rounded);
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xfffu + odd;  // ties to even on the 13 dropped bits
  return sign | static_cast<uint16_t>((x - 0x38000000u) >> 13);  // carries into inf
}

inline float Bfloat16ToFloat(uint16_t b) { return BitsFloat(uint32_t{b} << 16); }

inline uint16_t FloatToBfloat16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace mpijax
