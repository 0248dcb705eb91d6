// What XLA's buffers are to MPI: the datatype of each element type, the MPI_Op
// of each reduction code, and a buffer's description for logs, error messages
// and check mode.
#pragma once

#include <mpi.h>

#include <cstdint>

#include "call.h"
#include "xla/ffi/api/ffi.h"

namespace mpijax {

struct Element {
  MPI_Datatype type;  // MPI_DATATYPE_NULL for an element type MPI cannot carry
  const char* name;
};

Element ElementOf(xla::ffi::DataType t);

inline MPI_Datatype TypeOf(const xla::ffi::AnyBuffer& x) {
  return ElementOf(x.element_type()).type;
}

// The MPI_Op of a reduction code (reductions.h) or user op (registry.h) for
// x's elements; MPI_OP_NULL (MPI_ERR_OP) for an unknown one.
MPI_Op OpOf(int64_t code, const xla::ffi::AnyBuffer& x);

Shape ShapeOf(const xla::ffi::AnyBuffer& x);

// Elements per row: the product of x's dimensions after the first.
int64_t RowOf(const xla::ffi::AnyBuffer& x);

CallInfo Describe(const char* op, const xla::ffi::AnyBuffer& x);

}  // namespace mpijax
