// The tile-level GEMM fed by flags (kernels/gpu/flag_gemm.cu, flag_gemm_sm90.cu) on one GPU:
// every kernel (the Hopper one where the device is compute capability 9.0, with its plain and
// its persistent epilogue, and the portable one) against the float32 reference on fresh random
// inputs, outputs poisoned first, over shapes with tails in every dimension and padded leading
// dimensions whose padding must stay untouched; then with flags raised while the GEMM waits,
// rows landing out of order; and the vendor GEMM that adds into a distinct output
// (Blas::gemm_add). Skips without a GPU.
#include "kernels/gpu/blas.h"
#include "kernels/gpu/kernels.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/require_gpus.h"

#include <caravan/error.h>
#include <caravan/kernels/bf16.h>
#include <caravan/platform.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace caravan::gpu {
namespace {

using test::DeviceArray;

constexpr FlagGemmKernel kKernels[] = {FlagGemmKernel::best, FlagGemmKernel::persistent, FlagGemmKernel::portable};

struct Shape {
  long m, n, k;
  long pad_a, pad_b, pad_c;  // leading dimension = width + pad
  FlagGemmKernel kernel;
};

std::string kernel_label(FlagGemmKernel kernel) {
  switch (kernel) {
    case FlagGemmKernel::best: return "best";
    case FlagGemmKernel::portable: return "portable";
    case FlagGemmKernel::persistent: return "persistent";
  }
  return "unknown";
}

void PrintTo(const Shape& s, std::ostream* os) {
  *os << s.m << " x " << s.n << " x " << s.k << ", pads " << s.pad_a << "/" << s.pad_b << "/" << s.pad_c << ", "
      << kernel_label(s.kernel) << " kernel";
}

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return "m" + std::to_string(s.m) + "_n" + std::to_string(s.n) + "_k" + std::to_string(s.k) + "_pads" +
         std::to_string(s.pad_a) + "_" + std::to_string(s.pad_b) + "_" + std::to_string(s.pad_c) + "_" +
         kernel_label(s.kernel);
}

struct Measured {
  double relative_error = 0;
  unsigned long long nonfinite = 0;
  bool padding_untouched = true;
  std::string kernel;
};

double relative_error(const ErrorSums& s) {
  return s.ref2 > 0 ? std::sqrt(s.diff2 / s.ref2) : (s.diff2 > 0 ? 1.0 : 0.0);
}

// Inputs and the float32 reference for one shape; `run` launches the GEMM under test on `stream`
// (it may use other streams, ordered before it returns).
struct Problem {
  Shape s;
  long lda, ldb, ldc;
  hipStream_t stream = nullptr;
  DeviceArray<bf16> a, b, c;
  DeviceArray<float> a_f, b_f, ref;
  DeviceArray<ErrorSums> sums{1};

  explicit Problem(const Shape& shape, std::uint64_t seed)
      : s(shape),
        lda(shape.k + shape.pad_a),
        ldb(shape.n + shape.pad_b),
        ldc(shape.n + shape.pad_c),
        a(count(shape.m, lda)),
        b(count(shape.k, ldb)),
        c(count(shape.m, ldc)),
        a_f(count(shape.m, lda)),
        b_f(count(shape.k, ldb)),
        ref(count(shape.m, ldc)) {
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
    fill_random(a.data, s.m, s.k, lda, seed, 0, 0, 1.0f, stream);
    fill_random(a_f.data, s.m, s.k, lda, seed, 0, 0, 1.0f, stream);
    fill_random(b.data, s.k, s.n, ldb, seed + 1, 0, 0, 1.0f, stream);
    fill_random(b_f.data, s.k, s.n, ldb, seed + 1, 0, 0, 1.0f, stream);
    CARAVAN_HIP_CHECK(hipMemsetAsync(c.data, 0xff, count(s.m, ldc) * sizeof(bf16), stream));  // NaN everywhere
  }
  ~Problem() { (void)hipStreamDestroy(stream); }
  static std::size_t count(long rows, long cols) { return static_cast<std::size_t>(std::max(rows, 1L) * cols); }

