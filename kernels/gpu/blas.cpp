#include "kernels/gpu/blas.h"

#include <caravan/error.h>
#include <caravan/settings.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace caravan::gpu {
namespace {

void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(Errc::device, std::string(call) + " failed: " + cublasGetStatusName(status) + " (" +
                                  cublasGetStatusString(status) + ")");
}

constexpr std::size_t kWorkspace = 32u << 20;

// The alignment cuBLASLt may assume of a pointer: its lowest set address bit, at most 256 bytes.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// What a GEMM does with C: gemm() with beta 0 (overwrite) or 1 (accumulate, D = C), or
// gemm_add() (D = A B + C into another buffer). Tuned choices are kept per kind: the fastest
// kernel for one need not be the fastest for another.
enum class GemmKind { overwrite, accumulate, add_elsewhere };

// A GEMM's column-major terms (as cuBLAS sees the row-major call: operands swapped) on a device.
struct GemmKey {
  int device = 0;
  GemmKind kind = GemmKind::overwrite;
  long m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, ldd = 0;
  bool operator==(const GemmKey&) const = default;
};

// What Blas::tune measured fastest for a key: cuBLAS's default choice (cublasGemmEx), or a
// cuBLASLt algorithm. Shared by every Blas of the process (an algorithm is plain data, valid with
// any handle on its device), so that each shape is timed once per device, not once per lane.
struct TunedChoice {
  GemmKey key;
  bool vendor_default = false;
  cublasLtMatmulAlgo_t algo{};
};
std::mutex g_tuned_mutex;
std::condition_variable g_tuned_changed;  // a device's tuning ended
std::vector<TunedChoice> g_tuned;         // under g_tuned_mutex
std::vector<int> g_devices_tuning;        // under g_tuned_mutex: one tuning at a time per device
// Entries in g_tuned: with none (tuning off, the default), gemm() takes no lock to find that out.
std::atomic<std::size_t> g_tuned_count{0};

