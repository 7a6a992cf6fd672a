// Where bytes live: a Storage is one allocation in one memory: host bytes (sys, reg), pinned
// host bytes mapped into every GPU (zcm), GPU memory (fbm), or a region of an unlinked temporary
// file (dsk). Channels address requests relative to it.
#pragma once

#include "runtime/gpu/devices.h"

#include <caravan/machine.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>

namespace caravan::net {
class RegisteredMemory;
class RemoteMemory;
}  // namespace caravan::net

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
  // Memory of GPU `device` (hipMalloc; zeroed). Throws Error(device) on a HIP failure, and
  // Error(invalid_argument) in a build or on a machine without that GPU.
  static std::shared_ptr<Storage> allocate_device(MemoryId memory, int device, std::uint64_t bytes);
  // Pinned host memory mapped into every GPU (hipHostMalloc, portable and mapped; zeroed). It
  // is host memory too: host() is set, so the memcpy and file channels use it like sys.
  static std::shared_ptr<Storage> allocate_pinned(MemoryId memory, std::uint64_t bytes);
  // REG memory in a job: host bytes registered with UCX (the nic channel puts from and into
  // them), and pinned for the GPUs where there are any. The storage keeps the registration alive.
  static std::shared_ptr<Storage> wrap_registered(MemoryId memory, std::shared_ptr<net::RegisteredMemory> registration,
                                                  std::uint64_t bytes);
  // REG memory of another rank, reachable by UCX puts only (host() is null): what the nic
  // channel writes into when a copy's next hop or destination lives on that rank.
  static std::shared_ptr<Storage> remote(MemoryId memory, std::shared_ptr<net::RemoteMemory> memory_key, std::uint64_t bytes);
  // GPU memory of another rank of this node, mapped into this process through IPC: `mapping`
  // is the owner's allocation as this process sees it (unmapped when the last holder lets go),
  // on its GPU `device`. What the xgmi and sdma channels write into when a copy's next hop or
  // destination is another rank's GPU memory on this node (see ipc_handle()).
  static std::shared_ptr<Storage> mapped_device(MemoryId memory, std::shared_ptr<std::byte> mapping, int device,
                                                std::uint64_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  MemoryId memory() const noexcept { return memory_; }
  std::uint64_t bytes() const noexcept { return bytes_; }
  bool is_file() const noexcept { return fd_ >= 0; }
  std::byte* host() const noexcept { return host_; }
  int fd() const noexcept { return fd_; }
  // GPU memory: the device that holds it (-1 for host memory and files).
  int device() const noexcept { return device_; }
  // The unified address GPU copies use: device memory for fbm, the host bytes otherwise
  // (pinned for zcm, pageable for sys); null for files.
  std::byte* gpu_address() const noexcept { return device_ >= 0 ? device_ptr_ : host_; }
  // Registered with UCX (REG memory of this rank in a job), or null.
  const std::shared_ptr<net::RegisteredMemory>& registration() const noexcept { return registration_; }
  // Another rank's registered memory (see remote()), or null.
  const std::shared_ptr<net::RemoteMemory>& remote_memory() const noexcept { return remote_; }
  // GPU memory this storage allocated (allocate_device): other processes of the node may map it.
  bool exportable() const noexcept { return owner_ == Owner::device; }
  // Its IPC handle (gpu::ipc_export, asked of the driver once) and a number no other allocation of this process has had,
  // so that a mapping cached by that number can never be taken for a later allocation's.
  // Error(invalid_argument) unless exportable().
  gpu::IpcHandle ipc_handle() const;
  std::uint64_t serial() const noexcept { return serial_; }

  // Synchronous access to any storage of this rank (GPU memory through a blocking copy); throws
  // Error(transport) on an I/O error, Error(device) on a GPU error, Error(invalid_argument) for
  // another rank's memory.
  void read(std::uint64_t offset, std::span<std::byte> out) const;
  void write(std::uint64_t offset, std::span<const std::byte> in) const;

 private:
  Storage(MemoryId memory, std::uint64_t bytes) : memory_(memory), bytes_(bytes) {}
  MemoryId memory_;
  std::uint64_t bytes_;
  enum class Owner : std::uint8_t { none, aligned, pinned, device };
  std::byte* host_ = nullptr;
  std::byte* device_ptr_ = nullptr;
  Owner owner_ = Owner::none;
  int device_ = -1;
  int fd_ = -1;
  bool gpu_pinned_ = false;  // host_ pinned for the GPUs by wrap_registered (unpinned at the end)
  std::shared_ptr<net::RegisteredMemory> registration_;
  std::shared_ptr<net::RemoteMemory> remote_;
  std::shared_ptr<std::byte> mapping_;  // mapped_device(): another rank's GPU memory, mapped
  std::uint64_t serial_ = 0;
  mutable std::once_flag ipc_once_;
  mutable gpu::IpcHandle ipc_handle_;
};

// Storage for `bytes` bytes in `memory`: pageable host memory for sys and reg (registration
// with the NIC belongs to the distributed runtime), pinned host memory for zcm, GPU memory of
// device `index` for fbm<index>, a file for dsk. Throws Error(invalid_argument) for a kind this
// build or machine cannot allocate (fbm or zcm without a GPU).
std::shared_ptr<Storage> allocate_storage(MemoryId memory, std::uint64_t bytes);

}  // namespace caravan::dma
