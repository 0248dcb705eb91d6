#include "log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mpijax {
namespace {

bool EnvFlag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

std::atomic<bool> enabled{EnvFlag("MPIJAX_DEBUG") || EnvFlag("MPI4JAX_DEBUG")};

void Append(std::string& line, const char* key, int value) {
  if (value == kUnset) return;
  line += " | ";
  line += key;
  line += ' ';
  line += std::to_string(value);
}

}  // namespace

bool LogEnabled() { return enabled.load(std::memory_order_relaxed); }
void SetLogEnabled(bool on) { enabled.store(on, std::memory_order_relaxed); }

void LogCall(const CallInfo& call, int rank, double seconds, int error_code) {
  std::string line = "mpijax r" + std::to_string(rank) + " | " + call.op;
  Append(line, "root", call.root);
  Append(line, "dest", call.dest);
  Append(line, "source", call.source);
  Append(line, "sendtag", call.send_tag);
  Append(line, "recvtag", call.recv_tag);
  char tail[128];
  std::snprintf(tail, sizeof tail, " | %lld x %s | %lld B | %.2f us%s\n",
                static_cast<long long>(call.count), call.dtype, static_cast<long long>(call.bytes),
                seconds * 1e6, error_code ? " | FAILED" : "");
  line += tail;
  // One write per line, so lines from different threads never interleave.
  std::fputs(line.c_str(), stderr);
}

}  // namespace mpijax
