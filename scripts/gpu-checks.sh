#!/usr/bin/env bash
# The GPU checks and benchmarks, each bounded in time, for a GPU machine reached with little
# time to spare: run it from the repository root after carrying the binaries (see
# docs/gpu.md, "Running the GPU tests and benchmark on the GPU machine").
#
#   usage: scripts/gpu-checks.sh [BIN_DIR] [OUT_DIR] [STEP...]
#     BIN_DIR: where caravan and the GPU test binaries are (what scripts/gpu-carry.sh carries)
#              (default .devcarry; the Debian libraries they need are looked up there too)
#     OUT_DIR: where each step's log goes (default gpu-checks)
#     STEP:    any of tests kernels run-ahead ipc remote copies overlap llm (default: all, in that order),
#              or tuning: the GEMM tuning A/B at the machine's full TP (overlap_gpu_tests, then
#              bench overlap at 8192 tokens and the 70B layer, each with CARAVAN_GPU_GEMM_TUNE 8
#              and 0), or scatter: the GEMMs that store to the peers themselves (tile tests, GEMM+RS and
#              GEMM+AS at M = 8192, the layer, the layer test six times for the TP 4 hang, and the
#              pacing tests five times)
#
# Each step's log is OUT_DIR/<step>.log; a summary line per step is printed at the end. A step
# that hangs is killed at its limit and reported as such; the next step still runs.
set -uo pipefail
bin=${1:-.devcarry}
out=${2:-gpu-checks}
shift $(( $# > 2 ? 2 : $# ))
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels run-ahead ipc remote copies overlap llm)
mkdir -p "$out"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 CARAVAN_CACHE_DIR=${CARAVAN_CACHE_DIR:-/tmp/caravan-cache}
[ -d "$bin/ucx" ] && export UCX_MODULE_DIR="$bin/ucx"  # UCX's transport modules (scripts/gpu-carry.sh)
summary=()

# run NAME LIMIT_S COMMAND...: runs the command with a time limit, logging to OUT/NAME.log.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$out/$name.log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$out/$name.log" 2>&1
  local rc=$?
  local verdict="ok"
  [ $rc -ne 0 ] && verdict="FAILED (exit $rc)"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="KILLED at its ${limit} s limit"
  summary+=("$name: $verdict in $((SECONDS - start)) s")
  return $rc
}

