#include "tags.h"

#include <mpi.h>

namespace mpijax {
namespace {

int TagUpperBound() {
  static const int upper = [] {
    void* value = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &found);
    return found ? *static_cast<int*>(value) : 32767;  // the least MPI allows
  }();
  return upper;
}

// The derivative tags start right after the users' tags and end below check
// mode's four.
int DerivativeBase() { return LargestTag() + 1; }

}  // namespace

int LargestTag() { return (TagUpperBound() - 5) / 2; }

int DerivativeTag(int tag) {
  return tag < 0 || IsDerivativeTag(tag) ? tag : tag + DerivativeBase();
}

bool IsDerivativeTag(int tag) { return tag >= DerivativeBase() && tag <= TagUpperBound() - 4; }

std::string TagName(int tag) {
  if (tag == MPI_ANY_TAG) return "ANY_TAG";
  if (!IsDerivativeTag(tag)) return std::to_string(tag);
  return std::to_string(tag) + " (derivatives of tag " + std::to_string(tag - DerivativeBase()) +
         ")";
}

int CheckTag(bool reply, bool derivative) {
  return TagUpperBound() - (derivative ? 2 : 0) - (reply ? 0 : 1);
}

}  // namespace mpijax
