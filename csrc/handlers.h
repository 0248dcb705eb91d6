// The XLA FFI handlers, one per operation and platform, with the target
// names "mpijax_<name>" that Python registers them under.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace mpijax {

// A point-to-point call's peer (dest or source) given as kRouted is taken,
// with its tag, at run time from the call's route operand: the MPI_Status of
// an earlier receive, whose sender it names. The derivatives of a receive
// from MPI_ANY_SOURCE or with MPI_ANY_TAG answer whoever actually sent.
inline constexpr int kRouted = -2000000;

// Platform ("cpu", and "CUDA" in CUDA builds) -> (target name, handler).
using HandlerTable = std::map<std::string, std::vector<std::pair<const char*, XLA_FFI_Handler*>>>;
const HandlerTable& HandlersByPlatform();

}  // namespace mpijax
