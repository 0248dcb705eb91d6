// Reduction operators: the codes Python bakes into compiled programs, and the
// MPI_Op each one means for a given element type.
#pragma once

#include <mpi.h>

#include <string>

namespace mpijax {

enum class Reduction : int { kSum, kProd, kMin, kMax, kLand, kLor, kLxor, kBand, kBor, kBxor };
inline constexpr int kNumReductions = 10;

// The name of the matching mpi4py constant (MPI.SUM, ...).
const char* ReductionName(Reduction r);

// Codes from kFirstUserOp on name user-defined operators: kFirstUserOp plus
// their id in the registry (registry.h).
inline constexpr int kFirstUserOp = kNumReductions;

// What logs and messages call the operator of `code`: "SUM", "user-defined #2".
std::string ReductionLabel(int code);

// The predefined MPI operator.
MPI_Op PredefinedOp(Reduction r);

// Element types whose reductions mpijax computes in its own MPI user ops
// (commutative, created on first use; MPI must be initialised):
//  - 16-bit floats, which MPI has no type for: SUM, PROD, MIN, MAX in float
//    arithmetic, each partial result rounded back to 16 bits;
//  - 8- and 16-bit integers (signed or not: the same bits), for SUM only:
//    Open MPI 4.1's vectorised SUM saturates them instead of wrapping
//    (open-mpi/ompi#8045), so a result would depend on the array length.
enum class CustomElement { kHalf, kBfloat16, kWord8, kWord16 };

// The user op for `r` on `e`, or MPI_OP_NULL where MPI's predefined op is
// used (integers) or none is defined (logical and bitwise ops on floats).
MPI_Op CustomOp(Reduction r, CustomElement e);

}  // namespace mpijax
