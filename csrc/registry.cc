#include "registry.h"

#include <mutex>
#include <stdexcept>
#include <vector>

namespace mpijax {
namespace {

std::mutex mutex;
std::vector<MPI_Comm>& Comms() {
  static auto* comms =
      new std::vector<MPI_Comm>();  // never destroyed: handlers may outlive statics
  return *comms;
}

}  // namespace

int64_t RegisterComm(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) throw std::invalid_argument("cannot register MPI_COMM_NULL");
  std::lock_guard<std::mutex> lock(mutex);
  auto& comms = Comms();
  for (size_t i = 0; i < comms.size(); ++i) {
    if (comms[i] == comm) return static_cast<int64_t>(i);
  }
  comms.push_back(comm);
  return static_cast<int64_t>(comms.size() - 1);
}

bool LookupComm(int64_t id, MPI_Comm* comm) {
  std::lock_guard<std::mutex> lock(mutex);
  const auto& comms = Comms();
  if (id < 0 || id >= static_cast<int64_t>(comms.size())) return false;
  *comm = comms[id];
  return true;
}

}  // namespace mpijax