# snapshot PID FILE: every thread's syscall and kernel wait channel, and stacks if gdb is there.
snapshot() {
  local pid=$1 file=$2
  for t in /proc/"$pid"/task/*; do
    [ -r "$t/syscall" ] && echo "$(basename "$t") syscall=$(cut -d' ' -f1 "$t/syscall") wchan=$(cat "$t/wchan" 2>/dev/null)"
  done >"$file"
  command -v gdb >/dev/null && gdb -p "$pid" -batch -ex 'thread apply all bt 30' >>"$file" 2>&1
}

for step in "${steps[@]}"; do
  case $step in
    tests)
      run overlap-tests 240 "$bin/overlap_gpu_tests" --gtest_shuffle --gtest_repeat=2
      ;;
    kernels)
      # One GPU: the tile GEMMs, tuned cuBLAS, attention and the layer's kernels, then their benchmarks.
      run flag-gemm-tests 150 "$bin/flag_gemm_gpu_tests"
      run attention-tests 150 "$bin/attention_gpu_tests"
      run bench-gemm 240 "$bin/caravan" bench gemm
      run bench-attention 240 "$bin/caravan" bench attention
      ;;
    run-ahead)
      # The run-ahead hang (docs/overlap.md): with pacing (the default, around pulls) it should
      # pass; with none, the snapshots say where the rank threads are.
      CARAVAN_TEST_RUN_AHEAD=1 run run-ahead-paced 120 "$bin/overlap_gpu_tests" --gtest_filter='*RunAhead*'
      echo "== run-ahead-unpaced (snapshots at 8 s and 25 s)" >>"$out/run-ahead-unpaced.log"
      CARAVAN_TEST_RUN_AHEAD=1 CARAVAN_OVERLAP_GPU_PACE=none \
        "$bin/overlap_gpu_tests" --gtest_filter='*RunAheadThroughMixedVariantsWithoutLowLatency' \
        >>"$out/run-ahead-unpaced.log" 2>&1 &
      pid=$!
      sleep 8 && kill -0 $pid 2>/dev/null && snapshot $pid "$out/run-ahead-unpaced.t08"
      sleep 17 && kill -0 $pid 2>/dev/null && snapshot $pid "$out/run-ahead-unpaced.t25"
      if kill -0 $pid 2>/dev/null; then
        kill -9 $pid
        summary+=("run-ahead-unpaced: hung (snapshots in $out/run-ahead-unpaced.t08/.t25)")
      else
        wait $pid
        summary+=("run-ahead-unpaced: exited with $? (no hang)")
      fi
      ;;
    ipc)
      for n in 2 4; do
        run "ipc-heap-$n" 240 "$bin/caravan" run -n "$n" --grace 20 "$bin/ipc_heap_gpu_tests"
        run "ipc-copy-$n" 240 "$bin/caravan" run -n "$n" --grace 20 "$bin/ipc_copy_gpu_tests"
      done
      run bench-ipc 240 "$bin/caravan" bench ipc
      ;;
    remote)
      # GPU memory across two logical nodes: fbm -> reg -> UCX -> reg -> fbm, tested, then timed
      # pipelined against staged and against its slowest hop (and the host-to-host path).
      run remote-copy-tests 180 "$bin/caravan" run -n 2 --nodes 2 --grace 20 "$bin/remote_gpu_copy_tests"
      # The host-memory copies between ranks on this machine's UCX (the tests that kill a rank
      # run under ctest only: they expect the launcher's view of a killed rank).
      run net-copy-tests 240 "$bin/caravan" run -n 2 --nodes 2 --grace 20 "$bin/net_copy_tests" --gtest_filter='-*Kill*'
      # Also the raw put rate (net::Rma against ucx_perftest, carried in BIN_DIR) at the tile size.
      PATH="$(cd "$bin" && pwd):$PATH" run bench-remote-gpu 300 "$bin/caravan" bench nic --path-memory fbm --transports default --reps 5 \
        --sizes 4M 32M
      run bench-remote-host 300 "$bin/caravan" bench nic --path-only --path-memory sys --transports default --reps 5
      ;;
    copies)
      run gpu-tests 300 "$bin/gpu_tests"
      run bench-gpu 300 "$bin/caravan" bench gpu
      run bench-gpu-tasks 180 "$bin/caravan" bench gpu-tasks
      ;;
    overlap)
      run bench-overlap 420 "$bin/caravan" bench overlap --backend gpu --json "$out/overlap.json"
      ;;
    tuning)
      # Tuned GEMMs became the default on 2 x H200 (thirty-sixth session); this is the check at
      # TP 4 that the tests pass and what the layer gains, both settings in one call.
      for tune in 8 0; do
        CARAVAN_GPU_GEMM_TUNE=$tune run "tuning-tests-$tune" 240 "$bin/overlap_gpu_tests" --gtest_shuffle
      done
      for tune in 8 0; do  # one round; name the step twice for a second
        CARAVAN_GPU_GEMM_TUNE=$tune run "tuning-overlap-$tune" 300 "$bin/caravan" bench overlap --backend gpu \
          --op ag_gemm gemm_rs --tokens 8192
        CARAVAN_GPU_GEMM_TUNE=$tune run "tuning-llm-$tune" 200 "$bin/caravan" bench llm --backend gpu --model llama3-70b \
          --tokens 8192
      done
      ;;
    scatter)
      run bench-overlap-scatter 240 "$bin/caravan" bench overlap --backend gpu --op gemm_rs gemm_as --tokens 8192
      run bench-llm-layer 150 "$bin/caravan" bench llm --backend gpu --json "$out/llm.json" --plot "$out/llm.svg"
      for i in 1 2 3 4 5 6; do
        run "layer-test-$i" 75 "$bin/overlap_gpu_tests" --gtest_filter='GpuTpLayer.*'
      done
      # Pacing per GPU (eighteenth session): operations queued as the layer queues them.
      run pacing-tests 120 "$bin/overlap_gpu_tests" --gtest_filter='*OperationsQueued*:*CopyEnginePull*' --gtest_repeat=5
      # The collectives alone against NCCL's (AllGather since the nineteenth session, ReduceScatter and All-Scatter since the twentieth).
      run bench-overlap-collectives 240 "$bin/caravan" bench overlap --backend gpu --op allgather reduce_scatter all_scatter --tokens 8192 1024 128
      ;;
    llm)
      run bench-llm 500 "$bin/caravan" bench llm --sweep --iterations 6 --warmup 2 --json "$out/llm-sweep.json"
      ;;
    *)
      echo "gpu-checks: unknown step '$step' (tests kernels run-ahead ipc remote copies overlap llm tuning scatter)" >&2
      exit 2
      ;;
  esac
done
printf '%s\n' "${summary[@]}"
