#include "kernels/gpu/sm90_host.h"

#include <caravan/error.h>

#include "runtime/gpu/platform.h"

#include <string>

namespace caravan::gpu::sm90 {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static const EncodeTiled encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CARAVAN_HIP_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || function == nullptr)
      throw Error(Errc::device, "the driver has no cuTensorMapEncodeTiled (CUDA 12 or later is needed)");
    return reinterpret_cast<EncodeTiled>(function);
  }();
  return encode;
}

}  // namespace

bool HopperDevices::ready_on_current_device(const std::function<void()>& setup) {
  int device = 0;
  CARAVAN_HIP_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return false;
  int state = state_[device].load(std::memory_order_acquire);
  if (state == 0) {
    cudaDeviceProp properties{};
    CARAVAN_HIP_CHECK(cudaGetDeviceProperties(&properties, device));
    state = properties.major == 9 && properties.minor == 0 ? 1 : -1;  // sm_90a code runs on 9.0 exactly
    if (state == 1) setup();
    state_[device].store(state, std::memory_order_release);
  }
  return state == 1;
}

int current_multiprocessors() {
  int device = 0, sms = 0;
  CARAVAN_HIP_CHECK(cudaGetDevice(&device));
  CARAVAN_HIP_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

void find_tensor_map_encoder() { (void)encoder(); }

CUtensorMap tensor_map(const char* who, const bf16* base, long rows, long cols, long ld, int box_cols, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(bf16)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(base), dims, strides,
                                    box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw Error(Errc::device, std::string(who) + ": cuTensorMapEncodeTiled failed (" +
                                  std::to_string(static_cast<int>(result)) + ") for a " + std::to_string(rows) + " x " +
                                  std::to_string(cols) + " matrix, ld " + std::to_string(ld));
  return map;
}

}  // namespace caravan::gpu::sm90
