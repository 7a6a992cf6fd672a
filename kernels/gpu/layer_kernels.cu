// The element-wise kernels of the GPU transformer layer (kernels.h): RMSNorm, residual add,
// SwiGLU and the causal softmax of attention. fp32 arithmetic on bf16 data, 16-byte vectors.
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/device.cuh"

#include <caravan/error.h>

#include <cmath>
#include <cstdint>
#include <string>

namespace caravan::gpu {
namespace {

constexpr int kThreads = 256;

struct Vec8 {
  float v[8];
};
__device__ inline Vec8 load8(const bf16* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const bf16x2*>(&raw);
  Vec8 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = bf16x2_to_float2(h[k]);
    out.v[2 * k] = f.x;
    out.v[2 * k + 1] = f.y;
  }
  return out;
}
__device__ inline void store8(bf16* p, const Vec8& x) {
  uint4 raw;
  auto* h = reinterpret_cast<bf16x2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = floats_to_bf16x2(x.v[2 * k], x.v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Sum over the block (every thread gets it); `scratch` holds one float per warp.
__device__ inline float block_sum(float x, float* scratch) {
  for (int o = 16; o > 0; o /= 2) x += dev::shfl_xor32(x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// Any width (or a weight not 16-byte aligned): two passes over the row, the second from cache.
__global__ void rmsnorm_kernel(const bf16* x, long cols, const float* weight, bf16* out) {
  __shared__ float scratch[32];
  const bf16* row = x + blockIdx.x * cols;
  float sum = 0;
  for (long c = threadIdx.x * 8L; c < cols; c += blockDim.x * 8L) {
    const Vec8 v = load8(row + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += v.v[k] * v.v[k];
  }
  const float inverse = rsqrtf(block_sum(sum, scratch) / static_cast<float>(cols) + 1e-6f);
  for (long c = threadIdx.x * 8L; c < cols; c += blockDim.x * 8L) {
    Vec8 v = load8(row + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) v.v[k] = v.v[k] * inverse * weight[c + k];
    store8(out + blockIdx.x * cols + c, v);
  }
}

// Rows of at most kVectors x kThreads vectors: each thread loads all of its vectors at once and
// keeps them in registers, so the row is read once and the loads overlap (1.2-1.6x the two-pass
// kernel on an H200 at the Llama widths, the same bits: docs/results/layer-kernels-h200-s34.txt).
template <int kVectors>
__global__ void rmsnorm_registers_kernel(const bf16* x, long cols, const float* weight, bf16* out) {
  __shared__ float scratch[32];
  const bf16* row = x + blockIdx.x * cols;
  Vec8 v[kVectors];
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kVectors; ++i) {
    const long c = (threadIdx.x + static_cast<long>(i) * blockDim.x) * 8;
    if (c < cols) {
      v[i] = load8(row + c);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[i].v[k] = 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < kVectors; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += v[i].v[k] * v[i].v[k];
  const float inverse = rsqrtf(block_sum(sum, scratch) / static_cast<float>(cols) + 1e-6f);
#pragma unroll
  for (int i = 0; i < kVectors; ++i) {
    const long c = (threadIdx.x + static_cast<long>(i) * blockDim.x) * 8;
    if (c >= cols) continue;
    const float4 w0 = *reinterpret_cast<const float4*>(weight + c);
    const float4 w1 = *reinterpret_cast<const float4*>(weight + c + 4);
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[i].v[k] = v[i].v[k] * inverse * w[k];
    store8(out + blockIdx.x * cols + c, v[i]);
  }
}

__global__ void add_kernel(const bf16* a, const bf16* b, bf16* out, std::size_t vectors) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    Vec8 x = load8(a + 8 * i);
    const Vec8 y = load8(b + 8 * i);
#pragma unroll
    for (int k = 0; k < 8; ++k) x.v[k] += y.v[k];
    store8(out + 8 * i, x);
  }
}

// Block (x, y) takes 256 vectors of rows y, y + gridDim.y, ...: no division per vector (the
// grid-stride loop over all vectors that this replaced divided by the row width for each one,
// 7-9% slower on an H200, docs/results/layer-kernels-h200-s34.txt).
__global__ void swiglu_kernel(const bf16* up_gate, long rows, long f, bf16* out) {
  const long c = (blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x) * 8;
  if (c >= f) return;
  for (long r = blockIdx.y; r < rows; r += gridDim.y) {
    Vec8 up = load8(up_gate + r * 2 * f + c);
    const Vec8 gate = load8(up_gate + r * 2 * f + f + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) up.v[k] *= gate.v[k] / (1.0f + expf(-gate.v[k]));
    store8(out + r * f + c, up);
  }
}

// One block per row: an online max/sum over the row's valid keys (one pass), then the writes.
__global__ void causal_softmax_kernel(const float* scores, long cols, long rows_per_head, long first_query, bf16* out) {
  __shared__ float scratch_max[32], scratch_sum[32];
  const long row = blockIdx.x;
  const long valid = min(cols, first_query + row % rows_per_head + 1);
  const float* s = scores + row * cols;
  float top = -INFINITY, sum = 0;
  for (long j = threadIdx.x; j < valid; j += blockDim.x) {
    const float x = s[j];
    if (x > top) {
      sum = sum * expf(top - x) + 1.0f;
      top = x;
    } else {
      sum += expf(x - top);
    }
  }
  // Combine (max, sum) pairs: first within warps, then across them.
  for (int o = 16; o > 0; o /= 2) {
    const float other_top = dev::shfl_xor32(top, o), other_sum = dev::shfl_xor32(sum, o);
    const float t = fmaxf(top, other_top);
    sum = (top == -INFINITY ? 0.0f : sum * expf(top - t)) + (other_top == -INFINITY ? 0.0f : other_sum * expf(other_top - t));
    top = t;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) scratch_max[warp] = top, scratch_sum[warp] = sum;
  __syncthreads();
  float t = -INFINITY;
  for (int w = 0; w < warps; ++w) t = fmaxf(t, scratch_max[w]);
  float total = 0;
  for (int w = 0; w < warps; ++w)
    if (scratch_max[w] != -INFINITY) total += scratch_sum[w] * expf(scratch_max[w] - t);
  const float inverse = 1.0f / total;
  bf16* p = out + row * cols;
  for (long j = threadIdx.x; j < cols; j += blockDim.x)
    p[j] = float_to_bf16(j < valid ? expf(s[j] - t) * inverse : 0.0f);
}

__global__ void to_float_kernel(const bf16* in, float* out, std::size_t count) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = bf16_to_float(in[i]);
}

int grid_for(long work, int cap = 4096) {
  const long blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

void require_vectors(const char* what, long n) {
  if (n <= 0 || n % 8 != 0)
    throw Error(Errc::invalid_argument, std::string(what) + ": width must be a positive multiple of 8 (16-byte vectors), got " +
                                            std::to_string(n));
}

}  // namespace

void preload_layer_kernels() {
  hipFuncAttributes attributes;
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&rmsnorm_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&rmsnorm_registers_kernel<1>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&rmsnorm_registers_kernel<2>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&rmsnorm_registers_kernel<4>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&rmsnorm_registers_kernel<8>)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&add_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&swiglu_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&causal_softmax_kernel)));
  CARAVAN_HIP_CHECK(hipFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&to_float_kernel)));
}

