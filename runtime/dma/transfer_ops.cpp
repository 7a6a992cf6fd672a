#include "runtime/dma/transfer_ops.h"

#include "runtime/dma/interleave.h"

#include <algorithm>
#include <array>

namespace caravan::dma {

TransferOp split_front(TransferOp& op, std::uint64_t bytes) {
  if (op.rows > 1) {
    // At least one row, and one left (bytes < op.bytes(), the caller's promise, gives that too).
    const std::uint64_t n = std::clamp<std::uint64_t>(bytes / op.row_bytes(), 1, op.rows - 1);
    TransferOp head = op.rows_from(0, n);
    op = op.rows_from(n, op.rows - n);
    return head;
  }
  TransferOp head = op;
  if (op.count == 1) {
    head.elem = bytes;
    op.src += bytes;
    op.dst += bytes;
    op.elem -= bytes;
    return head;
  }
  std::uint64_t n = std::max<std::uint64_t>(bytes / op.elem, 1);  // < op.count since bytes < op.bytes()
  head.count = n;
  op.src = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.src) + static_cast<std::int64_t>(n) * op.src_stride);
  op.dst = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.dst) + static_cast<std::int64_t>(n) * op.dst_stride);
  op.count -= n;
  return head;
}

View View::of_layout(const Layout& layout, const Rect& rect, const FieldSpace& fields, std::uint64_t base) {
  View v;
  v.lin_.emplace(layout, rect, fields);
  v.fields_ = &fields;
  v.base_ = base;
  v.fields_innermost_ = layout.size() > 0 && layout[0].kind == LayoutComponent::Kind::fields;
  for (const auto& c : layout) {
    if (c.kind != LayoutComponent::Kind::fields) {
      v.innermost_dim_ = c.dim;
      break;
    }
  }
  return v;
}

View View::pattern(const FieldSpace& fields) {
  View v;
  v.fields_ = &fields;
  v.fields_innermost_ = true;
  return v;
}

namespace {

struct Walker {
  const View& src;
  const View& dst;
  std::vector<TransferOp>& out;
  std::size_t field;
  std::uint64_t elem;
  int row_dim;

  void append(const TransferOp& op) {
    bool contiguous = op.count == 1 || (op.src_stride == static_cast<std::int64_t>(op.elem) &&
                                        op.dst_stride == static_cast<std::int64_t>(op.elem));
    TransferOp run = op;
    if (contiguous && op.count > 1) {
      run.elem = op.elem * op.count;
      run.count = 1;
      run.src_stride = run.dst_stride = 0;
    }
    if (run.rows > 1) {
      // Rows that continue each other on both sides are one longer row.
      const auto row_src = run.count == 1 ? static_cast<std::int64_t>(run.elem) : static_cast<std::int64_t>(run.count) * run.src_stride;
      const auto row_dst = run.count == 1 ? static_cast<std::int64_t>(run.elem) : static_cast<std::int64_t>(run.count) * run.dst_stride;
      if (run.src_row_stride == row_src && run.dst_row_stride == row_dst) {
        if (run.count == 1) run.elem *= run.rows;
        else run.count *= run.rows;
        run.rows = 1;
        run.src_row_stride = run.dst_row_stride = 0;
      }
    }
    if (!out.empty()) {
      TransferOp& last = out.back();
      // Fuse with the previous run when both sides continue exactly where it ended.
      if (run.count == 1 && run.rows == 1 && last.count == 1 && last.rows == 1 && last.src + last.elem == run.src &&
          last.dst + last.elem == run.dst) {
        last.elem += run.elem;
        return;
      }
      // Or with the previous op of rows when these are its next rows.
      if (run.rows > 1 && last.rows > 1 && last.elem == run.elem && last.count == run.count &&
          last.src_stride == run.src_stride && last.dst_stride == run.dst_stride &&
          last.src_row_stride == run.src_row_stride && last.dst_row_stride == run.dst_row_stride &&
          last.row(last.rows).src == run.src && last.row(last.rows).dst == run.dst) {
        last.rows += run.rows;
        return;
      }
    }
    out.push_back(run);
  }

