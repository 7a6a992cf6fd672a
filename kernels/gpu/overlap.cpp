#include "kernels/gpu/overlap.h"

#include <caravan/error.h>

#include <fmt/format.h>

namespace caravan::gpu {
namespace {

constexpr std::uint64_t kFlagBytes = sizeof(std::uint64_t);

void require(bool ok, const std::string& what) {
  if (!ok) throw Error(Errc::invalid_argument, what);
}

// The flag words of an operation: `groups` arrays of `count` 64-bit flags per rank.
struct FlagArrays {
  std::uint64_t* base;
  long count;
  std::uint64_t* at(int group, long index) const { return base + group * count + index; }
};

void wait_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t epoch) {
  CARAVAN_HIP_CHECK(hipStreamWaitValue64(stream, flag, epoch, hipStreamWaitValueGte));
}
void write_flag(hipStream_t stream, std::uint64_t* flag, std::uint64_t epoch) {
  CARAVAN_HIP_CHECK(hipStreamWriteValue64(stream, flag, epoch, 0));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
struct GpuTeam::Rank {
  int device = 0;
  hipStream_t comm = nullptr;
  std::unique_ptr<Blas> blas;
};

GpuTeam::GpuTeam(std::vector<int> devices, std::uint64_t heap_bytes_per_rank) : heap_(std::move(devices), heap_bytes_per_rank) {
  for (int r = 0; r < heap_.world(); ++r) {
    auto rank = std::make_unique<Rank>();
    rank->device = heap_.device(r);
    CARAVAN_HIP_CHECK(hipSetDevice(rank->device));
    // The communication stream gets the highest priority: its work is tiny (copy-engine
    // launches and flag operations) and others wait on it.
    int least = 0, greatest = 0;
    CARAVAN_HIP_CHECK(hipDeviceGetStreamPriorityRange(&least, &greatest));
    CARAVAN_HIP_CHECK(hipStreamCreateWithPriority(&rank->comm, hipStreamNonBlocking, greatest));
    rank->blas = std::make_unique<Blas>();
    ranks_.push_back(std::move(rank));
  }
}

GpuTeam::~GpuTeam() {
  for (auto& rank : ranks_) {
    (void)hipSetDevice(rank->device);
    rank->blas.reset();
    if (rank->comm) (void)hipStreamDestroy(rank->comm);
  }
}

hipStream_t GpuTeam::comm_stream(int rank) const { return ranks_.at(static_cast<std::size_t>(rank))->comm; }
Blas& GpuTeam::blas(int rank) { return *ranks_.at(static_cast<std::size_t>(rank))->blas; }
void GpuTeam::use(int rank) const { CARAVAN_HIP_CHECK(hipSetDevice(device(rank))); }

RankSync::RankSync(int chunk_events) {
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&start, hipEventDisableTiming));
  CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&comm_done, hipEventDisableTiming));
  chunk.resize(static_cast<std::size_t>(chunk_events));
  for (auto& e : chunk) CARAVAN_HIP_CHECK(hipEventCreateWithFlags(&e, hipEventDisableTiming));
}

RankSync::~RankSync() {
  (void)hipEventDestroy(start);
  (void)hipEventDestroy(comm_done);
  for (auto e : chunk) (void)hipEventDestroy(e);
}

