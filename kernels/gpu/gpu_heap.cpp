#include "kernels/gpu/gpu_heap.h"

#include "runtime/gpu/platform.h"
#include "runtime/net/network.h"
#include "runtime/runtime_impl.h"

#include <caravan/error.h>
#include <caravan/runtime.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>

namespace caravan::gpu {

GpuSymmetricHeap::GpuSymmetricHeap(std::vector<int> devices, std::uint64_t bytes_per_rank, DeviceSharing sharing)
    : devices_(std::move(devices)), bytes_(bytes_per_rank) {
  if (devices_.empty() || devices_.size() > static_cast<std::size_t>(kMaxHeapRanks))
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap: devices must list 1 to {} GPUs, got {}", kMaxHeapRanks, devices_.size()));
  for (std::size_t i = 0; i < devices_.size() && sharing == DeviceSharing::refused; ++i)
    if (std::count(devices_.begin(), devices_.end(), devices_[i]) > 1)
      throw Error(Errc::invalid_argument,
                  fmt::format("GpuSymmetricHeap: device {} is listed twice (one rank per GPU; DeviceSharing::allowed "
                              "is for tests of the copy-engine schedules)",
                              devices_[i]));
  try {
    for (int a : devices_) {
      CARAVAN_HIP_CHECK(hipSetDevice(a));
      for (int b : devices_) {
        if (a == b) continue;
        int can = 0;
        CARAVAN_HIP_CHECK(hipDeviceCanAccessPeer(&can, a, b));
        if (!can)
          throw Error(Errc::invalid_argument,
                      fmt::format("GpuSymmetricHeap: GPU {} cannot reach GPU {} (no peer access)", a, b));
        hipError_t status = hipDeviceEnablePeerAccess(b, 0);
        if (status == hipErrorPeerAccessAlreadyEnabled) (void)hipGetLastError();
        else CARAVAN_HIP_CHECK(status);
      }
      void* base = nullptr;
      CARAVAN_HIP_CHECK(malloc_peer_coherent(&base, bytes_));
      bases_.push_back(static_cast<char*>(base));
      CARAVAN_HIP_CHECK(hipMemset(base, 0, bytes_));
    }
    for (int d : devices_) {
      CARAVAN_HIP_CHECK(hipSetDevice(d));
      CARAVAN_HIP_CHECK(hipDeviceSynchronize());
    }
  } catch (...) {
    free_all();
    throw;
  }
}

namespace {
// Settings that decide the symmetric allocations or the protocols of the operations built on a
// heap (kernels/gpu/overlap.h): ranks that disagree would lay out their heaps differently, or
// wait for flag values their peers never write, and corrupt memory or hang instead of failing.
// join_node() refuses them up front. Bytes settings, read as such.
constexpr const char* kAgreedSettings[] = {"CARAVAN_LL128_MIN_BYTES", "CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES",
                                           "CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES"};
constexpr std::size_t kAgreedCount = std::size(kAgreedSettings);
}  // namespace

// What each rank of the job tells the others in join_node(). A rank that failed to set up
// still sends one (ok = false, with its reason), so every rank takes part in every collective
// and every rank reaches the same verdict.
struct JoinEntry {
  int node = 0;
  int local_rank = 0;
  int device = 0;
  int ok = 0;
  char bus_id[32] = {};  // the GPU's PCI address: two ranks of a node must not share one
  char failure[160] = {};
  std::uint64_t bytes = 0;
  std::uint64_t agreed[kAgreedCount] = {};  // kAgreedSettings, as this rank reads them
  hipIpcMemHandle_t handle{};
};

namespace {

std::chrono::nanoseconds join_timeout() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(settings::get_double("CARAVAN_OVERLAP_TIMEOUT_S")));
}

// Every rank's entry (the job's allgather; one rank alone: its own).
std::vector<JoinEntry> exchange(net::Network* network, const JoinEntry& mine, const char* what) {
  if (!network) return {mine};
  std::vector<JoinEntry> out;
  for (const auto& part : network->allgather(std::as_bytes(std::span<const JoinEntry, 1>(&mine, 1)), join_timeout(), what)) {
    JoinEntry e;
    if (part.size() != sizeof(e)) throw Error(Errc::internal, fmt::format("{}: a rank sent a malformed entry", what));
    std::memcpy(&e, part.data(), sizeof(e));
    out.push_back(e);
  }
  return out;
}

void set_failure(JoinEntry& e, const std::string& why) {
  e.ok = 0;
  std::snprintf(e.failure, sizeof(e.failure), "%s", why.c_str());
}

}  // namespace

