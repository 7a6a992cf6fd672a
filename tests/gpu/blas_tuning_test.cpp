// Blas::tune (kernels/gpu/blas.cpp): the GEMM algorithm timed fastest per shape and device,
// which every Blas of the process then runs. Checks, on one GPU, that tuned calls of each kind
// (gemm() overwriting and accumulating in place, gemm_add() into a distinct output) match the
// float32 reference on fresh random inputs with outputs poisoned and padding left alone, both
// whatever tuning chose and with a cuBLASLt algorithm forced (TuneOptions::pick), so that the
// tuned path of gemm() runs whatever the machine's timings; that a shape is timed once per
// device and shared by every Blas that tunes, but not by one made with GemmTuning::off; that
// pointers the tuned plan does not serve take the untuned choice and stay correct; that threads
// tuning one shape at once time it once; that CARAVAN_GPU_GEMM_TUNE=0 tunes nothing unless the
// call names a count; and that bad arguments are refused. Skips without a GPU.
#include "kernels/gpu/blas.h"
#include "kernels/gpu/kernels.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/require_gpus.h"

#include <caravan/error.h>
#include <caravan/kernels/bf16.h>
#include <caravan/settings.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace caravan::gpu {
namespace {

using test::DeviceArray;

enum class Kind { overwrite, accumulate, add_elsewhere };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::overwrite: return "gemm, beta 0";
    case Kind::accumulate: return "gemm, beta 1";
    case Kind::add_elsewhere: return "gemm_add";
  }
  return "?";
}

// A stream per test, destroyed after the Blas objects that were bound to it.
struct Stream {
  hipStream_t s = nullptr;
  Stream() { CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&s, hipStreamNonBlocking)); }
  ~Stream() { (void)hipStreamDestroy(s); }
};

// Runs one GEMM of `kind` through `blas` on fresh random data, the output poisoned, with A
// placed `a_shift` elements past a 256-byte aligned address; returns the relative error against
// float32 (A B, plus C's values where the kind adds them) and counts poisoned or non-finite
// outputs and elements written in the output's padding (ldc = n + pad).
struct Outcome {
  double error = 1;
  long nonfinite = 0, padding_written = 0;
};
Outcome run_case(Blas& blas, hipStream_t stream, Kind kind, long m, long n, long k, long pad, long a_shift,
                 std::uint64_t seed) {
  const long lda = k, ldb = n, ldc = n + pad;
  const auto elements = [](long rows, long ld) { return static_cast<std::size_t>(rows * ld); };
  DeviceArray<bf16> a(elements(m, lda) + static_cast<std::size_t>(a_shift)), b(elements(k, ldb)), c(elements(m, ldc)),
      d(elements(m, ldc));
  DeviceArray<float> a_f(elements(m, lda)), b_f(elements(k, ldb)), ref(elements(m, n));
  bf16* a_at = a.data + a_shift;
  fill_random(a_at, m, k, lda, seed, 0, 0, 1.0f, stream);
  fill_random(a_f.data, m, k, lda, seed, 0, 0, 1.0f, stream);
  fill_random(b.data, k, n, ldb, seed + 1, 0, 0, 1.0f, stream);
  fill_random(b_f.data, k, n, ldb, seed + 1, 0, 0, 1.0f, stream);
  const bool adds = kind != Kind::overwrite;
  bf16* out = kind == Kind::add_elsewhere ? d.data : c.data;
  CARAVAN_HIP_CHECK(hipMemsetAsync(out, 0xff, elements(m, ldc) * sizeof(bf16), stream));  // NaN, padding too
  if (adds) fill_random(c.data, m, n, ldc, seed + 2, 0, 0, 4.0f, stream);  // accumulate: C's rows, padding poisoned
  std::vector<std::uint16_t> c_before(elements(m, ldc));
  CARAVAN_HIP_CHECK(hipMemcpyAsync(c_before.data(), c.data, c_before.size() * 2, hipMemcpyDefault, stream));
  blas.gemm_reference(stream, m, n, k, a_f.data, lda, b_f.data, ldb, ref.data, n);
  if (kind == Kind::add_elsewhere)
    blas.gemm_add(stream, m, n, k, a_at, lda, b.data, ldb, c.data, ldc, d.data, ldc);
  else
    blas.gemm(stream, m, n, k, a_at, lda, b.data, ldb, c.data, ldc, adds ? 1.0f : 0.0f);
  std::vector<std::uint16_t> got(elements(m, ldc));
  std::vector<float> product(elements(m, n));
  CARAVAN_HIP_CHECK(hipMemcpyAsync(got.data(), out, got.size() * 2, hipMemcpyDefault, stream));
  CARAVAN_HIP_CHECK(hipMemcpyAsync(product.data(), ref.data, product.size() * 4, hipMemcpyDefault, stream));
  CARAVAN_HIP_CHECK(hipStreamSynchronize(stream));
  const auto to_float = [](std::uint16_t bits) { return kernels::Bf16{bits}.to_float(); };
  Outcome o;
  double diff2 = 0, ref2 = 0;
  for (long row = 0; row < m; ++row) {
    for (long col = 0; col < n; ++col) {
      const auto at = static_cast<std::size_t>(row * ldc + col);
      const double want =
          static_cast<double>(product[static_cast<std::size_t>(row * n + col)]) + (adds ? to_float(c_before[at]) : 0.0);
      const double have = to_float(got[at]);
      if (!std::isfinite(have)) ++o.nonfinite;
      diff2 += (have - want) * (have - want);
      ref2 += want * want;
    }
    for (long col = n; col < ldc; ++col)
      if (got[static_cast<std::size_t>(row * ldc + col)] != 0xffff) ++o.padding_written;
  }
  o.error = ref2 > 0 ? std::sqrt(diff2 / ref2) : 1.0;
  return o;
}

