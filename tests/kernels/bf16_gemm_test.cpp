// Unit tests of the bf16 storage type and the CPU tile GEMM alone (one process, no ranks).
#include "tests/runtime/test_util.h"

#include <caravan/kernels/bf16.h>
#include <caravan/kernels/tile_gemm.h>

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <thread>

namespace caravan::kernels {
namespace {

float bf16_neighbour_below(float x) {  // the bf16 value just below x's bf16 truncation
  return std::bit_cast<float>((std::bit_cast<std::uint32_t>(x) & 0xFFFF0000u));
}

TEST(Bf16Test, ExactValuesRoundTrip) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, -0.75f, 1.0f / 1024}) {
    Bf16 b = Bf16::from_float(v);
    EXPECT_EQ(b.to_float(), v) << v;
    EXPECT_EQ(std::signbit(b.to_float()), std::signbit(v)) << v;
  }
  EXPECT_EQ(Bf16::from_float(1.0f).bits, 0x3F80);
  EXPECT_EQ(Bf16::from_float(-2.0f).bits, 0xC000);
}

TEST(Bf16Test, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 lies exactly halfway between 1 (even mantissa) and 1 + 2^-7 (odd): goes down.
  EXPECT_EQ(Bf16::from_float(1.0f + 0x1p-8f).to_float(), 1.0f);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(Bf16::from_float(1.0f + 3 * 0x1p-8f).to_float(), 1.0f + 0x1p-6f);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(Bf16::from_float(1.0f + 0x1p-8f + 0x1p-20f).to_float(), 1.0f + 0x1p-7f);
  EXPECT_EQ(Bf16::from_float(1.0f + 0x1p-8f - 0x1p-20f).to_float(), 1.0f);
  // Against the definition, on random bit patterns of finite floats: the result is one of the
  // two bf16 neighbours, the nearer one, and on a tie the one with an even mantissa.
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t bits = rng();
    float x = std::bit_cast<float>(bits);
    if (!std::isfinite(x) || std::abs(x) > 3.0e38f) continue;
    const float below = bf16_neighbour_below(x);  // toward zero
    const float above = std::bit_cast<float>(std::bit_cast<std::uint32_t>(below) + 0x10000u);  // away from zero
    const float got = Bf16::from_float(x).to_float();
    const double d_below = std::abs(static_cast<double>(x) - below), d_above = std::abs(static_cast<double>(x) - above);
    float expected = d_below < d_above ? below : d_above < d_below ? above
                     : ((std::bit_cast<std::uint32_t>(below) >> 16) & 1) == 0 ? below : above;
    ASSERT_EQ(got, expected) << std::hexfloat << x;
  }
}

TEST(Bf16Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Bf16::from_float(inf).to_float(), inf);
  EXPECT_EQ(Bf16::from_float(-inf).to_float(), -inf);
  EXPECT_TRUE(std::isnan(Bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
  // A NaN whose payload sits only in the low 16 bits must not become infinity.
  EXPECT_TRUE(std::isnan(Bf16::from_float(std::bit_cast<float>(0x7F800001u)).to_float()));
  EXPECT_TRUE(std::isnan(Bf16::from_float(std::bit_cast<float>(0xFF800001u)).to_float()));
  // The largest floats round up to infinity, as GPU conversions do.
  EXPECT_EQ(Bf16::from_float(std::numeric_limits<float>::max()).to_float(), inf);
  // Subnormals keep their value when representable.
  const float tiny = std::bit_cast<float>(0x00010000u);
  EXPECT_EQ(Bf16::from_float(tiny).to_float(), tiny);
}

TEST(Bf16Test, ArrayConversionsCheckSizes) {
  std::vector<float> f = {1.5f, -3.0f, 0.1f};
  std::vector<Bf16> b(3);
  to_bf16(f, b);
  std::vector<float> back(3);
  to_float(b, back);
  EXPECT_EQ(back[0], 1.5f);
  EXPECT_EQ(back[1], -3.0f);
  EXPECT_EQ(back[2], Bf16::from_float(0.1f).to_float());
  std::vector<Bf16> small(2);
  CARAVAN_EXPECT_ERROR(to_bf16(f, small), Errc::invalid_argument, "3 floats into 2");
}

std::vector<Bf16> random_matrix(std::int64_t rows, std::int64_t cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<Bf16> m(static_cast<std::size_t>(rows * cols));
  for (auto& v : m) v = Bf16::from_float(dist(rng));
  return m;
}

struct GemmCase {
  std::int64_t m, n, k;
};

// Every tile of an M x N result, tiles of 5 rows x 64 columns (shapes with remainders in every
// dimension: rows not a multiple of the 4-row block, columns of the 32-column panel, K of the
// 256 depth block), against the float reference.
TEST(TileGemmTest, TilesMatchTheFloatReference) {
  for (GemmCase gc : {GemmCase{1, 32, 1}, GemmCase{7, 45, 300}, GemmCase{16, 96, 256}, GemmCase{33, 130, 513}}) {
    auto a = random_matrix(gc.m, gc.k, 1);
    auto b = random_matrix(gc.k, gc.n, 2);
    auto ref = reference_gemm(a.data(), gc.k, b.data(), gc.n, gc.m, gc.n, gc.k);
    PackedB packed(b.data(), gc.k, gc.n, gc.n);
    std::vector<float> c32(static_cast<std::size_t>(gc.m * gc.n), NAN);
    std::vector<Bf16> c16(static_cast<std::size_t>(gc.m * gc.n), Bf16{0x7FC0});
    for (std::int64_t r0 = 0; r0 < gc.m; r0 += 5)
      for (std::int64_t c0 = 0; c0 < gc.n; c0 += 64) {
        std::int64_t rows = std::min<std::int64_t>(5, gc.m - r0), cols = std::min<std::int64_t>(64, gc.n - c0);
        gemm_tile(a.data() + r0 * gc.k, gc.k, packed, rows, c0, cols, c32.data() + r0 * gc.n + c0, gc.n);
        gemm_tile(a.data() + r0 * gc.k, gc.k, packed, rows, c0, cols, c16.data() + r0 * gc.n + c0, gc.n);
      }
    double max_ref = 0, max_diff = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      max_ref = std::max(max_ref, static_cast<double>(std::abs(ref[i])));
      max_diff = std::max(max_diff, static_cast<double>(std::abs(c32[i] - ref[i])));
      ASSERT_FALSE(std::isnan(c32[i])) << "element " << i << " not written";
    }
    // fp32 output: only summation order differs from the reference.
    EXPECT_LT(max_diff, 1e-5 * std::max(1.0, max_ref) * static_cast<double>(gc.k)) << gc.m << "x" << gc.n << "x" << gc.k;
    EXPECT_LT(relative_error(c16.data(), gc.n, ref.data(), gc.n, gc.m, gc.n), 1e-2) << gc.m << "x" << gc.n << "x" << gc.k;
  }
}