std::unique_ptr<GpuSymmetricHeap> GpuSymmetricHeap::join_node(int device, std::uint64_t bytes_per_rank) {
  Runtime& rt = Runtime::current();
  net::Network* network = rt.impl().network();
  std::unique_ptr<GpuSymmetricHeap> heap(new GpuSymmetricHeap());
  heap->bytes_ = bytes_per_rank;
  JoinEntry mine;
  mine.node = rt.node();
  mine.local_rank = rt.rank_info(rt.rank()).local_rank;
  mine.device = device;
  mine.bytes = bytes_per_rank;
  mine.ok = 1;
  void* base = nullptr;
  try {
    for (std::size_t i = 0; i < kAgreedCount; ++i) mine.agreed[i] = settings::get_bytes(kAgreedSettings[i]);
    if (bytes_per_rank == 0) throw Error(Errc::invalid_argument, "bytes_per_rank must be positive");
    CARAVAN_HIP_CHECK(hipSetDevice(device));
    CARAVAN_HIP_CHECK(hipDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id), device));
    CARAVAN_HIP_CHECK(malloc_peer_coherent(&base, bytes_per_rank));
    CARAVAN_HIP_CHECK(hipMemset(base, 0, bytes_per_rank));
    CARAVAN_HIP_CHECK(hipDeviceSynchronize());
    CARAVAN_HIP_CHECK(hipIpcGetMemHandle(&mine.handle, base));
  } catch (const std::exception& e) {
    set_failure(mine, e.what());  // still takes part in the exchange: the peers learn why
  }
  const auto release_base = [&] {
    if (base) (void)hipFree(base);
    base = nullptr;
  };
  std::vector<JoinEntry> team;
  try {
    for (const JoinEntry& e : exchange(network, mine, "GpuSymmetricHeap::join_node"))
      if (e.node == mine.node) team.push_back(e);
  } catch (...) {
    release_base();
    throw;
  }
  std::sort(team.begin(), team.end(), [](const JoinEntry& a, const JoinEntry& b) { return a.local_rank < b.local_rank; });
  // The same checks on every rank of the node, over the whole team: the same verdict everywhere.
  std::string verdict;
  for (std::size_t i = 0; i < team.size() && verdict.empty(); ++i) {
    const JoinEntry& e = team[i];
    if (!e.ok) verdict = fmt::format("local rank {} could not set up its heap: {}", e.local_rank, e.failure);
    else if (e.bytes != team.front().bytes)
      verdict = fmt::format("every rank of a node must ask for the same size; local rank {} asked for {} bytes, local rank "
                            "{} for {}",
                            e.local_rank, e.bytes, team.front().local_rank, team.front().bytes);
    for (std::size_t k = 0; k < kAgreedCount && verdict.empty() && e.ok && team.front().ok; ++k)
      if (e.agreed[k] != team.front().agreed[k])
        verdict = fmt::format("every rank of a node must see the same {}; local rank {} has {}, local rank {} has {}",
                              kAgreedSettings[k], e.local_rank, e.agreed[k], team.front().local_rank,
                              team.front().agreed[k]);
    for (std::size_t j = 0; j < i && verdict.empty(); ++j)
      if (team[j].ok && e.ok && std::strncmp(team[j].bus_id, e.bus_id, sizeof(e.bus_id)) == 0)
        verdict = fmt::format("local ranks {} and {} both chose GPU {}; each rank needs a GPU of its own", team[j].local_rank,
                              e.local_rank, e.bus_id);
  }
  if (verdict.empty() && team.size() > static_cast<std::size_t>(kMaxHeapRanks))
    verdict = fmt::format("{} ranks on this node; at most {}", team.size(), kMaxHeapRanks);
  if (!verdict.empty()) {
    release_base();
    throw Error(Errc::invalid_argument, "GpuSymmetricHeap::join_node: " + verdict);
  }
  for (std::size_t i = 0; i < team.size(); ++i)
    if (team[i].local_rank == mine.local_rank) heap->own_rank_ = static_cast<int>(i);
  JoinEntry mapped_all = mine;  // the second exchange: did this rank map every peer?
  for (const JoinEntry& e : team) {
    heap->devices_.push_back(e.device);
    if (e.local_rank == mine.local_rank) {
      heap->bases_.push_back(static_cast<char*>(base));
      base = nullptr;  // the heap owns it now
      continue;
    }
    void* mapped = nullptr;
    const hipError_t status = mapped_all.ok ? hipIpcOpenMemHandle(&mapped, e.handle, hipIpcMemLazyEnablePeerAccess)
                                            : hipSuccess;
    if (!mapped_all.ok) {
      heap->bases_.push_back(nullptr);
    } else if (status != hipSuccess) {
      (void)hipGetLastError();
      set_failure(mapped_all, fmt::format("cannot map local rank {}'s heap (GPU {}, {}) on GPU {} ({}): {}", e.local_rank,
                                          e.device, e.bus_id, device, mine.bus_id, hipGetErrorName(status)));
      heap->bases_.push_back(nullptr);
    } else {
      heap->bases_.push_back(static_cast<char*>(mapped));
    }
  }
  std::vector<JoinEntry> statuses;
  try {
    statuses = exchange(network, mapped_all, "GpuSymmetricHeap::join_node (mapping)");
  } catch (...) {
    heap->free_all();
    heap->bases_.clear();
    throw;
  }
  for (const JoinEntry& e : statuses)
    if (e.node == mine.node && !e.ok) {
      heap->free_all();  // nobody uses the heap: every rank of the node fails here alike
      heap->bases_.clear();
      throw Error(Errc::device, fmt::format("GpuSymmetricHeap::join_node: local rank {}: {}", e.local_rank, e.failure));
    }
  return heap;
}

