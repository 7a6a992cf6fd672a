// Probe (not part of the build): what a kernel launch costs the host thread as its arguments
// grow. The gpu_convert channel's kernel (runtime/gpu/op_kernel.cu) takes its batch of up to 56
// ops by value (about 3 KiB) whatever the request holds; a 48 MiB conversion's request is 3 ops.
// For each argument size: the host time of one launch (a stream kept busy, so launches queue
// without waiting), median of 20 rounds of 100 launches, and the time from the launch call to
// the kernel's end when the stream is idle (launch, then synchronize), median of 200.
//   nvcc -arch=sm_90 -O3 -o launch_probe scripts/probes/launch_probe.cu
//   ./launch_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>
#include "check.h"

template <int Bytes>
struct Args {
  unsigned char bytes[Bytes];
};

// Reads one byte of its arguments (so they are not dropped) and writes it where no one looks.
template <int Bytes>
__global__ void touch(Args<Bytes> a, unsigned char* sink) {
  if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] = a.bytes[Bytes - 1];
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

using Clock = std::chrono::steady_clock;
double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <int Bytes>
void measure(cudaStream_t stream, unsigned char* sink) {
  Args<Bytes> a{};
  a.bytes[Bytes - 1] = 1;
  std::vector<double> queued, idle;
  for (int r = 0; r < 20; ++r) {
    spin<<<1, 1, 0, stream>>>(2'000'000);  // about 1 ms: the launches below queue behind it
    CK(cudaGetLastError());
    auto t0 = Clock::now();
    for (int i = 0; i < 100; ++i) touch<Bytes><<<1, 32, 0, stream>>>(a, sink);
    queued.push_back(us(Clock::now() - t0) / 100);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(stream));
  }
  for (int r = 0; r < 200; ++r) {
    auto t0 = Clock::now();
    touch<Bytes><<<1, 32, 0, stream>>>(a, sink);
    CK(cudaStreamSynchronize(stream));
    idle.push_back(us(Clock::now() - t0));
  }
  std::printf("%6d B arguments: %6.2f us per launch (queued), %6.2f us launch to end (idle stream)\n", Bytes,
              median(queued), median(idle));
}

int main() {
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned char* sink = nullptr;
  CK(cudaMalloc(&sink, 64));
  measure<16>(stream, sink);  // warm-up
  measure<16>(stream, sink);
  measure<256>(stream, sink);
  measure<512>(stream, sink);
  measure<1024>(stream, sink);
  measure<2048>(stream, sink);
  measure<3072>(stream, sink);
  measure<4096>(stream, sink);
  CK(cudaFree(sink));
  CK(cudaStreamDestroy(stream));
  return 0;
}
