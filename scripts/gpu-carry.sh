#!/usr/bin/env bash
# Builds the GPU binaries here (nvcc, sm_90) and puts them, stripped, into .devcarry with the
# Debian libraries the GPU machine lacks (UCX, fmt, spdlog, numa), under the device tool's
# 64 MiB carry limit. Then carry ".devcarry" and run scripts/gpu-checks.sh there.
#   usage: scripts/gpu-carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release --target caravan overlap_gpu_tests attention_gpu_tests flag_gemm_gpu_tests gpu_tests ipc_heap_gpu_tests remote_gpu_copy_tests \
  ipc_copy_gpu_tests net_copy_tests
mkdir -p .devcarry/ucx
for b in apps/caravan tests/gpu/overlap_gpu_tests tests/gpu/attention_gpu_tests tests/gpu/flag_gemm_gpu_tests tests/gpu/gpu_tests tests/gpu/ipc_heap_gpu_tests \
         tests/gpu/remote_gpu_copy_tests tests/gpu/ipc_copy_gpu_tests tests/net/net_copy_tests; do
  strip -o ".devcarry/$(basename "$b")" "build/release/$b"
done
strip -o .devcarry/ucx_perftest /usr/bin/ucx_perftest  # the baseline of `bench nic` (Debian's ucx-utils)
for l in libfmt.so.9 libspdlog.so.1.10 libnuma.so.1 libucm.so.0 libucp.so.0 libucs.so.0 libuct.so.0 libgomp.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" .devcarry/
done
for name in libuct_cma.so libuct_cma.so.0; do  # the cma transport (a UCX module)
  cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0 ".devcarry/ucx/$name"
done
du -sh .devcarry
