// Instances and copies: the data-movement API.
//
// An Instance is an index space x field space stored in one memory with one layout (Isometry's
// data model, include/caravan/layout.h). copy() names only the source and destination; the
// planner chooses the path (possibly several hops through intermediate buffers) and the DMA
// engine moves the bytes in pipelined requests on per-channel workers, by priority.
#pragma once

#include <caravan/event.h>
#include <caravan/layout.h>
#include <caravan/machine.h>
#include <caravan/task_graph.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace caravan {

namespace planner {
struct Plan;
struct MultiPlan;
}

class InstanceImpl;

// An Instance is a shared handle: copies of it name the same bytes, which are freed when the last
// handle (and every copy still using it) lets go. Handles may be used from any thread. Destroying
// one after its runtime has shut down is safe, and a host instance's data() stays readable until
// the last handle is gone. Copies, fills and descriptors need a running runtime (Error(shut_down)
// when none is); use an instance only with the runtime that made it, not a later one.
class Instance {
 public:
  Instance() = default;

  // Allocates an instance in `memory`, a memory of this rank (see `caravan machine show`; on a CPU
  // machine node0/rank0/sys and node0/rank0/dsk; in a job also node<n>/rank<r>/reg, host memory
  // registered with UCX, which the nic channel reads and writes). Throws Error(invalid_argument)
  // when the layout does not fit the space, the field space is empty, the footprint exceeds
  // 2^64 - 1 bytes or the memory is another rank's; Error(not_found) for a memory this rank does
  // not have; Error(shut_down) when no runtime is running.
  static Instance create(MemoryId memory, IndexSpace space, FieldSpace fields, Layout layout);
  // Wraps `bytes` bytes of caller-owned host memory (sys, zcm or reg) at `data`, which must be at
  // least the layout's footprint and stay alive as long as the instance is used. zcm memory not
  // pinned yet is pinned and mapped for the GPUs here (hipHostRegister) until the instance goes.
  static Instance attach(MemoryId memory, IndexSpace space, FieldSpace fields, Layout layout, void* data,
                         std::size_t bytes);

  bool valid() const noexcept { return impl_ != nullptr; }
  MemoryId memory() const;
  const IndexSpace& space() const;
  const FieldSpace& fields() const;
  const Layout& layout() const;
  std::uint64_t footprint_bytes() const;  // TOTAL(layout), padding included
  // Byte offset of (point, field) within the footprint.
  std::uint64_t offset(const Point& point, std::size_t field) const;
  // The bytes of a host instance; throws Error(invalid_argument) for a file-backed (dsk) or GPU
  // (fbm) one (use read_bytes/write_bytes, or gpu_data in a GPU task).
  std::byte* data() const;
  // The address a GPU kernel uses for the instance's bytes: GPU memory (fbm<i>), or pinned host
  // memory mapped into the GPUs (zcm). For the work a GPU task enqueues on
  // TaskContext::gpu_stream (order it after the copies that fill the instance with their events).
  // An attached zcm instance (Instance::attach) gives back the caller's pointer, which attach
  // pinned and mapped if it was not already. Throws Error(invalid_argument) for
  // memory a GPU cannot address this way (sys, reg, dsk) and for another rank's instance.
  void* gpu_data() const;
  // Reads or writes footprint bytes of any instance, synchronously (for set-up and checks).
  void read_bytes(std::uint64_t offset, std::span<std::byte> out) const;
  void write_bytes(std::uint64_t offset, std::span<const std::byte> in) const;

