// The XLA FFI handlers, one per operation and platform, registered as
// "mpijax_<name>".
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace mpijax {

// Platform ("cpu", and "CUDA" in CUDA builds) -> (target name, handler).
std::map<std::string, std::vector<std::pair<const char*, XLA_FFI_Handler*>>> HandlersByPlatform();

}  // namespace mpijax
