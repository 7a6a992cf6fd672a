#include "channels/memcpy_channel.h"

#include "runtime/dma/engine.h"
#include "runtime/dma/interleave.h"

#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace caravan::dma {
namespace {

// Copies a large run with non-temporal (streaming) stores. glibc's memcpy streams only past a
// size threshold of several MiB (a fraction of the last-level cache), which one request of a
// pipelined copy never reaches; below it, every destination line is first read for ownership,
// costing about a third of the bandwidth of a large copy (measured here: 4.2-5.0 GB/s with
// 256 KiB memcpys against 5.1-6.5 GB/s streamed). The data is not wanted in this core's cache:
// the next hop or the application reads it later, usually from another core.
//
// The run is copied kInterleavedPages 4 KiB pages at a time, one cache line of each page in
// turn, with the same lines of the next group prefetched: like glibc's own large copies, this
// keeps several DRAM pages streaming at once. A plain front-to-back streaming loop reached
// 9.0-9.4 GB/s on the build machine (any vector width) against 10.6-11.0 for one glibc memcpy
// of the same 256 MiB; interleaving 8 pages reached 11.7-12.3 (docs/dma.md).
constexpr std::size_t kPage = 4096;
constexpr std::size_t kInterleavedPages = 8;
constexpr std::size_t kLine = 64;

#if defined(__x86_64__)
struct SseLine {
  static void copy(std::byte* dst, const std::byte* src) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
};
struct Avx2Line {
  [[gnu::target("avx2")]] static void copy(std::byte* dst, const std::byte* src) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
  }
};
struct Avx512Line {
  [[gnu::target("avx512f")]] static void copy(std::byte* dst, const std::byte* src) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(src));
  }
};

// `dst` is 64-byte aligned. Line::copy is inlined into the target-specific callers below
// (gnu::flatten), which is where its vector instructions are allowed. `Interleave`: a line of
// each of kInterleavedPages pages in turn, else front to back.
template <class Line, bool Interleave>
void stream_lines(std::byte* dst, const std::byte* src, std::size_t n) {
  constexpr std::size_t group = kInterleavedPages * kPage;
  for (; Interleave && n >= group; n -= group, src += group, dst += group) {
    for (std::size_t line = 0; line < kPage; line += kLine) {
      for (std::size_t page = 0; page < kInterleavedPages; ++page) {
        const std::byte* s = src + page * kPage + line;
        if (n >= 2 * group) _mm_prefetch(reinterpret_cast<const char*>(s + group), _MM_HINT_T0);  // next group, if any
        Line::copy(dst + page * kPage + line, s);
      }
    }
  }
  for (; n >= kLine; n -= kLine, src += kLine, dst += kLine) Line::copy(dst, src);
  std::memcpy(dst, src, n);
  // Streaming stores are weakly ordered: fence before the completion makes the bytes visible.
  _mm_sfence();
}

[[gnu::flatten]] void stream_lines_sse(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<SseLine, true>(dst, src, n);
}
[[gnu::flatten]] void stream_lines_sse_linear(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<SseLine, false>(dst, src, n);
}
[[gnu::target("avx2"), gnu::flatten]] void stream_lines_avx2(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<Avx2Line, true>(dst, src, n);
}
[[gnu::target("avx2"), gnu::flatten]] void stream_lines_avx2_linear(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<Avx2Line, false>(dst, src, n);
}
[[gnu::target("avx512f"), gnu::flatten]] void stream_lines_avx512(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<Avx512Line, true>(dst, src, n);
}
[[gnu::target("avx512f"), gnu::flatten]] void stream_lines_avx512_linear(std::byte* dst, const std::byte* src,
                                                                         std::size_t n) {
  stream_lines<Avx512Line, false>(dst, src, n);
}

using LinesFn = void (*)(std::byte*, const std::byte*, std::size_t);

