// Probe (not part of the build): how fast can every GPU send to every other at once, and what
// decides it? docs/gpu.md ("All-to-all") has what it printed on 4 x H200 (CUDA 13, driver 580).
// Each GPU sends `MiB` to each peer, all GPUs at once; GB/s sent per GPU, median of 5 after a
// warm-up. The copy-engine cases vary the stream lifetime, the destination allocations and the
// order the copies are issued in; the SM cases the launch shape:
//   ce 3 streams        hipMemcpyPeerAsync per peer, a stream each, peers d+1, d+2, ...
//   sm 3 streams        a full-GPU copy kernel per peer, a stream each
//   sm 1 stream         the same kernels one after another on one stream
//   sm 1 kernel         one kernel per GPU, its blocks split between the peers
//   sm 1 kernel mixed   one kernel per GPU, each thread storing one vector to every peer
//   ... receivers ascending / d+1, d+2: the issue order (0 -> 1, 2, 3; 1 -> 0, 2, 3; ... or a
//   rotation); on 4 x H200 the order alone made it 194 or 384 GB/s.
//   nvcc -arch=sm_90 -O3 -o all_to_all_probe scripts/probes/all_to_all_probe.cu
//   timeout 120 ./all_to_all_probe [MiB per peer, default 256] [blocks per GPU, default 132*2]
//                                  [idle streams made first on each GPU, default 0]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>
#include "check.h"

constexpr int kMaxGpus = 8;
struct Targets {
  uint4* dst[kMaxGpus];  // this GPU's slot in each peer's receive buffer (null: self)
  int peers[kMaxGpus];
  int npeers;
};