  // Emits the row of `n` elements starting at `start` along row_dim, splitting it where either
  // view stops being an arithmetic progression (block boundaries of blocked layouts).
  void row(Point start, std::int64_t n) {
    std::uint64_t s0 = src.offset(start, field), d0 = dst.offset(start, field);
    if (n == 1) {
      append({s0, d0, elem, 1, 0, 0});
      return;
    }
    Point next = start, last = start;
    next[static_cast<std::size_t>(row_dim)] += 1;
    last[static_cast<std::size_t>(row_dim)] += n - 1;
    auto ss = static_cast<std::int64_t>(src.offset(next, field) - s0);
    auto ds = static_cast<std::int64_t>(dst.offset(next, field) - d0);
    auto sl = static_cast<std::int64_t>(src.offset(last, field) - s0);
    auto dl = static_cast<std::int64_t>(dst.offset(last, field) - d0);
    // Offsets along a dimension are piecewise linear (linear within a block); if both ends
    // agree with the first step, the whole row is linear (see the note in docs/dma.md).
    if (sl == ss * (n - 1) && dl == ds * (n - 1)) {
      append({s0, d0, elem, static_cast<std::uint64_t>(n), ss, ds});
      return;
    }
    std::int64_t half = n / 2;
    row(start, half);
    Point mid = start;
    mid[static_cast<std::size_t>(row_dim)] += half;
    row(mid, n - half);
  }
};

// A tile whose ops are, field by field, the same number of ops of rows (one per plane of a 3-D
// sub-box whose planes do not continue each other: ops[field_first[f] + p]) lists each plane's
// fields next to each other instead, where that makes them a group (op_group_at: the fields
// interleave on one side) and the field-by-field order did not already: a conversion then moves
// a plane's fields in one pass instead of one pass per field. The ops of a tile are disjoint, so
// their order changes nothing else.
void interleave_planes(std::vector<TransferOp>& out, const std::vector<std::size_t>& field_first) {
  const std::size_t fields = field_first.size() - 1, first = field_first.front();
  if (fields < 2) return;
  const std::size_t planes = field_first[1] - field_first[0];
  if (planes < 2) return;
  for (std::size_t f = 0; f < fields; ++f)
    if (field_first[f + 1] - field_first[f] != planes) return;
  for (std::size_t i = first; i < out.size(); ++i)
    if (out[i].rows < 2) return;
  if (op_group_at(out.data() + first, out.size() - first, 0).members >= 2) return;  // groups as it is
  std::vector<TransferOp> by_plane;
  by_plane.reserve(fields * planes);
  for (std::size_t p = 0; p < planes; ++p)
    for (std::size_t f = 0; f < fields; ++f) by_plane.push_back(out[field_first[f] + p]);
  if (op_group_at(by_plane.data(), by_plane.size(), 0).members < 2) return;
  std::copy(by_plane.begin(), by_plane.end(), out.begin() + static_cast<std::ptrdiff_t>(first));
}

}  // namespace

