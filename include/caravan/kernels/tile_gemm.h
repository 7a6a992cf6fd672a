// The CPU tile GEMM: C = A x B with bf16 inputs, fp32 accumulation, fp32 or bf16 output, cut
// into tiles so that each tile is one work unit (the overlapped collectives wait on the flag of
// the A rows a tile needs, then compute it).
//
// Matrices are row-major with a leading dimension (elements between rows). B, the weights,
// is packed once into fp32 column panels (PackedB); a tile then reads its rows of A straight
// from wherever they landed (the symmetric heap, for gathered A).
//
// Inner kernel: 4 x 32 register block, compiled for AVX-512, AVX2 and baseline x86-64 and
// picked at load time (GCC/Clang function multiversioning); other targets use the portable
// vector code.
#pragma once

#include <caravan/kernels/bf16.h>

#include <cstdint>
#include <vector>

namespace caravan::kernels {

// B[K, N] packed into panels of kPanelWidth columns, K rows each, fp32 (the last panel padded
// with zeros). Tiles of C must start at a column that is a multiple of kPanelWidth.
class PackedB {
 public:
  static constexpr std::int64_t kPanelWidth = 32;

  PackedB() = default;
  // Throws Error(invalid_argument) for k or n < 1 or ldb < n.
  PackedB(const Bf16* b, std::int64_t k, std::int64_t n, std::int64_t ldb);
  // Repacks new values of the same shape (no allocation).
  void repack(const Bf16* b, std::int64_t ldb);

  std::int64_t k() const { return k_; }
  std::int64_t n() const { return n_; }
  const float* panel(std::int64_t index) const { return panels_.data() + index * k_ * kPanelWidth; }

 private:
  std::int64_t k_ = 0, n_ = 0;
  std::vector<float> panels_;  // [ceil(n / kPanelWidth)][k][kPanelWidth]
};

// One output tile: C[0..rows, 0..cols) = A[0..rows, 0..K) x B[0..K, col0..col0+cols), where `a`
// points at the tile's first row of A and `c` at the tile's first element of C. Overwrites C
// (no accumulation). Throws Error(invalid_argument) when col0 is not a multiple of
// PackedB::kPanelWidth or the tile leaves B. Thread-safe (scratch is per thread).
void gemm_tile(const Bf16* a, std::int64_t lda, const PackedB& b, std::int64_t rows, std::int64_t col0,
               std::int64_t cols, float* c, std::int64_t ldc);
void gemm_tile(const Bf16* a, std::int64_t lda, const PackedB& b, std::int64_t rows, std::int64_t col0,
               std::int64_t cols, Bf16* c, std::int64_t ldc);

// The float32 reference the tests and benchmarks check against: C[M, N] = A[M, K] x B[K, N] in
// plain loops over the bf16 values widened to float (no tiling, no packing).
std::vector<float> reference_gemm(const Bf16* a, std::int64_t lda, const Bf16* b, std::int64_t ldb, std::int64_t m,
                                  std::int64_t n, std::int64_t k);

// max |got - expected| / max |expected| (0 when both are all zero): the error measure of the
// tests and `caravan bench overlap` (bf16 results pass below 1e-2).
double relative_error(const Bf16* got, std::int64_t ld_got, const float* expected, std::int64_t ld_expected,
                      std::int64_t rows, std::int64_t cols);

}  // namespace caravan::kernels
