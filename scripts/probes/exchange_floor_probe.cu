// Probe (not part of the build): the floor under a one-kernel-per-call exchange between the GPUs
// of one node, to judge what an LL AllGather per call can reach. docs/overlap-sessions.md
// ("Twelfth session", "Where a call's time went") has what it printed on 4 x H200.
//   launch   host time to enqueue an empty kernel (with a 72-byte argument, like a heap view),
//            from 1 thread, and from one thread per GPU at once in this process;
//   exchange the smallest exchange there is: every call, each GPU stores one 8-byte word (the
//            call's epoch) into each peer's slot for it and spins until every peer's word for it
//            has arrived. One block of one warp; timed per call over back-to-back calls on one
//            stream per GPU, launched per call and replayed from a captured graph (epochs kept
//            on the device, so a replay gets fresh ones), with and without programmatic
//            dependent launch (the next call's launch overlapping this one's end).
//   nvcc -arch=sm_90 -O3 -std=c++20 -o exchange_floor_probe scripts/probes/exchange_floor_probe.cu
//   timeout 60 ./exchange_floor_probe [gpus]
//   for d in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$d ./exchange_floor_probe launch & done; wait
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#include "check.h"

constexpr int kMaxGpus = 8;
struct View {  // the shape of a heap view: 8 bases, rank, world
  unsigned long long* slots[kMaxGpus];
  int rank, world;
};

__global__ void empty_kernel(View) {}