void GpuSymmetricHeap::free_all() noexcept {
  if (own_rank_ >= 0 && static_cast<std::size_t>(own_rank_) < devices_.size()) (void)hipSetDevice(devices_[own_rank_]);
  for (std::size_t i = 0; i < bases_.size(); ++i) {
    if (!bases_[i]) continue;
    const bool own = own_rank_ < 0 || static_cast<int>(i) == own_rank_;
    if (own_rank_ < 0) (void)hipSetDevice(devices_[i]);
    if (own) (void)hipFree(bases_[i]);
    else (void)hipIpcCloseMemHandle(bases_[i]);
  }
}

void GpuSymmetricHeap::leave() {
  if (own_rank_ < 0 || bases_.empty()) return;
  // Importers unmap first; only then may the exporters free (the CUDA rule for IPC memory).
  CARAVAN_HIP_CHECK(hipSetDevice(devices_[static_cast<std::size_t>(own_rank_)]));
  for (std::size_t i = 0; i < bases_.size(); ++i)
    if (bases_[i] && static_cast<int>(i) != own_rank_) {
      (void)hipIpcCloseMemHandle(bases_[i]);
      bases_[i] = nullptr;
    }
  if (Runtime::is_running()) Runtime::current().barrier(join_timeout());
  char* own = bases_[static_cast<std::size_t>(own_rank_)];
  bases_.clear();
  if (own) CARAVAN_HIP_CHECK(hipFree(own));
}

GpuSymmetricHeap::~GpuSymmetricHeap() { free_all(); }

SymmetricRegion GpuSymmetricHeap::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::allocate: alignment {} is not a power of two", alignment));
  const std::uint64_t offset = (used_ + alignment - 1) / alignment * alignment;
  if (offset > bytes_ || bytes > bytes_ - offset)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::allocate: {} bytes do not fit ({} of {} bytes per rank used)", bytes,
                            used_, bytes_));
  used_ = offset + bytes;
  return {offset, bytes};
}

void GpuSymmetricHeap::release_to(std::uint64_t mark) {
  if (mark > used_)
    throw Error(Errc::invalid_argument,
                fmt::format("GpuSymmetricHeap::release_to: mark {} is beyond the {} bytes in use", mark, used_));
  // Cross-process: no peer may still write the part being zeroed, nor write it again before
  // every rank zeroed it.
  const bool collective = own_rank_ >= 0 && Runtime::is_running();
  if (collective) Runtime::current().barrier(join_timeout());
  for (std::size_t i = 0; i < bases_.size(); ++i) {
    if (own_rank_ >= 0 && static_cast<int>(i) != own_rank_) continue;  // a peer zeroes its own
    CARAVAN_HIP_CHECK(hipSetDevice(devices_[i]));
    CARAVAN_HIP_CHECK(hipMemset(bases_[i] + mark, 0, used_ - mark));
    CARAVAN_HIP_CHECK(hipDeviceSynchronize());  // the memset is on the legacy stream: finish it
  }
  used_ = mark;
  if (collective) Runtime::current().barrier(join_timeout());
}

void GpuSymmetricHeap::check_rank(int rank, const char* call) const {
  if (rank < 0 || rank >= world())
    throw Error(Errc::invalid_argument,
                fmt::format("{}: rank {} is outside the team's ranks 0..{}", call, rank, world() - 1));
}

HeapView GpuSymmetricHeap::view(int rank) const {
  check_rank(rank, "GpuSymmetricHeap::view");
  HeapView v;
  for (int p = 0; p < world(); ++p) v.bases[p] = bases_[static_cast<std::size_t>(p)];
  v.rank = rank;
  v.world = world();
  return v;
}

}  // namespace caravan::gpu
