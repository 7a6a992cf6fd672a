#!/usr/bin/env bash
# Compiles Caravan's GPU code for an AMD GPU (gfx90a, MI200) with Debian 12's hipcc: the device
# code with hipcc, the host code that calls the HIP runtime with the host compiler against HIP's
# headers (as an AMD build compiles it). A compile check only: no AMD GPU is at hand, so nothing
# built here has run on one. Installs hipcc first if it is missing (Debian package, ~100 MB).
#   usage: scripts/amd-check.sh [--arch gfxNNN]
# Exit status 1 when a file fails to compile, or when a GPU source is in none of the lists below.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=gfx90a
while (($#)); do
  case $1 in
    --arch) arch=${2:?--arch needs a target, e.g. gfx90a}; shift 2 ;;
    *) echo "amd-check: unknown argument '$1' (usage: scripts/amd-check.sh [--arch gfxNNN])" >&2; exit 2 ;;
  esac
done

if ! command -v hipcc >/dev/null; then
  echo "amd-check: installing hipcc"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq hipcc >/dev/null
fi

# Device code: compiled for the AMD target.
device=(runtime/gpu/op_kernel.cu runtime/gpu/probe.cu runtime/gpu/stream_memops.cu
        kernels/gpu/elementwise.cu kernels/gpu/layer_kernels.cu kernels/gpu/sm_copy.cu
        tests/gpu/flag_handoff.cu tests/gpu/task_kernels.cu tests/gpu/tile_consumer.cu)
# Host code against the HIP runtime API.
host=(runtime/gpu/devices.cpp runtime/gpu/devices_none.cpp runtime/gpu/copy_queue.cpp runtime/gpu/task_streams.cpp
      runtime/gpu_processor.cpp runtime/dma/calibrate.cpp runtime/dma/engine.cpp runtime/dma/remote_copy.cpp
      runtime/dma/storage.cpp
      channels/gpu_channel.cpp channels/sdma_channel.cpp channels/xgmi_channel.cpp channels/gpu_convert_channel.cpp
      kernels/gpu/gpu_heap.cpp kernels/gpu/overlap.cpp kernels/gpu/tp_layer.cpp
      apps/caravan/bench_gpu.cpp apps/caravan/bench_gpu_tasks.cpp apps/caravan/bench_ipc.cpp apps/caravan/bench_nic.cpp
      tests/gpu/attention_test.cpp tests/gpu/layer_kernels_test.cpp tests/gpu/flag_gemm_test.cpp tests/gpu/blas_tuning_test.cpp tests/gpu/gpu_copy_test.cpp tests/gpu/gpu_processor_test.cpp
      tests/gpu/ipc_copy_test.cpp tests/gpu/ipc_heap_test.cpp tests/gpu/overlap_gpu_test.cpp
      tests/gpu/remote_gpu_copy_test.cpp tests/runtime/gpu_processor_test.cpp)