std::optional<TunedChoice> find_tuned(const GemmKey& key) {
  if (g_tuned_count.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::lock_guard lock(g_tuned_mutex);
  for (const TunedChoice& t : g_tuned)
    if (t.key == key) return t;
  return std::nullopt;
}

// Makes `device` current for its scope (tune() allocates and launches there), then restores the
// one before.
struct DeviceScope {
  int previous = 0;
  explicit DeviceScope(int device) {
    CARAVAN_HIP_CHECK(hipGetDevice(&previous));
    if (previous != device) CARAVAN_HIP_CHECK(hipSetDevice(device));
  }
  ~DeviceScope() { (void)hipSetDevice(previous); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

constexpr std::uint32_t kTunedAlignment = 256;  // bytes: hipMalloc's, and what tune()'s buffers have

// One planned cuBLASLt GEMM (D = A B + C, column-major terms): its shape, the alignments it was
// planned for, its descriptors and its algorithm (the heuristic's first, or the tuned one).
struct LtPlan {
  long m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, ldd = 0;
  std::uint32_t align[4] = {};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t layout[4] = {};
  cublasLtMatmulAlgo_t algo{};
  GemmKind kind = GemmKind::add_elsewhere;
  bool vendor_default = false;  // a tuned plan whose winner was cublasGemmEx's choice (no descriptors)

  // A plan for `key`'s terms, for pointers aligned as tune()'s buffers (nothing described yet).
  static LtPlan tuned_for(const GemmKey& key) {
    LtPlan p;
    p.m = key.m, p.n = key.n, p.k = key.k, p.lda = key.lda, p.ldb = key.ldb, p.ldc = key.ldc, p.ldd = key.ldd;
    std::fill(std::begin(p.align), std::end(p.align), kTunedAlignment);
    p.kind = key.kind;
    return p;
  }
  bool same_gemm(long m_, long n_, long k_, long lda_, long ldb_, long ldc_, long ldd_) const {
    return m == m_ && n == n_ && k == k_ && lda == lda_ && ldb == ldb_ && ldc == ldc_ && ldd == ldd_;
  }
  // Planned for no stricter alignments than these (so its algorithm takes pointers aligned so).
  bool serves(const std::uint32_t (&al)[4]) const {
    return align[0] <= al[0] && align[1] <= al[1] && align[2] <= al[2] && align[3] <= al[3];
  }
  bool exactly(const std::uint32_t (&al)[4]) const {
    return align[0] == al[0] && align[1] == al[1] && align[2] == al[2] && align[3] == al[3];
  }
  void release() {
    for (auto& l : layout)
      if (l) (void)cublasLtMatrixLayoutDestroy(l), l = nullptr;
    if (op) (void)cublasLtMatmulDescDestroy(op), op = nullptr;
  }
  // The operation and the four matrix layouts for these terms (bf16, fp32 accumulation).
  void describe() {
    check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const std::uint64_t rows[4] = {static_cast<std::uint64_t>(m), static_cast<std::uint64_t>(k),
                                   static_cast<std::uint64_t>(m), static_cast<std::uint64_t>(m)},
                        cols[4] = {static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(n),
                                   static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(n)};
    const long lds[4] = {lda, ldb, ldc, ldd};
    for (int i = 0; i < 4; ++i)
      check(cublasLtMatrixLayoutCreate(&layout[i], CUDA_R_16BF, rows[i], cols[i], lds[i]),
            "cublasLtMatrixLayoutCreate");
  }
  // Up to `count` algorithms cuBLASLt's heuristic offers for these terms and alignments, best
  // first (at least one, else Error(device)).
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(cublasLtHandle_t lt, int count) const {
    cublasLtMatmulPreference_t preference = nullptr;
    std::vector<cublasLtMatmulHeuristicResult_t> found(static_cast<std::size_t>(count));
    int returned = 0;
    try {
      check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
      const std::uint64_t workspace_bytes = kWorkspace;
      check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                 sizeof workspace_bytes),
            "cublasLtMatmulPreferenceSetAttribute(workspace)");
      const cublasLtMatmulPreferenceAttributes_t align_attribute[4] = {
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
      for (int i = 0; i < 4; ++i)
        check(cublasLtMatmulPreferenceSetAttribute(preference, align_attribute[i], &align[i], sizeof align[i]),
              "cublasLtMatmulPreferenceSetAttribute(alignment)");
      check(cublasLtMatmulAlgoGetHeuristic(lt, op, layout[0], layout[1], layout[2], layout[3], preference, count,
                                           found.data(), &returned),
            "cublasLtMatmulAlgoGetHeuristic");
    } catch (...) {
      if (preference) (void)cublasLtMatmulPreferenceDestroy(preference);
      throw;
    }
    (void)cublasLtMatmulPreferenceDestroy(preference);
    if (returned < 1)
      throw Error(Errc::device, "cublasLtMatmulAlgoGetHeuristic found no algorithm for a bf16 GEMM of " +
                                    std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k));
    found.resize(static_cast<std::size_t>(returned));
    return found;
  }
};

// Device memory freed when it leaves scope (tune()'s buffers).
struct DeviceScratch {
  void* p = nullptr;
  explicit DeviceScratch(std::size_t bytes) { CARAVAN_HIP_CHECK(hipMalloc(&p, std::max<std::size_t>(bytes, 256))); }
  ~DeviceScratch() { (void)hipFree(p); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  bf16* bf() const { return static_cast<bf16*>(p); }
};

}  // namespace

// The handle is bound to one stream for its whole life (`home`); a call on another stream is
// ordered into it with two events. Why: cublasSetStream resets the workspace to cuBLAS's pool,
// and (re)binding a handle while the device holds a stream waiting on a peer's flag can wait on
// that device; a mixed-stream test of the overlapped operations hung inside a CUDA call on
// 4 x H200 while the handle was rebound at every call.
struct Blas::Impl {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  hipStream_t home = nullptr;
  bool owns_home = false;
  hipEvent_t enter = nullptr, leave = nullptr;
  cublasLtHandle_t lt = nullptr;    // gemm_add's and the tuned GEMMs'
  std::vector<LtPlan> plans;        // gemm_add's, from the heuristic
  std::vector<LtPlan> tuned_plans;  // from the process's tuned choices, described at first use here
  GemmTuning tuning = GemmTuning::use;
  int device = 0;

  template <class Call>
  void on(hipStream_t stream, Call call) {
    if (stream == home) {
      call();
      return;
    }
    CARAVAN_HIP_CHECK(hipEventRecord(enter, stream));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(home, enter, 0));
    call();
    CARAVAN_HIP_CHECK(hipEventRecord(leave, home));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, leave, 0));
  }
  // The plan for this column-major D[m x n] = A[m x k] B[k x n] + C (made at first use).
  const LtPlan& plan(long m, long n, long k, const void* a, long lda, const void* b, long ldb, const void* c, long ldc,
                     const void* d, long ldd);
  // The tuned plan for this GEMM (column-major terms) when tuning is on here, the four pointers
  // are aligned as tune()'s buffers were, and the process has a tuned choice; else null.
  const LtPlan* tuned_plan(const GemmKey& key, const void* a, const void* b, const void* c, const void* d);
  void release() {
    for (auto& p : plans) p.release();
    plans.clear();
    for (auto& p : tuned_plans) p.release();
    tuned_plans.clear();
    if (lt) (void)cublasLtDestroy(lt);
    if (handle) (void)cublasDestroy(handle);
    if (workspace) (void)hipFree(workspace);
    if (enter) (void)hipEventDestroy(enter);
    if (leave) (void)hipEventDestroy(leave);
    if (owns_home && home) (void)hipStreamDestroy(home);
  }
};

