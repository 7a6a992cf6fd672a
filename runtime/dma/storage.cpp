#include "runtime/dma/storage.h"

#include "runtime/gpu/devices.h"
#include "runtime/host_memory.h"
#include "runtime/net/rma.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace caravan::dma {

std::shared_ptr<Storage> Storage::allocate_host(MemoryId memory, std::uint64_t bytes) {
  detail::require_host_bytes(bytes, fmt::format("allocating {}", memory.to_string()));
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  std::size_t rounded = static_cast<std::size_t>((std::max<std::uint64_t>(bytes, 1) + 63) / 64 * 64);
  s->host_ = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  if (!s->host_)
    throw Error(Errc::invalid_argument, fmt::format("cannot allocate {} bytes in {}", bytes, memory.to_string()));
  std::memset(s->host_, 0, rounded);
  s->owner_ = Owner::aligned;
  return s;
}

std::shared_ptr<Storage> Storage::allocate_device(MemoryId memory, int device, std::uint64_t bytes) {
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->device_ptr_ = static_cast<std::byte*>(gpu::allocate_device(device, bytes));
  s->owner_ = Owner::device;
  s->device_ = device;
  static std::atomic<std::uint64_t> next_serial{0};
  s->serial_ = next_serial.fetch_add(1, std::memory_order_relaxed) + 1;
  return s;
}

std::shared_ptr<Storage> Storage::mapped_device(MemoryId memory, std::shared_ptr<std::byte> mapping, int device,
                                                std::uint64_t bytes) {
  if (!mapping || device < 0)
    throw Error(Errc::internal, fmt::format("{}: a mapped GPU storage needs its mapping and device", memory.to_string()));
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->device_ptr_ = mapping.get();
  s->device_ = device;
  s->mapping_ = std::move(mapping);
  return s;
}

gpu::IpcHandle Storage::ipc_handle() const {
  if (!exportable())
    throw Error(Errc::invalid_argument, fmt::format("{}: only GPU memory this process allocated can be shared with "
                                                    "another process", memory_.to_string()));
  std::call_once(ipc_once_, [this] { ipc_handle_ = gpu::ipc_export(device_ptr_); });
  return ipc_handle_;
}

std::shared_ptr<Storage> Storage::allocate_pinned(MemoryId memory, std::uint64_t bytes) {
  detail::require_host_bytes(bytes, fmt::format("allocating {}", memory.to_string()));
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->host_ = static_cast<std::byte*>(gpu::allocate_pinned(bytes));
  s->owner_ = Owner::pinned;
  return s;
}

std::shared_ptr<Storage> Storage::wrap_host(MemoryId memory, void* data, std::uint64_t bytes) {
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->host_ = static_cast<std::byte*>(data);
  // Attached zcm memory is what GPU kernels and copy engines address directly: plain malloc'd
  // memory there would fault the device (a fatal, sticky error). So it is pinned and mapped
  // here for the instance's life, unless it already is (hipHostMalloc'd or registered).
  if (memory.kind == MemoryKind::zcm && !gpu::topology().devices.empty())
    s->gpu_pinned_ = gpu::pin_host(s->host_, std::max<std::uint64_t>(bytes, 1));
  return s;
}

std::shared_ptr<Storage> Storage::wrap_registered(MemoryId memory, std::shared_ptr<net::RegisteredMemory> registration,
                                                  std::uint64_t bytes) {
  if (!registration || registration->size() < bytes)
    throw Error(Errc::internal, fmt::format("{}: a registration of at least {} bytes is needed", memory.to_string(), bytes));
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->host_ = registration->data();
  s->registration_ = std::move(registration);
  // With GPUs, REG memory is also pinned for them: a copy between GPU memory and REG (the first
  // and last hops of a GPU-to-GPU copy across nodes) then runs on the copy engines at the pinned
  // rate instead of being staged by the driver as pageable memory.
  if (!gpu::topology().devices.empty()) s->gpu_pinned_ = gpu::pin_host(s->host_, std::max<std::uint64_t>(bytes, 1));
  return s;
}

std::shared_ptr<Storage> Storage::remote(MemoryId memory, std::shared_ptr<net::RemoteMemory> memory_key, std::uint64_t bytes) {
  if (!memory_key || memory_key->size() < bytes)
    throw Error(Errc::internal, fmt::format("{}: the remote registration is smaller than {} bytes", memory.to_string(), bytes));
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->remote_ = std::move(memory_key);
  return s;
}

