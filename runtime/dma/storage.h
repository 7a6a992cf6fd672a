// Where bytes live: a Storage is one allocation in one memory, either host bytes (sys, zcm, reg)
// or a region of an unlinked temporary file (dsk). Channels address requests relative to it.
#pragma once

#include <caravan/machine.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace caravan::dma {

class Storage {
 public:
  // Host bytes owned by the storage (64-byte aligned, zeroed).
  static std::shared_ptr<Storage> allocate_host(MemoryId memory, std::uint64_t bytes);
  // Host bytes owned by the caller.
  static std::shared_ptr<Storage> wrap_host(MemoryId memory, void* data, std::uint64_t bytes);
  // A new temporary file of `bytes` bytes in CARAVAN_DSK_DIR (unlinked at once; the descriptor
  // keeps it until the storage is destroyed).
  static std::shared_ptr<Storage> allocate_file(MemoryId memory, std::uint64_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  MemoryId memory() const noexcept { return memory_; }
  std::uint64_t bytes() const noexcept { return bytes_; }
  bool is_file() const noexcept { return fd_ >= 0; }
  std::byte* host() const noexcept { return host_; }
  int fd() const noexcept { return fd_; }

  // Synchronous access to any storage; throws Error(transport) on an I/O error.
  void read(std::uint64_t offset, std::span<std::byte> out) const;
  void write(std::uint64_t offset, std::span<const std::byte> in) const;

 private:
  Storage(MemoryId memory, std::uint64_t bytes) : memory_(memory), bytes_(bytes) {}
  MemoryId memory_;
  std::uint64_t bytes_;
  std::byte* host_ = nullptr;
  bool owns_host_ = false;
  int fd_ = -1;
};

// Storage for `bytes` bytes in `memory`: host for host kinds, a file for dsk. Throws
// Error(invalid_argument) for a kind this build cannot allocate (fbm without a GPU...).
std::shared_ptr<Storage> allocate_storage(MemoryId memory, std::uint64_t bytes);

}  // namespace caravan::dma
