// A tensor-parallel transformer layer on the GPUs of a node, the GPU form of the CPU layer in
// include/caravan/kernels/tp_layer.h (same shape, weights, steps and reference), sequence
// parallel (Megatron-style):
//
//   x_r [M/W, H] -> RMSNorm -> AllGather+GEMM (QKV; query and key/value heads split over ranks)
//     -> causal attention (grouped-query) -> GEMM+ReduceScatter (output projection) -> + x_r
//     -> RMSNorm -> AllGather+GEMM (up | gate) -> SwiGLU -> GEMM+ReduceScatter (down) -> + residual
//
// Each of the four communications runs either bulk-synchronous through a BulkCollectives (the
// baseline: NCCL collective, then cuBLAS GEMM, as PyTorch+NCCL runs it) or overlapped with
// Caravan's operations (kernels/gpu/overlap.h) in the variants a LayerCommunication names.
// Attention is fused (kernels.h: fused_causal_attention, a flash-attention kernel) where the head
// width allows, or unfused on request: per block of queries a cuBLAS batched GEMM for the scores
// (fp32), a causal softmax kernel and a batched GEMM with V, only the causal part of the keys
// computed. Every communication mode runs the same attention and element-wise kernels.
// One host thread drives each rank, like the operations it uses.
#pragma once

#include "kernels/gpu/overlap.h"

#include <caravan/kernels/tp_layer.h>

#include <mutex>
#include <string>

namespace caravan::gpu {

// Collectives for the bulk-synchronous layer (the benchmark's NCCL baseline implements them).
class BulkCollectives {
 public:
  virtual ~BulkCollectives() = default;
  // out [world x count] = every rank's `in` [count], in rank order.
  virtual void all_gather(int rank, const bf16* in, bf16* out, std::size_t count, hipStream_t stream) = 0;
  // out [count] on rank r = the sum over ranks of their in[r * count, (r + 1) * count).
  virtual void reduce_scatter(int rank, const bf16* in, bf16* out, std::size_t count, hipStream_t stream) = 0;
};

// The unfused causal attention (per block of `query_block` queries: the scores by cuBLAS into
// `scores`, q_heads x query_block x tokens floats, the causal softmax into `probs`, as many bf16,
// then probabilities x V by cuBLAS): the layer's path for head widths the fused kernel does not
// take, and the fused kernel's baseline in `caravan bench attention`.
void unfused_causal_attention(Blas& blas, const AttentionArguments& a, long query_block, float* scores, bf16* probs,
                              hipStream_t stream);

// Which attention the layer runs: fused where the head width allows (automatic), always fused
// (an unsupported head width is an error), or always unfused.
enum class AttentionKind { automatic, fused, unfused };

// How the layer communicates.
struct LayerCommunication {
  std::string name;
  BulkCollectives* bulk = nullptr;  // set: bulk-synchronous through these; the variants below unused
  // No communication at all: each GEMM runs on this rank's stale buffers (random values, filled
  // once at construction). Its output is meaningless; its time is the bound any overlap can reach
  // (compute alone).
  bool skip_communication = false;
  AgGemmVariant all_gather = AgGemmVariant::ce_push;
  int all_gather_lanes = 1;
  GemmRsVariant reduce_scatter = GemmRsVariant::ce_push;
  int reduce_scatter_lanes = 1;
  int reduce_scatter_splits = 1;
  // The out projection's parts, when it wants other than the down projection's (0: the same).
  // Its K is H / W against F / W for the down projection, so its parts' GEMMs are shorter than
  // their pushes sooner (at TP 4 the ring wants x4 parts there and x2 for the down projection).
  int out_proj_splits = 0;
};

class GpuTpLayer {
 public:
  // Throws Error(invalid_argument) for a shape the world size does not divide or whose widths
  // are not multiples of 8. Runs every GEMM shape and kernel once (see overlap.h: no first
  // launch while a peer's flag is awaited), so construct it with no work in flight.
  // `query_block`: queries per block of the unfused attention (the scores of a block take
  // heads x block x keys floats).
  GpuTpLayer(GpuTeam& team, const kernels::TpLayerShape& shape, LayerCommunication communication,
             long query_block = 1024, AttentionKind attention_kind = AttentionKind::automatic);
  ~GpuTpLayer();
  GpuTpLayer(const GpuTpLayer&) = delete;
  GpuTpLayer& operator=(const GpuTpLayer&) = delete;

  // Every rank's slices of the full weights (the CPU layer's layout). Synchronous.
  void set_weights(const kernels::TpLayerWeights& weights);
  // Random weights generated on the devices (uniform, scaled by 1 / sqrt(fan-in); norms 1).
  void set_random_weights(std::uint64_t seed);

  // Enqueues the layer on `stream` of rank's device: y = layer(x), x and y this rank's rows
  // [M/W, H]. Every rank calls run() equally often.
  void run(int rank, const bf16* x, bf16* y, hipStream_t stream);
  // The device time of each step of rank's last run (waits for that run, at most 60 s; then
  // throws Error(timeout) with describe_progress() in its message).
  kernels::LayerTimes step_times(int rank);
  // For a hang report: how far each rank's last run has got (the steps whose end the GPU has
  // passed, found by event queries, which never block) and the flag words of its four
  // operations (AllGatherGemm::describe_flags, GemmReduceScatter::describe_flags). Thread-safe.
  std::string describe_progress() const;

  const kernels::TpLayerShape& shape() const { return shape_; }
  const LayerCommunication& communication() const { return communication_; }
  bool fused_attention() const { return fused_attention_; }
  // Device memory one rank needs for a layer of this shape: symmetric heap bytes (overlapped
  // communication) and private bytes.
  static std::uint64_t heap_bytes(const kernels::TpLayerShape& shape, int world);

 private:
  struct Rank;
  void attention(int rank, hipStream_t stream);

  GpuTeam& team_;
  kernels::TpLayerShape shape_;
  LayerCommunication communication_;
  int world_;
  long rows_, q_heads_, kv_heads_, head_dim_, qkv_cols_, h_local_, f_local_, query_block_;
  bool fused_attention_ = true;
  std::unique_ptr<AllGatherGemm> qkv_op_, up_gate_op_;
  std::unique_ptr<GemmReduceScatter> out_op_, down_op_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  mutable std::mutex describe_mutex_;  // describe_progress() reuses the operations' report buffers
};

}  // namespace caravan::gpu
