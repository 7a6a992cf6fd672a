// Interleaved groups of strided ops: the fields of a layout conversion.
//
// Converting a layout between "fields innermost" (AOS) and "fields outermost" (SOA) produces one
// strided op per field: for three 4-byte fields, op f moves element i from src + 12 i + 4 f to
// dst_f + 4 i (AOS -> SOA), or the reverse. The ops share their element size, count and strides,
// and their addresses on the interleaved side step by one element. Moved one op after another,
// each op touches every sector of the interleaved side again: the source is read once per field.
// Moved as a group, element range by element range with all fields together, each sector is
// read (or written) once. Two places keep groups together: the DMA engine cuts a group into
// requests by element range rather than op by op (engine.cpp, cut_ops), and the GPU conversion
// kernel moves a group a thread per element (runtime/gpu/op_kernel.cu). Only consecutive ops
// group: the row walker (transfer_ops.h) emits a conversion's ops field by field, so the fields
// of one row are consecutive only where each field is one row (a 1-D tile, or rows fused into
// one run); a 2-D tile with rows apart still moves field by field.
//
// Header-only and free of library types, so that nvcc compiles it into the kernel's host code
// as it is. `Op` has src, dst (addresses: integers or byte pointers), elem, count, src_stride and
// dst_stride, as dma::TransferOp and gpu::KernelOp do.
#pragma once

#include <cstddef>
#include <cstdint>

namespace caravan::dma {

// The end (one past the last) of the interleaved group that starts at ops[first]: the ops after
// it that have its element size, count and strides and whose source addresses (or destination
// addresses; the second op decides which side) step by one element, no more of them than fit in
// one stride. first + 1 where ops[first] starts no group.
template <typename Op>
std::size_t interleaved_group_end(const Op* ops, std::size_t size, std::size_t first) {
  std::size_t end = first + 1;
  const Op& lead = ops[first];
  if (lead.count < 2 || lead.elem == 0 || end >= size) return end;
  auto same_shape = [&](const Op& o) {
    return o.elem == lead.elem && o.count == lead.count && o.src_stride == lead.src_stride &&
           o.dst_stride == lead.dst_stride;
  };
  const bool on_src = same_shape(ops[end]) && ops[end].src == ops[end - 1].src + lead.elem;
  const bool on_dst = !on_src && same_shape(ops[end]) && ops[end].dst == ops[end - 1].dst + lead.elem;
  if (!on_src && !on_dst) return end;
  const std::int64_t stride = on_src ? lead.src_stride : lead.dst_stride;
  const auto span = static_cast<std::uint64_t>(stride < 0 ? -stride : stride);
  while (end < size && same_shape(ops[end]) &&
         (on_src ? ops[end].src == ops[end - 1].src + lead.elem : ops[end].dst == ops[end - 1].dst + lead.elem) &&
         static_cast<std::uint64_t>(end - first + 1) * lead.elem <= span)
    ++end;
  return end;
}

}  // namespace caravan::dma
