// What the GPU channels (channels/sdma_channel, channels/xgmi_channel) share: a CopyQueue of
// dedicated streams with a completion thread, and the translation of the DMA engine's byte
// operations into copy-engine calls. GPU builds only (HIP types).
//
// Completion protocol: submit() enqueues a request's copies on the next stream (round robin),
// records an event behind them and appends (event, done) to a FIFO. One completion thread per
// queue waits on the FIFO's front event (hipEventSynchronize) and then runs its `done`, so the
// DMA worker that submitted never blocks on the GPU, the streams never stall on a host callback,
// and a GPU error that surfaces at the event is reported as that request's failure.
// Completions run in submission order (a later request on another stream that finishes first
// waits for the earlier one's report), which keeps the engine's in-order tile accounting simple.
// A thread waiting for an event may run them too (help(), runtime/progress.h): the front
// request's completion once hipEventQuery says its copies finished, if no other thread is
// completing one. One completion runs at a time, in order, whoever runs it.
#pragma once

#include "runtime/dma/channel.h"
#include "runtime/gpu/platform.h"
#include "runtime/progress.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <atomic>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace caravan::gpu {

class CopyQueue final : public detail::ProgressHook {
 public:
  // `streams` non-blocking streams on `device`.
  CopyQueue(int device, int streams, std::string name);
  // Waits for the copies in flight, then stops. Completions still pending are not run: the
  // owner (a DMA worker or the calibration) has already waited for every one it cares about.
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  int device() const noexcept { return device_; }
  // Calls `enqueue(stream)` to put a request's copies on a stream, then arranges for `done` to
  // run (on the completion thread) once they have finished. A HIP error while enqueueing is
  // reported through `done` too, after whatever was enqueued before it has finished.
  // With `flag`: once those copies, and everything submitted to this queue before them, have
  // finished, the GPU writes `flag_value` to *flag (hipStreamWriteValue64 behind them on the same
  // stream, after the other streams' work through events), before `done` runs. Not written when
  // enqueueing failed.
  void submit(const std::function<void(hipStream_t)>& enqueue, dma::Channel::Completion done,
              std::uint64_t* flag = nullptr, std::uint64_t flag_value = 0);

  // Runs the front request's completion on this thread if its copies have finished and no other
  // thread is completing one (never blocks). Called by threads waiting for events.
  void help() noexcept override;

 private:
  struct Pending {
    hipEvent_t event = nullptr;  // null: nothing to wait for
    dma::Channel::Completion done;
    FailureCause failure;
  };
  hipEvent_t take_event();  // mutex_ held
  void enqueue_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t value);
  void completion_main();

  int device_;
  std::string name_;
  std::vector<hipStream_t> streams_;
  std::size_t next_stream_ = 0;  // mutex_
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<hipEvent_t> free_events_;
  // One per stream, made at the first flag with several streams: recorded on each other stream
  // and waited for on the flag's stream, so the flag follows every request submitted before it.
  std::vector<hipEvent_t> fences_;  // mutex_
  bool stop_ = false;
  bool dropping_ = false;  // destructor: wait for events, skip completions
  // Submissions so far, bumped under mutex_: the completion thread polls it for spin_ns_ after
  // its last pending request before it sleeps (CARAVAN_GPU_WORKER_SPIN_US, as the DMA workers).
  std::atomic<std::uint64_t> submitted_{0};
  std::int64_t spin_ns_ = 0;
  // mutex_: a thread (the completion thread or a helper) is running a completion; the others
  // leave the queue's front alone until it is done.
  bool completing_ = false;
  std::atomic<std::size_t> pending_count_{0};  // pending_.size(), for help()'s check without the lock
  bool hooked_ = false;  // registered as a progress hook (CARAVAN_WAIT_HELPS)
  std::thread thread_;
};

// Where a request's two storages are, for the op translation below.
struct CopyEnds {
  std::byte* src = nullptr;  // unified addresses of the storages' first bytes
  std::byte* dst = nullptr;
  int src_device = -1;       // -1: host memory
  int dst_device = -1;
};

// Enqueues `ops` on `stream` as copy-engine calls:
//   - runs (count 1, or both strides equal to the element): hipMemcpyAsync, or
//     hipMemcpyPeerAsync between two devices; consecutive runs of one length at constant
//     distances become one hipMemcpy2DAsync;
//   - strided ops (strides >= the element): hipMemcpy2DAsync (width = element, height = count,
//     pitches = strides); consecutive ops of the same shape at constant distances that are
//     whole multiples of the strides become one hipMemcpy3DAsync (the ops are its slices);
//   - fills (source stride 0): one element copied, then doubled in place with 2-D copies
//     (log2(count) calls);
//   - anything else (overlapping or negative strides): one copy per element.
void enqueue_transfer_ops(std::span<const dma::TransferOp> ops, const CopyEnds& ends, hipStream_t stream);

// Enqueues `ops` on `stream` as kernels on the stream's device (runtime/gpu/op_kernel.h), one per
// kMaxKernelGroups groups of ops (runtime/dma/interleave.h: a conversion's fields, rows): the
// GPU's threads move the bytes. Both ends must be reachable from that
// device (its own memory, a peer's with peer access, or mapped host memory). `max_blocks`: as
// launch_op_batch's.
void enqueue_transfer_kernel(std::span<const dma::TransferOp> ops, const CopyEnds& ends, hipStream_t stream,
                             unsigned max_blocks = 0);

}  // namespace caravan::gpu
