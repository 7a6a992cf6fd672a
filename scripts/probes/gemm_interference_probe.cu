// Probe (not part of the build): how much a cuBLAS GEMM slows down when copy-engine traffic runs
// beside it. On every GPU of this process at once (2 or 4), each GPU runs the same scenario, as
// the ranks of an overlapped operation do: the GEMM alone, or beside `traffic` MiB pushed to the
// right neighbour (so that as many arrive from the left one), pulled from the left one, copied
// within the GPU, or pushed by GPU 0 to GPU 1 only; in copies of 0.5-32 MiB or one copy; with
// spin kernels between copies as a crude pace. Scenarios alternate within each round, so drift
// (clocks, temperature) hits them alike. Prints, per shape and scenario, the GEMM's time (slowest
// GPU; median and p10..p90 over the rounds; and each GPU's median), its ratio to `alone`, and when
// the traffic finished.
// Findings on 2 x H200 (32nd session, docs/results/gemm-interference-h200x2-s32.txt): with L2 as
// the driver leaves it, 64 MiB each way cost the TP 4 Llama GEMMs 0-3%. With the L2 persisting
// set-aside at its maximum (37 of 60 MiB; argument "l2"), the same traffic cost them 3-27%, with
// or without a persisting window over the weight: a process that sets aside L2 pays for it in
// every GEMM beside NVLink traffic.
// 33rd session (docs/results/ring-push-flags-h200x2-s33.txt): a flag written into the neighbour's
// memory after each 8 MiB piece (as the ring's write_flag) costs the pushes about 4 us a piece
// beside the o-proj GEMM (96 MiB: 314 us bare, 362 us flagged); an event after each piece costs
// nothing, and the flag written from a second stream still about 3.6 us; 16 MiB pieces with flags
// 318 us.
// Build (CUDA toolkit only):
//   nvcc -arch=sm_90 -O2 -std=c++20 -o gemm_interference_probe scripts/probes/gemm_interference_probe.cu -lcublas -lcuda
// Run: ./gemm_interference_probe [rounds, default 15] [traffic MiB, default 96] [l2|nol2] [shape name part]
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "check.h"

