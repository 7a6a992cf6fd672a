#include "runtime/gpu/copy_queue.h"

#include "runtime/dma/interleave.h"
#include "runtime/gpu/op_kernel.h"
#include "runtime/cpu_relax.h"
#include "runtime/event_table.h"

#include "runtime/log.h"
#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace caravan::gpu {
namespace {

// The copy engines take pitches below 2^31 bytes; larger distances are not batched.
constexpr std::uint64_t kMaxPitch = (std::uint64_t{1} << 31) - 1;

FailureCause failure_of(const Error& e) { return std::make_shared<const Error>(e); }

bool linear(const dma::TransferOp& op) {
  return op.count == 1 || (op.src_stride == static_cast<std::int64_t>(op.elem) && op.dst_stride == static_cast<std::int64_t>(op.elem));
}

bool pitch_ok(std::int64_t pitch, std::uint64_t width) {
  return pitch > 0 && static_cast<std::uint64_t>(pitch) >= width && static_cast<std::uint64_t>(pitch) <= kMaxPitch;
}

void copy_1d(std::byte* dst, const std::byte* src, std::uint64_t bytes, const CopyEnds& e, hipStream_t stream) {
  if (e.src_device >= 0 && e.dst_device >= 0 && e.src_device != e.dst_device)
    CARAVAN_HIP_CHECK(hipMemcpyPeerAsync(dst, e.dst_device, src, e.src_device, bytes, stream));
  else
    CARAVAN_HIP_CHECK(hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, stream));
}

void copy_2d(std::byte* dst, std::uint64_t dpitch, const std::byte* src, std::uint64_t spitch, std::uint64_t width,
             std::uint64_t height, hipStream_t stream) {
  CARAVAN_HIP_CHECK(hipMemcpy2DAsync(dst, dpitch, src, spitch, width, height, hipMemcpyDefault, stream));
}

// `depth` slices of `height` rows of `width` bytes; rows `*pitch` apart, slices `*slice` apart
// (each slice distance a whole number of rows, at least `height`).
void copy_3d(std::byte* dst, std::uint64_t dpitch, std::uint64_t dslice, const std::byte* src, std::uint64_t spitch,
             std::uint64_t sslice, std::uint64_t width, std::uint64_t height, std::uint64_t depth, hipStream_t stream) {
  hipMemcpy3DParms p{};
  p.srcPtr = make_hipPitchedPtr(const_cast<std::byte*>(src), spitch, width, sslice / spitch);
  p.dstPtr = make_hipPitchedPtr(dst, dpitch, width, dslice / dpitch);
  p.extent = make_hipExtent(width, height, depth);
  p.kind = hipMemcpyDefault;
  CARAVAN_HIP_CHECK(hipMemcpy3DAsync(&p, stream));
}

// Whether slices `distance` bytes apart, of `count` rows `pitch` bytes apart, can be the slices
// of a 3-D copy: a positive whole number of rows apart, with room for the `count` rows.
bool slices_fit(std::int64_t distance, std::uint64_t pitch, std::uint64_t count) {
  return distance > 0 && static_cast<std::uint64_t>(distance) % pitch == 0 && static_cast<std::uint64_t>(distance) / pitch >= count;
}

std::byte* at(std::byte* base, std::uint64_t offset) { return base + offset; }
std::byte* at(std::byte* base, std::uint64_t offset, std::uint64_t i, std::int64_t stride) {
  return base + static_cast<std::uint64_t>(static_cast<std::int64_t>(offset) + static_cast<std::int64_t>(i) * stride);
}

void fill_op(const dma::TransferOp& op, const CopyEnds& e, hipStream_t stream) {
  std::byte* first = at(e.dst, op.dst);
  const std::byte* value = at(e.src, op.src);
  if (!pitch_ok(op.dst_stride, op.elem)) {
    for (std::uint64_t i = 0; i < op.count; ++i) copy_1d(at(e.dst, op.dst, i, op.dst_stride), value, op.elem, e, stream);
    return;
  }
  // One element from the pattern, then elements [0, k) copied onto [k, 2k) until count elements
  // hold it: the stream orders each doubling after the one before. Packed elements double as
  // plain runs, spaced ones as 2-D copies.
  copy_1d(first, value, op.elem, e, stream);
  const CopyEnds within{e.dst, e.dst, e.dst_device, e.dst_device};  // the doublings read the destination
  const auto pitch = static_cast<std::uint64_t>(op.dst_stride);
  for (std::uint64_t done = 1; done < op.count;) {
    std::uint64_t n = std::min(done, op.count - done);
    if (pitch == op.elem) copy_1d(first + done * pitch, first, n * pitch, within, stream);
    else copy_2d(first + done * pitch, pitch, first, pitch, op.elem, n, stream);
    done += n;
  }
}

