// Probe (not part of the build): can a copy on one stream of a GPU be held up by copies that other
// streams of that GPU queued behind stream waits on a flag? docs/overlap.md, "Run-ahead", has
// what it printed on 4 x H200 (CUDA 13, driver 580): B's pull from A completes while only A has
// held streams, and stalls once B itself has two streams each holding copies behind a wait.
//   nvcc -arch=sm_90 -O2 -o copy_queue_probe scripts/probes/copy_queue_probe.cu -lcuda
//   timeout 40 ./copy_queue_probe    # needs 2 GPUs with peer access; each case waits 1.5 s
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <thread>
#include <vector>
#include "check.h"
#define DK(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { std::printf("%s:%d drv %d\n", __FILE__, __LINE__, (int)e); std::exit(1);} } while (0)

static bool completes(cudaStream_t s, int ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) { std::printf("query: %s\n", cudaGetErrorString(q)); std::exit(1); }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

int main() {
  const size_t bytes = 8 << 20;
  setvbuf(stdout, nullptr, _IONBF, 0);
  int n = 0; CK(cudaGetDeviceCount(&n));
  if (n < 2) { std::printf("need 2 GPUs\n"); return 0; }
  for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceEnablePeerAccess(1 - d, 0)); }
  void *a0, *b0, *a1, *b1; unsigned long long* dflag0; unsigned long long* dflag1;
  CK(cudaSetDevice(0)); CK(cudaMalloc(&a0, bytes)); CK(cudaMalloc(&b0, bytes)); CK(cudaMalloc(&dflag0, 8)); CK(cudaMemset(dflag0, 0, 8));
  CK(cudaSetDevice(1)); CK(cudaMalloc(&a1, bytes)); CK(cudaMalloc(&b1, bytes)); CK(cudaMalloc(&dflag1, 8)); CK(cudaMemset(dflag1, 0, 8));
  CK(cudaDeviceSynchronize());
  struct Case { int held_a, copies, held_b; bool peer_held; };
  const Case cases[] = {{1, 1, 0, false}, {1, 1, 0, true}, {3, 40, 0, true}, {3, 40, 2, true}, {6, 40, 4, true}};  // 12 on A and 8 on B never finished being queued
  for (const Case& c : cases) {
    // Held: streams on A (and on B) that wait on a flag in GPU memory, then `copies` copies each (peer pulls B->A on A's streams).
    std::vector<cudaStream_t> held;
    for (int i = 0; i < c.held_a + c.held_b; ++i) {
      const int dev = i < c.held_a ? 0 : 1;
      CK(cudaSetDevice(dev)); cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); held.push_back(s);
      DK(cuStreamWaitValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(dev == 0 ? dflag0 : dflag1), 1, CU_STREAM_WAIT_VALUE_GEQ));
      for (int k = 0; k < c.copies; ++k) {
        if (dev == 0) CK(cudaMemcpyAsync(b0, c.peer_held ? a1 : a0, bytes, cudaMemcpyDefault, s));
        else CK(cudaMemcpyAsync(b1, c.peer_held ? a0 : a1, bytes, cudaMemcpyDefault, s));
      }
    }
    std::printf("case held_a %d copies %d held_b %d: enqueued\n", c.held_a, c.copies, c.held_b);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CK(cudaSetDevice(1)); cudaStream_t other; CK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    CK(cudaMemcpyAsync(a1, b0, bytes, cudaMemcpyDefault, other));  // B pulls from A
    const bool done = completes(other, 1500);
    std::printf("held streams on A %2d (each %2d %s copies), on B %2d: B's pull from A %s\n", c.held_a, c.copies,
                c.peer_held ? "peer" : "local", c.held_b, done ? "completes" : "STALLS");
    unsigned long long one = 1;
    std::printf("   releasing\n");
    CK(cudaSetDevice(0)); CK(cudaMemcpy(dflag0, &one, 8, cudaMemcpyHostToDevice));
    CK(cudaSetDevice(1)); CK(cudaMemcpy(dflag1, &one, 8, cudaMemcpyHostToDevice));
    bool all = completes(other, 5000);
    for (auto s : held) all = completes(s, 5000) && all;
    std::printf("   after release: %s\n", all ? "all done" : "STUCK");
    for (auto s : held) CK(cudaStreamDestroy(s));
    CK(cudaStreamDestroy(other));
    CK(cudaSetDevice(0)); CK(cudaMemset(dflag0, 0, 8)); CK(cudaDeviceSynchronize());
    CK(cudaSetDevice(1)); CK(cudaMemset(dflag1, 0, 8)); CK(cudaDeviceSynchronize());
  }
  return 0;
}
