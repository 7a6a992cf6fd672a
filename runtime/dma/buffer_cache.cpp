#include "runtime/dma/buffer_cache.h"

#include <vector>

namespace caravan::dma {

bool BufferCache::keeps(MemoryId memory) {
  return memory.kind == MemoryKind::sys || memory.kind == MemoryKind::zcm || memory.kind == MemoryKind::fbm;
}

std::shared_ptr<Storage> BufferCache::take(MemoryId memory, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  auto it = idle_.find(memory);
  if (it == idle_.end()) return nullptr;
  Idle& idle = it->second;
  auto best = idle.oldest_first.end();
  for (auto b = idle.oldest_first.begin(); b != idle.oldest_first.end(); ++b) {
    const std::uint64_t size = (*b)->bytes();
    // At most a quarter larger than asked: the pool charges the size asked for, so a larger
    // buffer holds memory the pool does not count.
    if (size < bytes || size - bytes > bytes / 4) continue;
    if (best == idle.oldest_first.end() || size < (*best)->bytes()) best = b;
  }
  if (best == idle.oldest_first.end()) return nullptr;
  std::shared_ptr<Storage> out = std::move(*best);
  idle.oldest_first.erase(best);
  idle.total -= out->bytes();
  return out;
}

void BufferCache::give(std::shared_ptr<Storage> storage) {
  if (!storage || !keeps(storage->memory()) || storage->bytes() > limit_) return;
  std::vector<std::shared_ptr<Storage>> freed;  // destroyed after the lock is released
  std::lock_guard lock(mutex_);
  if (closed_) {
    freed.push_back(std::move(storage));  // the engine is shutting down: keep nothing
    return;
  }
  Idle& idle = idle_[storage->memory()];
  while (idle.total + storage->bytes() > limit_) {
    idle.total -= idle.oldest_first.front()->bytes();
    freed.push_back(std::move(idle.oldest_first.front()));
    idle.oldest_first.pop_front();
  }
  idle.total += storage->bytes();
  idle.oldest_first.push_back(std::move(storage));
}

void BufferCache::close() {
  std::map<MemoryId, Idle> freed;  // destroyed after the lock is released
  std::lock_guard lock(mutex_);
  closed_ = true;
  freed.swap(idle_);
}

std::uint64_t BufferCache::idle_bytes(MemoryId memory) {
  std::lock_guard lock(mutex_);
  auto it = idle_.find(memory);
  return it == idle_.end() ? 0 : it->second.total;
}

}  // namespace caravan::dma
