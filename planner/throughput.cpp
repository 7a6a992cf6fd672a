#include <caravan/error.h>
#include <caravan/planner/throughput.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace caravan::planner {

ThroughputFunction::ThroughputFunction(std::vector<Sample> samples) : samples_(std::move(samples)) {
  if (samples_.empty()) throw Error(Errc::invalid_argument, "throughput table: at least one (bytes, GB/s) point is needed");
  std::sort(samples_.begin(), samples_.end(), [](const Sample& a, const Sample& b) { return a.bytes < b.bytes; });
  for (std::size_t i = 0; i < samples_.size(); ++i) {
    const auto& s = samples_[i];
    if (s.bytes == 0) throw Error(Errc::invalid_argument, "throughput table: request size 0 is not allowed");
    if (!(s.gbps > 0) || !std::isfinite(s.gbps))
      throw Error(Errc::invalid_argument, fmt::format("throughput table: throughput at {} bytes is {}, must be positive", s.bytes, s.gbps));
    if (i > 0 && samples_[i - 1].bytes == s.bytes)
      throw Error(Errc::invalid_argument, fmt::format("throughput table: request size {} appears twice", s.bytes));
    if (i > 0 && s.gbps < samples_[i - 1].gbps) {
      samples_[i].gbps = samples_[i - 1].gbps;
      flattened_ = true;
    }
  }
  for (const auto& s : samples_) log_bytes_.push_back(std::log2(static_cast<double>(s.bytes)));
}

ThroughputFunction ThroughputFunction::flat(double gbps) { return ThroughputFunction({{1, gbps}}); }

ThroughputFunction ThroughputFunction::scaled(const std::vector<Sample>& shape, double peak_gbps) {
  std::vector<Sample> samples;
  for (const auto& s : shape) samples.push_back({s.bytes, s.gbps * peak_gbps});
  return ThroughputFunction(std::move(samples));
}

double ThroughputFunction::operator()(double bytes) const noexcept {
  if (samples_.empty() || !(bytes > 0)) return 0.0;
  const auto& first = samples_.front();
  if (bytes <= static_cast<double>(first.bytes)) return first.gbps * bytes / static_cast<double>(first.bytes);
  if (bytes >= static_cast<double>(samples_.back().bytes)) return samples_.back().gbps;
  // First point strictly above `bytes`.
  auto it = std::upper_bound(samples_.begin(), samples_.end(), bytes,
                             [](double b, const Sample& s) { return b < static_cast<double>(s.bytes); });
  auto i = static_cast<std::size_t>(it - samples_.begin());
  double l = std::log2(bytes);
  double t = (l - log_bytes_[i - 1]) / (log_bytes_[i] - log_bytes_[i - 1]);
  return samples_[i - 1].gbps + t * (samples_[i].gbps - samples_[i - 1].gbps);
}

double ThroughputFunction::inverse(double gbps) const noexcept {
  if (!(gbps > 0)) return 0.0;
  if (samples_.empty() || gbps > samples_.back().gbps) return std::numeric_limits<double>::infinity();
  const auto& first = samples_.front();
  if (gbps <= first.gbps) return static_cast<double>(first.bytes) * gbps / first.gbps;
  // First point whose throughput reaches gbps; the segment before it crosses gbps.
  auto it = std::lower_bound(samples_.begin(), samples_.end(), gbps, [](const Sample& s, double g) { return s.gbps < g; });
  auto i = static_cast<std::size_t>(it - samples_.begin());
  double t = (gbps - samples_[i - 1].gbps) / (samples_[i].gbps - samples_[i - 1].gbps);
  return std::exp2(log_bytes_[i - 1] + t * (log_bytes_[i] - log_bytes_[i - 1]));
}

bool ThroughputFunction::operator==(const ThroughputFunction& other) const noexcept {
  if (samples_.size() != other.samples_.size()) return false;
  for (std::size_t i = 0; i < samples_.size(); ++i)
    if (samples_[i].bytes != other.samples_[i].bytes || samples_[i].gbps != other.samples_[i].gbps) return false;
  return true;
}

}  // namespace caravan::planner
