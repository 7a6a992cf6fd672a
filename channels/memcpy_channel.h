// memcpy: CPU copies between host memories (sys, zcm, reg) of one node. It converts layouts
// well (strided gathers and scatters cost little more than runs), so planners put conversions
// here. A request of at least CARAVAN_MEMCPY_SPLIT_BYTES is split over CARAVAN_MEMCPY_THREADS
// threads (the worker itself is one of them); runs of at least CARAVAN_MEMCPY_STREAM_BYTES use
// streaming stores.
#pragma once

#include "runtime/dma/channel.h"

#include <condition_variable>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace caravan::channels {

class MemcpyChannel final : public dma::Channel {
 public:
  // inline_bytes: requests up to this size may run on the caller's thread (Channel::inline_bytes);
  // at most split_bytes, below which submit() touches no state of the channel.
  MemcpyChannel(int threads, std::uint64_t split_bytes, std::uint64_t inline_bytes = 0);
  ~MemcpyChannel() override;
  ChannelKind kind() const noexcept override { return ChannelKind::memcpy; }
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  // Landing flags: a release store after the request's copies (host memory).
  dma::FlagWriter flag_writer() const noexcept override { return dma::FlagWriter::cpu; }
  void submit(const dma::Request& request, Completion done) override;
  std::uint64_t inline_bytes() const noexcept override { return inline_bytes_; }

 private:
  void helper_main(std::size_t index);
  void run_split(const dma::Request& request);

  std::uint64_t split_bytes_;
  std::uint64_t inline_bytes_;
  std::uint64_t stream_bytes_;  // runs this long use streaming stores (0: never)
  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::span<const dma::TransferOp>> slices_;  // one per helper, for the request being split
  const std::byte* src_ = nullptr;
  std::byte* dst_ = nullptr;
  std::uint64_t generation_ = 0;  // bumped per split request
  std::size_t pending_ = 0;       // helpers still working on it
  bool stop_ = false;
};

}  // namespace caravan::channels
