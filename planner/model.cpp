#include "planner/model.h"

#include <caravan/error.h>
#include <caravan/planner/throughput.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace caravan::planner::detail {
namespace {

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

// Divisors of n, ascending. Memoised per thread: extents repeat, and trial division of a large
// prime extent costs up to sqrt(n) steps.
const std::vector<std::uint64_t>& divisors(std::uint64_t n) {
  thread_local std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> memo;
  auto it = memo.find(n);
  if (it != memo.end()) return it->second;
  if (memo.size() > 1024) memo.clear();
  std::vector<std::uint64_t> small, large;
  for (std::uint64_t d = 1; d * d <= n; ++d) {
    if (n % d) continue;
    small.push_back(d);
    if (d != n / d) large.push_back(n / d);
  }
  small.insert(small.end(), large.rbegin(), large.rend());
  return memo.emplace(n, std::move(small)).first->second;
}

std::uint64_t block_of(const Layout& l, int d) {
  for (const auto& c : l)
    if (c.kind == LayoutComponent::Kind::dim_in && c.dim == d) return c.block;
  return 0;
}

Mono constant(double bytes) {
  Mono m;
  m.log2c = std::log2(bytes);
  return m;
}

}  // namespace

Model build_model(const TransferRequest& request) {
  request.validate();
  Model m;
  m.space = &request.space;
  m.src_layout = request.src_layout;
  m.dst_layout = request.dst_layout;
  m.max_field = request.fields.max_size();
  const int dims = request.space.dims();

  // Atoms: F first, then per dimension.
  ModelAtom f;
  f.kind = ModelAtom::fields;
  f.size = constant(static_cast<double>(request.fields.total_size()));
  m.atoms.push_back(f);
  // For each dimension: the atoms a whole / inner / outer component of the src (side 0) and dst
  // (side 1) layout expands to.
  struct DimAtoms {
    std::array<std::vector<std::uint8_t>, 2> whole;  // what a whole "d" expands to, per side
    std::array<int, 2> inner{-1, -1}, outer{-1, -1};
  };
  std::array<DimAtoms, kMaxDims> per_dim;
  bool tileable = true;
  for (int d = 0; d < dims; ++d) {
    auto ext = static_cast<std::uint64_t>(request.space.extent(d));
    std::uint64_t b1 = block_of(request.src_layout, d), b2 = block_of(request.dst_layout, d);
    auto& pd = per_dim[static_cast<std::size_t>(d)];
    auto add = [&](ModelAtom a) {
      a.dim = d;
      m.atoms.push_back(a);
      return static_cast<std::uint8_t>(m.atoms.size() - 1);
    };
    if (b1 == 0 && b2 == 0) {
      int v = m.vars++;
      m.var_dim[static_cast<std::size_t>(v)] = d;
      m.domain[static_cast<std::size_t>(v)] = divisors(ext);
      for (auto c : m.domain[static_cast<std::size_t>(v)]) m.domain_log2[static_cast<std::size_t>(v)].push_back(std::log2(static_cast<double>(c)));
      ModelAtom in, out;
      in.kind = ModelAtom::inner;
      in.var = v;
      in.size.e[static_cast<std::size_t>(v)] = 1;
      out.kind = ModelAtom::outer;
      out.var = v;
      out.size = constant(static_cast<double>(ext));
      out.size.e[static_cast<std::size_t>(v)] = -1;
      auto i = add(in), o = add(out);
      pd.whole = {std::vector<std::uint8_t>{i, o}, std::vector<std::uint8_t>{i, o}};
      pd.inner = {i, i};
      pd.outer = {o, o};
    } else if (b1 == b2 || ((b1 == 0 || b2 == 0) && ext % (b1 + b2) == 0)) {
      std::uint64_t b = b1 ? b1 : b2;
      ModelAtom in, out;
      in.kind = ModelAtom::inner;
      in.block = b;
      in.size = constant(static_cast<double>(b));
      out.kind = ModelAtom::outer;
      out.block = b;
      out.size = constant(static_cast<double>(ceil_div(ext, b)));
      auto i = add(in), o = add(out);
      pd.whole = {std::vector<std::uint8_t>{i, o}, std::vector<std::uint8_t>{i, o}};
      pd.inner = {i, i};
      pd.outer = {o, o};
    } else {
      // Blocked differently: the two sides never match and no tiling is built.
      tileable = false;
      for (int side = 0; side < 2; ++side) {
        std::uint64_t b = side == 0 ? b1 : b2;
        auto s = static_cast<std::size_t>(side);
        if (b == 0) {
          ModelAtom w;
          w.kind = ModelAtom::whole;
          w.size = constant(static_cast<double>(ext));
          pd.whole[s] = {add(w)};
        } else {
          ModelAtom in, out;
          in.kind = ModelAtom::inner;
          in.block = b;
          in.size = constant(static_cast<double>(b));
          out.kind = ModelAtom::outer;
          out.block = b;
          out.size = constant(static_cast<double>(ceil_div(ext, b)));
          pd.inner[s] = add(in);
          pd.outer[s] = add(out);
        }
      }
    }
  }
  auto expand = [&](const Layout& l, int side) {
    std::vector<std::uint8_t> seq;
    auto s = static_cast<std::size_t>(side);
    for (const auto& c : l) {
      const auto& pd = per_dim[c.dim];
      switch (c.kind) {
        case LayoutComponent::Kind::fields: seq.push_back(0); break;
        case LayoutComponent::Kind::dim: seq.insert(seq.end(), pd.whole[s].begin(), pd.whole[s].end()); break;
        case LayoutComponent::Kind::dim_in: seq.push_back(static_cast<std::uint8_t>(pd.inner[s])); break;
        case LayoutComponent::Kind::dim_out: seq.push_back(static_cast<std::uint8_t>(pd.outer[s])); break;
      }
    }
    return seq;
  };
  auto add_candidate = [&](std::vector<std::uint8_t> seq, std::string name) {
    for (std::size_t i = 0; i < m.candidates.size(); ++i)
      if (m.candidates[i] == seq) return static_cast<int>(i);
    m.candidates.push_back(std::move(seq));
    m.names.push_back(std::move(name));
    return static_cast<int>(m.candidates.size() - 1);
  };
  auto src_seq = expand(request.src_layout, 0), dst_seq = expand(request.dst_layout, 1);
  m.src = add_candidate(src_seq, "src");
  m.dst = add_candidate(dst_seq, "dst");
  if (m.src != m.dst && tileable) {
    auto split = [&](const std::vector<std::uint8_t>& seq, bool inner) {
      std::vector<std::uint8_t> out;
      for (auto a : seq) {
        bool is_inner = m.atoms[a].kind == ModelAtom::fields || m.atoms[a].kind == ModelAtom::inner;
        if (is_inner == inner) out.push_back(a);
      }
      return out;
    };
    auto tile = [&](const std::vector<std::uint8_t>& in_from, const std::vector<std::uint8_t>& out_from) {
      auto seq = split(in_from, true);
      auto outer = split(out_from, false);
      seq.insert(seq.end(), outer.begin(), outer.end());
      return seq;
    };
    add_candidate(tile(src_seq, src_seq), "tile(src|src)");
    add_candidate(tile(dst_seq, src_seq), "tile(dst|src)");
    add_candidate(tile(src_seq, dst_seq), "tile(src|dst)");
    add_candidate(tile(dst_seq, dst_seq), "tile(dst|dst)");
  }
  m.count = static_cast<int>(m.candidates.size());

  // PREFIX and SUFFIX-bar of every ordered pair, as monomials, with their extremes over the
  // blocking factors' ranges (for the search's upper bounds).
  double min_field_log2 = std::log2(static_cast<double>(request.fields.min_size()));
  double max_field_log2 = std::log2(static_cast<double>(request.fields.max_size()));
  auto extreme = [&](const Mono& mono, bool maximum) {
    double v = mono.log2c;
    for (int i = 0; i < m.vars; ++i) {
      auto s = static_cast<std::size_t>(i);
      if (!mono.e[s]) continue;
      bool take_high = (mono.e[s] > 0) == maximum;
      v += mono.e[s] * (take_high ? m.domain_log2[s].back() : m.domain_log2[s].front());
    }
    return v;
  };
  m.pairs.resize(static_cast<std::size_t>(m.count * m.count));
  for (int a = 0; a < m.count; ++a)
    for (int b = 0; b < m.count; ++b) {
      const auto& la = m.candidates[static_cast<std::size_t>(a)];
      const auto& lb = m.candidates[static_cast<std::size_t>(b)];
      Model::Pair p;
      std::size_t pre = 0;
      bool f_in_prefix = false;
      while (pre < la.size() && pre < lb.size() && la[pre] == lb[pre]) {
        p.request.multiply(m.atoms[la[pre]].size);
        f_in_prefix |= la[pre] == 0;
        ++pre;
      }
      if (!f_in_prefix) p.request.log2c += min_field_log2;
      std::size_t suf = 0;
      while (suf < la.size() && suf < lb.size() && la[la.size() - 1 - suf] == lb[lb.size() - 1 - suf]) ++suf;
      bool f_in_rest = false;
      for (std::size_t i = 0; i + suf < la.size(); ++i) {
        p.shuffle.multiply(m.atoms[la[i]].size);
        f_in_rest |= la[i] == 0;
      }
      if (!f_in_rest) p.shuffle.log2c += max_field_log2;
      p.max_request_log2 = extreme(p.request, true);
      p.min_shuffle_log2 = extreme(p.shuffle, false);
      m.pairs[static_cast<std::size_t>(a * m.count + b)] = p;
    }
  return m;
}

