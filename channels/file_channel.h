// file: host memory <-> file-backed storage (the paper's DiskRead/DiskWrite). Runs go straight
// through pread/pwrite; strided ops are staged through a bounce buffer so the file side still
// sees large sequential accesses.
#pragma once

#include "runtime/dma/channel.h"

#include <vector>

namespace caravan::channels {

class FileChannel final : public dma::Channel {
 public:
  ChannelKind kind() const noexcept override { return ChannelKind::file; }
  bool serves(MemoryId src, MemoryId dst) const noexcept override;
  void submit(const dma::Request& request, Completion done) override;

 private:
  void run(const dma::Request& request);
  void run_row(const dma::TransferOp& op, bool reading, const dma::Storage& file, std::byte* host);
  std::vector<std::byte> bounce_;
};

}  // namespace caravan::channels
