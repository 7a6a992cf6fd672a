// Probe (not part of the build): the layer's element-wise kernels before and after the 34th
// session, on one GPU, at the Llama layers' shapes; L2 flushed before each call, 30 calls of each
// alternating, medians; and whether old and new write the same bits.
//   RMSNorm: the two-pass kernel against the row held in registers (kernels/gpu/layer_kernels.cu
//   since), 256 threads a row as the library launches it, and with fewer threads (not taken).
//   SwiGLU: the grid-stride loop dividing by the width per vector against the 2-D grid.
//   add: the grid capped at 4096 blocks (as the library has it) against uncapped (no gain: kept).
// Build: nvcc -arch=sm_90 -O2 -std=c++20 -o layer_kernels_probe scripts/probes/layer_kernels_probe.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cmath>
#include "check.h"
typedef __nv_bfloat16 bf16;
struct Vec8 { float v[8]; };
__device__ inline Vec8 load8(const bf16* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  Vec8 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) { float2 f = __bfloat1622float2(h[k]); out.v[2*k]=f.x; out.v[2*k+1]=f.y; }
  return out;
}
__device__ inline void store8(bf16* p, const Vec8& x) {
  uint4 raw; auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(x.v[2*k], x.v[2*k+1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ inline float block_sum(float x, float* scratch) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}
__global__ void old_kernel(const bf16* x, long cols, const float* weight, bf16* out) {
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
template <int kV>
__global__ void new_kernel(const bf16* x, long cols, const float* weight, bf16* out) {
  __shared__ float scratch[32];
  const bf16* row = x + blockIdx.x * cols;
  Vec8 v[kV];
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kV; ++i) {
    const long c = (threadIdx.x + static_cast<long>(i) * blockDim.x) * 8;
    if (c < cols) v[i] = load8(row + c);
    else for (int k = 0; k < 8; ++k) v[i].v[k] = 0;
  }
#pragma unroll
  for (int i = 0; i < kV; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += v[i].v[k] * v[i].v[k];
  const float inverse = rsqrtf(block_sum(sum, scratch) / static_cast<float>(cols) + 1e-6f);
#pragma unroll
  for (int i = 0; i < kV; ++i) {
    const long c = (threadIdx.x + static_cast<long>(i) * blockDim.x) * 8;
    if (c >= cols) continue;
    const float4 w0 = *reinterpret_cast<const float4*>(weight + c), w1 = *reinterpret_cast<const float4*>(weight + c + 4);
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[i].v[k] = v[i].v[k] * inverse * w[k];
    store8(out + blockIdx.x * cols + c, v[i]);
  }
}
void rmsnorm_cases(){
  long shapes[][2]={{2048,8192},{4096,8192},{1024,4096},{2048,4096},{8192,8192},{256,8192}};
  bf16 *x,*o1,*o2; float* w;
  CK(cudaMalloc(&x,8192L*8192*2)); CK(cudaMalloc(&o1,8192L*8192*2)); CK(cudaMalloc(&o2,8192L*8192*2)); CK(cudaMalloc(&w,8192*4));
  std::vector<float> hw(8192); for(int i=0;i<8192;i++) hw[i]=0.8f+0.4f*((i*37)%100)/100.0f;
  CK(cudaMemcpy(w,hw.data(),8192*4,cudaMemcpyHostToDevice));
  probe_fill<<<1024, 256>>>(x, 8192L * 8192, 3, 2.0f);
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  // a big buffer to flush L2
  char* flush; CK(cudaMalloc(&flush, 256<<20));
  for(auto& s: shapes){ long rows=s[0], cols=s[1];
    std::vector<float> t_old, t_new[3];
    for(int rep=-2; rep<30; ++rep){
      for(int which=0; which<4; ++which){
        CK(cudaMemsetAsync(flush, rep&0xff, 256<<20));
        cudaEventRecord(a);
        if(which==0) old_kernel<<<rows,256>>>(x,cols,w,o1);
        else if(which==1){ if(cols/8<=256*4) new_kernel<4><<<rows,256>>>(x,cols,w,o2); else new_kernel<8><<<rows,256>>>(x,cols,w,o2);} 
        else if(which==2){ int th=cols/8/4; new_kernel<4><<<rows,th>>>(x,cols,w,o2);} 
        else { int th=cols/8/8; if(th<32) th=32; new_kernel<8><<<rows,th>>>(x,cols,w,o2);} 
        cudaEventRecord(b); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms,a,b);
        if(rep>=0){ if(which==0) t_old.push_back(ms*1e3); else t_new[which-1].push_back(ms*1e3);} 
      }
    }
    // compare outputs (last written by which=3; rerun which=1 for compare)
    if(cols/8<=256*4) new_kernel<4><<<rows,256>>>(x,cols,w,o2); else new_kernel<8><<<rows,256>>>(x,cols,w,o2);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned short> h1(rows*cols), h2(rows*cols);
    CK(cudaMemcpy(h1.data(),o1,rows*cols*2,cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(),o2,rows*cols*2,cudaMemcpyDeviceToHost));
    long diff=0; for(long i=0;i<rows*cols;i++) if(h1[i]!=h2[i]) diff++;
    auto med=[](std::vector<float> v){std::sort(v.begin(),v.end()); return v[v.size()/2];};
    double bytes=2.0*rows*cols*2;
    printf("%5ld x %5ld: old %.1f us (%.2f TB/s)  new256 %.1f (%.2f)  new-4per %.1f  new-8per %.1f   bits differ %ld\n", rows, cols,
      med(t_old), bytes/med(t_old)/1e6, med(t_new[0]), bytes/med(t_new[0])/1e6, med(t_new[1]), med(t_new[2]), diff);
  }
}

__global__ void swiglu_old(const bf16* up_gate, long rows, long f, bf16* out) {
  const long per_row = f / 8, total = rows * per_row;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < total; i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = i / per_row, c = (i % per_row) * 8;
    Vec8 up = load8(up_gate + r * 2 * f + c);
    const Vec8 gate = load8(up_gate + r * 2 * f + f + c);
#pragma unroll
    for (int k = 0; k < 8; ++k) up.v[k] *= gate.v[k] / (1.0f + expf(-gate.v[k]));
    store8(out + r * f + c, up);
  }
}
__global__ void swiglu_new(const bf16* up_gate, long rows, long f, bf16* out) {
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
__global__ void add_old(const bf16* a, const bf16* b, bf16* out, size_t vectors) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < vectors; i += (size_t)gridDim.x * blockDim.x) {
    Vec8 x = load8(a + 8 * i); const Vec8 y = load8(b + 8 * i);
#pragma unroll
    for (int k = 0; k < 8; ++k) x.v[k] += y.v[k];
    store8(out + 8 * i, x);
  }
}
int grid_for(long work, int cap = 4096) { long b = (work + 255) / 256; return (int)std::max(1L, std::min((long)cap, b)); }
void swiglu_add_cases(){
  long shapes[][2]={{8192,7168},{8192,3584},{4096,7168},{8192,14336},{16384,7168}};
  bf16 *x,*o1,*o2; size_t maxe = 16384L*14336*2;
  CK(cudaMalloc(&x,maxe*2)); CK(cudaMalloc(&o1,maxe)); CK(cudaMalloc(&o2,maxe));
  probe_fill<<<1024, 256>>>(x, maxe, 3, 2.0f);  // values in [-1, 1]
  char* flush; CK(cudaMalloc(&flush, 256<<20));
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto med=[](std::vector<float> v){std::sort(v.begin(),v.end()); return v[v.size()/2];};
  for(auto& s: shapes){ long rows=s[0], f=s[1];
    std::vector<float> t[3];
    for(int rep=-2; rep<30; ++rep) for(int w=0; w<3; ++w){
      CK(cudaMemsetAsync(flush, rep&0xff, 256<<20));
      cudaEventRecord(a);
      if(w==0) swiglu_old<<<grid_for(rows*f/8),256>>>(x,rows,f,o1);
      else if(w==1) { dim3 g((unsigned)((f/8+255)/256), (unsigned)std::min(rows, 65535L)); swiglu_new<<<g,256>>>(x,rows,f,o2);} 
      else { dim3 g((unsigned)((f/8+127)/128), (unsigned)std::min(rows, 65535L)); swiglu_new<<<g,128>>>(x,rows,f,o2);} 
      cudaEventRecord(b); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms,a,b); if(rep>=0) t[w].push_back(ms*1e3);
    }
    CK(cudaGetLastError());
    { dim3 g((unsigned)((f/8+255)/256), (unsigned)std::min(rows, 65535L)); swiglu_new<<<g,256>>>(x,rows,f,o2);} 
    swiglu_old<<<grid_for(rows*f/8),256>>>(x,rows,f,o1);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned short> h1(rows*f), h2(rows*f);
    CK(cudaMemcpy(h1.data(),o1,rows*f*2,cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(),o2,rows*f*2,cudaMemcpyDeviceToHost));
    long diff=0; for(long i=0;i<rows*f;i++) if(h1[i]!=h2[i]) diff++;
    double bytes = 3.0*rows*f*2;
    printf("swiglu %5ld x %5ld: old %.1f us (%.2f TB/s)  new256 %.1f (%.2f)  new128 %.1f  bits differ %ld\n", rows,f, med(t[0]), bytes/med(t[0])/1e6, med(t[1]), bytes/med(t[1])/1e6, med(t[2]), diff);
  }
  long adds[]={2048L*8192, 4096L*8192, 1024L*4096, 8192L*8192};
  for(long n: adds){ std::vector<float> t[2];
    for(int rep=-2; rep<30; ++rep) for(int w=0; w<2; ++w){
      CK(cudaMemsetAsync(flush, rep&0xff, 256<<20));
      cudaEventRecord(a);
      if(w==0) add_old<<<grid_for(n/8),256>>>(x, x+n, o1, n/8); else add_old<<<grid_for(n/8, 1<<30),256>>>(x, x+n, o2, n/8);
      cudaEventRecord(b); CK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms,a,b); if(rep>=0) t[w].push_back(ms*1e3);
    }
    double bytes=3.0*n*2;
    printf("add %9ld: capped %.1f us (%.2f TB/s)  uncapped %.1f (%.2f)\n", n, med(t[0]), bytes/med(t[0])/1e6, med(t[1]), bytes/med(t[1])/1e6);
  }
}

int main() {
  rmsnorm_cases();
  swiglu_add_cases();
}