void append_tile_ops(const Rect& tile, const FieldSpace& fields, const View& src, const View& dst,
                     std::vector<TransferOp>& out) {
  const int dims = tile.dims();
  // Whole points move as one element when both sides keep a point's fields together.
  const bool whole_points = src.fields_innermost() && dst.fields_innermost();
  int row_dim = dst.innermost_dim();
  if (row_dim < 0 || row_dim >= dims) row_dim = 0;
  const std::int64_t row_length = tile.extent(row_dim);
  const std::size_t field_groups = whole_points ? 1 : fields.count();
  std::vector<TransferOp> first_row;
  std::vector<std::size_t> field_first;  // where each field's ops begin in `out`, then the end
  for (std::size_t f = 0; f < field_groups; ++f) {
    field_first.push_back(out.size());
    const std::uint64_t elem = whole_points ? fields.total_size() : fields.fields()[f].size;
    Walker w{src, dst, out, f, elem, row_dim};
    // Where both views step evenly along every dimension but the row's (none is blocked), each
    // row is the first one moved by those steps (offsets add up per dimension): the first row is
    // walked once and the others are its ops moved. Walking each row took six offset() calls, a
    // few divisions each: for a 2-D conversion of 12288 rows, 1.0-1.5 ms against 0.16-0.18 ms
    // moving the first row's ops (build machine, a warm op list), where the GPU kernels that move
    // the tile's 48 MiB take 0.14 ms; ops of several rows (below) leave one op per field.
    std::array<std::int64_t, kMaxDims> src_step{}, dst_step{};
    bool even = true;
    for (int d = 0; d < dims && even; ++d) {
      if (d == row_dim) continue;
      const auto s = src.stride(d, f), t = dst.stride(d, f);
      even = s && t;
      if (even) src_step[static_cast<std::size_t>(d)] = *s, dst_step[static_cast<std::size_t>(d)] = *t;
    }
    // Where even, the rows along the first other dimension of the tile (with more than one
    // coordinate) are the rows of the first row's ops: one op per op of the first row and
    // coordinate of the dimensions above, instead of one per row.
    int rows_dim = -1;
    if (even) {
      first_row.clear();
      Walker{src, dst, first_row, f, elem, row_dim}.row(tile.lo(), row_length);
      for (int d = 0; d < dims && rows_dim < 0; ++d)
        if (d != row_dim && tile.extent(d) > 1) rows_dim = d;
    }
    const auto rows = static_cast<std::uint64_t>(rows_dim < 0 ? 1 : tile.extent(rows_dim));
    const std::int64_t src_row = rows_dim < 0 ? 0 : src_step[static_cast<std::size_t>(rows_dim)];
    const std::int64_t dst_row = rows_dim < 0 ? 0 : dst_step[static_cast<std::size_t>(rows_dim)];
    // Visit every row start: all coordinates of the tile except row_dim (and rows_dim, whose
    // rows the ops hold), dimension 0 fastest.
    Point p = tile.lo();
    std::int64_t src_shift = 0, dst_shift = 0;  // of row p from the first row, where even
    for (;;) {
      if (even) {
        for (TransferOp op : first_row) {
          op.src = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.src) + src_shift);
          op.dst = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.dst) + dst_shift);
          if (rows > 1) {
            op.rows = rows;
            op.src_row_stride = src_row;
            op.dst_row_stride = dst_row;
          }
          w.append(op);
        }
      } else {
        w.row(p, row_length);
      }
      int d = 0;
      for (; d < dims; ++d) {
        if (d == row_dim || d == rows_dim) continue;
        auto i = static_cast<std::size_t>(d);
        if (p[i] < tile.hi()[i]) {
          ++p[i];
          src_shift += src_step[i];
          dst_shift += dst_step[i];
          break;
        }
        src_shift -= src_step[i] * (tile.hi()[i] - tile.lo()[i]);
        dst_shift -= dst_step[i] * (tile.hi()[i] - tile.lo()[i]);
        p[i] = tile.lo()[i];
      }
      if (d == dims) break;
    }
  }
  field_first.push_back(out.size());
  interleave_planes(out, field_first);
}

TileGrid::TileGrid(const Rect& space, std::uint64_t target_points) : space_(space) {
  target_points = std::max<std::uint64_t>(target_points, 1);
  const int dims = space.dims();
  std::uint64_t below = 1;  // points in one slice of dimensions below split_dim_
  split_dim_ = dims - 1;
  for (int d = 0; d < dims; ++d) {
    auto extent = static_cast<std::uint64_t>(space.extent(d));
    if (below * extent > target_points) {
      split_dim_ = d;
      break;
    }
    below *= extent;
    if (d == dims - 1) split_dim_ = d;  // everything fits: one tile
  }
  auto split_extent = static_cast<std::uint64_t>(space.extent(split_dim_));
  std::uint64_t inner = 1;
  for (int d = 0; d < split_dim_; ++d) inner *= static_cast<std::uint64_t>(space.extent(d));
  thickness_ = static_cast<std::int64_t>(std::clamp<std::uint64_t>(target_points / inner, 1, split_extent));
  per_column_ = (split_extent + static_cast<std::uint64_t>(thickness_) - 1) / static_cast<std::uint64_t>(thickness_);
  count_ = per_column_;
  for (int d = split_dim_ + 1; d < dims; ++d) count_ *= static_cast<std::uint64_t>(space.extent(d));
}

Rect TileGrid::tile(std::uint64_t index) const {
  Point lo = space_.lo(), hi = space_.hi();
  auto s = static_cast<std::size_t>(split_dim_);
  std::uint64_t along = index % per_column_;
  std::uint64_t rest = index / per_column_;
  lo[s] = space_.lo()[s] + static_cast<std::int64_t>(along) * thickness_;
  // Not lo + thickness - 1, which overflows for a tile near INT64_MAX.
  hi[s] = space_.hi()[s] - lo[s] < thickness_ - 1 ? space_.hi()[s] : lo[s] + thickness_ - 1;
  for (int d = split_dim_ + 1; d < space_.dims(); ++d) {
    auto i = static_cast<std::size_t>(d);
    auto extent = static_cast<std::uint64_t>(space_.extent(d));
    lo[i] = hi[i] = space_.lo()[i] + static_cast<std::int64_t>(rest % extent);
    rest /= extent;
  }
  return Rect(space_.dims(), lo, hi);
}

}  // namespace caravan::dma