namespace {
// Events live on the device that was current when they were made: make one set per rank there.
std::vector<std::unique_ptr<RankSync>> make_sync(GpuTeam& team, int chunk_events) {
  std::vector<std::unique_ptr<RankSync>> sync;
  for (int r = 0; r < team.world(); ++r) {
    team.use(r);
    sync.push_back(std::make_unique<RankSync>(chunk_events));
  }
  return sync;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
std::string_view to_string(AgGemmVariant v) {
  switch (v) {
    case AgGemmVariant::ce_pull: return "ce-pull";
    case AgGemmVariant::ce_push: return "ce-push";
    default: return "ce-bulk";
  }
}

// Flags of AllGatherGemm, per rank: ready[p] (p's shard is in its slot for this epoch),
// done[p] (p finished pulling my slot), landed[chunk] (that chunk of A is in my gathered
// buffer), freed[p] (p's GEMM finished reading the slot I pushed to it).
enum AgFlags { ag_ready, ag_done, ag_landed, ag_freed, ag_groups };

AllGatherGemm::AllGatherGemm(GpuTeam& team, long m, long k, long n, int splits)
    : team_(team), m_(m), k_(k), n_(n), splits_(splits) {
  const int world = team.world();
  require(m > 0 && k > 0 && n > 0, fmt::format("AllGatherGemm: m, k, n must be positive, got {}, {}, {}", m, k, n));
  require(splits >= 1, fmt::format("AllGatherGemm: splits must be >= 1, got {}", splits));
  require(m % (static_cast<long>(world) * splits) == 0,
          fmt::format("AllGatherGemm: m = {} must be a multiple of world x splits = {} x {}", m, world, splits));
  gathered_ = team.heap().allocate(static_cast<std::uint64_t>(m) * k * sizeof(bf16));
  flags_ = team.heap().allocate(ag_groups * static_cast<std::uint64_t>(world) * splits * kFlagBytes);
  sync_ = make_sync(team, 0);
}

AllGatherGemm::~AllGatherGemm() = default;

bf16* AllGatherGemm::shard(int rank) const {
  return team_.heap().at<bf16>(gathered_, rank) + static_cast<long>(rank) * (m_ / team_.world()) * k_;
}
const bf16* AllGatherGemm::gathered(int rank) const { return team_.heap().at<bf16>(gathered_, rank); }

void AllGatherGemm::wait_shard_free(int rank, hipStream_t stream) {
  const std::uint64_t last = sync_[static_cast<std::size_t>(rank)]->epoch;
  const FlagArrays my{team_.heap().at<std::uint64_t>(flags_, rank), static_cast<long>(team_.world()) * splits_};
  for (int step = 1; step < team_.world(); ++step) wait_flag(stream, my.at(ag_done, (rank + step) % team_.world()), last);
}

void AllGatherGemm::run(int rank, const bf16* b, bf16* c, AgGemmVariant variant, hipStream_t stream) {
  const int world = team_.world();
  const long count = static_cast<long>(world) * splits_;
  const long shard_rows = m_ / world, chunk_rows = shard_rows / splits_;
  const std::size_t chunk_bytes = static_cast<std::size_t>(chunk_rows) * k_ * sizeof(bf16);
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const std::uint64_t e = ++s.epoch;
  hipStream_t comm = team_.comm_stream(rank);
  Blas& blas = team_.blas(rank);
  auto flags = [&](int r) { return FlagArrays{team_.heap().at<std::uint64_t>(flags_, r), count}; };
  auto rows_of = [&](int r, bf16* base) { return base + static_cast<long>(r) * shard_rows * k_; };
  bf16* mine = team_.heap().at<bf16>(gathered_, rank);
  const FlagArrays my = flags(rank);

  // The communication stream starts after everything the caller enqueued so far: the shard is
  // written, and this rank's earlier GEMMs no longer read the gathered buffer.
  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));

