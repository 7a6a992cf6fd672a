// Probe (not part of the build): what AllGather+GEMM's cutting of the GEMM costs before any
// communication, on one GPU. For each rank r of a tensor-parallel degree W (M = tokens rows,
// shards of S = M / W rows), it times the cuBLAS calls a rank makes once every shard has landed
// (no copies, no flags), against one GEMM over all M rows:
//   chunks      one GEMM per shard, own shard first, then r-1, r-2, ... (ce-push's arrival order)
//   runs        own shard, then the shards below r as one GEMM, then those above (ce-push runs)
//   batch rest  own shard, then the other W-1 shards as one pointer-array batched GEMM
//   batch all   every shard as one batched GEMM (how much batching itself costs)
// each on one stream, or with consecutive calls alternating over two streams ("2 lanes"), as
// AllGatherGemm's lanes do. Scenarios alternate within each round. Prints, per shape and
// scenario, the slowest rank's median (and p10..p90 over rounds), its ratio to the whole GEMM,
// and each rank's median.
// Build (CUDA toolkit only):
//   nvcc -arch=sm_90 -O2 -std=c++20 -o gemm_schedule_probe scripts/probes/gemm_schedule_probe.cu -lcublas
// Run: ./gemm_schedule_probe [rounds, default 20] [tokens, default 8192] [shape name part]
#include <cublas_v2.h>
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

// An AllGather+GEMM shape at tensor-parallel degree tp: K the hidden size, N the weight's
// columns over tp.
struct Shape {
  const char* name;
  int tp;
  long k, n;
};
const Shape kShapes[] = {
    {"70B qkv TP4", 4, 8192, 2560},      {"8B mlp-up TP4", 4, 4096, 7168},  {"70B mlp-up TP4", 4, 8192, 14336},
    {"70B qkv TP2", 2, 8192, 5120},      {"8B mlp-up TP2", 2, 4096, 14336},
};

enum class Plan { whole, chunks, runs, batch_rest, batch_all };
struct Scenario {
  const char* name;
  Plan plan;
  int lanes;
};
const Scenario kScenarios[] = {
    {"whole", Plan::whole, 1},           {"chunks", Plan::chunks, 1},        {"chunks 2 lanes", Plan::chunks, 2},
    {"runs", Plan::runs, 1},             {"runs 2 lanes", Plan::runs, 2},    {"batch rest", Plan::batch_rest, 1},
    {"batch rest 2 lanes", Plan::batch_rest, 2}, {"batch all", Plan::batch_all, 1},
};
constexpr int kScenarioCount = static_cast<int>(sizeof kScenarios / sizeof kScenarios[0]);

struct Lane {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  void** pointers = nullptr;  // device: A, B, C arrays of a batched call (3 x 8 pointers)
};

