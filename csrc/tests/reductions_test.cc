#include "reductions.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "half.h"

namespace mpijax {
namespace {

// MPI_Reduce_local applies an op without communication: inout = in op inout.
template <class T>
std::vector<T> ReduceLocal(std::vector<T> in, std::vector<T> inout, MPI_Datatype type, MPI_Op op) {
  EXPECT_EQ(MPI_Reduce_local(in.data(), inout.data(), static_cast<int>(in.size()), type, op),
            MPI_SUCCESS);
  return inout;
}

TEST(CustomOp, HalfArithmeticRoundsEachResult) {
  const std::vector<float> a = {1.0f, 0.1f, 2049.0f, -3.5f, 65504.0f};
  const std::vector<float> b = {2.0f, 0.2f, 1.0f, 7.25f, 65504.0f};
  std::vector<uint16_t> ha, hb;
  for (size_t i = 0; i < a.size(); ++i) {
    ha.push_back(FloatToHalf(a[i]));
    hb.push_back(FloatToHalf(b[i]));
  }
  const Reduction ops[] = {Reduction::kSum, Reduction::kProd, Reduction::kMin, Reduction::kMax};
  for (Reduction r : ops) {
    const auto got = ReduceLocal(ha, hb, MPI_UINT16_T, CustomOp(r, CustomElement::kHalf));
    for (size_t i = 0; i < a.size(); ++i) {
      const float x = HalfToFloat(ha[i]), y = HalfToFloat(hb[i]);
      const float want = r == Reduction::kSum    ? x + y
                         : r == Reduction::kProd ? x * y
                         : r == Reduction::kMin  ? std::fmin(x, y)
                                                 : std::fmax(x, y);
      EXPECT_EQ(got[i], FloatToHalf(want)) << ReductionName(r) << " " << i;
    }
  }
  // 2049 is not a half: 2048 + 1 rounds back to 2048; 65504 + 65504 overflows.
  const auto sum =
      ReduceLocal(ha, hb, MPI_UINT16_T, CustomOp(Reduction::kSum, CustomElement::kHalf));
  EXPECT_EQ(HalfToFloat(sum[2]), 2048.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(sum[4])));
}

TEST(CustomOp, Bfloat16Sum) {
  const std::vector<uint16_t> a = {FloatToBfloat16(1.0f), FloatToBfloat16(256.0f)};
  const std::vector<uint16_t> b = {FloatToBfloat16(2.0f), FloatToBfloat16(1.0f)};
  const auto got =
      ReduceLocal(a, b, MPI_UINT16_T, CustomOp(Reduction::kSum, CustomElement::kBfloat16));
  EXPECT_EQ(Bfloat16ToFloat(got[0]), 3.0f);
  EXPECT_EQ(Bfloat16ToFloat(got[1]), 256.0f);  // 257 has no bfloat16: ties to even
}

TEST(CustomOp, SmallIntegerSumsWrapAtEveryLength) {
  for (int n : {1, 7, 31, 32, 33, 100, 1000}) {
    const auto s8 = ReduceLocal(std::vector<int8_t>(n, 100), std::vector<int8_t>(n, 100),
                                MPI_INT8_T, CustomOp(Reduction::kSum, CustomElement::kWord8));
    const auto u8 = ReduceLocal(std::vector<uint8_t>(n, 200), std::vector<uint8_t>(n, 200),
                                MPI_UINT8_T, CustomOp(Reduction::kSum, CustomElement::kWord8));
    const auto s16 = ReduceLocal(std::vector<int16_t>(n, 20000), std::vector<int16_t>(n, 20000),
                                 MPI_INT16_T, CustomOp(Reduction::kSum, CustomElement::kWord16));
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(s8[i], -56) << n;
      EXPECT_EQ(u8[i], 144) << n;
      EXPECT_EQ(s16[i], -25536) << n;
    }
  }
}

TEST(CustomOp, UndefinedCombinationsHaveNoOp) {
  EXPECT_EQ(CustomOp(Reduction::kLand, CustomElement::kHalf), MPI_OP_NULL);
  EXPECT_EQ(CustomOp(Reduction::kBxor, CustomElement::kBfloat16), MPI_OP_NULL);
  EXPECT_EQ(CustomOp(Reduction::kProd, CustomElement::kWord8), MPI_OP_NULL);
  EXPECT_EQ(CustomOp(Reduction::kMax, CustomElement::kWord16), MPI_OP_NULL);
  EXPECT_STREQ(ReductionName(Reduction::kBxor), "BXOR");
  EXPECT_EQ(PredefinedOp(Reduction::kLxor), MPI_LXOR);
}

}  // namespace
}  // namespace mpijax
