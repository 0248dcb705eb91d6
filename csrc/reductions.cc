#include "reductions.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>

#include "half.h"

namespace mpijax {
namespace {

struct HalfCodec {
  using Word = uint16_t;
  static float Decode(Word v) { return HalfToFloat(v); }
  static Word Encode(float v) { return FloatToHalf(v); }
};

struct Bfloat16Codec {
  using Word = uint16_t;
  static float Decode(Word v) { return Bfloat16ToFloat(v); }
  static Word Encode(float v) { return FloatToBfloat16(v); }
};

// Unsigned words: arithmetic in int, then conversion back wraps modulo 2^n,
// which is two's complement wrapping for the signed types too.
template <class W>
struct WordCodec {
  using Word = W;
  static int Decode(Word v) { return v; }
  static Word Encode(int v) { return static_cast<Word>(v); }
};

struct Min {
  template <class T>
  T operator()(T a, T b) const {
    return std::min(a, b);
  }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const {
    return std::max(a, b);
  }
};

// MPI_User_function: inout[i] = in[i] op inout[i].
template <class Codec, class Fn>
void Apply(void* in, void* inout, int* len, MPI_Datatype*) {
  using Word = typename Codec::Word;
  const auto* a = static_cast<const Word*>(in);
  auto* b = static_cast<Word*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = Codec::Encode(Fn{}(Codec::Decode(a[i]), Codec::Decode(b[i])));
  }
}

constexpr int kFloatReductions = 4;  // SUM, PROD, MIN, MAX lead the Reduction enum

struct CustomOps {
  MPI_Op half[kFloatReductions], bfloat16[kFloatReductions];
  MPI_Op sum8, sum16;

  CustomOps() {
    MPI_User_function* half_fns[] = {Apply<HalfCodec, std::plus<>>,
                                     Apply<HalfCodec, std::multiplies<>>, Apply<HalfCodec, Min>,
                                     Apply<HalfCodec, Max>};
    MPI_User_function* bfloat16_fns[] = {Apply<Bfloat16Codec, std::plus<>>,
                                         Apply<Bfloat16Codec, std::multiplies<>>,
                                         Apply<Bfloat16Codec, Min>, Apply<Bfloat16Codec, Max>};
    for (int i = 0; i < kFloatReductions; ++i) {
      half[i] = Create(half_fns[i]);
      bfloat16[i] = Create(bfloat16_fns[i]);
    }
    sum8 = Create(Apply<WordCodec<uint8_t>, std::plus<>>);
    sum16 = Create(Apply<WordCodec<uint16_t>, std::plus<>>);
  }

  static MPI_Op Create(MPI_User_function* fn) {
    MPI_Op op = MPI_OP_NULL;
    if (MPI_Op_create(fn, /*commute=*/1, &op) != MPI_SUCCESS) return MPI_OP_NULL;
    return op;
  }
};

}  // namespace

const char* ReductionName(Reduction r) {
  static constexpr const char* kNames[kNumReductions] = {"SUM", "PROD", "MIN",  "MAX", "LAND",
                                                         "LOR", "LXOR", "BAND", "BOR", "BXOR"};
  return kNames[static_cast<int>(r)];
}

std::string ReductionLabel(int code) {
  if (code >= kFirstUserOp) return "user-defined #" + std::to_string(code - kFirstUserOp);
  if (code >= 0) return ReductionName(static_cast<Reduction>(code));
  return "op " + std::to_string(code);
}

MPI_Op PredefinedOp(Reduction r) {
  switch (r) {
    case Reduction::kSum:
      return MPI_SUM;
    case Reduction::kProd:
      return MPI_PROD;
    case Reduction::kMin:
      return MPI_MIN;
    case Reduction::kMax:
      return MPI_MAX;
    case Reduction::kLand:
      return MPI_LAND;
    case Reduction::kLor:
      return MPI_LOR;
    case Reduction::kLxor:
      return MPI_LXOR;
    case Reduction::kBand:
      return MPI_BAND;
    case Reduction::kBor:
      return MPI_BOR;
    case Reduction::kBxor:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

MPI_Op CustomOp(Reduction r, CustomElement e) {
  static const CustomOps* ops = new CustomOps();  // thread-safe init; never freed
  const int index = static_cast<int>(r);
  switch (e) {
    case CustomElement::kHalf:
      return index < kFloatReductions ? ops->half[index] : MPI_OP_NULL;
    case CustomElement::kBfloat16:
      return index < kFloatReductions ? ops->bfloat16[index] : MPI_OP_NULL;
    case CustomElement::kWord8:
      return r == Reduction::kSum ? ops->sum8 : MPI_OP_NULL;
    case CustomElement::kWord16:
      return r == Reduction::kSum ? ops->sum16 : MPI_OP_NULL;
  }
  return MPI_OP_NULL;
}

}  // namespace mpijax
