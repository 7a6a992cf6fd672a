// Turning "copy this tile from layout A to layout B" into byte operations.
//
// The DMA engine cuts an instance into tiles (slabs of the index space, TileGrid) and moves
// the tiles down the planned path one after another, so hops pipeline tile by tile. Each tile
// copy between two views becomes a list of TransferOps: strided copies of `count` elements of
// `elem` bytes. The walker makes rows along the destination's innermost dimension, and fuses
// rows that are contiguous in both views into single runs, so identical layouts become a few
// large memcpys and a conversion becomes strided gathers or scatters.
#pragma once

#include <caravan/layout.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace caravan::dma {

// One strided copy, in `rows` rows: element i of row r goes from
// src + r * src_row_stride + i * src_stride to dst + r * dst_row_stride + i * dst_stride.
// count == 1 is a contiguous run of `elem` bytes. src_stride == 0 replicates one element (fill).
// Rows let one op stand for every row of a 2-D tile whose rows sit at one distance from each
// other in both views (a sub-rectangle, or `F,x,y` -> `x,F,y`): such a tile of 4096 rows and
// three fields was 12288 ops, each built, grouped and cut on the host before the first request
// could leave (the 2-D conversion within a GPU spent 0.4-0.6 ms there against 0.14 ms of kernels).
struct TransferOp {
  std::uint64_t src = 0;
  std::uint64_t dst = 0;
  std::uint64_t elem = 0;
  std::uint64_t count = 1;
  std::int64_t src_stride = 0;
  std::int64_t dst_stride = 0;
  std::uint64_t rows = 1;
  std::int64_t src_row_stride = 0;
  std::int64_t dst_row_stride = 0;
  std::uint64_t row_bytes() const noexcept { return elem * count; }
  std::uint64_t bytes() const noexcept { return elem * count * rows; }
  // Rows [first, first + n).
  TransferOp rows_from(std::uint64_t first, std::uint64_t n) const noexcept {
    TransferOp part = *this;
    part.src = static_cast<std::uint64_t>(static_cast<std::int64_t>(src) + static_cast<std::int64_t>(first) * src_row_stride);
    part.dst = static_cast<std::uint64_t>(static_cast<std::int64_t>(dst) + static_cast<std::int64_t>(first) * dst_row_stride);
    part.rows = n;
    if (n == 1) part.src_row_stride = part.dst_row_stride = 0;
    return part;
  }
  // Row r alone (an op of one row).
  TransferOp row(std::uint64_t r) const noexcept { return rows_from(r, 1); }
};

// Cuts the first `bytes` bytes off `op`, which must be longer than that, and returns them; `op`
// keeps the rest. An op of one row is cut at whole elements (rounded down, at least one); an op
// of several rows at whole rows (rounded down, at least one).
TransferOp split_front(TransferOp& op, std::uint64_t bytes);

// How the points of some rectangle sit in a storage: a layout over that rectangle starting at
// `base`, or (for fill) a pattern that maps every point to the same |F| bytes.
class View {
 public:
  static View of_layout(const Layout& layout, const Rect& rect, const FieldSpace& fields, std::uint64_t base);
  static View pattern(const FieldSpace& fields);

  std::uint64_t offset(const Point& point, std::size_t field) const {
    if (!lin_) return fields_->offset(field);
    return base_ + lin_->offset(point, field);
  }
  // The distance in bytes between a field of neighbouring points along `dim`, where it is the
  // same everywhere (dimension_stride: not blocked); a pattern's is 0.
  std::optional<std::int64_t> stride(int dim, std::size_t field) const {
    if (!lin_) return 0;
    return lin_->dimension_stride(dim, field);
  }
  // F is the densest component: all fields of a point are adjacent.
  bool fields_innermost() const noexcept { return fields_innermost_; }
  // The densest dimension component, or -1 (pattern).
  int innermost_dim() const noexcept { return innermost_dim_; }

 private:
  std::optional<Linearization> lin_;
  const FieldSpace* fields_ = nullptr;
  std::uint64_t base_ = 0;
  bool fields_innermost_ = false;
  int innermost_dim_ = -1;
};

// Appends the ops that copy every (point, field) of `tile` from `src` to `dst`.
void append_tile_ops(const Rect& tile, const FieldSpace& fields, const View& src, const View& dst,
                     std::vector<TransferOp>& out);

// An index space cut into slabs of at most `target_points` points: whole extents in the
// dimensions below split_dim, a range of `thickness` in split_dim, single coordinates above it.
class TileGrid {
 public:
  TileGrid() = default;
  TileGrid(const Rect& space, std::uint64_t target_points);
  std::uint64_t count() const noexcept { return count_; }
  Rect tile(std::uint64_t index) const;
  // The largest tile (the first one).
  Rect largest() const { return tile(0); }

 private:
  Rect space_;
  int split_dim_ = 0;
  std::int64_t thickness_ = 1;
  std::uint64_t per_column_ = 1;  // tiles along split_dim
  std::uint64_t count_ = 0;
};

}  // namespace caravan::dma
