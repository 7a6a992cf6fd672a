// Probe (not part of the build): how fast can one GPU convert AOS -> SOA (three 4-byte fields,
// 48 MiB), and which loop shape gets there? The gpu_convert channel's kernel
// (runtime/gpu/op_kernel.cu) moves generic strided ops; this isolates the loop shapes it could
// use, against a plain 16-byte copy of the same bytes (the ceiling: each byte read and written
// once, in order). Each variant's output is checked against the host. Kernel time from CUDA
// events, median of 20 after a warm-up.
//   per-field          one pass per field, a 4-byte unit per thread and iteration
//   interleaved        units numbered element-major (element u / 3, field u % 3), 4 per thread
//   thread-per-point   a thread reads a point's 3 fields and stores each, 4 points per thread
//   shared tile        a block reads 1024 points' 12 KiB as 16-byte vectors into shared memory,
//                      then writes each field's 4 KiB as 16-byte vectors
//   nvcc -arch=sm_90 -O3 -o conversion_probe scripts/probes/conversion_probe.cu
//   ./conversion_probe [MiB, default 48]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "check.h"

constexpr int kThreads = 256;

__global__ void per_field(const std::uint32_t* src, std::uint32_t* dst, std::uint64_t points) {
  const std::uint64_t total = points * 3, stride = std::uint64_t{gridDim.x} * kThreads;
  for (std::uint64_t u = blockIdx.x * std::uint64_t{kThreads} + threadIdx.x; u < total; u += stride) {
    const std::uint64_t f = u / points, i = u % points;
    dst[f * points + i] = src[i * 3 + f];
  }
}

__global__ void interleaved(const std::uint32_t* src, std::uint32_t* dst, std::uint32_t points) {
  const std::uint32_t total = points * 3, pass = gridDim.x * kThreads * 4;
  for (std::uint32_t base = blockIdx.x * kThreads * 4 + threadIdx.x; base < total; base += pass) {
    std::uint32_t v[4], at[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t u = base + k * kThreads;
      if (u >= total) continue;
      const std::uint32_t i = u / 3, f = u - i * 3;
      v[k] = src[u];
      at[k] = f * points + i;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (base + k * kThreads < total) dst[at[k]] = v[k];
  }
}

__global__ void thread_per_point(const std::uint32_t* src, std::uint32_t* dst, std::uint32_t points) {
  const std::uint32_t pass = gridDim.x * kThreads * 4;
  for (std::uint32_t base = blockIdx.x * kThreads * 4 + threadIdx.x; base < points; base += pass) {
    std::uint32_t v[4][3];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t i = base + k * kThreads;
      if (i < points)
#pragma unroll
        for (int f = 0; f < 3; ++f) v[k][f] = src[i * 3 + f];
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t i = base + k * kThreads;
      if (i < points)
#pragma unroll
        for (int f = 0; f < 3; ++f) dst[f * points + i] = v[k][f];
    }
  }
}

// points must be a multiple of 1024 here (the probe's sizes are).
__global__ void shared_tile(const uint4* src, std::uint32_t* dst, std::uint32_t points) {
  __shared__ std::uint32_t tile[1024 * 3];
  for (std::uint32_t first = blockIdx.x * 1024; first < points; first += gridDim.x * 1024) {
    const uint4* in = src + first * 3 / 4;  // 1024 points = 768 vectors
    for (int v = threadIdx.x; v < 768; v += kThreads) reinterpret_cast<uint4*>(tile)[v] = in[v];
    __syncthreads();
    for (int f = 0; f < 3; ++f) {
      // thread t writes points 4t .. 4t + 3 of field f
      const int p = threadIdx.x * 4;
      uint4 out{tile[p * 3 + f], tile[(p + 1) * 3 + f], tile[(p + 2) * 3 + f], tile[(p + 3) * 3 + f]};
      reinterpret_cast<uint4*>(dst + static_cast<std::uint64_t>(f) * points + first)[threadIdx.x] = out;
    }
    __syncthreads();
  }
}

__global__ void plain_copy(const uint4* src, uint4* dst, std::uint64_t vectors) {
  const std::uint64_t pass = std::uint64_t{gridDim.x} * kThreads * 4;
  for (std::uint64_t base = blockIdx.x * std::uint64_t{kThreads} * 4 + threadIdx.x; base < vectors; base += pass) {
    uint4 v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (base + k * kThreads < vectors) v[k] = src[base + k * kThreads];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (base + k * kThreads < vectors) dst[base + k * kThreads] = v[k];
  }
}

int main(int argc, char** argv) {
  const std::uint64_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 48;
  const std::uint32_t points = static_cast<std::uint32_t>((mib << 20) / 12 / 1024 * 1024);
  const std::uint64_t bytes = std::uint64_t{points} * 12;
  std::vector<std::uint32_t> host(points * 3ull), got(points * 3ull);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& w : host) w = static_cast<std::uint32_t>((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 32);
  std::uint32_t *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemcpy(src, host.data(), bytes, cudaMemcpyHostToDevice));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto run = [&](const char* name, bool converts, auto launch) {
    CK(cudaMemset(dst, 0xAB, bytes));
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost));
    std::uint64_t wrong = 0;
    for (std::uint64_t i = 0; i < points; ++i)
      for (int f = 0; f < 3; ++f)
        wrong += converts ? got[f * std::uint64_t{points} + i] != host[i * 3 + f] : got[i * 3 + f] != host[i * 3 + f];
    std::vector<float> ms;
    for (int r = 0; r < 20; ++r) {
      CK(cudaEventRecord(a));
      launch();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("%-28s %8.1f us (p10 %.1f, p90 %.1f)  %7.1f GB/s  %s\n", name, ms[10] * 1e3, ms[2] * 1e3, ms[17] * 1e3,
                static_cast<double>(bytes) / (ms[10] * 1e-3) / 1e9, wrong ? "WRONG" : "ok");
  };
  std::printf("AOS -> SOA, three 4-byte fields, %u points (%.1f MiB); GB/s of the array's bytes\n", points,
              bytes / 1048576.0);
  for (unsigned blocks : {1056u, 2048u, 4096u}) {
    std::printf("grid %u blocks of %d threads\n", blocks, kThreads);
    run("plain 16-byte copy", false, [&] {
      plain_copy<<<blocks, kThreads>>>(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), bytes / 16);
    });
    run("per-field", true, [&] { per_field<<<blocks, kThreads>>>(src, dst, points); });
    run("interleaved", true, [&] { interleaved<<<blocks, kThreads>>>(src, dst, points); });
    run("thread-per-point", true, [&] { thread_per_point<<<blocks, kThreads>>>(src, dst, points); });
    run("shared tile", true,
        [&] { shared_tile<<<blocks, kThreads>>>(reinterpret_cast<const uint4*>(src), dst, points); });
  }
  return 0;
}