// An op of several rows: one 2-D copy (runs) or 3-D copy (strided elements, rows a whole number
// of strides apart with room for `count` elements) where the pitches allow, else row by row.
void rows_op(const dma::TransferOp& op, const CopyEnds& e, hipStream_t stream) {
  const std::uint64_t width = op.row_bytes();
  if (linear(op) && pitch_ok(op.src_row_stride, width) && pitch_ok(op.dst_row_stride, width)) {
    copy_2d(at(e.dst, op.dst), static_cast<std::uint64_t>(op.dst_row_stride), at(e.src, op.src),
            static_cast<std::uint64_t>(op.src_row_stride), width, op.rows, stream);
    return;
  }
  if (!linear(op) && op.src_stride != 0 && pitch_ok(op.src_stride, op.elem) && pitch_ok(op.dst_stride, op.elem)) {
    const auto sp = static_cast<std::uint64_t>(op.src_stride), dp = static_cast<std::uint64_t>(op.dst_stride);
    if (slices_fit(op.src_row_stride, sp, op.count) && slices_fit(op.dst_row_stride, dp, op.count)) {
      copy_3d(at(e.dst, op.dst), dp, static_cast<std::uint64_t>(op.dst_row_stride), at(e.src, op.src), sp,
              static_cast<std::uint64_t>(op.src_row_stride), op.elem, op.count, op.rows, stream);
      return;
    }
  }
  for (std::uint64_t r = 0; r < op.rows; ++r) {
    const dma::TransferOp row = op.row(r);
    enqueue_transfer_ops(std::span<const dma::TransferOp>(&row, 1), e, stream);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------ op translation

void enqueue_transfer_ops(std::span<const dma::TransferOp> ops, const CopyEnds& e, hipStream_t stream) {
  std::size_t i = 0;
  while (i < ops.size()) {
    const dma::TransferOp& op = ops[i];
    if (op.count == 0 || op.elem == 0 || op.rows == 0) {
      ++i;
      continue;
    }
    if (op.rows > 1) {
      rows_op(op, e, stream);
      ++i;
      continue;
    }
    if (linear(op)) {
      // Runs of one length at constant distances: one 2-D copy (rows = runs).
      const std::uint64_t len = op.bytes();
      std::size_t j = i + 1;
      std::int64_t ds = 0, dd = 0;
      if (j < ops.size() && linear(ops[j]) && ops[j].rows == 1 && ops[j].bytes() == len) {
        ds = static_cast<std::int64_t>(ops[j].src - op.src);
        dd = static_cast<std::int64_t>(ops[j].dst - op.dst);
        if (pitch_ok(ds, len) && pitch_ok(dd, len)) {
          while (j < ops.size() && linear(ops[j]) && ops[j].rows == 1 && ops[j].bytes() == len &&
                 static_cast<std::int64_t>(ops[j].src - ops[j - 1].src) == ds &&
                 static_cast<std::int64_t>(ops[j].dst - ops[j - 1].dst) == dd)
            ++j;
        } else {
          j = i + 1;
        }
      }
      if (j - i > 1)
        copy_2d(at(e.dst, op.dst), static_cast<std::uint64_t>(dd), at(e.src, op.src), static_cast<std::uint64_t>(ds), len, j - i, stream);
      else
        copy_1d(at(e.dst, op.dst), at(e.src, op.src), len, e, stream);
      i = j;
      continue;
    }
    if (op.src_stride == 0) {
      fill_op(op, e, stream);
      ++i;
      continue;
    }
    if (pitch_ok(op.src_stride, op.elem) && pitch_ok(op.dst_stride, op.elem)) {
      // Strided: a 2-D copy; following ops of the same shape whose distances are whole numbers
      // of rows (and leave room for `count` rows) join it as the slices of a 3-D copy.
      const auto sp = static_cast<std::uint64_t>(op.src_stride), dp = static_cast<std::uint64_t>(op.dst_stride);
      std::size_t j = i + 1;
      std::int64_t ds = 0, dd = 0;
      auto same_shape = [&](const dma::TransferOp& o) {
        return o.elem == op.elem && o.count == op.count && o.src_stride == op.src_stride && o.dst_stride == op.dst_stride &&
               o.rows == 1;
      };
      if (j < ops.size() && same_shape(ops[j])) {
        ds = static_cast<std::int64_t>(ops[j].src - op.src);
        dd = static_cast<std::int64_t>(ops[j].dst - op.dst);
        if (slices_fit(ds, sp, op.count) && slices_fit(dd, dp, op.count)) {
          while (j < ops.size() && same_shape(ops[j]) && static_cast<std::int64_t>(ops[j].src - ops[j - 1].src) == ds &&
                 static_cast<std::int64_t>(ops[j].dst - ops[j - 1].dst) == dd)
            ++j;
        } else {
          j = i + 1;
        }
      }
      if (j - i > 1)
        copy_3d(at(e.dst, op.dst), dp, static_cast<std::uint64_t>(dd), at(e.src, op.src), sp, static_cast<std::uint64_t>(ds),
                op.elem, op.count, j - i, stream);
      else
        copy_2d(at(e.dst, op.dst), dp, at(e.src, op.src), sp, op.elem, op.count, stream);
      i = j;
      continue;
    }
    for (std::uint64_t k = 0; k < op.count; ++k)
      copy_1d(at(e.dst, op.dst, k, op.dst_stride), at(e.src, op.src, k, op.src_stride), op.elem, e, stream);
    ++i;
  }
}

void enqueue_transfer_kernel(std::span<const dma::TransferOp> ops, const CopyEnds& e, hipStream_t stream,
                             unsigned max_blocks) {
  KernelBatch batch;
  for (std::size_t i = 0; i < ops.size();) {
    const dma::TransferOp& op = ops[i];
    const dma::OpGroup g = dma::op_group_at(ops.data(), ops.size(), i);
    i += g.size();
    if (op.count == 0 || op.elem == 0 || op.rows == 0) continue;  // a group's ops share their shape: nothing to move
    // Members are at most the ops in the list; rows at most a tile's (a request moves whole rows).
    if (g.members > UINT32_MAX || g.rows > UINT32_MAX)
      throw Error(Errc::invalid_argument,
                  fmt::format("enqueue_transfer_kernel: a group of {} members and {} rows in one request; the conversion "
                              "kernel takes fewer than 2^32 of each",
                              g.members, g.rows));
    KernelGroup& k = batch.groups[batch.count++];
    k.src = at(e.src, op.src);
    k.dst = at(e.dst, op.dst);
    k.elem = op.elem;
    k.count = op.count;
    k.src_stride = op.src_stride;
    k.dst_stride = op.dst_stride;
    k.members = static_cast<std::uint32_t>(g.members);
    k.rows = static_cast<std::uint32_t>(g.rows);
    k.member_src = g.member_src;
    k.member_dst = g.member_dst;
    k.row_src = g.row_src;
    k.row_dst = g.row_dst;
    if (batch.count == kMaxKernelGroups) {
      launch_op_batch(batch, stream, max_blocks);
      batch.count = 0;
    }
  }
  if (batch.count > 0) launch_op_batch(batch, stream, max_blocks);
}

// ------------------------------------------------------------------------------------ CopyQueue

CopyQueue::CopyQueue(int device, int streams, std::string name)
    : device_(device), name_(std::move(name)), spin_ns_(settings::get_int("CARAVAN_GPU_WORKER_SPIN_US") * 1000) {
  // Often built on an application thread (the first copy() makes every channel): its current
  // device is put back afterwards.
  const gpu::ScopedDevice on_device(device_);
  streams_.resize(static_cast<std::size_t>(std::max(streams, 1)), nullptr);
  for (auto& s : streams_) {
    hipError_t status = hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
    if (status != hipSuccess) {
      for (auto& made : streams_)
        if (made) (void)hipStreamDestroy(made);
      throw_hip_error(status, "hipStreamCreateWithFlags(&s, hipStreamNonBlocking)", __FILE__, __LINE__);
    }
  }
  thread_ = std::thread([this] { completion_main(); });
  if (detail::waiting_threads_help()) hooked_ = detail::add_progress_hook(this);
}

CopyQueue::~CopyQueue() {
  if (hooked_) detail::remove_progress_hook(this);  // no helper runs help() after this
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
    dropping_ = true;
    submitted_.fetch_add(1, std::memory_order_release);  // ends a poll at once
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& s : streams_) {
    if (hipStreamSynchronize(s) != hipSuccess) (void)hipGetLastError();
    (void)hipStreamDestroy(s);
  }
  for (hipEvent_t ev : free_events_) (void)hipEventDestroy(ev);
  for (hipEvent_t ev : fences_) (void)hipEventDestroy(ev);
}

hipEvent_t CopyQueue::take_event() {
  if (!free_events_.empty()) {
    hipEvent_t ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  hipEvent_t ev = nullptr;
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&ev, hipEventDisableTiming));
  return ev;
}

