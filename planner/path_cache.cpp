#include <caravan/planner/path_cache.h>
#include <caravan/planner/planner.h>

#include <bit>
#include <limits>
#include <mutex>

namespace caravan::planner {

PathCacheKey PathCacheKey::of(const TransferRequest& request, PlannerKind planner) {
  PathCacheKey key;
  key.src = request.src.key();
  key.dst = request.dst.key();
  key.src_layout = request.src_layout;
  key.dst_layout = request.dst_layout;
  key.fields_total = request.fields.total_size();
  key.field_min = request.fields.min_size();
  key.field_max = request.fields.max_size();
  key.dims = static_cast<std::uint8_t>(request.space.dims());
  key.size_class = static_cast<std::uint8_t>(std::bit_width(request.bytes()));
  if (request.src_instance_space)
    key.src_run_class = static_cast<std::uint8_t>(std::bit_width(
        region_run_bytes(request.src_layout, *request.src_instance_space, request.space, request.fields)));
  if (request.dst_instance_space)
    key.dst_run_class = static_cast<std::uint8_t>(std::bit_width(
        region_run_bytes(request.dst_layout, *request.dst_instance_space, request.space, request.fields)));
  key.planner = planner;
  return key;
}

bool PathCacheKey::operator==(const PathCacheKey& o) const noexcept {
  return src == o.src && dst == o.dst && fields_total == o.fields_total && field_min == o.field_min &&
         field_max == o.field_max && dims == o.dims && size_class == o.size_class && src_run_class == o.src_run_class &&
         dst_run_class == o.dst_run_class && planner == o.planner && src_layout == o.src_layout &&
         dst_layout == o.dst_layout;
}

std::size_t PathCacheKeyHash::operator()(const PathCacheKey& k) const noexcept {
  std::uint64_t h = k.src * 0x9e3779b97f4a7c15ull;
  h ^= k.dst + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= k.fields_total + (h << 6) + (h >> 2);
  h ^= (static_cast<std::uint64_t>(k.field_min) << 32 | k.field_max) + (h << 6) + (h >> 2);
  h ^= (static_cast<std::uint64_t>(k.src_run_class) << 32 | static_cast<std::uint64_t>(k.dst_run_class) << 24 |
        static_cast<std::uint64_t>(k.dims) << 16 | static_cast<std::uint64_t>(k.size_class) << 8 |
        static_cast<std::uint64_t>(k.planner)) +
       (h << 6) + (h >> 2);
  h ^= k.src_layout.hash() + (h << 6) + (h >> 2);
  h ^= k.dst_layout.hash() + (h << 6) + (h >> 2);
  return static_cast<std::size_t>(h);
}

PathCache::PathCache(std::size_t capacity) : capacity_(capacity) {}

std::optional<PathCache::Hit> PathCache::lookup(const PathCacheKey& key) const {
  std::shared_lock lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    misses_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  it->second.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed), std::memory_order_relaxed);
  hits_.fetch_add(1, std::memory_order_relaxed);
  return Hit{it->second.plan, it->second.space};
}

void PathCache::insert(const PathCacheKey& key, const IndexSpace& space, std::shared_ptr<const Plan> plan) {
  if (capacity_ == 0) return;
  std::unique_lock lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end() && entries_.size() >= capacity_) {
    // Least recently used out. O(entries), but only on a miss, which has just paid for planning.
    auto victim = entries_.begin();
    std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
    for (auto e = entries_.begin(); e != entries_.end(); ++e) {
      auto used = e->second.last_used.load(std::memory_order_relaxed);
      if (used < oldest) {
        oldest = used;
        victim = e;
      }
    }
    entries_.erase(victim);
  }
  Entry& entry = entries_[key];
  entry.plan = std::move(plan);
  entry.space = space;
  entry.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed), std::memory_order_relaxed);
}

void PathCache::clear() {
  std::unique_lock lock(mutex_);
  entries_.clear();
}

std::size_t PathCache::size() const {
  std::shared_lock lock(mutex_);
  return entries_.size();
}

}  // namespace caravan::planner
