#include "runtime/dma/engine.h"
#include "runtime/checks.h"

#include "channels/file_channel.h"
#include "channels/memcpy_channel.h"
#include "channels/nic_channel.h"
#include "runtime/cpu_relax.h"
#include "runtime/dma/calibrate.h"
#include "runtime/dma/instance_impl.h"
#include "runtime/dma/interleave.h"
#include "runtime/gpu/devices.h"
#include "runtime/log.h"
#include "runtime/net/network.h"
#if CARAVAN_HAVE_GPU
#include "channels/gpu_convert_channel.h"
#include "channels/sdma_channel.h"
#include "channels/xgmi_channel.h"
#endif

#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <limits>

namespace caravan::dma {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

namespace {

double us_since(std::int64_t start_ns) { return static_cast<double>(now_ns() - start_ns) / 1e3; }

// The layout an intermediate buffer uses for one tile slot: the planned layout with every block
// clamped to the tile's extent. A block wider than the tile only adds padding (the planner
// sizes blocks for the whole transfer); the writer and the reader of a slot compute the same
// clamped layout from the same tile, so they agree.
Layout slot_layout(const Layout& planned, const Rect& tile) {
  Layout out;
  for (LayoutComponent c : planned) {
    if (c.kind == LayoutComponent::Kind::dim_in)
      c.block = std::min<std::uint64_t>(c.block, static_cast<std::uint64_t>(tile.extent(c.dim)));
    out.push_back(c);
  }
  return out;
}

// Waits on the copy's precondition and hands the copy to the engine when it triggers.
class PreconditionWaiter final : public detail::EventWaiter {
 public:
  explicit PreconditionWaiter(std::shared_ptr<CopyOperation> op) : op_(std::move(op)) {}
  void event_triggered(const FailureCause& failure) override;

 private:
  std::shared_ptr<CopyOperation> op_;
};

}  // namespace

// ------------------------------------------------------------------------------------ CopyOperation

void CopyOperation::fail(const FailureCause& cause) {
  {
    std::lock_guard lock(failure_mutex);
    if (!failure) failure = cause;
  }
  cancelled.store(true, std::memory_order_release);
  for (auto& xd : xds)
    if (xd->worker) xd->worker->wake();
}

std::string CopyOperation::route() const {
  if (!route_text.empty() || route_steps.empty()) return route_text;
  std::string out = route_src.to_string();
  for (const auto& [kind, to] : route_steps) out += fmt::format(" -[{}]-> {}", to_string(kind), to.to_string());
  return out;
}

void CopyOperation::set_route(const std::vector<planner::Hop>& hops) {
  route_steps.clear();
  if (hops.empty()) return;
  route_src = hops.front().src;
  for (const planner::Hop& hop : hops) route_steps.emplace_back(hop.kind, hop.dst);
}

void CopyOperation::touch() { last_progress_ns.store(now_ns(), std::memory_order_relaxed); }

// ------------------------------------------------------------------------------------ DmaWorker

DmaWorker::DmaWorker(Engine& engine, std::unique_ptr<Channel> channel, std::string name)
    : engine_(engine),
      channel_(std::move(channel)),
      name_(std::move(name)),
      // Not the nic: its completions come from the progress thread, which a polling worker
      // would starve of a core on a small machine.
      submit_here_(channel_->submits_from_any_thread()),
      spin_ns_(channel_->window() > 1 && channel_->kind() != ChannelKind::nic
                   ? settings::get_int("CARAVAN_GPU_WORKER_SPIN_US") * 1000
                   : 0),
      thread_([this] { loop(); }) {}

DmaWorker::~DmaWorker() {
  stop();
  // The channel goes first, while the worker's mutex and condition variable still exist: a
  // channel that completes outstanding requests as it is destroyed calls back into them.
  channel_.reset();
}

void DmaWorker::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stop_) return;
    stop_ = true;
    signals_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

namespace {
// The XD this thread runs inline (DmaWorker::run_inline), if any: its completion, inside the
// channel's submit(), wakes the worker only for other work.
thread_local const Xd* t_inline_xd = nullptr;
}  // namespace

bool DmaWorker::run_inline(Xd* xd, std::unique_lock<std::mutex>& lock) {
  // A small copy (one hop, one tile) on a channel that runs small requests on any thread: the
  // caller runs it. Handing it to the worker costs a wake-up (5-20 us; tens on a virtual machine)
  // and a second thread's cache misses, more than copying a few KiB: 2048 copies of 4 KiB took
  // 17 us each one at a time handed over, 2 us run here (docs/dma.md, small copies).
  const CopyOperation& op = *xd->op;
  const std::uint64_t limit = channel_->inline_bytes();
  if (limit == 0 || stop_ || op.xds.size() != 1 || op.grid.count() != 1 || !xd->active.empty() || !can_issue(*xd) ||
      op.space.volume() * op.fields.total_size() > limit)
    return false;
  xd->generating = true;  // neither issued nor retired by the worker meanwhile
  lock.unlock();
  FailureCause failure;
  Xd::ActiveTile tile;
  try {
    tile = cut_tile(*xd, 0);
  } catch (const std::exception& e) {
    failure = make_failure(Errc::internal, fmt::format("{}: cutting a copy: {}", name_, e.what()));
  }
  if (failure) xd->op->fail(failure);  // cancels it: retired below
  lock.lock();
  if (!failure) {
    xd->next_tile = 1;
    xd->active.push_back(std::move(tile));
    // The tile leaves `active` once its last request completes (inside submit()).
    while (!xd->op->cancelled.load(std::memory_order_acquire) && !xd->active.empty() &&
           xd->active.back().next_op < xd->active.back().ops.size()) {
      Issue issue = take_request(xd);
      lock.unlock();
      t_inline_xd = xd;
      try {
        submit(xd, issue);
      } catch (const std::exception& e) {
        complete(xd, issue.tile, issue.span, make_failure(Errc::internal, fmt::format("{}: {}", name_, e.what())));
      }
      t_inline_xd = nullptr;
      lock.lock();
    }
  }
  xd->generating = false;
  bool retire = false;
  if (can_retire(*xd)) {
    if (auto it = std::find(pool_.begin(), pool_.end(), xd); it != pool_.end()) {
      pool_.erase(it);
      xd->retired = true;
      retire = true;
    }
  }
  if (!retire) {  // (a request failed part-way and left work) the worker takes it from here
    signals_.fetch_add(1, std::memory_order_release);
    cv_.notify_one();
  }
  lock.unlock();
  if (retire) engine_.xd_retired(xd->op);
  return true;
}

void DmaWorker::add(Xd* xd) {
  std::unique_lock lock(mutex_);
  // Highest priority first; among equals, the older copy first.
  auto it = std::find_if(pool_.begin(), pool_.end(), [&](const Xd* other) {
    return other->op->priority < xd->op->priority ||
           (other->op->priority == xd->op->priority && other->op->sequence > xd->op->sequence);
  });
  pool_.insert(it, xd);
  if (run_inline(xd, lock)) return;
  // Notifying under the lock, here and below: once it is released the worker may retire the XD,
  // finish the copy, and the engine (with this worker) may be destroyed.
  auto hand_to_worker = [&] {
    signals_.fetch_add(1, std::memory_order_release);
    cv_.notify_one();
  };
  // Alone on an idle channel that takes requests from any thread: the calling thread cuts the
  // first tile and submits its first request itself, which saves the worker's wake-up and the
  // hand-over of the copy's cache lines (about 1.5 us of every GPU copy's start). While the
  // worker sleeps, the caller goes on to fill the channel's window (a second request costs it one
  // more launch, a few microseconds; the sleeping worker would take tens to wake: 25-45 us
  // before a 48 MiB conversion's second request on an H100). The XD counts as being cut
  // (`generating`) until the last of these submits has returned, so the worker neither issues
  // its later requests ahead of them (a landing flag must follow them) nor retires it.
  const bool direct = submit_here_ && !stop_ && in_flight_ == 0 && pool_.size() == 1 && can_issue(*xd) && xd->active.empty();
  if (!direct) {
    hand_to_worker();
    return;
  }
  const int most = worker_asleep_ ? channel_->window() : 1;
  xd->generating = true;
  for (int issued = 0; issued < most; ++issued) {
    if (issued > 0) {
      // Looked at again: the worker's window, other copies, cancellation, the tile's inputs.
      if (stop_ || in_flight_ >= channel_->window() || pool_.size() != 1) break;
      xd->generating = false;  // can_issue refuses an XD being cut; it is ours, under the lock
      const bool more = can_issue(*xd);
      xd->generating = true;
      if (!more) break;
    }
    if (xd->active.empty() || xd->active.back().next_op == xd->active.back().ops.size()) {
      const std::uint64_t t = xd->next_tile;
      lock.unlock();
      FailureCause cut_failure;
      Xd::ActiveTile tile;
      try {
        tile = cut_tile(*xd, t);
      } catch (const std::exception& e) {
        cut_failure =
            make_failure(Errc::internal, fmt::format("{}: cutting tile {} of a copy: {}", name_, t, e.what()));
      }
      if (cut_failure) {
        // The copy fails and is cancelled; the XD, still counted as being cut, cannot retire (and
        // the copy cannot finish) until the worker sees it below.
        xd->op->fail(cut_failure);
        lock.lock();
        break;
      }
      lock.lock();
      xd->next_tile = t + 1;
      xd->active.push_back(std::move(tile));
      // Looked at again: while the tile was cut, the worker may have filled the channel's window
      // with other copies, this copy may have been cancelled, or the worker stopped; past the
      // first request, another copy (perhaps of higher priority) may have arrived.
      if (stop_ || in_flight_ >= channel_->window() || xd->op->cancelled.load(std::memory_order_acquire) ||
          (issued > 0 && pool_.size() != 1))
        break;
    }
    Issue issue = take_request(xd);
    lock.unlock();
    try {
      submit(xd, issue);
    } catch (const std::exception& e) {
      // The channel did not take it: the request ends failed, which fails the copy.
      complete(xd, issue.tile, issue.span, make_failure(Errc::internal, fmt::format("{}: {}", name_, e.what())));
    }
    lock.lock();
  }
  xd->generating = false;
  hand_to_worker();
}

void DmaWorker::wake() {
  // Taking the lock orders this wake after any check the worker made under it: no lost wake-up.
  signals_.fetch_add(1, std::memory_order_release);
  { std::lock_guard lock(mutex_); }
  cv_.notify_one();
}

bool DmaWorker::can_issue(const Xd& xd) const {
  if (xd.op->cancelled.load(std::memory_order_acquire) || xd.generating) return false;
  if (!xd.active.empty() && xd.active.back().next_op < xd.active.back().ops.size()) return true;
  const CopyOperation& op = *xd.op;
  std::uint64_t t = xd.next_tile;
  if (t >= op.grid.count()) return false;
  const std::size_t last = op.xds.size() - 1;
  // Input: the previous hop has finished writing tile t into its output slot.
  if (xd.hop > 0 && op.xds[xd.hop - 1]->tiles_done.load(std::memory_order_acquire) <= t) return false;
  // Output: the slot tile t goes to has been drained by the next hop (it finished t - slots).
  if (xd.hop < last && op.xds[xd.hop + 1]->tiles_done.load(std::memory_order_acquire) + static_cast<std::uint64_t>(op.slots) <= t)
    return false;
  // The last hop writes the destination directly; bound its tiles in progress all the same.
  if (xd.hop == last && xd.active.size() >= static_cast<std::size_t>(op.slots)) return false;
  return true;
}

