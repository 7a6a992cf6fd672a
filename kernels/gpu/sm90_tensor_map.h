// TMA tensor maps for the Hopper (sm_90a) kernels (flag_gemm_sm90.cu, attention_sm90.cu): the
// driver's encoder, reached through the runtime so that Caravan links no driver library.
#pragma once

#include "kernels/gpu/bf16.h"

#include <cuda.h>  // CUtensorMap

namespace caravan::gpu::sm90 {

// Finds cuTensorMapEncodeTiled once per process; throws Error(device) where the driver lacks it.
void find_tensor_map_encoder();

// A row-major bf16 matrix (rows x cols, leading dimension ld elements) as 128-byte swizzled boxes
// of box_cols x box_rows; reads past its edges are zeros. `who` prefixes the error message.
CUtensorMap tensor_map(const char* who, const bf16* base, long rows, long cols, long ld, int box_cols, int box_rows);

}  // namespace caravan::gpu::sm90