// counter: this GPU's epoch (local memory). slots[p] + q: GPU p's word for sender q.
__global__ void exchange_kernel(View v, unsigned long long* counter, int pdl) {
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int lane = threadIdx.x;
  const unsigned long long e = *reinterpret_cast<volatile unsigned long long*>(counter) + 1;
  if (lane < v.world && lane != v.rank) {
    // Relaxed store at system scope: the word is the data; nothing else needs ordering.
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(v.slots[lane] + v.rank), "l"(e) : "memory");
  }
  if (lane < v.world && lane != v.rank) {
    unsigned long long got;
    do {
      asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(got) : "l"(v.slots[v.rank] + lane) : "memory");
    } while (got < e);
  }
  __syncwarp();
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (lane == 0) *reinterpret_cast<volatile unsigned long long*>(counter) = e;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void launch_exchange(const View& v, unsigned long long* counter, bool pdl, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(32);
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, exchange_kernel, v, counter, pdl ? 1 : 0));
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  // "launch": only the one-thread launch cost (run several at once, one GPU each, to see
  // whether launches from separate processes contend).
  const bool launch_only = argc > 1 && std::string(argv[1]) == "launch";
  int world = argc > 1 && !launch_only ? std::atoi(argv[1]) : n;
  world = std::min({world, n, kMaxGpus});
  if (launch_only) world = 1;
  if (world < 2 && !launch_only) {
    std::printf("need 2 GPUs\n");
    return 0;
  }
  std::vector<unsigned long long*> slots(world), counters(world);
  std::vector<cudaStream_t> streams(world);
  for (int d = 0; d < world; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < world; ++p)
      if (p != d) CK(cudaDeviceEnablePeerAccess(p, 0));
    CK(cudaMalloc(&slots[d], kMaxGpus * 8));
    CK(cudaMalloc(&counters[d], 8));
    CK(cudaMemset(slots[d], 0, kMaxGpus * 8));
    CK(cudaMemset(counters[d], 0, 8));
    CK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CK(cudaDeviceSynchronize());
  }
  std::vector<View> views(world);
  for (int d = 0; d < world; ++d) {
    for (int p = 0; p < world; ++p) views[d].slots[p] = slots[p];
    views[d].rank = d;
    views[d].world = world;
  }

  // ---- host enqueue cost of an empty kernel ----
  // how: 0 = <<<>>>, 1 = cudaLaunchKernelEx without attributes, 2 = the same with programmatic
  // stream serialization (early launch).
  auto launch_one = [&](int how, int t) {
    if (how == 0) {
      empty_kernel<<<1, 32, 0, streams[t]>>>(views[t]);
      return;
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(32);
    cfg.stream = streams[t];
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = how == 2 ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, empty_kernel, views[t]));
  };
  auto launch_rate = [&](int threads) {
    for (int how = 0; how < 3; ++how) {
      std::vector<double> per_thread(threads);
      std::barrier sync(threads);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          CK(cudaSetDevice(t));
          for (int i = 0; i < 100; ++i) launch_one(how, t);
          CK(cudaStreamSynchronize(streams[t]));
          std::vector<double> samples;
          for (int rep = 0; rep < 20; ++rep) {
            sync.arrive_and_wait();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 200; ++i) launch_one(how, t);
            const auto t1 = std::chrono::steady_clock::now();
            samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 200);
            CK(cudaStreamSynchronize(streams[t]));
          }
          per_thread[t] = median(samples);
        });
      for (auto& th : pool) th.join();
      static const char* const kHow[] = {"<<<>>>", "cudaLaunchKernelEx", "cudaLaunchKernelEx, early launch"};
      std::printf("launch: %d thread(s), one GPU each, %s: host us per empty-kernel launch (median of 20 x 200):", threads,
                  kHow[how]);
      for (double x : per_thread) std::printf(" %.2f", x);
      std::printf("\n");
    }
  };
  launch_rate(1);
  if (launch_only) return 0;
  launch_rate(world);

  // ---- the exchange, per call and from graphs ----
  constexpr int kCalls = 100;
  auto run_exchange = [&](bool graph, bool pdl) {
    std::vector<double> per_rank(world), host(world);
    std::barrier sync(world);
    std::vector<std::thread> pool;
    for (int d = 0; d < world; ++d)
      pool.emplace_back([&, d] {
        CK(cudaSetDevice(d));
        cudaGraphExec_t exec = nullptr;
        if (graph) {
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(streams[d], cudaStreamCaptureModeThreadLocal));
          for (int i = 0; i < kCalls; ++i) launch_exchange(views[d], counters[d], pdl, streams[d]);
          CK(cudaStreamEndCapture(streams[d], &g));
          CK(cudaGraphInstantiate(&exec, g, 0));
          CK(cudaGraphDestroy(g));
        }
        auto batch = [&] {
          if (graph) CK(cudaGraphLaunch(exec, streams[d]));
          else
            for (int i = 0; i < kCalls; ++i) launch_exchange(views[d], counters[d], pdl, streams[d]);
        };
        for (int w = 0; w < 3; ++w) {  // warm-up
          sync.arrive_and_wait();
          batch();
          CK(cudaStreamSynchronize(streams[d]));
        }
        std::vector<double> samples, enqueue;
        for (int rep = 0; rep < 20; ++rep) {
          sync.arrive_and_wait();
          const auto t0 = std::chrono::steady_clock::now();
          batch();
          const auto t1 = std::chrono::steady_clock::now();
          CK(cudaStreamSynchronize(streams[d]));
          const auto t2 = std::chrono::steady_clock::now();
          samples.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count() / kCalls);
          enqueue.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls);
        }
        per_rank[d] = median(samples);
        host[d] = median(enqueue);
        if (exec) CK(cudaGraphExecDestroy(exec));
      });
    for (auto& th : pool) th.join();
    std::printf("exchange (%d GPUs, one word to each peer), %s%s: us per call (median of 20 x %d), per GPU:", world,
                graph ? "graph replay" : "launched per call", pdl ? ", programmatic dependent launch" : "", kCalls);
    for (double x : per_rank) std::printf(" %.2f", x);
    std::printf("; host us to enqueue a call:");
    for (double x : host) std::printf(" %.2f", x);
    std::printf("\n");
  };
  for (bool graph : {false, true})
    for (bool pdl : {false, true}) run_exchange(graph, pdl);
  // Every GPU's counter advanced once per call, and all by the same amount.
  unsigned long long first = 0;
  for (int d = 0; d < world; ++d) {
    unsigned long long c = 0;
    CK(cudaSetDevice(d));
    CK(cudaMemcpy(&c, counters[d], 8, cudaMemcpyDeviceToHost));
    if (d == 0) first = c;
    if (c != first || c != 4ull * 23 * kCalls) {
      std::printf("FAILED: GPU %d's epoch is %llu, expected %llu\n", d, c, 4ull * 23 * kCalls);
      return 1;
    }
  }
  std::printf("epochs consistent: %llu calls on every GPU\n", first);
  return 0;
}