std::string DmaWorker::describe(const Xd& xd) {
  std::lock_guard lock(mutex_);
  const CopyOperation& op = *xd.op;
  if (xd.in_flight > 0)
    return fmt::format("{} request(s) in flight, the latest issued {:.1f} s ago (the channel has not completed it)",
                       xd.in_flight, static_cast<double>(now_ns() - xd.last_issue_ns) / 1e9);
  if (xd.generating) return "cutting a tile into requests (or its first requests being submitted by the copy's caller)";
  if (op.cancelled.load(std::memory_order_acquire)) return "cancelled, retiring";
  if (!xd.active.empty() && xd.active.back().next_op < xd.active.back().ops.size())
    return fmt::format("ready to issue, waiting for the channel ({} request(s) of other copies in flight)", in_flight_);
  const std::uint64_t t = xd.next_tile;
  if (t >= op.grid.count()) return "all tiles issued";
  if (xd.hop > 0 && op.xds[xd.hop - 1]->tiles_done.load(std::memory_order_acquire) <= t)
    return fmt::format("waiting for hop {} to finish tile {}", xd.hop - 1, t);
  if (xd.hop + 1 < op.xds.size() &&
      op.xds[xd.hop + 1]->tiles_done.load(std::memory_order_acquire) + static_cast<std::uint64_t>(op.slots) <= t)
    return fmt::format("waiting for hop {} to drain the slot of tile {}", xd.hop + 1, t);
  return fmt::format("ready to issue tile {}, waiting for the channel ({} request(s) in flight)", t, in_flight_);
}

void DmaWorker::loop() {
  const detail::RuntimeThreadRole role("a DMA worker");
  std::unique_lock lock(mutex_);
  bool spun_out = false;  // this idle period already polled for spin_ns_: sleep now
  for (;;) {
    if (stop_) return;
    // Retire XDs that are done, or whose copy was cancelled, once nothing of theirs is in flight.
    std::vector<Xd*> retired;
    for (auto it = pool_.begin(); it != pool_.end();) {
      Xd* xd = *it;
      if (can_retire(*xd)) {
        xd->retired = true;
        retired.push_back(xd);
        it = pool_.erase(it);
      } else {
        ++it;
      }
    }
    if (!retired.empty()) {
      lock.unlock();
      for (Xd* xd : retired) engine_.xd_retired(xd->op);
      lock.lock();
      continue;
    }
    Xd* chosen = nullptr;
    if (in_flight_ < channel_->window()) {
      for (Xd* xd : pool_) {
        if (can_issue(*xd)) {
          chosen = xd;
          break;
        }
      }
    }
    if (!chosen) {
      if (spin_ns_ > 0 && !spun_out) {
        // Poll for the next signal outside the lock, then look again under it. A signal sent
        // after the poll gave up is seen by that look (it is bumped before the signaller takes
        // the lock), and one sent after the look waits for the lock until cv_.wait releases it.
        const std::uint64_t seen = signals_.load(std::memory_order_acquire);
        lock.unlock();
        const bool signalled = poll_for_change(signals_, seen, spin_ns_);
        lock.lock();
        spun_out = !signalled;
        continue;
      }
      worker_asleep_ = true;
      cv_.wait(lock);
      worker_asleep_ = false;
      spun_out = false;
      continue;
    }
    spun_out = false;
    if (chosen->active.empty() || chosen->active.back().next_op == chosen->active.back().ops.size()) {
      // Cut the next tile into ops outside the lock: it can take a while for a large tile.
      const std::uint64_t t = chosen->next_tile;
      chosen->generating = true;
      lock.unlock();
      Xd::ActiveTile tile = cut_tile(*chosen, t);
      lock.lock();
      chosen->generating = false;
      chosen->next_tile = t + 1;
      chosen->active.push_back(std::move(tile));
      continue;  // re-pick: priorities may have changed meanwhile
    }
    Issue issue = take_request(chosen);
    lock.unlock();
    submit(chosen, issue);
    lock.lock();
  }
}

Xd::ActiveTile DmaWorker::cut_tile(const Xd& xd, std::uint64_t t) const {
  const CopyOperation& op = *xd.op;
  Xd::ActiveTile tile;
  tile.index = t;
  Rect rect = op.grid.tile(t);
  const std::size_t last = op.xds.size() - 1;
  std::optional<View> in_slot, out_slot;
  const View* src = &*op.src_view;
  const View* dst = &*op.dst_view;
  if (xd.hop > 0) {
    const auto& b = op.buffers[xd.hop - 1];
    in_slot = View::of_layout(slot_layout(b.layout, rect), rect, op.fields, (t % static_cast<std::uint64_t>(op.slots)) * b.slot_bytes);
    src = &*in_slot;
  }
  if (xd.hop < last) {
    const auto& b = op.buffers[xd.hop];
    out_slot = View::of_layout(slot_layout(b.layout, rect), rect, op.fields, (t % static_cast<std::uint64_t>(op.slots)) * b.slot_bytes);
    dst = &*out_slot;
  }
  append_tile_ops(rect, op.fields, *src, *dst, tile.ops);
  tile.request_ends = cut_requests(tile.ops, xd.request_bytes);
  return tile;
}

DmaWorker::Issue DmaWorker::take_request(Xd* chosen) {
  CopyOperation& op = *chosen->op;
  // The tile's next request, as cut_requests cut it.
  Xd::ActiveTile& tile = chosen->active.back();
  std::size_t first = tile.next_op;
  tile.next_op = tile.request_ends.empty() ? tile.ops.size() : tile.request_ends[tile.next_request++];
  std::uint64_t bytes = 0;
  for (std::size_t i = first; i < tile.next_op; ++i) bytes += tile.ops[i].bytes();
  Issue issue;
  Request& request = issue.request;
  request.ops = std::span<const TransferOp>(tile.ops.data() + first, tile.next_op - first);
  request.bytes = bytes;
  const std::size_t last = op.xds.size() - 1;
  request.src = chosen->hop == 0 ? (op.pattern ? op.pattern.get() : op.src_storage.get())
                                 : op.buffers[chosen->hop - 1].storage.get();
  request.dst = chosen->hop == last ? op.dst_storage.get() : op.buffers[chosen->hop].storage.get();
  request.cancelled = &op.cancelled;
  // The tile's last request on the last hop carries its landing flag: the channel writes it
  // once this request and the tile's earlier ones (submitted before it) have landed.
  if (op.signal_flags && chosen->hop == last && tile.next_op == tile.ops.size()) {
    request.signal_flag = op.signal_flags + tile.index;
    request.signal_value = op.signal_value;
  }
  chosen->last_issue_ns = now_ns();
  ++tile.outstanding;
  ++chosen->in_flight;
  ++in_flight_;
  std::uint64_t seq = ++executed_;
  if (chosen->requests++ == 0) chosen->first_seq = seq;
  chosen->last_seq = seq;
  issue.tile = tile.index;
  if (chosen->record) {
    issue.span = chosen->spans.size();
    chosen->spans.push_back({tile.index, bytes, us_since(op.started_ns), 0});
  }
  return issue;
}

namespace {
// Nonzero while this thread is inside Channel::submit: a completion run from there (a synchronous
// channel, or an enqueue failure) leaves the retiring to the worker, since the channel may still
// read the request, whose ops the copy owns, after `done` returns.
thread_local int t_submitting = 0;
}  // namespace

bool DmaWorker::can_retire(const Xd& xd) const {
  if (xd.in_flight != 0 || xd.generating || xd.retired) return false;
  return xd.tiles_done.load(std::memory_order_acquire) == xd.op->grid.count() ||
         xd.op->cancelled.load(std::memory_order_acquire);
}

void DmaWorker::submit(Xd* xd, const Issue& issue) {
  struct Submitting {
    Submitting() { ++t_submitting; }
    ~Submitting() { --t_submitting; }
  } submitting;
  channel_->submit(issue.request, [this, xd, tile = issue.tile, span = issue.span](const FailureCause& failure) {
    complete(xd, tile, span, failure);
  });
}

void DmaWorker::complete(Xd* xd, std::uint64_t tile_index, std::size_t span, const FailureCause& failure) {
  // The request counts as in flight until the end: an XD with a request in flight does not
  // retire, so its copy (and `xd`) stay alive while this runs. That matters for asynchronous
  // channels, whose completions run on their own threads: the worker could otherwise retire the
  // XD and finish the copy between the tile bookkeeping and the wake-ups below.
  bool finished_tile = false;
  CopyOperation& op = *xd->op;
  {
    std::lock_guard lock(mutex_);
    if (span != kNoSpan) xd->spans[span].end_us = us_since(op.started_ns);
    for (auto& tile : xd->active) {
      if (tile.index == tile_index) {
        --tile.outstanding;
        break;
      }
    }
    // Tiles finish in order: pop finished ones from the front.
    while (!xd->active.empty() && xd->active.front().outstanding == 0 &&
           xd->active.front().next_op == xd->active.front().ops.size()) {
      xd->active.erase(xd->active.begin());
      if (xd->record) xd->tile_done_us.push_back(us_since(op.started_ns));
      xd->tiles_done.fetch_add(1, std::memory_order_acq_rel);
      finished_tile = true;
    }
  }
  op.touch();
  if (failure) op.fail(failure);
  if (finished_tile) engine_.tile_finished(xd);
  // Notify under the lock: once it is released the worker may retire the XD, finish the copy,
  // and the engine (with this worker) may be shut down and destroyed, so an asynchronous
  // channel's completion thread must not touch the worker after that.
  CopyOperation* retire_here = nullptr;
  {
    std::lock_guard lock(mutex_);
    --in_flight_;
    --xd->in_flight;
    // The XD's last request on a channel that completes from its own threads (or from a thread
    // waiting for an event, runtime/progress.h): retire it here rather than hand that to the
    // worker, whose wake-up after an idle spell (150-200 us on the GPU machine) would otherwise
    // sit between the copy's last byte and its event. Taken out of the pool under the lock, the
    // XD is the worker's no more; the copy stays active (and the engine with this worker alive)
    // until xd_retired below has run.
    if (submit_here_ && t_submitting == 0 && !stop_ && can_retire(*xd)) {
      if (auto it = std::find(pool_.begin(), pool_.end(), xd); it != pool_.end()) {
        pool_.erase(it);
        xd->retired = true;
        retire_here = xd->op;
      }
    }
    // The worker has work only if the pool still holds some (a request slot came free for it);
    // a worker left with an empty pool would wake for nothing.
    // Run inline (run_inline), the XD is its caller's to retire: wake the worker only for other
    // XDs (it may be waiting for the request slot this one held).
    const bool others = t_inline_xd == xd ? pool_.size() > 1 : (!retire_here || !pool_.empty());
    if (others) {
      signals_.fetch_add(1, std::memory_order_release);
      cv_.notify_one();
    }
  }
  if (retire_here) engine_.xd_retired(retire_here);
}

// ------------------------------------------------------------------------------------ Timeline

// Splits each hop's time into busy, waiting for input, waiting for a free output slot and
// scheduling (see HopTimeline). Runs after every XD has retired, so their records are final.
std::vector<HopTimeline> hop_timelines(const CopyOperation& op) {
  std::vector<HopTimeline> out;
  const std::size_t last = op.xds.size() - 1;
  const auto slots = static_cast<std::uint64_t>(op.slots);
  for (const auto& xd : op.xds) {
    HopTimeline h;
    // Copies across ranks record no timeline (yet): their hops on other ranks are mirrors here.
    h.channel = xd->worker ? xd->worker->name() : "another rank";
    h.requests = xd->spans;
    h.tile_done_us = xd->tile_done_us;
    auto done_at = [&](std::size_t hop, std::uint64_t tile) {
      // A tile is only issued once its input is finished and its slot drained, so both are known.
      const auto& done = op.xds[hop]->tile_done_us;
      return tile < done.size() ? done[tile] : 0.0;
    };
    double covered = 0;  // requests run up to here (window > 1: they overlap)
    std::uint64_t previous_tile = ~std::uint64_t{0};
    for (const RequestSpan& r : h.requests) {
      const double end = std::max(r.end_us, r.start_us);
      if (r.start_us > covered) {
        const double gap = r.start_us - covered;
        double input_ready = 0, output_ready = 0;
        if (r.tile != previous_tile) {
          if (xd->hop > 0) input_ready = done_at(xd->hop - 1, r.tile);
          if (xd->hop < last && r.tile >= slots) output_ready = done_at(xd->hop + 1, r.tile - slots);
        }
        const double blocked = std::clamp(std::max(input_ready, output_ready) - covered, 0.0, gap);
        (input_ready >= output_ready ? h.waiting_input_us : h.waiting_output_us) += blocked;
        h.scheduling_us += gap - blocked;
      }
      h.busy_us += std::max(0.0, end - std::max(r.start_us, covered));
      covered = std::max(covered, end);
      previous_tile = r.tile;
    }
    h.end_us = covered;
    out.push_back(std::move(h));
  }
  return out;
}

