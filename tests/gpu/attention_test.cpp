// The fused causal attention kernel (kernels/gpu/attention.cu) against the float32 reference on
// fresh random inputs, outputs poisoned first, on one GPU: head widths 32, 64 and 128, grouped
// and plain multi-head attention, both block heights, sequence lengths that are not multiples of
// the tiles, and inputs scaled up so that the softmax is peaked; each through the portable
// mma.sync kernel and, on a device of compute capability 9.0, the Hopper wgmma kernel. Skips
// without a GPU (and the Hopper cases elsewhere), saying why.
#include "kernels/gpu/blas.h"
#include "kernels/gpu/kernels.h"
#include "kernels/gpu/tp_layer.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/require_gpus.h"

#include <caravan/error.h>
#include <caravan/platform.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace caravan::gpu {
namespace {

using test::DeviceArray;

struct Case {
  long tokens, q_heads, kv_heads, head_dim;
  int block_rows;
  float input_scale;  // inputs uniform in [-scale, scale]; larger: a more peaked softmax
  AttentionKernel kernel = AttentionKernel::portable;
};

const char* kernel_label(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::portable: return "portable";
    case AttentionKernel::hopper: return "hopper";
    default: return "automatic";
  }
}

// gtest prints a parameter with this (not as raw bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << "tokens " << c.tokens << ", heads " << c.q_heads << "/" << c.kv_heads << ", width " << c.head_dim
      << ", block rows " << c.block_rows << ", input scale " << c.input_scale << ", kernel " << kernel_label(c.kernel);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "t" + std::to_string(c.tokens) + "_h" + std::to_string(c.q_heads) + "_kv" + std::to_string(c.kv_heads) + "_d" +
         std::to_string(c.head_dim) + "_rows" + std::to_string(c.block_rows) + "_scale" +
         std::to_string(static_cast<int>(c.input_scale)) + "_" + kernel_label(c.kernel);
}

struct Measured {
  double relative_error = 0;
  double worst_row_error = 0;  // the largest relative error of one row of one head
  unsigned long long nonfinite = 0;
  bool padding_untouched = true;
};

// Rows past the sequence in the output buffer, poisoned and checked untouched: the kernels run
// whole blocks of 64 or 128 rows and must not store the rows past the end.
constexpr long kSpareRows = 128;

float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// Q, K, V packed per row like the layer's QKV projection, with 8 spare columns so that the
// leading dimension is not the packed width; the output likewise, its spare columns and spare
// rows poisoned and checked afterwards (the kernel must not write outside its heads and rows).
Measured run_case(const Case& c, std::uint64_t seed) {
  hipStream_t stream = nullptr;
  CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
  const long d = c.head_dim, ld = (c.q_heads + 2 * c.kv_heads) * d + 8, out_width = c.q_heads * d,
             ld_out = out_width + 8;
  const std::size_t in_count = static_cast<std::size_t>(std::max(c.tokens, 1L) * ld);
  const std::size_t out_count = static_cast<std::size_t>((c.tokens + kSpareRows) * ld_out);
  DeviceArray<bf16> qkv(in_count), out(out_count);
  DeviceArray<float> qkv_f(in_count), ref(out_count);
  DeviceArray<ErrorSums> sums(1);
  fill_random(qkv.data, c.tokens, ld, ld, seed, 0, 0, c.input_scale, stream);
  fill_random(qkv_f.data, c.tokens, ld, ld, seed, 0, 0, c.input_scale, stream);  // the same values
  CARAVAN_HIP_CHECK(hipMemsetAsync(out.data, 0xff, out_count * sizeof(bf16), stream));  // NaN everywhere

  const AttentionArguments a =
      packed_qkv_attention(qkv.data, ld, c.tokens, c.q_heads, c.kv_heads, d, out.data, ld_out);
  fused_causal_attention(a, stream, c.block_rows, c.kernel);
  attention_reference(qkv_f.data, qkv_f.data + c.q_heads * d, qkv_f.data + (c.q_heads + c.kv_heads) * d, a, ref.data,
                      stream);
  compare(out.data, c.tokens, out_width, ld_out, ref.data, ld_out, sums.data, stream);
  ErrorSums host;
  CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.data, sizeof(host), hipMemcpyDefault, stream));
  std::vector<std::uint16_t> out_host(out_count);
  CARAVAN_HIP_CHECK(hipMemcpyAsync(out_host.data(), out.data, out_count * sizeof(bf16), hipMemcpyDefault, stream));
  std::vector<float> ref_host(out_count);
  CARAVAN_HIP_CHECK(hipMemcpyAsync(ref_host.data(), ref.data, out_count * sizeof(float), hipMemcpyDefault, stream));
  CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  Measured m;
  m.relative_error = host.ref2 > 0 ? std::sqrt(host.diff2 / host.ref2) : (host.diff2 > 0 ? 1.0 : 0.0);
  m.nonfinite = host.nonfinite;
  for (long row = 0; row < c.tokens + kSpareRows; ++row)
    for (long col = row < c.tokens ? out_width : 0; col < ld_out; ++col)
      if (out_host[static_cast<std::size_t>(row * ld_out + col)] != 0xffff) m.padding_untouched = false;
  // Per row and head: a fault confined to a few rows would hide in the whole output's error.
  for (long row = 0; row < c.tokens; ++row)
    for (long head = 0; head < c.q_heads; ++head) {
      double diff2 = 0, ref2 = 0;
      for (long col = head * d; col < (head + 1) * d; ++col) {
        const std::size_t i = static_cast<std::size_t>(row * ld_out + col);
        const double r = ref_host[i], x = bf16_bits_to_float(out_host[i]);
        diff2 += (x - r) * (x - r);
        ref2 += r * r;
      }
      const double e = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
      m.worst_row_error = std::max(m.worst_row_error, std::isfinite(e) ? e : 1.0);
    }
  return m;
}

class FusedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(FusedAttention, MatchesTheFloat32Reference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  preload_attention();
  if (!attention_kernel_runs(GetParam().kernel, GetParam().head_dim))
    GTEST_SKIP() << "the Hopper attention kernel needs a build with the sm_90a kernels and a device of compute "
                    "capability 9.0; this one runs "
                 << attention_kernel_name(AttentionKernel::automatic, GetParam().head_dim);
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Measured m = run_case(GetParam(), seed);
  EXPECT_EQ(m.nonfinite, 0u) << "outputs left poisoned or not finite";
  EXPECT_LT(m.relative_error, 1e-2);
  // One row of bf16 outputs rounds to about 4e-3 alone; 3e-2 catches a wrong row, not rounding.
  EXPECT_LT(m.worst_row_error, 3e-2);
  EXPECT_TRUE(m.padding_untouched) << "the kernel wrote outside its heads' columns or past the last row";
  if (GetParam().kernel == AttentionKernel::automatic &&
      attention_kernel_runs(AttentionKernel::hopper, GetParam().head_dim)) {
    EXPECT_EQ(attention_kernel_name(AttentionKernel::automatic, GetParam().head_dim), "wgmma")
        << "automatic must pick the Hopper kernel where it runs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Portable, FusedAttention,
    ::testing::Values(Case{1000, 8, 2, 128, 0, 1.0f},   // grouped, tails of both tiles
                      Case{1000, 8, 2, 128, 64, 1.0f},  // the 4-warp block
                      Case{4096, 2, 1, 128, 0, 1.0f},   // many key tiles: the online softmax's rescaling
                      Case{777, 4, 4, 128, 128, 4.0f},  // plain multi-head, peaked softmax
                      Case{300, 4, 4, 64, 128, 2.0f}, Case{257, 6, 3, 32, 64, 1.0f}, Case{129, 6, 3, 32, 128, 4.0f},
                      Case{1, 2, 1, 128, 0, 1.0f},  // one token: the output is V's first row
                      Case{64, 2, 2, 64, 64, 1.0f}),
    case_name);

// The Hopper kernel: 128 query rows per block in two consumer warpgroups of 64, so also a
// sequence whose last block has rows for the first consumer only (tokens % 128 <= 64), and one
// shorter than a block.
INSTANTIATE_TEST_SUITE_P(
    Hopper, FusedAttention,
    ::testing::Values(Case{1000, 8, 2, 128, 0, 1.0f, AttentionKernel::hopper},   // grouped, tails of both tiles
                      Case{4096, 2, 1, 128, 0, 1.0f, AttentionKernel::hopper},   // many key tiles, rescaling
                      Case{777, 4, 4, 128, 128, 4.0f, AttentionKernel::hopper},  // plain multi-head, peaked
                      Case{300, 4, 4, 64, 0, 2.0f, AttentionKernel::hopper},     // width 64; 300 % 128 = 44
                      Case{1090, 6, 3, 64, 0, 1.0f, AttentionKernel::hopper},    // 1090 % 128 = 66
                      Case{50, 2, 1, 128, 0, 1.0f, AttentionKernel::hopper},     // shorter than one block
                      Case{1, 2, 1, 128, 0, 1.0f, AttentionKernel::hopper},      // one token
                      Case{2100, 16, 2, 128, 0, 1.0f, AttentionKernel::hopper},  // 70B at TP 4: groups of 8 heads
                      Case{33, 2, 1, 64, 0, 1.0f, AttentionKernel::hopper},      // width 64, shorter than a tile
                      Case{1, 2, 2, 64, 0, 1.0f, AttentionKernel::hopper},       // width 64, one token
                      Case{1000, 8, 2, 128, 0, 1.0f, AttentionKernel::automatic}),
    case_name);

// The layer's unfused path (cuBLAS + softmax kernel) agrees with the reference too: it is the
// baseline the benchmark measures the fused kernel against.
TEST(UnfusedAttention, MatchesTheFloat32Reference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  preload_attention();
  preload_layer_kernels();
  hipStream_t stream = nullptr;
  CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
  const long tokens = 700, q_heads = 4, kv_heads = 2, d = 128, ld = (q_heads + 2 * kv_heads) * d, ld_out = q_heads * d;
  const long query_block = 256;
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  DeviceArray<bf16> qkv(static_cast<std::size_t>(tokens * ld)), out(static_cast<std::size_t>(tokens * ld_out)),
      probs(static_cast<std::size_t>(q_heads * query_block * tokens));
  DeviceArray<float> qkv_f(static_cast<std::size_t>(tokens * ld)), ref(static_cast<std::size_t>(tokens * ld_out)),
      scores(static_cast<std::size_t>(q_heads * query_block * tokens));
  DeviceArray<ErrorSums> sums(1);
  fill_random(qkv.data, tokens, ld, ld, seed, 0, 0, 1.0f, stream);
  fill_random(qkv_f.data, tokens, ld, ld, seed, 0, 0, 1.0f, stream);
  CARAVAN_HIP_CHECK(hipMemsetAsync(out.data, 0xff, static_cast<std::size_t>(tokens * ld_out) * sizeof(bf16), stream));
  const AttentionArguments a = packed_qkv_attention(qkv.data, ld, tokens, q_heads, kv_heads, d, out.data, ld_out);
  {
    Blas blas(stream);
    unfused_causal_attention(blas, a, query_block, scores.data, probs.data, stream);
    attention_reference(qkv_f.data, qkv_f.data + q_heads * d, qkv_f.data + (q_heads + kv_heads) * d, a, ref.data, stream);
    compare(out.data, tokens, ld_out, ld_out, ref.data, ld_out, sums.data, stream);
    CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  }
  ErrorSums host;
  CARAVAN_HIP_CHECK(hipMemcpy(&host, sums.data, sizeof(host), hipMemcpyDefault));
  CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  EXPECT_EQ(host.nonfinite, 0u);
  EXPECT_LT(std::sqrt(host.diff2 / host.ref2), 1e-2);
}

TEST(FusedAttentionArguments, AreCheckedWithTheRuleNamed) {
  // Checked before anything touches a device, so this runs without a GPU too.
  AttentionArguments a{.ld = 3 * 128, .tokens = 16, .q_heads = 1, .kv_heads = 1, .head_dim = 128, .scale = 1.0f, .ld_out = 128};
  auto message = [](const AttentionArguments& args, int block_rows = 0) {
    try {
      fused_causal_attention(args, nullptr, block_rows);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  AttentionArguments bad = a;
  bad.head_dim = 96;
  EXPECT_NE(message(bad).find("head_dim = 96"), std::string::npos);
  bad = a;
  bad.q_heads = 3;
  bad.kv_heads = 2;
  EXPECT_NE(message(bad).find("kv_heads must divide q_heads"), std::string::npos);
  bad = a;
  bad.ld = 3 * 128 + 4;
  EXPECT_NE(message(bad).find("ld must be a multiple of 8"), std::string::npos);
  bad = a;
  bad.k = reinterpret_cast<const bf16*>(std::uintptr_t{0x1002});
  EXPECT_NE(message(bad).find("16-byte aligned"), std::string::npos);
  EXPECT_NE(message(a, 96).find("block_rows = 96"), std::string::npos);
  for (float scale : {0.0f, -0.5f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    bad = a;
    bad.scale = scale;
    EXPECT_NE(message(bad).find("must be finite and positive"), std::string::npos) << "scale " << scale;
  }
  // The Hopper kernel's own rules, also checked before any device call.
  const auto hopper_message = [](const AttentionArguments& args, int block_rows) {
    try {
      fused_causal_attention(args, nullptr, block_rows, AttentionKernel::hopper);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(hopper_message(a, 64).find("kernel = hopper takes 128 query rows per block"), std::string::npos);
  bad = a;
  bad.head_dim = 32;
  bad.ld = 3 * 32;
  bad.ld_out = 32;
  EXPECT_NE(hopper_message(bad, 0).find("head_dim 64 or 128 (head_dim = 32)"), std::string::npos);
  EXPECT_FALSE(attention_kernel_runs(AttentionKernel::hopper, 32));
  EXPECT_FALSE(fused_attention_supports(96));
  EXPECT_TRUE(fused_attention_supports(128));
}

}  // namespace
}  // namespace caravan::gpu
