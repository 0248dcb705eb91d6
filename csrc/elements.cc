#include "elements.h"

#include <algorithm>

#include "reductions.h"
#include "registry.h"

namespace ffi = xla::ffi;

namespace mpijax {

Element ElementOf(ffi::DataType t) {
  switch (t) {
    case ffi::PRED:
      return {MPI_C_BOOL, "bool"};
    case ffi::S8:
      return {MPI_INT8_T, "int8"};
    case ffi::S16:
      return {MPI_INT16_T, "int16"};
    case ffi::S32:
      return {MPI_INT32_T, "int32"};
    case ffi::S64:
      return {MPI_INT64_T, "int64"};
    case ffi::U8:
      return {MPI_UINT8_T, "uint8"};
    case ffi::U16:
      return {MPI_UINT16_T, "uint16"};
    case ffi::U32:
      return {MPI_UINT32_T, "uint32"};
    case ffi::U64:
      return {MPI_UINT64_T, "uint64"};
    // No MPI type exists for 16-bit floats: they travel as 2-byte words and
    // reduce in user ops (OpOf).
    case ffi::F16:
      return {MPI_UINT16_T, "float16"};
    case ffi::BF16:
      return {MPI_UINT16_T, "bfloat16"};
    case ffi::F32:
      return {MPI_FLOAT, "float32"};
    case ffi::F64:
      return {MPI_DOUBLE, "float64"};
    case ffi::C64:
      return {MPI_C_FLOAT_COMPLEX, "complex64"};
    case ffi::C128:
      return {MPI_C_DOUBLE_COMPLEX, "complex128"};
    default:
      return {MPI_DATATYPE_NULL, "unsupported"};
  }
}

MPI_Op OpOf(int64_t code, const ffi::AnyBuffer& x) {
  if (code >= kFirstUserOp) {
    // The user's operator sees the MPI type TypeOf(x): 16-bit floats as
    // MPI_UINT16_T words, since MPI has no type for them.
    MPI_Op op = MPI_OP_NULL;
    return LookupOp(code - kFirstUserOp, &op) ? op : MPI_OP_NULL;
  }
  if (code < 0) return MPI_OP_NULL;
  const auto r = static_cast<Reduction>(code);
  switch (x.element_type()) {
    case ffi::F16:
      return CustomOp(r, CustomElement::kHalf);
    case ffi::BF16:
      return CustomOp(r, CustomElement::kBfloat16);
    case ffi::S8:
    case ffi::U8:
      if (r == Reduction::kSum) return CustomOp(r, CustomElement::kWord8);
      return PredefinedOp(r);
    case ffi::S16:
    case ffi::U16:
      if (r == Reduction::kSum) return CustomOp(r, CustomElement::kWord16);
      return PredefinedOp(r);
    default:
      return PredefinedOp(r);
  }
}

Shape ShapeOf(const ffi::AnyBuffer& x) {
  Shape shape;
  const auto dims = x.dimensions();
  shape.ndim = static_cast<int>(dims.size());
  for (int i = 0; i < shape.ndim; ++i) {
    const int j = std::min(i, Shape::kMaxDims - 1);
    shape.dims[j] = i > j ? shape.dims[j] * dims[i] : dims[i];
  }
  return shape;
}

int64_t RowOf(const ffi::AnyBuffer& x) {
  const auto dims = x.dimensions();
  int64_t row = 1;
  for (size_t i = 1; i < dims.size(); ++i) row *= dims[i];
  return row;
}

CallInfo Describe(const char* op, const ffi::AnyBuffer& x) {
  CallInfo info;
  info.op = op;
  info.count = static_cast<int64_t>(x.element_count());
  info.dtype = ElementOf(x.element_type()).name;
  info.bytes = static_cast<int64_t>(x.size_bytes());
  info.shape = ShapeOf(x);
  return info;
}

}  // namespace mpijax