CopyTiling describe_tiling(const TileGrid& grid, const Rect& space) {
  CopyTiling out;
  out.tiles.reserve(grid.count());
  for (std::uint64_t i = 0; i < grid.count(); ++i) {
    CopyTile t;
    t.rect = grid.tile(i);
    std::uint64_t stride = 1;
    for (int d = 0; d < space.dims(); ++d) {
      auto k = static_cast<std::size_t>(d);
      t.first_point += static_cast<std::uint64_t>(t.rect.lo()[k] - space.lo()[k]) * stride;
      stride *= static_cast<std::uint64_t>(space.extent(d));
    }
    t.points = t.rect.volume();
    out.tiles.push_back(t);
  }
  out.tile_points = out.tiles.empty() ? 0 : out.tiles.front().points;
  return out;
}

// ------------------------------------------------------------------------------------ Engine

void PreconditionWaiter::event_triggered(const FailureCause& failure) {
  op_->engine->on_precondition(op_, failure);
  delete this;
}

Engine::Engine(RuntimeImpl& runtime)
    : runtime_(runtime), buffer_cache_(settings::get_bytes("CARAVAN_DMA_IDLE_BUFFER_BYTES")) {
  request_floor_bytes_ = settings::get_bytes("CARAVAN_DMA_REQUEST_BYTES");
  gpu_request_us_ = settings::get_int("CARAVAN_GPU_REQUEST_US");
  tile_bytes_ = settings::get_bytes("CARAVAN_DMA_TILE_BYTES");
  pool_bytes_ = settings::get_bytes("CARAVAN_DMA_POOL_BYTES");
  slots_ = static_cast<int>(settings::get_int("CARAVAN_DMA_SLOTS"));
  // Seconds to nanoseconds, saturating: inf (or anything past 292 years) means never.
  const double stall_s = settings::get_double("CARAVAN_DMA_STALL_S");
  stall_ns_ =
      stall_s * 1e9 >= 9.0e18 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(stall_s * 1e9);
  network_ = runtime.network();
  auto machine = live_machine(static_cast<std::uint32_t>(runtime.rank()), runtime.ranks());
  multipath_min_bytes_ = settings::get_bytes("CARAVAN_DMA_MULTIPATH_MIN_BYTES");
  multipath_learn_ = settings::get_double("CARAVAN_DMA_MULTIPATH_LEARN");
  graph_ = std::make_shared<const planner::TransferGraph>(machine);
  for (std::size_t v = 0; v < graph_->memory_count(); ++v)
    if (graph_->memory(static_cast<std::uint32_t>(v)).id.kind == MemoryKind::fbm) {
      runtime.note_uses_gpu();  // copies through GPUs: waits on them poll longer (CARAVAN_WAIT_SPIN_US)
      break;
    }
  planner_ = std::make_unique<planner::Planner>(graph_);
  workers_ = make_workers(*graph_);
  for (std::size_t v = 0; v < graph_->memory_count(); ++v)
    pools_[graph_->memory(static_cast<std::uint32_t>(v)).id].capacity = pool_bytes_;
  watchdog_ = std::thread([this] { watchdog_main(); });
  dist_init();
  log::get("dma")->info("DMA engine started: {} channels on {}", graph_->channel_count(), graph_->name());
}

std::vector<std::unique_ptr<DmaWorker>> Engine::make_workers(const planner::TransferGraph& graph) {
  std::vector<std::unique_ptr<DmaWorker>> workers(graph.channel_count());
  int memcpy_threads = static_cast<int>(settings::get_int("CARAVAN_MEMCPY_THREADS"));
  std::uint64_t split = settings::get_bytes("CARAVAN_MEMCPY_SPLIT_BYTES");
  [[maybe_unused]] int gpu_streams = static_cast<int>(settings::get_int("CARAVAN_GPU_STREAMS"));
  [[maybe_unused]] int gpu_window = static_cast<int>(settings::get_int("CARAVAN_GPU_WINDOW"));
  for (std::uint32_t c = 0; c < graph.channel_count(); ++c) {
    const auto& ch = graph.channel(c);
    std::string name = fmt::format("{} {}->{}", to_string(ch.kind), graph.memory(ch.src).id.to_string(),
                                   graph.memory(ch.dst).id.to_string());
    std::unique_ptr<Channel> impl;
    // A channel is run by the rank that owns its source memory; other ranks' channels (in the
    // graph of a job) get no worker here.
    if (graph.memory(ch.src).id.rank != static_cast<std::uint32_t>(runtime_.rank())) continue;
    if (ch.kind == ChannelKind::memcpy)
      impl = std::make_unique<channels::MemcpyChannel>(memcpy_threads, split,
                                                       settings::get_bytes("CARAVAN_DMA_INLINE_BYTES"));
    else if (ch.kind == ChannelKind::file) impl = std::make_unique<channels::FileChannel>();
    else if (ch.kind == ChannelKind::nic && network_)
      impl = std::make_unique<channels::NicChannel>(network_->rma(), graph.memory(ch.src).id, graph.memory(ch.dst).id,
                                                    static_cast<int>(settings::get_int("CARAVAN_NIC_WINDOW")));
#if CARAVAN_HAVE_GPU
    // GPU channels of the live machine: sdma on the GPU of its fbm end, xgmi on the source GPU.
    // On a planning-only machine (a machine file) with no such GPU here, there is no
    // implementation, and copies that need one fail with "no implementation of channel".
    else if (ch.kind == ChannelKind::sdma || ch.kind == ChannelKind::xgmi) {
      MemoryId src = graph.memory(ch.src).id, dst = graph.memory(ch.dst).id;
      MemoryId gpu_end = src.kind == MemoryKind::fbm ? src : dst;
      const auto& devices = gpu::topology().devices;
      const auto me = static_cast<std::uint32_t>(runtime_.rank());
      bool here = gpu_end.kind == MemoryKind::fbm && src.rank == me && dst.rank == me &&
                  gpu_end.index < devices.size() && (dst.kind != MemoryKind::fbm || dst.index < devices.size());
      // Into the GPU memory of another rank of this node (mapped through IPC when a copy starts):
      // this rank's GPU runs it, as it runs its own peer copies.
      bool into_rank = src.kind == MemoryKind::fbm && dst.kind == MemoryKind::fbm && src.rank == me && dst.rank != me &&
                       src.node == dst.node && src.index < devices.size() && dst.index < devices.size();
      if ((here || into_rank) && ch.kind == ChannelKind::sdma)
        impl = std::make_unique<channels::SdmaChannel>(gpu_end, gpu_streams, gpu_window);
      else if (((here && gpu::topology().can_peer(static_cast<int>(src.index), static_cast<int>(dst.index))) || into_rank) &&
               src.kind == MemoryKind::fbm && dst.kind == MemoryKind::fbm)
        impl = std::make_unique<channels::XgmiChannel>(src, dst, gpu_streams, gpu_window);
    } else if (ch.kind == ChannelKind::gpu_convert) {
      MemoryId src = graph.memory(ch.src).id, dst = graph.memory(ch.dst).id;
      if (src == dst && src.kind == MemoryKind::fbm && src.rank == static_cast<std::uint32_t>(runtime_.rank()) &&
          src.index < gpu::topology().devices.size())
        impl = std::make_unique<channels::GpuConvertChannel>(src, gpu_streams, gpu_window);
    }
#endif
    if (impl) workers[c] = std::make_unique<DmaWorker>(*this, std::move(impl), std::move(name));
  }
  return workers;
}

Engine::~Engine() {
  shutdown();
  // The workers go first, while the rest of the engine is still there: destroying a GPU channel
  // joins its completion thread, and a channel that completes outstanding requests as it goes
  // calls back into the engine.
  workers_.clear();
}

Engine& Engine::current() {
  RuntimeImpl* rt = RuntimeImpl::current();
  if (!rt) throw Error(Errc::shut_down, "no Caravan runtime is running (create a caravan::Runtime first)");
  return static_cast<Engine&>(rt->service("dma", [rt] { return std::make_unique<Engine>(*rt); }));
}

DmaWorker& Engine::worker_for(std::uint32_t graph_channel) {
  if (graph_channel >= workers_.size() || !workers_[graph_channel])
    throw Error(Errc::invalid_argument,
                fmt::format("no implementation of channel {} ({} {} -> {}) on this rank", graph_channel,
                            to_string(graph_->channel(graph_channel).kind),
                            graph_->memory(graph_->channel(graph_channel).src).id.to_string(),
                            graph_->memory(graph_->channel(graph_channel).dst).id.to_string()));
  return *workers_[graph_channel];
}

std::uint32_t Engine::channel_between(MemoryId src, MemoryId dst, ChannelKind kind) const {
  std::optional<std::uint32_t> from = graph_->find(src), to = graph_->find(dst);
  if (from && to)
    for (std::uint32_t c : graph_->out_channels(*from))
      if (graph_->channel(c).dst == *to && graph_->channel(c).kind == kind) return c;
  throw Error(Errc::not_found, fmt::format("no {} channel from {} to {} in this rank's transfer graph", to_string(kind),
                                           src.to_string(), dst.to_string()));
}

namespace {

// The first difference between two field spaces, for an error message.
std::string field_difference(const FieldSpace& src, const FieldSpace& dst) {
  const auto& a = src.fields();
  const auto& b = dst.fields();
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i].name != b[i].name || a[i].size != b[i].size)
      return fmt::format("field {} is '{}' ({} bytes) in src and '{}' ({} bytes) in dst", i, a[i].name, a[i].size,
                         b[i].name, b[i].size);
  const bool src_longer = a.size() > b.size();
  const Field& extra = src_longer ? a[b.size()] : b[a.size()];
  return fmt::format("src has {} fields and dst {}; the first one only {} has is '{}' ({} bytes)", a.size(), b.size(),
                     src_longer ? "src" : "dst", extra.name, extra.size);
}

}  // namespace

void Engine::check_common(const Instance& inst, const char* what) const {
  if (!inst.valid()) throw Error(Errc::invalid_argument, fmt::format("{}: the instance is empty (use Instance::create)", what));
  graph_->require(inst.memory(), what);
}

