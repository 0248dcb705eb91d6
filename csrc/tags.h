// MPI's tag space as mpijax divides it (MPI_TAG_UB is at least 32767):
//   0 .. LargestTag()            the tags users pass;
//   DerivativeTag(t)             the messages of derivatives (JVP tangents and
//                                transposes), which so never match a receive
//                                of values under a fixed tag;
//   MPI_TAG_UB - 3 .. MPI_TAG_UB check mode's handshakes (check.h).
// A receive of values from MPI_ANY_SOURCE with MPI_ANY_TAG can still meet a
// derivative message: it sets such messages aside (mpi_calls.h).
#pragma once

#include <string>

namespace mpijax {

int LargestTag();

// Idempotent, so that derivatives of derivatives stay derivative messages;
// MPI_ANY_TAG and the other negative markers are left alone.
int DerivativeTag(int tag);
bool IsDerivativeTag(int tag);

// For messages: "ANY_TAG", "5", or "1073741827 (derivatives of tag 5)".
std::string TagName(int tag);

// The handshake tags of check mode: announce and reply, of values and of
// derivatives.
int CheckTag(bool reply, bool derivative);

}  // namespace mpijax