  // Instances of other ranks. descriptor() (on the rank that owns the instance) returns bytes to
  // hand to other ranks (in task arguments, an allgather...); from_descriptor() there gives an
  // Instance that copy() accepts as its source or destination, so that a copy may start on one
  // rank and finish on another. The bytes stay with the owner: data(), read_bytes() and
  // write_bytes() of such an Instance throw Error(invalid_argument). The owner must keep its
  // Instance alive while copies use it (a copy that finds it gone is poisoned, not a crash; a
  // copy into another rank's GPU memory that starts directly, CARAVAN_DMA_IPC_DIRECT, does not
  // ask the owner first and cannot tell). The descriptor of GPU memory carries its IPC handle.
  // from_descriptor throws Error(invalid_argument) for bytes that are not a descriptor, one of
  // an instance that no longer exists on this rank, or one from another job.
  std::vector<std::byte> descriptor() const;
  static Instance from_descriptor(std::span<const std::byte> descriptor);
  // True for an Instance made by from_descriptor on a rank other than its owner.
  bool is_remote() const;

  const std::shared_ptr<InstanceImpl>& impl() const noexcept { return impl_; }

 private:
  std::shared_ptr<InstanceImpl> impl_;
};

// How copy() plans its path.
//   automatic  the simple planner below CARAVAN_PLANNER_FULL_MIN_BYTES, the full planner from
//              there; and, from CARAVAN_DMA_MULTIPATH_MIN_BYTES (when set, > 0), as multipath for
//              copies within this rank that ask for no landing flags (a copy with
//              CopyOptions::signal goes multi-path only when it asks for multipath, so that its
//              tiling does not depend on that setting).
//   simple     the simple planner (Isometry section 4.4).
//   full       the full planner (section 4.2).
//   multipath  the multi-path planner: the index space is cut into slabs along the outermost
//              dimension of the source layout, in proportion to each path's share, and every
//              slab moves on its own path at the same time, under one event. When the planner
//              finds one path (or several that would not beat the best one), the copy is the
//              full planner's. Not for copies across ranks: Error(invalid_argument). With
//              several paths and CopyOptions::signal, each path writes the flags of its own
//              tiles (see TileSignal, copy_tiling); that needs slabs that are runs of
//              consecutive points (no dimension above the split one with more than one
//              coordinate), else Error(invalid_argument).
enum class PlannerChoice : std::uint8_t { automatic, simple, full, multipath };

// One request a hop sent to its channel; times in microseconds since the copy started running
// (its buffers reserved and its hops handed to their DMA workers).
struct RequestSpan {
  std::uint64_t tile = 0;
  std::uint64_t bytes = 0;
  double start_us = 0;  // when the worker handed it to the channel
  double end_us = 0;    // when the channel completed it
};

// Where one hop's time went, from the copy's start to the end of the hop's last request. The
// hop is busy while one of its requests runs; every idle stretch before the first request of a
// tile is charged to what the tile waited for (the previous hop finishing it, or the next hop
// draining the slot it goes to), and whatever remains, or lies between requests of one tile, to
// scheduling: the worker had what it needed but did not issue yet (wake-up latency, cutting the
// tile into ops, or the channel running other copies' requests).
struct HopTimeline {
  std::string channel;                 // its worker, e.g. "file node0/rank0/dsk->node0/rank0/sys"
  std::vector<RequestSpan> requests;   // in issue order
  std::vector<double> tile_done_us;    // when each tile was finished, by tile
  double busy_us = 0;                  // time with at least one request running
  double waiting_input_us = 0;         // idle: the previous hop had not finished the next tile
  double waiting_output_us = 0;        // idle: the next hop had not drained the next tile's slot
  double scheduling_us = 0;            // idle although the next request could have been issued
  double end_us = 0;                   // the end of the hop's last request
};

// One tile of a copy: the unit the DMA engine pipelines through a path's hops and, with a
// TileSignal, the unit whose landing it signals. Tiles are slabs of the index space: whole
// extents in the dimensions below some dimension s, a range of s, single coordinates above s.
// So in the order that runs dimension 0 fastest (the points of a row-major array whose column is
// x, or of an "F,x" / "F,x,y" instance in footprint order), tile i holds the consecutive points
// [first_point, first_point + points), and tile i + 1 starts where tile i ends; a multi-path
// copy's tiles too (copy_tiling says when it refuses instead).
struct CopyTile {
  Rect rect;                      // its points (inclusive bounds, as every Rect)
  std::uint64_t first_point = 0;  // the linear index of rect.lo(), dimension 0 fastest, from the space's lo()
  std::uint64_t points = 0;       // rect.volume()
};