planner::TransferRequest Engine::make_request(const Instance& src, const Instance& dst,
                                              const std::optional<Rect>& region) const {
  check_common(src, "src memory");
  check_common(dst, "dst memory");
  if (region) {
    const Rect& r = *region;
    const auto inside = [&r](const Rect& space) { return space.contains(r); };
    if (r.dims() == 0)
      throw Error(Errc::invalid_argument, "copy: CopyOptions::region is an empty Rect (give the points to copy)");
    if (r.dims() != src.space().dims() || r.dims() != dst.space().dims())
      throw Error(Errc::invalid_argument,
                  fmt::format("copy: CopyOptions::region {} has {} dimension(s); the src index space {} has {} and "
                              "the dst index space {} has {}",
                              r.to_string(), r.dims(), src.space().to_string(), src.space().dims(),
                              dst.space().to_string(), dst.space().dims()));
    if (!inside(src.space()) || !inside(dst.space()))
      throw Error(Errc::invalid_argument,
                  fmt::format("copy: CopyOptions::region {} must lie inside both index spaces; it is not inside the "
                              "{} index space {}",
                              r.to_string(), inside(src.space()) ? "dst" : "src",
                              (inside(src.space()) ? dst : src).space().to_string()));
  } else if (!(src.space() == dst.space())) {
    throw Error(Errc::invalid_argument,
                fmt::format("copy: src index space {} differs from dst index space {} (to copy the points both hold, "
                            "name them in CopyOptions::region)",
                            src.space().to_string(), dst.space().to_string()));
  }
  if (!(src.fields() == dst.fields()))
    throw Error(Errc::invalid_argument,
                fmt::format("copy: src and dst field spaces differ: {}", field_difference(src.fields(), dst.fields())));
  planner::TransferRequest r;
  r.src = src.memory();
  r.dst = dst.memory();
  r.space = region ? *region : src.space();
  r.fields = src.fields();
  r.src_layout = src.layout();
  r.dst_layout = dst.layout();
  // A region narrower than an instance reads or writes it in runs shorter than the region: the
  // planner rates the first and last hop by those runs.
  if (region && !(*region == src.space())) r.src_instance_space = src.space();
  if (region && !(*region == dst.space())) r.dst_instance_space = dst.space();
  r.validate();
  return r;
}

std::shared_ptr<const planner::Plan> Engine::plan(const Instance& src, const Instance& dst, PlannerChoice choice,
                                                  const std::optional<Rect>& region) {
  planner::TransferRequest request = make_request(src, dst, region);
  switch (choice) {
    case PlannerChoice::automatic: return planner_->plan(request);
    case PlannerChoice::simple: return std::make_shared<planner::Plan>(planner::plan_simple(*graph_, request, planner_->options()));
    case PlannerChoice::full: return std::make_shared<planner::Plan>(planner::plan_full(*graph_, request, planner_->options()));
    case PlannerChoice::multipath: {
      planner::MultiPlan multi = planner_->plan_multipath(request);
      if (multi.shares.size() != 1)
        throw Error(Errc::invalid_argument,
                    fmt::format("plan: the multi-path plan of {} -> {} has {} paths, not one plan (see plan_copy_multipath)",
                                request.src.to_string(), request.dst.to_string(), multi.shares.size()));
      return std::make_shared<planner::Plan>(std::move(multi.shares.front().plan));
    }
  }
  throw Error(Errc::invalid_argument, "copy: unknown planner choice");
}

// GPU channels size their requests from CARAVAN_GPU_REQUEST_US alone. Each copy-engine call
// costs a few microseconds, so a peer copy runs at 80% of its peak in 4 MiB requests and a host
// link at 96%; at 250 us a request both are at 99% (docs/dma.md, GPU channels). The setting is
// also what a high-priority copy waits for (the request running and the one queued behind it),
// so the calibrated table no longer raises it. The earlier rule, "and at least where the table
// reaches 99% of its peak", lands between the table's 16 and 64 MiB points whenever those differ
// by more than 1% (up to 1.2 ms of work over PCIe), and the setting could then not shorten the
// wait: the nineteenth session's 2 x H200 runs sent 32 MiB host-link requests (docs/gpu.md,
// priorities). Host channels peak by 4 MiB, so the 99% rule keeps them at 4 MiB.
std::uint64_t full_speed_request_bytes(const planner::Channel& channel, std::int64_t gpu_request_us) {
  constexpr std::uint64_t kMiB = 1u << 20;
  double r = 0;
  if (channel.kind == ChannelKind::sdma || channel.kind == ChannelKind::xgmi || channel.kind == ChannelKind::gpu_convert)
    r = channel.tp.peak() * 1e3 * static_cast<double>(gpu_request_us);
  else
    r = channel.tp.inverse(0.99 * channel.tp.peak());
  if (!(r > static_cast<double>(4 * kMiB))) return 4 * kMiB;
  auto bytes = static_cast<std::uint64_t>(std::min(r, 256.0 * kMiB));
  return (bytes + kMiB - 1) / kMiB * kMiB;
}

// Requests stay near the batch size (the granularity at which a higher-priority copy can take the
// channel). A group (interleave.h: the fields of a layout conversion, rows at one distance) is
// never split between requests except by cutting it: by row range, each piece all members of its
// rows, or by element range within a row, all members side by side; so that each request reads
// (or writes) its part of the interleaved side once instead of once per field.
std::vector<std::size_t> cut_requests(std::vector<TransferOp>& ops, std::uint64_t limit) {
  std::vector<std::size_t> ends;
  std::uint64_t total = 0;
  for (const TransferOp& op : ops) total += op.bytes();
  if (total <= limit) return ends;  // one request: most tiles
  // The list is copied only from the first group whose bytes exceed the limit, with the ops
  // before it (the indices in `ends` hold for both).
  std::vector<TransferOp> out;
  bool cutting = false;  // out holds ops[0, i), cut where needed
  std::size_t i = 0;
  std::uint64_t open = 0;  // bytes of the request being filled
  // Called before `bytes` more join the list: they start a new request if the open one has no
  // room. The list is out once cutting, ops itself (up to i) before.
  auto place = [&](std::uint64_t bytes) {
    if (open > 0 && open + bytes > limit) {
      ends.push_back(cutting ? out.size() : i);
      open = 0;
    }
    open += bytes;
  };
  while (i < ops.size()) {
    const OpGroup g = op_group_at(ops.data(), ops.size(), i);
    const TransferOp& lead = ops[i];
    const std::uint64_t group_bytes = g.size() * lead.bytes();
    if (group_bytes <= limit) {
      place(group_bytes);
      if (cutting)
        out.insert(out.end(), ops.begin() + static_cast<std::ptrdiff_t>(i),
                   ops.begin() + static_cast<std::ptrdiff_t>(i + g.size()));
      i += g.size();
      continue;
    }
    if (!cutting) {
      out.reserve(ops.size() + 8);
      out.assign(ops.begin(), ops.begin() + static_cast<std::ptrdiff_t>(i));
      cutting = true;
    }
    auto member = [&](std::size_t m, std::size_t r) { return group_row(ops.data(), i, g, m, r); };
    const std::uint64_t row_bytes = g.members * lead.row_bytes();
    if (row_bytes <= limit) {
      // Whole rows: as many as fit, each piece in the group's own op order.
      const std::size_t per_piece = static_cast<std::size_t>(limit / row_bytes);
      for (std::size_t a = 0; a < g.rows; a += per_piece) {
        const std::size_t b = std::min(g.rows, a + per_piece);
        place((b - a) * row_bytes);
        if (g.row_index == 0) {  // ops of several rows: each member's op, rows [a, b)
          for (std::size_t m = 0; m < g.members; ++m) out.push_back(ops[i + m * g.member_index].rows_from(a, b - a));
        } else if (g.member_index == 1) {
          for (std::size_t r = a; r < b; ++r)
            for (std::size_t m = 0; m < g.members; ++m) out.push_back(member(m, r));
        } else {
          for (std::size_t m = 0; m < g.members; ++m)
            for (std::size_t r = a; r < b; ++r) out.push_back(member(m, r));
        }
      }
    } else {
      // Rows longer than a request: each row by element range, its members side by side.
      const std::uint64_t per_piece = std::max<std::uint64_t>(limit / (g.members * lead.elem), 1);
      std::vector<TransferOp> rest(g.members);
      for (std::size_t r = 0; r < g.rows; ++r) {
        for (std::size_t m = 0; m < g.members; ++m) rest[m] = member(m, r);
        if (lead.count == 1) {  // a run (one member): pieces of the limit
          while (rest[0].bytes() > limit) {
            place(limit);
            out.push_back(split_front(rest[0], limit));
          }
        } else {
          while (rest[0].count > per_piece) {
            place(per_piece * lead.elem * g.members);
            for (TransferOp& part : rest) out.push_back(split_front(part, per_piece * lead.elem));
          }
        }
        place(rest[0].bytes() * g.members);
        out.insert(out.end(), rest.begin(), rest.end());
      }
    }
    i += g.size();
  }
  if (cutting) ops.swap(out);
  ends.push_back(ops.size());
  return ends;
}

// Sizes tiles and intermediate buffers: each buffer is a ring of `slots` tile slots and stays
// within the planner's buffer threshold TH; each hop gets one XD.
std::uint64_t Engine::choose_tile_points(const Rect& space, const FieldSpace& fields, const std::vector<planner::Hop>& hops,
                                         std::vector<std::uint64_t>& slot_bytes) const {
  const std::uint64_t point_bytes = std::max<std::uint64_t>(fields.total_size(), 1);
  const auto slots = static_cast<std::uint64_t>(slots_);
  std::uint64_t tile_bytes = tile_bytes_;
  if (hops.size() > 1) tile_bytes = std::min(tile_bytes, planner_->options().buffer_threshold / slots);
  // One hop has no intermediate buffer: its tiles may hold a full-speed request of its channel.
  else if (hops.size() == 1) tile_bytes = std::max(tile_bytes, full_speed_request_bytes(graph_->channel(hops[0].channel), gpu_request_us_));
  std::uint64_t tile_points = 1;
  for (;;) {
    tile_points = std::max<std::uint64_t>(tile_bytes / point_bytes, 1);
    TileGrid grid(space, tile_points);
    slot_bytes.clear();
    bool fits = true;
    Rect largest = grid.largest();
    for (std::size_t i = 0; i + 1 < hops.size(); ++i) {
      // Every tile fits in the largest tile's footprint: extents only shrink, and so does padding.
      std::uint64_t bytes = (total_bytes(slot_layout(hops[i].dst_layout, largest), largest, fields) + 63) / 64 * 64;
      if (bytes * slots > planner_->options().buffer_threshold) fits = false;
      slot_bytes.push_back(bytes);
    }
    if (fits || tile_bytes <= point_bytes) break;
    tile_bytes /= 2;  // padding of blocked layouts made a slot too big: smaller tiles
  }
  return tile_points;
}

void Engine::prepare_pipeline(CopyOperation& op, const std::vector<planner::Hop>& hops) {
  op.slots = slots_;
  std::vector<std::uint64_t> slot_bytes;
  const std::uint64_t tile_points = choose_tile_points(op.space, op.fields, hops, slot_bytes);
  std::vector<std::uint64_t> request_bytes;
  for (const planner::Hop& hop : hops) {
    // At least the size where the channel's calibrated throughput reaches 90% of its peak: the
    // plan's request is the longest run the layouts allow, which for a file hop can be far below
    // what the disk needs (256 KiB file requests ran a dsk->sys->dsk pipeline below its staged
    // version; 4 MiB ones ran it 1.66x faster). Channels that peak early keep the smaller floor,
    // and so their finer priority pre-emption.
    const planner::Channel& channel = graph_->channel(hop.channel);
    const double efficient = channel.tp.inverse(0.9 * channel.tp.peak());
    const std::uint64_t wanted = std::max<std::uint64_t>(hop.request_bytes, std::isfinite(efficient) ? static_cast<std::uint64_t>(efficient) : 0);
    request_bytes.push_back(std::clamp<std::uint64_t>(wanted, request_floor_bytes_,
                                                      std::max(request_floor_bytes_, full_speed_request_bytes(channel, gpu_request_us_))));
  }
  const auto me = static_cast<std::uint32_t>(runtime_.rank());
  build_pipeline(op, hops, tile_points, slot_bytes, request_bytes, [&](std::size_t i) { return hops[i].src.rank == me; });
  if (op.dist) op.dist->tile_points = tile_points;
}

