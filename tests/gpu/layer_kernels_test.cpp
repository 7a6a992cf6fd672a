// The layer's RMSNorm and SwiGLU kernels (kernels/gpu/layer_kernels.cu) against float32
// references on fresh random inputs, outputs poisoned first, on one GPU: RMSNorm at widths that
// take each of its paths (a row held in registers, 1 to 8 vectors a thread; a row too wide for
// that; a weight not 16-byte aligned), SwiGLU at widths that fill blocks partly and at more rows
// than one grid column covers. Skips without a GPU, saying why.
#include "kernels/gpu/kernels.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/require_gpus.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <utility>
#include <string>
#include <vector>

namespace caravan::gpu {
namespace {

using test::DeviceArray;

std::uint16_t to_bf16_bits(float f) {  // round to nearest even
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float from_bf16_bits(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct NormCase {
  long rows, cols;
  bool misaligned_weight;  // the weight one float past a 16-byte boundary
};

// gtest prints a parameter with this (not as raw bytes).
void PrintTo(const NormCase& c, std::ostream* os) {
  *os << c.rows << " rows x " << c.cols << (c.misaligned_weight ? ", weight misaligned" : "");
}

std::string norm_case_name(const ::testing::TestParamInfo<NormCase>& param) {
  return "rows" + std::to_string(param.param.rows) + "_cols" + std::to_string(param.param.cols) +
         (param.param.misaligned_weight ? "_misaligned" : "");
}

class RmsNorm : public ::testing::TestWithParam<NormCase> {};

TEST_P(RmsNorm, MatchesFloatReference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  const NormCase c = GetParam();
  const auto elements = static_cast<std::size_t>(c.rows * c.cols);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> value(-2.0f, 2.0f), near_one(0.5f, 1.5f);
  std::vector<std::uint16_t> x(elements);
  for (auto& v : x) v = to_bf16_bits(value(rng));
  std::vector<float> weight(static_cast<std::size_t>(c.cols) + 1);
  for (auto& w : weight) w = near_one(rng);

  CARAVAN_HIP_CHECK(hipSetDevice(0));
  DeviceArray<std::uint16_t> x_d(elements), out_d(elements);
  DeviceArray<float> weight_d(weight.size());
  const float* weight_used = weight_d.data + (c.misaligned_weight ? 1 : 0);
  CARAVAN_HIP_CHECK(hipMemcpy(x_d.data, x.data(), elements * 2, hipMemcpyDefault));
  CARAVAN_HIP_CHECK(hipMemcpy(weight_d.data, weight.data(), weight.size() * sizeof(float), hipMemcpyDefault));
  CARAVAN_HIP_CHECK(hipMemset(out_d.data, 0xff, elements * 2));  // NaN: a row never written fails
  rmsnorm(reinterpret_cast<const bf16*>(x_d.data), c.rows, c.cols, weight_used, reinterpret_cast<bf16*>(out_d.data),
          nullptr);
  CARAVAN_HIP_CHECK(hipDeviceSynchronize());
  std::vector<std::uint16_t> out(elements);
  CARAVAN_HIP_CHECK(hipMemcpy(out.data(), out_d.data, elements * 2, hipMemcpyDefault));

  const float* w = weight.data() + (c.misaligned_weight ? 1 : 0);
  double diff2 = 0, ref2 = 0;
  long nonfinite = 0;
  for (long r = 0; r < c.rows; ++r) {
    double squares = 0;
    for (long j = 0; j < c.cols; ++j) {
      const double v = from_bf16_bits(x[static_cast<std::size_t>(r * c.cols + j)]);
      squares += v * v;
    }
    const double inverse = 1.0 / std::sqrt(squares / static_cast<double>(c.cols) + 1e-6);
    for (long j = 0; j < c.cols; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * c.cols + j);
      const double ref = from_bf16_bits(x[i]) * inverse * w[j];
      const double got = from_bf16_bits(out[i]);
      if (!std::isfinite(got)) ++nonfinite;
      diff2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
  }
  EXPECT_EQ(nonfinite, 0) << "elements left poisoned or not finite";
  EXPECT_LT(std::sqrt(diff2 / ref2), 1e-2) << "relative error against the float32 reference";
}

INSTANTIATE_TEST_SUITE_P(Widths, RmsNorm,
                         ::testing::Values(NormCase{3, 8, false},       // one vector, most threads idle
                                           NormCase{17, 2056, false},   // 2 vectors a thread, the last partly
                                           NormCase{64, 4096, false},   // 8B's width: 2 a thread
                                           NormCase{33, 8192, false},   // 70B's width: 4 a thread
                                           NormCase{9, 12288, false},   // 6 vectors: the 8-vector kernel
                                           NormCase{5, 16384, false},   // 8 a thread, the widest kept in registers
                                           NormCase{4, 16392, false},   // one vector too wide: two passes
                                           NormCase{7, 8192, true}),    // misaligned weight: two passes
                         norm_case_name);

// SwiGLU: rows x f outputs from rows of [up (f) | gate (f)]; rows past 65535 take the grid's
// row loop.
class SwiGlu : public ::testing::TestWithParam<std::pair<long, long>> {};

TEST_P(SwiGlu, MatchesFloatReference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  const auto [rows, f] = GetParam();
  const auto in_elements = static_cast<std::size_t>(rows * 2 * f), out_elements = static_cast<std::size_t>(rows * f);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::vector<std::uint16_t> in(in_elements);
  for (auto& v : in) v = to_bf16_bits(value(rng));
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  DeviceArray<std::uint16_t> in_d(in_elements), out_d(out_elements);
  CARAVAN_HIP_CHECK(hipMemcpy(in_d.data, in.data(), in_elements * 2, hipMemcpyDefault));
  CARAVAN_HIP_CHECK(hipMemset(out_d.data, 0xff, out_elements * 2));  // NaN
  swiglu(reinterpret_cast<const bf16*>(in_d.data), rows, f, reinterpret_cast<bf16*>(out_d.data), nullptr);
  CARAVAN_HIP_CHECK(hipDeviceSynchronize());
  std::vector<std::uint16_t> out(out_elements);
  CARAVAN_HIP_CHECK(hipMemcpy(out.data(), out_d.data, out_elements * 2, hipMemcpyDefault));
  double diff2 = 0, ref2 = 0;
  long nonfinite = 0;
  for (long r = 0; r < rows; ++r)
    for (long j = 0; j < f; ++j) {
      const double up = from_bf16_bits(in[static_cast<std::size_t>(r * 2 * f + j)]);
      const double gate = from_bf16_bits(in[static_cast<std::size_t>(r * 2 * f + f + j)]);
      const double ref = up * gate / (1.0 + std::exp(-gate));
      const double got = from_bf16_bits(out[static_cast<std::size_t>(r * f + j)]);
      if (!std::isfinite(got)) ++nonfinite;
      diff2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
  EXPECT_EQ(nonfinite, 0) << "elements left poisoned or not finite";
  EXPECT_LT(std::sqrt(diff2 / ref2), 1e-2) << "relative error against the float32 reference";
}

std::string swiglu_case_name(const ::testing::TestParamInfo<std::pair<long, long>>& param) {
  return "rows" + std::to_string(param.param.first) + "_f" + std::to_string(param.param.second);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwiGlu,
                         ::testing::Values(std::pair<long, long>{3, 8},         // one vector a row
                                           std::pair<long, long>{37, 2056},     // a block and one vector
                                           std::pair<long, long>{64, 7168},     // 70B's width at TP 4
                                           std::pair<long, long>{65537, 16}),   // past one grid column of rows
                         swiglu_case_name);

}  // namespace
}  // namespace caravan::gpu