Blas::Blas(hipStream_t home, GemmTuning tuning) : impl_(std::make_unique<Impl>()) {
  Impl& i = *impl_;
  i.tuning = tuning;
  try {
    CARAVAN_HIP_CHECK(hipGetDevice(&i.device));
    if (home) {
      i.home = home;
    } else {
      CARAVAN_HIP_CHECK(hipStreamCreateWithFlags(&i.home, hipStreamNonBlocking));
      i.owns_home = true;
    }
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&i.enter, hipEventDisableTiming));
    CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&i.leave, hipEventDisableTiming));
    check(cublasCreate(&i.handle), "cublasCreate");
    check(cublasLtCreate(&i.lt), "cublasLtCreate");  // gemm_add's, on this device like the other
    // A workspace of its own (per handle, so two lanes never share one) lets cuBLAS pick its
    // fastest kernels.
    CARAVAN_HIP_CHECK(hipMalloc(&i.workspace, kWorkspace));
    check(cublasSetStream(i.handle, i.home), "cublasSetStream");
    check(cublasSetWorkspace(i.handle, i.workspace, kWorkspace), "cublasSetWorkspace");
  } catch (...) {
    i.release();
    throw;
  }
}

Blas::~Blas() { impl_->release(); }

const LtPlan* Blas::Impl::tuned_plan(const GemmKey& key, const void* a, const void* b, const void* c, const void* d) {
  // Nothing tuned in the process (the default): one atomic load on the call's path, no more.
  if (tuning == GemmTuning::off || g_tuned_count.load(std::memory_order_acquire) == 0) return nullptr;
  for (const void* p : {a, b, c, d})
    if (alignment_of(p) < kTunedAlignment) return nullptr;
  for (const LtPlan& p : tuned_plans)
    if (p.kind == key.kind && p.same_gemm(key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.ldd)) return &p;
  const std::optional<TunedChoice> choice = find_tuned(key);
  if (!choice) return nullptr;
  LtPlan p = LtPlan::tuned_for(key);
  p.vendor_default = choice->vendor_default;
  p.algo = choice->algo;
  try {
    if (!p.vendor_default) p.describe();
    tuned_plans.push_back(p);
  } catch (...) {
    p.release();
    throw;
  }
  return &tuned_plans.back();
}

namespace {
GemmKey key_of(int device, long m, long n, long k, long lda, long ldb, long ldc, float beta, bool add_elsewhere) {
  // Row-major D = A B (+ C) is column-major D^T = B^T A^T (+ C^T): operands swapped, m and n too.
  return GemmKey{
      device, add_elsewhere ? GemmKind::add_elsewhere : beta != 0.0f ? GemmKind::accumulate : GemmKind::overwrite,
      n,      m,
      k,      ldb,
      lda,    ldc,
      ldc};
}
}  // namespace