void Engine::build_pipeline(CopyOperation& op, const std::vector<planner::Hop>& hops, std::uint64_t tile_points,
                            const std::vector<std::uint64_t>& slot_bytes, const std::vector<std::uint64_t>& request_bytes,
                            const std::function<bool(std::size_t hop)>& runs_here) {
  op.grid = TileGrid(op.space, tile_points);
  // A ring never needs more slots than the copy has tiles: a one-tile copy reserves one.
  op.slots = static_cast<int>(std::clamp<std::uint64_t>(op.grid.count(), 1, static_cast<std::uint64_t>(op.slots)));
  op.buffers.clear();
  for (std::size_t i = 0; i + 1 < hops.size(); ++i) {
    CopyOperation::BufferSpec b;
    b.memory = hops[i].dst;
    b.layout = hops[i].dst_layout;
    b.slot_bytes = slot_bytes.at(i);
    op.buffers.push_back(b);
  }
  op.xds.clear();
  for (std::size_t i = 0; i < hops.size(); ++i) {
    auto xd = std::make_unique<Xd>();
    xd->op = &op;
    xd->hop = i;
    xd->worker = runs_here(i) ? &worker_for(hops[i].channel) : nullptr;
    xd->src_layout = hops[i].src_layout;
    xd->dst_layout = hops[i].dst_layout;
    xd->request_bytes = request_bytes.at(i);
    op.xds.push_back(std::move(xd));
  }
  // Reservations in one global memory order (MemoryId order), so that copies that wait for
  // buffers while holding others can never wait in a cycle. Only this rank's memories: the
  // other ranks of a copy reserve theirs, one after another in the same order (remote_copy.cpp).
  const auto me = static_cast<std::uint32_t>(runtime_.rank());
  std::map<MemoryId, std::uint64_t> per_memory;
  for (const auto& b : op.buffers)
    if (b.memory.rank == me) per_memory[b.memory] += b.slot_bytes * static_cast<std::uint64_t>(op.slots);
  op.reservation_order.clear();
  for (const auto& [memory, bytes] : per_memory) {
    if (bytes > pool_bytes_)
      throw Error(Errc::invalid_argument,
                  fmt::format("copy needs {} bytes of intermediate buffers in {}, more than its pool holds "
                              "(CARAVAN_DMA_POOL_BYTES={}); lower CARAVAN_PLANNER_BUFFER_THRESHOLD or raise the pool",
                              bytes, memory.to_string(), pool_bytes_));
    op.reservation_order.emplace_back(memory, bytes);
  }
}

namespace {
// The rules of CopyOptions::signal that need no plan.
void check_signal_fields(const TileSignal& signal, const char* call) {
  if (!signal.flags) {
    if (signal.value != 0 || signal.tiles != 0)
      throw Error(Errc::invalid_argument,
                  fmt::format("{}: CopyOptions::signal.flags is null but signal.value ({}) or signal.tiles ({}) is set; "
                              "give the landing-flag array, or leave the whole signal empty for no flags",
                              call, signal.value, signal.tiles));
    return;
  }
  if (signal.value == 0)
    throw Error(Errc::invalid_argument,
                fmt::format("{}: CopyOptions::signal.value must be nonzero: flags start at 0, so 0 cannot say "
                            "'landed' (use an epoch that grows with every copy)", call));
  if (reinterpret_cast<std::uintptr_t>(signal.flags) % alignof(std::uint64_t) != 0)
    throw Error(Errc::invalid_argument,
                fmt::format("{}: CopyOptions::signal.flags ({}) must be 8-byte aligned (each flag is written as one "
                            "64-bit word)", call, static_cast<const void*>(signal.flags)));
  if (signal.tiles == 0)
    throw Error(Errc::invalid_argument,
                fmt::format("{}: CopyOptions::signal.tiles must give the number of flags at signal.flags (the copy's "
                            "tile count: copy_tiling(src, dst).tiles.size())", call));
}

// CopyTiling promises that tile i + 1 starts where tile i ends in the order that runs dimension 0
// fastest, so that a consumer may take a tile for a range of points (a byte range of an "F,x,y"
// instance). A multi-path copy tiles each slab along plan.split_dim on its own; concatenated in
// slab order, those tiles keep the promise exactly when every slab is itself a run of
// consecutive points, i.e. when no dimension above the split one has more than one coordinate.
// Otherwise refuse: a first_point range that is not the tile would mislead a consumer silently.
void check_multipath_tiles_consecutive(const planner::MultiPlan& plan, const Instance& src, const Instance& dst,
                                       const Rect& space, const char* call) {
  for (int d = plan.split_dim + 1; d < space.dims(); ++d) {
    if (space.extent(d) <= 1) continue;
    throw Error(Errc::invalid_argument,
                fmt::format("{}: landing flags over several paths need the slabs cut along the outermost dimension of "
                            "the index space (that has more than one coordinate), so that each tile is a run of "
                            "consecutive points and tile i + 1 starts where tile i ends (CopyTiling); the multi-path "
                            "plan of {} -> {} cuts {} along dimension {}, the outermost of the source layout '{}', and "
                            "dimension {} above it has {} coordinates. Give the source a layout whose outermost "
                            "dimension is the space's last (e.g. F,x,y), or use PlannerChoice::full for this copy",
                            call, src.memory().to_string(), dst.memory().to_string(), space.to_string(), plan.split_dim,
                            src.layout().to_string(), d, space.extent(d)));
  }
}
}  // namespace

Event Engine::copy(const Instance& src, const Instance& dst, const CopyOptions& options) {
  detail::check_priority(options.priority, "copy");
  const std::int64_t called_ns = now_ns();
  std::shared_ptr<const planner::Plan> plan;
  if (wants_multipath(src, dst, options)) {
    std::string learn_key;
    planner::MultiPlan multi = runnable_multipath_plan(src, dst, &learn_key, options.region);
    // Copies with landing flags keep the planned cut: their flags were sized by copy_tiling.
    if (multi.shares.size() > 1 && multipath_learn_.load(std::memory_order_relaxed) > 0 && !options.signal.flags)
      spread_by_learned_rates(multi, learn_key, copied_space(src, options));
    else
      learn_key.clear();  // nothing to learn into
    if (multi.shares.size() > 1) return copy_multipath(src, dst, multi, options, called_ns, std::move(learn_key));
    // One path: the copy is exactly what it would be without multi-path (the full planner's
    // path when asked for explicitly, today's automatic plan otherwise).
    if (options.planner == PlannerChoice::multipath && !multi.shares.empty())
      plan = std::make_shared<planner::Plan>(multi.shares.front().plan);
  }
  if (!plan) plan = this->plan(src, dst, options.planner, options.region);
  auto op = prepare_copy(src, dst, *plan, copied_space(src, options), options, called_ns);
  return submit(std::move(op), options.precondition);
}

planner::MultiPlan Engine::runnable_multipath_plan(const Instance& src, const Instance& dst, std::string* key,
                                                   const std::optional<Rect>& region) {
  std::string scratch;
  planner::MultiPlan multi = *plan_multipath(src, dst, key ? *key : scratch, region);
  // Every slab is whole rows; one that rounded to nothing has no path (the planner drops those
  // already).
  std::erase_if(multi.shares, [](const planner::PathShare& share) { return share.piece.volume() == 0; });
  return multi;
}

bool Engine::writes_peer_gpu_directly(const Instance& src, const Instance& dst, const planner::Plan& plan) const {
  const auto me = static_cast<std::uint32_t>(runtime_.rank());
  const MemoryId to = dst.memory();
  if (plan.hops.empty() || dst.impl()->gpu_target.empty() || src.memory().rank != me || to.rank == me ||
      to.node != src.memory().node || !settings::get_bool("CARAVAN_DMA_IPC_DIRECT"))
    return false;
  for (std::size_t i = 0; i < plan.hops.size(); ++i) {
    const planner::Hop& hop = plan.hops[i];
    const bool last = i + 1 == plan.hops.size();
    if (hop.src.rank != me || (last ? hop.dst != to : hop.dst.rank != me)) return false;
    if (last && hop.kind != ChannelKind::xgmi && hop.kind != ChannelKind::sdma) return false;
  }
  return true;
}

bool Engine::wants_multipath(const Instance& src, const Instance& dst, const CopyOptions& options) const {
  const bool asked = options.planner == PlannerChoice::multipath;
  if (!asked && (options.planner != PlannerChoice::automatic || multipath_min_bytes_ == 0 || options.signal.flags))
    return false;
  if (!src.valid() || !dst.valid()) return false;  // make_request says why
  const auto me = static_cast<std::uint32_t>(runtime_.rank());
  const bool local = src.memory().rank == me && dst.memory().rank == me;
  if (asked && !local)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: PlannerChoice::multipath is for copies within this rank; {} -> {} crosses ranks "
                            "(use PlannerChoice::automatic or full)", src.memory().to_string(), dst.memory().to_string()));
  if (!local) return false;
  return asked || copied_space(src, options).volume() * src.fields().total_size() >= multipath_min_bytes_;
}

std::shared_ptr<CopyOperation> Engine::prepare_copy(const Instance& src, const Instance& dst, const planner::Plan& plan,
                                                    const Rect& piece, const CopyOptions& options, std::int64_t called_ns) {
  auto op = std::make_shared<CopyOperation>();
  op->called_ns = called_ns;
  op->engine = this;
  op->priority = options.priority;
  op->report = options.report;
  op->set_route(plan.hops);
  op->predicted_gbps = plan.predicted_gbps;
  op->src_instance = src;
  op->dst_instance = dst;
  op->src_storage = src.impl()->storage;
  op->dst_storage = dst.impl()->storage;
  op->space = piece;
  op->fields = src.fields();
  // The views cover the whole instances (a multi-path part's tiles address its slab in them).
  op->src_view = View::of_layout(src.layout(), src.space(), op->fields, 0);
  op->dst_view = View::of_layout(dst.layout(), dst.space(), op->fields, 0);
  // Hops or instances on other ranks: a cross-rank copy (remote_copy.cpp).
  const auto me = static_cast<std::uint32_t>(runtime_.rank());
  bool spans_ranks = src.memory().rank != me || dst.memory().rank != me;
  for (const planner::Hop& hop : plan.hops) spans_ranks = spans_ranks || hop.src.rank != me || hop.dst.rank != me;
  if (spans_ranks && writes_peer_gpu_directly(src, dst, plan)) {
    op->dst_storage = map_target(dst.memory(), plan.hops.back(), dst.impl()->gpu_target, 0);
    spans_ranks = false;  // a copy of this rank from here on, into mapped memory
  }
  if (spans_ranks && options.signal.flags)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: CopyOptions::signal is not supported for copies across ranks yet ({} -> {}, "
                            "route {}): landing flags are written only by copies whose hops all run on this rank",
                            src.memory().to_string(), dst.memory().to_string(), plan.route()));
  if (spans_ranks) {
    op->dist = std::make_unique<DistributedState>();
    op->dist->hops = plan.hops;
  }
  prepare_pipeline(*op, plan.hops);
  check_signal(*op, options.signal);
  if (op->dist) dist_prepare(*op);
  return op;
}

namespace {
// Runs the engine's bookkeeping when a part of a multi-path copy triggers its event.
class PartWaiter final : public detail::EventWaiter {
 public:
  explicit PartWaiter(std::shared_ptr<MultiCopy> multi) : multi_(std::move(multi)) {}
  void event_triggered(const FailureCause& failure) override {
    multi_->engine->multipath_part_done(multi_, failure);
    delete this;
  }

 private:
  std::shared_ptr<MultiCopy> multi_;
};
}  // namespace