std::shared_ptr<Storage> Storage::allocate_file(MemoryId memory, std::uint64_t bytes) {
  std::string dir = settings::get_string("CARAVAN_DSK_DIR");
  std::string path = dir + "/caravan-dsk-XXXXXX";
  int fd = ::mkstemp(path.data());
  if (fd < 0)
    throw Error(Errc::invalid_argument, fmt::format("cannot create a file for {} in CARAVAN_DSK_DIR={}: {}",
                                                    memory.to_string(), dir, std::strerror(errno)));
  ::unlink(path.c_str());
  // The file is sparse: sizing it succeeds whatever the disk holds, and a full disk would only
  // show as a failed write part-way through a copy. So the free space is checked now.
  struct statvfs fs {};
  if (::fstatvfs(fd, &fs) == 0) {
    const auto free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * static_cast<std::uint64_t>(fs.f_frsize);
    if (bytes > free_bytes) {
      ::close(fd);
      throw Error(Errc::invalid_argument,
                  fmt::format("a {}-byte instance in {} does not fit: CARAVAN_DSK_DIR={} has {} bytes free", bytes,
                              memory.to_string(), dir, free_bytes));
    }
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(Errc::invalid_argument, fmt::format("cannot size a {}-byte file for {} in {}: {}", bytes,
                                                    memory.to_string(), dir, std::strerror(err)));
  }
  std::shared_ptr<Storage> s(new Storage(memory, bytes));
  s->fd_ = fd;
  return s;
}

Storage::~Storage() {
  switch (owner_) {
    case Owner::aligned: std::free(host_); break;
    case Owner::pinned: gpu::free_pinned(host_); break;
    case Owner::device: gpu::free_device(device_ptr_); break;
    case Owner::none: break;
  }
  if (gpu_pinned_) gpu::unpin_host(host_);  // before registration_ (a member) releases the bytes
  if (fd_ >= 0) ::close(fd_);
}

void Storage::read(std::uint64_t offset, std::span<std::byte> out) const {
  // Compared so that nothing wraps: an offset near 2^64 must not pass as a small one.
  if (offset > bytes_ || out.size() > bytes_ - offset)
    throw Error(Errc::invalid_argument, fmt::format("read of {} bytes at {} is outside the {}-byte storage in {}",
                                                    out.size(), offset, bytes_, memory_.to_string()));
  if (remote_ || mapping_)
    throw Error(Errc::invalid_argument, fmt::format("{} belongs to rank {}: read it there", memory_.to_string(), memory_.rank));
  if (device_ >= 0) {
    gpu::copy_sync(out.data(), device_ptr_ + offset, out.size());
    return;
  }
  if (!is_file()) {
    std::memcpy(out.data(), host_ + offset, out.size());
    return;
  }
  std::size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n <= 0)
      throw Error(Errc::io, fmt::format("read from {} failed: {}", memory_.to_string(),
                                        n == 0 ? "unexpected end of file" : std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
}

void Storage::write(std::uint64_t offset, std::span<const std::byte> in) const {
  if (offset > bytes_ || in.size() > bytes_ - offset)
    throw Error(Errc::invalid_argument, fmt::format("write of {} bytes at {} is outside the {}-byte storage in {}",
                                                    in.size(), offset, bytes_, memory_.to_string()));
  if (remote_ || mapping_)
    throw Error(Errc::invalid_argument, fmt::format("{} belongs to rank {}: write it there", memory_.to_string(), memory_.rank));
  if (device_ >= 0) {
    gpu::copy_sync(device_ptr_ + offset, in.data(), in.size());
    return;
  }
  if (!is_file()) {
    std::memcpy(host_ + offset, in.data(), in.size());
    return;
  }
  std::size_t done = 0;
  while (done < in.size()) {
    ssize_t n = ::pwrite(fd_, in.data() + done, in.size() - done, static_cast<off_t>(offset + done));
    if (n <= 0) throw Error(Errc::io, fmt::format("write to {} failed: {}", memory_.to_string(), std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
}

std::shared_ptr<Storage> allocate_storage(MemoryId memory, std::uint64_t bytes) {
  if (memory.kind == MemoryKind::zcm) return Storage::allocate_pinned(memory, bytes);
  if (memory.kind == MemoryKind::fbm) return Storage::allocate_device(memory, static_cast<int>(memory.index), bytes);
  if (is_host(memory.kind)) return Storage::allocate_host(memory, bytes);
  if (memory.kind == MemoryKind::dsk) return Storage::allocate_file(memory, bytes);
  throw Error(Errc::invalid_argument, fmt::format("{}: this build cannot allocate {} memory yet", memory.to_string(),
                                                  to_string(memory.kind)));
}

}  // namespace caravan::dma