  // `out` (C by default, or a copy of it with C's shape) against the reference.
  Measured check(const bf16* out_data = nullptr) {
    if (out_data == nullptr) out_data = c.data;
    Blas blas(stream);
    blas.gemm_reference(stream, s.m, s.n, s.k, a_f.data, lda, b_f.data, ldb, ref.data, ldc);
    compare(out_data, s.m, s.n, ldc, ref.data, ldc, sums.data, stream);
    ErrorSums host;
    CARAVAN_HIP_CHECK(hipMemcpyAsync(&host, sums.data, sizeof(host), hipMemcpyDefault, stream));
    std::vector<std::uint16_t> out(count(s.m, ldc));
    CARAVAN_HIP_CHECK(hipMemcpyAsync(out.data(), out_data, out.size() * sizeof(bf16), hipMemcpyDefault, stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
    Measured m;
    m.relative_error = relative_error(host);
    m.nonfinite = host.nonfinite;
    for (long row = 0; row < s.m; ++row)
      for (long col = s.n; col < ldc; ++col)
        if (out[static_cast<std::size_t>(row * ldc + col)] != 0xffff) m.padding_untouched = false;
    return m;
  }
};

class FlagGemm : public ::testing::TestWithParam<Shape> {};

TEST_P(FlagGemm, MatchesTheFloat32Reference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  preload_flag_gemm();
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Shape& s = GetParam();
  Problem p(s, seed);
  const std::string kernel = flag_gemm_kernel_name(s.m, s.n, p.ldc, s.kernel);
  SCOPED_TRACE("kernel " + kernel);
  std::printf("kernel: %s\n", kernel.c_str());  // which kernel and tile width this shape ran
  flag_gemm(p.a.data, p.lda, p.b.data, p.ldb, p.c.data, p.ldc, s.m, s.n, s.k, nullptr, 0, 0, nullptr, nullptr, 0,
            p.stream, s.kernel);
  const Measured m = p.check();
  EXPECT_EQ(m.nonfinite, 0u) << "outputs left poisoned or not finite";
  // Inputs in [-1, 1] summed over k in fp32 and rounded to bf16 once: about 2^-9 relative.
  EXPECT_LT(m.relative_error, 1e-2);
  EXPECT_TRUE(m.padding_untouched) << "the kernel wrote into C's padding columns";
}

// Tails in m, n and k, exact tiles, one row, k shorter than a stage, long k, padded leading
// dimensions; each for every kernel. On the Hopper kernel (132 multiprocessors), shapes of one
// wave of blocks take 128-column tiles and 4096 x 2560 x 512 (3 waves of 256 columns) takes
// 256-column ones; an ldc of n + 2 is not a multiple of 8, so "best" falls back to the portable
// kernel there.
std::vector<Shape> shapes() {
  std::vector<Shape> out;
  for (FlagGemmKernel kernel : kKernels)
    for (Shape s : {Shape{1000, 520, 200, 0, 0, 0}, Shape{300, 1032, 1000, 8, 16, 8}, Shape{256, 512, 128, 0, 0, 0},
                    Shape{1, 8, 8, 0, 0, 8}, Shape{129, 264, 24, 8, 8, 8}, Shape{512, 2560, 4096, 0, 0, 0},
                    Shape{2048, 640, 512, 0, 0, 0}, Shape{4096, 2560, 512, 0, 0, 0}, Shape{300, 264, 64, 0, 0, 2}}) {
      s.kernel = kernel;
      out.push_back(s);
    }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlagGemm, ::testing::ValuesIn(shapes()), shape_name);

// The flags gate the loads: A starts poisoned (NaN), the GEMM is launched waiting for epoch 1,
// and only then, from another stream, each flag's rows are copied in and the flag raised, last
// rows first, with the row tiles launched in that order. A block that read its rows before their
// flag would read NaN. The flags guard 200 rows each (tiles span two flags).
// The done words signal the stores: a word per 300 rows of C (so tiles add to two words), and a
// third stream, queued before the GEMM can start, copies each word's rows of C out once the word
// has grown by n per row tile over them (one stream wait-value each), into a poisoned copy that
// must then match the reference too; every word ends at exactly that count.
TEST(FlagGemmFlags, BlocksWaitForTheFlagsOfTheirRows) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  preload_flag_gemm();
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (FlagGemmKernel kernel : kKernels) {
    const Shape s{1800, 4096, 512, 0, 0, 0, kernel};  // 240 tiles of 256 columns: the persistent grid's blocks take two
    Problem p(s, seed);
    SCOPED_TRACE("kernel " + flag_gemm_kernel_name(s.m, s.n, p.ldc, kernel));
    const long rows_per_flag = 200, flag_count = (s.m + rows_per_flag - 1) / rows_per_flag;
    const std::size_t a_bytes = Problem::count(s.m, p.lda) * sizeof(bf16);
    // In pinned host memory: the rows come in on a copy engine. A device-to-device copy may run as
    // a kernel, and with every SM held by the GEMM's waiting blocks it would never start.
    test::PinnedArray<bf16> staged(Problem::count(s.m, p.lda));
    DeviceArray<std::uint64_t> flags(static_cast<std::size_t>(flag_count));
    const long tiles = flag_gemm_row_tiles(s.m);
    std::vector<int> order(static_cast<std::size_t>(tiles));
    for (long t = 0; t < tiles; ++t) order[static_cast<std::size_t>(t)] = static_cast<int>(tiles - 1 - t);
    DeviceArray<int> tile_order(order.size());
    CARAVAN_HIP_CHECK(hipMemcpyAsync(staged.data, p.a.data, a_bytes, hipMemcpyDefault, p.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(p.stream));
    CARAVAN_HIP_CHECK(hipMemsetAsync(p.a.data, 0xff, a_bytes, p.stream));
    CARAVAN_HIP_CHECK(hipMemsetAsync(flags.data, 0, static_cast<std::size_t>(flag_count) * 8, p.stream));
    CARAVAN_HIP_CHECK(
        hipMemcpyAsync(tile_order.data, order.data(), order.size() * sizeof(int), hipMemcpyDefault, p.stream));
    const long rows_per_done = 300, words = (s.m + rows_per_done - 1) / rows_per_done;
    DeviceArray<std::uint64_t> done(static_cast<std::size_t>(words));
    DeviceArray<bf16> c_copy(Problem::count(s.m, p.ldc));
    CARAVAN_HIP_CHECK(hipMemsetAsync(done.data, 0, static_cast<std::size_t>(words) * 8, p.stream));
    CARAVAN_HIP_CHECK(hipMemsetAsync(c_copy.data, 0xff, Problem::count(s.m, p.ldc) * sizeof(bf16), p.stream));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(p.stream));

    flag_gemm(p.a.data, p.lda, p.b.data, p.ldb, p.c.data, p.ldc, s.m, s.n, s.k, flags.data, rows_per_flag, 1,
              tile_order.data, done.data, rows_per_done, p.stream, kernel);
    hipStream_t reader = nullptr;
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&reader, hipStreamNonBlocking));
    const auto target = [&](long w) {
      return static_cast<std::uint64_t>(s.n * flag_gemm_tiles_over(s.m, w * rows_per_done, rows_per_done));
    };
    for (long w = 0; w < words; ++w) {  // in the opposite order to the tiles' launch
      const long first = w * rows_per_done, rows = std::min(rows_per_done, s.m - first);
      const std::size_t offset = static_cast<std::size_t>(first * p.ldc);
      CARAVAN_HIP_CHECK(hipStreamWaitValue64(reader, done.data + w, target(w), hipStreamWaitValueGte));
      CARAVAN_HIP_CHECK(hipMemcpyAsync(c_copy.data + offset, p.c.data + offset,
                                       static_cast<std::size_t>(rows * p.ldc) * sizeof(bf16), hipMemcpyDefault,
                                       reader));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the GEMM's blocks are waiting by now
    hipStream_t copier = nullptr;
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&copier, hipStreamNonBlocking));
    for (long f = flag_count - 1; f >= 0; --f) {
      const long first = f * rows_per_flag, rows = std::min(rows_per_flag, s.m - first);
      const std::size_t offset = static_cast<std::size_t>(first * p.lda);
      CARAVAN_HIP_CHECK(hipMemcpyAsync(p.a.data + offset, staged.data + offset,
                                       static_cast<std::size_t>(rows * p.lda) * sizeof(bf16), hipMemcpyDefault,
                                       copier));
      CARAVAN_HIP_CHECK(hipStreamWriteValue64(copier, flags.data + f, 1, 0));
    }
    CARAVAN_HIP_CHECK(hipStreamSynchronize(copier));
    CARAVAN_HIP_CHECK(hipStreamSynchronize(reader));
    CARAVAN_HIP_CHECK(hipStreamDestroy(copier));
    CARAVAN_HIP_CHECK(hipStreamDestroy(reader));
    const Measured m = p.check();
    EXPECT_EQ(m.nonfinite, 0u) << "a block read rows before their flag was raised";
    EXPECT_LT(m.relative_error, 1e-2);
    const Measured copied = p.check(c_copy.data);
    EXPECT_EQ(copied.nonfinite, 0u) << "a done word rose before its rows were written";
    EXPECT_LT(copied.relative_error, 1e-2);
    std::vector<std::uint64_t> counted(static_cast<std::size_t>(words));
    CARAVAN_HIP_CHECK(hipMemcpy(counted.data(), done.data, counted.size() * 8, hipMemcpyDefault));
    for (long w = 0; w < words; ++w) EXPECT_EQ(counted[static_cast<std::size_t>(w)], target(w)) << "done word " << w;
  }
}

