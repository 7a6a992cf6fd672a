// A channel's throughput as a function of request size, tp(r) (Isometry section 4.1, Figure 5).
#pragma once

#include <cstdint>
#include <vector>

namespace caravan::planner {

// tp(r) in GB/s (1e9 bytes per second) for a request of r bytes, given by a table of measured
// points and interpolated linearly in log2(r) between them:
//   - above the largest point, tp stays at that point's value (the channel's peak);
//   - below the smallest point (r0, t0), tp(r) = t0 * r / r0: a request that small costs the same
//     fixed overhead as one of r0 bytes, which is how every measured channel behaves there.
// The planner needs tp to be non-decreasing (section 4.2); a table that dips at large sizes is
// flattened to its running maximum, following the paper's footnote: a slow large request can
// always be split into faster smaller ones. flattened() tells whether that happened.
class ThroughputFunction {
 public:
  struct Sample {
    std::uint64_t bytes = 0;
    double gbps = 0;
  };

  ThroughputFunction() = default;
  // Throws Error(invalid_argument) for an empty table, repeated or zero sizes, or a
  // non-positive or non-finite throughput. Points may come in any order.
  explicit ThroughputFunction(std::vector<Sample> samples);
  // The same at every request size.
  static ThroughputFunction flat(double gbps);
  // `shape` holds fractions of the peak (e.g. the curves of Figure 5), scaled to `peak_gbps`.
  static ThroughputFunction scaled(const std::vector<Sample>& shape, double peak_gbps);

  double operator()(double bytes) const noexcept;
  double peak() const noexcept { return samples_.empty() ? 0.0 : samples_.back().gbps; }
  // The smallest request size r with tp(r) >= gbps: 0 for gbps <= 0, +infinity above the peak.
  double inverse(double gbps) const noexcept;

  const std::vector<Sample>& samples() const noexcept { return samples_; }
  bool flattened() const noexcept { return flattened_; }
  bool operator==(const ThroughputFunction& other) const noexcept;

 private:
  std::vector<Sample> samples_;  // sorted by size, non-decreasing throughput
  std::vector<double> log_bytes_;
  bool flattened_ = false;
};

}  // namespace caravan::planner
