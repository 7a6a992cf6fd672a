// The Hopper (sm_90a) path of fused_causal_attention (kernels.h), in the sm90 library (built for
// that one architecture): attention.cu calls it when the current device can run it.
#pragma once

#include "kernels/gpu/kernels.h"

namespace caravan::gpu::sm90 {

// Whether the current device runs the Hopper kernel (compute capability 9.0); the first call on a
// device also grants the kernel its shared memory there (call it before peers spin).
bool attention_available();
// Head widths the Hopper kernel takes: 64 and 128 (whole 128-byte rows of a TMA box).
bool attention_supports(long head_dim);
// fused_causal_attention's contract with 128 query rows per block; the caller has checked the
// arguments, that attention_supports(a.head_dim) and that attention_available() hold.
void fused_causal_attention(const AttentionArguments& a, hipStream_t stream);

}  // namespace caravan::gpu::sm90