TEST(TileGemmTest, RepackChangesTheWeightsAndTilesAreThreadSafe) {
  const std::int64_t m = 24, n = 64, k = 40;
  auto a = random_matrix(m, k, 3);
  auto b1 = random_matrix(k, n, 4), b2 = random_matrix(k, n, 5);
  PackedB packed(b1.data(), k, n, n);
  packed.repack(b2.data(), n);
  auto ref = reference_gemm(a.data(), k, b2.data(), n, m, n, k);
  // Four threads compute different tiles at once (each has its own scratch).
  std::vector<Bf16> c(static_cast<std::size_t>(m * n));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 50; ++rep)
        gemm_tile(a.data() + t * 6 * k, k, packed, 6, (t % 2) * 32, 32, c.data() + t * 6 * n + (t % 2) * 32, n);
      // the other half of this thread's rows
      gemm_tile(a.data() + t * 6 * k, k, packed, 6, ((t + 1) % 2) * 32, 32, c.data() + t * 6 * n + ((t + 1) % 2) * 32, n);
    });
  for (auto& th : threads) th.join();
  EXPECT_LT(relative_error(c.data(), n, ref.data(), n, m, n), 1e-2);
}

TEST(TileGemmTest, BadArgumentsAreRejected) {
  auto b = random_matrix(8, 64, 1);
  auto a = random_matrix(4, 8, 2);
  CARAVAN_EXPECT_ERROR(PackedB(b.data(), 0, 64, 64), Errc::invalid_argument, "K = 0");
  CARAVAN_EXPECT_ERROR(PackedB(b.data(), 8, 64, 32), Errc::invalid_argument, "ldb = 32");
  PackedB packed(b.data(), 8, 64, 64);
  std::vector<float> c(4 * 64);
  CARAVAN_EXPECT_ERROR(gemm_tile(a.data(), 8, packed, 4, 16, 16, c.data(), 64), Errc::invalid_argument,
                       "multiple of 32");
  CARAVAN_EXPECT_ERROR(gemm_tile(a.data(), 8, packed, 4, 32, 64, c.data(), 64), Errc::invalid_argument, "B's 64 columns");
  CARAVAN_EXPECT_ERROR(gemm_tile(a.data(), 4, packed, 4, 0, 32, c.data(), 64), Errc::invalid_argument, "lda 4 >= K = 8");
}

TEST(TileGemmTest, RelativeErrorFailsOnNanAndMeasuresAgainstTheLargestValue) {
  std::vector<float> ref = {1.0f, -4.0f};
  std::vector<Bf16> got = {Bf16::from_float(1.0f), Bf16::from_float(-3.96f)};
  EXPECT_NEAR(relative_error(got.data(), 2, ref.data(), 2, 1, 2), std::abs(Bf16::from_float(-3.96f).to_float() + 4.0) / 4.0,
              1e-9);
  got[0] = Bf16{0x7FC0};  // NaN: a poisoned output that was never written
  EXPECT_TRUE(std::isinf(relative_error(got.data(), 2, ref.data(), 2, 1, 2)));
  std::vector<float> zeros = {0.0f, 0.0f};
  std::vector<Bf16> zero_got = {Bf16{}, Bf16{}};
  EXPECT_EQ(relative_error(zero_got.data(), 2, zeros.data(), 2, 1, 2), 0.0);
}

}  // namespace
}  // namespace caravan::kernels
