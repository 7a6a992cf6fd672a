#include "channels/memcpy_channel.h"

#include <caravan/settings.h>

#include <atomic>
#include <cstdint>
#include <cstring>

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
// (gnu::flatten), which is where its vector instructions are allowed.
template <class Line>
void stream_lines(std::byte* dst, const std::byte* src, std::size_t n) {
  constexpr std::size_t group = kInterleavedPages * kPage;
  for (; n >= group; n -= group, src += group, dst += group) {
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
  stream_lines<SseLine>(dst, src, n);
}
[[gnu::target("avx2"), gnu::flatten]] void stream_lines_avx2(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<Avx2Line>(dst, src, n);
}
[[gnu::target("avx512f"), gnu::flatten]] void stream_lines_avx512(std::byte* dst, const std::byte* src, std::size_t n) {
  stream_lines<Avx512Line>(dst, src, n);
}

struct StreamVariant {
  void (*copy)(std::byte*, const std::byte*, std::size_t);
  const char* name;
};

// The widest stores this CPU has, chosen once. Wider ones measured a few percent faster here
// (AVX-512 12.3 GB/s, AVX2 12.0, SSE2 11.7 with 8 interleaved pages).
const StreamVariant& stream_variant() {
  static const StreamVariant variant = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return StreamVariant{stream_lines_avx512, "avx512"};
    if (__builtin_cpu_supports("avx2")) return StreamVariant{stream_lines_avx2, "avx2"};
    return StreamVariant{stream_lines_sse, "sse2"};
  }();
  return variant;
}

void stream_copy(std::byte* dst, const std::byte* src, std::size_t n,
                 void (*lines)(std::byte*, const std::byte*, std::size_t)) {
  std::size_t head = (kLine - (reinterpret_cast<std::uintptr_t>(dst) & (kLine - 1))) & (kLine - 1);
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  lines(dst + head, src + head, n - head);
}
#endif

void stream_copy(std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__x86_64__)
  stream_copy(dst, src, n, stream_variant().copy);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

const char* stream_copy_isa() {
#if defined(__x86_64__)
  return stream_variant().name;
#else
  return "none (memcpy)";
#endif
}

bool stream_copy_using(std::string_view isa, std::byte* dst, const std::byte* src, std::size_t n) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == "avx512" && __builtin_cpu_supports("avx512f")) stream_copy(dst, src, n, stream_lines_avx512);
  else if (isa == "avx2" && __builtin_cpu_supports("avx2")) stream_copy(dst, src, n, stream_lines_avx2);
  else if (isa == "sse2") stream_copy(dst, src, n, stream_lines_sse);
  else return false;
  return true;
#else
  (void)isa, (void)dst, (void)src, (void)n;
  return false;
#endif
}

namespace {

template <class T>
void strided(const TransferOp& op, const std::byte* src, std::byte* dst) {
  const std::byte* s = src + op.src;
  std::byte* d = dst + op.dst;
  for (std::uint64_t i = 0; i < op.count; ++i) {
    T value;
    std::memcpy(&value, s, sizeof(T));
    std::memcpy(d, &value, sizeof(T));
    s += op.src_stride;
    d += op.dst_stride;
  }
}

struct Bytes16 {
  std::byte b[16];
};

}  // namespace

void copy_host_ops(std::span<const TransferOp> ops, const std::byte* src, std::byte* dst, std::uint64_t stream_bytes) {
  for (const TransferOp& op : ops) {
    if (op.count == 1) {
      if (stream_bytes && op.elem >= stream_bytes) stream_copy(dst + op.dst, src + op.src, op.elem);
      else std::memcpy(dst + op.dst, src + op.src, op.elem);
      continue;
    }
    switch (op.elem) {
      case 1: strided<std::uint8_t>(op, src, dst); break;
      case 2: strided<std::uint16_t>(op, src, dst); break;
      case 4: strided<std::uint32_t>(op, src, dst); break;
      case 8: strided<std::uint64_t>(op, src, dst); break;
      case 16: strided<Bytes16>(op, src, dst); break;
      default:
        for (std::uint64_t i = 0; i < op.count; ++i)
          std::memcpy(dst + op.dst + static_cast<std::int64_t>(i) * op.dst_stride,
                      src + op.src + static_cast<std::int64_t>(i) * op.src_stride, op.elem);
    }
  }
}

}  // namespace caravan::dma

namespace caravan::channels {

MemcpyChannel::MemcpyChannel(int threads, std::uint64_t split_bytes)
    : split_bytes_(split_bytes), stream_bytes_(settings::get_bytes("CARAVAN_MEMCPY_STREAM_BYTES")) {
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
// last share. Ops larger than a share are cut (runs by bytes, strided ops by elements).
void MemcpyChannel::run_split(const dma::Request& request) {
  const std::size_t shares = helpers_.size() + 1;
  const std::uint64_t per_share = (request.bytes + shares - 1) / shares;
  std::vector<std::vector<dma::TransferOp>> parts(shares);
  std::size_t part = 0;
  std::uint64_t filled = 0;
  for (dma::TransferOp op : request.ops) {
    while (op.bytes() > 0) {
      std::uint64_t room = per_share - filled;
      if (part == shares - 1 || op.bytes() <= room) {
        parts[part].push_back(op);
        filled += op.bytes();
        break;
      }
      parts[part].push_back(dma::split_front(op, room));
      ++part;
      filled = 0;
    }
    if (filled >= per_share && part < shares - 1) {
      ++part;
      filled = 0;
    }
  }
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i + 1 < shares; ++i) slices_[i].ops = std::move(parts[i]);
    src_ = request.src->host();
    dst_ = request.dst->host();
    pending_ = helpers_.size();
    ++generation_;
  }
  cv_.notify_all();
  dma::copy_host_ops(parts.back(), request.src->host(), request.dst->host(), stream_bytes_);
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
    std::vector<dma::TransferOp> ops = std::move(slices_[index].ops);
    const std::byte* src = src_;
    std::byte* dst = dst_;
    lock.unlock();
    dma::copy_host_ops(ops, src, dst, stream_bytes_);
    lock.lock();
    if (--pending_ == 0) cv_.notify_all();
  }
}

}  // namespace caravan::channels
