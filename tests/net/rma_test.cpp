// Multi-process: the RMA layer under the nic channel (registered memory, remote keys, put/get,
// atomics, flush), checked by checksums in every direction, with layout changes (pitched rows
// and a transposition done by many small puts) and many operations in flight from several
// threads.
#include "runtime/net/rma.h"
#include "tests/net/net_test_util.h"

#include <atomic>
#include <thread>

namespace caravan {
namespace {

using namespace std::chrono_literals;
using test::JobTest;

std::uint64_t checksum(const std::byte* data, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint8_t>(data[i])) * 1099511628211ull;
  return h;
}

// Counts completions of pending operations; `failures` keeps the first error text.
struct Counter {
  std::atomic<int> done{0};
  std::atomic<int> failed{0};
  static void complete(void* user, const FailureCause& failure) {
    auto* self = static_cast<Counter*>(user);
    if (failure) self->failed.fetch_add(1);
    self->done.fetch_add(1);
  }
  net::RmaCallback callback() { return {&Counter::complete, this}; }
  void wait_for(int expected) {
    auto deadline = std::chrono::steady_clock::now() + 30s;
    while (done.load() < expected && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(100us);
    ASSERT_EQ(done.load(), expected);
  }
};

TEST_F(JobTest, RmaPutAndGetInEveryDirectionWithLayoutChanges) {
  net::Rma& rma = test::network(rt()).rma();
  // Each rank's buffer: one 64 KiB slot per rank (pitched rows), then a 32x32 transposition area.
  constexpr std::size_t kRows = 64, kRowBytes = 1000, kPitch = 1024, kSlot = kRows * kPitch, kN = 32;
  const std::size_t slots = static_cast<std::size_t>(world()) * kSlot;
  auto mine = rma.allocate(slots + static_cast<std::size_t>(world()) * kN * kN * 4);
  std::memset(mine->data(), 0, mine->size());
  auto all = rma.exchange(*mine, "test");
  ASSERT_EQ(static_cast<int>(all.size()), world());
  // Source: contiguous rows of 1000 bytes, registered too so zero-copy paths are exercised.
  auto source = rma.allocate(kRows * kRowBytes + kN * kN * 4);
  Counter counter;
  int pending = 0;
  for (int r = 0; r < world(); ++r) {
    std::byte* rows = source->data();
    for (std::size_t i = 0; i < kRows * kRowBytes; ++i) rows[i] = static_cast<std::byte>((i * 13 + r * 7 + rank()) & 0xFF);
    for (std::size_t row = 0; row < kRows; ++row)  // rows land at the destination's pitch
      if (rma.put(all[r], static_cast<std::uint64_t>(rank()) * kSlot + row * kPitch, rows + row * kRowBytes, kRowBytes,
                  source, counter.callback()) == net::RmaStatus::pending)
        ++pending;
    // Transpose a 32x32 matrix of uint32: element (i, j) goes to (j, i), one 4-byte put each.
    auto* matrix = reinterpret_cast<std::uint32_t*>(source->data() + kRows * kRowBytes);
    for (std::size_t i = 0; i < kN * kN; ++i) matrix[i] = static_cast<std::uint32_t>(i * 2654435761u + r + rank() * 7);
    std::uint64_t area = slots + static_cast<std::uint64_t>(rank()) * kN * kN * 4;
    for (std::size_t i = 0; i < kN; ++i)
      for (std::size_t j = 0; j < kN; ++j)
        if (rma.put(all[r], area + (j * kN + i) * 4, &matrix[i * kN + j], 4, source, counter.callback()) ==
            net::RmaStatus::pending)
          ++pending;
    net::RmaWait flushed;
    flushed.wait(rma.flush(r, flushed.callback()));  // source reused for the next rank only after this
  }
  counter.wait_for(pending);
  EXPECT_EQ(counter.failed.load(), 0);
  rt().barrier(30s);
  // Check what every rank put here, against the same computation.
  std::vector<std::byte> expected(kRows * kRowBytes);
  for (int from = 0; from < world(); ++from) {
    for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::byte>((i * 13 + rank() * 7 + from) & 0xFF);
    for (std::size_t row = 0; row < kRows; ++row) {
      ASSERT_EQ(checksum(mine->data() + static_cast<std::size_t>(from) * kSlot + row * kPitch, kRowBytes),
                checksum(expected.data() + row * kRowBytes, kRowBytes))
          << "row " << row << " from rank " << from;
      for (std::size_t gap = kRowBytes; gap < kPitch; ++gap)  // the pitch gap stays untouched
        ASSERT_EQ(mine->data()[static_cast<std::size_t>(from) * kSlot + row * kPitch + gap], std::byte{0});
    }
    auto* got = reinterpret_cast<const std::uint32_t*>(mine->data() + slots + static_cast<std::size_t>(from) * kN * kN * 4);
    for (std::size_t i = 0; i < kN; ++i)
      for (std::size_t j = 0; j < kN; ++j)
        ASSERT_EQ(got[j * kN + i], static_cast<std::uint32_t>((i * kN + j) * 2654435761u + rank() + from * 7))
            << "element (" << i << ", " << j << ") from rank " << from;
  }
  // Gets: read every rank's slot written by rank 0 back, and compare with what that rank holds.
  std::vector<std::byte> read(kSlot);
  for (int r = 0; r < world(); ++r) {
    net::RmaWait got;
    got.wait(rma.get(read.data(), nullptr, all[r], 0, kSlot, got.callback()));
    auto theirs = test::all_gather(rt(), checksum(mine->data(), kSlot));
    EXPECT_EQ(checksum(read.data(), kSlot), theirs[static_cast<std::size_t>(r)]) << "get from rank " << r;
  }
  EXPECT_EQ(rma.pending_count(), 0u);
  rt().barrier(30s);
}

TEST_F(JobTest, RmaManyOperationsInFlightFromSeveralThreads) {
  net::Rma& rma = test::network(rt()).rma();
  constexpr int kThreads = 3, kPuts = 400;
  constexpr std::size_t kBytes = 4096;
  auto mine = rma.allocate(static_cast<std::size_t>(world() * kThreads * kPuts) * 8);
  std::memset(mine->data(), 0, mine->size());
  auto all = rma.exchange(*mine, "test");
  auto source = rma.allocate(kBytes);
  std::memset(source->data(), 0x5A, kBytes);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter counter;
      int pending = 0;
      std::vector<std::uint64_t> values(kPuts);
      for (int i = 0; i < kPuts; ++i) {
        int target = (rank() + i) % world();
        values[static_cast<std::size_t>(i)] = static_cast<std::uint64_t>(rank()) << 32 | static_cast<std::uint64_t>(t * kPuts + i);
        std::uint64_t at = (static_cast<std::uint64_t>(rank() * kThreads + t) * kPuts + static_cast<std::uint64_t>(i)) * 8;
        if (rma.put(all[target], at, &values[static_cast<std::size_t>(i)], 8, nullptr, counter.callback()) ==
            net::RmaStatus::pending)
          ++pending;
        if (i % 50 == 0 && rma.atomic_add(all[0], 0, 0, counter.callback()) == net::RmaStatus::pending) ++pending;
      }
      counter.wait_for(pending);
      failures += counter.failed.load();
      for (int r = 0; r < world(); ++r) {
        net::RmaWait flushed;
        flushed.wait(rma.flush(r, flushed.callback()));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  rt().barrier(30s);
  // Every rank wrote its (rank, index) words to the targets (rank + i) % world.
  auto* words = reinterpret_cast<const std::uint64_t*>(mine->data());
  int found = 0;
  for (int from = 0; from < world(); ++from)
    for (int t = 0; t < kThreads; ++t)
      for (int i = 0; i < kPuts; ++i) {
        if ((from + i) % world() != rank()) continue;
        std::size_t at = static_cast<std::size_t>((from * kThreads + t) * kPuts + i);
        if (at == 0) continue;  // word 0 is the atomics' target
        ASSERT_EQ(words[at], static_cast<std::uint64_t>(from) << 32 | static_cast<std::uint64_t>(t * kPuts + i));
        ++found;
      }
  EXPECT_GT(found, 0);
  EXPECT_EQ(rma.pending_count(), 0u);
  rt().barrier(30s);
}

TEST_F(JobTest, RmaAtomicsAndBadArguments) {
  net::Rma& rma = test::network(rt()).rma();
  auto mine = rma.allocate(64);
  std::memset(mine->data(), 0, 64);
  auto all = rma.exchange(*mine, "test");
  for (int r = 0; r < world(); ++r) {
    net::RmaWait added, set;
    added.wait(rma.atomic_add(all[r], 0, static_cast<std::uint64_t>(rank() + 1), added.callback()));
    if (r == rank()) set.wait(rma.atomic_set(all[(r + 1) % world()], 8, 77, set.callback()));
  }
  for (int r = 0; r < world(); ++r) {
    net::RmaWait flushed;
    flushed.wait(rma.flush(r, flushed.callback()));
  }
  rt().barrier(30s);
  auto* words = reinterpret_cast<std::uint64_t*>(mine->data());
  EXPECT_EQ(std::atomic_ref<std::uint64_t>(words[0]).load(), static_cast<std::uint64_t>(world() * (world() + 1) / 2));
  EXPECT_EQ(std::atomic_ref<std::uint64_t>(words[1]).load(), 77u);
  net::RmaWait unused;
  CARAVAN_EXPECT_ERROR(rma.put(all[0], 60, mine->data(), 8, nullptr, unused.callback()), Errc::invalid_argument,
                       "outside rank 0's registered memory of 64 bytes");
  CARAVAN_EXPECT_ERROR(rma.atomic_add(all[0], 4, 1, unused.callback()), Errc::invalid_argument, "not 8-byte aligned");
  CARAVAN_EXPECT_ERROR(rma.flush(world(), unused.callback()), Errc::invalid_argument, "outside [0,");
  CARAVAN_EXPECT_ERROR(rma.allocate(0), Errc::invalid_argument, "at least 1");
  rt().barrier(30s);
}

}  // namespace
}  // namespace caravan