  if (variant == AgGemmVariant::ce_push) {
    // Pushing reads nothing of the peers: they may reuse their shards (a later pull call waits
    // for this).
    for (int step = 1; step < world; ++step) write_flag(comm, flags((rank + step) % world).at(ag_done, rank), e);
    for (int step = 1; step < world; ++step) {
      const int peer = (rank + step) % world;
      wait_flag(comm, my.at(ag_freed, peer), e - 1);
      bf16* theirs = team_.heap().at<bf16>(gathered_, peer);
      for (int sp = 0; sp < splits_; ++sp) {
        const long offset = static_cast<long>(sp) * chunk_rows * k_;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(rows_of(rank, theirs) + offset, rows_of(rank, mine) + offset, chunk_bytes,
                                         hipMemcpyDefault, comm));
        write_flag(comm, flags(peer).at(ag_landed, static_cast<long>(rank) * splits_ + sp), e);
      }
    }
  } else {
    for (int step = 1; step < world; ++step) wait_flag(comm, my.at(ag_done, (rank + step) % world), e - 1);
    for (int step = 1; step < world; ++step) write_flag(comm, flags((rank + step) % world).at(ag_ready, rank), e);
    for (int step = 1; step < world; ++step) {
      const int peer = (rank + step) % world;
      wait_flag(comm, my.at(ag_ready, peer), e);
      const bf16* theirs = team_.heap().at<bf16>(gathered_, peer);
      for (int sp = 0; sp < splits_; ++sp) {
        const long offset = static_cast<long>(sp) * chunk_rows * k_;
        CARAVAN_HIP_CHECK(hipMemcpyAsync(rows_of(peer, mine) + offset, rows_of(peer, const_cast<bf16*>(theirs)) + offset,
                                         chunk_bytes, hipMemcpyDefault, comm));
        write_flag(comm, my.at(ag_landed, static_cast<long>(peer) * splits_ + sp), e);
      }
      write_flag(comm, flags(peer).at(ag_done, rank), e);
    }
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));

  if (variant == AgGemmVariant::ce_bulk) {
    for (int step = 1; step < world; ++step)
      for (int sp = 0; sp < splits_; ++sp)
        wait_flag(stream, my.at(ag_landed, static_cast<long>((rank + step) % world) * splits_ + sp), e);
    blas.gemm(stream, m_, n_, k_, mine, k_, b, n_, c, n_);
    for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(ag_freed, rank), e);
  } else {
    // Own shard first; then peers in the order they arrive: pulls go rank+1, rank+2, ...;
    // pushes reach this rank from rank-1 first, then rank-2, ...
    for (int step = 0; step < world; ++step) {
      const int src = variant == AgGemmVariant::ce_push ? (rank - step + world) % world : (rank + step) % world;
      for (int sp = 0; sp < splits_; ++sp) {
        const long row0 = static_cast<long>(src) * shard_rows + static_cast<long>(sp) * chunk_rows;
        if (src != rank) wait_flag(stream, my.at(ag_landed, static_cast<long>(src) * splits_ + sp), e);
        blas.gemm(stream, chunk_rows, n_, k_, mine + row0 * k_, k_, b, n_, c + row0 * n_, n_);
      }
      // This rank no longer reads slot src: its owner may push the next epoch's shard into it.
      if (src != rank) write_flag(stream, flags(src).at(ag_freed, rank), e);
    }
  }
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

// ---------------------------------------------------------------------------------------------
std::string_view to_string(GemmRsVariant v) { return v == GemmRsVariant::ce_push ? "ce-push" : "ce-bulk"; }

// Flags of GemmReduceScatter, per rank: arrived[p] (p's partial for my rows is in my slot p),
// freed[p] (p finished reducing the slot I pushed to it).
enum RsFlags { rs_arrived, rs_freed, rs_groups };

GemmReduceScatter::GemmReduceScatter(GpuTeam& team, long m, long k, long n) : team_(team), m_(m), k_(k), n_(n) {
  const int world = team.world();
  require(m > 0 && k > 0 && n > 0, fmt::format("GemmReduceScatter: m, k, n must be positive, got {}, {}, {}", m, k, n));
  require(m % world == 0, fmt::format("GemmReduceScatter: m = {} must be a multiple of world = {}", m, world));
  require((m / world) * n % 8 == 0, "GemmReduceScatter: (m / world) x n must be a multiple of 8 (16-byte vectors)");
  received_ = team.heap().allocate(static_cast<std::uint64_t>(m) * n * sizeof(bf16));
  flags_ = team.heap().allocate(rs_groups * static_cast<std::uint64_t>(world) * kFlagBytes);
  for (int r = 0; r < world; ++r) {
    team.use(r);
    void* p = nullptr;
    CARAVAN_HIP_CHECK(hipMalloc(&p, static_cast<std::size_t>(m) * n * sizeof(bf16)));
    partial_.push_back(static_cast<bf16*>(p));
  }
  sync_ = make_sync(team, world);
}

GemmReduceScatter::~GemmReduceScatter() {
  for (int r = 0; r < team_.world(); ++r) {
    (void)hipSetDevice(team_.device(r));
    (void)hipFree(partial_[static_cast<std::size_t>(r)]);
  }
}