// C in parts (flag_gemm_parts): 4000 rows in parts of 1200 (the last of 400), each part its own
// poisoned buffer with padded rows, each with its own done words (128 rows each, counted from
// the part's first row, so row tiles straddle parts and words); then the same with every part
// written twice (copies, as GEMM+All-Scatter writes every rank's C), each copy to buffers and
// words of its own. Gathered back into one C, every copy must match the reference with the
// padding untouched, and every word must end at n per row tile over its rows.
TEST(FlagGemmParts, EachPartsRowsLandInItsOwnBufferAndWords) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  preload_flag_gemm();
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (FlagGemmKernel kernel : kKernels)
    for (int copies : {1, 2}) {
      const Shape s{4000, 520, 200, 0, 0, 8, kernel};  // 160 tiles: the persistent grid's blocks take one or two
      Problem p(s, seed);
      SCOPED_TRACE("kernel " + flag_gemm_kernel_name(s.m, s.n, p.ldc, kernel) + ", copies " + std::to_string(copies));
      const long part_rows = 1200, rows_per_done = 128,
                 words_per_part = (part_rows + rows_per_done - 1) / rows_per_done;
      FlagGemmParts parts;
      parts.count = static_cast<int>((s.m + part_rows - 1) / part_rows);
      parts.copies = copies;
      parts.rows = part_rows;
      const int entries = parts.count * copies;  // entry q * copies + i: part q, copy i
      std::deque<DeviceArray<bf16>> buffers;     // not movable: a deque keeps them in place
      std::deque<DeviceArray<std::uint64_t>> words;
      for (int e = 0; e < entries; ++e) {
        buffers.emplace_back(Problem::count(part_rows, p.ldc));
        words.emplace_back(static_cast<std::size_t>(words_per_part));
        CARAVAN_HIP_CHECK(
            hipMemsetAsync(buffers.back().data, 0xff, Problem::count(part_rows, p.ldc) * sizeof(bf16), p.stream));
        CARAVAN_HIP_CHECK(hipMemsetAsync(words.back().data, 0, static_cast<std::size_t>(words_per_part) * 8, p.stream));
        parts.c[e] = buffers.back().data;
        parts.done[e] = words.back().data;
      }
      flag_gemm_parts(p.a.data, p.lda, p.b.data, p.ldb, parts, p.ldc, s.m, s.n, s.k, nullptr, 0, 0, nullptr,
                      rows_per_done, p.stream, kernel);
      for (int copy = 0; copy < copies; ++copy) {
        SCOPED_TRACE("copy " + std::to_string(copy));
        for (int q = 0; q < parts.count; ++q) {
          const long first = q * part_rows, rows = std::min(part_rows, s.m - first);
          CARAVAN_HIP_CHECK(
              hipMemcpyAsync(p.c.data + first * p.ldc, buffers[static_cast<std::size_t>(q * copies + copy)].data,
                             static_cast<std::size_t>(rows * p.ldc) * sizeof(bf16), hipMemcpyDefault, p.stream));
        }
        const Measured m = p.check();
        EXPECT_EQ(m.nonfinite, 0u) << "rows left poisoned: a part's rows went elsewhere";
        EXPECT_LT(m.relative_error, 1e-2);
        EXPECT_TRUE(m.padding_untouched) << "the kernel wrote into a part's padding columns";
        for (int q = 0; q < parts.count; ++q) {
          std::vector<std::uint64_t> counted(static_cast<std::size_t>(words_per_part));
          CARAVAN_HIP_CHECK(hipMemcpy(counted.data(), words[static_cast<std::size_t>(q * copies + copy)].data,
                                      counted.size() * 8, hipMemcpyDefault));
          const long part_end = std::min((q + 1) * part_rows, s.m);
          for (long w = 0; w < words_per_part; ++w) {
            const long first = q * part_rows + w * rows_per_done, rows = std::min(rows_per_done, part_end - first);
            const std::uint64_t target =
                rows > 0 ? static_cast<std::uint64_t>(s.n * flag_gemm_tiles_over(s.m, first, rows)) : 0;
            EXPECT_EQ(counted[static_cast<std::size_t>(w)], target) << "part " << q << ", done word " << w;
          }
        }
      }
    }
}

