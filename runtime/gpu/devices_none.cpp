// Built without GPU sources (CARAVAN_GPU=OFF, or no GPU compiler found at configure time): there
// are no devices, and GPU memory cannot be had; probe_gpus().reason says why.
#include "runtime/gpu/devices.h"

#include <caravan/error.h>
#include <caravan/platform.h>

namespace caravan::gpu {
namespace {

[[noreturn]] void unsupported(const char* what) {
  throw Error(Errc::invalid_argument, std::string(what) + ": " + probe_gpus().reason);
}

}  // namespace

bool Topology::can_peer(int, int) const { return false; }

const Topology& topology() {
  static const Topology t = [] {
    Topology out;
    out.reason = probe_gpus().reason;
    out.driver = "none";
    return out;
  }();
  return t;
}

std::string topology_key() { return "none"; }

void* allocate_device(int, std::uint64_t) { unsupported("GPU memory"); }
void free_device(void*) noexcept {}
void* allocate_pinned(std::uint64_t) { unsupported("pinned host memory (zcm)"); }
void free_pinned(void*) noexcept {}
bool pin_host(void*, std::uint64_t) { return false; }  // no GPU: nothing to pin for
void unpin_host(void*) noexcept {}
IpcHandle ipc_export(void*) { unsupported("GPU memory shared between processes"); }
void* ipc_open(const IpcHandle&, int) { unsupported("GPU memory shared between processes"); }
void ipc_close(void*) noexcept {}
int device_of_pci_bus(const std::string&) { return -1; }
void copy_sync(void*, const void*, std::uint64_t) { unsupported("GPU copy"); }
std::vector<double> time_raw_copies(const RawCopy&, int) { unsupported("GPU copy"); }
std::vector<double> time_raw_concurrent(const std::vector<RawCopy>&, int) { unsupported("GPU copy"); }
PointerKind pointer_kind(const void*) { return PointerKind::pageable; }

}  // namespace caravan::gpu
