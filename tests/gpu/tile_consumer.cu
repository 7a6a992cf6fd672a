// The landing-flag consumer (tile_consumer.h): one block per tile, thread 0 polls the flag,
// the block checksums the tile once it has landed.
#include "tests/gpu/tile_consumer.h"

#include "kernels/gpu/device.cuh"

namespace caravan::gpu::test {
namespace {

constexpr int kThreads = 256;

__global__ void tile_consumer(const std::uint64_t* flags, std::uint64_t value, const std::byte* data,
                              const TileBytes* ranges, std::uint64_t max_polls, std::uint64_t timeout_ns,
                              TileSeen* seen, unsigned* started) {
  __shared__ int landed;
  __shared__ std::uint64_t partial[kThreads];
  const std::uint64_t tile = blockIdx.x;
  if (threadIdx.x == 0) {
    const volatile std::uint64_t* flag = flags + tile;
    std::uint64_t polls = 0;
    bool ok = *flag == value;
    if (!ok) ++polls;
    // After the first read: once every block has said so, the host may start the copy. One
    // word per block (system-scope atomics on host memory need native PCIe atomics).
    *reinterpret_cast<volatile unsigned*>(started + tile) = 1u;
    __threadfence_system();
    const std::uint64_t until = dev::global_ns() + timeout_ns;
    while (!ok && polls < max_polls && dev::global_ns() < until) {
      dev::pause_ns(64);
      ok = *flag == value;
      if (!ok) ++polls;
    }
    // Acquire: the tile's bytes were written before the flag (the copy's release), so reads
    // ordered after this fence see them.
    __threadfence_system();
    landed = ok ? 1 : 0;
    seen[tile].polls = polls;
    seen[tile].status = ok ? 1u : 2u;
  }
  __syncthreads();
  if (!landed) return;
  const TileBytes r = ranges[tile];
  const auto* words = reinterpret_cast<const std::uint64_t*>(data);
  std::uint64_t sum = 0;
  for (std::uint64_t k = r.begin / 8 + threadIdx.x; k < r.end / 8; k += kThreads)
    sum += dev::load_l2(words + k) * (2 * k + 1);  // cache-global: no stale L1 line
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) seen[tile].checksum = partial[0];
}

}  // namespace

void launch_tile_consumer(const std::uint64_t* flags, std::uint64_t value, const std::byte* data, const TileBytes* ranges,
                          std::uint64_t tiles, std::uint64_t max_polls, std::uint64_t timeout_ns, TileSeen* seen,
                          unsigned* started, hipStream_t stream) {
  tile_consumer<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(flags, value, data, ranges, max_polls, timeout_ns,
                                                                      seen, started);
  CARAVAN_HIP_CHECK(hipGetLastError());
}

std::uint64_t tile_checksum(const std::byte* data, std::uint64_t begin, std::uint64_t end) {
  const auto* words = reinterpret_cast<const std::uint64_t*>(data);
  std::uint64_t sum = 0;
  for (std::uint64_t k = begin / 8; k < end / 8; ++k) sum += words[k] * (2 * k + 1);
  return sum;
}

}  // namespace caravan::gpu::test