TEST(FlagGemmArguments, BadArgumentsAreRejectedNamingTheRule) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  DeviceArray<bf16> buffer(64 * 64);
  try {
    flag_gemm(buffer.data, 64, buffer.data, 64, buffer.data, 64, 8, 60, 64, nullptr, 0, 0, nullptr, nullptr, 0,
              nullptr);
    FAIL() << "n = 60 (not a multiple of 8) was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("multiples of 8"), std::string::npos) << e.what();
  }
  DeviceArray<std::uint64_t> words(1);
  try {
    flag_gemm(buffer.data, 64, buffer.data, 64, buffer.data, 64, 8, 64, 64, nullptr, 0, 0, nullptr, words.data, 0,
              nullptr);
    FAIL() << "done words with rows_per_done = 0 were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("rows_per_done"), std::string::npos) << e.what();
  }
  FlagGemmParts parts;
  parts.count = 2;
  parts.rows = 8;  // 8 rows need one part, not two
  parts.c[0] = parts.c[1] = buffer.data;
  try {
    flag_gemm_parts(buffer.data, 64, buffer.data, 64, parts, 64, 8, 64, 64, nullptr, 0, 0, nullptr, 0, nullptr);
    FAIL() << "two parts of 8 rows for an 8-row C were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("parts.count"), std::string::npos) << e.what();
  }
}

