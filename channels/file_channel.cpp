#include "channels/file_channel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace caravan::channels {

bool FileChannel::serves(MemoryId src, MemoryId dst) const noexcept {
  return src.node == dst.node && ((is_host(src.kind) && dst.kind == MemoryKind::dsk) ||
                                  (src.kind == MemoryKind::dsk && is_host(dst.kind)));
}

void FileChannel::submit(const dma::Request& request, Completion done) {
  try {
    run(request);
  } catch (const Error& e) {
    done(std::make_shared<const Error>(e));
    return;
  }
  done(nullptr);
}

void FileChannel::run(const dma::Request& request) {
  const bool reading = request.src->is_file();
  const dma::Storage& file = reading ? *request.src : *request.dst;
  std::byte* host = reading ? request.dst->host() : request.src->host();
  if (!host || !file.is_file())
    throw Error(Errc::internal, "file channel given a request that is not between host memory and a file");
  for (const dma::TransferOp& rows : request.ops)
    for (std::uint64_t r = 0; r < rows.rows; ++r) run_row(rows.row(r), reading, file, host);
}

// One row of an op: a run, or strided elements.
void FileChannel::run_row(const dma::TransferOp& op, bool reading, const dma::Storage& file, std::byte* host) {
  if (op.count == 1) {
    if (reading) file.read(op.src, {host + op.dst, op.elem});
    else file.write(op.dst, {host + op.src, op.elem});
    return;
  }
  // Stage the elements contiguously, then one file access for as many as the bounce holds.
  const std::int64_t file_stride = reading ? op.src_stride : op.dst_stride;
  const std::int64_t host_stride = reading ? op.dst_stride : op.src_stride;
  const bool file_contiguous = file_stride == static_cast<std::int64_t>(op.elem);
  const std::uint64_t per_batch = file_contiguous ? std::max<std::uint64_t>(1, (1u << 20) / op.elem) : 1;
  bounce_.resize(per_batch * op.elem);
  for (std::uint64_t first = 0; first < op.count; first += per_batch) {
    std::uint64_t n = std::min(per_batch, op.count - first);
    auto file_at = static_cast<std::uint64_t>(static_cast<std::int64_t>(reading ? op.src : op.dst) +
                                              static_cast<std::int64_t>(first) * file_stride);
    std::byte* host_at = host + (reading ? op.dst : op.src) + static_cast<std::int64_t>(first) * host_stride;
    std::span<std::byte> staged(bounce_.data(), n * op.elem);
    if (reading) {
      file.read(file_at, staged);
      for (std::uint64_t i = 0; i < n; ++i)
        std::memcpy(host_at + static_cast<std::int64_t>(i) * host_stride, staged.data() + i * op.elem, op.elem);
    } else {
      for (std::uint64_t i = 0; i < n; ++i)
        std::memcpy(staged.data() + i * op.elem, host_at + static_cast<std::int64_t>(i) * host_stride, op.elem);
      file.write(file_at, staged);
    }
  }
}

}  // namespace caravan::channels
