// The CPU tile GEMM (include/caravan/kernels/tile_gemm.h).
//
// Blocking, as in GotoBLAS/BLIS, scaled down to one tile: K is cut into blocks of kDepthBlock;
// for each block the tile's rows of A are widened to fp32 and packed in groups of kRowBlock
// rows, interleaved by k (so that the inner kernel broadcasts a[i][k] from consecutive
// addresses), and the inner kernel multiplies a kRowBlock x K-block group by one 32-column
// panel of the packed B into a 4 x 32 block of fp32 accumulators held in registers. The tile's
// accumulators live in a per-thread scratch between K blocks and are written to C (fp32 or
// rounded to bf16) once at the end.
//
// This file is compiled with -O3 -ffp-contract=fast (kernels/CMakeLists.txt): the inner loop
// relies on the vectoriser and on multiply-adds being fused.
#include <caravan/error.h>
#include <caravan/kernels/tile_gemm.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace caravan::kernels {
namespace {

constexpr std::int64_t kRowBlock = 4;
constexpr std::int64_t kPanel = PackedB::kPanelWidth;  // 32 = two 16-float vectors
constexpr std::int64_t kDepthBlock = 256;              // A group (4 KiB) and B panel block (32 KiB) stay in L1/L2

// GCC/Clang vector extension: 16 floats. Compiles to one AVX-512 register, two AVX2 registers or
// four SSE registers depending on the clone.
typedef float Vec16 __attribute__((vector_size(64)));

inline Vec16 load16(const float* p) {
  Vec16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, Vec16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__SANITIZE_THREAD__)
#define CARAVAN_GEMM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef CARAVAN_GEMM_CLONES
#define CARAVAN_GEMM_CLONES
#endif

// acc[0..4)[0..32) (row stride ld) += a_group[k][0..4) x panel[k][0..32) for k in [0, depth).
CARAVAN_GEMM_CLONES
void kernel_4x32(const float* a_group, const float* panel, std::int64_t depth, float* acc, std::int64_t ld) {
  Vec16 c[kRowBlock][2];
#pragma GCC unroll 4
  for (int i = 0; i < kRowBlock; ++i) {
    c[i][0] = load16(acc + i * ld);
    c[i][1] = load16(acc + i * ld + 16);
  }
  for (std::int64_t k = 0; k < depth; ++k) {
    const Vec16 b0 = load16(panel), b1 = load16(panel + 16);
#pragma GCC unroll 4
    for (int i = 0; i < kRowBlock; ++i) {
      const float a = a_group[i];
      c[i][0] += a * b0;
      c[i][1] += a * b1;
    }
    a_group += kRowBlock;
    panel += kPanel;
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRowBlock; ++i) {
    store16(acc + i * ld, c[i][0]);
    store16(acc + i * ld + 16, c[i][1]);
  }
}

struct Scratch {
  std::vector<float> a;    // [groups][kDepthBlock][kRowBlock]
  std::vector<float> acc;  // [groups * kRowBlock][panels * kPanel]
};
thread_local Scratch t_scratch;

// Accumulates the tile into t_scratch.acc (row stride returned) and returns that stride.
std::int64_t multiply(const Bf16* a, std::int64_t lda, const PackedB& b, std::int64_t rows, std::int64_t col0,
                      std::int64_t cols) {
  if (rows < 0 || cols < 0 || lda < b.k())
    throw Error(Errc::invalid_argument,
                fmt::format("gemm_tile: rows {} and cols {} must be >= 0 and lda {} >= K = {}", rows, cols, lda, b.k()));
  if (col0 % kPanel != 0 || col0 < 0 || col0 + cols > b.n())
    throw Error(Errc::invalid_argument,
                fmt::format("gemm_tile: columns [{}, {}) must start at a multiple of {} and lie in B's {} columns", col0,
                            col0 + cols, kPanel, b.n()));
  const std::int64_t groups = (rows + kRowBlock - 1) / kRowBlock;
  const std::int64_t panels = (cols + kPanel - 1) / kPanel;
  const std::int64_t ld = panels * kPanel;
  Scratch& s = t_scratch;
  s.acc.assign(static_cast<std::size_t>(groups * kRowBlock * ld), 0.0f);
  s.a.resize(static_cast<std::size_t>(groups * kDepthBlock * kRowBlock));
  const std::int64_t k_total = b.k();
  for (std::int64_t k0 = 0; k0 < k_total; k0 += kDepthBlock) {
    const std::int64_t depth = std::min(kDepthBlock, k_total - k0);
    // Pack A[.., k0..k0+depth) as fp32, 4 rows interleaved; rows past the tile are zero.
    for (std::int64_t g = 0; g < groups; ++g) {
      float* out = s.a.data() + g * depth * kRowBlock;
      for (std::int64_t i = 0; i < kRowBlock; ++i) {
        const std::int64_t row = g * kRowBlock + i;
        if (row >= rows) {
          for (std::int64_t k = 0; k < depth; ++k) out[k * kRowBlock + i] = 0.0f;
          continue;
        }
        const Bf16* in = a + row * lda + k0;
        for (std::int64_t k = 0; k < depth; ++k) out[k * kRowBlock + i] = in[k].to_float();
      }
    }
    for (std::int64_t p = 0; p < panels; ++p) {
      const float* panel = b.panel(col0 / kPanel + p) + k0 * kPanel;
      for (std::int64_t g = 0; g < groups; ++g)
        kernel_4x32(s.a.data() + g * depth * kRowBlock, panel, depth, s.acc.data() + g * kRowBlock * ld + p * kPanel, ld);
    }
  }
  return ld;
}

}  // namespace

