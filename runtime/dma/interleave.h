// Groups of ops that one loop moves together: the fields of a layout conversion, and rows.
//
// Converting a layout between "fields innermost" (AOS) and "fields outermost" (SOA) produces one
// strided op per field: for three 4-byte fields, op f moves element i from src + 12 i + 4 f to
// dst_f + 4 i (AOS -> SOA), or the reverse. The ops share their element size, count and strides,
// and their addresses on the interleaved side step by one element. Moved one op after another,
// each op touches every sector of the interleaved side again: the source is read once per field.
// Moved as a group, element range by element range with all fields together, each sector is
// read (or written) once.
//
// A 2-D tile whose rows are apart (a sub-rectangle, or `F,x,y` -> `x,F,y`) gives one op of
// several rows per field (TransferOp::rows), or, where a view is blocked, one op per field and
// row, emitted field by field, each field's rows at one distance from each other. A group then
// has two dimensions: its members (the fields, which interleave) and its rows, held by each
// member's op or spread over ops. Ops at one distance from each other that do not interleave (the
// rows of a sub-rectangle copy of a blocked layout) are a group of one member and several rows.
//
// Three places keep groups together: the DMA engine cuts a tile's ops into requests by element or
// row range and never splits a group between requests otherwise (engine.cpp, cut_requests); the
// memcpy channel moves a group element range by element range, all members together
// (channels/memcpy_channel.cpp); the GPU conversion kernel moves a group a thread per element and
// row, and takes its rows in one launch (runtime/gpu/op_kernel.cu).
//
// Header-only and free of library types, so that nvcc compiles it into the kernel's host code
// as it is. `Op` has src, dst (addresses: integers or byte pointers), elem, count, src_stride,
// dst_stride, rows, src_row_stride, dst_row_stride and row(r), as dma::TransferOp does.
#pragma once

#include <cstddef>
#include <cstdint>

namespace caravan::dma {

// `members` x `rows` rows of one shape (element size, count and strides) starting at ops[first]:
// member m of row r is ops[first + m * member_index + r * row_index], or, where row_index is 0
// (ops of several rows), row r of ops[first + m * member_index]; it sits at the first op's
// addresses moved by m * member_src / member_dst and r * row_src / row_dst bytes. Members
// interleave: on one side each member's elements sit one element after the previous member's,
// within one stride. A group of one member and one row is a lone op of one row.
struct OpGroup {
  std::size_t members = 1;
  std::size_t rows = 1;
  std::size_t member_index = 1;
  std::size_t row_index = 1;
  std::int64_t member_src = 0, member_dst = 0;
  std::int64_t row_src = 0, row_dst = 0;
  // The ops the group takes in the list.
  std::size_t size() const noexcept { return members * (row_index == 0 ? 1 : rows); }
};

// Member m of row r of the group at ops[first], as an op of one row.
template <typename Op>
Op group_row(const Op* ops, std::size_t first, const OpGroup& g, std::size_t m, std::size_t r) {
  const Op& op = ops[first + m * g.member_index + (g.row_index == 0 ? 0 : r * g.row_index)];
  return op.row(g.row_index == 0 ? r : 0);
}

namespace group_detail {
template <typename Address>
std::int64_t distance(Address from, Address to) {
  return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(to) - reinterpret_cast<std::uintptr_t>(from));
}
inline std::int64_t distance(std::uint64_t from, std::uint64_t to) { return static_cast<std::int64_t>(to - from); }

inline std::uint64_t magnitude(std::int64_t v) {
  return v < 0 ? static_cast<std::uint64_t>(-v) : static_cast<std::uint64_t>(v);
}
}  // namespace group_detail

