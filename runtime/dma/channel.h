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
  // Set on the last request of a tile of a copy's last hop when the copy signals its tiles
  // (CopyOptions::signal): once this request's bytes, and those of the tile's earlier requests
  // (submitted before it to this channel), have landed in dst, the channel writes signal_value
  // to *signal_flag, ordered after them (release), before it completes the request. Only sent
  // to channels whose flag_writer() is not none; the engine has checked the flag's memory.
  std::uint64_t* signal_flag = nullptr;
  std::uint64_t signal_value = 0;
};

// Who writes a request's landing flag (Request::signal_flag), which decides where it may live.
enum class FlagWriter : std::uint8_t {
  none,  // the channel cannot signal tiles
  cpu,   // a release store by the host after the copy: host memory (sys, zcm)
  gpu,   // a stream write behind the copy-engine copies: GPU memory or pinned mapped host memory
};

class Channel {
 public:
  virtual ~Channel() = default;
  virtual ChannelKind kind() const noexcept = 0;
  // Pure capability probe: can this channel move bytes from memory `src` to memory `dst`?
  virtual bool serves(MemoryId src, MemoryId dst) const noexcept = 0;
  // How many requests the DMA worker keeps in flight to saturate the channel.
  virtual int window() const noexcept { return 1; }
  // How the channel writes landing flags (Request::signal_flag); none: it does not.
  virtual FlagWriter flag_writer() const noexcept { return FlagWriter::none; }
  // Starts a request; `done` runs exactly once when it finishes (nullptr: success). Synchronous
  // channels run it inline before returning; asynchronous ones from their progress.
  using Completion = std::function<void(const FailureCause&)>;
  virtual void submit(const Request& request, Completion done) = 0;
  // Whether submit() may be called from any thread, also while another thread is in it, and
  // returns quickly (it only queues the work): then the engine's caller may submit a copy's first
  // request itself when the channel is idle, instead of waking the DMA worker. No for channels
  // that do the work inside submit() (it would run on the thread that called copy()).
  virtual bool submits_from_any_thread() const noexcept { return false; }
  // Requests of at most this many bytes may run on any thread, also while another thread is in
  // submit(), and finish inside submit(): then a copy that small (one hop, one tile) runs on the
  // thread that starts it instead of being handed to the DMA worker. 0: never.
  virtual std::uint64_t inline_bytes() const noexcept { return 0; }
};

// Executes ops between two host storages (the memcpy channel's inner loop; also used by file
// staging). Element sizes 1, 2, 4, 8 and 16 bytes get typed loops; a group of ops (interleave.h:
// a conversion's fields) moves all its members element block by element block. Runs of at least
// `stream_bytes` bytes (0: never) are copied the way stream_copy_method() names (non-temporal
// stores where they measured fastest; see memcpy_channel.cpp).
void copy_host_ops(std::span<const TransferOp> ops, const std::byte* src, std::byte* dst,
                   std::uint64_t stream_bytes = 0);
// How copy_host_ops copies long runs on this CPU, for reports: the streaming stores and their
// order, or plain memcpy, whichever a measurement at the first long run found fastest, with the
// measured figures (channels/memcpy_channel.cpp).
const char* stream_copy_method();
// Test seam: copies with the named streaming stores ("avx512", "avx2", "sse2"), a line of 8 pages
// in turn (`interleave`) or front to back; false (nothing copied) when this CPU or build lacks them.
bool stream_copy_using(std::string_view isa, bool interleave, std::byte* dst, const std::byte* src, std::size_t n);

}  // namespace caravan::dma
