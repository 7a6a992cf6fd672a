// The one table of CARAVAN_* settings. Every subsystem's knobs are declared here, so that
// `caravan config` can list all of them with defaults and docs, and so that a typo in a name is
// an error rather than a silently ignored variable.
#include <caravan/error.h>
#include <caravan/settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include <unistd.h>

namespace caravan::settings {
namespace {

enum class Kind { integer, bytes, real, boolean, string, choice };

struct Definition {
  const char* name;
  Kind kind;
  const char* default_value;
  const char* doc;
  double min = -std::numeric_limits<double>::infinity();  // for integer, bytes, real
  double max = std::numeric_limits<double>::infinity();
  const char* choices = "";  // for choice: "a|b|c"
  std::int64_t multiple_of = 0;  // for integer: the value must be a multiple of this (0: any)
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// clang-format off
const Definition kTable[] = {
  // --- core runtime ---
  {"CARAVAN_LOG_LEVEL", Kind::choice, "warn",
   "Log level of every subsystem logger", -kInf, kInf, "trace|debug|info|warn|error|critical|off"},
  {"CARAVAN_CPU_WORKERS", Kind::integer, "0",
   "Worker threads of each rank's CPU processor; 0 means one per core", 0, 4096},
  {"CARAVAN_WORKER_SPIN_US", Kind::integer, "50",
   "How long an idle CPU worker, GPU task launcher or GPU stream thread polls for work before it sleeps (microseconds)", 0, 1000000},
  {"CARAVAN_GPU_TASK_STREAMS", Kind::integer, "2",
   "Streams of each GPU processor per priority class (tasks of priority > 0 use high-priority streams)", 1, 64},
  {"CARAVAN_WAIT_SPIN_US", Kind::integer, "-1",
   "How long Event::wait polls before it blocks the thread (microseconds); -1: 20, and 5000 once the runtime uses "
   "a GPU (a blocked thread took 150-200 us to wake on the GPU machine)", -1, 1000000},
  {"CARAVAN_WAIT_HELPS", Kind::boolean, "true",
   "Whether a thread in Event::wait or Event::query finishes GPU copy requests that have completed on the device "
   "while the channel's service threads sleep (waking one took 150-200 us on the GPU machine)"},
  // --- planner ---
  {"CARAVAN_PLANNER_FULL_MIN_BYTES", Kind::bytes, "16M",
   "Transfers of at least this many bytes use the full path planner; smaller ones the simple planner", 0, kInf},
  {"CARAVAN_PLANNER_BUFFER_THRESHOLD", Kind::bytes, "32M",
   "TH: the largest intermediate buffer one hop of a planned path may use (bytes)", 1, kInf},
  {"CARAVAN_PLANNER_MAX_HOPS", Kind::integer, "6",
   "Longest path (in hops, self-loops included) the planners consider", 1, 16},
  {"CARAVAN_PLANNER_TRANSIT_NODES", Kind::boolean, "false",
   "Whether planned paths may pass through memories of nodes other than the source's and destination's"},
  {"CARAVAN_PLANNER_MAX_PATHS", Kind::integer, "8",
   "Most paths the multi-path planner splits one transfer over", 1, 64},
  {"CARAVAN_PLANNER_CACHE_ENTRIES", Kind::integer, "4096",
   "Plans kept in the path cache (least recently used dropped first); 0 disables it", 0, 1000000},
  {"CARAVAN_PLANNER_MACHINE", Kind::string, "local",
   "The machine `caravan plan` and `caravan machine show` use without --machine: local (this machine as the runtime "
   "sees it), a built-in machine (isometry-two-node, h200x4), generate:NxG, or a machine file path. Copies always "
   "plan on the live machine"},
  // --- DMA engine ---
  {"CARAVAN_DMA_REQUEST_BYTES", Kind::bytes, "256K",
   "Smallest batch of bytes a DMA worker sends to a channel in one request (the priority pre-emption granularity)", 4096, kInf},
  {"CARAVAN_DMA_INLINE_BYTES", Kind::bytes, "64K",
   "A one-hop copy of at most this many bytes between host memories (memcpy) runs on the thread that calls copy() "
   "(or that triggers its precondition) instead of waking the channel's DMA worker, which costs more than such a "
   "copy; 0 hands every copy to the worker", 0, kInf},
  {"CARAVAN_DMA_TILE_BYTES", Kind::bytes, "4M",
   "Largest tile a copy is cut into for pipelining (also bounded by the buffer threshold / slots)", 4096, kInf},
  {"CARAVAN_DMA_SLOTS", Kind::integer, "3",
   "Tile slots per intermediate buffer (ring depth of the pipeline between two hops)", 2, 64},
  {"CARAVAN_DMA_POOL_BYTES", Kind::bytes, "1G",
   "Intermediate-buffer bytes all copies together may hold in one memory", 1, kInf},
  {"CARAVAN_DMA_IDLE_BUFFER_BYTES", Kind::bytes, "64M",
   "Intermediate-buffer bytes per memory (pageable, pinned and GPU) kept allocated after copies finish, for the next copies to reuse", 0, kInf},
  {"CARAVAN_DMA_MULTIPATH_MIN_BYTES", Kind::bytes, "0",
   "Copies of at least this many bytes with PlannerChoice::automatic are split over several paths at once when the "
   "multi-path planner finds them (copies within this rank, without landing flags); 0: only copies that ask for "
   "PlannerChoice::multipath", 0, kInf},
  {"CARAVAN_DMA_MULTIPATH_LEARN", Kind::real, "0",
   "When > 0, multi-path copies are cut by the rates their paths were measured at in earlier copies of the same "
   "shape: each finished copy moves the learned rates this fraction of the way to what it measured (0: the planner's "
   "cut; copies with landing flags keep it always, as copy_tiling describes it). Helps where a path runs "
   "steadily off its modelled rate; on 4 x H200 host->GPU it measured 0.99-1.00 of the planner's cut", 0, 1},
  {"CARAVAN_LL128_MIN_BYTES", Kind::bytes, "32K",
   "The low-latency AllGather and ReduceScatter (also in ll_bulk of AllGather+GEMM and GEMM+ReduceScatter) send this "
   "many bytes per rank and more as 128-byte "
   "lines of 120 data bytes (NVIDIA GPUs with native peer atomics between every pair, i.e. NVLink), smaller "
   "messages as 16-byte lines of 8 (0: always 16-byte lines)", 0, kInf},
  {"CARAVAN_DMA_IPC_DIRECT", Kind::boolean, "true",
   "A copy from this rank into another rank's GPU memory on this node, all of whose hops run here, starts at once "
   "through the destination's IPC handle (sent with its descriptor) instead of a set-up exchange with its owner "
   "(false: the exchange, which also keeps the owner's instance alive during the copy)", 0, 0},
  {"CARAVAN_DMA_STALL_S", Kind::real, "10",
   "A copy that makes no progress for this many seconds is reported in the log (inf: never)", 0.01, kInf},
  {"CARAVAN_MEMCPY_THREADS", Kind::integer, "1",
   "Threads that share one large memcpy request (1: the channel's worker alone)", 1, 256},
  {"CARAVAN_MEMCPY_SPLIT_BYTES", Kind::bytes, "1M",
   "memcpy requests at least this large are split over CARAVAN_MEMCPY_THREADS", 1, kInf},
  {"CARAVAN_MEMCPY_STREAM_BYTES", Kind::bytes, "128K",
   "memcpy runs at least this long are copied with non-temporal stores, in the order measured fastest on this CPU, "
   "or by memcpy where that measured faster (0: always memcpy)", 0, kInf},
  {"CARAVAN_DSK_DIR", Kind::string, "/tmp",
   "Directory for file-backed (dsk) instances and buffers"},
  {"CARAVAN_CACHE_DIR", Kind::string, "",
   "Where channel calibrations are cached (empty: $XDG_CACHE_HOME/caravan or ~/.cache/caravan)"},
  // --- distributed ---
  {"CARAVAN_UCX_TLS", Kind::string, "",
   "UCX transports between ranks (UCX_TLS syntax, e.g. tcp or sm,self); empty: UCX's default choice"},
  {"CARAVAN_UCX_ERROR_MODE", Kind::choice, "auto",
   "UCX endpoint error handling: peer survives a peer's failure but, in UCX 1.13, rules out shared-memory transports; "
   "none keeps them (heartbeats detect failures) but UCX aborts on some network errors; auto: none towards ranks of "
   "this host when CARAVAN_UCX_TLS allows shared memory, peer otherwise", -kInf, kInf, "auto|none|peer"},
  {"CARAVAN_UCX_POLL_US", Kind::integer, "50",
   "How long the progress thread polls after the last UCX event before it sleeps on the worker's fd (microseconds)",
   0, 1000000},
  {"CARAVAN_HEARTBEAT_MS", Kind::integer, "200",
   "Period of the heartbeat each rank sends every peer (milliseconds)", 10, 60000},
  {"CARAVAN_PEER_TIMEOUT_S", Kind::real, "5",
   "A peer that sent nothing (heartbeats included) for this long is declared failed (seconds)", 0.1, 86400},
  {"CARAVAN_BOOTSTRAP_TIMEOUT_S", Kind::real, "60",
   "How long the rendezvous waits for every rank to join (seconds)", 0.1, 86400},
  {"CARAVAN_SHUTDOWN_TIMEOUT_S", Kind::real, "30",
   "How long a rank that shuts down keeps serving peers that are still running; and, with several ranks, how long "
   "its task bodies blocked in Event::wait may go without progress before each of the two steps that poison the "
   "pending events they may wait on (user events, then all; one rank waits 20 ms). Seconds",
   0, 86400},
  {"CARAVAN_NIC_WINDOW", Kind::integer, "4",
   "Requests the nic channel keeps in flight towards one rank (each is one or more UCX puts)", 1, 256},
  {"CARAVAN_NIC_GBPS", Kind::real, "10",
   "Peak throughput the planner assumes for the nic channel between two ranks (GB/s; not calibrated, since "
   "measuring it takes two ranks): it sets the predicted rate and the nic hop's request size, not the path", 0.001, 100000},
  {"CARAVAN_SYMMETRIC_HEAP_BYTES", Kind::bytes, "16M",
   "Size of each rank's part of the host symmetric heap (POSIX shared memory per node); 0: no heap", 0, kInf},
  // --- overlap kernels (kernels/, docs/overlap.md) ---
  {"CARAVAN_OVERLAP_THREADS", Kind::integer, "0",
   "Compute threads per rank of the CPU overlapped GEMMs (AllGather+GEMM, GEMM+ReduceScatter, GEMM+All-Scatter); "
   "0: the cores divided by the ranks of the job on this host (at least 1)", 0, 256},
  {"CARAVAN_OVERLAP_COMM_THREADS", Kind::integer, "1",
   "Threads of the workgroup_specialized variant that only communicate (the others compute)", 1, 64},
  {"CARAVAN_OVERLAP_TILE_M", Kind::integer, "64",
   "Rows per flagged chunk of the CPU overlapped collectives, also the GEMM tile's rows", 1, 1 << 20},
  {"CARAVAN_OVERLAP_TILE_N", Kind::integer, "128",
   "Columns of a CPU GEMM tile (a multiple of 32)", 32, 1 << 20, "", 32},
  {"CARAVAN_OVERLAP_TIMEOUT_S", Kind::real, "30",
   "Longest a CPU overlapped operation waits for one flag (a chunk, a peer's entry) before it fails (seconds)", 0.001, 86400},
  {"CARAVAN_OVERLAP_GPU_COMM_BLOCKS", Kind::integer, "32",
   "Blocks (each on one SM) of the SM-driven push of the GPU AllGather+GEMM variant sm-push, which runs beside the "
   "GEMM: more push faster and leave fewer SMs to the GEMM (the bulk variant sm-bulk takes every SM)", 1, 1024},
  {"CARAVAN_OVERLAP_GPU_PACE", Kind::choice, "pulls",
   "GPU overlapped operations: when a call waits on the host until earlier calls on its rank have finished before it "
   "is queued. pulls: a copy-engine pull (AllGather+GEMM ce-pull, ce-pull runs, ce-bulk, tile-pull) waits for every "
   "operation's calls on its GPU, and the next call on that GPU, of any operation, waits for it; a call not measured "
   "unpaced yet (AllGather+GEMM tile-push, GEMM+ReduceScatter ce-push, ce-bulk, ll-bulk, tile-push, tile-scatter, "
   "blas-scatter, every GEMM+All-Scatter call) waits for its own operation's previous call, and that operation's next "
   "call for it; the rest (AllGather+GEMM ce-push, ce-push runs, sm-push, sm-bulk, ll-bulk; GEMM+ReduceScatter "
   "sm-pull, sm-push) run ahead. Pulls queued behind other copies that wait on flags "
   "hang on 4 x H200 (docs/overlap.md, 'Run-ahead'). all: as pulls, and every call also waits for its own "
   "operation's previous call; none: no call waits (calls may then be captured in a graph, at the risk of that hang)",
   -kInf, kInf, "pulls|all|none"},
  {"CARAVAN_OVERLAP_GPU_SM_RS_MAX_BYTES", Kind::bytes, "32M",
   "Largest partial (M x N bf16) for which a GPU GEMM+ReduceScatter takes the two symmetric-heap buffers of its "
   "SM-driven variants sm-pull and sm-push, when the heap has room; above it they are not offered (after a large GEMM "
   "they ran no faster than the bulk baseline, and the buffers take heap other variants use). The ReduceScatter alone "
   "takes them at any size. Read when the operation is constructed; every rank must see the same value", 0, kInf},
  {"CARAVAN_OVERLAP_GPU_SM_RS_ROUND_BYTES", Kind::bytes, "4M",
   "GPU ReduceScatter sm and GEMM+ReduceScatter sm-push: bytes a rank sends each peer per round (at most 8 rounds); "
   "each block sums one round while the next round's stores are on the links. 0: one round (store everything, then "
   "sum). Read when the operation is constructed; every rank must see the same value", 0, kInf},
  {"CARAVAN_OVERLAP_GPU_RING_PUSH_BYTES", Kind::bytes, "0",
   "GPU GEMM+ReduceScatter ce-ring: the least bytes one push to the next rank carries. A ring's GEMMs run in parts "
   "(x2, x4 parts); its pushes take consecutive parts of a step together, the fewest that divide the step's parts "
   "and reach this (at most the whole step). 0: a push per part. Ranks may differ. Read when the operation is "
   "constructed", 0, kInf},
  {"CARAVAN_OVERLAP_GPU_EARLY_LAUNCH", Kind::boolean, "true",
   "GPU GEMM+ReduceScatter sm-pull, sm-push and ll-bulk, and the LL AllGather: launch the exchange kernel as a programmatic "
   "dependent of the kernel before it (Hopper and later), so that its launch overlaps that kernel's end; off: an ordinary launch "
   "(read when the operation is constructed)"},
  {"CARAVAN_GPU_GEMM_TUNE", Kind::integer, "8",
   "GPU overlapped operations and the layer: when an operation is built, time each of its GEMM shapes on random data, "
   "cuBLAS's untuned choice against up to this many cuBLASLt algorithms (the heuristic's first ones, each with one K "
   "split and no reduction between blocks), and run the fastest (if 1% faster) from then on, in every operation of "
   "the process on that GPU and in its bulk baseline alike (cuBLAS's default ran some of the layer's GEMMs up to 18% "
   "slower on an H200: bench gemm). Costs about 144 GEMMs per shape once per GPU (about 0.17 s a shape of the "
   "8192-token layer on an H200). 0: tune nothing and run cuBLAS's choice, as PyTorch does", 0, 64},
  // --- GPU ---
  {"CARAVAN_GPU_STREAMS", Kind::integer, "1",
   "Streams each GPU channel (sdma, xgmi) spreads its requests over; 1 queues them behind each other on one link, "
   "so the next is always ready when one finishes (requests on several streams share the link and finish together)", 1, 64},
  {"CARAVAN_GPU_WORKER_SPIN_US", Kind::integer, "1000",
   "How long the DMA worker of a GPU channel polls for its next event (a completion, a new copy), and the channel's "
   "completion thread for its next request, before they sleep (microseconds; 0: sleep at once, as host channels do). "
   "A copy that comes after a longer idle time waits for the threads to wake (150-200 us on a 4 x H200 host)",
   0, 1000000},
  {"CARAVAN_GPU_XGMI_ENGINE", Kind::choice, "copy",
   "What moves the bytes of xgmi (GPU to peer GPU) requests: copy (the source GPU's copy engines), sm (a kernel on "
   "the source GPU's SMs storing into the peer: holds more when every GPU sends to every other at once, and takes SMs), "
   "or auto (each request: the copy engines when no other xgmi request of the source GPU is in flight, else sm)",
   -kInf, kInf, "copy|sm|auto"},
  {"CARAVAN_GPU_XGMI_SM_BLOCKS", Kind::integer, "0",
   "With CARAVAN_GPU_XGMI_ENGINE=sm or auto: the most blocks (of 256 threads) one xgmi request's kernel takes; 0: one "
   "per SM of the source GPU (132 on an H200), so that the kernels of its requests to several peers run side by side "
   "instead of one after another in launch order (a grid that fills the GPU made every GPU sending to every other at "
   "once 227 GB/s per GPU on 4 x H200; one block per SM, 285-321)",
   0, 65535},
  {"CARAVAN_GPU_WINDOW", Kind::integer, "2",
   "Requests a GPU channel keeps in flight (2: one running, one queued behind it); at most CARAVAN_DMA_SLOTS lets one "
   "copy fill it alone, so that a high-priority copy waits behind no more than this many requests", 1, 256},
  {"CARAVAN_GPU_REQUEST_US", Kind::integer, "250",
   "GPU channels send requests of at least this much work at their calibrated peak (microseconds; each copy-engine "
   "call costs a few): longer ones waste less, shorter ones let a high-priority copy in sooner", 1, 1000000},
};
// clang-format on

const Definition* find(std::string_view name) {
  for (const auto& d : kTable)
    if (name == d.name) return &d;
  return nullptr;
}

const Definition& require(std::string_view name) {
  if (const Definition* d = find(name)) return *d;
  throw Error(Errc::not_found, fmt::format("unknown setting '{}' (run `caravan config` to list them)", name));
}

std::shared_mutex g_mutex;
std::map<std::string, std::string, std::less<>>& overrides() {
  static std::map<std::string, std::string, std::less<>> map;
  return map;
}

// "int in [0, 64]", "bytes >= 0", "double": the kind and, where it has one, the range a value
// must lie in (what `caravan config` shows, so a rule is known before a value breaks it).
std::string with_range(const char* kind, const Definition& d) {
  const bool low = std::isfinite(d.min), high = std::isfinite(d.max);
  if (low && high) return fmt::format("{} in [{}, {}]", kind, d.min, d.max);
  if (low) return fmt::format("{} >= {}", kind, d.min);
  if (high) return fmt::format("{} <= {}", kind, d.max);
  return kind;
}

std::string type_name(const Definition& d) {
  switch (d.kind) {
    case Kind::integer: return with_range("int", d);
    case Kind::bytes: return with_range("bytes", d);
    case Kind::real: return with_range("double", d);
    case Kind::boolean: return "bool";
    case Kind::string: return "string";
    case Kind::choice: return fmt::format("one of {}", d.choices);
  }
  return "?";
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

[[noreturn]] void reject(const Definition& d, std::string_view value, std::string_view rule) {
  throw Error(Errc::invalid_argument, fmt::format("{}='{}': {}", d.name, value, rule));
}

void check_range(const Definition& d, std::string_view text, double value) {
  if (std::isnan(value)) reject(d, text, fmt::format("must be a number in [{}, {}]", d.min, d.max));
  if (value < d.min || value > d.max)
    reject(d, text, fmt::format("must be in [{}, {}]", d.min, d.max));
}

std::int64_t parse_int(const Definition& d, std::string_view text) {
  std::int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    reject(d, text, "expected an integer");
  check_range(d, text, static_cast<double>(value));
  if (d.multiple_of > 0 && value % d.multiple_of != 0)
    reject(d, text, fmt::format("must be a multiple of {}", d.multiple_of));
  return value;
}

// The byte-count grammar (parse_byte_count); on failure returns nullopt and the rule broken.
std::optional<std::uint64_t> byte_count(std::string_view text, std::string* rule) {
  std::uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) return *rule = "too large", std::nullopt;
  if (ec != std::errc() || ptr == text.data())
    return *rule = "expected a byte count such as 4096, 64K, 16M or 1G", std::nullopt;
  std::string_view suffix(ptr, static_cast<std::size_t>(text.data() + text.size() - ptr));
  std::string s = lower(suffix);
  if (!s.empty() && s.back() == 'b') s.pop_back();
  if (!s.empty() && s.back() == 'i') s.pop_back();
  unsigned shift = 0;
  if (s.empty()) shift = 0;
  else if (s == "k") shift = 10;
  else if (s == "m") shift = 20;
  else if (s == "g") shift = 30;
  else if (s == "t") shift = 40;
  else
    return *rule = "unknown size suffix (use K, M, G or T, for example 64K)", std::nullopt;
  if (shift && value > (std::numeric_limits<std::uint64_t>::max() >> shift)) return *rule = "too large", std::nullopt;
  return value << shift;
}

std::uint64_t parse_bytes(const Definition& d, std::string_view text) {
  std::string rule;
  const std::optional<std::uint64_t> value = byte_count(text, &rule);
  if (!value) reject(d, text, rule);
  check_range(d, text, static_cast<double>(*value));
  return *value;
}

double parse_real(const Definition& d, std::string_view text) {
  std::string copy(text);
  char* end = nullptr;
  double value = std::strtod(copy.c_str(), &end);
  // strtod also reads hexadecimal ("0x10" as 16), which no one means for seconds or ratios.
  if (copy.empty() || end != copy.c_str() + copy.size() || copy.find_first_of("xX") != std::string::npos)
    reject(d, text, "expected a decimal number");
  check_range(d, text, value);
  return value;
}

bool parse_bool(const Definition& d, std::string_view text) {
  std::string s = lower(text);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  reject(d, text, "expected one of 1/0, true/false, yes/no, on/off");
}

std::string parse_choice(const Definition& d, std::string_view text) {
  std::string s = lower(text);
  std::string_view choices = d.choices;
  while (!choices.empty()) {
    auto bar = choices.find('|');
    auto choice = choices.substr(0, bar);
    if (s == choice) return s;
    if (bar == std::string_view::npos) break;
    choices.remove_prefix(bar + 1);
  }
  reject(d, text, fmt::format("must be one of {}", d.choices));
}

// Validates `text` as a value of `d`; throws if it is not one.
void validate(const Definition& d, std::string_view text) {
  switch (d.kind) {
    case Kind::integer: parse_int(d, text); break;
    case Kind::bytes: parse_bytes(d, text); break;
    case Kind::real: parse_real(d, text); break;
    case Kind::boolean: parse_bool(d, text); break;
    case Kind::string: break;
    case Kind::choice: parse_choice(d, text); break;
  }
}

// The raw current value and where it came from.
std::pair<std::string, Source> raw_value(const Definition& d) {
  {
    std::shared_lock lock(g_mutex);
    auto it = overrides().find(d.name);
    if (it != overrides().end()) return {it->second, Source::override_value};
  }
  if (const char* env = std::getenv(d.name)) return {env, Source::environment};
  return {d.default_value, Source::default_value};
}

const Definition& require_kind(std::string_view name, std::initializer_list<Kind> kinds) {
  const Definition& d = require(name);
  if (std::find(kinds.begin(), kinds.end(), d.kind) == kinds.end())
    throw Error(Errc::internal, fmt::format("setting {} is a {}, read with the wrong accessor", d.name, type_name(d)));
  return d;
}

// Edits (insertions, deletions, substitutions) between two names.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}
}  // namespace

std::uint64_t parse_byte_count(std::string_view text, std::string_view what) {
  std::string rule;
  const std::optional<std::uint64_t> value = byte_count(text, &rule);
  if (!value) throw Error(Errc::invalid_argument, fmt::format("{} '{}': {}", what, text, rule));
  return *value;
}

std::vector<UnknownVariable> unknown_environment_variables() {
  std::vector<UnknownVariable> out;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string_view text(*entry);
    if (!text.starts_with("CARAVAN_")) continue;
    const std::string_view name = text.substr(0, text.find('='));
    // CARAVAN_NODE and CARAVAN_JOB_ID are set by `caravan run` for its ranks; CARAVAN_TEST_*
    // belong to test programs.
    if (find(name) || name == "CARAVAN_NODE" || name == "CARAVAN_JOB_ID" || name.starts_with("CARAVAN_TEST_")) continue;
    UnknownVariable unknown{std::string(name), ""};
    // A name within a third of its length in edits, or one that extends or is extended by a
    // setting's name (CARAVAN_WAIT_SPIN for CARAVAN_WAIT_SPIN_US), is a likely intended one.
    std::size_t best = name.size() / 3 + 1;
    for (const auto& d : kTable) {
      const std::string_view candidate(d.name);
      const std::size_t distance =
          candidate.starts_with(name) || name.starts_with(candidate) ? 1 : edit_distance(name, candidate);
      if (distance < best) best = distance, unknown.suggestion = d.name;
    }
    out.push_back(std::move(unknown));
  }
  return out;
}

std::vector<SettingView> list() {
  std::vector<SettingView> out;
  for (const auto& d : kTable) {
    auto [value, source] = raw_value(d);
    SettingView view{d.name, type_name(d), d.default_value, value, source, d.doc, ""};
    try {
      validate(d, value);
    } catch (const Error& e) {
      view.error = e.what();
    }
    out.push_back(std::move(view));
  }
  // Rules between settings, on the first setting they name.
  const auto timeout =
      std::find_if(out.begin(), out.end(), [](const SettingView& v) { return v.name == "CARAVAN_PEER_TIMEOUT_S"; });
  const bool both_valid = std::none_of(out.begin(), out.end(), [](const SettingView& v) {
    return (v.name == "CARAVAN_PEER_TIMEOUT_S" || v.name == "CARAVAN_HEARTBEAT_MS") && !v.error.empty();
  });
  if (timeout != out.end() && both_valid) timeout->error = peer_timeout_error();
  return out;
}

std::string peer_timeout_error() {
  const double timeout_s = get_double("CARAVAN_PEER_TIMEOUT_S");
  const auto heartbeat_ms = static_cast<double>(get_int("CARAVAN_HEARTBEAT_MS"));
  if (timeout_s * 1000.0 >= 3.0 * heartbeat_ms) return {};
  return fmt::format(
      "CARAVAN_PEER_TIMEOUT_S={}: must be at least three heartbeat periods (CARAVAN_HEARTBEAT_MS={}): "
      "{:.3f} s or more, or a shorter heartbeat",
      timeout_s, heartbeat_ms, 3.0 * heartbeat_ms / 1000.0);
}

std::int64_t get_int(std::string_view name) {
  const Definition& d = require_kind(name, {Kind::integer});
  return parse_int(d, raw_value(d).first);
}

std::uint64_t get_bytes(std::string_view name) {
  const Definition& d = require_kind(name, {Kind::bytes});
  return parse_bytes(d, raw_value(d).first);
}

double get_double(std::string_view name) {
  const Definition& d = require_kind(name, {Kind::real, Kind::integer});
  return parse_real(d, raw_value(d).first);
}

bool get_bool(std::string_view name) {
  const Definition& d = require_kind(name, {Kind::boolean});
  return parse_bool(d, raw_value(d).first);
}

std::string get_string(std::string_view name) {
  const Definition& d = require_kind(name, {Kind::string, Kind::choice});
  std::string value = raw_value(d).first;
  return d.kind == Kind::choice ? parse_choice(d, value) : value;
}

void set_override(std::string_view name, std::string value) {
  const Definition& d = require(name);
  validate(d, value);
  std::unique_lock lock(g_mutex);
  overrides()[std::string(name)] = std::move(value);
}

void clear_override(std::string_view name) {
  require(name);
  std::unique_lock lock(g_mutex);
  overrides().erase(std::string(name));
}

ScopedOverride::ScopedOverride(std::string_view name, std::string value) : name_(name) {
  {
    std::shared_lock lock(g_mutex);
    auto it = overrides().find(name_);
    if (it != overrides().end()) {
      had_previous_ = true;
      previous_ = it->second;
    }
  }
  set_override(name, std::move(value));
}

ScopedOverride::~ScopedOverride() {
  std::unique_lock lock(g_mutex);
  if (had_previous_) overrides()[name_] = previous_;
  else overrides().erase(name_);
}

}  // namespace caravan::settings