void GemmReduceScatter::run(int rank, const bf16* a, const bf16* b, bf16* out, GemmRsVariant variant,
                            hipStream_t stream) {
  const int world = team_.world();
  const long rows = m_ / world;
  const std::size_t chunk_elems = static_cast<std::size_t>(rows) * n_;
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const std::uint64_t e = ++s.epoch;
  hipStream_t comm = team_.comm_stream(rank);
  Blas& blas = team_.blas(rank);
  bf16* partial = partial_[static_cast<std::size_t>(rank)];
  auto flags = [&](int r) { return FlagArrays{team_.heap().at<std::uint64_t>(flags_, r), world}; };
  auto slot = [&](int owner, int from) { return team_.heap().at<bf16>(received_, owner) + from * chunk_elems; };
  const FlagArrays my = flags(rank);

  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));
  auto push = [&](int step, hipEvent_t computed) {
    const int dst = (rank + step) % world;
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, computed, 0));
    wait_flag(comm, my.at(rs_freed, dst), e - 1);
    CARAVAN_HIP_CHECK(hipMemcpyAsync(slot(dst, rank), partial + dst * chunk_elems, chunk_elems * sizeof(bf16),
                                     hipMemcpyDefault, comm));
    write_flag(comm, flags(dst).at(rs_arrived, rank), e);
  };
  if (variant == GemmRsVariant::ce_bulk) {
    blas.gemm(stream, m_, n_, k_, a, k_, b, n_, partial, n_);
    CARAVAN_HIP_CHECK(hipEventRecord(s.chunk[0], stream));
    for (int step = 1; step < world; ++step) push(step, s.chunk[0]);
  } else {
    // Destination order rank+1, rank+2, ...: the chunk this rank keeps is computed last, so the
    // pushes of the others overlap the remaining GEMMs.
    for (int step = 1; step <= world; ++step) {
      const int dst = (rank + step) % world;
      blas.gemm(stream, rows, n_, k_, a + dst * rows * k_, k_, b, n_, partial + dst * chunk_elems, n_);
      if (step < world) {
        CARAVAN_HIP_CHECK(hipEventRecord(s.chunk[static_cast<std::size_t>(step)], stream));
        push(step, s.chunk[static_cast<std::size_t>(step)]);
      }
    }
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
  ReduceInputs inputs;
  inputs.count = world;
  for (int q = 0; q < world; ++q) {
    if (q != rank) wait_flag(stream, my.at(rs_arrived, q), e);
    inputs.in[q] = q == rank ? partial + rank * chunk_elems : slot(rank, q);
  }
  reduce_sum(out, inputs, chunk_elems, stream);
  for (int step = 1; step < world; ++step) write_flag(stream, flags((rank + step) % world).at(rs_freed, rank), e);
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

// ---------------------------------------------------------------------------------------------
std::string_view to_string(GemmAsVariant v) { return v == GemmAsVariant::ce_push ? "ce-push" : "ce-bulk"; }

// Flags of GemmAllScatter, per rank: arrived[p * chunks + c] (p's chunk c of its column block
// is in my C), released[p] (p's caller is done with the C of the previous epoch).
GemmAllScatter::GemmAllScatter(GpuTeam& team, long m, long k, long n, int chunks)
    : team_(team), m_(m), k_(k), n_(n), chunks_(chunks) {
  const int world = team.world();
  require(m > 0 && k > 0 && n > 0, fmt::format("GemmAllScatter: m, k, n must be positive, got {}, {}, {}", m, k, n));
  require(n % world == 0, fmt::format("GemmAllScatter: n = {} must be a multiple of world = {}", n, world));
  require(chunks >= 1 && m % chunks == 0,
          fmt::format("GemmAllScatter: chunks = {} must be >= 1 and divide m = {}", chunks, m));
  c_ = team.heap().allocate(static_cast<std::uint64_t>(m) * n * sizeof(bf16));
  flags_ = team.heap().allocate((static_cast<std::uint64_t>(world) * chunks + world) * kFlagBytes);
  sync_ = make_sync(team, chunks);
}

GemmAllScatter::~GemmAllScatter() = default;

bf16* GemmAllScatter::output(int rank) const { return team_.heap().at<bf16>(c_, rank); }

void GemmAllScatter::run(int rank, const bf16* a, const bf16* b_shard, GemmAsVariant variant, hipStream_t stream) {
  const int world = team_.world();
  const long block = n_ / world, rows = m_ / chunks_;
  RankSync& s = *sync_[static_cast<std::size_t>(rank)];
  const std::uint64_t e = ++s.epoch;
  hipStream_t comm = team_.comm_stream(rank);
  Blas& blas = team_.blas(rank);
  auto arrived = [&](int owner, int from, int chunk) {
    return team_.heap().at<std::uint64_t>(flags_, owner) + static_cast<long>(from) * chunks_ + chunk;
  };
  auto released = [&](int owner, int from) {
    return team_.heap().at<std::uint64_t>(flags_, owner) + static_cast<long>(world) * chunks_ + from;
  };
  bf16* mine = output(rank);

  // Everything the caller enqueued before this call (its use of the previous C) is done on
  // this rank: tell the peers they may overwrite this rank's C.
  for (int step = 1; step < world; ++step) write_flag(stream, released((rank + step) % world, rank), e - 1);
  CARAVAN_HIP_CHECK(hipEventRecord(s.start, stream));
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.start, 0));
  for (int step = 1; step < world; ++step) wait_flag(comm, released(rank, (rank + step) % world), e - 1);

  const int gemms = variant == GemmAsVariant::ce_push ? chunks_ : 1;
  const long gemm_rows = m_ / gemms;
  for (int g = 0; g < gemms; ++g) {
    bf16* c0 = mine + static_cast<long>(g) * gemm_rows * n_ + rank * block;
    blas.gemm(stream, gemm_rows, block, k_, a + static_cast<long>(g) * gemm_rows * k_, k_, b_shard, block, c0, n_);
    CARAVAN_HIP_CHECK(hipEventRecord(s.chunk[static_cast<std::size_t>(g)], stream));
    CARAVAN_HIP_CHECK(hipStreamWaitEvent(comm, s.chunk[static_cast<std::size_t>(g)], 0));
    const int first = variant == GemmAsVariant::ce_push ? g : 0, last = variant == GemmAsVariant::ce_push ? g + 1 : chunks_;
    for (int c = first; c < last; ++c) {
      for (int step = 1; step < world; ++step) {
        const int dst = (rank + step) % world;
        const long offset = static_cast<long>(c) * rows * n_ + rank * block;
        CARAVAN_HIP_CHECK(hipMemcpy2DAsync(output(dst) + offset, n_ * sizeof(bf16), mine + offset, n_ * sizeof(bf16),
                                           block * sizeof(bf16), rows, hipMemcpyDefault, comm));
        write_flag(comm, arrived(dst, rank, c), e);
      }
    }
  }
  CARAVAN_HIP_CHECK(hipEventRecord(s.comm_done, comm));
  for (int step = 1; step < world; ++step)
    for (int c = 0; c < chunks_; ++c) wait_flag(stream, arrived(rank, (rank + world - step) % world, c), e);
  CARAVAN_HIP_CHECK(hipStreamWaitEvent(stream, s.comm_done, 0));
}

// ---------------------------------------------------------------------------------------------
LowLatencyAllGather::LowLatencyAllGather(GpuTeam& team, std::size_t bytes_per_rank)
    : team_(team), bytes_(bytes_per_rank), epoch_(static_cast<std::size_t>(team.world()), 0) {
  require(bytes_per_rank > 0 && bytes_per_rank % 8 == 0 && bytes_per_rank <= kLlMaxBytes,
          fmt::format("LowLatencyAllGather: bytes per rank must be a positive multiple of 8 up to {}, got {}", kLlMaxBytes,
                      bytes_per_rank));
  lines_ = team.heap().allocate(ll_buffer_bytes(team.world(), bytes_per_rank));
}

void LowLatencyAllGather::run(int rank, const void* in, void* out, hipStream_t stream) {
  const std::uint32_t e = ++epoch_[static_cast<std::size_t>(rank)];
  ll_allgather(team_.heap().view(rank), in, bytes_, team_.heap().at(lines_, rank), out, e, stream);
}

}  // namespace caravan::gpu