// How a copy is cut into tiles: tiles[i] is what flag i of a TileSignal guards. For an instance
// whose layout is "F,x", "F,x,y"... (fields innermost, then the dimensions in order), tile i is
// the byte range [first_point * |F|, (first_point + points) * |F|) of the footprint.
struct CopyTiling {
  // The most points a tile holds: tiles[0].points on one path; over several paths, whose tiles
  // may differ in size, the largest path's first tile.
  std::uint64_t tile_points = 0;
  std::vector<CopyTile> tiles;
};

struct CopyPathReport;

// What a finished copy did, for inspection and tests. Filled in before the copy's event triggers.
struct CopyReport {
  std::string route;                          // the planned path, e.g. "node0/rank0/dsk -[file]-> ..."
  double predicted_gbps = 0;
  std::vector<std::uint64_t> buffer_bytes;    // each intermediate buffer as allocated
  std::uint64_t tiles = 0;                    // pipelining units the instance was cut into
  std::vector<std::uint64_t> hop_requests;    // requests each hop sent to its channel
  // Requests of other copies that the channel of each hop ran between this copy's first and last
  // request on it: 0 means this copy had the channel to itself once it started.
  std::vector<std::uint64_t> hop_interleaved;
  std::uint64_t slots = 0;                    // tile slots per intermediate buffer
  double setup_us = 0;                        // from the copy() call to its start (planning, precondition, buffers)
  double elapsed_us = 0;                      // from the copy's start to its last request's end
  double teardown_us = 0;                     // from there until the event is about to trigger
  std::vector<HopTimeline> timeline;          // one per hop (see HopTimeline); none of a copy across ranks
  CopyTiling tiling;                          // which points each tile covered (tiling.tiles.size() == tiles)
  std::uint64_t bytes = 0;                    // payload moved: points x |F|
  // A copy split over several paths (PlannerChoice::multipath): one entry per path, in the order
  // of their slabs along the split dimension. The fields above then describe the whole copy:
  // route lists the paths ("3 paths: A | B | C"), predicted_gbps is the multi-path plan's,
  // tiles adds up the paths' tiles, and setup_us, elapsed_us and teardown_us run from the call
  // to the first path's start, from there to the last request's end, and on to the event.
  // buffer_bytes, hop_requests, hop_interleaved, timeline and tiling are each path's own (in
  // paths[i].report) and empty here. Empty for a copy on one path.
  std::vector<CopyPathReport> paths;
};

// One path of a multi-path copy.
struct CopyPathReport {
  Rect piece;                // the slab of the index space this path moved (whole in every other dimension)
  std::uint64_t bytes = 0;   // payload bytes it carried: piece.volume() x |F|
  double share_gbps = 0;     // the rate the planner gave it (its share of the predicted total)
  double start_us = 0;       // when it started (buffers reserved), from the copy's start (its first path's)
  double end_us = 0;         // when its last request ended, on the same clock
  // Its own report as a copy of `piece`: route, buffers, requests, timeline (on a clock that
  // starts at start_us) and tiling (first_point counted within `piece`; copy_tiling gives the
  // same tiles counted in the whole space).
  CopyReport report;
};