int Blas::tune(long m, long n, long k, long lda, long ldb, long ldc, float beta, bool add_elsewhere,
               TuneOptions options) {
  Impl& i = *impl_;
  if (m < 1 || n < 1 || k < 1 || lda < k || ldb < n || ldc < n)
    throw Error(Errc::invalid_argument,
                fmt::format("Blas::tune: m = {}, n = {}, k = {} must be at least 1, and lda = {} >= k, ldb = {} >= n, "
                            "ldc = {} >= n",
                            m, n, k, lda, ldb, ldc));
  if (beta != 0.0f && beta != 1.0f)
    throw Error(Errc::invalid_argument, fmt::format("Blas::tune: beta = {} must be 0 or 1", beta));
  if (options.candidates != TuneOptions::kFromSetting && (options.candidates < 0 || options.candidates > 64))
    throw Error(
        Errc::invalid_argument,
        fmt::format("Blas::tune: options.candidates = {} must be 0 to 64, or kFromSetting", options.candidates));
  if (options.pick < -1 || options.pick > 63)
    throw Error(Errc::invalid_argument, fmt::format("Blas::tune: options.pick = {} must be -1 to 63", options.pick));
  const int count = options.candidates == TuneOptions::kFromSetting
                        ? static_cast<int>(settings::get_int("CARAVAN_GPU_GEMM_TUNE"))
                        : options.candidates;
  if (i.tuning == GemmTuning::off || count == 0) return 0;
  const GemmKey key = key_of(i.device, m, n, k, lda, ldb, ldc, beta, add_elsewhere);

  // One tuning at a time per device: two at once would time each other's kernels, and a second
  // call for the same shape finds the first one's choice when it is let in.
  {
    std::unique_lock lock(g_tuned_mutex);
    g_tuned_changed.wait(lock, [&] {
      return std::find(g_devices_tuning.begin(), g_devices_tuning.end(), i.device) == g_devices_tuning.end();
    });
    if (std::any_of(g_tuned.begin(), g_tuned.end(), [&](const TunedChoice& t) { return t.key == key; })) return 0;
    g_devices_tuning.push_back(i.device);
  }
  struct Release {
    int device;
    ~Release() {
      {
        std::lock_guard lock(g_tuned_mutex);
        std::erase(g_devices_tuning, device);
      }
      g_tuned_changed.notify_all();
    }
  } release_device{i.device};
  DeviceScope on_device(i.device);

  // Random operands (on zeros the tensor cores draw less power and clock higher, which would
  // time another GEMM than the layer's), in 256-byte aligned buffers of its own.
  const auto elements = [](long rows, long ld) {
    return static_cast<std::size_t>(rows) * static_cast<std::size_t>(ld);
  };
  DeviceScratch a(elements(m, lda) * sizeof(bf16)), b(elements(k, ldb) * sizeof(bf16)),
      c(elements(m, ldc) * sizeof(bf16)), d(add_elsewhere ? elements(m, ldc) * sizeof(bf16) : 0);
  fill_random(a.bf(), m, k, lda, 0x7e57a, 0, 0, 1.0f, i.home);
  fill_random(b.bf(), k, n, ldb, 0x7e57b, 0, 0, 1.0f, i.home);
  fill_random(c.bf(), m, n, ldc, 0x7e57c, 0, 0, 1.0f, i.home);
  bf16* out = add_elsewhere ? d.bf() : c.bf();

  LtPlan p = LtPlan::tuned_for(key);
  hipEvent_t start = nullptr, stop = nullptr;
  const auto release = [&] {
    p.release();
    if (start) (void)hipEventDestroy(start);
    if (stop) (void)hipEventDestroy(stop);
  };
  // A choice: cuBLAS's default (cublasGemmEx) or a cuBLASLt algorithm. The first is the untuned
  // one: cublasGemmEx for gemm(); for gemm_add() the heuristic's first, which plan() runs untuned
  // (timed as the baseline even if it splits K, since it runs anyway without tuning).
  struct Choice {
    bool vendor_default;
    cublasLtMatmulAlgo_t algo;
  };
  std::vector<Choice> choices;
  std::size_t chosen = 0;
  try {
    p.describe();
    const std::vector<cublasLtMatmulHeuristicResult_t> found = p.candidates(i.lt, std::max(count, 1));
    if (add_elsewhere)
      choices.push_back({false, found.front().algo});
    else
      choices.push_back({true, {}});
    // Only algorithms whose blocks never wait for one another: one K split, no reduction between
    // blocks. Why: a thirty-first-session experiment with tuned algorithms hung once beside
    // kernels that hold SMs while they spin on a peer's flag (cause unconfirmed; docs/overlap.md).
    for (std::size_t j = add_elsewhere ? 1 : 0; j < found.size() && static_cast<int>(j) < count; ++j) {
      std::int32_t split_k = 1;
      std::uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
      std::size_t written = 0;
      check(cublasLtMatmulAlgoConfigGetAttribute(&found[j].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k,
                                                 sizeof split_k, &written),
            "cublasLtMatmulAlgoConfigGetAttribute(split-k)");
      check(cublasLtMatmulAlgoConfigGetAttribute(&found[j].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                                 sizeof reduction, &written),
            "cublasLtMatmulAlgoConfigGetAttribute(reduction)");
      if (split_k == 1 && reduction == CUBLASLT_REDUCTION_SCHEME_NONE) choices.push_back({false, found[j].algo});
    }
    const float alpha = 1.0f;
    const auto run = [&](const Choice& choice) {
      if (choice.vendor_default)
        check(cublasGemmEx(i.handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), &alpha, b.p, CUDA_R_16BF, static_cast<int>(ldb), a.p, CUDA_R_16BF,
                           static_cast<int>(lda), &beta, c.p, CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx(bf16, tuning)");
      else
        check(cublasLtMatmul(i.lt, p.op, &alpha, b.p, p.layout[0], a.p, p.layout[1], &beta, c.p, p.layout[2], out,
                             p.layout[3], &choice.algo, i.workspace, kWorkspace, i.home),
              "cublasLtMatmul(bf16, tuning)");
    };
    // Each choice once: loads its kernel (no first launch may happen inside an operation) and
    // warms the clocks.
    for (const Choice& choice : choices) run(choice);
    if (options.pick >= 0) {
      if (static_cast<std::size_t>(options.pick) + 1 >= choices.size())
        throw Error(Errc::invalid_argument,
                    fmt::format("Blas::tune: options.pick = {}, but only {} candidates passed the filter for {} x {} x "
                                "{}",
                                options.pick, choices.size() - 1, m, n, k));
      chosen = static_cast<std::size_t>(options.pick) + 1;
    } else if (choices.size() > 1) {
      // Rounds in which the choices alternate, so that the GPU's clock and power drift hit them
      // alike; each sample is two calls queued behind an untimed one, so that the host's time
      // to launch (cublasGemmEx picks its kernel then) is not timed. Each choice's median.
      CARAVAN_HIP_CHECK(hipEventCreate(&start));
      CARAVAN_HIP_CHECK(hipEventCreate(&stop));
      constexpr int kRounds = 5;
      std::vector<std::vector<float>> times(choices.size());
      for (int round = 0; round < kRounds; ++round)
        for (std::size_t j = 0; j < choices.size(); ++j) {
          run(choices[j]);
          CARAVAN_HIP_CHECK(hipEventRecord(start, i.home));
          run(choices[j]);
          run(choices[j]);
          CARAVAN_HIP_CHECK(hipEventRecord(stop, i.home));
          CARAVAN_HIP_CHECK(hipEventSynchronize(stop));
          float ms = 0;
          CARAVAN_HIP_CHECK(hipEventElapsedTime(&ms, start, stop));
          times[j].push_back(ms);
        }
      std::vector<float> median(times.size());
      for (std::size_t j = 0; j < times.size(); ++j) {
        std::nth_element(times[j].begin(), times[j].begin() + kRounds / 2, times[j].end());
        median[j] = times[j][kRounds / 2];
      }
      // The untuned choice keeps the shape unless another runs at least 1% faster: closer than
      // that is noise in five rounds, and switching for it would only make runs differ.
      for (std::size_t j = 1; j < median.size(); ++j)
        if (median[j] < median[chosen] && median[j] < 0.99f * median[0]) chosen = j;
    }
    CARAVAN_HIP_CHECK(hipStreamSynchronize(i.home));
  } catch (...) {
    release();
    throw;
  }
  release();
  std::lock_guard lock(g_tuned_mutex);
  g_tuned.push_back({key, choices[chosen].vendor_default, choices[chosen].algo});
  g_tuned_count.store(g_tuned.size(), std::memory_order_release);
  return static_cast<int>(choices.size());
}

GemmChoice Blas::choice(long m, long n, long k, long lda, long ldb, long ldc, float beta, bool add_elsewhere) const {
  if (impl_->tuning == GemmTuning::off) return GemmChoice::untuned;
  const std::optional<TunedChoice> t = find_tuned(key_of(impl_->device, m, n, k, lda, ldb, ldc, beta, add_elsewhere));
  if (!t) return GemmChoice::untuned;
  return t->vendor_default ? GemmChoice::vendor_default : GemmChoice::algorithm;
}

// Row-major C = A B is column-major C^T = B^T A^T: swap the operands and the m/n roles.
void Blas::gemm(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb, bf16* c,
                long ldc, float beta) {
  const float alpha = 1.0f;
  impl_->on(stream, [&] {
    const LtPlan* tuned = impl_->tuned_plan(key_of(impl_->device, m, n, k, lda, ldb, ldc, beta, false), a, b, c, c);
    if (tuned && !tuned->vendor_default) {
      check(cublasLtMatmul(impl_->lt, tuned->op, &alpha, b, tuned->layout[0], a, tuned->layout[1], &beta, c,
                           tuned->layout[2], c, tuned->layout[3], &tuned->algo, impl_->workspace, kWorkspace,
                           impl_->home),
            "cublasLtMatmul(bf16, tuned)");
      return;
    }
    check(cublasGemmEx(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                       static_cast<int>(k), &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF,
                       static_cast<int>(lda), &beta, c, CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx(bf16)");
  });
}

const LtPlan& Blas::Impl::plan(long m, long n, long k, const void* a, long lda, const void* b, long ldb, const void* c,
                               long ldc, const void* d, long ldd) {
  const std::uint32_t align[4] = {alignment_of(a), alignment_of(b), alignment_of(c), alignment_of(d)};
  // The plan made for exactly these alignments, else one made for looser ones (valid here too):
  // no new plan, and no kernel's first launch, inside an operation whose warm-up planned the
  // shape at the loosest alignment its pointers can have (see overlap.cpp's warm_up).
  const LtPlan* looser = nullptr;
  for (const auto& p : plans) {
    if (!p.same_gemm(m, n, k, lda, ldb, ldc, ldd) || !p.serves(align)) continue;
    if (p.exactly(align)) return p;
    if (!looser) looser = &p;
  }
  if (looser) return *looser;
  LtPlan p;
  p.m = m, p.n = n, p.k = k, p.lda = lda, p.ldb = ldb, p.ldc = ldc, p.ldd = ldd;
  for (int i = 0; i < 4; ++i) p.align[i] = align[i];
  try {
    p.describe();
    p.algo = p.candidates(lt, 1).front().algo;
    plans.push_back(p);
  } catch (...) {
    p.release();
    throw;
  }
  return plans.back();
}

// Row-major D = A B + C is column-major D^T = B^T A^T + C^T, as in gemm().
void Blas::gemm_add(hipStream_t stream, long m, long n, long k, const bf16* a, long lda, const bf16* b, long ldb,
                    const bf16* c, long ldc, bf16* d, long ldd) {
  const float alpha = 1.0f, beta = 1.0f;
  impl_->on(stream, [&] {
    const GemmKey key{impl_->device, GemmKind::add_elsewhere, n, m, k, ldb, lda, ldc, ldd};
    const LtPlan* tuned = impl_->tuned_plan(key, b, a, c, d);
    const LtPlan& p = tuned ? *tuned : impl_->plan(n, m, k, b, ldb, a, lda, c, ldc, d, ldd);
    check(cublasLtMatmul(impl_->lt, p.op, &alpha, b, p.layout[0], a, p.layout[1], &beta, c, p.layout[2], d, p.layout[3],
                         &p.algo, impl_->workspace, kWorkspace, impl_->home),
          "cublasLtMatmul(bf16, C != D)");
  });
}

void Blas::gemm_batched(hipStream_t stream, long m, long n, long k, float alpha, const bf16* a, long lda, long stride_a,
                        const bf16* b, long ldb, long stride_b, bool transpose_b, void* c, bool c_float, long ldc,
                        long stride_c, int batch) {
  const float beta = 0.0f;
  impl_->on(stream, [&] {
    check(cublasGemmStridedBatchedEx(impl_->handle, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N,
                                     static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, CUDA_R_16BF,
                                     static_cast<int>(ldb), stride_b, a, CUDA_R_16BF, static_cast<int>(lda), stride_a, &beta, c,
                                     c_float ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), stride_c, batch,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx(bf16)");
  });
}

void Blas::gemm_reference(hipStream_t stream, long m, long n, long k, const float* a, long lda, const float* b, long ldb,
                          float* c, long ldc) {
  const float alpha = 1.0f, beta = 0.0f;
  impl_->on(stream, [&] {
    check(cublasSetMathMode(impl_->handle, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode(pedantic)");
    cublasStatus_t status = cublasSgemm(impl_->handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                                        static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a, static_cast<int>(lda),
                                        &beta, c, static_cast<int>(ldc));
    check(cublasSetMathMode(impl_->handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode(default)");
    check(status, "cublasSgemm(reference)");
  });
}

}  // namespace caravan::gpu
