// nic: UCX puts from this rank's registered host memory (reg) into another rank's registered
// memory (reg of a rank on another node, or of another process on this one), through the RMA
// layer (runtime/net/rma.h). It moves bytes only: layouts are converted by the memcpy hops on
// either side, since a strided op costs one put per element here.
//
// Completion is local (the source may be reused) and runs on the progress thread. "The bytes
// are at the target" takes a flush, which the DMA engine issues per tile before it tells the
// target rank's XD that the tile landed (runtime/dma/remote_copy.cpp).
#pragma once

#include "runtime/dma/channel.h"

namespace caravan::net {
class Rma;
}

namespace caravan::channels {

class NicChannel final : public dma::Channel {
 public:
  // Puts from `src` (this rank's reg) to `dst` (another rank's reg); `window` requests in flight.
  NicChannel(net::Rma& rma, MemoryId src, MemoryId dst, int window);
  ChannelKind kind() const noexcept override { return ChannelKind::nic; }
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  int window() const noexcept override { return window_; }
  // request.src must be registered storage of this rank, request.dst a remote storage
  // (dma::Storage::remote) of the rank this channel reaches.
  void submit(const dma::Request& request, Completion done) override;

 private:
  net::Rma& rma_;
  MemoryId src_, dst_;
  int window_;
};

}  // namespace caravan::channels