// Row-major C[rows x n] = A[rows x k] B[k x n], as column-major C^T = B^T A^T.
void gemm(const Lane& l, long rows, long n, long k, const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* c) {
  const float one = 1.0f, zero = 0.0f;
  CB(cublasGemmEx(l.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(rows), static_cast<int>(k), &one,
                  b, CUDA_R_16BF, static_cast<int>(n), a, CUDA_R_16BF, static_cast<int>(k), &zero, c, CUDA_R_16BF,
                  static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Shards `shards` (each S rows) as one batched call; the pointer arrays were written for this
// lane and this set of shards before the rounds began.
void batched(const Lane& l, long shard_rows, long n, long k, int count) {
  const float one = 1.0f, zero = 0.0f;
  void** p = l.pointers;
  CB(cublasGemmBatchedEx(l.blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(shard_rows),
                         static_cast<int>(k), &one, const_cast<const void**>(p + 8), CUDA_R_16BF, static_cast<int>(n),
                         const_cast<const void**>(p), CUDA_R_16BF, static_cast<int>(k), &zero, p + 16, CUDA_R_16BF,
                         static_cast<int>(n), count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const long m = argc > 2 ? std::atol(argv[2]) : 8192;
  const std::string only = argc > 3 ? argv[3] : "";
  long max_k = 0, max_n = 0;
  for (const Shape& s : kShapes) max_k = std::max(max_k, s.k), max_n = std::max(max_n, s.n);
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  CK(cudaMalloc(&a, static_cast<std::size_t>(m) * max_k * 2));
  CK(cudaMalloc(&b, static_cast<std::size_t>(max_k) * max_n * 2));
  CK(cudaMalloc(&c, static_cast<std::size_t>(m) * max_n * 2));
  probe_fill<<<1024, 256>>>(a, static_cast<std::size_t>(m) * max_k, 1);
  probe_fill<<<1024, 256>>>(b, static_cast<std::size_t>(max_k) * max_n, 2);
  CK(cudaGetLastError());
  Lane lanes[2];
  // Each lane's pointer arrays, per (shape, rank, plan) rewritten before that case's rounds:
  // two sets so that both lanes' calls may be in flight.
  for (Lane& l : lanes) {
    CK(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
    CB(cublasCreate(&l.blas));
    CB(cublasSetStream(l.blas, l.stream));
    CK(cudaMalloc(&l.pointers, 24 * sizeof(void*)));
  }
  cudaEvent_t start, stop, fork, join;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  int device = 0;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device));
  std::printf("gemm_schedule_probe: %s, %d SMs; M = %ld, %d rounds; times in us\n", prop.name, prop.multiProcessorCount,
              m, rounds);

  for (const Shape& s : kShapes) {
    if (!only.empty() && std::string(s.name).find(only) == std::string::npos) continue;
    const int world = s.tp;
    const long shard = m / world, k = s.k, n = s.n;
    std::printf("\n%s: M x K x N = %ld x %ld x %ld, shards of %ld rows\n", s.name, m, k, n, shard);
    std::printf("%-20s %10s %16s %8s   per rank\n", "scenario", "slowest", "p10..p90", "/whole");
    // times[scenario][rank][round]
    std::vector<std::vector<std::vector<double>>> times(
        kScenarioCount, std::vector<std::vector<double>>(static_cast<std::size_t>(world)));
    auto rows_a = [&](long shard_index) { return a + shard_index * shard * k; };
    auto rows_c = [&](long shard_index) { return c + shard_index * shard * n; };
    for (int round = -2; round < rounds; ++round) {
      for (int rank = 0; rank < world; ++rank) {
        // The batched calls' pointers for this rank: lane 0 all shards (batch all), lane 1 the
        // peers' shards (batch rest: own first, then r-1, r-2, ... as ce-push delivers them).
        std::vector<void*> host_all(24, nullptr), host_rest(24, nullptr);
        for (int i = 0; i < world; ++i) {
          host_all[static_cast<std::size_t>(i)] = rows_a(i);
          host_all[static_cast<std::size_t>(8 + i)] = b;
          host_all[static_cast<std::size_t>(16 + i)] = rows_c(i);
        }
        for (int step = 1; step < world; ++step) {
          const int src = (rank - step + world) % world;
          host_rest[static_cast<std::size_t>(step - 1)] = rows_a(src);
          host_rest[static_cast<std::size_t>(8 + step - 1)] = b;
          host_rest[static_cast<std::size_t>(16 + step - 1)] = rows_c(src);
        }
        CK(cudaMemcpy(lanes[0].pointers, host_all.data(), 24 * sizeof(void*), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(lanes[1].pointers, host_rest.data(), 24 * sizeof(void*), cudaMemcpyHostToDevice));
        for (int si = 0; si < kScenarioCount; ++si) {
          const Scenario& sc = kScenarios[si];
          const Lane& main_lane = lanes[0];
          CK(cudaEventRecord(start, main_lane.stream));
          if (sc.lanes == 2) {
            CK(cudaEventRecord(fork, main_lane.stream));
            CK(cudaStreamWaitEvent(lanes[1].stream, fork, 0));
          }
          int call = 0;
          auto lane_of = [&] { return lanes[sc.lanes == 2 ? (call++ % 2) : 0]; };
          switch (sc.plan) {
            case Plan::whole: gemm(main_lane, m, n, k, a, b, c); break;
            case Plan::chunks:
              for (int step = 0; step < world; ++step) {
                const int src = (rank - step + world) % world;
                gemm(lane_of(), shard, n, k, rows_a(src), b, rows_c(src));
              }
              break;
            case Plan::runs:
              gemm(lane_of(), shard, n, k, rows_a(rank), b, rows_c(rank));
              if (rank > 0) gemm(lane_of(), rank * shard, n, k, rows_a(0), b, rows_c(0));
              if (rank + 1 < world) gemm(lane_of(), (world - rank - 1) * shard, n, k, rows_a(rank + 1), b, rows_c(rank + 1));
              break;
            case Plan::batch_rest: {
              gemm(main_lane, shard, n, k, rows_a(rank), b, rows_c(rank));
              // The rest's pointers are lane 1's arrays; on one lane the call runs on lane 0.
              Lane rest = sc.lanes == 2 ? lanes[1] : lanes[0];
              rest.pointers = lanes[1].pointers;
              batched(rest, shard, n, k, world - 1);
              break;
            }
            case Plan::batch_all: batched(main_lane, shard, n, k, world); break;
          }
          if (sc.lanes == 2) {
            CK(cudaEventRecord(join, lanes[1].stream));
            CK(cudaStreamWaitEvent(main_lane.stream, join, 0));
          }
          CK(cudaEventRecord(stop, main_lane.stream));
          CK(cudaEventSynchronize(stop));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, start, stop));
          if (round >= 0) times[static_cast<std::size_t>(si)][static_cast<std::size_t>(rank)].push_back(ms * 1e3);
        }
      }
    }
    double whole = 0;
    for (int si = 0; si < kScenarioCount; ++si) {
      // The slowest rank per round (the ranks run at once in the real operation).
      std::vector<double> slowest(static_cast<std::size_t>(rounds), 0);
      std::string per_rank;
      for (int rank = 0; rank < world; ++rank) {
        const auto& t = times[static_cast<std::size_t>(si)][static_cast<std::size_t>(rank)];
        for (int i = 0; i < rounds; ++i)
          slowest[static_cast<std::size_t>(i)] = std::max(slowest[static_cast<std::size_t>(i)], t[static_cast<std::size_t>(i)]);
        per_rank += " " + std::to_string(static_cast<int>(percentile(t, 0.5) + 0.5));
      }
      const double med = percentile(slowest, 0.5);
      if (si == 0) whole = med;
      std::printf("%-20s %10.1f %7.1f..%-7.1f %8.3f  %s\n", kScenarios[si].name, med, percentile(slowest, 0.1),
                  percentile(slowest, 0.9), med / whole, per_rank.c_str());
    }
  }
  return 0;
}