// Blas::gemm_add (cuBLASLt, C and D distinct), which the GEMM+ReduceScatter ring's last step
// runs: D = A B + C against the float32 A B plus C's values, on fresh random inputs, D poisoned
// first, its padding and the elements before it untouched, and C unchanged. One Blas per shape
// runs it at five placements of the four operands in turn (all 256-byte aligned; all 16 bytes
// past that; C and D 8 bytes past, A 16; A and C shifted, B and D not; all aligned again, which
// must find its first plan), so a plan made for one placement is reused only where it serves.
TEST(BlasGemmAdd, SumsIntoADistinctOutputAtEveryPlacement) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  const std::uint64_t seed0 = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed0));
  struct Case {
    long m, n, k, pad_c, pad_d;
  };
  struct Placement {
    long a, b, c, d;  // elements past a 256-byte-aligned address
  };
  const Placement placements[] = {{0, 0, 0, 0}, {8, 8, 8, 8}, {8, 0, 4, 4}, {8, 0, 8, 0}, {0, 0, 0, 0}};
  constexpr long kMaxShift = 8;
  const auto to_float = [](std::uint16_t bits) { return kernels::Bf16{bits}.to_float(); };
  std::uint64_t seed = seed0;
  for (const Case& cs : {Case{1024, 1024, 512, 0, 0}, Case{300, 264, 72, 8, 16}}) {
    SCOPED_TRACE(std::to_string(cs.m) + " x " + std::to_string(cs.n) + " x " + std::to_string(cs.k));
    const long lda = cs.k, ldb = cs.n, ldc = cs.n + cs.pad_c, ldd = cs.n + cs.pad_d;
    hipStream_t stream = nullptr;
    CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&stream, hipStreamNonBlocking));
    const auto count = [](long rows, long ld) { return static_cast<std::size_t>(rows * ld + kMaxShift); };
    DeviceArray<bf16> a(count(cs.m, lda)), b(count(cs.k, ldb)), c(count(cs.m, ldc)), d(count(cs.m, ldd));
    DeviceArray<float> a_f(count(cs.m, lda)), b_f(count(cs.k, ldb)), ref(count(cs.m, cs.n));
    auto blas = std::make_unique<Blas>(stream);
    for (const Placement& at : placements) {
      SCOPED_TRACE("placement " + std::to_string(at.a) + "/" + std::to_string(at.b) + "/" + std::to_string(at.c) + "/" +
                   std::to_string(at.d));
      seed += 3;
      bf16 *a_at = a.data + at.a, *b_at = b.data + at.b, *c_at = c.data + at.c, *d_at = d.data + at.d;
      fill_random(a_at, cs.m, cs.k, lda, seed, 0, 0, 1.0f, stream);
      fill_random(a_f.data, cs.m, cs.k, lda, seed, 0, 0, 1.0f, stream);
      fill_random(b_at, cs.k, cs.n, ldb, seed + 1, 0, 0, 1.0f, stream);
      fill_random(b_f.data, cs.k, cs.n, ldb, seed + 1, 0, 0, 1.0f, stream);
      fill_random(c_at, cs.m, cs.n, ldc, seed + 2, 0, 0, 4.0f, stream);
      CARAVAN_HIP_CHECK(hipMemsetAsync(d.data, 0xff, count(cs.m, ldd) * sizeof(bf16), stream));  // NaN
      blas->gemm_reference(stream, cs.m, cs.n, cs.k, a_f.data, lda, b_f.data, ldb, ref.data, cs.n);
      std::vector<std::uint16_t> c_before(static_cast<std::size_t>(cs.m * ldc));
      CARAVAN_HIP_CHECK(hipMemcpyAsync(c_before.data(), c_at, c_before.size() * 2, hipMemcpyDefault, stream));
      blas->gemm_add(stream, cs.m, cs.n, cs.k, a_at, lda, b_at, ldb, c_at, ldc, d_at, ldd);
      std::vector<std::uint16_t> c_after(c_before.size()), out(count(cs.m, ldd));
      std::vector<float> product(static_cast<std::size_t>(cs.m * cs.n));
      CARAVAN_HIP_CHECK(hipMemcpyAsync(c_after.data(), c_at, c_after.size() * 2, hipMemcpyDefault, stream));
      CARAVAN_HIP_CHECK(hipMemcpyAsync(out.data(), d.data, out.size() * 2, hipMemcpyDefault, stream));
      CARAVAN_HIP_CHECK(hipMemcpyAsync(product.data(), ref.data, product.size() * 4, hipMemcpyDefault, stream));
      CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
      double diff2 = 0, ref2 = 0;
      long nonfinite = 0, written_outside = 0;
      for (long row = 0; row < cs.m; ++row) {
        for (long col = 0; col < cs.n; ++col) {
          const double want = static_cast<double>(product[static_cast<std::size_t>(row * cs.n + col)]) +
                              to_float(c_before[static_cast<std::size_t>(row * ldc + col)]);
          const double got = to_float(out[static_cast<std::size_t>(at.d + row * ldd + col)]);
          if (!std::isfinite(got)) ++nonfinite;
          diff2 += (got - want) * (got - want);
          ref2 += want * want;
        }
        for (long col = cs.n; col < ldd; ++col)
          if (out[static_cast<std::size_t>(at.d + row * ldd + col)] != 0xffff) ++written_outside;
      }
      for (long i = 0; i < at.d; ++i)
        if (out[static_cast<std::size_t>(i)] != 0xffff) ++written_outside;
      EXPECT_EQ(nonfinite, 0) << "outputs left poisoned or not finite";
      EXPECT_LT(std::sqrt(diff2 / ref2), 1e-2);
      EXPECT_EQ(written_outside, 0) << "written outside D's rows";
      EXPECT_TRUE(c_after == c_before) << "C changed";
    }
    blas.reset();  // before its stream
    CARAVAN_HIP_CHECK(hipStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace caravan::gpu