std::array<int, kMaxDims> Model::default_index() const {
  std::array<int, kMaxDims> index{};
  for (int v = 0; v < vars; ++v) index[static_cast<std::size_t>(v)] = static_cast<int>(domain[static_cast<std::size_t>(v)].size()) - 1;
  return index;
}

Layout Model::layout(int candidate, const std::array<int, kMaxDims>& index) const {
  if (candidate == src) return src_layout;
  if (candidate == dst) return dst_layout;
  const auto& seq = candidates[static_cast<std::size_t>(candidate)];
  Layout l;
  for (std::size_t i = 0; i < seq.size(); ++i) {
    const ModelAtom& a = atoms[seq[i]];
    std::uint64_t block = a.var >= 0 ? domain[static_cast<std::size_t>(a.var)][static_cast<std::size_t>(index[static_cast<std::size_t>(a.var)])] : a.block;
    auto ext = static_cast<std::uint64_t>(space->extent(a.dim));
    switch (a.kind) {
      case ModelAtom::fields: l.push_back(LayoutComponent::fields()); break;
      case ModelAtom::whole: l.push_back(LayoutComponent::whole(a.dim)); break;
      case ModelAtom::inner: {
        // d_in immediately followed by d_out with a dividing block is just d.
        bool merge = i + 1 < seq.size() && atoms[seq[i + 1]].kind == ModelAtom::outer && atoms[seq[i + 1]].dim == a.dim &&
                     ext % block == 0;
        if (merge) {
          l.push_back(LayoutComponent::whole(a.dim));
          ++i;
        } else {
          l.push_back(LayoutComponent::inner(a.dim, block));
        }
        break;
      }
      case ModelAtom::outer: l.push_back(LayoutComponent::outer(a.dim)); break;
    }
  }
  return l;
}

