// The GPUs this process drives, discovered once: each device's name, PCI address and memory,
// which pairs can reach each other's memory directly (peer access is enabled for every such
// pair at discovery), and the allocations the DMA engine's GPU memories are made of.
//
// No HIP type appears here, so CPU-only code (storage, calibration, the live machine) can use it
// in every build: without a GPU toolchain (devices_none.cpp) there are no devices, and the
// allocation functions throw Error(invalid_argument) saying why.
#pragma once

#include "runtime/dma/transfer_ops.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace caravan::gpu {

struct DeviceInfo {
  int index = 0;              // the HIP/CUDA device ordinal; fbm<index> is its memory
  std::string name;           // e.g. "NVIDIA H200"
  std::string pci_bus_id;     // e.g. "0000:19:00.0"
  std::uint64_t memory_bytes = 0;
  int copy_engines = 0;       // asyncEngineCount
  int multiprocessors = 0;    // multiProcessorCount (SMs on NVIDIA, CUs on AMD)
};

struct Topology {
  std::vector<DeviceInfo> devices;
  std::vector<std::vector<bool>> peer;  // peer[i][j]: device i reaches j's memory directly (enabled)
  std::string reason;                   // why there are no devices, when there are none
  std::string driver;                   // runtime/driver versions, for the calibration key
  bool can_peer(int i, int j) const;
};

// Discovers the devices the first time (creating each device's context and enabling peer
// access); later calls return the same answer. Never throws for "no device": that is an empty
// topology with a reason.
const Topology& topology();
// Identifies the GPU set for caches: "none" or the devices' names, PCI addresses and peer matrix.
std::string topology_key();

// Device memory of `device` (zeroed). Throws Error(device) on a HIP failure.
void* allocate_device(int device, std::uint64_t bytes);
void free_device(void* ptr) noexcept;
// Pinned host memory mapped into every device (zeroed).
void* allocate_pinned(std::uint64_t bytes);
void free_pinned(void* ptr) noexcept;
// Pins host memory allocated elsewhere (REG memory that UCX allocated or registered) for every
// device, so the copy engines reach it directly instead of staging it as pageable memory.
// Returns false, changing nothing, where the GPU runtime already knows the range (pinned by
// someone else: leave it to them). Throws Error(device) on any other HIP failure. A range this
// function pinned before is shared: it returns true again, and the range stays pinned until every
// caller that got true has called unpin_host.
bool pin_host(void* ptr, std::uint64_t bytes);
void unpin_host(void* ptr) noexcept;
// GPU memory shared between the processes of a node (IPC), for copies between ranks: the owner
// exports an allocation of allocate_device (its base address) as an opaque handle; another
// process maps it (the copy engines and kernels of its `device` then reach it like local memory).
// A handle names one allocation; each ipc_open needs its ipc_close. Throws Error(device) on a
// HIP failure (e.g. a handle of this same process, or of a GPU this process cannot see).
inline constexpr std::size_t kIpcHandleBytes = 64;
struct IpcHandle {
  std::byte bytes[kIpcHandleBytes] = {};
};
IpcHandle ipc_export(void* base);
void* ipc_open(const IpcHandle& handle, int device);
void ipc_close(void* mapped) noexcept;
// The ordinal of the GPU at `pci_bus_id` (DeviceInfo::pci_bus_id) in this process, or -1 when
// this process does not see it (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES).
int device_of_pci_bus(const std::string& pci_bus_id);
// Synchronous copy between any two unified addresses (host, pinned or device).
void copy_sync(void* dst, const void* src, std::uint64_t bytes);

// What memory an address points into, as the GPU runtime knows it (for checking addresses
// applications hand in, e.g. landing flags). Without a GPU every address is pageable host memory.
enum class PointerKind : std::uint8_t {
  pageable,  // host memory the GPU runtime does not know (malloc, stack, sys instances)
  pinned,    // host memory pinned and mapped for the GPUs (hipHostMalloc, zcm instances)
  device,    // memory of a GPU (hipMalloc, fbm instances)
  managed,   // unified memory, reachable by the host and the GPUs
};
PointerKind pointer_kind(const void* ptr);

// Raw copies for benchmarks (the baseline Caravan is measured against): `repetitions` copies of
// `bytes` bytes on one new stream of `device`, each timed from enqueue to stream synchronize
// (seconds). `peer` uses hipMemcpyPeerAsync from src_device to dst_device, otherwise
// hipMemcpyAsync. `chunk` > 0 cuts each copy into pieces of that size spread round-robin over
// `streams` streams (a diagnostic of per-request cost).
struct RawCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  std::uint64_t bytes = 0;
  int device = 0;
  bool peer = false;
  int src_device = 0, dst_device = 0;
  std::uint64_t chunk = 0;
  int streams = 1;
  // A strided copy instead (width > 0): `slices` 2-D copies of `height` rows of `width` bytes,
  // rows `src_pitch` / `dst_pitch` apart, slice s starting s * src_slice / s * dst_slice bytes in
  // (one field of a layout conversion per slice, as a copy engine does it). `bytes` and `chunk`
  // are then unused.
  std::uint64_t width = 0, height = 0, src_pitch = 0, dst_pitch = 0, src_slice = 0, dst_slice = 0;
  int slices = 1;
  // Byte operations through the conversion kernel instead (not empty): offsets from src and dst,
  // each op alone, kMaxKernelGroups a launch; what the gpu_convert channel did with a 2-D
  // conversion's ops before it grouped their rows (op_kernel.h). Everything above but the
  // device is then unused.
  std::vector<dma::TransferOp> kernel_ops;
};
std::vector<double> time_raw_copies(const RawCopy& copy, int repetitions);
// Seconds per repetition for all `copies` at once, each on a stream of its own on its `device`,
// from the first enqueue to the last completion.
std::vector<double> time_raw_concurrent(const std::vector<RawCopy>& copies, int repetitions);

}  // namespace caravan::gpu
