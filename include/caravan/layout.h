// The data model of Isometry (ICS'18, section 2): index spaces, field spaces, layouts, and how a
// layout linearizes an instance into bytes. The planner reasons about copies only through these
// types; the DMA engine uses the same linearization to address requests.
//
// A layout is a vector of components, densest first:
//   F            the whole field space (all fields of one point, packed in declaration order)
//   x            a whole dimension (x, y, z, w are dimensions 0..3)
//   x_in=C       the inner part of a blocked dimension: C consecutive coordinates
//   x_out        the outer part of a blocked dimension: which block
// F appears exactly once; every dimension of the index space appears either whole, or as both
// x_in=C and x_out. Text form: components separated by commas, e.g. "F,x" (AOS), "x,F" (SOA),
// "x_in=4,F,x_out" (hybrid), "F,x,y" (row-major when x is the column), "x_in=3,y_in=3,x_out,y_out,F".
//
// Extents that the block size does not divide: the outer extent is rounded up,
// |x_out| = ceil(|x| / C), and the last block is padded. Padding bytes belong to the instance's
// footprint (total_bytes) but hold no point: copies never read or write them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace caravan {

inline constexpr int kMaxDims = 4;

// A point of an index space; only the first `dims` coordinates of the owning space are used.
using Point = std::array<std::int64_t, kMaxDims>;

// A dense N-dimensional rectangle (N = 1..4), bounds inclusive on both ends.
class Rect {
 public:
  Rect() = default;
  // The rectangle [0, extents[d]) in each dimension. Throws Error(invalid_argument) for 0 or more
  // than 4 dimensions, an extent < 1, or more than 2^63 - 1 points in all.
  static Rect from_extents(const std::vector<std::int64_t>& extents);
  // [lo, hi] inclusive; throws Error(invalid_argument) if hi < lo in some dimension, or for more
  // than 2^63 - 1 points (in one dimension or in all).
  Rect(int dims, const Point& lo, const Point& hi);

  int dims() const noexcept { return dims_; }
  const Point& lo() const noexcept { return lo_; }
  const Point& hi() const noexcept { return hi_; }
  std::int64_t extent(int d) const noexcept { return hi_[static_cast<std::size_t>(d)] - lo_[static_cast<std::size_t>(d)] + 1; }
  std::uint64_t volume() const noexcept;
  bool contains(const Point& p) const noexcept;
  // Every point of `other` is here: the same number of dimensions and both corners inside (false
  // for an empty Rect).
  bool contains(const Rect& other) const noexcept;
  bool operator==(const Rect& other) const noexcept;

  // "[0,9]x[0,4]"
  std::string to_string() const;

 private:
  int dims_ = 0;
  Point lo_{};
  Point hi_{};
};

// Isometry's index space: the set of points of an instance. Caravan's are dense rectangles.
using IndexSpace = Rect;

// One named field with its byte size.
struct Field {
  std::string name;
  std::uint32_t size = 0;
};

// The values stored for every point. Fields are packed in declaration order wherever the
// layout keeps them together. Immutable once made, so copies share the field list: a copy is a
// reference count, not an allocation (every copy() call copies the field space of its
// instances).
class FieldSpace {
 public:
  FieldSpace() = default;
  // Throws Error(invalid_argument) for an empty list, a zero size, or a repeated name.
  explicit FieldSpace(std::vector<Field> fields);
  // n unnamed fields ("f0", "f1"...) of `size` bytes each.
  static FieldSpace uniform(int count, std::uint32_t size);

  const std::vector<Field>& fields() const noexcept;
  std::size_t count() const noexcept { return fields().size(); }
  std::uint64_t total_size() const noexcept { return total_; }        // |F| in bytes
  std::uint32_t min_size() const noexcept { return min_; }
  std::uint32_t max_size() const noexcept { return max_; }
  // Within F; throws Error(invalid_argument) past count().
  std::uint64_t offset(std::size_t field) const {
    if (!data_ || field >= data_->offsets.size()) throw_no_field(field);
    return data_->offsets[field];
  }
  std::size_t index_of(std::string_view name) const;  // throws Error(not_found)
  bool operator==(const FieldSpace& other) const noexcept;

 private:
  struct Data {
    std::vector<Field> fields;
    std::vector<std::uint64_t> offsets;
  };
  [[noreturn]] void throw_no_field(std::size_t field) const;
  std::shared_ptr<const Data> data_;  // null: the empty field space
  std::uint64_t total_ = 0;
  std::uint32_t min_ = 0, max_ = 0;
};

// One component of a layout vector.
struct LayoutComponent {
  enum class Kind : std::uint8_t { fields, dim, dim_in, dim_out };
  Kind kind = Kind::fields;
  std::uint8_t dim = 0;     // for dim, dim_in, dim_out
  std::uint64_t block = 0;  // for dim_in: C

  static LayoutComponent fields() { return {Kind::fields, 0, 0}; }
  static LayoutComponent whole(int d) { return {Kind::dim, static_cast<std::uint8_t>(d), 0}; }
  static LayoutComponent inner(int d, std::uint64_t c) { return {Kind::dim_in, static_cast<std::uint8_t>(d), c}; }
  static LayoutComponent outer(int d) { return {Kind::dim_out, static_cast<std::uint8_t>(d), 0}; }
  bool operator==(const LayoutComponent&) const = default;
};

// A layout: at most 1 + 2 * kMaxDims components, stored inline (no allocation), so that the
// planner can copy and compare layouts in its inner loops.
class Layout {
 public:
  static constexpr std::size_t kMaxComponents = 1 + 2 * kMaxDims;