namespace {

#define CU(x)                                                              \
  do {                                                                     \
    CUresult result_ = (x);                                                \
    if (result_ != CUDA_SUCCESS) {                                         \
      std::printf("%s:%d driver error %d\n", __FILE__, __LINE__, result_); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

struct Shape {
  const char* name;
  long m, k, n;
};

struct Gpu {
  cublasHandle_t blas = nullptr;
  cudaStream_t gemm = nullptr, traffic = nullptr, traffic2 = nullptr;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  char *send = nullptr, *receive = nullptr, *local = nullptr;  // traffic buffers
  cudaEvent_t start = nullptr, gemm_done = nullptr, traffic_done = nullptr, traffic2_done = nullptr;
  std::vector<cudaEvent_t> pieces;       // one per piece (After::event, flag_beside, ring)
  std::uint64_t* flag = nullptr;         // the word the left neighbour's flags land in
  std::uint64_t epoch = 0;
};

// What runs beside the GEMM: nothing, copies to the right neighbour (push), from the left one
// (pull, this GPU's engine reading the peer), within this GPU (local), or GPU 0 pushing to GPU 1
// only (one way: GPU 0 sends, GPU 1 receives); cut into pieces of `piece_mib`; `gap_us` > 0 puts
// a spin kernel of that length on the copy stream between pieces (a crude pace); `l2`: the
// GEMM's stream gets a persisting L2 window over B.
enum class Traffic { none, push, pull, local, push_one_way, push_two_streams };
// After each pushed piece, as a ring's push is followed: nothing, a flag written into the right
// neighbour's memory (a stream memory operation), an event recorded, the event and the flag
// written from a second stream that waits for it, or (ring) a wait for an event of another
// stream before the piece and the flag after it.
enum class After { nothing, flag, event, flag_beside, ring };
struct Scenario {
  const char* name;
  Traffic traffic;
  double piece_mib;
  bool l2;
  int gap_us;
  After after = After::nothing;
};
const Scenario kScenarioList[] = {
    {"alone", Traffic::none, 8, false, 0},        {"+push 8M", Traffic::push, 8, false, 0},
    {"+local 8M", Traffic::local, 8, false, 0},   {"+push 8M l2", Traffic::push, 8, true, 0},
    {"+0->1 8M", Traffic::push_one_way, 8, false, 0}, {"+pull 8M", Traffic::pull, 8, false, 0},
    {"+push 32M", Traffic::push, 32, false, 0},   {"+push 4M", Traffic::push, 4, false, 0},
    {"+push 2M", Traffic::push, 2, false, 0},     {"+push 1M", Traffic::push, 1, false, 0},
    {"+push 0.5M", Traffic::push, 0.5, false, 0}, {"+push 4M gap5", Traffic::push, 4, false, 5},
    {"+push 4M gap10", Traffic::push, 4, false, 10}, {"+local 32M", Traffic::local, 32, false, 0},
    {"+push whole", Traffic::push, 1 << 20, false, 0},
    {"+push 8M 2 str", Traffic::push_two_streams, 8, false, 0},
    {"+push 4M 2 str", Traffic::push_two_streams, 4, false, 0},
    {"+push 8M flag", Traffic::push, 8, false, 0, After::flag},
    {"+push 8M event", Traffic::push, 8, false, 0, After::event},
    {"+push 8M flag2", Traffic::push, 8, false, 0, After::flag_beside},
    {"+push 8M ring", Traffic::push, 8, false, 0, After::ring},
    {"+push 16M ring", Traffic::push, 16, false, 0, After::ring},
    {"+push 16M", Traffic::push, 16, false, 0},
};
constexpr int kScenarios = static_cast<int>(sizeof kScenarioList / sizeof kScenarioList[0]);

__global__ void spin(long long ns) {
  long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
float pct(std::vector<float> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

void set_window(Gpu& g, const void* base, std::size_t bytes, bool on) {
  cudaStreamAttrValue value{};
  if (on) {
    int max_window = 0, max_persist = 0;
    CK(cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize, 0));
    CK(cudaDeviceGetAttribute(&max_persist, cudaDevAttrMaxPersistingL2CacheSize, 0));
    const std::size_t window = std::min(bytes, static_cast<std::size_t>(max_window));
    value.accessPolicyWindow.base_ptr = const_cast<void*>(base);
    value.accessPolicyWindow.num_bytes = window;
    value.accessPolicyWindow.hitRatio = std::min(1.0f, static_cast<float>(max_persist) / static_cast<float>(window));
    value.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    value.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  } else {
    value.accessPolicyWindow.num_bytes = 0;
    value.accessPolicyWindow.hitProp = cudaAccessPropertyNormal;
    value.accessPolicyWindow.missProp = cudaAccessPropertyNormal;
  }
  CK(cudaStreamSetAttribute(g.gemm, cudaStreamAttributeAccessPolicyWindow, &value));
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  const std::size_t traffic = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 96) << 20;
  // "l2": set aside the most L2 the device allows for persisting lines, run the scenarios with a
  // window, and reset persisting lines between scenarios. Without it, L2 is left as it is.
  const bool use_l2 = argc > 3 && std::string(argv[3]) == "l2";
  int count = 0;
  CK(cudaGetDeviceCount(&count));
  if (count < 2) {
    std::printf("needs 2 or more GPUs, found %d\n", count);
    return 0;
  }
  const Shape shapes[] = {{"70B qkv TP4", 8192, 8192, 2560},
                          {"70B o-proj TP4", 8192, 2048, 8192},
                          {"8B mlp-down TP4", 8192, 3584, 4096},
                          {"70B mlp-down TP4", 8192, 7168, 8192}};
  std::vector<Gpu> gpus(static_cast<std::size_t>(count));
  int max_window = 0, max_persist = 0, l2 = 0;
  for (int d = 0; d < count; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < count; ++p)
      if (p != d) CK(cudaDeviceEnablePeerAccess(p, 0));
    Gpu& g = gpus[static_cast<std::size_t>(d)];
    CB(cublasCreate(&g.blas));
    CK(cudaStreamCreateWithFlags(&g.gemm, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&g.traffic, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&g.traffic2, cudaStreamNonBlocking));
    CB(cublasSetStream(g.blas, g.gemm));
    CK(cudaMalloc(&g.send, traffic));
    CK(cudaMalloc(&g.receive, traffic));
    CK(cudaMalloc(&g.local, traffic));
    CK(cudaMemset(g.send, 1, traffic));
    CK(cudaEventCreate(&g.start));
    CK(cudaEventCreate(&g.gemm_done));
    CK(cudaEventCreate(&g.traffic_done));
    CK(cudaEventCreate(&g.traffic2_done));
    g.pieces.resize(256);
    for (cudaEvent_t& piece_event : g.pieces) CK(cudaEventCreateWithFlags(&piece_event, cudaEventDisableTiming));
    CK(cudaMalloc(&g.flag, sizeof(std::uint64_t)));
    CK(cudaMemset(g.flag, 0, sizeof(std::uint64_t)));
    CK(cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize, d));
    CK(cudaDeviceGetAttribute(&max_persist, cudaDevAttrMaxPersistingL2CacheSize, d));
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, d));
    if (use_l2) CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, static_cast<std::size_t>(max_persist)));
  }
  std::printf("%d GPUs; L2 %d MiB, persisting at most %d MiB, window at most %d MiB; traffic %zu MiB each way per GPU; %d rounds\n",
              count, l2 >> 20, max_persist >> 20, max_window >> 20, traffic >> 20, rounds);
  std::printf("%-18s %-14s %9s %17s %8s %12s\n", "shape", "scenario", "gemm ms", "p10..p90", "vs alone", "traffic ms");
  const std::string only = argc > 4 ? argv[4] : "";
  for (const Shape& s : shapes) {
    if (std::string(s.name).find(only) == std::string::npos) continue;
    for (int d = 0; d < count; ++d) {
      CK(cudaSetDevice(d));
      Gpu& g = gpus[static_cast<std::size_t>(d)];
      CK(cudaMalloc(&g.a, static_cast<std::size_t>(s.m * s.k) * 2));
      CK(cudaMalloc(&g.b, static_cast<std::size_t>(s.k * s.n) * 2));
      CK(cudaMalloc(&g.c, static_cast<std::size_t>(s.m * s.n) * 2));
      probe_fill<<<1024, 256>>>(g.a, static_cast<std::size_t>(s.m * s.k), 17u + d);
      probe_fill<<<1024, 256>>>(g.b, static_cast<std::size_t>(s.k * s.n), 91u + d);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
    }
    std::vector<std::vector<float>> gemm_ms(kScenarios), traffic_ms(kScenarios);
    std::vector<std::vector<std::vector<float>>> per_gpu(kScenarios, std::vector<std::vector<float>>(static_cast<std::size_t>(count)));
    for (int round = -1; round < rounds; ++round) {  // round -1 warms up
      for (int sc = 0; sc < kScenarios; ++sc) {
        const Scenario& scenario = kScenarioList[sc];
        const bool l2_window = scenario.l2;
        if (l2_window && !use_l2) continue;
        for (int d = 0; d < count; ++d) {
          CK(cudaSetDevice(d));
          Gpu& g = gpus[static_cast<std::size_t>(d)];
          if (!use_l2) continue;
          set_window(g, g.b, static_cast<std::size_t>(s.k * s.n) * 2, l2_window);
          CK(cudaCtxResetPersistingL2Cache());
        }
        for (int d = 0; d < count; ++d) {
          CK(cudaSetDevice(d));
          CK(cudaDeviceSynchronize());
        }
        for (int d = 0; d < count; ++d) {
          CK(cudaSetDevice(d));
          Gpu& g = gpus[static_cast<std::size_t>(d)];
          Gpu& right = gpus[static_cast<std::size_t>((d + 1) % count)];
          CK(cudaEventRecord(g.start, g.gemm));
          CK(cudaStreamWaitEvent(g.traffic, g.start, 0));
          CK(cudaStreamWaitEvent(g.traffic2, g.start, 0));
          // Row-major C[m x n] = A[m x k] B[k x n] as column-major C^T = B^T A^T.
          const float one = 1.0f, zero = 0.0f;
          CB(cublasGemmEx(g.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.n), static_cast<int>(s.m), static_cast<int>(s.k),
                          &one, g.b, CUDA_R_16BF, static_cast<int>(s.n), g.a, CUDA_R_16BF, static_cast<int>(s.k), &zero, g.c,
                          CUDA_R_16BF, static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          CK(cudaEventRecord(g.gemm_done, g.gemm));
          Gpu& left = gpus[static_cast<std::size_t>((d + count - 1) % count)];
          const bool moves = scenario.traffic != Traffic::none && (scenario.traffic != Traffic::push_one_way || d == 0);
          const auto piece = static_cast<std::size_t>(scenario.piece_mib * (1 << 20));
          for (std::size_t off = 0; off < traffic && moves; off += piece) {
            const std::size_t bytes = std::min(piece, traffic - off);
            cudaEvent_t piece_event = g.pieces[(off / piece) % g.pieces.size()];
            if (scenario.after == After::ring) {  // as the ring waits for a part's GEMM (done long ago)
              CK(cudaEventRecord(piece_event, g.traffic2));
              CK(cudaStreamWaitEvent(g.traffic, piece_event, 0));
            }
            if (off > 0 && scenario.gap_us > 0) spin<<<1, 1, 0, g.traffic>>>(scenario.gap_us * 1000LL);
            if (scenario.traffic == Traffic::local)
              CK(cudaMemcpyAsync(g.local + off, g.send + off, bytes, cudaMemcpyDeviceToDevice, g.traffic));
            else if (scenario.traffic == Traffic::pull)  // this GPU's engine reads the left neighbour's memory
              CK(cudaMemcpyPeerAsync(g.receive + off, d, left.send + off, (d + count - 1) % count, bytes, g.traffic));
            else if (scenario.traffic == Traffic::push_two_streams)  // pieces alternate over two streams
              CK(cudaMemcpyPeerAsync(right.receive + off, (d + 1) % count, g.send + off, d, bytes,
                                     (off / piece) % 2 ? g.traffic2 : g.traffic));
            else
              CK(cudaMemcpyPeerAsync(right.receive + off, (d + 1) % count, g.send + off, d, bytes, g.traffic));
            const auto flag = reinterpret_cast<CUdeviceptr>(right.flag);
            switch (scenario.after) {
              case After::nothing: break;
              case After::flag:
              case After::ring: CU(cuStreamWriteValue64(g.traffic, flag, ++g.epoch, 0)); break;
              case After::event: CK(cudaEventRecord(piece_event, g.traffic)); break;
              case After::flag_beside:
                CK(cudaEventRecord(piece_event, g.traffic));
                CK(cudaStreamWaitEvent(g.traffic2, piece_event, 0));
                CU(cuStreamWriteValue64(g.traffic2, flag, ++g.epoch, 0));
                break;
            }
          }
          CK(cudaEventRecord(g.traffic2_done, g.traffic2));
          CK(cudaStreamWaitEvent(g.traffic, g.traffic2_done, 0));
          CK(cudaEventRecord(g.traffic_done, g.traffic));
        }
        float worst_gemm = 0, worst_traffic = 0;
        for (int d = 0; d < count; ++d) {
          CK(cudaSetDevice(d));
          Gpu& g = gpus[static_cast<std::size_t>(d)];
          CK(cudaEventSynchronize(g.gemm_done));
          CK(cudaEventSynchronize(g.traffic_done));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, g.start, g.gemm_done));
          worst_gemm = std::max(worst_gemm, ms);
          if (round >= 0) per_gpu[static_cast<std::size_t>(sc)][static_cast<std::size_t>(d)].push_back(ms);
          CK(cudaEventElapsedTime(&ms, g.start, g.traffic_done));
          worst_traffic = std::max(worst_traffic, ms);
        }
        if (round >= 0) {
          gemm_ms[static_cast<std::size_t>(sc)].push_back(worst_gemm);
          traffic_ms[static_cast<std::size_t>(sc)].push_back(worst_traffic);
        }
      }
    }
    const float alone = median(gemm_ms[0]);
    char label[64];
    std::snprintf(label, sizeof label, "%s", s.name);
    for (int sc = 0; sc < kScenarios; ++sc) {
      const auto& g = gemm_ms[static_cast<std::size_t>(sc)];
      if (g.empty()) continue;  // skipped (nol2)
      const bool moved = kScenarioList[sc].traffic != Traffic::none;
      std::string each;
      for (int d = 0; d < count; ++d) {
        char cell[32];
        std::snprintf(cell, sizeof cell, " %.4f", median(per_gpu[static_cast<std::size_t>(sc)][static_cast<std::size_t>(d)]));
        each += cell;
      }
      std::printf("%-18s %-14s %9.4f %8.4f..%-8.4f %7.3fx %12s  each GPU:%s\n", label, kScenarioList[sc].name, median(g), pct(g, 0.1),
                  pct(g, 0.9), median(g) / alone,
                  moved ? std::to_string(median(traffic_ms[static_cast<std::size_t>(sc)])).substr(0, 6).c_str() : "-",
                  each.c_str());
      label[0] = '\0';
    }
    std::printf("  (%s: M=%ld K=%ld N=%ld, B %ld MiB)\n", s.name, s.m, s.k, s.n, s.k * s.n * 2 >> 20);
    for (int d = 0; d < count; ++d) {
      CK(cudaSetDevice(d));
      Gpu& g = gpus[static_cast<std::size_t>(d)];
      CK(cudaFree(g.a));
      CK(cudaFree(g.b));
      CK(cudaFree(g.c));
    }
  }
  return 0;
}
