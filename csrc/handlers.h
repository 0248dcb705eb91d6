// The XLA FFI handlers, one per operation, registered as "mpijax_<name>".
#pragma once

#include <utility>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace mpijax {

std::vector<std::pair<const char*, XLA_FFI_Handler*>> CpuHandlers();

}  // namespace mpijax