// A landing flag behind everything this queue was given so far. On one stream the stream's order
// is enough: the request's copies and every earlier request run before the write. With several
// streams a tile's earlier requests may sit on the others, so the flag's stream first waits for
// an event recorded on each of them now (a wait takes the event's latest record at the call, so
// one event per stream, recorded again each time, serves). hipStreamWriteValue64 with flags 0
// orders the write after the stream's earlier memory operations (a system-scope barrier).
void CopyQueue::enqueue_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t value) {
  if (streams_.size() > 1) {
    std::lock_guard lock(mutex_);
    if (fences_.empty()) {
      std::vector<hipEvent_t> made;
      for (std::size_t i = 0; i < streams_.size(); ++i) {
        hipEvent_t ev = nullptr;
        if (hipError_t status = hipEventCreateWithFlags(&ev, hipEventDisableTiming); status != hipSuccess) {
          for (hipEvent_t m : made) (void)hipEventDestroy(m);
          throw_hip_error(status, "hipEventCreateWithFlags(&ev, hipEventDisableTiming)", __FILE__, __LINE__);
        }
        made.push_back(ev);
      }
      fences_ = std::move(made);
    }
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] == stream) continue;
      CARAVAN_HIP_CHECK(hipEventRecord(fences_[i], streams_[i]));
      CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, fences_[i], 0));
    }
  }
  CARAVAN_HIP_CHECK(hipStreamWriteValue64(stream, flag, value, 0));
}