void expect_right(const Outcome& o) {
  EXPECT_EQ(o.nonfinite, 0) << "outputs left poisoned or not finite";
  EXPECT_LT(o.error, 1e-2);
  EXPECT_EQ(o.padding_written, 0) << "written in C's padding";
}

// Shapes no other test of this process tunes (tuned choices are the process's, per device).
struct TuneCase {
  long m, n, k, pad;
  Kind kind;
};

TEST(BlasTuning, TunedGemmsOfEveryKindMatchTheFloatReference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  settings::ScopedOverride candidates{"CARAVAN_GPU_GEMM_TUNE", "8"};
  const std::uint64_t seed0 = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed0));
  std::uint64_t seed = seed0;
  Stream stream;
  for (const TuneCase& t :
       {TuneCase{1024, 1536, 768, 0, Kind::overwrite}, TuneCase{1024, 1536, 768, 0, Kind::accumulate},
        TuneCase{1024, 1536, 768, 0, Kind::add_elsewhere}, TuneCase{264, 520, 136, 8, Kind::overwrite},
        TuneCase{264, 520, 136, 8, Kind::accumulate}, TuneCase{264, 520, 136, 8, Kind::add_elsewhere}}) {
    SCOPED_TRACE(std::to_string(t.m) + " x " + std::to_string(t.n) + " x " + std::to_string(t.k) + ", ldc pad " +
                 std::to_string(t.pad) + ", " + kind_name(t.kind));
    const float beta = t.kind == Kind::overwrite ? 0.0f : 1.0f;
    const bool elsewhere = t.kind == Kind::add_elsewhere;
    const long ldc = t.n + t.pad;
    Blas blas(stream.s), lane(stream.s), untuned(stream.s, GemmTuning::off);
    // The default plus at least one cuBLASLt candidate (gemm_add: at least the heuristic's first),
    // unless an earlier repetition of this test in this process tuned the shape already.
    const bool before = blas.choice(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere) != GemmChoice::untuned;
    const int timed = blas.tune(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere);
    if (before)
      EXPECT_EQ(timed, 0);
    else
      EXPECT_GE(timed, 2) << "the untuned choice and at least one candidate";
    const GemmChoice chosen = blas.choice(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere);
    EXPECT_NE(chosen, GemmChoice::untuned);
    // Once per device: a second Blas finds the choice and times nothing.
    EXPECT_EQ(lane.tune(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere), 0);
    EXPECT_EQ(lane.choice(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere), chosen);
    EXPECT_EQ(untuned.choice(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere), GemmChoice::untuned);
    EXPECT_EQ(untuned.tune(t.m, t.n, t.k, t.k, t.n, ldc, beta, elsewhere), 0);
    for (Blas* b : {&blas, &lane, &untuned}) {
      expect_right(run_case(*b, stream.s, t.kind, t.m, t.n, t.k, t.pad, 0, seed += 3));
    }
  }
}