// ------------------------------------------------------------------ the block solver
namespace {

constexpr double kEps = 1e-9;

// sum_v e[v] * x_v >= b, x_v = domain_log2[v][index]
struct Linear {
  std::array<std::int8_t, kMaxDims> e{};
  double b = 0;
};

struct Box {
  std::array<int, kMaxDims> lo{}, hi{};
};

// Narrows the box to what the constraints allow (bounds propagation); false if it empties.
bool propagate(const Model& m, const std::vector<Linear>& cons, Box& box) {
  for (int round = 0; round < 64; ++round) {
    bool changed = false;
    for (const auto& c : cons) {
      double total = 0;
      std::array<double, kMaxDims> best{};
      for (int v = 0; v < m.vars; ++v) {
        auto s = static_cast<std::size_t>(v);
        if (!c.e[s]) continue;
        const auto& x = m.domain_log2[s];
        best[s] = c.e[s] > 0 ? c.e[s] * x[static_cast<std::size_t>(box.hi[s])] : c.e[s] * x[static_cast<std::size_t>(box.lo[s])];
        total += best[s];
      }
      if (total < c.b - kEps) return false;
      for (int v = 0; v < m.vars; ++v) {
        auto s = static_cast<std::size_t>(v);
        if (!c.e[s]) continue;
        const auto& x = m.domain_log2[s];
        double need = (c.b - (total - best[s])) / c.e[s];  // e>0: x >= need; e<0: x <= need
        if (c.e[s] > 0) {
          int lo = box.lo[s];
          while (lo <= box.hi[s] && x[static_cast<std::size_t>(lo)] < need - kEps) ++lo;
          if (lo != box.lo[s]) {
            box.lo[s] = lo;
            changed = true;
          }
        } else {
          int hi = box.hi[s];
          while (hi >= box.lo[s] && x[static_cast<std::size_t>(hi)] > need + kEps) --hi;
          if (hi != box.hi[s]) {
            box.hi[s] = hi;
            changed = true;
          }
        }
        if (box.lo[s] > box.hi[s]) return false;
      }
    }
    if (!changed) break;
  }
  return true;
}

bool satisfies(const Model& m, const std::vector<Linear>& cons, const std::array<int, kMaxDims>& index) {
  for (const auto& c : cons) {
    double total = 0;
    for (int v = 0; v < m.vars; ++v) {
      auto s = static_cast<std::size_t>(v);
      if (c.e[s]) total += c.e[s] * m.domain_log2[s][static_cast<std::size_t>(index[s])];
    }
    if (total < c.b - kEps) return false;
  }
  return true;
}

// Depth-first search over the box with propagation at every node; the first feasible point.
bool find_point(const Model& m, const std::vector<Linear>& cons, Box box, std::array<int, kMaxDims>& out) {
  if (!propagate(m, cons, box)) return false;
  int widest = -1, width = 0;
  for (int v = 0; v < m.vars; ++v) {
    auto s = static_cast<std::size_t>(v);
    if (box.hi[s] - box.lo[s] > width) {
      width = box.hi[s] - box.lo[s];
      widest = v;
    }
  }
  // The top corner (large blocks: long requests) is the likeliest point; try it before splitting.
  if (satisfies(m, cons, box.hi)) {
    out = box.hi;
    return true;
  }
  if (widest < 0) return false;
  auto s = static_cast<std::size_t>(widest);
  int mid = box.lo[s] + width / 2;
  Box upper = box, lower = box;
  upper.lo[s] = mid + 1;
  lower.hi[s] = mid;
  return find_point(m, cons, upper, out) || find_point(m, cons, lower, out);
}

}  // namespace