// The group that starts at ops[first] (ops[first, first + size()) in the list). It takes the
// longest run of ops at one distance from each other, then as many copies of that run at another
// constant distance as follow; whichever of the two steps interleaves becomes the members, the
// other the rows. Every op of the group is checked against the addresses the group gives it.
template <typename Op>
OpGroup op_group_at(const Op* ops, std::size_t size, std::size_t first) {
  using group_detail::distance;
  OpGroup g;
  const Op& lead = ops[first];
  if (lead.rows > 1) {  // the op holds the group's rows
    g.rows = static_cast<std::size_t>(lead.rows);
    g.row_index = 0;
    g.row_src = lead.src_row_stride;
    g.row_dst = lead.dst_row_stride;
  }
  if (lead.elem == 0 || first + 1 >= size) return g;
  auto same_shape = [&](const Op& o) {
    return o.elem == lead.elem && o.count == lead.count && o.src_stride == lead.src_stride &&
           o.dst_stride == lead.dst_stride && o.rows == lead.rows && o.src_row_stride == lead.src_row_stride &&
           o.dst_row_stride == lead.dst_row_stride;
  };
  auto at = [&](const Op& o, std::int64_t src, std::int64_t dst) {
    return same_shape(o) && distance(lead.src, o.src) == src && distance(lead.dst, o.dst) == dst;
  };
  if (!same_shape(ops[first + 1])) return g;
  // The run: ops[first + k] at k * (run_src, run_dst).
  const std::int64_t run_src = distance(lead.src, ops[first + 1].src);
  const std::int64_t run_dst = distance(lead.dst, ops[first + 1].dst);
  std::size_t run = 2;
  while (first + run < size && at(ops[first + run], static_cast<std::int64_t>(run) * run_src, static_cast<std::int64_t>(run) * run_dst))
    ++run;
  // How many members a step can interleave: one element apart on a side, as many as fit in that
  // side's stride (0: the step does not interleave).
  auto fit = [&](std::int64_t src_step, std::int64_t dst_step) -> std::uint64_t {
    if (lead.count < 2) return 0;
    const auto elem = static_cast<std::int64_t>(lead.elem);
    if (src_step == elem) return group_detail::magnitude(lead.src_stride) / lead.elem;
    if (dst_step == elem) return group_detail::magnitude(lead.dst_stride) / lead.elem;
    return 0;
  };
  if (lead.rows > 1) {
    // Ops of several rows: the fields of a 2-D conversion, one op each, or a lone op.
    if (const std::uint64_t m = fit(run_src, run_dst); m >= 2) {
      g.members = static_cast<std::size_t>(run < m ? run : m);
      g.member_index = 1;
      g.member_src = run_src;
      g.member_dst = run_dst;
    }
    return g;
  }
  // Copies of the run: block b (ops[first + b * run + k]) at b * (block_src, block_dst).
  std::size_t blocks = 1;
  std::int64_t block_src = 0, block_dst = 0;
  if (first + 2 * run <= size) {
    block_src = distance(lead.src, ops[first + run].src);
    block_dst = distance(lead.dst, ops[first + run].dst);
    auto block_matches = [&](std::size_t b) {
      for (std::size_t k = 0; k < run; ++k) {
        const auto bi = static_cast<std::int64_t>(b), ki = static_cast<std::int64_t>(k);
        if (!at(ops[first + b * run + k], bi * block_src + ki * run_src, bi * block_dst + ki * run_dst)) return false;
      }
      return true;
    };
    while (first + (blocks + 1) * run <= size && block_matches(blocks)) ++blocks;
  }
  if (const std::uint64_t n = fit(block_src, block_dst); blocks >= 2 && n >= 2) {
    // The fields of a 2-D conversion as the walker emits them: field by field, each field's rows.
    g.members = static_cast<std::size_t>(blocks < n ? blocks : n);
    g.member_index = run;
    g.member_src = block_src;
    g.member_dst = block_dst;
    g.rows = run;
    g.row_index = 1;
    g.row_src = run_src;
    g.row_dst = run_dst;
  } else if (const std::uint64_t m = fit(run_src, run_dst); m >= 2) {
    // The fields of one row, then (if the run repeats whole) the same for further rows.
    g.members = static_cast<std::size_t>(run < m ? run : m);
    g.member_index = 1;
    g.member_src = run_src;
    g.member_dst = run_dst;
    if (g.members == run && blocks >= 2) {
      g.rows = blocks;
      g.row_index = run;
      g.row_src = block_src;
      g.row_dst = block_dst;
    }
  } else {
    g.rows = run;  // rows of one member: ops at one distance that do not interleave
    g.row_src = run_src;
    g.row_dst = run_dst;
  }
  return g;
}

}  // namespace caravan::dma