// A 16-byte shifted A is not served by the 256-byte plan: cuBLAS's default (or, for gemm_add, a
// plan for that alignment) runs it, still right.
TEST(BlasTuning, PointersLessAlignedThanTheTunedPlanStillComputeRight) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  settings::ScopedOverride candidates{"CARAVAN_GPU_GEMM_TUNE", "8"};
  const std::uint64_t seed0 = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed0));
  Stream stream;
  Blas blas(stream.s);
  const long m = 768, n = 1280, k = 640;
  for (Kind kind : {Kind::overwrite, Kind::accumulate, Kind::add_elsewhere}) {
    SCOPED_TRACE(kind_name(kind));
    const float beta = kind == Kind::overwrite ? 0.0f : 1.0f;
    TuneOptions forced;
    forced.candidates = 8;
    forced.pick = 0;  // a cuBLASLt algorithm, whatever the timings: the plan an aligned call would take
    blas.tune(m, n, k, k, n, n, beta, kind == Kind::add_elsewhere, forced);
    ASSERT_EQ(blas.choice(m, n, k, k, n, n, beta, kind == Kind::add_elsewhere), GemmChoice::algorithm);
    for (long shift : {8L, 0L}) {  // 16 bytes past, then aligned again
      const Outcome o = run_case(blas, stream.s, kind, m, n, k, 0, shift, seed0 + static_cast<std::uint64_t>(shift));
      EXPECT_EQ(o.nonfinite, 0) << "A shifted by " << shift;
      EXPECT_LT(o.error, 1e-2) << "A shifted by " << shift;
    }
  }
}

// Each kind with a cuBLASLt algorithm forced: gemm()'s and gemm_add()'s tuned path (the plan,
// its operand order and layouts) against float32, whichever algorithm would have won.
TEST(BlasTuning, ForcedAlgorithmsOfEveryKindMatchTheFloatReference) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  const std::uint64_t seed0 = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed0));
  std::uint64_t seed = seed0;
  Stream stream;
  for (const TuneCase& t :
       {TuneCase{776, 1048, 328, 0, Kind::overwrite}, TuneCase{776, 1048, 328, 0, Kind::accumulate},
        TuneCase{776, 1048, 328, 0, Kind::add_elsewhere}, TuneCase{136, 392, 264, 24, Kind::overwrite},
        TuneCase{136, 392, 264, 24, Kind::accumulate}, TuneCase{136, 392, 264, 24, Kind::add_elsewhere}}) {
    for (int pick : {0, 1}) {
      // Another shape per pick: the process keeps one choice per shape.
      const long n = t.n + 8L * pick;
      SCOPED_TRACE(std::to_string(t.m) + " x " + std::to_string(n) + " x " + std::to_string(t.k) + ", ldc pad " +
                   std::to_string(t.pad) + ", " + kind_name(t.kind) + ", candidate " + std::to_string(pick));
      const float beta = t.kind == Kind::overwrite ? 0.0f : 1.0f;
      const bool elsewhere = t.kind == Kind::add_elsewhere;
      Blas blas(stream.s);
      TuneOptions forced;
      forced.candidates = 8;
      forced.pick = pick;
      try {
        blas.tune(t.m, n, t.k, t.k, n, n + t.pad, beta, elsewhere, forced);
      } catch (const Error& e) {  // fewer candidates than `pick` for this shape: nothing to force
        EXPECT_NE(std::string(e.what()).find("only"), std::string::npos) << e.what();
        continue;
      }
      ASSERT_EQ(blas.choice(t.m, n, t.k, t.k, n, n + t.pad, beta, elsewhere), GemmChoice::algorithm);
      expect_right(run_case(blas, stream.s, t.kind, t.m, n, t.k, t.pad, 0, seed += 3));
    }
  }
}