__global__ void __launch_bounds__(1024) copy_one(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a, dst[i + stride] = b, dst[i + 2 * stride] = c, dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// Blocks split into npeers groups; group g copies to peer g.
__global__ void __launch_bounds__(1024) copy_split(const uint4* __restrict__ src, Targets t, size_t n) {
  const int groups = t.npeers;
  const int g = blockIdx.x % groups;
  const size_t blocks_in_group = gridDim.x / groups;
  const size_t b = blockIdx.x / groups;
  if (b >= blocks_in_group) return;
  uint4* dst = t.dst[t.peers[g]];
  const size_t stride = blocks_in_group * blockDim.x;
  size_t i = b * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = src[i], c = src[i + stride], d = src[i + 2 * stride], e = src[i + 3 * stride];
    dst[i] = a, dst[i + stride] = c, dst[i + 2 * stride] = d, dst[i + 3 * stride] = e;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// Every thread stores its vectors to every peer (the source read once for all of them).
__global__ void __launch_bounds__(1024) copy_mixed(const uint4* __restrict__ src, Targets t, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = src[i];
    for (int p = 0; p < t.npeers; ++p) t.dst[t.peers[p]][i] = v;
  }
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  int gpus = 0;
  CK(cudaGetDeviceCount(&gpus));
  gpus = std::min(gpus, kMaxGpus);
  if (gpus < 2) {
    std::printf("needs 2 or more GPUs\n");
    return 0;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = argc > 2 ? std::atoi(argv[2]) : sms * 2;
  const int idle_streams = argc > 3 ? std::atoi(argv[3]) : 0;
  const size_t bytes = mib << 20, n = bytes / 16;
  std::vector<uint4*> src(gpus), recv(gpus);
  std::vector<std::vector<cudaStream_t>> streams(gpus, std::vector<cudaStream_t>(gpus));
  for (int d = 0; d < gpus; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < gpus; ++p)
      if (p != d) CK(cudaDeviceEnablePeerAccess(p, 0));
    for (int k = 0; k < idle_streams; ++k) {  // made and never used, as a runtime's other channels' streams
      cudaStream_t idle;
      CK(cudaStreamCreateWithFlags(&idle, cudaStreamNonBlocking));
    }
    CK(cudaMalloc(&src[d], bytes));
    CK(cudaMemset(src[d], d + 1, bytes));
    CK(cudaMalloc(&recv[d], bytes * gpus));  // slot q: what GPU q sent here
    for (auto& s : streams[d]) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  auto targets = [&](int d) {
    Targets t{};
    t.npeers = 0;
    for (int step = 1; step < gpus; ++step) {
      const int p = (d + step) % gpus;
      t.dst[p] = recv[p] + size_t(d) * n;
      t.peers[t.npeers++] = p;
    }
    return t;
  };
  std::vector<std::pair<int, cudaStream_t>>* fresh_ptr = nullptr;
  auto sync_all = [&] {
    for (int d = 0; d < gpus; ++d) {
      CK(cudaSetDevice(d));
      CK(cudaDeviceSynchronize());
    }
    if (fresh_ptr)
      for (auto& [d, st] : *fresh_ptr) {
        CK(cudaSetDevice(d));
        CK(cudaStreamDestroy(st));
      }
    if (fresh_ptr) fresh_ptr->clear();
  };
  // Separate destination allocations per (sender, receiver), as a runtime's instances are.
  std::vector<std::vector<uint4*>> own_dst(gpus, std::vector<uint4*>(gpus, nullptr));
  for (int d = 0; d < gpus; ++d)
    for (int p = 0; p < gpus; ++p)
      if (p != d) {
        CK(cudaSetDevice(p));
        CK(cudaMalloc(&own_dst[d][p], bytes));
      }
  enum Mode { ce, sm_streams, sm_one_stream, sm_split, sm_mixed, ce_fresh, ce_own_dst, ce_fresh_interleaved };
  const char* names[] = {"ce 3 streams", "sm 3 streams", "sm 1 stream", "sm 1 kernel", "sm 1 kernel mixed",
                         "ce fresh streams", "ce own dst allocs", "ce fresh + own dst"};
  std::vector<std::pair<int, cudaStream_t>> fresh;
  auto launch = [&](Mode m) {
    if (m == ce_fresh || m == ce_fresh_interleaved) {
      // Streams made for this launch and destroyed after it (as gpu::time_raw_concurrent does),
      // copies in (sender, receiver ascending) order.
      for (int d = 0; d < gpus; ++d)
        for (int p = 0; p < gpus; ++p) {
          if (p == d) continue;
          CK(cudaSetDevice(d));
          cudaStream_t st;
          CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
          fresh.push_back({d, st});
          uint4* to = m == ce_fresh ? recv[p] + size_t(d) * n : own_dst[d][p];
          CK(cudaMemcpyPeerAsync(to, p, src[d], d, bytes, st));
        }
      return;
    }
    for (int d = 0; d < gpus; ++d) {
      CK(cudaSetDevice(d));
      Targets t = targets(d);
      for (int k = 0; k < t.npeers; ++k) {
        const int p = t.peers[k];
        switch (m) {
          case ce: CK(cudaMemcpyPeerAsync(t.dst[p], p, src[d], d, bytes, streams[d][k])); break;
          case ce_own_dst: CK(cudaMemcpyPeerAsync(own_dst[d][p], p, src[d], d, bytes, streams[d][k])); break;
          case sm_streams: copy_one<<<blocks, 1024, 0, streams[d][k]>>>(src[d], t.dst[p], n); break;
          case sm_one_stream: copy_one<<<blocks, 1024, 0, streams[d][0]>>>(src[d], t.dst[p], n); break;
          default: break;
        }
      }
      if (m == sm_split) copy_split<<<blocks / t.npeers * t.npeers, 1024, 0, streams[d][0]>>>(src[d], t, n);
      if (m == sm_mixed) copy_mixed<<<blocks, 1024, 0, streams[d][0]>>>(src[d], t, n);
      CK(cudaGetLastError());
    }
  };
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::printf("%d GPUs, %zu MiB to each peer, %d blocks x 1024 threads per SM kernel, %d idle streams per GPU made first, "
              "CUDA_DEVICE_MAX_CONNECTIONS=%s\n",
              gpus, mib, blocks, idle_streams, connections ? connections : "(unset)");
  fresh_ptr = &fresh;
  for (Mode m : {ce, ce_own_dst, ce_fresh, ce_fresh_interleaved, sm_streams, sm_one_stream, sm_split, sm_mixed}) {
    launch(m);
    sync_all();
    std::vector<double> gbps;
    for (int r = 0; r < 5; ++r) {
      auto start = std::chrono::steady_clock::now();
      launch(m);
      sync_all();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      gbps.push_back(double(bytes) * (gpus - 1) / s / 1e9);
    }
    std::sort(gbps.begin(), gbps.end());
    std::printf("%-18s %8.1f GB/s sent per GPU (min %.1f, max %.1f)\n", names[m], gbps[2], gbps[0], gbps[4]);
  }
  // Checks the last mode's bytes: slot q of GPU p holds GPU q's fill byte.
  bool ok = true;
  for (int p = 0; p < gpus && ok; ++p)
    for (int q = 0; q < gpus && ok; ++q) {
      if (p == q) continue;
      unsigned char first = 0, last = 0;
      CK(cudaSetDevice(p));
      CK(cudaMemcpy(&first, reinterpret_cast<unsigned char*>(recv[p] + size_t(q) * n), 1, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&last, reinterpret_cast<unsigned char*>(recv[p] + size_t(q) * n) + bytes - 1, 1, cudaMemcpyDeviceToHost));
      ok = first == q + 1 && last == q + 1;
    }
  std::printf("received bytes %s\n", ok ? "check out" : "DIFFER");
  // Which streams of a pool made up front carry the three peer copies of each GPU: stream i of
  // the pool is the i-th made on that GPU (after the 4 above).
  std::vector<std::vector<cudaStream_t>> pool(gpus, std::vector<cudaStream_t>(16));
  for (int d = 0; d < gpus; ++d) {
    CK(cudaSetDevice(d));
    for (auto& st : pool[d]) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  }
  // Orders and stream lifetimes, each timed like the modes above.
  auto timed = [&](const char* name, const std::function<void()>& once) {
    once();
    std::vector<double> gbps;
    for (int r = 0; r < 5; ++r) {
      auto start = std::chrono::steady_clock::now();
      once();
      gbps.push_back(double(bytes) * (gpus - 1) / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 1e9);
    }
    std::sort(gbps.begin(), gbps.end());
    std::printf("%-40s %8.1f GB/s sent per GPU (min %.1f, max %.1f)\n", name, gbps[2], gbps[0], gbps[4]);
  };
  auto peer_of = [&](int d, int k, bool ascending) {  // the k-th receiver of d
    if (!ascending) return (d + 1 + k) % gpus;
    return k < d ? k : k + 1;
  };
  for (bool ascending : {false, true}) {
    timed(ascending ? "pool streams, receivers ascending" : "pool streams, receivers d+1, d+2, ...", [&] {
      for (int d = 0; d < gpus; ++d) {
        CK(cudaSetDevice(d));
        for (int k = 0; k < gpus - 1; ++k) {
          const int p = peer_of(d, k, ascending);
          CK(cudaMemcpyPeerAsync(recv[p] + size_t(d) * n, p, src[d], d, bytes, pool[d][k]));
        }
      }
      sync_all();
    });
    for (bool made_first : {true, false}) {
      std::string name = std::string("new streams ") + (made_first ? "all made first" : "made per copy") +
                         (ascending ? ", ascending" : ", d+1...");
      timed(name.c_str(), [&] {
        std::vector<std::vector<cudaStream_t>> made(gpus, std::vector<cudaStream_t>(gpus - 1));
        if (made_first)
          for (int d = 0; d < gpus; ++d) {
            CK(cudaSetDevice(d));
            for (auto& st : made[d]) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
          }
        for (int d = 0; d < gpus; ++d) {
          CK(cudaSetDevice(d));
          for (int k = 0; k < gpus - 1; ++k) {
            if (!made_first) CK(cudaStreamCreateWithFlags(&made[d][k], cudaStreamNonBlocking));
            const int p = peer_of(d, k, ascending);
            CK(cudaMemcpyPeerAsync(recv[p] + size_t(d) * n, p, src[d], d, bytes, made[d][k]));
          }
        }
        sync_all();
        for (int d = 0; d < gpus; ++d) {
          CK(cudaSetDevice(d));
          for (auto& st : made[d]) CK(cudaStreamDestroy(st));
        }
      });
    }
  }
  // One stream per GPU, the copies cut into pieces issued round robin over the peers: each GPU
  // sends to one peer at a time, switching every piece. In rotation order the GPUs' k-th pieces
  // go to a permutation of receivers; in ascending order they collide.
  for (std::size_t piece_mib : {4, 16, 64})
    for (bool ascending : {false, true}) {
      const size_t piece = std::min(piece_mib << 20, bytes), pieces = (bytes + piece - 1) / piece;
      std::string name = "1 stream, " + std::to_string(piece_mib) + " MiB pieces round robin, " +
                         (ascending ? "ascending" : "rotation");
      timed(name.c_str(), [&] {
        for (int d = 0; d < gpus; ++d) {
          CK(cudaSetDevice(d));
          for (size_t k = 0; k < pieces; ++k)
            for (int j = 0; j < gpus - 1; ++j) {
              const int p = peer_of(d, j, ascending);
              const size_t off = k * piece, len = std::min(piece, bytes - off);
              CK(cudaMemcpyPeerAsync(reinterpret_cast<char*>(recv[p] + size_t(d) * n) + off, p,
                                     reinterpret_cast<const char*>(src[d]) + off, d, len, pool[d][0]));
            }
        }
        sync_all();
      });
    }
  const int picks[][3] = {{0, 1, 2}, {0, 4, 8}};
  for (const auto& pick : picks) {
    const std::string name = "ce pool streams " + std::to_string(pick[0]) + " " + std::to_string(pick[1]) + " " +
                             std::to_string(pick[2]);
    timed(name.c_str(), [&] {
      for (int d = 0; d < gpus; ++d) {
        CK(cudaSetDevice(d));
        Targets t = targets(d);
        for (int k = 0; k < t.npeers && k < 3; ++k)
          CK(cudaMemcpyPeerAsync(t.dst[t.peers[k]], t.peers[k], src[d], d, bytes, pool[d][pick[k]]));
      }
      sync_all();
    });
  }
  return ok ? 0 : 1;
}
