// GPU discovery and the allocations behind fbm and zcm (built with a GPU toolchain).
#include "runtime/gpu/devices.h"

#include "runtime/gpu/op_kernel.h"
#include "runtime/gpu/platform.h"
#include "runtime/log.h"

#include <caravan/platform.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace caravan::gpu {
namespace {

// For the release calls of noexcept frees: a failure cannot be thrown, so it is logged (and
// cleared, so that it does not surface in an unrelated later call).
void log_failed_release(hipError_t status, const char* call) {
  if (status == hipSuccess) return;
  (void)hipGetLastError();
  log::get("gpu")->error("{} failed: {} ({})", call, hipGetErrorName(status), hipGetErrorString(status));
}

Topology discover() {
  Topology t;
  GpuProbe probe = probe_gpus();
  t.driver = probe.toolchain;
  int driver = 0;
  if (hipDriverGetVersion(&driver) == hipSuccess) t.driver += fmt::format(" driver {}", driver);
  else (void)hipGetLastError();
  if (probe.device_count <= 0) {
    t.reason = probe.reason;
    return t;
  }
  const int n = probe.device_count;
  for (int d = 0; d < n; ++d) {
    hipDeviceProp_t prop{};
    CARAVAN_HIP_CHECK(hipGetDeviceProperties(&prop, d));
    char bus[32] = {};
    CARAVAN_HIP_CHECK(hipDeviceGetPCIBusId(bus, sizeof(bus), d));
    t.devices.push_back({d, prop.name, bus, static_cast<std::uint64_t>(prop.totalGlobalMem), copy_engine_count(prop),
                         prop.multiProcessorCount});
  }
  t.peer.assign(static_cast<std::size_t>(n), std::vector<bool>(static_cast<std::size_t>(n), false));
  for (int i = 0; i < n; ++i) {
    ScopedDevice guard(i);
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      CARAVAN_HIP_CHECK(hipDeviceCanAccessPeer(&can, i, j));
      if (!can) continue;
      hipError_t status = hipDeviceEnablePeerAccess(j, 0);
      if (status == hipErrorPeerAccessAlreadyEnabled) {
        (void)hipGetLastError();
      } else if (status != hipSuccess) {
        (void)hipGetLastError();
        log::get("gpu")->warn("GPU {} cannot enable peer access to GPU {}: {} ({}); copies between them go through the host",
                              i, j, hipGetErrorName(status), hipGetErrorString(status));
        continue;
      }
      t.peer[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] = true;
    }
  }
  return t;
}

}  // namespace