// Four threads tune one shape through Blas objects of their own at once: one times it (one
// tuning at a time per device), the others find its choice. A hang fails by the test's timeout.
TEST(BlasTuning, ThreadsTuningOneShapeTimeItOnce) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  constexpr int kThreads = 4;
  std::atomic<int> timed_calls{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      try {
        CARAVAN_HIP_CHECK(hipSetDevice(0));
        Stream stream;
        Blas blas(stream.s);
        if (blas.tune(1096, 1160, 456, 456, 1160, 1160, 0.0f, false, TuneOptions{8}) > 0) ++timed_calls;
        if (blas.choice(1096, 1160, 456, 456, 1160, 1160) == GemmChoice::untuned) ++failures;
      } catch (...) {
        ++failures;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(timed_calls.load(), 1) << "the shape was timed more than once";
}

TEST(BlasTuning, OffWithZeroCandidatesAndBadArgumentsRefused) {
  CARAVAN_REQUIRE_GPU_COUNT(1);
  CARAVAN_HIP_CHECK(hipSetDevice(0));
  Stream stream;
  Blas blas(stream.s);
  {
    settings::ScopedOverride off{"CARAVAN_GPU_GEMM_TUNE", "0"};
    EXPECT_EQ(blas.tune(512, 640, 384, 384, 640, 640), 0);
    EXPECT_EQ(blas.choice(512, 640, 384, 384, 640, 640), GemmChoice::untuned);
    const Outcome o = run_case(blas, stream.s, Kind::overwrite, 512, 640, 384, 0, 0, std::random_device{}());
    EXPECT_EQ(o.nonfinite, 0);
    EXPECT_LT(o.error, 1e-2);
    // A count given to the call overrides the setting (bench gemm's --tune).
    const bool before = blas.choice(512, 640, 392, 392, 640, 640) != GemmChoice::untuned;
    const int timed = blas.tune(512, 640, 392, 392, 640, 640, 0.0f, false, TuneOptions{4});
    if (!before) {
      EXPECT_GE(timed, 2);
    }
    EXPECT_NE(blas.choice(512, 640, 392, 392, 640, 640), GemmChoice::untuned);
  }
  const auto refused = [&](const char* what, auto call, const char* names) {
    try {
      call();
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << what;
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << what << ": " << e.what();
    }
  };
  refused(
      "m = 0", [&] { blas.tune(0, 64, 64, 64, 64, 64); }, "m = 0");
  refused(
      "lda < k", [&] { blas.tune(64, 64, 128, 64, 64, 64); }, "lda = 64 >= k");
  refused(
      "ldc < n", [&] { blas.tune(64, 128, 64, 64, 128, 64); }, "ldc = 64 >= n");
  refused(
      "beta 0.5", [&] { blas.tune(64, 64, 64, 64, 64, 64, 0.5f); }, "beta = 0.5");
  refused(
      "candidates 65", [&] { blas.tune(64, 64, 64, 64, 64, 64, 0.0f, false, TuneOptions{65}); }, "candidates = 65");
  refused(
      "pick 63 of 2",
      [&] {
        blas.tune(192, 256, 128, 128, 256, 256, 0.0f, false, TuneOptions{2, 63});
      },
      "options.pick = 63, but only");
}

}  // namespace
}  // namespace caravan::gpu