  Layout() = default;
  Layout(std::initializer_list<LayoutComponent> components);

  // Parses the text form ("F,x_in=4,x_out"; whitespace and surrounding "<>" are allowed).
  // Checks the syntax and that no component repeats; throws Error(invalid_argument) naming the
  // offending component. Whether it fits an index space is checked by validate().
  static Layout parse(std::string_view text);
  // Common layouts for a `dims`-dimensional space.
  static Layout aos(int dims);   // F,x,y,...
  static Layout soa(int dims);   // x,y,...,F
  static Layout hybrid(std::uint64_t block);  // x_in=block,F,x_out (1-D)

  // Checks the rules of section 2 against a space of `dims` dimensions: F exactly once; each
  // dimension either whole or as an in/out pair; no dimension beyond the space; blocks >= 1.
  // Throws Error(invalid_argument) with `what` (e.g. "dst layout") and the rule broken.
  void validate(int dims, std::string_view what = "layout") const;

  std::size_t size() const noexcept { return count_; }
  const LayoutComponent& operator[](std::size_t i) const noexcept { return items_[i]; }
  const LayoutComponent* begin() const noexcept { return items_.data(); }
  const LayoutComponent* end() const noexcept { return items_.data() + count_; }
  void push_back(const LayoutComponent& c);  // throws past kMaxComponents
  bool operator==(const Layout& other) const noexcept;
  std::size_t hash() const noexcept;

  std::string to_string() const;

 private:
  std::array<LayoutComponent, kMaxComponents> items_{};
  std::size_t count_ = 0;
};

// The size |l(k)| of a component over `space`: |F| in bytes for F, the extent for x, C for
// x_in=C, ceil(|x| / C) for x_out.
std::uint64_t component_size(const Layout& layout, std::size_t k, const IndexSpace& space,
                             const FieldSpace& fields);

// Byte offset of (point, field) under a layout, relative to the start of the instance, and the
// instance's footprint. Strides are computed once; offset() is a handful of multiply-adds.
class Linearization {
 public:
  // Validates the layout against the space; throws Error(invalid_argument), also when the
  // footprint would exceed 2^64 - 1 bytes.
  Linearization(const Layout& layout, const IndexSpace& space, const FieldSpace& fields);

  std::uint64_t offset(const Point& point, std::size_t field) const;
  // The distance in bytes from (point, field) to the same field one coordinate further along
  // `dim`, when it is the same at every point: the dimension is whole in the layout, not blocked.
  // Empty for a blocked dimension.
  std::optional<std::int64_t> dimension_stride(int dim, std::size_t field) const;
  // TOTAL(l) in bytes, padding included.
  std::uint64_t total_bytes() const noexcept { return total_; }

 private:
  struct Term {
    int dim;           // which coordinate
    std::uint64_t div; // coordinate / div % mod selects this component's digit
    std::uint64_t mod;
    std::uint64_t weight;  // units of this digit: see offset()
  };
  const FieldSpace* fields_;
  Point lo_{};
  std::vector<Term> inner_;  // components before F: weight counts values of one field
  std::vector<Term> outer_;  // components after F: weight counts bytes
  std::uint64_t inner_count_ = 1;
  std::uint64_t total_ = 0;
};

// Section 4.2 quantities between two layouts of one instance, in bytes.
//   prefix_bytes:  PREFIX(l1, l2), the length of the runs both layouts keep contiguous, i.e. the
//                  largest request one hop can send. When the common prefix does not include F a
//                  run holds values of one field, so the product of the prefix components is
//                  multiplied by the smallest field size.
//   shuffle_bytes: SUFFIX-bar(l1, l2) = TOTAL / SUFFIX, the data one must hold to reorder between
//                  the layouts (the lower bound on both buffers of a hop between intermediate
//                  buffers). When F is part of the common suffix, fields are reordered one at a
//                  time, so the product is multiplied by the largest field size instead.
//   total_bytes:   TOTAL(l) with padding.
// To compare them, whole dimensions are split to match a blocked dimension of the other layout
// when the block divides the extent ("x" equals "x_in=C,x_out"); dimensions blocked differently
// never match. Both throw Error(invalid_argument) when a layout does not fit the space.
std::uint64_t prefix_bytes(const Layout& l1, const Layout& l2, const IndexSpace& space, const FieldSpace& fields);
std::uint64_t shuffle_bytes(const Layout& l1, const Layout& l2, const IndexSpace& space, const FieldSpace& fields);
std::uint64_t total_bytes(const Layout& layout, const IndexSpace& space, const FieldSpace& fields);
// The longest run of bytes that the points of `region` occupy contiguously in an instance of
// `instance_space` laid out by `layout` (counted as prefix_bytes counts: in one field's values
// until F is reached). Components are taken fastest first while the region spans the whole
// extent; the first one it does not span ends the run, which then holds the region's extent
// there. A blocked dimension the region does not span goes on through one of the whole blocks
// it holds (blocks count from the instance's lo), and ends at its outer part with the number of
// those blocks; a region holding no whole block ends at the inner part with its longest piece
// within one block. Equals prefix_bytes(layout, layout, region, fields) when the region is the
// whole space.
// Throws Error(invalid_argument) when the layout does not fit the space or the region is not
// inside it.
std::uint64_t region_run_bytes(const Layout& layout, const IndexSpace& instance_space, const IndexSpace& region,
                               const FieldSpace& fields);

// Dimension names used by the text form: x, y, z, w.
char dim_name(int d);

}  // namespace caravan