// Per-tile landing flags, for consumers (GPU kernels, CPU tasks) that start on a copy's tiles
// as they arrive instead of waiting for its event. Once every byte of tile i (CopyTiling) has
// landed in the destination, the copy's last hop sets flags[i] = value, ordered after those
// bytes (release ordering): a consumer that reads flags[i] == value with acquire ordering (a
// volatile load followed by a fence in a kernel) then reads tile i's bytes.
//   - sdma, xgmi (GPU copy engines): hipStreamWriteValue64 on the channel's stream right behind
//     the tile's last copy (the stream's memory barrier before the write; with several streams,
//     behind the tile's copies on all of them). flags may be GPU memory (of any GPU the copy's
//     GPU reaches) or pinned host memory mapped into the GPUs (zcm), not pageable host memory.
//   - memcpy (host memories): a release store by the CPU after the tile's copies; flags must
//     be host memory (sys, or zcm for a GPU kernel to watch), not GPU memory.
// The tiles of one path land in order. A multi-path copy (PlannerChoice::multipath, several
// paths) hands each path the flags of its own tiles, a contiguous range of the array (its slab's,
// after the tiles of the slabs before it: copy_tiling), and runs its paths at once, so across
// paths the flags rise interleaved: flag i + 1 may rise before flag i when the two belong to
// different paths. Wait for each flag a consumer needs, not for the flags before it.
// Flags of tiles that did not land (a failed or cancelled copy) are left as they were; the
// copy's event triggers after every flag it writes (a multi-path copy's after each path has
// written its flags). flags is not reset: use a new value (an epoch) per copy. The copy does not
// touch flags after its event has triggered.
// Across ranks only for a copy that starts directly (CARAVAN_DMA_IPC_DIRECT): every hop on this
// rank, the destination another rank's GPU memory on this node. flags is then an address of this
// process, e.g. the destination rank's symmetric heap as this process maps it, so that the
// owner's kernels see them. Not for fill(), other copies across ranks, or copies whose last hop
// (every path's, for a multi-path copy) is the file or nic channel (Error(invalid_argument),
// naming the rule).
struct TileSignal {
  std::uint64_t* flags = nullptr;  // null: no signal; else 8-byte aligned, `tiles` entries, alive until the event triggers
  std::uint64_t value = 0;         // written to each flag; nonzero (flags start at 0)
  std::uint64_t tiles = 0;         // entries of flags: must equal the copy's tile count (copy_tiling(src, dst, planner).tiles.size())
};

struct CopyOptions {
  Event precondition;      // the copy starts after this; if it is poisoned, no byte moves
  int priority = 0;        // [kMinPriority, kMaxPriority]: higher takes a channel at the next request
  PlannerChoice planner = PlannerChoice::automatic;  // see PlannerChoice (multipath: several paths at once)
  CopyReport* report = nullptr;  // optional; must stay alive until the copy's event triggers
  TileSignal signal;             // optional per-tile landing flags (copy() only; see TileSignal)
  // Optional: copy (or fill) only these points, which must lie inside both instances' index
  // spaces; the spaces may then differ (a block of a large instance into a small one that holds
  // the same points, say). Each point keeps its coordinates: point p of src lands at point p of
  // dst. Tiles (CopyTiling, CopyReport::tiling) are then slabs of the region, and first_point
  // counts from the region's lo().
  std::optional<Rect> region;
};

// Copies every (point, field) of `src` into `dst` (or of CopyOptions::region). Both must have the
// same index space (or both hold the region) and field space; layouts and memories may differ (a
// layout change is a conversion). Bad input (different spaces or fields, a region outside
// either space, a memory without a path, a priority out of range) throws before any byte moves.
// A copy split over several paths (PlannerChoice::multipath) still has one event: it triggers
// once every path has finished, poisoned with the first failure's cause if any path fails (the
// other paths are then stopped with that cause).
// copy(), fill() and cancel() may be called from any thread, tasks included.
Event copy(const Instance& src, const Instance& dst, const CopyOptions& options = {});

// Writes `point_value` (|F| bytes: one point's fields in declaration order) to every point of `dst`.
Event fill(const Instance& dst, std::span<const std::byte> point_value, const CopyOptions& options = {});

// Cancels a copy or fill: its event is poisoned with Errc::cancelled, its requests stop at the
// next request boundary and its buffers go back to their pools (every path of a multi-path
// copy). A copy still waiting on its precondition is cancelled too. Returns false if
// `copy_event` is not a copy or fill that is pending or running (also for an event of a task or a
// user event: tasks cannot be cancelled; poison a UserEvent they wait on instead). A copy node of
// a TaskGraph exposes no event of its own: cancel its launch by poisoning a UserEvent it waits on.
bool cancel(Event copy_event);