void to_bf16(std::span<const float> from, std::span<Bf16> to) {
  if (from.size() != to.size())
    throw Error(Errc::invalid_argument, fmt::format("to_bf16: {} floats into {} bf16 values", from.size(), to.size()));
  for (std::size_t i = 0; i < from.size(); ++i) to[i] = Bf16::from_float(from[i]);
}

void to_float(std::span<const Bf16> from, std::span<float> to) {
  if (from.size() != to.size())
    throw Error(Errc::invalid_argument, fmt::format("to_float: {} bf16 values into {} floats", from.size(), to.size()));
  for (std::size_t i = 0; i < from.size(); ++i) to[i] = from[i].to_float();
}

PackedB::PackedB(const Bf16* b, std::int64_t k, std::int64_t n, std::int64_t ldb) : k_(k), n_(n) {
  if (k < 1 || n < 1 || ldb < n)
    throw Error(Errc::invalid_argument, fmt::format("PackedB: K = {} and N = {} must be >= 1 and ldb = {} >= N", k, n, ldb));
  panels_.assign(static_cast<std::size_t>((n + kPanelWidth - 1) / kPanelWidth * k * kPanelWidth), 0.0f);
  repack(b, ldb);
}

void PackedB::repack(const Bf16* b, std::int64_t ldb) {
  if (ldb < n_) throw Error(Errc::invalid_argument, fmt::format("PackedB::repack: ldb = {} < N = {}", ldb, n_));
  const std::int64_t panels = (n_ + kPanelWidth - 1) / kPanelWidth;
  for (std::int64_t p = 0; p < panels; ++p) {
    const std::int64_t c0 = p * kPanelWidth, width = std::min(kPanelWidth, n_ - c0);
    float* out = panels_.data() + p * k_ * kPanelWidth;
    for (std::int64_t k = 0; k < k_; ++k) {
      const Bf16* row = b + k * ldb + c0;
      for (std::int64_t j = 0; j < width; ++j) out[k * kPanelWidth + j] = row[j].to_float();
    }
  }
}

void gemm_tile(const Bf16* a, std::int64_t lda, const PackedB& b, std::int64_t rows, std::int64_t col0,
               std::int64_t cols, float* c, std::int64_t ldc) {
  const std::int64_t ld = multiply(a, lda, b, rows, col0, cols);
  const float* acc = t_scratch.acc.data();
  for (std::int64_t i = 0; i < rows; ++i) std::memcpy(c + i * ldc, acc + i * ld, static_cast<std::size_t>(cols) * sizeof(float));
}

void gemm_tile(const Bf16* a, std::int64_t lda, const PackedB& b, std::int64_t rows, std::int64_t col0,
               std::int64_t cols, Bf16* c, std::int64_t ldc) {
  const std::int64_t ld = multiply(a, lda, b, rows, col0, cols);
  const float* acc = t_scratch.acc.data();
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) c[i * ldc + j] = Bf16::from_float(acc[i * ld + j]);
}

std::vector<float> reference_gemm(const Bf16* a, std::int64_t lda, const Bf16* b, std::int64_t ldb, std::int64_t m,
                                  std::int64_t n, std::int64_t k) {
  std::vector<float> c(static_cast<std::size_t>(m * n), 0.0f);
  std::vector<float> b_row(static_cast<std::size_t>(n));
  for (std::int64_t kk = 0; kk < k; ++kk) {
    for (std::int64_t j = 0; j < n; ++j) b_row[static_cast<std::size_t>(j)] = b[kk * ldb + j].to_float();
    for (std::int64_t i = 0; i < m; ++i) {
      const float av = a[i * lda + kk].to_float();
      float* row = c.data() + i * n;
      for (std::int64_t j = 0; j < n; ++j) row[j] += av * b_row[static_cast<std::size_t>(j)];
    }
  }
  return c;
}

double relative_error(const Bf16* got, std::int64_t ld_got, const float* expected, std::int64_t ld_expected,
                      std::int64_t rows, std::int64_t cols) {
  double max_diff = 0, max_ref = 0;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = got[i * ld_got + j].to_float(), e = expected[i * ld_expected + j];
      // A NaN (a poisoned or never-written output) must fail the check, not slip through max().
      max_diff = std::isnan(g) ? INFINITY : std::max(max_diff, std::abs(g - e));
      max_ref = std::max(max_ref, std::abs(e));
      if (std::isinf(max_diff)) return INFINITY;
    }
  return max_ref == 0 ? (max_diff == 0 ? 0 : INFINITY) : max_diff / max_ref;
}

}  // namespace caravan::kernels
