// Probe (not part of the build): the low-latency AllGather (kernels/gpu/elementwise.cu) in its
// two line formats, 16-byte lines of 8-byte pairs and 128-byte lines, across every GPU of this
// process (peer access, one "heap" allocation per GPU with the same layout so that translate()
// works), so that they can be compared in one call without a job.
//   1. Checked calls: every call gets one of 8 distinct random inputs and its own poisoned
//      output, all compared word by word with what each rank sent; a line taken before its data
//      landed would show the data of the call two before it (the same half of the buffer).
//   2. Latency: 100 back-to-back calls captured in a graph per GPU (launched early, as
//      `bench overlap` does), replayed; per-call time = sample / 100, median and spread of 15.
// Build (after cmake --build --preset release --target caravan_kernels_gpu):
//   nvcc -arch=sm_90 -O2 -std=c++20 -I. -I include -o ll_format_probe scripts/probes/ll_format_probe.cu \
//        build/release/kernels/gpu/libcaravan_kernels_gpu.a build/release/runtime/libcaravan_runtime.a -lfmt
// Run: ./ll_format_probe [checked calls per size, default 4000]
#include "kernels/gpu/kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "check.h"

using namespace caravan::gpu;

namespace {

constexpr int kInputs = 8;

struct Rank {
  char* heap = nullptr;  // [lines | state]
  std::uint64_t* in[kInputs] = {};
  std::uint64_t* out[kInputs] = {};
  cudaStream_t stream = nullptr;
  cudaGraphExec_t graph = nullptr;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const long checked_calls = argc > 1 ? std::atol(argv[1]) : 4000;
  int world = 0;
  CK(cudaGetDeviceCount(&world));
  if (world < 2) {
    std::printf("needs at least 2 GPUs, found %d\n", world);
    return 1;
  }
  world = std::min(world, 8);
  for (int a = 0; a < world; ++a) {
    CK(cudaSetDevice(a));
    for (int b = 0; b < world; ++b)
      if (a != b) CK(cudaDeviceEnablePeerAccess(b, 0));
  }
  std::mt19937_64 rng(std::random_device{}());
  std::printf("%d GPUs; LL AllGather, 16-byte lines of pairs vs 128-byte lines, per-call latency from graphs of 100 "
              "calls (early launch), 15 samples\n",
              world);
  std::printf("%10s %10s %12s %10s %10s %10s %14s\n", "KiB/rank", "format", "checked", "median us", "min us",
              "max us", "vs pairs");
  for (std::size_t kib : {8, 16, 32, 64, 128, 256}) {
    const std::size_t bytes = kib << 10, pairs = bytes / 8;
    const std::size_t lines_bytes = ll_buffer_bytes(world, bytes);
    std::vector<Rank> ranks(static_cast<std::size_t>(world));
    std::vector<std::vector<std::uint64_t>> host_in(static_cast<std::size_t>(world) * kInputs,
                                                    std::vector<std::uint64_t>(pairs));
    for (int r = 0; r < world; ++r) {
      Rank& k = ranks[static_cast<std::size_t>(r)];
      CK(cudaSetDevice(r));
      CK(cudaMalloc(&k.heap, lines_bytes + sizeof(LlState)));
      CK(cudaMemset(k.heap, 0, lines_bytes + sizeof(LlState)));
      for (int i = 0; i < kInputs; ++i) {
        auto& h = host_in[static_cast<std::size_t>(r * kInputs + i)];
        for (auto& w : h) w = rng();
        CK(cudaMalloc(&k.in[i], bytes));
        CK(cudaMemcpy(k.in[i], h.data(), bytes, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&k.out[i], bytes * static_cast<std::size_t>(world)));
      }
      CK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    }
    auto view = [&](int r) {
      HeapView h;
      h.world = world;
      h.rank = r;
      for (int q = 0; q < world; ++q) h.bases[q] = ranks[static_cast<std::size_t>(q)].heap;
      return h;
    };
    double pairs_median = 0;
    for (LlFormat format : {LlFormat::pairs, LlFormat::lines128}) {
      // Fresh epochs for each format: zero the state and the lines.
      for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaDeviceSynchronize());
        CK(cudaMemset(ranks[static_cast<std::size_t>(r)].heap, 0, lines_bytes + sizeof(LlState)));
        CK(cudaDeviceSynchronize());
      }
      auto call = [&](int r, int input) {
        Rank& k = ranks[static_cast<std::size_t>(r)];
        ll_allgather(view(r), k.in[input], bytes, k.heap, k.out[input], reinterpret_cast<LlState*>(k.heap + lines_bytes),
                     k.stream, true, format);
      };
      // 1. Checked calls, in rounds of kInputs.
      long wrong = 0, checked = 0;
      std::vector<std::uint64_t> got(pairs * static_cast<std::size_t>(world));
      for (long done = 0; done < checked_calls; done += kInputs) {
        for (int r = 0; r < world; ++r) {
          CK(cudaSetDevice(r));
          for (int i = 0; i < kInputs; ++i)
            CK(cudaMemsetAsync(ranks[static_cast<std::size_t>(r)].out[i], 0xFF, bytes * world,
                                  ranks[static_cast<std::size_t>(r)].stream));
        }
        for (int i = 0; i < kInputs; ++i)
          for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            call(r, i);
          }
        for (int r = 0; r < world; ++r) {
          CK(cudaSetDevice(r));
          CK(cudaStreamSynchronize(ranks[static_cast<std::size_t>(r)].stream));
          for (int i = 0; i < kInputs; ++i) {
            CK(cudaMemcpy(got.data(), ranks[static_cast<std::size_t>(r)].out[i], bytes * world, cudaMemcpyDeviceToHost));
            for (int q = 0; q < world; ++q) {
              const auto& want = host_in[static_cast<std::size_t>(q * kInputs + i)];
              for (std::size_t w = 0; w < pairs; ++w) wrong += got[static_cast<std::size_t>(q) * pairs + w] != want[w];
            }
            ++checked;
          }
        }
      }
      // 2. Latency from graphs.
      constexpr int kRepeat = 100, kSamples = 15;
      for (int r = 0; r < world; ++r) {
        Rank& k = ranks[static_cast<std::size_t>(r)];
        CK(cudaSetDevice(r));
        cudaGraph_t graph = nullptr;
        CK(cudaStreamBeginCapture(k.stream, cudaStreamCaptureModeThreadLocal));
        for (int c = 0; c < kRepeat; ++c) call(r, 0);
        CK(cudaStreamEndCapture(k.stream, &graph));
        if (k.graph) CK(cudaGraphExecDestroy(k.graph));
        CK(cudaGraphInstantiate(&k.graph, graph, 0));
        CK(cudaGraphDestroy(graph));
      }
      std::vector<double> per_call;
      for (int s = 0; s < kSamples + 2; ++s) {
        const auto start = std::chrono::steady_clock::now();
        for (int r = 0; r < world; ++r) {
          CK(cudaSetDevice(r));
          CK(cudaGraphLaunch(ranks[static_cast<std::size_t>(r)].graph, ranks[static_cast<std::size_t>(r)].stream));
        }
        for (int r = 0; r < world; ++r) {
          CK(cudaSetDevice(r));
          CK(cudaStreamSynchronize(ranks[static_cast<std::size_t>(r)].stream));
        }
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        if (s >= 2) per_call.push_back(us / kRepeat);  // two warm-up samples
      }
      const double med = median(per_call);
      if (format == LlFormat::pairs) pairs_median = med;
      std::printf("%10zu %10s %5ld wrong %3s %10.2f %10.2f %10.2f %13.3fx\n", kib, to_string(format), wrong,
                  wrong ? "!!" : "ok", med, *std::min_element(per_call.begin(), per_call.end()),
                  *std::max_element(per_call.begin(), per_call.end()), pairs_median / med);
      std::printf("           (%ld outputs of %d ranks checked)\n", checked, world);
    }
    for (int r = 0; r < world; ++r) {
      Rank& k = ranks[static_cast<std::size_t>(r)];
      CK(cudaSetDevice(r));
      CK(cudaDeviceSynchronize());
      if (k.graph) CK(cudaGraphExecDestroy(k.graph));
      CK(cudaStreamDestroy(k.stream));
      CK(cudaFree(k.heap));
      for (int i = 0; i < kInputs; ++i) {
        CK(cudaFree(k.in[i]));
        CK(cudaFree(k.out[i]));
      }
    }
  }
  return 0;
}
