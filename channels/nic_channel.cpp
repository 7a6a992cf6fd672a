#include "channels/nic_channel.h"

#include "runtime/net/rma.h"

#include <fmt/format.h>

#include <atomic>
#include <mutex>
#include <string>

namespace caravan::channels {
namespace {

// One request: the puts it posted, counted down by their completions. The request is done when
// the count reaches zero; the submitting thread holds one count until it has posted them all,
// so that completions arriving meanwhile cannot finish it early.
struct PutBatch {
  dma::Channel::Completion done;
  std::atomic<std::uint64_t> outstanding{1};
  std::mutex mutex;
  FailureCause failure;  // the first one

  void fail(const FailureCause& cause) {
    std::lock_guard lock(mutex);
    if (!failure) failure = cause;
  }
  void release() {
    if (outstanding.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    FailureCause cause;
    {
      std::lock_guard lock(mutex);
      cause = failure;
    }
    done(cause);
    delete this;
  }
  static void put_done(void* user, const FailureCause& failure) {
    auto* self = static_cast<PutBatch*>(user);
    if (failure) self->fail(failure);
    self->release();
  }
};

}  // namespace

NicChannel::NicChannel(net::Rma& rma, MemoryId src, MemoryId dst, int window)
    : rma_(rma), src_(src), dst_(dst), window_(window) {}

bool NicChannel::serves(MemoryId src, MemoryId dst) const noexcept {
  return src.kind == MemoryKind::reg && dst.kind == MemoryKind::reg && src.rank != dst.rank && src == src_ && dst == dst_;
}

void NicChannel::submit(const dma::Request& request, Completion done) {
  const dma::Storage* src = request.src;
  const dma::Storage* dst = request.dst;
  if (!src || !src->host() || !src->registration() || !dst || !dst->remote_memory()) {
    done(make_failure(Errc::internal, fmt::format("nic channel {} -> {}: a request needs registered storage of this rank "
                                                  "and remote storage of the target",
                                                  src_.to_string(), dst_.to_string())));
    return;
  }
  auto* batch = new PutBatch;
  batch->done = std::move(done);
  const net::RmaCallback callback{&PutBatch::put_done, batch};
  try {
    for (const dma::TransferOp& rows : request.ops) {
      for (std::uint64_t r = 0; r < rows.rows; ++r) {
        const dma::TransferOp op = rows.row(r);
        // Runs that continue each other on both sides are one put; otherwise one put per element.
        const bool contiguous = op.count == 1 || (op.src_stride == static_cast<std::int64_t>(op.elem) &&
                                                  op.dst_stride == static_cast<std::int64_t>(op.elem));
        const std::uint64_t puts = contiguous ? 1 : op.count;
        const std::uint64_t bytes = contiguous ? op.bytes() : op.elem;
        for (std::uint64_t i = 0; i < puts; ++i) {
          const auto s = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.src) + static_cast<std::int64_t>(i) * op.src_stride);
          const auto d = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.dst) + static_cast<std::int64_t>(i) * op.dst_stride);
          batch->outstanding.fetch_add(1, std::memory_order_relaxed);
          if (rma_.put(dst->remote_memory(), d, src->host() + s, bytes, src->registration(), callback) == net::RmaStatus::done)
            batch->release();
        }
      }
    }
  } catch (const Error& e) {
    // Refused at submission (the peer is lost, the runtime shuts down): the put that threw was
    // counted but will never complete.
    batch->fail(std::make_shared<const Error>(e));
    batch->release();
  } catch (const std::exception& e) {
    // Anything else (out of memory in UCX's request path, say) fails the request the same way,
    // rather than leaving it in flight for ever.
    batch->fail(std::make_shared<const Error>(Errc::transport, std::string("nic put: ") + e.what()));
    batch->release();
  }
  batch->release();
}

}  // namespace caravan::channels
