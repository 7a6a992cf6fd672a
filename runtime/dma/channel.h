// The interface every channel implements: a capability probe and request execution.
// Implementations live in channels/ (one small class per hardware path).
#pragma once

#include "runtime/dma/storage.h"
#include "runtime/dma/transfer_ops.h"

#include <caravan/error.h>
#include <caravan/machine.h>

#include <atomic>
#include <functional>
#include <span>
#include <string>
#include <string_view>

namespace caravan::dma {

// A batch of ops between two storages; offsets in the ops are relative to each storage.
struct Request {
  std::span<const TransferOp> ops;
  std::uint64_t bytes = 0;
  const Storage* src = nullptr;
  const Storage* dst = nullptr;
  // Set once the copy is cancelled or has failed. A channel that can give up on a request part
  // way (one that waits for a peer, say) may check it and complete the request early, with any
  // failure: the copy is poisoned already. It may complete it only once nothing it started can
  // still touch src or dst (no DMA or put in flight): the buffers go to the next copy as soon
  // as the request is done. memcpy, file and the GPU channels run their requests to the end; a
  // request stuck in them ends the copy only when it returns.
  const std::atomic<bool>* cancelled = nullptr;
};

class Channel {
 public:
  virtual ~Channel() = default;
  virtual ChannelKind kind() const noexcept = 0;
  // Pure capability probe: can this channel move bytes from memory `src` to memory `dst`?
  virtual bool serves(MemoryId src, MemoryId dst) const noexcept = 0;
  // How many requests the DMA worker keeps in flight to saturate the channel.
  virtual int window() const noexcept { return 1; }
  // Starts a request; `done` runs exactly once when it finishes (nullptr: success). Synchronous
  // channels run it inline before returning; asynchronous ones from their progress.
  using Completion = std::function<void(const FailureCause&)>;
  virtual void submit(const Request& request, Completion done) = 0;
};

// Executes ops between two host storages (the memcpy channel's inner loop; also used by file
// staging). Element sizes 1, 2, 4, 8 and 16 bytes get typed loops. Runs of at least
// `stream_bytes` bytes (0: never) are copied with non-temporal stores (see memcpy_channel.cpp).
void copy_host_ops(std::span<const TransferOp> ops, const std::byte* src, std::byte* dst,
                   std::uint64_t stream_bytes = 0);
// The stores copy_host_ops streams with on this CPU ("avx512", "avx2", "sse2"), for reports.
const char* stream_copy_isa();
// Test seam: copies with the named stores ("avx512", "avx2", "sse2"); false (nothing copied)
// when this CPU or build lacks them.
bool stream_copy_using(std::string_view isa, std::byte* dst, const std::byte* src, std::size_t n);

}  // namespace caravan::dma