double throughput_at(const Model& m, std::span<const HopConstraint> hops, const std::array<int, kMaxDims>& index,
                     double upper_bound) {
  std::array<double, kMaxDims> x{};
  for (int v = 0; v < m.vars; ++v) {
    auto s = static_cast<std::size_t>(v);
    x[s] = m.domain_log2[s][static_cast<std::size_t>(index[s])];
  }
  double tp = upper_bound;
  for (const auto& h : hops) {
    if (h.shuffle && h.shuffle->log2_at(x) > std::log2(h.shuffle_limit) + kEps) return 0;
    double request = std::min(std::exp2(h.request->log2_at(x)), h.cap);
    tp = std::min(tp, (*h.tp)(request));
  }
  return tp;
}

BlockSolution solve_blocks(const Model& m, std::span<const HopConstraint> hops, double upper_bound) {
  BlockSolution result;
  bool any_var = false;
  for (const auto& h : hops) any_var |= !h.request->constant() || (h.shuffle && !h.shuffle->constant());
  Box full;
  for (int v = 0; v < m.vars; ++v) full.hi[static_cast<std::size_t>(v)] = static_cast<int>(m.domain[static_cast<std::size_t>(v)].size()) - 1;
  if (!any_var || m.vars == 0) {
    result.index = m.default_index();
    result.gbps = throughput_at(m, hops, result.index, upper_bound);
    result.feasible = result.gbps > 0;
    return result;
  }
  // Constraints for a target throughput: PREFIX_i >= tp_i^-1(target) for every hop (the cap is
  // a constant check), SUFFIX-bar_i <= limit for hops between buffers.
  std::vector<Linear> cons;
  cons.reserve(hops.size() * 2);
  auto build = [&](double target) {
    cons.clear();
    for (const auto& h : hops) {
      if (h.shuffle) {
        Linear c;
        for (std::size_t s = 0; s < kMaxDims; ++s) c.e[s] = static_cast<std::int8_t>(-h.shuffle->e[s]);
        c.b = h.shuffle->log2c - std::log2(h.shuffle_limit);  // -(log2c + e.x) >= -log2(limit)
        if (h.shuffle->constant()) {
          if (c.b > kEps) return false;
        } else {
          cons.push_back(c);
        }
      }
      if (target > 0) {
        double need = h.tp->inverse(target);
        if (need > h.cap * (1 + 1e-12)) return false;
        Linear c;
        c.e = h.request->e;
        c.b = std::log2(need) - h.request->log2c;
        if (h.request->constant()) {
          if (c.b > kEps) return false;
        } else {
          cons.push_back(c);
        }
      }
    }
    return true;
  };
  std::array<int, kMaxDims> point{};
  if (!build(0) || !find_point(m, cons, full, point)) return result;  // no blocking fits the threshold
  result.feasible = true;
  result.index = point;
  double best = throughput_at(m, hops, point, upper_bound);
  double lo = best, hi = upper_bound;
  for (const auto& h : hops) {
    std::array<double, kMaxDims> top{};
    for (int v = 0; v < m.vars; ++v) {
      auto s = static_cast<std::size_t>(v);
      top[s] = h.request->e[s] > 0 ? m.domain_log2[s].back() : m.domain_log2[s].front();
    }
    hi = std::min(hi, (*h.tp)(std::min(std::exp2(h.request->log2_at(top)), h.cap)));
  }
  // Binary search on the throughput (part 3). A feasible probe moves lo to the throughput the
  // point found actually reaches, one of finitely many values, so the search usually lands on
  // the optimum exactly, long before the relative tolerance.
  for (int iter = 0; iter < 100 && hi > lo * (1 + 1e-9); ++iter) {
    double mid = lo > 0 ? std::sqrt(lo * hi) : hi / 2;
    if (!(mid > lo && mid < hi)) mid = (lo + hi) / 2;
    if (build(mid) && find_point(m, cons, full, point)) {
      double reached = throughput_at(m, hops, point, upper_bound);
      if (reached > best) {
        best = reached;
        result.index = point;
      }
      lo = std::max(mid, reached);
    } else {
      hi = mid;
    }
  }
  result.gbps = best;
  return result;
}

}  // namespace caravan::planner::detail
