// The path cache (Isometry section 4.2, last paragraph): a plan made once is reused for later
// transfers between the same memories with the same layouts. Caravan's key also holds the size
// class (the bit width of the byte count), the field sizes, the number of dimensions and which
// planner made the plan, so a plan for a 4 KiB copy is not reused for a 4 GiB one.
// A hit for a different index space of the same class keeps the path and its layouts and
// re-derives the blocking factors and request sizes for the new extents (Planner does this).
// Eviction drops the least recently used entry. Thread-safe: lookups take a shared lock.
#pragma once

#include <caravan/planner/plan.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

namespace caravan::planner {

struct PathCacheKey {
  std::uint64_t src = 0, dst = 0;  // MemoryId::key()
  Layout src_layout, dst_layout;
  // |F| and the smallest and largest field size, each kept whole (packed into one word they
  // collided once a field reached 4 KiB).
  std::uint64_t fields_total = 0;
  std::uint32_t field_min = 0, field_max = 0;
  std::uint8_t dims = 0;
  std::uint8_t size_class = 0;  // bit width of the payload byte count
  // For a region of larger instances: bit widths of the runs it keeps in each (region_run_bytes;
  // 0 for a whole instance), which bound the first and last hop's requests.
  std::uint8_t src_run_class = 0, dst_run_class = 0;
  PlannerKind planner = PlannerKind::full;

  static PathCacheKey of(const TransferRequest& request, PlannerKind planner);
  bool operator==(const PathCacheKey& other) const noexcept;
};

struct PathCacheKeyHash {
  std::size_t operator()(const PathCacheKey& key) const noexcept;
};

class PathCache {
 public:
  explicit PathCache(std::size_t capacity = 4096);

  struct Hit {
    std::shared_ptr<const Plan> plan;
    IndexSpace space;  // the space the plan was made for
  };
  std::optional<Hit> lookup(const PathCacheKey& key) const;
  void insert(const PathCacheKey& key, const IndexSpace& space, std::shared_ptr<const Plan> plan);
  void clear();

  std::size_t size() const;
  std::size_t capacity() const noexcept { return capacity_; }
  std::uint64_t hits() const noexcept { return hits_.load(std::memory_order_relaxed); }
  std::uint64_t misses() const noexcept { return misses_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    std::shared_ptr<const Plan> plan;
    IndexSpace space;
    // Stamped on every hit under the shared lock, hence atomic; eviction reads it under the
    // exclusive lock and drops the smallest (least recently used).
    mutable std::atomic<std::uint64_t> last_used{0};
  };
  std::size_t capacity_;
  mutable std::shared_mutex mutex_;
  std::unordered_map<PathCacheKey, Entry, PathCacheKeyHash> entries_;
  mutable std::atomic<std::uint64_t> clock_{0};
  mutable std::atomic<std::uint64_t> hits_{0}, misses_{0};
};

}  // namespace caravan::planner
