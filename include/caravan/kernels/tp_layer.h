// A tensor-parallel transformer layer on the CPU backend (Megatron-style with sequence
// parallelism), built from the overlapped operations of overlap.h, for `caravan bench llm`:
//
//   x_r [M/W, H] -> RMSNorm -> AllGather+GEMM (QKV, heads split over ranks) -> causal attention
//     -> GEMM+ReduceScatter (output projection) -> + x_r -> RMSNorm -> AllGather+GEMM (up, gate)
//     -> SwiGLU -> GEMM+ReduceScatter (down projection) -> + residual = y_r [M/W, H]
//
// Each communication runs in the layer's OverlapVariant (bulk_synchronous is the baseline).
// Activations are stored as bf16 between operations; arithmetic is fp32. Collective, like the
// operations it uses.
#pragma once

#include <caravan/kernels/overlap.h>

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace caravan::kernels {

struct TpLayerShape {
  std::int64_t tokens = 256;  // M (all ranks together); a multiple of W
  std::int64_t hidden = 1024;  // H; heads x head_dim
  std::int64_t heads = 8;      // a multiple of W
  std::int64_t ffn = 2816;     // F; a multiple of W
  // Key/value heads (grouped-query attention, as Llama-3 has: 8 for 64 query heads); 0 means
  // `heads`. Divides `heads`; the layers also need it to be a multiple of the world size.
  std::int64_t kv_heads = 0;
  std::int64_t kv() const { return kv_heads == 0 ? heads : kv_heads; }
  std::int64_t head_dim() const { return hidden / heads; }
  // Columns of the QKV projection: query heads, then key heads, then value heads.
  std::int64_t qkv_width() const { return (heads + 2 * kv()) * head_dim(); }
};

// The whole layer's weights (every rank may build them; each takes its slices).
//   norm1, norm2 [H]; qkv [H, qkv_width()] (columns: Q, then K, then V, heads contiguous in each);
//   out [H, H]; up, gate [H, F]; down [F, H].
struct TpLayerWeights {
  std::vector<float> norm1, norm2;
  std::vector<Bf16> qkv, out, up, gate, down;
};
// Random weights scaled by 1 / sqrt(fan-in), so that activations stay O(1).
TpLayerWeights random_layer_weights(const TpLayerShape& shape, std::uint64_t seed);

enum class LayerStep { norm1, qkv, attention, out_proj, norm2, up_gate, swiglu, down_proj, count };
std::string_view to_string(LayerStep step);
using LayerTimes = std::array<double, static_cast<std::size_t>(LayerStep::count)>;  // seconds per step

class TensorParallelLayer {
 public:
  // Throws Error(invalid_argument) for shapes the world size does not divide.
  TensorParallelLayer(SymmetricHeap heap, const TpLayerShape& shape, OverlapVariant variant, const OverlapOptions& options = {});
  ~TensorParallelLayer();
  void set_weights(const TpLayerWeights& weights);
  // x, y: this rank's rows [M / W, H]. `times` (optional) receives each step's time on this rank.
  void run(const Bf16* x, Bf16* y, LayerTimes* times = nullptr);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The layer on one process in fp32, rounding to bf16 where the distributed layer of `world`
// ranks stores bf16 (including each rank's partial product before a ReduceScatter), so that only
// summation order differs: y [M, H] for x [M, H].
std::vector<float> reference_layer(const TpLayerShape& shape, const TpLayerWeights& weights, const std::vector<Bf16>& x,
                                   int world);

}  // namespace caravan::kernels
