// `caravan bench copy` and `caravan bench priority`: the DMA engine against baselines measured
// in the same run.
//   copy:     a direct copy against plain memcpy of the same bytes; a pipelined multi-hop copy
//             (dsk -> sys -> dsk) against the staged version (each hop run to completion into a
//             full-size instance, as a runtime without path planning does) and against its
//             slowest hop measured alone; layout conversions against the loop a user writes.
//   priority: a high-priority copy under 64 large low-priority copies on one channel, against
//             its time alone and against the same load without priorities (FIFO).
#include "apps/caravan/bench_report.h"
#include "apps/caravan/commands.h"
#include "runtime/dma/channel.h"

#include <caravan/caravan.h>
#include <caravan/copy.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

namespace caravan::app {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMaxMib = std::uint64_t{1} << 24;  // 16 TiB: more than any host, far from overflowing

struct CopyBenchOptions {
  std::uint64_t mib = 256;
  int repetitions = 5;
  bool timeline = false;  // print where each pipelined run's hops spent their time
  bool small_only = false;  // only the small copies (what each copy costs the host)
};
CopyBenchOptions g_copy;

struct PriorityBenchOptions {
  std::uint64_t low_mib = 16;
  int low_copies = 64;
  std::uint64_t high_mib = 16;
  int repetitions = 5;
};
PriorityBenchOptions g_priority;

MemoryId sys() { return {0, static_cast<std::uint32_t>(Runtime::current().rank()), MemoryKind::sys, 0}; }
MemoryId dsk() { return {0, static_cast<std::uint32_t>(Runtime::current().rank()), MemoryKind::dsk, 0}; }

const FieldSpace& bench_fields() {
  static const FieldSpace fields({{"a", 8}, {"b", 8}});
  return fields;
}

Rect space_of(std::uint64_t bytes) {
  return Rect::from_extents({static_cast<std::int64_t>(std::max<std::uint64_t>(bytes / bench_fields().total_size(), 1))});
}

double timed_copy(const Instance& src, const Instance& dst, const CopyOptions& options = {}) {
  auto start = Clock::now();
  copy(src, dst, options).wait();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The 1-, 5- and 15-minute load averages: the build machine is shared, and its load moves
// every figure.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  double one = 0, five = 0, fifteen = 0;
  if (!(in >> one >> five >> fifteen)) return "unknown";
  return fmt::format("{:.2f} {:.2f} {:.2f}", one, five, fifteen);
}

// One row per hop of a copy's timeline (CopyReport::timeline), in milliseconds.
void add_timeline_rows(BenchTable& table, const std::string& run, const CopyReport& report, double wall_s) {
  for (std::size_t h = 0; h < report.timeline.size(); ++h) {
    const HopTimeline& hop = report.timeline[h];
    table.rows.push_back({run, fmt::format("{} {}", h, hop.channel), std::to_string(hop.requests.size()),
                          fmt::format("{:.1f}", hop.busy_us / 1e3), fmt::format("{:.1f}", hop.waiting_input_us / 1e3),
                          fmt::format("{:.1f}", hop.waiting_output_us / 1e3), fmt::format("{:.1f}", hop.scheduling_us / 1e3),
                          fmt::format("{:.1f}", report.setup_us / 1e3), fmt::format("{:.1f}", report.elapsed_us / 1e3),
                          fmt::format("{:.1f}", report.teardown_us / 1e3), fmt::format("{:.1f}", wall_s * 1e3)});
  }
}

nlohmann::json timeline_json(const CopyReport& report) {
  nlohmann::json hops = nlohmann::json::array();
  for (const HopTimeline& hop : report.timeline) {
    nlohmann::json requests = nlohmann::json::array();
    for (const RequestSpan& r : hop.requests) requests.push_back({r.tile, r.bytes, r.start_us, r.end_us});
    hops.push_back({{"channel", hop.channel}, {"busy_us", hop.busy_us}, {"waiting_input_us", hop.waiting_input_us},
                    {"waiting_output_us", hop.waiting_output_us}, {"scheduling_us", hop.scheduling_us},
                    {"tile_done_us", hop.tile_done_us}, {"requests_tile_bytes_start_end_us", requests}});
  }
  return {{"setup_us", report.setup_us}, {"elapsed_us", report.elapsed_us}, {"teardown_us", report.teardown_us},
          {"slots", report.slots}, {"hops", hops}};
}

double gbps(std::uint64_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

std::vector<std::string> gbps_row(const std::string& name, const Summary& s) {
  return {name, fmt::format("{:.2f}", s.median), fmt::format("{:.2f}", s.p10), fmt::format("{:.2f}", s.p90),
          fmt::format("{:.2f}", s.min), fmt::format("{:.2f}", s.max)};
}

nlohmann::json summary_json(const Summary& s) {
  return {{"median", s.median}, {"p10", s.p10}, {"p90", s.p90}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

// Layout conversions of three 4-byte fields (a point's x, y, z) between two sys instances, by
// Caravan and by the loop a user would write for that one conversion, on the same random source;
// Caravan's destination is poisoned before its last run and checked against the loop's.
struct ConversionCase {
  const char* name;
  const char* from;
  const char* to;
  bool two_d;  // F,x,y -> x,F,y over rows of kRow points (rows of each field apart), else F,x -> x,F
};
constexpr std::int64_t kRow = 1024;

// The loop a user writes: record by record, every field of a record stored to its array.
void convert_by_hand(const ConversionCase& c, const std::uint32_t* in, std::uint32_t* out, std::int64_t points) {
  if (!c.two_d) {
    const auto n = static_cast<std::size_t>(points);
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = in[3 * i];
      out[n + i] = in[3 * i + 1];
      out[2 * n + i] = in[3 * i + 2];
    }
    return;
  }
  const auto rows = static_cast<std::size_t>(points / kRow), row = static_cast<std::size_t>(kRow);
  for (std::size_t y = 0; y < rows; ++y)
    for (std::size_t x = 0; x < row; ++x)
      for (std::size_t f = 0; f < 3; ++f) out[(y * 3 + f) * row + x] = in[(y * row + x) * 3 + f];
}

void add_conversion_cases(BenchReport& out, std::uint64_t bytes, int repetitions) {
  static const FieldSpace xyz({{"x", 4}, {"y", 4}, {"z", 4}});
  const std::vector<ConversionCase> cases = {{"AOS -> SOA", "F,x", "x,F", false},
                                             {"2-D, rows apart: F,x,y -> x,F,y", "F,x,y", "x,F,y", true}};
  BenchTable t{fmt::format("Layout conversions of three 4-byte fields, GB/s moved ({} runs)", repetitions),
               {"conversion", "median", "p10", "p90", "min", "max"}, {}};
  nlohmann::json figures = nlohmann::json::object();
  for (const ConversionCase& c : cases) {
    const std::int64_t points = std::max<std::int64_t>(static_cast<std::int64_t>(bytes / 12) / kRow, 1) * kRow;
    const Rect space = c.two_d ? Rect::from_extents({kRow, points / kRow}) : Rect::from_extents({points});
    Instance src = Instance::create(sys(), space, xyz, Layout::parse(c.from));
    Instance dst = Instance::create(sys(), space, xyz, Layout::parse(c.to));
    const auto moved = static_cast<std::uint64_t>(points) * 12;
    std::mt19937 rng(static_cast<unsigned>(points));
    auto* in = reinterpret_cast<std::uint32_t*>(src.data());
    for (std::int64_t i = 0; i < points * 3; ++i) in[i] = rng();
    std::vector<std::uint32_t> by_hand(static_cast<std::size_t>(points) * 3);
    std::vector<double> caravan_gbps, hand_gbps;
    CopyReport report;
    copy(src, dst, {.report = &report}).wait();  // first touch of the destination, and the plan cached
    for (int r = 0; r < repetitions; ++r) {
      if (r == repetitions - 1) std::memset(dst.data(), 0xAB, moved);
      caravan_gbps.push_back(gbps(moved, timed_copy(src, dst)));
      auto start = Clock::now();
      convert_by_hand(c, in, by_hand.data(), points);
      hand_gbps.push_back(gbps(moved, std::chrono::duration<double>(Clock::now() - start).count()));
    }
    if (std::memcmp(dst.data(), by_hand.data(), moved) != 0)
      throw Error(Errc::internal, fmt::format("bench copy: the {} conversion's destination differs from the loop's", c.name));
    const Summary s_caravan = summarize(caravan_gbps), s_hand = summarize(hand_gbps);
    t.rows.push_back(gbps_row(fmt::format("{} (caravan)", c.name), s_caravan));
    t.rows.push_back(gbps_row(fmt::format("{}, hand-written loop", c.name), s_hand));
    out.headlines.push_back(fmt::format("conversion {} / hand-written loop: {:.2f}x", c.name, s_caravan.median / s_hand.median));
    out.notes.push_back(fmt::format("conversion {}: {} tile(s), {} request(s) on {}", c.name, report.tiles,
                                    report.hop_requests.empty() ? 0 : report.hop_requests.front(), report.route));
    figures[c.from + std::string(" -> ") + c.to] = {{"bytes", moved},
                                                    {"caravan", summary_json(s_caravan)},
                                                    {"hand_written", summary_json(s_hand)},
                                                    {"caravan_over_hand_written", s_caravan.median / s_hand.median}};
  }
  out.tables.push_back(t);
  out.notes.push_back("conversions: the destination verified against the hand-written loop's after a poisoned last run");
  out.figures["conversions"] = figures;
}

// A region (CopyOptions::region): the middle half of every row of a 2-D sys instance, rows of 4096
// points of 16 bytes, into an instance that holds just those points, against the loop a user
// writes (one memcpy per row); Caravan's destination is poisoned before its last run and checked
// against the loop's.
void add_region_case(BenchReport& out, std::uint64_t bytes, int repetitions) {
  constexpr std::int64_t kWidth = 4096;
  const std::uint64_t point_bytes = bench_fields().total_size();
  const std::int64_t rows = std::max<std::int64_t>(static_cast<std::int64_t>(bytes / (kWidth * point_bytes)), 1);
  const Rect whole = Rect::from_extents({kWidth, rows});
  const Rect band(2, Point{kWidth / 4, 0}, Point{3 * kWidth / 4 - 1, rows - 1});
  Instance src = Instance::create(sys(), whole, bench_fields(), Layout::parse("F,x,y"));
  Instance dst = Instance::create(sys(), band, bench_fields(), Layout::parse("F,x,y"));
  const std::uint64_t moved = band.volume() * point_bytes,
                      row_bytes = static_cast<std::uint64_t>(kWidth / 2) * point_bytes;
  std::mt19937_64 rng(static_cast<std::uint64_t>(rows));
  auto* words = reinterpret_cast<std::uint64_t*>(src.data());
  for (std::uint64_t i = 0; i < whole.volume() * point_bytes / 8; ++i) words[i] = rng();
  std::vector<std::byte> by_hand(moved);
  std::vector<double> caravan_gbps, hand_gbps;
  CopyReport report;
  copy(src, dst, {.report = &report, .region = band}).wait();  // first touch, and the plan cached
  for (int r = 0; r < repetitions; ++r) {
    if (r == repetitions - 1) std::memset(dst.data(), 0xAB, moved);
    caravan_gbps.push_back(gbps(moved, timed_copy(src, dst, {.region = band})));
    auto start = Clock::now();
    for (std::int64_t y = 0; y < rows; ++y)
      std::memcpy(by_hand.data() + static_cast<std::uint64_t>(y) * row_bytes,
                  src.data() + src.offset(Point{kWidth / 4, y}, 0), row_bytes);
    hand_gbps.push_back(gbps(moved, std::chrono::duration<double>(Clock::now() - start).count()));
  }
  if (std::memcmp(dst.data(), by_hand.data(), moved) != 0)
    throw Error(Errc::internal, "bench copy: the region copy's destination differs from the loop's");
  const Summary s_caravan = summarize(caravan_gbps), s_hand = summarize(hand_gbps);
  BenchTable t{fmt::format("A region: the middle half of each of {} rows of {} KiB, GB/s moved ({} runs)", rows,
                           kWidth * point_bytes >> 10, repetitions),
               {"copy", "median", "p10", "p90", "min", "max"},
               {}};
  t.rows.push_back(gbps_row("region copy (caravan)", s_caravan));
  t.rows.push_back(gbps_row("memcpy per row, hand-written loop", s_hand));
  out.tables.push_back(t);
  out.headlines.push_back(fmt::format("region copy / memcpy per row: {:.2f}x", s_caravan.median / s_hand.median));
  out.notes.push_back(
      fmt::format("region copy: {} tile(s), {} request(s) on {}; destination verified against the "
                  "loop's after a poisoned last run",
                  report.tiles, report.hop_requests.empty() ? 0 : report.hop_requests.front(), report.route));
  out.figures["region"] = {{"bytes", moved},
                           {"caravan", summary_json(s_caravan)},
                           {"hand_written", summary_json(s_hand)},
                           {"caravan_over_hand_written", s_caravan.median / s_hand.median}};
}

// Many small copies at once (what a KV-cache transfer issues: blocks of a few KiB): 2048 copies of
// 4 KiB and of 64 KiB between sys instances, all submitted, then waited for together; and one at
// a time, each waited for. The baseline is a memcpy of the same blocks in a loop. Small copies are
// bound by what each copy costs the host (planning from the cache, the descriptor, the worker's
// hand-off, the event), which this case measures.
void add_small_copy_cases(BenchReport& out, int repetitions) {
  constexpr int kCopies = 2048;
  BenchTable t{fmt::format("{} small copies between sys instances, GB/s moved ({} runs)", kCopies, repetitions),
               {"copy", "median", "p10", "p90", "min", "max"},
               {}};
  nlohmann::json figures = nlohmann::json::object();
  for (std::uint64_t block : {std::uint64_t{4} << 10, std::uint64_t{64} << 10}) {
    const Rect space = space_of(block);
    std::vector<Instance> srcs, dsts;
    for (int i = 0; i < kCopies; ++i) {
      srcs.push_back(Instance::create(sys(), space, bench_fields(), Layout::parse("F,x")));
      dsts.push_back(Instance::create(sys(), space, bench_fields(), Layout::parse("F,x")));
      std::memset(srcs.back().data(), i & 0xff, block);
    }
    const std::uint64_t moved = block * kCopies;
    std::vector<double> in_flight, one_by_one, by_hand;
    std::vector<Event> events(kCopies);
    for (int r = 0; r <= repetitions; ++r) {  // run 0 warms up (plans cached, pages touched)
      auto start = Clock::now();
      for (int i = 0; i < kCopies; ++i)
        events[static_cast<std::size_t>(i)] =
            copy(srcs[static_cast<std::size_t>(i)], dsts[static_cast<std::size_t>(i)]);
      merge_events(events).wait();
      const double all_s = std::chrono::duration<double>(Clock::now() - start).count();
      start = Clock::now();
      for (int i = 0; i < kCopies; ++i)
        copy(srcs[static_cast<std::size_t>(i)], dsts[static_cast<std::size_t>(i)]).wait();
      const double each_s = std::chrono::duration<double>(Clock::now() - start).count();
      start = Clock::now();
      for (int i = 0; i < kCopies; ++i)
        std::memcpy(dsts[static_cast<std::size_t>(i)].data(), srcs[static_cast<std::size_t>(i)].data(), block);
      const double hand_s = std::chrono::duration<double>(Clock::now() - start).count();
      if (r == 0) continue;
      in_flight.push_back(gbps(moved, all_s));
      one_by_one.push_back(gbps(moved, each_s));
      by_hand.push_back(gbps(moved, hand_s));
    }
    const Summary s_all = summarize(in_flight), s_each = summarize(one_by_one), s_hand = summarize(by_hand);
    const std::string size = fmt::format("{} KiB", block >> 10);
    t.rows.push_back(gbps_row(size + ", all in flight (caravan)", s_all));
    t.rows.push_back(gbps_row(size + ", one at a time, each waited (caravan)", s_each));
    t.rows.push_back(gbps_row(size + ", memcpy loop", s_hand));
    out.headlines.push_back(fmt::format(
        "{} copies of {}: {:.2f} GB/s in flight, {:.1f} us each one at a time ({:.3f}x a memcpy loop)", kCopies, size,
        s_all.median, static_cast<double>(block) / s_each.median / 1e3, s_all.median / s_hand.median));
    figures[size] = {{"copies", kCopies},
                     {"in_flight", summary_json(s_all)},
                     {"one_at_a_time", summary_json(s_each)},
                     {"memcpy_loop", summary_json(s_hand)},
                     {"in_flight_over_memcpy", s_all.median / s_hand.median}};
  }
  out.tables.push_back(t);
  out.figures["small_copies"] = figures;
}

BenchReport run_copy_bench() {
  if (g_copy.repetitions <= 0) throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", g_copy.repetitions));
  Runtime rt;
  const std::string load_before = load_average();
  if (g_copy.small_only) {
    BenchReport out;
    add_small_copy_cases(out, g_copy.repetitions);
    out.notes.push_back(fmt::format("load average (1, 5, 15 min): {} before, {} after", load_before, load_average()));
    return out;
  }
  const std::uint64_t bytes = g_copy.mib << 20;
  const Rect space = space_of(bytes);
  const std::uint64_t moved = space.volume() * bench_fields().total_size();
  Layout aos = Layout::parse("F,x");
  Instance a = Instance::create(sys(), space, bench_fields(), aos);
  Instance b = Instance::create(sys(), space, bench_fields(), aos);
  std::memset(a.data(), 0x5a, moved);
  Instance fa = Instance::create(dsk(), space, bench_fields(), aos);
  Instance fb = Instance::create(dsk(), space, bench_fields(), aos);
  Instance staging = Instance::create(sys(), space, bench_fields(), aos);
  copy(a, fa).wait();  // give the source file its contents
  // Every case then writes destinations that were written before: a file's first write
  // allocates its blocks (0.75 s for 256 MiB here, against 45 ms for a rewrite), which only the
  // first pipelined run would otherwise pay, and sys instances are zeroed when created.
  copy(a, fb).wait();
  // The memcpy channel measures its streaming stores once, at its first long run (about 80 ms
  // here): done now, it is not the first direct run's time.
  (void)dma::stream_copy_method();

  std::vector<double> direct, plain, pipelined, staged, read_hop, write_hop;
  CopyReport report, direct_report;
  BenchTable timeline{"Where the time of each run went, ms (see HopTimeline): busy = a request running; waiting = "
                      "for the previous hop's tile (input) or a free slot (output); scheduling = idle while ready",
                      {"run", "hop", "requests", "busy", "wait input", "wait output", "scheduling", "setup", "copy", "teardown", "wall"}, {}};
  nlohmann::json timelines = nlohmann::json::array();
  for (int r = 0; r < g_copy.repetitions; ++r) {
    const double direct_s = timed_copy(a, b, {.report = &direct_report});
    direct.push_back(gbps(moved, direct_s));
    auto start = Clock::now();
    std::memcpy(b.data(), a.data(), moved);
    plain.push_back(gbps(moved, std::chrono::duration<double>(Clock::now() - start).count()));
    const double pipelined_s = timed_copy(fa, fb, {.report = &report});
    pipelined.push_back(gbps(moved, pipelined_s));
    if (g_copy.timeline) {
      add_timeline_rows(timeline, fmt::format("direct {}", r), direct_report, direct_s);
      add_timeline_rows(timeline, fmt::format("pipelined {} ({:.2f} GB/s)", r, pipelined.back()), report, pipelined_s);
      timelines.push_back({{"direct", timeline_json(direct_report)}, {"pipelined", timeline_json(report)}});
    }
    CopyReport read_report, write_report;
    double t_read = timed_copy(fa, staging, {.report = &read_report});
    double t_write = timed_copy(staging, fb, {.report = &write_report});
    staged.push_back(gbps(moved, t_read + t_write));
    read_hop.push_back(gbps(moved, t_read));
    write_hop.push_back(gbps(moved, t_write));
    if (g_copy.timeline) {
      add_timeline_rows(timeline, fmt::format("hop alone {}", r), read_report, t_read);
      add_timeline_rows(timeline, fmt::format("hop alone {}", r), write_report, t_write);
    }
  }
  Summary s_direct = summarize(direct), s_plain = summarize(plain), s_pipe = summarize(pipelined),
          s_staged = summarize(staged), s_read = summarize(read_hop), s_write = summarize(write_hop);
  double slowest = std::min(s_read.median, s_write.median);

  BenchReport out;
  BenchTable t{fmt::format("GB/s, {} MiB per copy, {} runs", moved >> 20, g_copy.repetitions),
               {"copy", "median", "p10", "p90", "min", "max"}, {}};
  t.rows.push_back(gbps_row("direct sys->sys (caravan)", s_direct));
  t.rows.push_back(gbps_row("plain memcpy, same bytes", s_plain));
  t.rows.push_back(gbps_row("dsk->sys->dsk pipelined (caravan)", s_pipe));
  t.rows.push_back(gbps_row("dsk->sys->dsk staged", s_staged));
  t.rows.push_back(gbps_row("hop dsk->sys alone", s_read));
  t.rows.push_back(gbps_row("hop sys->dsk alone", s_write));
  out.tables.push_back(t);
  if (g_copy.timeline) out.tables.push_back(timeline);
  out.notes.push_back(fmt::format("pipelined route: {} ({} tiles, {} slots per buffer)", report.route, report.tiles, report.slots));
  out.notes.push_back(fmt::format("load average (1, 5, 15 min): {} before, {} after; the machine is shared, so figures move with it",
                                  load_before, load_average()));
  out.notes.push_back("dsk is file-backed storage in CARAVAN_DSK_DIR; the host hops share this machine's cores and memory bandwidth");
  out.notes.push_back(fmt::format("memcpy channel, runs of CARAVAN_MEMCPY_STREAM_BYTES or more: {}", dma::stream_copy_method()));
  out.headlines.push_back(fmt::format("direct copy / plain memcpy: {:.2f}x (goal >= 0.95)", s_direct.median / s_plain.median));
  out.headlines.push_back(fmt::format("pipelined / staged: {:.2f}x", s_pipe.median / s_staged.median));
  out.headlines.push_back(fmt::format("pipelined / slowest hop alone: {:.2f} (goal >= 0.90)", s_pipe.median / slowest));
  out.figures = {{"bytes", moved},
                 {"gbps", {{"direct", summary_json(s_direct)}, {"plain_memcpy", summary_json(s_plain)},
                           {"pipelined", summary_json(s_pipe)}, {"staged", summary_json(s_staged)},
                           {"hop_read", summary_json(s_read)}, {"hop_write", summary_json(s_write)}}},
                 {"direct_over_memcpy", s_direct.median / s_plain.median},
                 {"pipelined_over_staged", s_pipe.median / s_staged.median},
                 {"pipelined_over_slowest_hop", s_pipe.median / slowest},
                 {"route", report.route},
                 {"load_average_before", load_before}};
  if (g_copy.timeline) out.figures["timelines"] = timelines;
  add_conversion_cases(out, moved, g_copy.repetitions);
  add_region_case(out, moved, g_copy.repetitions);
  add_small_copy_cases(out, g_copy.repetitions);
  return out;
}

BenchReport run_priority_bench() {
  const PriorityBenchOptions& o = g_priority;
  if (o.low_copies <= 0)
    throw Error(Errc::invalid_argument, fmt::format("--low-copies {}: must be at least 1", o.low_copies));
  if (o.repetitions <= 0)
    throw Error(Errc::invalid_argument, fmt::format("--reps {}: must be at least 1", o.repetitions));
  Runtime rt;
  const std::string load_before = load_average();
  Layout aos = Layout::parse("F,x");
  Rect low_space = space_of(o.low_mib << 20), high_space = space_of(o.high_mib << 20);
  std::vector<Instance> low_src, low_dst;
  for (int i = 0; i < o.low_copies; ++i) {
    low_src.push_back(Instance::create(sys(), low_space, bench_fields(), aos));
    low_dst.push_back(Instance::create(sys(), low_space, bench_fields(), aos));
  }
  Instance hs = Instance::create(sys(), high_space, bench_fields(), aos);
  Instance hd = Instance::create(sys(), high_space, bench_fields(), aos);
  timed_copy(hs, hd);  // warm-up

  auto under_load = [&](int high_priority, int low_priority) {
    std::vector<Event> load;
    for (int i = 0; i < o.low_copies; ++i)
      load.push_back(copy(low_src[static_cast<std::size_t>(i)], low_dst[static_cast<std::size_t>(i)], {.priority = low_priority}));
    double t = timed_copy(hs, hd, {.priority = high_priority});
    merge_events(load).wait();
    return t * 1e3;
  };
  std::vector<double> alone, prioritized, fifo;
  for (int r = 0; r < o.repetitions; ++r) {
    alone.push_back(timed_copy(hs, hd, {.priority = 10}) * 1e3);
    prioritized.push_back(under_load(10, -10));
    fifo.push_back(under_load(0, 0));
  }
  Summary s_alone = summarize(alone), s_prio = summarize(prioritized), s_fifo = summarize(fifo);
  BenchReport out;
  BenchTable t{fmt::format("Completion time of a {} MiB copy, ms ({} runs; load: {} x {} MiB copies on the same memcpy channel)",
                           o.high_mib, o.repetitions, o.low_copies, o.low_mib),
               {"case", "median", "p10", "p90", "min", "max"}, {}};
  auto row = [](const std::string& name, const Summary& s) {
    return std::vector<std::string>{name, fmt::format("{:.2f}", s.median), fmt::format("{:.2f}", s.p10),
                                    fmt::format("{:.2f}", s.p90), fmt::format("{:.2f}", s.min), fmt::format("{:.2f}", s.max)};
  };
  t.rows.push_back(row("alone", s_alone));
  t.rows.push_back(row("under load, high priority", s_prio));
  t.rows.push_back(row("under load, no priorities (FIFO)", s_fifo));
  out.tables.push_back(t);
  out.notes.push_back(fmt::format("load average (1, 5, 15 min): {} before, {} after; the machine is shared, so figures move with it",
                                  load_before, load_average()));
  out.headlines.push_back(fmt::format("high priority under load / alone: {:.2f}x (goal <= 1.5)", s_prio.median / s_alone.median));
  out.headlines.push_back(fmt::format("completion time cut by priorities vs FIFO: {:.0f}%", 100.0 * (1 - s_prio.median / s_fifo.median)));
  out.figures = {{"ms", {{"alone", summary_json(s_alone)}, {"prioritized", summary_json(s_prio)}, {"fifo", summary_json(s_fifo)}}},
                 {"loaded_over_alone", s_prio.median / s_alone.median},
                 {"reduction_vs_fifo", 1 - s_prio.median / s_fifo.median}};
  return out;
}

}  // namespace

void add_bench_copy(CLI::App& bench) {
  CLI::App& c = add_bench_case(bench, "copy", "Direct and pipelined multi-hop copies vs memcpy and staged hops", run_copy_bench);
  // The range is checked on the text: CLI11 would otherwise read -1 as 2^64 - 1.
  const CLI::Range mebibytes(std::uint64_t{1}, kMaxMib);
  c.add_option("--mib", g_copy.mib, "MiB per copy")->check(mebibytes)->capture_default_str();
  c.add_option("--reps", g_copy.repetitions, "Runs of each case")->capture_default_str();
  c.add_flag("--timeline", g_copy.timeline, "Also show where each run's hops spent their time (with --json: every request)");
  c.add_flag("--small-only", g_copy.small_only, "Run only the small copies (2048 of 4 and 64 KiB: the cost of a copy)")
      ->excludes("--timeline");
  CLI::App& p = add_bench_case(bench, "priority", "A high-priority copy under load vs alone and vs FIFO", run_priority_bench);
  p.add_option("--low-copies", g_priority.low_copies, "Low-priority copies in the load")->capture_default_str();
  p.add_option("--low-mib", g_priority.low_mib, "MiB per low-priority copy")->check(mebibytes)->capture_default_str();
  p.add_option("--high-mib", g_priority.high_mib, "MiB of the high-priority copy")
      ->check(mebibytes)
      ->capture_default_str();
  p.add_option("--reps", g_priority.repetitions, "Runs of each case")->capture_default_str();
}

}  // namespace caravan::app