Event Engine::copy_multipath(const Instance& src, const Instance& dst, const planner::MultiPlan& plan,
                             const CopyOptions& options, std::int64_t called_ns, std::string learn_key) {
  check_signal_fields(options.signal, "copy");
  if (options.signal.flags) check_multipath_tiles_consecutive(plan, src, dst, copied_space(src, options), "copy");
  auto multi = std::make_shared<MultiCopy>();
  multi->engine = this;
  multi->report = options.report;
  multi->called_ns = called_ns;
  multi->predicted_gbps = plan.predicted_gbps;
  multi->bytes = plan.bytes;
  multi->route = fmt::format("{} paths:", plan.shares.size());
  for (std::size_t i = 0; i < plan.shares.size(); ++i)
    multi->route += fmt::format("{} {}", i ? " |" : "", plan.shares[i].plan.route());
  multi->shares = plan.shares;
  multi->part_reports.resize(plan.shares.size());
  multi->learn_key = std::move(learn_key);
  // Every part is prepared (and so checked: channels, pool sizes, flags) before any is submitted.
  // Landing flags are handed out below, once every part's tile count is known.
  CopyOptions part_options = options;
  part_options.signal = {};
  for (std::size_t i = 0; i < plan.shares.size(); ++i) {
    const planner::PathShare& share = plan.shares[i];
    part_options.report = options.report ? &multi->part_reports[i] : nullptr;
    auto part = prepare_copy(src, dst, share.plan, share.piece, part_options, called_ns);
    if (part->dist)
      throw Error(Errc::internal, fmt::format("copy: path {} of a multi-path copy crosses ranks ({})", i, part->route()));
    multi->parts.push_back(std::move(part));
  }
  if (options.signal.flags) {
    // The copy's tiles are its parts' tiles in slab order (copy_tiling), so part i's flags are
    // the caller's array from the tiles of the parts before it on; each part's last hop then
    // writes its own tiles' flags as any copy does.
    std::uint64_t tiles = 0;
    std::string per_path;
    for (const auto& part : multi->parts) {
      per_path += fmt::format("{}{}", tiles ? " + " : "", part->grid.count());
      tiles += part->grid.count();
    }
    if (tiles != options.signal.tiles)
      throw Error(Errc::invalid_argument,
                  fmt::format("copy: CopyOptions::signal.tiles is {}, but this multi-path copy ({}) is cut into {} "
                              "tile(s) ({} over its {} paths, in slab order); size the flags by copy_tiling(src, dst, "
                              "PlannerChoice::multipath)", options.signal.tiles, multi->route, tiles, per_path,
                              multi->parts.size()));
    std::uint64_t first = 0;
    for (const auto& part : multi->parts) {
      const std::uint64_t count = part->grid.count();
      check_signal(*part, TileSignal{.flags = options.signal.flags + first, .value = options.signal.value, .tiles = count});
      first += count;
    }
  }
  multi->remaining = multi->parts.size();
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error(Errc::shut_down, "copy: the runtime is shutting down");
    multi->done = runtime_.events().create();
    multi_.emplace(multi->done, multi);
  }
  const Event done = multi->done;
  FailureCause refused;  // submit() refuses only once a shutdown has begun
  std::size_t submitted = 0;
  for (; submitted < multi->parts.size(); ++submitted) {
    auto& part = multi->parts[submitted];
    part->part_of = fmt::format("path {} of {} of copy {}", submitted + 1, multi->parts.size(), done.to_string());
    Event event;
    try {
      event = submit(part, options.precondition);
    } catch (const Error& e) {
      refused = std::make_shared<const Error>(e);
      break;
    }
    std::lock_guard lock(multi->mutex);
    multi->part_events.push_back(event);
  }
  if (refused) {
    {
      std::lock_guard lock(multi->mutex);
      if (!multi->failure) multi->failure = refused;
    }
    // The parts never submitted are done; the event triggers once the others have stopped.
    for (std::size_t k = submitted; k < multi->parts.size(); ++k) multipath_part_done(multi, refused);
  }
  // The waiters come after every submission, so that a part that fails at once finds each
  // sibling's event to stop.
  std::vector<Event> parts;
  {
    std::lock_guard lock(multi->mutex);
    parts = multi->part_events;
  }
  for (const Event& part : parts) runtime_.events().add_waiter(part, new PartWaiter(multi));
  if (refused) {
    for (const Event& part : parts) stop_copy(part, refused);
    throw Error(*refused);
  }
  return done;
}

void Engine::multipath_part_done(const std::shared_ptr<MultiCopy>& multi, const FailureCause& failure) {
  bool last = false, first_failure = false;
  std::vector<Event> parts;
  {
    std::lock_guard lock(multi->mutex);
    if (failure && !multi->failure) {
      multi->failure = failure;
      first_failure = true;
      parts = multi->part_events;
    }
    last = --multi->remaining == 0;
  }
  // The first failure stops the other paths with the same cause (those already done are not
  // found: stop_copy returns false for them).
  if (first_failure)
    for (const Event& part : parts) stop_copy(part, failure);
  if (last) finish_multipath(multi);
}

bool Engine::stop_multipath(const std::shared_ptr<MultiCopy>& multi, const FailureCause& cause) {
  std::vector<Event> parts;
  {
    std::lock_guard lock(multi->mutex);
    if (multi->remaining == 0) return false;
    if (!multi->failure) multi->failure = cause;
    parts = multi->part_events;
  }
  for (const Event& part : parts) stop_copy(part, cause);
  return true;
}

// Every part's event has triggered: the parts have released their buffers. Reports, then
// triggers the user's event.
void Engine::finish_multipath(const std::shared_ptr<MultiCopy>& multi) {
  if (multi->report) {
    CopyReport r;
    r.route = multi->route;
    r.predicted_gbps = multi->predicted_gbps;
    r.bytes = multi->bytes;
    r.slots = static_cast<std::uint64_t>(slots_);
    std::int64_t first_start = 0;
    for (const auto& part : multi->parts)
      if (part->started_ns && (!first_start || part->started_ns < first_start)) first_start = part->started_ns;
    for (std::size_t i = 0; i < multi->parts.size(); ++i) {
      const CopyOperation& part = *multi->parts[i];
      CopyPathReport path;
      path.piece = part.space;
      path.bytes = part.space.volume() * part.fields.total_size();
      path.share_gbps = multi->shares[i].gbps;
      path.report = std::move(multi->part_reports[i]);
      if (part.started_ns) {
        path.start_us = static_cast<double>(part.started_ns - first_start) / 1e3;
        path.end_us = path.start_us + path.report.elapsed_us;
      }
      r.tiles += path.report.tiles;
      r.elapsed_us = std::max(r.elapsed_us, path.end_us);
      r.paths.push_back(std::move(path));
    }
    if (first_start) {
      r.setup_us = static_cast<double>(first_start - multi->called_ns) / 1e3;
      r.teardown_us = us_since(first_start) - r.elapsed_us;
    }
    *multi->report = std::move(r);
  }
  FailureCause failure;
  {
    std::lock_guard lock(multi->mutex);
    failure = multi->failure;
  }
  if (!failure && !multi->learn_key.empty()) learn_path_rates(*multi);
  // Gone from the engine before its event triggers, as a copy leaves active_ (so that stats()
  // after the event shows it done; cancel() now returns false).
  {
    std::lock_guard lock(mutex_);
    multi_.erase(multi->done);
  }
  runtime_.events().trigger(multi->done, failure);
  std::lock_guard lock(mutex_);
  if (active_.empty() && multi_.empty()) idle_cv_.notify_all();
}

std::string Engine::multipath_key(const planner::TransferRequest& request) {
  std::string key = fmt::format("{} {} {} {} {}", request.src.to_string(), request.dst.to_string(), request.space.to_string(),
                                request.src_layout.to_string(), request.dst_layout.to_string());
  for (const Field& f : request.fields.fields()) key += fmt::format(" {}", f.size);
  // A region's instances bound its first and last hop's requests: the same rect in other
  // instances is another plan.
  if (request.src_instance_space) key += fmt::format(" in {}", request.src_instance_space->to_string());
  if (request.dst_instance_space) key += fmt::format(" out {}", request.dst_instance_space->to_string());
  return key;
}

// Why learn: the planner cuts a copy by modelled rates, but paths that share a host's memory
// system do not run at them. On 4 x H200 the direct PCIe path ran 43-45 GB/s beside three
// relays (PCIe, then NVLink) at 40-42, and the relays started 50-140 us later; cut in equal
// shares, the direct path sat idle for the last 400-500 us of a 6.5 ms copy. Measured since (4 x
// H200, 27th session): cut by learned rates, 0.987-1.001 of the planner's cut, because which path
// lags changes from copy to copy; so learning is off by default and serves paths that are
// steadily off their model (a stale calibration, a degraded link).
void Engine::spread_by_learned_rates(planner::MultiPlan& plan, const std::string& key, const Rect& space) {
  std::vector<double> rates;
  {
    std::lock_guard lock(multiplan_mutex_);
    auto it = learned_rates_.find(key);
    if (it == learned_rates_.end()) return;
    rates = it->second;
  }
  if (rates.size() == plan.shares.size()) planner::spread_shares(plan, space, rates);
}

void Engine::learn_path_rates(const MultiCopy& multi) {
  std::int64_t first_start = 0;
  for (const auto& part : multi.parts)
    if (part->started_ns && (!first_start || part->started_ns < first_start)) first_start = part->started_ns;
  std::vector<double> measured;  // GB/s = bytes per nanosecond
  for (const auto& part : multi.parts) {
    const std::int64_t ns = part->finished_ns - first_start;
    if (!first_start || !part->started_ns || !part->finished_ns || ns <= 0) return;  // nothing to learn from
    measured.push_back(static_cast<double>(part->space.volume() * part->fields.total_size()) / static_cast<double>(ns));
  }
  // The paths were cut by the plan's rates or by earlier learned ones; either way these are the
  // paths of the runnable plan, in its order (spread_shares drops none: rates are kept within a
  // factor of 4 of the plan's).
  std::lock_guard lock(multiplan_mutex_);
  auto cached = multiplans_.find(multi.learn_key);
  if (cached == multiplans_.end()) return;  // the plan cache was emptied: start again
  std::vector<double> planned;
  for (const planner::PathShare& share : cached->second->shares)
    if (share.piece.volume() > 0) planned.push_back(share.gbps);
  if (planned.size() != measured.size()) return;
  std::vector<double>& learned = learned_rates_[multi.learn_key];
  if (learned.size() != measured.size()) learned = measured;
  else
    for (std::size_t p = 0; p < learned.size(); ++p)
      learned[p] += multipath_learn_.load(std::memory_order_relaxed) * (measured[p] - learned[p]);
  // Only the ratios matter. Each path stays within a factor of 4 of its planned share, so that
  // one bad run cannot starve a path (a path given no rows would never be measured again).
  double sum_learned = 0, sum_planned = 0;
  for (std::size_t p = 0; p < learned.size(); ++p) {
    sum_learned += learned[p];
    sum_planned += planned[p];
  }
  const double scale = sum_learned / sum_planned;
  for (std::size_t p = 0; p < learned.size(); ++p)
    learned[p] = std::clamp(learned[p], 0.25 * scale * planned[p], 4.0 * scale * planned[p]);
}

void Engine::set_multipath_learn(double weight) {
  if (!(weight >= 0 && weight <= 1))
    throw Error(Errc::invalid_argument,
                fmt::format("set_multipath_learn: weight {} is outside [0, 1] (CARAVAN_DMA_MULTIPATH_LEARN)", weight));
  multipath_learn_.store(weight);
}

std::shared_ptr<const planner::MultiPlan> Engine::plan_multipath(const Instance& src, const Instance& dst,
                                                                 const std::optional<Rect>& region) {
  std::string key;
  return plan_multipath(src, dst, key, region);
}

