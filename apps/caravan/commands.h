// Each subcommand of the caravan tool adds itself to the CLI11 app through one function here.
#pragma once

#include <vector>

namespace CLI {
class App;
}

namespace caravan::app {

void add_config_command(CLI::App& app);
// `caravan bench <case>`: adds the bench command and every case; bench_*.cpp each add one case.
void add_bench_command(CLI::App& app);
void add_bench_tasks(CLI::App& bench);
void add_bench_copy(CLI::App& bench);  // also adds `bench priority`
void add_bench_gpu(CLI::App& bench);   // bench_gpu.cpp: sdma/xgmi vs raw HIP copies
void add_bench_gpu_tasks(CLI::App& bench);  // bench_gpu_tasks.cpp: GPU processors vs raw HIP calls
void add_calibrate_command(CLI::App& app);
// `caravan plan` and `caravan machine generate` (plan_command.cpp); `caravan bench plan` (bench_plan.cpp).
void add_plan_command(CLI::App& app);
void add_bench_plan(CLI::App& bench);
// `caravan run -n N [--nodes K] PROGRAM ARGS` (run_command.cpp); `caravan bench nic` (bench_nic.cpp).
void add_run_command(CLI::App& app);
// Before parsing: removes the `--` that may separate `caravan run`'s options from PROGRAM (CLI11
// would hand what follows it to the top level). `args` is argv.
void strip_run_separator(CLI::App& app, std::vector<char*>& args);
void add_bench_nic(CLI::App& bench);
// `caravan bench ipc` (bench_ipc.cpp: copies between GPU memories of ranks of one node vs raw peer copies).
void add_bench_ipc(CLI::App& bench);
// `caravan bench overlap` (bench_overlap.cpp: CPU backend; GPU backend through bench_overlap.h).
void add_bench_overlap(CLI::App& bench);
// `caravan bench llm` (bench_llm.cpp: a tensor-parallel transformer layer, CPU backend).
void add_bench_llm(CLI::App& bench);
// `caravan bench attention` (bench_attention.cpp: the fused attention kernel vs the unfused path; GPU).
void add_bench_attention(CLI::App& bench);
// `caravan bench gemm` (bench_gemm.cpp: the tile GEMM fed by flags vs cuBLAS; GPU).
void add_bench_gemm(CLI::App& bench);

}  // namespace caravan::app