// The stores of one ISA, both orders; null where this CPU lacks the ISA.
struct StreamIsa {
  const char* name;
  LinesFn interleaved, linear;
};
StreamIsa stream_isa(std::string_view isa) {
  __builtin_cpu_init();
  if (isa == "avx512" && __builtin_cpu_supports("avx512f")) return {"avx512", stream_lines_avx512, stream_lines_avx512_linear};
  if (isa == "avx2" && __builtin_cpu_supports("avx2")) return {"avx2", stream_lines_avx2, stream_lines_avx2_linear};
  if (isa == "sse2") return {"sse2", stream_lines_sse, stream_lines_sse_linear};
  return {nullptr, nullptr, nullptr};
}

struct StreamVariant {
  LinesFn copy;  // null: plain memcpy measured fastest
  std::string name;
};

void stream_copy(std::byte* dst, const std::byte* src, std::size_t n, LinesFn lines);

// How long runs are copied, chosen once per process by timing each way on 4 MiB runs (a
// request's size), each from and to its own part of two 36 MiB buffers (out of the cache, as a
// request's bytes mostly are), three rounds, the best of each: the widest streaming stores this
// CPU has, interleaving pages or front to back, or plain memcpy. No order wins everywhere:
// on the Intel Xeon build machine of earlier sessions 8 interleaved pages reached 11.7-12.3 GB/s,
// front to back 9.0-9.4 and memcpy 10.6-11.0 (256 MiB, docs/dma.md); on the AMD EPYC build
// machine of the twenty-sixth session interleaved pages ran at 2.1-2.5 GB/s, front to back at
// 4.5-9.6, memcpy at 3.4-4.5 (256 MiB in 4 MiB runs). It costs about 80 ms there (mostly the
// buffers' first touch), once, the first time a run of CARAVAN_MEMCPY_STREAM_BYTES or more is
// copied.
const StreamVariant& stream_variant() {
  static const StreamVariant variant = [] {
    StreamIsa isa = stream_isa("avx512");
    if (!isa.name) isa = stream_isa("avx2");
    if (!isa.name) isa = stream_isa("sse2");
    constexpr std::size_t kBytes = std::size_t{4} << 20, kParts = 9;
    std::vector<std::byte> from(kParts * kBytes, std::byte{1}), to(kParts * kBytes + kLine, std::byte{2});
    std::byte* dst = to.data() + (kLine - (reinterpret_cast<std::uintptr_t>(to.data()) & (kLine - 1))) % kLine;
    const LinesFn ways[] = {isa.interleaved, isa.linear, nullptr};
    double best[3] = {1e30, 1e30, 1e30};
    for (std::size_t round = 0; round < 3; ++round)
      for (std::size_t w = 0; w < 3; ++w) {
        const std::size_t part = (round * 3 + w) * kBytes;
        const auto start = std::chrono::steady_clock::now();
        if (ways[w]) stream_copy(dst + part, from.data() + part, kBytes, ways[w]);
        else std::memcpy(dst + part, from.data() + part, kBytes);
        best[w] = std::min(best[w], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    const int pick = static_cast<int>(std::min_element(best, best + 3) - best);
    const char* how[] = {"streaming stores, 8 pages interleaved", "streaming stores, front to back", "plain memcpy"};
    auto gbps = [&](int w) { return static_cast<double>(kBytes) / best[w] / 1e9; };
    return StreamVariant{ways[pick], fmt::format("{}{} (measured on 4 MiB runs: {} GB/s interleaved, {} front to back, "
                                                 "{} memcpy)",
                                                 pick < 2 ? std::string(isa.name) + " " : "", how[pick],
                                                 fmt::format("{:.1f}", gbps(0)), fmt::format("{:.1f}", gbps(1)),
                                                 fmt::format("{:.1f}", gbps(2)))};
  }();
  return variant;
}

void stream_copy(std::byte* dst, const std::byte* src, std::size_t n, LinesFn lines) {
  std::size_t head = (kLine - (reinterpret_cast<std::uintptr_t>(dst) & (kLine - 1))) & (kLine - 1);
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  lines(dst + head, src + head, n - head);
}
#endif

void stream_copy(std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__x86_64__)
  if (const LinesFn lines = stream_variant().copy) stream_copy(dst, src, n, lines);
  else std::memcpy(dst, src, n);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

const char* stream_copy_method() {
#if defined(__x86_64__)
  return stream_variant().name.c_str();
#else
  return "plain memcpy (no streaming stores on this architecture)";
#endif
}

bool stream_copy_using(std::string_view isa, bool interleave, std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__x86_64__)
  const StreamIsa found = stream_isa(isa);
  if (!found.name) return false;
  stream_copy(dst, src, n, interleave ? found.interleaved : found.linear);
  return true;
#else
  (void)isa, (void)interleave, (void)dst, (void)src, (void)n;
  return false;
#endif
}

namespace {

std::byte* moved(std::byte* base, std::uint64_t offset, std::int64_t by) {
  return base + static_cast<std::ptrdiff_t>(static_cast<std::int64_t>(offset) + by);
}
const std::byte* moved(const std::byte* base, std::uint64_t offset, std::int64_t by) {
  return base + static_cast<std::ptrdiff_t>(static_cast<std::int64_t>(offset) + by);
}

template <class T>
void strided(const std::byte* s, std::byte* d, std::uint64_t count, std::int64_t src_stride, std::int64_t dst_stride) {
  for (std::uint64_t i = 0; i < count; ++i) {
    T value;
    std::memcpy(&value, s, sizeof(T));
    std::memcpy(d, &value, sizeof(T));
    s += src_stride;
    d += dst_stride;
  }
}

struct Bytes16 {
  std::byte b[16];
};

using StridedLoop = void (*)(const std::byte*, std::byte*, std::uint64_t, std::int64_t, std::int64_t);

// Element sizes with a typed loop; others copy element by element with memcpy.
StridedLoop strided_loop(std::uint64_t elem) {
  switch (elem) {
    case 1: return strided<std::uint8_t>;
    case 2: return strided<std::uint16_t>;
    case 4: return strided<std::uint32_t>;
    case 8: return strided<std::uint64_t>;
    case 16: return strided<Bytes16>;
    default: return nullptr;
  }
}

void strided_op(const std::byte* s, std::byte* d, const TransferOp& op, StridedLoop loop, std::uint64_t count) {
  if (loop) {
    loop(s, d, count, op.src_stride, op.dst_stride);
    return;
  }
  for (std::uint64_t i = 0; i < count; ++i, s += op.src_stride, d += op.dst_stride) std::memcpy(d, s, op.elem);
}

// A group of M members (interleave.h: a layout conversion's fields) of T-sized elements, M known
// at compile time: each element of every member before the next element, as a loop written for
// one conversion does, so that the interleaved side is read (or written) once instead of once
// per member. Field by field, a 48 MiB AOS -> SOA conversion of three 4-byte fields read its
// source three times: 1.7-2.1 GB/s against 3.4-5.1 in blocks of 256 elements per member and
// 7.4-9.1 element by element with M fixed, where the loop a user writes for it ran at 6.2-9.3
// (the build machine, standalone loops).
template <class T, int M>
void copy_group_fixed(const TransferOp& lead, const OpGroup& g, const std::byte* src, std::byte* dst) {
  for (std::size_t r = 0; r < g.rows; ++r) {
    const auto row = static_cast<std::int64_t>(r);
    const std::byte* s = moved(src, lead.src, row * g.row_src);
    std::byte* d = moved(dst, lead.dst, row * g.row_dst);
    for (std::uint64_t i = 0; i < lead.count; ++i, s += lead.src_stride, d += lead.dst_stride) {
      T value[M];
      for (int m = 0; m < M; ++m) std::memcpy(&value[m], s + m * g.member_src, sizeof(T));
      for (int m = 0; m < M; ++m) std::memcpy(d + m * g.member_dst, &value[m], sizeof(T));
    }
  }
}

template <class T>
bool copy_group_typed(const TransferOp& lead, const OpGroup& g, const std::byte* src, std::byte* dst) {
  switch (g.members) {
    case 2: copy_group_fixed<T, 2>(lead, g, src, dst); return true;
    case 3: copy_group_fixed<T, 3>(lead, g, src, dst); return true;
    case 4: copy_group_fixed<T, 4>(lead, g, src, dst); return true;
    case 5: copy_group_fixed<T, 5>(lead, g, src, dst); return true;
    case 6: copy_group_fixed<T, 6>(lead, g, src, dst); return true;
    case 7: copy_group_fixed<T, 7>(lead, g, src, dst); return true;
    case 8: copy_group_fixed<T, 8>(lead, g, src, dst); return true;
    default: return false;
  }
}

// Any other group (more members, or elements of another size): in blocks of elements, each
// block of every member before the next block, so that the interleaved side's lines are still in
// the cache for the members after the first.
void copy_group(const TransferOp& lead, const OpGroup& g, const std::byte* src, std::byte* dst) {
  switch (lead.elem) {
    case 1: if (copy_group_typed<std::uint8_t>(lead, g, src, dst)) return; break;
    case 2: if (copy_group_typed<std::uint16_t>(lead, g, src, dst)) return; break;
    case 4: if (copy_group_typed<std::uint32_t>(lead, g, src, dst)) return; break;
    case 8: if (copy_group_typed<std::uint64_t>(lead, g, src, dst)) return; break;
    case 16: if (copy_group_typed<Bytes16>(lead, g, src, dst)) return; break;
    default: break;
  }
  constexpr std::uint64_t kBlock = 256;  // elements: 3 KiB of 12-byte records, well within L1
  const StridedLoop loop = strided_loop(lead.elem);
  for (std::size_t r = 0; r < g.rows; ++r) {
    const auto row = static_cast<std::int64_t>(r);
    for (std::uint64_t first = 0; first < lead.count; first += kBlock) {
      const std::uint64_t n = std::min(kBlock, lead.count - first);
      const auto at = static_cast<std::int64_t>(first);
      for (std::size_t m = 0; m < g.members; ++m) {
        const auto member = static_cast<std::int64_t>(m);
        strided_op(moved(src, lead.src, member * g.member_src + row * g.row_src + at * lead.src_stride),
                   moved(dst, lead.dst, member * g.member_dst + row * g.row_dst + at * lead.dst_stride), lead, loop, n);
      }
    }
  }
}

void copy_op(const TransferOp& op, const std::byte* src, std::byte* dst, std::uint64_t stream_bytes) {
  if (op.rows > 1) {
    for (std::uint64_t r = 0; r < op.rows; ++r) copy_op(op.row(r), src, dst, stream_bytes);
    return;
  }
  if (op.count == 1) {
    if (stream_bytes && op.elem >= stream_bytes) stream_copy(dst + op.dst, src + op.src, op.elem);
    else std::memcpy(dst + op.dst, src + op.src, op.elem);
    return;
  }
  strided_op(src + op.src, dst + op.dst, op, strided_loop(op.elem), op.count);
}

}  // namespace

void copy_host_ops(std::span<const TransferOp> ops, const std::byte* src, std::byte* dst, std::uint64_t stream_bytes) {
  for (std::size_t i = 0; i < ops.size();) {
    const TransferOp& op = ops[i];
    if (op.count < 2) {  // runs and single elements form no group of several members
      copy_op(op, src, dst, stream_bytes);
      ++i;
      continue;
    }
    const OpGroup g = op_group_at(ops.data(), ops.size(), i);
    if (g.members > 1) {
      copy_group(op, g, src, dst);
    } else {
      for (std::size_t k = 0; k < g.size(); ++k) copy_op(ops[i + k], src, dst, stream_bytes);
    }
    i += g.size();
  }
}

}  // namespace caravan::dma

