#include "registry.h"

#include <mutex>
#include <stdexcept>
#include <vector>

namespace mpijax {
namespace {

struct Entry {
  MPI_Comm comm;
  MPI_Comm reversed = MPI_COMM_NULL;
};

std::mutex mutex;
// Never destroyed: handlers may run after static destructors.
std::vector<Entry>& Comms() {
  static auto* comms = new std::vector<Entry>();
  return *comms;
}

}  // namespace

int64_t RegisterComm(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) throw std::invalid_argument("cannot register MPI_COMM_NULL");
  std::lock_guard<std::mutex> lock(mutex);
  auto& comms = Comms();
  for (size_t i = 0; i < comms.size(); ++i) {
    if (comms[i].comm == comm) return static_cast<int64_t>(i);
  }
  comms.push_back({comm});
  return static_cast<int64_t>(comms.size() - 1);
}

bool LookupComm(int64_t id, MPI_Comm* comm) {
  std::lock_guard<std::mutex> lock(mutex);
  const auto& comms = Comms();
  if (id < 0 || id >= static_cast<int64_t>(comms.size())) return false;
  *comm = comms[id].comm;
  return true;
}

int ReversedComm(int64_t id, MPI_Comm* reversed) {
  MPI_Comm comm;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (id < 0 || id >= static_cast<int64_t>(Comms().size())) return MPI_ERR_COMM;
    comm = Comms()[id].comm;
    *reversed = Comms()[id].reversed;
  }
  if (*reversed != MPI_COMM_NULL) return MPI_SUCCESS;
  // Split outside the lock: it waits for the other ranks. Each rank makes one
  // MPI call at a time, so no other thread creates this entry meanwhile.
  int rank, size;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  if (int rc = MPI_Comm_size(comm, &size)) return rc;
  if (int rc = MPI_Comm_split(comm, 0, size - 1 - rank, reversed)) return rc;
  std::lock_guard<std::mutex> lock(mutex);
  Comms()[id].reversed = *reversed;
  return MPI_SUCCESS;
}

}  // namespace mpijax