// The plan copy() would use now, without copying. With PlannerChoice::multipath: the one path
// of a multi-path plan that found one; Error(invalid_argument) when it found several (see
// plan_copy_multipath). PlannerChoice::automatic gives the single-path plan, as copy() uses it
// below CARAVAN_DMA_MULTIPATH_MIN_BYTES.
// With `region`, the plan of copy(src, dst, {.region = region}). The hops that read src or write
// dst are rated by the runs the region keeps there (a region narrower than an instance along a
// dimension leaves its rows apart: planner::region_run_bytes).
std::shared_ptr<const planner::Plan> plan_copy(const Instance& src, const Instance& dst,
                                               PlannerChoice planner = PlannerChoice::automatic,
                                               const std::optional<Rect>& region = std::nullopt);

// The multi-path plan copy(src, dst, {.planner = PlannerChoice::multipath}) would run now: its
// paths with their slabs (PathShare::piece) and rates; one share when it stays on one path.
std::shared_ptr<const planner::MultiPlan> plan_copy_multipath(const Instance& src, const Instance& dst,
                                                              const std::optional<Rect>& region = std::nullopt);

// The tiles copy(src, dst) with this planner choice is cut into, without copying: for sizing a
// TileSignal's flags and telling its consumer which points each flag guards. Planning is
// deterministic (and cached) and tile sizes follow from the plan and settings
// (CARAVAN_DMA_TILE_BYTES, CARAVAN_GPU_REQUEST_US...), so a copy made after this call with the
// same settings has the same tiling; pass tiles.size() as TileSignal::tiles and copy() checks it.
// PlannerChoice::automatic gives the single-path tiling (a copy with landing flags is never split
// over paths automatically). PlannerChoice::multipath with several paths gives the paths'
// tilings one after another in slab order, each tile's rect and first_point in the whole space:
// tiles[i] is what flag i guards, and tile i + 1 still starts where tile i ends (tile sizes may
// differ from path to path). That holds only when every slab is a run of consecutive points:
// the planner cuts along the outermost dimension of the source layout, and when a dimension
// above that one has more than one coordinate (say a source laid out "F,y,x" over a 2-D space),
// copy_tiling, and copy() with a signal, throw Error(invalid_argument) rather than describe
// tiles that are not ranges of points; give the source a layout whose outermost dimension is
// the space's last, or use PlannerChoice::full.
// With `region`, the tiles of copy(src, dst, {.region = region}).
CopyTiling copy_tiling(const Instance& src, const Instance& dst, PlannerChoice planner = PlannerChoice::automatic,
                       const std::optional<Rect>& region = std::nullopt);

// This rank's memory of `kind` (`index`: which GPU for fbm, else 0), with the node and rank of the
// running runtime filled in, so that the same code names the right memory on every rank of a
// job. Throws Error(not_found) when this rank has no such memory (fbm without GPUs, reg outside
// a job) and Error(shut_down) when no runtime is running.
MemoryId local_memory(MemoryKind kind, std::uint32_t index = 0);

// A copy as a task-graph node: started at each launch after its dependencies. Checked and
// planned when added, as copy() would (Error(invalid_argument) etc., prefixed "add_copy: "), so
// it needs a running runtime then (Error(shut_down) otherwise), as Instance::create does.
TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst, int priority = 0,
                           std::span<const TaskGraph::NodeId> dependencies = {});
// The same with the dependencies first, as TaskGraph::add_task takes them.
TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst,
                           std::span<const TaskGraph::NodeId> dependencies, int priority = 0);
// With copy options: priority, planner and region are used at every launch. The launch supplies
// the precondition, and a report or landing flags would be overwritten by each launch, so a
// precondition, report or signal in `options` is Error(invalid_argument).
TaskGraph::NodeId add_copy(TaskGraph& graph, const Instance& src, const Instance& dst, const CopyOptions& options,
                           std::span<const TaskGraph::NodeId> dependencies = {});

}  // namespace caravan