namespace caravan::channels {

MemcpyChannel::MemcpyChannel(int threads, std::uint64_t split_bytes, std::uint64_t inline_bytes)
    : split_bytes_(split_bytes),
      // Below the split size submit() uses no state of the channel's, so any thread may run it.
      inline_bytes_(threads > 1 ? std::min(inline_bytes, split_bytes - 1) : inline_bytes),
      stream_bytes_(settings::get_bytes("CARAVAN_MEMCPY_STREAM_BYTES")) {
  for (int i = 1; i < threads; ++i) {
    slices_.emplace_back();
    helpers_.emplace_back([this, i] { helper_main(static_cast<std::size_t>(i - 1)); });
  }
}

MemcpyChannel::~MemcpyChannel() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

bool MemcpyChannel::serves(MemoryId src, MemoryId dst) const noexcept {
  return is_host(src.kind) && is_host(dst.kind) && src.node == dst.node;
}

void MemcpyChannel::submit(const dma::Request& request, Completion done) {
  if (!request.src->host() || !request.dst->host()) {
    done(make_failure(Errc::internal, "memcpy channel given a request on non-host storage"));
    return;
  }
  if (!helpers_.empty() && request.bytes >= split_bytes_) run_split(request);
  else dma::copy_host_ops(request.ops, request.src->host(), request.dst->host(), stream_bytes_);
  // The tile has landed (its earlier requests ran before this one; split shares joined above,
  // streamed runs fenced): publish it. The engine checked the flag is 8-byte aligned host memory.
  if (request.signal_flag)
    std::atomic_ref<std::uint64_t>(*request.signal_flag).store(request.signal_value, std::memory_order_release);
  done(nullptr);
}

// Splits the request's ops into helpers_.size() + 1 byte-balanced shares; this thread takes the
// last share. The shares are cut as the engine cuts requests (dma::cut_requests): a group is cut
// by row or element range with its members side by side, so that each thread reads its part of
// a conversion's interleaved side once.
void MemcpyChannel::run_split(const dma::Request& request) {
  const std::size_t shares = helpers_.size() + 1;
  const std::uint64_t per_share = (request.bytes + shares - 1) / shares;
  std::vector<dma::TransferOp> ops(request.ops.begin(), request.ops.end());
  std::vector<std::size_t> ends = dma::cut_requests(ops, per_share);
  if (ends.empty()) ends.push_back(ops.size());
  // The pieces in order; each goes to the share its first byte falls in, so that a share ends up
  // a run of whole pieces (cut_requests fills pieces up to per_share, but not always to it).
  std::vector<std::size_t> share_end(shares, 0);
  std::uint64_t done = 0;
  std::size_t begin = 0;
  for (std::size_t end : ends) {
    const std::size_t share = std::min<std::size_t>(static_cast<std::size_t>(done / per_share), shares - 1);
    for (std::size_t k = begin; k < end; ++k) done += ops[k].bytes();
    share_end[share] = end;
    begin = end;
  }
  for (std::size_t k = 1; k < shares; ++k) share_end[k] = std::max(share_end[k], share_end[k - 1]);
  auto share_ops = [&](std::size_t k) {
    const std::size_t from = k == 0 ? 0 : share_end[k - 1];
    return std::span<const dma::TransferOp>(ops.data() + from, share_end[k] - from);
  };
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i + 1 < shares; ++i) slices_[i] = share_ops(i);
    src_ = request.src->host();
    dst_ = request.dst->host();
    pending_ = helpers_.size();
    ++generation_;
  }
  cv_.notify_all();
  dma::copy_host_ops(share_ops(shares - 1), request.src->host(), request.dst->host(), stream_bytes_);
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return pending_ == 0; });
}

void MemcpyChannel::helper_main(std::size_t index) {
  std::uint64_t seen = 0;
  for (;;) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    const std::span<const dma::TransferOp> ops = slices_[index];  // run_split waits for it
    const std::byte* src = src_;
    std::byte* dst = dst_;
    lock.unlock();
    dma::copy_host_ops(ops, src, dst, stream_bytes_);
    lock.lock();
    if (--pending_ == 0) cv_.notify_all();
  }
}

}  // namespace caravan::channels
