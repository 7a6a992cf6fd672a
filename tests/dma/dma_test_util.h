// Helpers for DMA tests: deterministic random contents per (point, field), poisoning and
// verification of whole instances through their own linearizations.
#pragma once

#include "tests/runtime/test_util.h"

#include <caravan/copy.h>

#include <cstring>
#include <random>
#include <vector>

namespace caravan::test {

inline MemoryId sys_memory() { return MemoryId{0, 0, MemoryKind::sys, 0}; }
inline MemoryId dsk_memory() { return MemoryId{0, 0, MemoryKind::dsk, 0}; }

template <class Fn>
void for_each_point(const Rect& r, Fn fn) {
  Point p = r.lo();
  for (;;) {
    fn(p);
    int d = 0;
    for (; d < r.dims(); ++d) {
      auto i = static_cast<std::size_t>(d);
      if (p[i] < r.hi()[i]) {
        ++p[i];
        break;
      }
      p[i] = r.lo()[i];
    }
    if (d == r.dims()) return;
  }
}

inline std::byte value_byte(std::uint64_t seed, const Point& p, std::size_t field, std::size_t k) {
  std::uint64_t h = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(p[0]) * 0xBF58476D1CE4E5B9ull) ^
                    (static_cast<std::uint64_t>(p[1]) * 0x94D049BB133111EBull) ^ (static_cast<std::uint64_t>(p[2]) << 40) ^
                    (static_cast<std::uint64_t>(p[3]) << 52) ^ (field * 0x2545F4914F6CDD1Dull) ^ (k << 7);
  h ^= h >> 31;
  h *= 0x7FB5D329728EA185ull;
  h ^= h >> 27;
  return static_cast<std::byte>(h & 0xff);
}

// Reads the whole footprint (host or file).
inline std::vector<std::byte> footprint(const Instance& inst) {
  std::vector<std::byte> bytes(inst.footprint_bytes());
  inst.read_bytes(0, bytes);
  return bytes;
}

inline void poison(const Instance& inst, std::byte value = std::byte{0xAB}) {
  std::vector<std::byte> bytes(inst.footprint_bytes(), value);
  inst.write_bytes(0, bytes);
}

inline void write_pattern(const Instance& inst, std::uint64_t seed) {
  std::vector<std::byte> bytes(inst.footprint_bytes(), std::byte{0});
  const FieldSpace& fields = inst.fields();
  for_each_point(inst.space(), [&](const Point& p) {
    for (std::size_t f = 0; f < fields.count(); ++f)
      for (std::size_t k = 0; k < fields.fields()[f].size; ++k) bytes[inst.offset(p, f) + k] = value_byte(seed, p, f, k);
  });
  inst.write_bytes(0, bytes);
}

// Counts (point, field) values that differ from the pattern.
inline std::uint64_t count_mismatches(const Instance& inst, std::uint64_t seed) {
  std::vector<std::byte> bytes = footprint(inst);
  const FieldSpace& fields = inst.fields();
  std::uint64_t bad = 0;
  for_each_point(inst.space(), [&](const Point& p) {
    for (std::size_t f = 0; f < fields.count(); ++f)
      for (std::size_t k = 0; k < fields.fields()[f].size; ++k)
        if (bytes[inst.offset(p, f) + k] != value_byte(seed, p, f, k)) {
          ++bad;
          break;
        }
  });
  return bad;
}

// After a copy of `region` (CopyOptions::region) into `inst`, poisoned with `untouched` before:
// the (point, field) values inside the region that differ from the pattern, and those outside it
// that the copy changed (it must leave them alone).
struct RegionCheck {
  std::uint64_t wrong_inside = 0;
  std::uint64_t changed_outside = 0;
};
inline RegionCheck check_region(const Instance& inst, std::uint64_t seed, const Rect& region,
                                std::byte untouched = std::byte{0xAB}) {
  std::vector<std::byte> bytes = footprint(inst);
  const FieldSpace& fields = inst.fields();
  RegionCheck out;
  for_each_point(inst.space(), [&](const Point& p) {
    const bool inside = region.contains(p);
    for (std::size_t f = 0; f < fields.count(); ++f)
      for (std::size_t k = 0; k < fields.fields()[f].size; ++k) {
        const std::byte b = bytes[inst.offset(p, f) + k];
        if (inside ? b != value_byte(seed, p, f, k) : b != untouched) {
          ++(inside ? out.wrong_inside : out.changed_outside);
          break;
        }
      }
  });
  return out;
}

// The index of point `p` in the order that runs dimension 0 fastest from space.lo() (what
// CopyTile::first_point counts).
inline std::uint64_t linear_index(const Rect& space, const Point& p) {
  std::uint64_t index = 0, stride = 1;
  for (int d = 0; d < space.dims(); ++d) {
    auto k = static_cast<std::size_t>(d);
    index += static_cast<std::uint64_t>(p[k] - space.lo()[k]) * stride;
    stride *= static_cast<std::uint64_t>(space.extent(d));
  }
  return index;
}

}  // namespace caravan::test
