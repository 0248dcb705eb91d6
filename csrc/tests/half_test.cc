#include "half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

namespace mpijax {
namespace {

bool IsHalfNan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
bool IsBfloat16Nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f); }

TEST(Half, EveryValueRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (IsHalfNan(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(IsHalfNan(FloatToHalf(f)));
    } else {
      EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
    }
  }
}

TEST(Half, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);  // rounds down to it
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // ties to even: infinity
  EXPECT_EQ(FloatToHalf(1e9f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie: to even (zero)
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // tie: to even (2)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
}

TEST(Half, MidpointsRoundToEven) {
  for (uint16_t h = 0; h < 0x7bff; ++h) {
    const float mid = (HalfToFloat(h) + HalfToFloat(h + 1)) / 2;  // exact in float
    EXPECT_EQ(FloatToHalf(mid), (h % 2 == 0) ? h : h + 1) << std::hex << h;
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), h);
    EXPECT_EQ(FloatToHalf(std::nextafter(mid, INFINITY)), h + 1);
  }
}

TEST(Bfloat16, EveryValueRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = Bfloat16ToFloat(static_cast<uint16_t>(b));
    if (IsBfloat16Nan(static_cast<uint16_t>(b))) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(IsBfloat16Nan(FloatToBfloat16(f)));
    } else {
      EXPECT_EQ(FloatToBfloat16(f), b) << std::hex << b;
    }
  }
}

TEST(Bfloat16, MidpointsRoundToEven) {
  for (uint16_t b = 0; b < 0x7f7f; ++b) {
    const float lo = Bfloat16ToFloat(b), hi = Bfloat16ToFloat(b + 1);
    const float mid = lo + (hi - lo) / 2;  // exact; lo + hi could overflow
    EXPECT_EQ(FloatToBfloat16(mid), (b % 2 == 0) ? b : b + 1) << std::hex << b;
  }
  EXPECT_EQ(FloatToBfloat16(3.4e38f), 0x7f80);  // past the largest finite: infinity
  EXPECT_EQ(FloatToBfloat16(1.0f), 0x3f80);
}

}  // namespace
}  // namespace mpijax