void Engine::check_copy(const Instance& src, const Instance& dst, const CopyOptions& options) {
  detail::check_priority(options.priority, "copy");
  check_signal_fields(options.signal, "copy");
  if (wants_multipath(src, dst, options)) {  // throws for multipath across ranks
    (void)runnable_multipath_plan(src, dst, nullptr, options.region);
    return;
  }
  (void)plan(src, dst, options.planner, options.region);
}

std::shared_ptr<const planner::MultiPlan> Engine::plan_multipath(const Instance& src, const Instance& dst,
                                                                 std::string& key, const std::optional<Rect>& region) {
  planner::TransferRequest request = make_request(src, dst, region);
  key = multipath_key(request);
  const std::size_t entries = planner_->options().cache_entries;
  {
    std::lock_guard lock(multiplan_mutex_);
    auto it = multiplans_.find(key);
    if (it != multiplans_.end()) return it->second;
  }
  auto plan = std::make_shared<const planner::MultiPlan>(planner_->plan_multipath(request));
  if (entries > 0) {
    std::lock_guard lock(multiplan_mutex_);
    if (multiplans_.size() >= entries) {
      multiplans_.clear();
      learned_rates_.clear();
    }
    multiplans_.emplace(key, plan);
  }
  return plan;
}

void Engine::check_signal(CopyOperation& op, const TileSignal& signal) const {
  check_signal_fields(signal, "copy");
  if (!signal.flags) return;
  if (op.grid.count() != signal.tiles)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: CopyOptions::signal.tiles is {}, but this copy ({}) is cut into {} tile(s) of up to "
                            "{} points; size the flags by copy_tiling(src, dst)", signal.tiles, op.route(),
                            op.grid.count(), op.grid.largest().volume()));
  const Xd& last = *op.xds.back();
  const Channel& channel = last.worker->channel();
  const FlagWriter writer = channel.flag_writer();
  if (writer == FlagWriter::none)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: CopyOptions::signal: the copy's last hop runs on the {} channel ('{}', route {}), "
                            "which cannot write landing flags (memcpy, sdma and xgmi can)",
                            to_string(channel.kind()), last.worker->name(), op.route()));
  const gpu::PointerKind where = gpu::pointer_kind(signal.flags);
  if (writer == FlagWriter::cpu && where == gpu::PointerKind::device)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: CopyOptions::signal.flags is GPU memory, but the copy's last hop runs on the {} "
                            "channel (route {}), whose flags the CPU stores: use host memory (zcm for a GPU to "
                            "watch them)", to_string(channel.kind()), op.route()));
  if (writer == FlagWriter::gpu && where == gpu::PointerKind::pageable)
    throw Error(Errc::invalid_argument,
                fmt::format("copy: CopyOptions::signal.flags is pageable host memory, but the copy's last hop runs on "
                            "the {} channel (route {}), whose flags a GPU stream writes: use GPU memory or pinned "
                            "host memory mapped into the GPUs (zcm)", to_string(channel.kind()), op.route()));
  op.signal_flags = signal.flags;
  op.signal_value = signal.value;
}

CopyTiling Engine::tiling(const Instance& src, const Instance& dst, PlannerChoice choice,
                          const std::optional<Rect>& region) {
  const Rect& space = region ? *region : src.space();
  std::shared_ptr<const planner::Plan> plan;
  if (choice == PlannerChoice::multipath) {
    const planner::MultiPlan multi = runnable_multipath_plan(src, dst, nullptr, region);
    if (multi.shares.size() > 1) {
      check_multipath_tiles_consecutive(multi, src, dst, space, "copy_tiling");
      // Each slab cut as copy() cuts its part (prepare_pipeline), in slab order, counted in the
      // whole space: tiles[i] is what flag i of the copy's signal guards.
      CopyTiling out;
      for (const planner::PathShare& share : multi.shares) {
        std::vector<std::uint64_t> slot_bytes;
        const std::uint64_t points = choose_tile_points(share.piece, src.fields(), share.plan.hops, slot_bytes);
        CopyTiling part = describe_tiling(TileGrid(share.piece, points), space);
        out.tile_points = std::max(out.tile_points, part.tile_points);
        out.tiles.insert(out.tiles.end(), part.tiles.begin(), part.tiles.end());
      }
      return out;
    }
    // One path: the one copy() takes.
    if (!multi.shares.empty()) plan = std::make_shared<planner::Plan>(multi.shares.front().plan);
  }
  if (!plan) plan = this->plan(src, dst, choice, region);
  std::vector<std::uint64_t> slot_bytes;
  const std::uint64_t points = choose_tile_points(space, src.fields(), plan->hops, slot_bytes);
  return describe_tiling(TileGrid(space, points), space);
}

Event Engine::fill(const Instance& dst, std::span<const std::byte> value, const CopyOptions& options) {
  check_common(dst, "dst memory");
  if (dst.memory().rank != static_cast<std::uint32_t>(runtime_.rank()))
    throw Error(Errc::invalid_argument, fmt::format("fill: the instance is in {}, memory of rank {}; fill it on that rank",
                                                    dst.memory().to_string(), dst.memory().rank));
  if (value.size() != dst.fields().total_size())
    throw Error(Errc::invalid_argument, fmt::format("fill: the value is {} bytes, but one point of the instance has {} "
                                                    "(its fields in declaration order)", value.size(), dst.fields().total_size()));
  detail::check_priority(options.priority, "fill");
  if (options.signal.flags || options.signal.value || options.signal.tiles)
    throw Error(Errc::invalid_argument, "fill: CopyOptions::signal is for copy() only; fill() does not write landing flags");
  // A fill is one hop from the host memory holding the value to the destination.
  MemoryId host{dst.memory().node, dst.memory().rank, MemoryKind::sys, 0};
  std::optional<std::uint32_t> from = graph_->find(host), to = graph_->find(dst.memory());
  std::optional<std::uint32_t> channel;
  if (from && to) {
    for (std::uint32_t c : graph_->out_channels(*from))
      if (graph_->channel(c).dst == *to && workers_[c]) channel = c;
  }
  if (!channel)
    throw Error(Errc::invalid_argument, fmt::format("fill: no channel writes {} from host memory", dst.memory().to_string()));
  auto op = std::make_shared<CopyOperation>();
  op->called_ns = now_ns();
  op->engine = this;
  op->priority = options.priority;
  op->report = options.report;
  op->route_text = fmt::format("fill -[{}]-> {}", to_string(graph_->channel(*channel).kind), dst.memory().to_string());
  op->dst_instance = dst;
  op->dst_storage = dst.impl()->storage;
  op->pattern = Storage::allocate_host(host, value.size());
  op->pattern->write(0, value);
  if (options.region) {
    const Rect& r = *options.region;
    if (!dst.space().contains(r))
      throw Error(Errc::invalid_argument,
                  fmt::format("fill: CopyOptions::region {} must lie inside the instance's index space {}",
                              r.dims() ? r.to_string() : std::string("(empty)"), dst.space().to_string()));
  }
  op->space = options.region ? *options.region : dst.space();
  op->fields = dst.fields();
  op->src_view = View::pattern(op->fields);
  op->dst_view = View::of_layout(dst.layout(), dst.space(), op->fields, 0);
  planner::Hop hop;
  hop.channel = *channel;
  hop.kind = graph_->channel(*channel).kind;
  hop.src = host;
  hop.dst = dst.memory();
  hop.dst_layout = dst.layout();
  hop.request_bytes = request_floor_bytes_;
  prepare_pipeline(*op, {hop});
  return submit(std::move(op), options.precondition);
}

Event Engine::submit(std::shared_ptr<CopyOperation> op, Event precondition) {
  // A precondition owned by another rank is waited on through its local proxy.
  RuntimeImpl::LocalEvent pre{nullptr, Event()};
  if (!precondition.is_none()) pre = RuntimeImpl::local_view(precondition);
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error(Errc::shut_down, "copy: the runtime is shutting down");
    op->sequence = ++next_sequence_;
    op->done = runtime_.events().create();
    op->touch();
    active_.emplace(op->done, op);
  }
  Event done = op->done;
  if (pre.table) pre.table->add_waiter(pre.event, new PreconditionWaiter(std::move(op)));
  else on_precondition(op, nullptr);
  return done;
}

void Engine::on_precondition(const std::shared_ptr<CopyOperation>& op, const FailureCause& failure) {
  std::unique_lock lock(mutex_);
  if (op->state != CopyOperation::State::waiting_precondition) return;  // cancelled meanwhile
  if (failure) {
    op->fail(failure);  // the original cause: no byte moves
    op->state = CopyOperation::State::finished;
    lock.unlock();
    finish(op);
    return;
  }
  if (op->dist) {
    lock.unlock();
    // Cross-rank copies move on the control thread only (remote_copy.cpp).
    post_control([this, op] { dist_begin(op); });
    return;
  }
  op->state = CopyOperation::State::waiting_buffers;
  admit(op);
  bool ready = op->state == CopyOperation::State::running;
  lock.unlock();
  if (ready) start(op);
}

// Takes the copy's buffer reservations in global memory order; a copy that cannot get one
// waits (FIFO) in that pool's queue, holding only reservations that come earlier in the order.
void Engine::admit(const std::shared_ptr<CopyOperation>& op) {
  while (op->reservations_held < op->reservation_order.size()) {
    auto [memory, bytes] = op->reservation_order[op->reservations_held];
    BufferPool& pool = pools_[memory];
    bool first_in_line = pool.waiters.empty() || pool.waiters.front() == op;
    if (!first_in_line || pool.used + bytes > pool.capacity) {
      if (std::find(pool.waiters.begin(), pool.waiters.end(), op) == pool.waiters.end()) pool.waiters.push_back(op);
      return;
    }
    if (!pool.waiters.empty() && pool.waiters.front() == op) pool.waiters.pop_front();
    pool.used += bytes;
    ++op->reservations_held;
  }
  op->state = CopyOperation::State::running;
}

void Engine::start(const std::shared_ptr<CopyOperation>& op) {
  if (op->dist) {
    // Admitted on whichever thread freed the reservations: allocate on the control thread,
    // where an abort or finish of this copy cannot run at the same time.
    post_control([this, op] { dist_admitted(op); });
    return;
  }
  try {
    for (auto& b : op->buffers) {
      const std::uint64_t bytes = b.slot_bytes * static_cast<std::uint64_t>(op->slots);
      b.storage = buffer_cache_.take(b.memory, bytes);
      if (!b.storage) b.storage = allocate_buffer(b.memory, bytes);
    }
  } catch (const Error& e) {
    op->fail(std::make_shared<const Error>(e));
    {
      std::lock_guard lock(mutex_);
      op->state = CopyOperation::State::finished;
    }
    finish(op);
    return;
  }
  op->touch();
  op->started_ns = now_ns();
  op->live_xds.store(static_cast<int>(op->xds.size()));
  for (auto& xd : op->xds) {
    xd->record = op->report != nullptr;  // read by the worker after add() (under its lock)
    xd->worker->add(xd.get());
  }
}

void Engine::tile_finished(Xd* xd) {
  CopyOperation& op = *xd->op;
  if (xd->hop + 1 < op.xds.size() && op.xds[xd->hop + 1]->worker) op.xds[xd->hop + 1]->worker->wake();
  if (xd->hop > 0 && op.xds[xd->hop - 1]->worker) op.xds[xd->hop - 1]->worker->wake();
  if (op.dist) dist_tile_progress(xd);  // neighbours on other ranks hear of it by message
  // Not xd's own worker: complete() signals it once the request is no longer in flight, when it
  // can act (retire the XD or issue the next tile). Waking it here too made it take the lock
  // while the completing thread still needed it, for nothing.
}

