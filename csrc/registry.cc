#include "registry.h"

#include <mutex>
#include <stdexcept>
#include <vector>

namespace mpijax {
namespace {

std::mutex mutex;
// Never destroyed: handlers may run after static destructors.
std::vector<MPI_Comm>& Comms() {
  static auto* comms = new std::vector<MPI_Comm>();
  return *comms;
}

int FreeReversed(MPI_Comm, int, void* attribute, void*) {
  auto* reversed = static_cast<MPI_Comm*>(attribute);
  const int rc = MPI_Comm_free(reversed);
  delete reversed;
  return rc;
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

int ReversedComm(MPI_Comm comm, MPI_Comm* reversed) {
  static const int keyval = [] {
    int key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreeReversed, &key, nullptr);
    return key;
  }();
  if (keyval == MPI_KEYVAL_INVALID) return MPI_ERR_KEYVAL;
  void* attribute = nullptr;
  int found = 0;
  if (int rc = MPI_Comm_get_attr(comm, keyval, &attribute, &found)) return rc;
  if (found) {
    *reversed = *static_cast<MPI_Comm*>(attribute);
    return MPI_SUCCESS;
  }
  int rank, size;
  if (int rc = MPI_Comm_rank(comm, &rank)) return rc;
  if (int rc = MPI_Comm_size(comm, &size)) return rc;
  auto* made = new MPI_Comm(MPI_COMM_NULL);
  if (int rc = MPI_Comm_split(comm, 0, size - 1 - rank, made)) {
    delete made;
    return rc;
  }
  if (int rc = MPI_Comm_set_attr(comm, keyval, made)) {
    MPI_Comm_free(made);
    delete made;
    return rc;
  }
  *reversed = *made;
  return MPI_SUCCESS;
}

}  // namespace mpijax