bool Topology::can_peer(int i, int j) const {
  if (i < 0 || j < 0 || static_cast<std::size_t>(i) >= peer.size() || static_cast<std::size_t>(j) >= peer.size()) return false;
  return peer[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
}

const Topology& topology() {
  // Discovery throws only for a real HIP failure on a device that exists; that failure is
  // reported to every caller (the flag is not set, so the next call tries again).
  static std::mutex mutex;
  static std::unique_ptr<Topology> found;
  std::lock_guard lock(mutex);
  if (!found) {
    auto start = std::chrono::steady_clock::now();
    found = std::make_unique<Topology>(discover());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (found->devices.empty()) {
      log::get("gpu")->info("no GPU: {}", found->reason);
    } else {
      int pairs = 0;
      for (const auto& row : found->peer)
        for (bool p : row) pairs += p ? 1 : 0;
      log::get("gpu")->info("{} GPU(s) ({}), {} peer pairs, found in {:.2f} s", found->devices.size(),
                            found->devices[0].name, pairs, s);
    }
  }
  return *found;
}

namespace {
// Throws Error(invalid_argument) for a device ordinal this process does not have.
void require_device(int device) {
  const Topology& t = topology();
  if (device < 0 || static_cast<std::size_t>(device) >= t.devices.size())
    throw Error(Errc::invalid_argument, fmt::format("GPU {} does not exist (this process sees {})", device, t.devices.size()));
}
}  // namespace

std::string topology_key() {
  const Topology& t = topology();
  if (t.devices.empty()) return "none";
  std::string key = t.driver;
  for (const auto& d : t.devices) key += fmt::format("|{}@{}:{}", d.name, d.pci_bus_id, d.memory_bytes);
  key += "|peers:";
  for (const auto& row : t.peer)
    for (bool p : row) key += p ? '1' : '0';
  return key;
}

void* allocate_device(int device, std::uint64_t bytes) {
  require_device(device);
  ScopedDevice guard(device);
  void* ptr = nullptr;
  CARAVAN_HIP_CHECK(hipMalloc(&ptr, std::max<std::uint64_t>(bytes, 1)));
  // Zeroed, and waited for: a memset of device memory returns before it has run, on the default
  // stream, which the channels' non-blocking streams do not wait for. A copy queued into the new
  // memory at once (a relay buffer's first tile) could otherwise be overwritten by the late
  // zeros; on 4 x H200 that corrupted multi-path copies once their first request was issued
  // within microseconds of the allocation (eleventh session).
  hipError_t status = hipMemsetAsync(ptr, 0, std::max<std::uint64_t>(bytes, 1), nullptr);
  if (status == hipSuccess) status = hipStreamSynchronize(nullptr);
  if (status != hipSuccess) {
    (void)hipFree(ptr);
    throw_hip_error(status, "hipMemsetAsync(ptr, 0, bytes, nullptr) + hipStreamSynchronize(nullptr)", __FILE__, __LINE__);
  }
  return ptr;
}

void free_device(void* ptr) noexcept {
  if (!ptr) return;
  log_failed_release(hipFree(ptr), "hipFree");
}

void* allocate_pinned(std::uint64_t bytes) {
  if (topology().devices.empty())
    throw Error(Errc::invalid_argument, "pinned host memory (zcm) needs a GPU: " + topology().reason);
  void* ptr = nullptr;
  CARAVAN_HIP_CHECK(hipHostMalloc(&ptr, std::max<std::uint64_t>(bytes, 1), hipHostMallocPortable | hipHostMallocMapped));
  std::memset(ptr, 0, std::max<std::uint64_t>(bytes, 1));
  return ptr;
}

void free_pinned(void* ptr) noexcept {
  if (!ptr) return;
  log_failed_release(hipHostFree(ptr), "hipHostFree");
}

namespace {
// The ranges Caravan pinned, with how many owners hold each: two instances attached over the same
// memory share its registration, and only the last to go unregisters it (the first used to, under
// the second's feet).
struct PinnedRanges {
  std::mutex mutex;
  std::map<void*, std::pair<std::uint64_t, int>> ranges;  // start -> (bytes, owners)
};
PinnedRanges& pinned_ranges() {
  static PinnedRanges* ranges = new PinnedRanges();  // never destroyed: unpins may run at exit
  return *ranges;
}
}  // namespace

bool pin_host(void* ptr, std::uint64_t bytes) {
  if (!ptr || bytes == 0) return false;
  PinnedRanges& pinned = pinned_ranges();
  std::lock_guard lock(pinned.mutex);
  if (auto it = pinned.ranges.find(ptr); it != pinned.ranges.end() && it->second.first >= bytes) {
    ++it->second.second;
    return true;
  }
  hipError_t status = hipHostRegister(ptr, bytes, hipHostRegisterPortable | hipHostRegisterMapped);
  if (status == hipErrorHostMemoryAlreadyRegistered) {
    (void)hipGetLastError();
    return false;  // pinned by the application (or a wider range of ours): not ours to unpin
  }
  CARAVAN_HIP_CHECK(status);
  pinned.ranges[ptr] = {bytes, 1};
  return true;
}

void unpin_host(void* ptr) noexcept {
  if (!ptr) return;
  PinnedRanges& pinned = pinned_ranges();
  std::lock_guard lock(pinned.mutex);
  auto it = pinned.ranges.find(ptr);
  if (it != pinned.ranges.end() && --it->second.second > 0) return;  // another owner still uses it
  if (it != pinned.ranges.end()) pinned.ranges.erase(it);
  log_failed_release(hipHostUnregister(ptr), "hipHostUnregister");
}

static_assert(sizeof(hipIpcMemHandle_t) == kIpcHandleBytes, "IpcHandle must hold a hipIpcMemHandle_t");

IpcHandle ipc_export(void* base) {
  hipIpcMemHandle_t handle{};
  CARAVAN_HIP_CHECK(hipIpcGetMemHandle(&handle, base));
  IpcHandle out;
  std::memcpy(out.bytes, &handle, kIpcHandleBytes);
  return out;
}

void* ipc_open(const IpcHandle& handle, int device) {
  require_device(device);
  hipIpcMemHandle_t h{};
  std::memcpy(&h, handle.bytes, kIpcHandleBytes);
  ScopedDevice guard(device);
  void* mapped = nullptr;
  // Lazy peer access: the mapping is reachable from `device` even where the owner's GPU is
  // another one (peer access between the two is enabled at discovery anyway).
  CARAVAN_HIP_CHECK(hipIpcOpenMemHandle(&mapped, h, hipIpcMemLazyEnablePeerAccess));
  return mapped;
}

void ipc_close(void* mapped) noexcept {
  if (!mapped) return;
  log_failed_release(hipIpcCloseMemHandle(mapped), "hipIpcCloseMemHandle");
}

int device_of_pci_bus(const std::string& pci_bus_id) {
  for (const DeviceInfo& d : topology().devices)
    if (d.pci_bus_id.size() == pci_bus_id.size() &&
        std::equal(d.pci_bus_id.begin(), d.pci_bus_id.end(), pci_bus_id.begin(),
                   [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b)); }))
      return d.index;
  return -1;
}

void copy_sync(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return;
  CARAVAN_HIP_CHECK(hipMemcpy(dst, src, bytes, hipMemcpyDefault));
}

PointerKind pointer_kind(const void* ptr) {
  if (topology().devices.empty()) return PointerKind::pageable;
  hipPointerAttribute_t attributes{};
  if (hipPointerGetAttributes(&attributes, ptr) != hipSuccess) {
    (void)hipGetLastError();  // older runtimes fail for memory they do not know: pageable
    return PointerKind::pageable;
  }
  switch (pointer_memory(attributes)) {
    case PointerMemory::device: return PointerKind::device;
    case PointerMemory::host: return PointerKind::pinned;
    case PointerMemory::managed: return PointerKind::managed;
    case PointerMemory::unknown: break;
  }
  return PointerKind::pageable;
}