void Engine::xd_retired(CopyOperation* raw) {
  if (raw->live_xds.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::shared_ptr<CopyOperation> op;
  {
    std::lock_guard lock(mutex_);
    auto it = active_.find(raw->done);
    if (it == active_.end()) return;
    op = it->second;
    if (!op->dist) op->state = CopyOperation::State::finished;
  }
  if (op->dist) post_control([this, op] { dist_segment_retired(op); });
  else finish(op);
}

void Engine::release_reservations(CopyOperation& op, std::vector<std::shared_ptr<CopyOperation>>& retry) {
  for (std::size_t i = 0; i < op.reservations_held; ++i) {
    auto [memory, bytes] = op.reservation_order[i];
    BufferPool& pool = pools_[memory];
    pool.used -= bytes;
    for (auto& waiter : pool.waiters) retry.push_back(waiter);
  }
  op.reservations_held = 0;
  for (auto& [memory, pool] : pools_) {
    auto it = std::find_if(pool.waiters.begin(), pool.waiters.end(), [&](const auto& w) { return w.get() == &op; });
    if (it != pool.waiters.end()) pool.waiters.erase(it);
  }
}

// Every XD has retired (or none started): release the buffers, report, trigger the event.
void Engine::finish(const std::shared_ptr<CopyOperation>& op) {
  std::vector<std::shared_ptr<CopyOperation>> retry, started;
  op->finished_ns = now_ns();
  {
    std::lock_guard lock(mutex_);
    ++finishing_;  // with the erase: shutdown never sees active_ empty while this finish runs
    release_reservations(*op, retry);
    active_.erase(op->done);
    for (auto& waiter : retry) {
      if (waiter->state != CopyOperation::State::waiting_buffers) continue;
      admit(waiter);
      if (waiter->state == CopyOperation::State::running &&
          std::find(started.begin(), started.end(), waiter) == started.end())
        started.push_back(waiter);
    }
  }
  if (op->report) {
    CopyReport& r = *op->report;
    r.route = op->route();
    r.predicted_gbps = op->predicted_gbps;
    r.tiles = op->grid.count();
    r.buffer_bytes.clear();
    for (const auto& b : op->buffers) r.buffer_bytes.push_back(b.slot_bytes * static_cast<std::uint64_t>(op->slots));
    r.hop_requests.clear();
    r.hop_interleaved.clear();
    for (const auto& xd : op->xds) {
      r.hop_requests.push_back(xd->requests);
      r.hop_interleaved.push_back(xd->requests ? xd->last_seq - xd->first_seq + 1 - xd->requests : 0);
    }
    r.slots = static_cast<std::uint64_t>(op->slots);
    r.tiling = describe_tiling(op->grid, op->space);
    r.bytes = op->space.volume() * op->fields.total_size();
    r.paths.clear();
    // Copies across ranks record no timeline yet (their hops run on several ranks).
    if (!op->dist) r.timeline = hop_timelines(*op);
    else r.timeline.clear();
    r.elapsed_us = 0;
    for (const auto& hop : r.timeline) r.elapsed_us = std::max(r.elapsed_us, hop.end_us);
    r.setup_us = op->started_ns ? static_cast<double>(op->started_ns - op->called_ns) / 1e3 : 0;
  }
  // No request is in flight any more (every XD retired): the buffers may serve the next copy,
  // except those that another rank may still put into (dist_hold_buffers keeps them).
  if (op->dist) dist_hold_buffers(*op);
  for (auto& b : op->buffers) {
    if (BufferCache::keeps(b.memory)) buffer_cache_.give(std::move(b.storage));
    else release_buffer(std::move(b.storage));
  }
  if (op->report && op->started_ns) op->report->teardown_us = us_since(op->started_ns) - op->report->elapsed_us;
  if (op->dist) {
    std::lock_guard lock(dist_mutex_);
    dist_ops_.erase(op->dist->id);
  }
  FailureCause failure;
  {
    std::lock_guard lock(op->failure_mutex);
    failure = op->failure;
  }
  for (auto& waiter : started) start(waiter);
  runtime_.events().trigger(op->done, failure);
  {
    std::lock_guard lock(mutex_);
    --finishing_;
    if (active_.empty() && multi_.empty() && finishing_ == 0) idle_cv_.notify_all();
  }
}

bool Engine::cancel(Event copy_event) {
  return stop_copy(copy_event, make_failure(Errc::cancelled, fmt::format("copy {} was cancelled", copy_event.to_string())));
}

bool Engine::stop_copy(Event copy_event, const FailureCause& cause) {
  std::shared_ptr<CopyOperation> op;
  CopyOperation::State state;
  {
    std::unique_lock lock(mutex_);
    auto it = active_.find(copy_event);
    if (it == active_.end()) {
      auto multi = multi_.find(copy_event);
      if (multi == multi_.end()) return false;
      std::shared_ptr<MultiCopy> found = multi->second;
      lock.unlock();
      return stop_multipath(found, cause);
    }
    op = it->second;
    state = op->state;
    // A cross-rank copy past its precondition is stopped by its own protocol: the initiator
    // aborts every participant; a participant (at shutdown) stops its part.
    if (op->dist && state != CopyOperation::State::waiting_precondition) {
      state = CopyOperation::State::running;
      // The cause is recorded before the copy can leave active_ (finish() erases it under this
      // lock, then reads the cause): a copy found here is poisoned with it.
      op->fail(cause);
    } else if (state != CopyOperation::State::running) {
      op->state = CopyOperation::State::finished;
    }
  }
  if (op->dist && state == CopyOperation::State::running) {
    // The protocol runs on the control thread, in order with the copy's admission and messages.
    post_control([this, op, cause] {
      if (op->dist->initiator == runtime_.rank()) dist_fail(op, cause);
      else dist_abort_here(op, cause);
    });
    return true;
  }
  op->fail(cause);
  // A running copy finishes when its XDs have retired at the next request boundary; one that
  // never started finishes now.
  if (state != CopyOperation::State::running && state != CopyOperation::State::finished) finish(op);
  return true;
}

void Engine::shutdown() {
  std::vector<std::shared_ptr<CopyOperation>> ops;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [event, op] : active_) ops.push_back(op);
  }
  auto cause = make_failure(Errc::shut_down, "the runtime shut down before this copy finished");
  for (auto& op : ops) stop_copy(op->done, cause);
  dist_shutdown();
  {
    std::unique_lock lock(mutex_);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    if (!idle_cv_.wait_until(lock, deadline, [&] { return active_.empty() && multi_.empty() && finishing_ == 0; }))
      log::get("dma")->error("shutdown: {} copies ({} multi-path) did not stop within 30 s", active_.size(), multi_.size());
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  for (auto& w : workers_)
    if (w) w->stop();
  dist_close();
  buffer_cache_.close();
}

void Engine::replace_channel_for_testing(const std::string& worker_name, std::unique_ptr<Channel> channel) {
  // The old worker is stopped outside the engine lock: a worker thread that has just retired
  // a copy may still be on its way into the lock (finish() notifies idle_cv_ under it), and
  // joining it while holding the lock would wait on it forever. Not for concurrent copy() calls.
  std::unique_ptr<DmaWorker> old;
  {
    std::lock_guard lock(mutex_);
    if (!active_.empty())
      throw Error(Errc::invalid_argument, fmt::format("replace_channel_for_testing('{}'): {} copies are active; "
                                                      "channels are replaced only while none is",
                                                      worker_name, active_.size()));
    for (auto& worker : workers_) {
      if (!worker || worker->name() != worker_name) continue;
      old = std::move(worker);
      worker = std::make_unique<DmaWorker>(*this, std::move(channel), worker_name);
      break;
    }
  }
  if (!old) throw Error(Errc::not_found, fmt::format("replace_channel_for_testing: no channel worker named '{}'", worker_name));
  old->stop();
}

void Engine::replace_machine_for_testing(const planner::MachineDescription& machine) {
  auto graph = std::make_shared<const planner::TransferGraph>(machine);
  std::vector<std::unique_ptr<DmaWorker>> old;
  {
    std::lock_guard lock(mutex_);
    if (!active_.empty() || !multi_.empty())
      throw Error(Errc::invalid_argument, fmt::format("replace_machine_for_testing('{}'): {} copies are active; the "
                                                      "machine is replaced only while none is",
                                                      machine.name, active_.size() + multi_.size()));
    for (const auto& [memory, pool] : pools_)
      if (pool.used != 0 || !pool.waiters.empty())
        throw Error(Errc::internal, fmt::format("replace_machine_for_testing: the pool of {} is in use", memory.to_string()));
    old = std::move(workers_);
    graph_ = graph;
    planner_ = std::make_unique<planner::Planner>(graph_);
    {
      std::lock_guard plans(multiplan_mutex_);
      multiplans_.clear();
      learned_rates_.clear();
    }
    workers_ = make_workers(*graph_);
    pools_.clear();
    for (std::size_t v = 0; v < graph_->memory_count(); ++v)
      pools_[graph_->memory(static_cast<std::uint32_t>(v)).id].capacity = pool_bytes_;
  }
  // Stopped outside the engine lock (see replace_channel_for_testing).
  for (auto& worker : old)
    if (worker) worker->stop();
}

EngineStats Engine::stats() {
  std::lock_guard lock(mutex_);
  EngineStats s;
  s.active_copies = active_.size();
  for (const auto& [memory, pool] : pools_) {
    s.pool_in_use[memory] = pool.used;
    if (std::uint64_t idle = buffer_cache_.idle_bytes(memory)) s.idle_buffers[memory] = idle;
  }
  for (const auto& [bytes, storage] : idle_registered_) s.idle_buffers[storage->memory()] += storage->bytes();
  for (const auto& [id, held] : quarantine_)
    for (const auto& storage : held.storages) s.quarantined_buffers[storage->memory()] += storage->bytes();
  s.remote_keys = remote_keys_.size();
  s.gpu_mappings = gpu_mappings_.size();
  s.multipath_copies = multi_.size();
  return s;
}

// Reports copies that made no progress for CARAVAN_DMA_STALL_S, naming the stuck XD, its
// channel and what it waits for: users of transfer engines rightly hate silent stalls.
void Engine::watchdog_main() {
  const detail::RuntimeThreadRole role("the DMA engine's watchdog");
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    // A quarter of the stall time, at most a second (a never-stall setting must not overflow
    // the clock's arithmetic), at least 10 ms.
    watchdog_cv_.wait_for(lock,
                          std::chrono::nanoseconds(std::clamp<std::int64_t>(stall_ns_ / 4, 10'000'000, 1'000'000'000)));
    if (stopping_) return;
    std::int64_t now = now_ns();
    for (auto& [event, op] : active_) {
      if (op->state != CopyOperation::State::running) continue;
      std::int64_t idle = now - op->last_progress_ns.load(std::memory_order_relaxed);
      if (idle < stall_ns_ || now - op->last_warned_ns < stall_ns_) continue;
      op->last_warned_ns = now;
      // Each XD's own state, under its worker's lock (engine lock, then a worker's: the order
      // used everywhere; workers never take the engine lock while holding theirs).
      std::string where;
      for (auto& xd : op->xds) {
        if (!xd->worker) {
          where += fmt::format("; hop {} on rank {}: {}/{} tiles done", xd->hop, op->dist ? op->dist->hop_rank[xd->hop] : -1,
                               xd->tiles_done.load(), op->grid.count());
          continue;
        }
        where += fmt::format("; hop {} on '{}': {}/{} tiles done, {}", xd->hop, xd->worker->name(),
                             xd->tiles_done.load(), op->grid.count(), xd->worker->describe(*xd));
      }
      log::get("dma")->warn("copy {} ({}{}{}) made no progress for {:.1f} s{}", event.to_string(), op->part_of,
                            op->part_of.empty() ? "" : ": ", op->route(), static_cast<double>(idle) / 1e9, where);
    }
  }
}

}  // namespace caravan::dma
