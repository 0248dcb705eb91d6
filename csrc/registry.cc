#include "registry.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

namespace mpijax {
namespace {

// Handles of one kind. An id is the index of its entry, with a tag above
// kIndexBits that the entry must match (registry.h).
template <class Handle>
class Table {
 public:
  // `null`, never registered, marks a retired id.
  explicit Table(Handle null) : null_(null) {}

  int64_t Register(Handle handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [known, id] : entries_) {
      if (known == handle) return id;
    }
    return AddLocked(handle, 0);
  }

  // A new id, whether or not the handle is in the table already.
  int64_t Add(Handle handle, uint64_t tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    return AddLocked(handle, tag);
  }

  Found Lookup(int64_t id, Handle* handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Found found = FindLocked(id);
    if (found != Found::kGone) *handle = entries_[Index(id)].first;
    return found;
  }

  // `id` names nothing from now on.
  void Retire(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (FindLocked(id) == Found::kYes) entries_[Index(id)].first = null_;
  }

 private:
  static size_t Index(int64_t id) {
    return static_cast<size_t>(id & ((int64_t{1} << kIndexBits) - 1));
  }

  Found FindLocked(int64_t id) const {
    if (id < 0 || Index(id) >= entries_.size() || entries_[Index(id)].first == null_)
      return Found::kGone;
    return entries_[Index(id)].second == id ? Found::kYes : Found::kOtherSize;
  }

  int64_t AddLocked(Handle handle, uint64_t tag) {
    if (entries_.size() >= (size_t{1} << kIndexBits)) {
      throw std::length_error(
          "mpijax: more than 2^24 communicators or reduction operators registered");
    }
    const auto id = static_cast<int64_t>(entries_.size() | (tag << kIndexBits));
    entries_.emplace_back(handle, id);
    return id;
  }

  std::mutex mutex_;
  std::vector<std::pair<Handle, int64_t>> entries_;
  const Handle null_;
};

// Never destroyed: handlers may run after static destructors.
Table<MPI_Comm>& Comms() {
  static auto* comms = new Table<MPI_Comm>(MPI_COMM_NULL);
  return *comms;
}

Table<MPI_Op>& Ops() {
  static auto* ops = new Table<MPI_Op>(MPI_OP_NULL);
  return *ops;
}

// MPI_Comm_free: a program compiled for the communicator must not reach the
// handle, which MPI may give to the next communicator it makes.
int RetireComm(MPI_Comm, int, void* attribute, void*) {
  Comms().Retire(static_cast<int64_t>(reinterpret_cast<intptr_t>(attribute)));
  return MPI_SUCCESS;
}

int FreeReversed(MPI_Comm, int, void* attribute, void*) {
  auto* reversed = static_cast<MPI_Comm*>(attribute);
  const int rc = MPI_Comm_free(reversed);
  delete reversed;
  return rc;
}

}  // namespace

// A communicator keeps its id as an attribute. One that is freed and one made
// later may share a handle but not the attribute, so the new one gets a new
// id, and the old id is retired when the attribute is deleted: compiled
// programs and JAX's caches (keyed by the id, and holding the old one's size
// in their shapes) never run on the new one.
int64_t RegisterComm(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) throw std::invalid_argument("cannot register MPI_COMM_NULL");
  static const int keyval = [] {
    int key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, RetireComm, &key, nullptr);
    return key;
  }();
  void* attribute = nullptr;
  int found = 0;
  if (keyval == MPI_KEYVAL_INVALID || MPI_Comm_get_attr(comm, keyval, &attribute, &found)) {
    return Comms().Register(comm);
  }
  if (found) return static_cast<int64_t>(reinterpret_cast<intptr_t>(attribute));
  int size = 0;
  MPI_Comm_size(comm, &size);
  const int64_t id = Comms().Add(comm, static_cast<uint64_t>(size));
  MPI_Comm_set_attr(comm, keyval, reinterpret_cast<void*>(static_cast<intptr_t>(id)));
  return id;
}

Found LookupComm(int64_t id, MPI_Comm* comm) { return Comms().Lookup(id, comm); }

namespace {
std::mutex abandoned_mutex;
std::map<int64_t, std::string>& Abandoned() {
  static auto* abandoned = new std::map<int64_t, std::string>();
  return *abandoned;
}
}  // namespace

void AbandonComm(int64_t id, const char* op) {
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  Abandoned().emplace(id, op);
}

std::string AbandonedBy(int64_t id) {
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  const auto it = Abandoned().find(id);
  return it == Abandoned().end() ? "" : it->second;
}

int64_t RegisterOp(MPI_Op op) {
  if (op == MPI_OP_NULL) throw std::invalid_argument("cannot register MPI_OP_NULL");
  return Ops().Register(op);
}

bool LookupOp(int64_t id, MPI_Op* op) { return Ops().Lookup(id, op) == Found::kYes; }

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
