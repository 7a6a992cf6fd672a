// Probe (not part of the build): the conversion kernel (runtime/gpu/op_kernel.cu) on its own,
// timed with events around each launch, so that two revisions of the kernel can be compared on
// one GPU in one call. Cases: a 48 MiB AOS -> SOA conversion of three 4-byte fields (3 ops, one
// group) and a plain 48 MiB run, both as the gpu_convert channel hands them to the kernel.
// Build it against the kernel file of the revision to time (its header must match):
//   nvcc -arch=sm_90 -O2 -std=c++20 -I. -I include -o op_kernel_probe scripts/probes/op_kernel_probe.cu \
//        runtime/gpu/op_kernel.cu build/release/runtime/libcaravan_runtime.a -lfmt
// With -DOLD_BATCH the harness uses the batch type of the kernel before groups (KernelOpBatch of
// KernelOps, up to 56), for the revision before 2-D groups.
#include "runtime/gpu/op_kernel.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
#include "check.h"

using namespace caravan::gpu;

namespace {

struct Op {  // one strided op: offsets from the two buffers
  std::uint64_t src, dst, elem, count;
  std::int64_t src_stride, dst_stride;
};

#ifdef OLD_BATCH
using Batch = KernelOpBatch;
void add(Batch& b, std::byte* s, std::byte* d, const Op& o) {
  b.ops[b.count++] = KernelOp{s + o.src, d + o.dst, o.elem, o.count, o.src_stride, o.dst_stride};
}
#else
using Batch = KernelBatch;
// The ops of a case are one group: consecutive ops one element apart on the source.
void add(Batch& b, std::byte* s, std::byte* d, const Op& o) {
  if (b.count > 0 && b.groups[b.count - 1].count == o.count && b.groups[b.count - 1].elem == o.elem && o.count > 1) {
    KernelGroup& g = b.groups[b.count - 1];
    if (g.members == 1) {
      g.member_src = (s + o.src) - g.src;
      g.member_dst = (d + o.dst) - g.dst;
    }
    ++g.members;
    return;
  }
  KernelGroup& g = b.groups[b.count++];
  g = KernelGroup{};
  g.src = s + o.src;
  g.dst = d + o.dst;
  g.elem = o.elem;
  g.count = o.count;
  g.src_stride = o.src_stride;
  g.dst_stride = o.dst_stride;
}
#endif

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const std::uint64_t points = (48u << 20) / 12, bytes = points * 12;
  std::byte *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 0x5a, bytes));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  struct Case {
    const char* name;
    std::vector<Op> ops;
  };
  std::vector<Case> cases = {
      {"AOS->SOA 48 MiB, 3 x 4-byte fields", {}},
      {"SOA->AOS 48 MiB, 3 x 4-byte fields", {}},
      {"one run of 48 MiB + 4 bytes off 16-byte alignment", {{4, 0, bytes - 16, 1, 0, 0}}},
  };
  for (std::uint64_t f = 0; f < 3; ++f) {
    cases[0].ops.push_back({4 * f, f * points * 4, 4, points, 12, 4});
    cases[1].ops.push_back({f * points * 4, 4 * f, 4, points, 4, 12});
  }
  for (const Case& c : cases) {
    Batch batch{};
    for (const Op& o : c.ops) add(batch, src, dst, o);
    std::vector<float> ms;
    for (int r = 0; r < 60; ++r) {
      CK(cudaEventRecord(start, stream));
      launch_op_batch(batch, stream);
      CK(cudaEventRecord(stop, stream));
      CK(cudaEventSynchronize(stop));
      float t = 0;
      CK(cudaEventElapsedTime(&t, start, stop));
      if (r >= 10) ms.push_back(t);
    }
    std::printf("%-52s median %7.1f us  (%.0f GB/s moved)  min %.1f max %.1f\n", c.name, median(ms) * 1e3,
                static_cast<double>(bytes) / (median(ms) * 1e-3) / 1e9, *std::min_element(ms.begin(), ms.end()) * 1e3,
                *std::max_element(ms.begin(), ms.end()) * 1e3);
  }
  return 0;
}
