// hipStreamWaitValue64 / hipStreamWriteValue64 on CUDA: the driver's stream memory operations,
// looked up once through the runtime so that nothing links libcuda directly (see platform.h).
#include "runtime/gpu/platform.h"

#if !defined(CARAVAN_GPU_AMD)
#include <cuda.h>

#include <mutex>

namespace {

using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

struct StreamMemOps {
  WaitValue64 wait = nullptr;
  WriteValue64 write = nullptr;
  hipError_t status = hipSuccess;
};

const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    void* wait = nullptr;
    void* write = nullptr;
    cudaDriverEntryPointQueryResult found{};
    o.status = cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &wait, 12000, cudaEnableDefault, &found);
    if (o.status == cudaSuccess && found == cudaDriverEntryPointSuccess)
      o.status = cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &write, 12000, cudaEnableDefault, &found);
    if (o.status == cudaSuccess && found != cudaDriverEntryPointSuccess) o.status = cudaErrorSymbolNotFound;
    o.wait = reinterpret_cast<WaitValue64>(wait);
    o.write = reinterpret_cast<WriteValue64>(write);
    return o;
  }();
  return ops;
}

// Driver errors share their numbers with the runtime's for the cases that occur here.
hipError_t from_driver(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : static_cast<cudaError_t>(r); }

}  // namespace

hipError_t hipStreamWaitValue64(hipStream_t stream, void* ptr, std::uint64_t value, unsigned flags, std::uint64_t mask) {
  const StreamMemOps& ops = stream_mem_ops();
  if (ops.status != hipSuccess) return ops.status;
  if (mask != ~std::uint64_t{0}) return cudaErrorInvalidValue;  // CUDA waits compare the whole word
  return from_driver(ops.wait(stream, reinterpret_cast<CUdeviceptr>(ptr), value, flags));
}

hipError_t hipStreamWriteValue64(hipStream_t stream, void* ptr, std::uint64_t value, unsigned flags) {
  const StreamMemOps& ops = stream_mem_ops();
  if (ops.status != hipSuccess) return ops.status;
  return from_driver(ops.write(stream, reinterpret_cast<CUdeviceptr>(ptr), value, flags));
}
#endif
