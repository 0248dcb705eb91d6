#include "pending.h"

#include <map>
#include <mutex>
#include <utility>

namespace mpijax {
namespace {

std::mutex mutex;
std::map<int32_t, Pending> kept;
int32_t last = 0;

}  // namespace

int32_t Keep(Pending pending) {
  std::lock_guard<std::mutex> lock(mutex);
  do {
    last = last + 1 == kDifferentiated ? 1 : last + 1;
  } while (kept.count(last));
  kept.emplace(last, std::move(pending));
  return last;
}

std::optional<Pending> Take(int32_t id) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kept.find(id & ~kDifferentiated);
  if (it == kept.end()) return std::nullopt;
  Pending pending = std::move(it->second);
  kept.erase(it);
  return pending;
}

size_t PendingCount() {
  std::lock_guard<std::mutex> lock(mutex);
  return kept.size();
}

}  // namespace mpijax