void CopyQueue::submit(const std::function<void(hipStream_t)>& enqueue, dma::Channel::Completion done,
                       std::uint64_t* flag, std::uint64_t flag_value) {
  Pending p;
  p.done = std::move(done);
  // Events belong to the device that is current when they are made, and must be recorded on a
  // stream of that device: set it first (the DMA worker issuing for this queue is usually already
  // there; setting it again costs little and keeps calibration and other callers right). The
  // caller's current device is put back on the way out: a thread that called copy() may submit
  // a copy's first request itself (DmaWorker::add) and must not find its device changed.
  struct RestoreDevice {
    int device = -1;
    ~RestoreDevice() {
      int now = -1;
      if (device >= 0 && hipGetDevice(&now) == hipSuccess && now != device && hipSetDevice(device) != hipSuccess)
        (void)hipGetLastError();  // not this copy's error, nor a later call's
    }
  } restore;
  if (hipGetDevice(&restore.device) != hipSuccess) {
    (void)hipGetLastError();
    restore.device = -1;
  }
  if (hipError_t status = hipSetDevice(device_); status != hipSuccess) {
    try {
      throw_hip_error(status, "hipSetDevice(device_)", __FILE__, __LINE__);
    } catch (const Error& e) {
      p.done(failure_of(Error(e.code(), fmt::format("{}: {}", name_, e.what()))));
      return;
    }
  }
  hipStream_t stream;
  {
    std::lock_guard lock(mutex_);
    stream = streams_[next_stream_++ % streams_.size()];
    try {
      p.event = take_event();
    } catch (const Error& e) {
      p.failure = failure_of(e);
    }
  }
  if (!p.failure) {
    try {
      enqueue(stream);
      if (flag) enqueue_flag(stream, flag, flag_value);
    } catch (const Error& e) {
      p.failure = failure_of(Error(e.code(), fmt::format("{}: {}", name_, e.what())));
    } catch (const std::exception& e) {
      p.failure = make_failure(Errc::internal, fmt::format("{}: {}", name_, e.what()));
    }
    // Recorded even after a failure, so that the report waits for the copies already enqueued
    // (the engine frees buffers once a request is reported).
    hipError_t status = hipEventRecord(p.event, stream);
    if (status != hipSuccess) {
      (void)hipGetLastError();
      if (!p.failure) {
        try {
          throw_hip_error(status, "hipEventRecord(event, stream)", __FILE__, __LINE__);
        } catch (const Error& e) {
          p.failure = failure_of(e);
        }
      }
      // Without an event, wait for the stream here: rare, and only after an error.
      (void)hipStreamSynchronize(stream);
      (void)hipGetLastError();
      std::lock_guard lock(mutex_);
      free_events_.push_back(p.event);
      p.event = nullptr;
    }
  }
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(std::move(p));
    pending_count_.store(pending_.size(), std::memory_order_release);
    submitted_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

void CopyQueue::help() noexcept {
  if (pending_count_.load(std::memory_order_acquire) == 0) return;
  std::unique_lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || completing_ || dropping_ || pending_.empty()) return;
  hipEvent_t event = pending_.front().event;
  // Not ready, or an error: the completion thread waits for it and reports it. hipErrorNotReady
  // is not recorded as the thread's last error (CUDA; recent ROCm), so the waiting thread's own
  // HIP state is kept; another error is taken back off it.
  if (event) {
    if (const hipError_t status = hipEventQuery(event); status != hipSuccess) {
      if (status != hipErrorNotReady) (void)hipGetLastError();
      return;
    }
  }
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  pending_count_.store(pending_.size(), std::memory_order_release);
  if (event) free_events_.push_back(event);
  completing_ = true;
  lock.unlock();
  p.done(p.failure);
  lock.lock();
  completing_ = false;
  submitted_.fetch_add(1, std::memory_order_release);  // the completion thread's turn again
  lock.unlock();
  cv_.notify_all();
}

