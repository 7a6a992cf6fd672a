// A GPU task between two copies: the data goes to GPU 0's memory, a task on GPU 0's processor
// runs a kernel on it, and the result comes back, each step ordered after the one before by its
// event. A task body only enqueues work on the stream it is given; the task completes when that
// work has finished on the GPU. Written in CUDA (on AMD the same with hip* names).
// Run: build/release/apps/examples/example_gpu_task (exits 77, "skipped", without a GPU)
#include <caravan/caravan.h>
#include <caravan/platform.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

namespace {

__global__ void scale_and_shift(float* values, long n, float scale, float shift) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n; i += static_cast<long>(gridDim.x) * blockDim.x)
    values[i] = scale * values[i] + shift;
}

struct ScaleArgs {
  float* values;  // the instance's GPU address (Instance::gpu_data)
  long n;
  float scale, shift;
};

}  // namespace

namespace {

int run() {
  const caravan::GpuProbe gpus = caravan::probe_gpus();
  if (gpus.device_count == 0) {
    std::printf("skipped: no GPU (%s)\n", gpus.reason.c_str());
    return 77;
  }
  caravan::TaskId scale = caravan::register_task("example.scale_and_shift", [](caravan::TaskContext& ctx) {
    auto a = ctx.args_as<ScaleArgs>();
    // The processor made this GPU current; enqueue on its stream and return.
    scale_and_shift<<<264, 256, 0, static_cast<cudaStream_t>(ctx.gpu_stream)>>>(a.values, a.n, a.scale, a.shift);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      throw caravan::Error(caravan::Errc::device, std::string("kernel launch: ") + cudaGetErrorString(e));
  });

  caravan::Runtime rt;
  constexpr long n = 1 << 22;
  caravan::FieldSpace value({{"v", sizeof(float)}});
  const caravan::Rect space = caravan::Rect::from_extents({n});
  const caravan::Layout layout = caravan::Layout::parse("F,x");
  auto host = caravan::Instance::create(caravan::local_memory(caravan::MemoryKind::sys), space, value, layout);
  auto on_gpu = caravan::Instance::create(caravan::local_memory(caravan::MemoryKind::fbm, 0), space, value, layout);
  auto result = caravan::Instance::create(caravan::local_memory(caravan::MemoryKind::sys), space, value, layout);
  auto* in = reinterpret_cast<float*>(host.data());
  for (long i = 0; i < n; ++i) in[i] = static_cast<float>(i % 4096) * 0.25f;

  // GPU processors come after the CPU in Runtime::processors(): cpu0, gpu0, gpu1, ...
  const caravan::Processor gpu0{caravan::ProcessorKind::gpu, caravan::Processor::kThisRank, 0};
  caravan::Event up = caravan::copy(host, on_gpu);
  caravan::Event scaled = rt.spawn(scale, caravan::task_args(ScaleArgs{static_cast<float*>(on_gpu.gpu_data()), n, 3.0f, -1.0f}),
                                   {.precondition = up, .processor = gpu0});
  caravan::Event down = caravan::copy(on_gpu, result, {.precondition = scaled});
  down.wait();

  const auto* out = reinterpret_cast<const float*>(result.data());
  long wrong = 0;
  for (long i = 0; i < n; ++i)
    if (std::abs(static_cast<double>(out[i]) - (3.0 * static_cast<double>(in[i]) - 1.0)) > 1e-6 * (1.0 + std::abs(3.0 * in[i])))
      ++wrong;
  if (wrong != 0) {
    std::printf("%ld of %ld values are wrong\n", wrong, n);
    return 1;
  }
  std::printf("%ld values went to GPU 0, through a kernel and back: all as expected\n", n);
  return 0;
}

}  // namespace

// Caravan reports errors as exceptions: caravan::Error (a code and a message naming what was
// refused, e.g. a bad CARAVAN_DSK_DIR), and EventPoisoned from a wait on an event whose work failed.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_gpu_task: %s\n", e.what());
    return 1;
  }
}
