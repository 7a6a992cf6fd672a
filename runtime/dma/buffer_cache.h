// Intermediate buffers kept for reuse between copies.
//
// A pipelined copy's buffers live only while it runs. Allocating them fresh for every copy means
// faulting in (and zeroing) new pages each time, which on the build machine (a VM) cost 10-14 ms
// per 12 MiB: a quarter of a 256 MiB dsk -> sys -> dsk copy; pinned and GPU buffers cost an
// allocation call each. Finished copies give their buffers back here instead, and the next copy that needs as much takes one. What is kept is
// bounded per memory (CARAVAN_DMA_IDLE_BUFFER_BYTES, on top of the pools' bounds, which count
// buffers in use); beyond it, the oldest are freed.
#pragma once

#include "runtime/dma/storage.h"

#include <caravan/machine.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>

namespace caravan::dma {

class BufferCache {
 public:
  explicit BufferCache(std::uint64_t bytes_per_memory) : limit_(bytes_per_memory) {}

  // Whether buffers of `memory` are kept: pageable host memory (sys), whose allocation is
  // where the faulting cost lies; pinned host memory (zcm) and GPU memory (fbm), whose
  // allocation costs most of a millisecond and whose free waits for the whole device (on
  // 4 x H200 the relay buffers of a 1 GiB multi-path copy staggered its paths' starts by
  // about 0.9 ms each). Files and REG memory (registered by the distributed runtime, which
  // keeps its own) are allocated per copy.
  static bool keeps(MemoryId memory);

  // An idle buffer of `memory` holding at least `bytes` and at most a quarter more (a bigger
  // one would hold memory the pool, which charges `bytes`, does not count), or null. Its
  // contents are stale.
  std::shared_ptr<Storage> take(MemoryId memory, std::uint64_t bytes);
  // Keeps `storage` for reuse when its memory is kept and it fits under the limit (freeing
  // the oldest idle buffers of that memory to make room); otherwise it is freed.
  void give(std::shared_ptr<Storage> storage);

  std::uint64_t idle_bytes(MemoryId memory);
  // Frees every idle buffer; later give() calls free theirs at once (engine shutdown).
  void close();

 private:
  struct Idle {
    std::uint64_t total = 0;
    std::list<std::shared_ptr<Storage>> oldest_first;
  };
  std::uint64_t limit_;
  std::mutex mutex_;
  std::map<MemoryId, Idle> idle_;
  bool closed_ = false;
};

}  // namespace caravan::dma