void to_float(const bf16* in, float* out, std::size_t count, hipStream_t stream) {
  if (count == 0) return;
  launch_checked(to_float_kernel, dim3(grid_for(static_cast<long>(count))), dim3(kThreads), 0, stream, in, out, count);
}

void rmsnorm(const bf16* x, long rows, long cols, const float* weight, bf16* out, hipStream_t stream) {
  require_vectors("rmsnorm", cols);
  if (rows <= 0) return;
  const auto blocks = static_cast<unsigned>(rows);
  const long per_thread = (cols / 8 + kThreads - 1) / kThreads;
  if (reinterpret_cast<std::uintptr_t>(weight) % 16 != 0 || per_thread > 8)
    launch_checked(rmsnorm_kernel, dim3(blocks), dim3(kThreads), 0, stream, x, cols, weight, out);
  else if (per_thread > 4)
    launch_checked(rmsnorm_registers_kernel<8>, dim3(blocks), dim3(kThreads), 0, stream, x, cols, weight, out);
  else if (per_thread > 2)
    launch_checked(rmsnorm_registers_kernel<4>, dim3(blocks), dim3(kThreads), 0, stream, x, cols, weight, out);
  else if (per_thread > 1)
    launch_checked(rmsnorm_registers_kernel<2>, dim3(blocks), dim3(kThreads), 0, stream, x, cols, weight, out);
  else
    launch_checked(rmsnorm_registers_kernel<1>, dim3(blocks), dim3(kThreads), 0, stream, x, cols, weight, out);
}

void add(const bf16* a, const bf16* b, bf16* out, std::size_t count, hipStream_t stream) {
  require_vectors("add", static_cast<long>(count));
  launch_checked(add_kernel, dim3(grid_for(static_cast<long>(count / 8))), dim3(kThreads), 0, stream, a, b, out,
                 count / 8);
}

void swiglu(const bf16* up_gate, long rows, long f, bf16* out, hipStream_t stream) {
  require_vectors("swiglu", f);
  if (rows <= 0) return;
  const dim3 grid(static_cast<unsigned>((f / 8 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(rows < 65535 ? rows : 65535));
  launch_checked(swiglu_kernel, dim3(grid), dim3(kThreads), 0, stream, up_gate, rows, f, out);
}

void causal_softmax(const float* scores, long rows, long cols, long rows_per_head, long first_query, bf16* out,
                    hipStream_t stream) {
  if (rows <= 0 || cols <= 0 || rows_per_head <= 0 || first_query < 0)
    throw Error(Errc::invalid_argument, "causal_softmax: rows, cols and rows_per_head must be positive, first_query >= 0");
  launch_checked(causal_softmax_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream, scores, cols,
                 rows_per_head, first_query, out);
}

}  // namespace caravan::gpu