void CopyQueue::completion_main() {
  const detail::RuntimeThreadRole role("a GPU copy queue's completion thread");
  if (hipSetDevice(device_) != hipSuccess) (void)hipGetLastError();
  std::unique_lock lock(mutex_);
  for (;;) {
    if ((pending_.empty() || completing_) && !stop_ && spin_ns_ > 0) {
      // Poll for the next request before sleeping: a thread woken from the condition variable
      // took 150-200 us on the GPU machine, longer than a request of 48 MiB within a GPU
      // (50-60 us), whose completion it then delayed. A submission after the poll gave up is
      // seen by the wait's predicate (pending_, under the lock).
      const std::uint64_t seen = submitted_.load(std::memory_order_acquire);
      lock.unlock();
      (void)poll_for_change(submitted_, seen, spin_ns_);
      lock.lock();
    }
    cv_.wait(lock, [&] { return (stop_ && !completing_) || (!pending_.empty() && !completing_); });
    if (pending_.empty()) return;  // stop_ and nothing left
    hipEvent_t event = pending_.front().event;
    completing_ = true;  // the front is this thread's: a helper leaves it alone
    lock.unlock();
    FailureCause failure;
    if (event) {
      hipError_t status = hipEventSynchronize(event);
      if (status != hipSuccess) {
        try {
          throw_hip_error(status, "hipEventSynchronize(event)", __FILE__, __LINE__);
        } catch (const Error& e) {
          failure = failure_of(Error(Errc::device, fmt::format("{}: {}", name_, e.what())));
        }
      }
    }
    lock.lock();
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    pending_count_.store(pending_.size(), std::memory_order_release);
    if (event) free_events_.push_back(event);
    if (!p.failure) p.failure = failure;
    if (dropping_) {
      completing_ = false;
      continue;
    }
    lock.unlock();
    p.done(p.failure);
    lock.lock();
    completing_ = false;
  }
}

}  // namespace caravan::gpu