namespace {
// Enqueues one raw copy on `streams` (round robin): its 2-D slices, or its 1-D pieces of `chunk`
// bytes (all of it when chunk is 0), peer or plain.
void enqueue_raw(const RawCopy& c, const std::vector<hipStream_t>& streams) {
  std::size_t next = 0;
  if (!c.kernel_ops.empty()) {
    KernelBatch batch;
    for (std::size_t i = 0; i < c.kernel_ops.size(); ++i) {
      const dma::TransferOp& op = c.kernel_ops[i];
      if (op.rows > UINT32_MAX)
        throw Error(Errc::invalid_argument,
                    fmt::format("RawCopy::kernel_ops[{}]: {} rows; the conversion kernel takes fewer than 2^32", i, op.rows));
      KernelGroup& k = batch.groups[batch.count++];
      k = KernelGroup{};
      k.src = static_cast<const std::byte*>(c.src) + op.src;
      k.dst = static_cast<std::byte*>(c.dst) + op.dst;
      k.elem = op.elem;
      k.count = op.count;
      k.src_stride = op.src_stride;
      k.dst_stride = op.dst_stride;
      k.rows = static_cast<std::uint32_t>(op.rows);
      k.row_src = op.src_row_stride;
      k.row_dst = op.dst_row_stride;
      if (batch.count == kMaxKernelGroups || i + 1 == c.kernel_ops.size()) {
        launch_op_batch(batch, streams[0]);
        batch.count = 0;
      }
    }
    return;
  }
  if (c.width > 0) {
    for (int slice = 0; slice < c.slices; ++slice)
      CARAVAN_HIP_CHECK(hipMemcpy2DAsync(static_cast<std::byte*>(c.dst) + slice * c.dst_slice, c.dst_pitch,
                                         static_cast<const std::byte*>(c.src) + slice * c.src_slice, c.src_pitch, c.width,
                                         c.height, hipMemcpyDefault, streams[next++ % streams.size()]));
    return;
  }
  const std::uint64_t chunk = c.chunk ? c.chunk : c.bytes;
  for (std::uint64_t off = 0; off < c.bytes; off += chunk) {
    const std::uint64_t n = std::min(chunk, c.bytes - off);
    hipStream_t s = streams[next++ % streams.size()];
    auto* dst = static_cast<std::byte*>(c.dst) + off;
    const auto* src = static_cast<const std::byte*>(c.src) + off;
    if (c.peer) CARAVAN_HIP_CHECK(hipMemcpyPeerAsync(dst, c.dst_device, src, c.src_device, n, s));
    else CARAVAN_HIP_CHECK(hipMemcpyAsync(dst, src, n, hipMemcpyDefault, s));
  }
}
}  // namespace

std::vector<double> time_raw_copies(const RawCopy& c, int repetitions) {
  ScopedDevice guard(c.device);
  const int n_streams = std::max(c.streams, 1);
  std::vector<hipStream_t> streams(static_cast<std::size_t>(n_streams));
  for (auto& s : streams) CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
  std::vector<double> seconds;
  try {
    for (int r = 0; r < repetitions; ++r) {
      auto start = std::chrono::steady_clock::now();
      enqueue_raw(c, streams);
      for (auto& s : streams) CARAVAN_HIP_CHECK(hipStreamSynchronize(s));
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  } catch (...) {
    for (auto& s : streams) (void)hipStreamDestroy(s);
    throw;
  }
  for (auto& s : streams) CARAVAN_HIP_CHECK(hipStreamDestroy(s));
  return seconds;
}

std::vector<double> time_raw_concurrent(const std::vector<RawCopy>& copies, int repetitions) {
  std::vector<hipStream_t> streams(copies.size(), nullptr);
  const auto destroy = [&] {
    for (std::size_t i = 0; i < copies.size(); ++i)
      if (streams[i]) {
        ScopedDevice guard(copies[i].device);
        (void)hipStreamDestroy(streams[i]);
      }
  };
  std::vector<double> seconds;
  try {
    for (std::size_t i = 0; i < copies.size(); ++i) {
      ScopedDevice guard(copies[i].device);
      CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&streams[i], hipStreamNonBlocking));
    }
    for (int r = 0; r < repetitions; ++r) {
      auto start = std::chrono::steady_clock::now();
      for (std::size_t i = 0; i < copies.size(); ++i) {
        ScopedDevice guard(copies[i].device);
        enqueue_raw(copies[i], {streams[i]});
      }
      for (std::size_t i = 0; i < copies.size(); ++i) {
        ScopedDevice guard(copies[i].device);
        CARAVAN_HIP_CHECK(hipStreamSynchronize(streams[i]));
      }
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  } catch (...) {
    destroy();
    throw;
  }
  destroy();
  return seconds;
}

}  // namespace caravan::gpu