# NVIDIA only, and why.
declare -A nvidia_only=(
  [kernels/gpu/blas.cpp]="cuBLAS; Debian 12 packages no hipBLAS or rocBLAS"
  [kernels/gpu/flag_gemm.cu]="WMMA (nvcuda::wmma); an AMD tile GEMM would use MFMA"
  [kernels/gpu/flag_gemm_sm90.cu]="TMA and wgmma: Hopper only"
  [kernels/gpu/attention_sm90.cu]="TMA and wgmma: Hopper only"
  [kernels/gpu/sm90_host.cu]="the CUDA driver's TMA tensor maps, for the Hopper kernels"
  [kernels/gpu/attention.cu]="mma.sync, ldmatrix and cp.async PTX; an AMD version would use MFMA"
  [apps/caravan/bench_overlap_gpu.cpp]="the NCCL baseline; Debian 12 packages no RCCL"
  [apps/caravan/bench_llm_gpu.cpp]="the NCCL baseline; Debian 12 packages no RCCL"
  [apps/caravan/bench_gemm.cpp]="its GPU part runs on the NCCL rank harness (bench_gpu_ranks.h); no RCCL"
  [apps/caravan/bench_attention.cpp]="its GPU part runs on the NCCL rank harness (bench_gpu_ranks.h); no RCCL"
  [apps/examples/gpu_task.cu]="an example of a task body written in CUDA"
  [scripts/probes/all_to_all_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/copy_queue_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/conversion_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/exchange_floor_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/launch_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/op_kernel_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/ll_format_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
  [scripts/probes/gemm_interference_probe.cu]="a standalone CUDA probe of the GPU machine (cuBLAS), not part of the build"
  [scripts/probes/gemm_schedule_probe.cu]="a standalone CUDA probe of the GPU machine (cuBLAS), not part of the build"
  [scripts/probes/gemm_algo_probe.cu]="a standalone CUDA probe of the GPU machine (cuBLAS), not part of the build"
  [scripts/probes/layer_kernels_probe.cu]="a standalone CUDA probe of the GPU machine, not part of the build"
)

# Every GPU source must be in a list, so that a new one is not skipped unnoticed: every .cu file,
# and every .cpp file that includes a GPU header (runtime/gpu/, kernels/gpu/, runtime/gpu_processor.h)
# or lives in a GPU folder.
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "amd-check: needs a git checkout (it lists the GPU sources with git)" >&2
  exit 2
fi
listed=" ${device[*]} ${host[*]} ${!nvidia_only[*]} "
unlisted=()
while IFS= read -r f; do
  [[ $listed == *" $f "* ]] || unlisted+=("$f")
done < <({ git ls-files '*.cu' 'kernels/gpu/*.cpp' 'runtime/gpu/*.cpp' 'tests/gpu/*.cpp'
           git grep -l -E '#include "(runtime/gpu/|kernels/gpu/|runtime/gpu_processor.h)' -- '*.cpp'; } |
         sort -u | grep -v -e '^runtime/gpu/probe_none.cpp$')

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c++20 -Wall -Wextra -Wno-missing-field-initializers -DCARAVAN_HAVE_GPU=1 -DFMT_SHARED -I. -Iinclude)
failed=()
check() {  # check FILE COMMAND...: runs the compile, keeping its messages when it fails
  local file=$1
  shift
  if "$@" >"$out/log" 2>&1; then
    echo "ok      $file$(grep -c 'warning:' "$out/log" | sed -e 's/^0$//' -e 's/..*/ (& warnings)/')"
  else
    echo "FAILED  $file"
    { grep -E 'error' "$out/log" || tail -3 "$out/log"; } | head -5 | sed 's/^/          /' || true
    failed+=("$file")
  fi
}
echo "== device code, hipcc --offload-arch=$arch ($(hipcc --version 2>/dev/null | grep -m1 'HIP version'))"
for f in "${device[@]}"; do check "$f" hipcc -x hip --offload-arch="$arch" "${flags[@]}" -c "$f" -o "$out/device.o"; done
echo "== host code against HIP's headers, $(c++ --version | head -1)"
for f in "${host[@]}"; do check "$f" c++ -D__HIP_PLATFORM_AMD__ "${flags[@]}" -fsyntax-only "$f"; done
echo "== NVIDIA only"
for f in $(printf '%s\n' "${!nvidia_only[@]}" | sort); do echo "skipped $f: ${nvidia_only[$f]}"; done

status=0
if ((${#unlisted[@]})); then
  echo "amd-check: GPU sources in no list (add each to device, host or nvidia_only): ${unlisted[*]}" >&2
  status=1
fi
if ((${#failed[@]})); then
  echo "amd-check: ${#failed[@]} file(s) failed to compile for $arch: ${failed[*]}" >&2
  status=1
else
  echo "amd-check: ${#device[@]} device and ${#host[@]} host files compile for $arch (not run: no AMD GPU here)"
fi
exit $status
