// Private: the planner's model of one transfer's layouts (section 4.2).
//
// Every layout the planner considers for this transfer is a sequence of atoms: F, and for each
// dimension an inner part d_in and an outer part d_out (or, for a dimension that the source and
// destination block differently, each side's own components). A dimension that both layouts keep
// whole gets a blocking factor c_d chosen by the planner: d_in has size c_d and d_out |d| / c_d, so
// every PREFIX and SUFFIX-bar is a monomial 2^k * prod c_d^e_d, and a constraint on it is linear in
// log c_d. c_d ranges over the divisors of |d| (intermediate buffers are never padded).
//
// The layouts considered for intermediate buffers are the source, the destination, and the four
// tilings T_ab = inner atoms in the order of layout a, then outer atoms in the order of layout b,
// for a, b in {src, dst}. Section 4.3's Table 3 path uses exactly these: l1 = T_ss, l2 = l3 = T_ds.
#pragma once

#include <caravan/planner/plan.h>

#include <array>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace caravan::planner {
class ThroughputFunction;
}

namespace caravan::planner::detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

// 2^log2c * prod_v c_v^e[v]
struct Mono {
  double log2c = 0;
  std::array<std::int8_t, kMaxDims> e{};
  bool constant() const noexcept { return e[0] == 0 && e[1] == 0 && e[2] == 0 && e[3] == 0; }
  double log2_at(const std::array<double, kMaxDims>& var_log2) const noexcept {
    double v = log2c;
    for (std::size_t i = 0; i < kMaxDims; ++i) v += e[i] * var_log2[i];
    return v;
  }
  void multiply(const Mono& other) noexcept {
    log2c += other.log2c;
    for (std::size_t i = 0; i < kMaxDims; ++i) e[i] = static_cast<std::int8_t>(e[i] + other.e[i]);
  }
};

struct ModelAtom {
  enum Kind : std::uint8_t { fields, whole, inner, outer };
  Kind kind = fields;
  int dim = 0;
  int var = -1;             // blocking variable, or -1 for a fixed size
  std::uint64_t block = 0;  // fixed block of an inner/outer part
  Mono size;
};

struct Model {
  int vars = 0;
  std::array<int, kMaxDims> var_dim{};
  std::array<std::vector<std::uint64_t>, kMaxDims> domain;  // divisors, ascending
  std::array<std::vector<double>, kMaxDims> domain_log2;
  std::vector<ModelAtom> atoms;
  std::vector<std::vector<std::uint8_t>> candidates;  // atom sequences
  std::vector<std::string> names;                     // "src", "dst", "tile(src|dst)"...
  int src = 0, dst = 0;                               // candidate indices (equal if the layouts are)
  int count = 0;                                      // number of candidates
  struct Pair {
    Mono request;  // PREFIX in bytes
    Mono shuffle;  // SUFFIX-bar in bytes
    double max_request_log2 = 0;
    double min_shuffle_log2 = 0;
  };
  std::vector<Pair> pairs;  // count * count
  const Pair& pair(int a, int b) const noexcept { return pairs[static_cast<std::size_t>(a * count + b)]; }
  std::uint32_t max_field = 0;
  Layout src_layout, dst_layout;
  const IndexSpace* space = nullptr;

  // The concrete layout of a candidate under blocking factors index[v] (into domain[v]).
  Layout layout(int candidate, const std::array<int, kMaxDims>& index) const;
  // A default index for variables that no constraint touches: the largest block.
  std::array<int, kMaxDims> default_index() const;
};

// Throws Error(invalid_argument) if a layout does not describe the request's instance.
Model build_model(const TransferRequest& request);

// One hop's constraints for the block solver.
struct HopConstraint {
  const ThroughputFunction* tp = nullptr;
  const Mono* request = nullptr;
  double cap = kInf;              // request bytes are capped by the buffers the hop touches
  const Mono* shuffle = nullptr;  // set when both ends are buffers
  double shuffle_limit = kInf;
};

struct BlockSolution {
  bool feasible = false;
  double gbps = 0;
  std::array<int, kMaxDims> index{};
};

// Section 4.2 parts (2) and (3) for one path with fixed layouts: the blocking factors that
// maximise min over hops of tp(min(PREFIX, cap)), subject to SUFFIX-bar <= limit, by binary
// search on the throughput with a feasibility test of the log-linear system. `upper_bound`
// caps the answer (shared resources).
BlockSolution solve_blocks(const Model& model, std::span<const HopConstraint> hops, double upper_bound);
double throughput_at(const Model& model, std::span<const HopConstraint> hops, const std::array<int, kMaxDims>& index,
                     double upper_bound);

}  // namespace caravan::planner::detail
