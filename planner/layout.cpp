// The data model: rectangles, field spaces, layouts, their text form and linearization.
#include <caravan/error.h>
#include <caravan/layout.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>
#include <set>
#include <stdexcept>

namespace caravan {
namespace {

[[noreturn]] void invalid(const std::string& message) { throw Error(Errc::invalid_argument, message); }

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0); }

// a * b for an instance's footprint; throws naming the instance when the footprint would not fit
// 64 bits (it would silently wrap otherwise, and an allocation of the wrapped size succeed).
std::uint64_t footprint_product(std::uint64_t a, std::uint64_t b, const Layout& layout, const IndexSpace& space,
                                const FieldSpace& fields) {
  std::uint64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product))
    invalid(fmt::format("layout {} over {} with {} bytes per point: the footprint exceeds 2^64 - 1 bytes",
                        layout.to_string(), space.to_string(), fields.total_size()));
  return product;
}

int dim_index(char c) {
  switch (c) {
    case 'x': return 0;
    case 'y': return 1;
    case 'z': return 2;
    case 'w': return 3;
    default: return -1;
  }
}

std::string component_text(const LayoutComponent& c) {
  switch (c.kind) {
    case LayoutComponent::Kind::fields: return "F";
    case LayoutComponent::Kind::dim: return std::string(1, dim_name(c.dim));
    case LayoutComponent::Kind::dim_in: return fmt::format("{}_in={}", dim_name(c.dim), c.block);
    case LayoutComponent::Kind::dim_out: return fmt::format("{}_out", dim_name(c.dim));
  }
  return "?";
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

char dim_name(int d) { return "xyzw"[d & 3]; }

// ---------------------------------------------------------------- Rect

Rect Rect::from_extents(const std::vector<std::int64_t>& extents) {
  if (extents.empty() || extents.size() > static_cast<std::size_t>(kMaxDims))
    invalid(fmt::format("index space: {} dimensions given, 1 to {} allowed", extents.size(), kMaxDims));
  Point lo{}, hi{};
  for (std::size_t d = 0; d < extents.size(); ++d) {
    if (extents[d] < 1)
      invalid(fmt::format("index space: extent of dimension {} is {}, must be at least 1", dim_name(static_cast<int>(d)), extents[d]));
    hi[d] = extents[d] - 1;
  }
  return Rect(static_cast<int>(extents.size()), lo, hi);
}

Rect::Rect(int dims, const Point& lo, const Point& hi) : dims_(dims), lo_(lo), hi_(hi) {
  if (dims < 1 || dims > kMaxDims) invalid(fmt::format("rect: {} dimensions, 1 to {} allowed", dims, kMaxDims));
  for (int d = 0; d < dims; ++d)
    if (hi_[static_cast<std::size_t>(d)] < lo_[static_cast<std::size_t>(d)])
      invalid(fmt::format("rect: dimension {} has hi {} < lo {}", dim_name(d), hi_[static_cast<std::size_t>(d)], lo_[static_cast<std::size_t>(d)]));
  for (int d = dims; d < kMaxDims; ++d) lo_[static_cast<std::size_t>(d)] = hi_[static_cast<std::size_t>(d)] = 0;
  // Extents and the volume must fit a signed 64-bit count, so that extent() and volume() (and
  // every offset computed from them) are exact.
  std::uint64_t volume = 1;
  for (int d = 0; d < dims; ++d) {
    const auto i = static_cast<std::size_t>(d);
    std::int64_t span = 0, extent = 0;
    std::uint64_t product = 0;
    if (__builtin_sub_overflow(hi_[i], lo_[i], &span) || __builtin_add_overflow(span, std::int64_t{1}, &extent))
      invalid(
          fmt::format("rect: dimension {} from {} to {} has more than 2^63 - 1 points", dim_name(d), lo_[i], hi_[i]));
    if (__builtin_mul_overflow(volume, static_cast<std::uint64_t>(extent), &product) ||
        product > static_cast<std::uint64_t>(INT64_MAX))
      invalid(fmt::format("rect {}: more than 2^63 - 1 points", to_string()));
    volume = product;
  }
}

std::uint64_t Rect::volume() const noexcept {
  if (dims_ == 0) return 0;
  std::uint64_t v = 1;
  for (int d = 0; d < dims_; ++d) v *= static_cast<std::uint64_t>(extent(d));
  return v;
}

bool Rect::contains(const Rect& other) const noexcept {
  return other.dims_ > 0 && other.dims_ == dims_ && contains(other.lo_) && contains(other.hi_);
}

bool Rect::contains(const Point& p) const noexcept {
  for (int d = 0; d < dims_; ++d) {
    auto i = static_cast<std::size_t>(d);
    if (p[i] < lo_[i] || p[i] > hi_[i]) return false;
  }
  return true;
}

bool Rect::operator==(const Rect& other) const noexcept {
  return dims_ == other.dims_ && lo_ == other.lo_ && hi_ == other.hi_;
}

std::string Rect::to_string() const {
  std::string out;
  for (int d = 0; d < dims_; ++d) {
    auto i = static_cast<std::size_t>(d);
    if (d) out += "x";
    out += fmt::format("[{},{}]", lo_[i], hi_[i]);
  }
  return out;
}

// ---------------------------------------------------------------- FieldSpace

FieldSpace::FieldSpace(std::vector<Field> fields) {
  if (fields.empty()) invalid("field space: at least one field is needed");
  auto data = std::make_shared<Data>();
  std::set<std::string> names;
  min_ = std::numeric_limits<std::uint32_t>::max();
  for (const auto& f : fields) {
    if (f.size == 0) invalid(fmt::format("field space: field '{}' has size 0", f.name));
    if (!names.insert(f.name).second) invalid(fmt::format("field space: field '{}' appears twice", f.name));
    data->offsets.push_back(total_);
    total_ += f.size;
    min_ = std::min(min_, f.size);
    max_ = std::max(max_, f.size);
  }
  data->fields = std::move(fields);
  data_ = std::move(data);
}

FieldSpace FieldSpace::uniform(int count, std::uint32_t size) {
  std::vector<Field> fields;
  for (int i = 0; i < count; ++i) fields.push_back({fmt::format("f{}", i), size});
  return FieldSpace(std::move(fields));
}

const std::vector<Field>& FieldSpace::fields() const noexcept {
  static const std::vector<Field> kNone;
  return data_ ? data_->fields : kNone;
}

void FieldSpace::throw_no_field(std::size_t field) const {
  throw Error(Errc::invalid_argument, fmt::format("field space: field index {} past its {} fields", field, count()));
}

std::size_t FieldSpace::index_of(std::string_view name) const {
  const std::vector<Field>& all = fields();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i].name == name) return i;
  throw Error(Errc::not_found, fmt::format("field space: no field named '{}'", name));
}

bool FieldSpace::operator==(const FieldSpace& other) const noexcept {
  if (data_ == other.data_) return true;
  const std::vector<Field>& a = fields();
  const std::vector<Field>& b = other.fields();
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].size != b[i].size) return false;
  return true;
}

// ---------------------------------------------------------------- Layout

Layout::Layout(std::initializer_list<LayoutComponent> components) {
  for (const auto& c : components) push_back(c);
}

void Layout::push_back(const LayoutComponent& c) {
  if (count_ == kMaxComponents) invalid(fmt::format("layout: more than {} components", kMaxComponents));
  items_[count_++] = c;
}

bool Layout::operator==(const Layout& other) const noexcept {
  return count_ == other.count_ && std::equal(begin(), end(), other.begin());
}

std::size_t Layout::hash() const noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull ^ count_;
  for (const auto& c : *this) {
    std::uint64_t word = (static_cast<std::uint64_t>(c.kind) << 8) | c.dim;
    h = (h ^ word) * 0x100000001b3ull;
    h = (h ^ c.block) * 0x100000001b3ull;
  }
  return static_cast<std::size_t>(h);
}

std::string Layout::to_string() const {
  std::string out;
  for (std::size_t i = 0; i < count_; ++i) {
    if (i) out += ',';
    out += component_text(items_[i]);
  }
  return out;
}

Layout Layout::parse(std::string_view text) {
  std::string_view s = trim(text);
  if (s.size() >= 2 && s.front() == '<' && s.back() == '>') s = trim(s.substr(1, s.size() - 2));
  if (s.empty()) invalid(fmt::format("layout '{}': empty", text));
  Layout layout;
  while (true) {
    auto comma = s.find(',');
    std::string_view item = trim(s.substr(0, comma));
    if (item.empty()) invalid(fmt::format("layout '{}': empty component", text));
    LayoutComponent c;
    if (item == "F") {
      c = LayoutComponent::fields();
    } else {
      int d = dim_index(item[0]);
      if (d < 0)
        invalid(fmt::format("layout '{}': unknown component '{}' (expected F, a dimension x/y/z/w, x_in=C or x_out)", text, item));
      std::string_view rest = item.substr(1);
      if (rest.empty()) {
        c = LayoutComponent::whole(d);
      } else if (rest == "_out") {
        c = LayoutComponent::outer(d);
      } else if (rest.rfind("_in", 0) == 0) {
        std::string_view value = trim(rest.substr(3));
        if (value.empty() || value.front() != '=')
          invalid(fmt::format("layout '{}': '{}' needs a block size, as in {}_in=4", text, item, dim_name(d)));
        value = trim(value.substr(1));
        std::uint64_t block = 0;
        auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), block);
        if (ec != std::errc() || ptr != value.data() + value.size() || block == 0)
          invalid(fmt::format("layout '{}': block size of '{}' must be a positive integer", text, item));
        c = LayoutComponent::inner(d, block);
      } else {
        invalid(fmt::format("layout '{}': unknown component '{}' (expected F, a dimension x/y/z/w, x_in=C or x_out)", text, item));
      }
    }
    for (const auto& prev : layout) {
      bool same = prev.kind == c.kind && (c.kind == LayoutComponent::Kind::fields || prev.dim == c.dim);
      if (same) invalid(fmt::format("layout '{}': component '{}' appears twice", text, component_text(c)));
    }
    if (layout.size() == kMaxComponents) invalid(fmt::format("layout '{}': more than {} components", text, kMaxComponents));
    layout.push_back(c);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return layout;
}

Layout Layout::aos(int dims) {
  Layout l;
  l.push_back(LayoutComponent::fields());
  for (int d = 0; d < dims; ++d) l.push_back(LayoutComponent::whole(d));
  return l;
}

Layout Layout::soa(int dims) {
  Layout l;
  for (int d = 0; d < dims; ++d) l.push_back(LayoutComponent::whole(d));
  l.push_back(LayoutComponent::fields());
  return l;
}

Layout Layout::hybrid(std::uint64_t block) {
  return Layout{LayoutComponent::inner(0, block), LayoutComponent::fields(), LayoutComponent::outer(0)};
}

void Layout::validate(int dims, std::string_view what) const {
  int fields = 0;
  std::array<int, kMaxDims> whole{}, in{}, out{};
  for (const auto& c : *this) {
    if (c.kind == LayoutComponent::Kind::fields) {
      ++fields;
      continue;
    }
    if (c.dim >= dims) {
      std::string names;
      for (int d = 0; d < dims; ++d) names += (d ? "," : "") + std::string(1, dim_name(d));
      invalid(fmt::format("{} '{}': dimension {} is not in the index space ({})", what, to_string(), dim_name(c.dim), names));
    }
    if (c.kind == LayoutComponent::Kind::dim) ++whole[c.dim];
    if (c.kind == LayoutComponent::Kind::dim_in) {
      ++in[c.dim];
      if (c.block == 0) invalid(fmt::format("{} '{}': block size of {}_in must be at least 1", what, to_string(), dim_name(c.dim)));
    }
    if (c.kind == LayoutComponent::Kind::dim_out) ++out[c.dim];
  }
  if (fields != 1) invalid(fmt::format("{} '{}': F must appear exactly once (found {} times)", what, to_string(), fields));
  for (int d = 0; d < dims; ++d) {
    auto i = static_cast<std::size_t>(d);
    char n = dim_name(d);
    bool ok = (whole[i] == 1 && in[i] == 0 && out[i] == 0) || (whole[i] == 0 && in[i] == 1 && out[i] == 1);
    if (!ok) {
      if (whole[i] + in[i] + out[i] == 0)
        invalid(fmt::format("{} '{}': dimension {} is missing (each dimension appears as {} or as {}_in=C and {}_out)", what, to_string(), n, n, n, n));
      invalid(fmt::format("{} '{}': dimension {} must appear either whole ({}) or as both {}_in=C and {}_out, exactly once", what, to_string(), n, n, n, n));
    }
  }
}

// ---------------------------------------------------------------- sizes and linearization

std::uint64_t component_size(const Layout& layout, std::size_t k, const IndexSpace& space, const FieldSpace& fields) {
  const auto& c = layout[k];
  switch (c.kind) {
    case LayoutComponent::Kind::fields: return fields.total_size();
    case LayoutComponent::Kind::dim: return static_cast<std::uint64_t>(space.extent(c.dim));
    case LayoutComponent::Kind::dim_in: return c.block;
    case LayoutComponent::Kind::dim_out: {
      for (const auto& other : layout)
        if (other.kind == LayoutComponent::Kind::dim_in && other.dim == c.dim)
          return ceil_div(static_cast<std::uint64_t>(space.extent(c.dim)), other.block);
      invalid(fmt::format("layout '{}': {}_out without {}_in", layout.to_string(), dim_name(c.dim), dim_name(c.dim)));
    }
  }
  return 0;
}

Linearization::Linearization(const Layout& layout, const IndexSpace& space, const FieldSpace& fields)
    : fields_(&fields), lo_(space.lo()) {
  layout.validate(space.dims());
  bool after_fields = false;
  std::uint64_t outer_weight = 0;
  for (std::size_t k = 0; k < layout.size(); ++k) {
    const auto& c = layout[k];
    std::uint64_t size = component_size(layout, k, space, fields);
    if (c.kind == LayoutComponent::Kind::fields) {
      after_fields = true;
      outer_weight = footprint_product(fields.total_size(), inner_count_, layout, space, fields);
      continue;
    }
    Term t{c.dim, 1, size, 0};
    if (c.kind == LayoutComponent::Kind::dim_out) {
      for (const auto& other : layout)
        if (other.kind == LayoutComponent::Kind::dim_in && other.dim == c.dim) t.div = other.block;
    }
    if (!after_fields) {
      t.weight = inner_count_;
      inner_count_ = footprint_product(inner_count_, size, layout, space, fields);
      inner_.push_back(t);
    } else {
      t.weight = outer_weight;
      outer_weight = footprint_product(outer_weight, size, layout, space, fields);
      outer_.push_back(t);
    }
  }
  total_ = outer_weight;
}

std::uint64_t Linearization::offset(const Point& point, std::size_t field) const {
  auto digit = [&](const Term& t) {
    auto coord = static_cast<std::uint64_t>(point[static_cast<std::size_t>(t.dim)] - lo_[static_cast<std::size_t>(t.dim)]);
    return (coord / t.div) % t.mod;
  };
  // Components before F count values of one field: field f's values for the whole inner block
  // sit together, after those of the fields declared before it.
  std::uint64_t inner_index = 0;
  for (const auto& t : inner_) inner_index += digit(t) * t.weight;
  std::uint64_t offset = fields_->offset(field) * inner_count_ + fields_->fields()[field].size * inner_index;
  for (const auto& t : outer_) offset += digit(t) * t.weight;
  return offset;
}

std::optional<std::int64_t> Linearization::dimension_stride(int dim, std::size_t field) const {
  const Term* only = nullptr;
  bool inner = false;
  for (const auto* terms : {&inner_, &outer_})
    for (const auto& t : *terms)
      if (t.dim == dim) {
        if (only) return std::nullopt;  // blocked: an inner and an outer part
        only = &t;
        inner = terms == &inner_;
      }
  if (!only || only->div != 1) return std::nullopt;
  const std::uint64_t step = inner ? fields_->fields()[field].size * only->weight : only->weight;
  return static_cast<std::int64_t>(step);
}

// ---------------------------------------------------------------- PREFIX / SUFFIX / TOTAL

namespace {

// A layout rewritten as a sequence of atoms that two layouts can compare position by position.
struct Atom {
  int kind;              // 0 = F, 1 = whole dimension, 2 = inner part, 3 = outer part
  int dim = 0;
  std::uint64_t block = 0;  // for inner/outer parts
  int side = 0;          // non-zero for atoms that only one of the two layouts has
  std::uint64_t size = 0;
  bool operator==(const Atom& o) const { return kind == o.kind && dim == o.dim && block == o.block && side == o.side; }
};

std::uint64_t block_of(const Layout& l, int d) {
  for (const auto& c : l)
    if (c.kind == LayoutComponent::Kind::dim_in && c.dim == d) return c.block;
  return 0;  // whole
}

// The common refinement of l1 and l2 (see the header). Returns the atom sequences of both.
std::pair<std::vector<Atom>, std::vector<Atom>> refine(const Layout& l1, const Layout& l2, const IndexSpace& space,
                                                     const FieldSpace& fields) {
  l1.validate(space.dims(), "first layout");
  l2.validate(space.dims(), "second layout");
  enum class Split { whole, blocked, apart };
  std::array<Split, kMaxDims> split{};
  std::array<std::uint64_t, kMaxDims> block{};
  for (int d = 0; d < space.dims(); ++d) {
    auto i = static_cast<std::size_t>(d);
    std::uint64_t b1 = block_of(l1, d), b2 = block_of(l2, d);
    auto ext = static_cast<std::uint64_t>(space.extent(d));
    if (b1 == 0 && b2 == 0) {
      split[i] = Split::whole;
    } else if (b1 == b2) {
      split[i] = Split::blocked;
      block[i] = b1;
    } else if ((b1 == 0 || b2 == 0) && ext % (b1 + b2) == 0) {
      split[i] = Split::blocked;
      block[i] = b1 + b2;
    } else {
      split[i] = Split::apart;
    }
  }
  auto convert = [&](const Layout& l, int side) {
    std::vector<Atom> atoms;
    for (const auto& c : l) {
      auto i = static_cast<std::size_t>(c.dim);
      std::uint64_t ext = static_cast<std::uint64_t>(space.extent(c.dim));
      switch (c.kind) {
        case LayoutComponent::Kind::fields: atoms.push_back({0, 0, 0, 0, fields.total_size()}); break;
        case LayoutComponent::Kind::dim:
          if (split[i] == Split::blocked) {
            atoms.push_back({2, c.dim, block[i], 0, block[i]});
            atoms.push_back({3, c.dim, block[i], 0, ext / block[i]});
          } else {
            atoms.push_back({1, c.dim, 0, split[i] == Split::apart ? side : 0, ext});
          }
          break;
        case LayoutComponent::Kind::dim_in:
          atoms.push_back({2, c.dim, c.block, split[i] == Split::apart ? side : 0, c.block});
          break;
        case LayoutComponent::Kind::dim_out:
          atoms.push_back({3, c.dim, block_of(l, c.dim), split[i] == Split::apart ? side : 0,
                           ceil_div(ext, block_of(l, c.dim))});
          break;
      }
    }
    return atoms;
  };
  return {convert(l1, 1), convert(l2, 2)};
}

}  // namespace

std::uint64_t prefix_bytes(const Layout& l1, const Layout& l2, const IndexSpace& space, const FieldSpace& fields) {
  auto [a, b] = refine(l1, l2, space, fields);
  std::uint64_t product = 1;
  bool has_fields = false;
  for (std::size_t i = 0; i < a.size() && i < b.size() && a[i] == b[i]; ++i) {
    product *= a[i].size;
    has_fields |= a[i].kind == 0;
  }
  return has_fields ? product : product * fields.min_size();
}

std::uint64_t shuffle_bytes(const Layout& l1, const Layout& l2, const IndexSpace& space, const FieldSpace& fields) {
  auto [a, b] = refine(l1, l2, space, fields);
  std::size_t common = 0;
  while (common < a.size() && common < b.size() && a[a.size() - 1 - common] == b[b.size() - 1 - common]) ++common;
  std::uint64_t product = 1;
  bool has_fields = false;
  for (std::size_t i = 0; i + common < a.size(); ++i) {
    product *= a[i].size;
    has_fields |= a[i].kind == 0;
  }
  return has_fields ? product : product * fields.max_size();
}

std::uint64_t total_bytes(const Layout& layout, const IndexSpace& space, const FieldSpace& fields) {
  layout.validate(space.dims());
  std::uint64_t product = 1;
  for (std::size_t k = 0; k < layout.size(); ++k)
    product = footprint_product(product, component_size(layout, k, space, fields), layout, space, fields);
  return product;
}

std::uint64_t region_run_bytes(const Layout& layout, const IndexSpace& instance_space, const IndexSpace& region,
                               const FieldSpace& fields) {
  layout.validate(instance_space.dims());
  if (!instance_space.contains(region))
    throw Error(Errc::invalid_argument, fmt::format("region_run_bytes: the region {} is not inside the index space {}",
                                                    region.to_string(), instance_space.to_string()));
  std::uint64_t run = 1;
  bool has_fields = false;
  // Per blocked dimension the region does not span: how many whole blocks it holds (0 until its
  // inner part is seen). The run may go on past the inner part through one of those blocks.
  std::array<std::uint64_t, kMaxDims> whole_blocks{};
  for (std::size_t k = 0; k < layout.size(); ++k) {
    const LayoutComponent& c = layout[k];
    if (c.kind == LayoutComponent::Kind::fields) {
      run *= fields.total_size();
      has_fields = true;
      continue;
    }
    const auto extent = static_cast<std::uint64_t>(instance_space.extent(c.dim));
    const auto part = static_cast<std::uint64_t>(region.extent(c.dim));
    // x_in=C directly followed by x_out orders the points as x does.
    const bool linear = c.kind == LayoutComponent::Kind::dim_in && k + 1 < layout.size() &&
                        layout[k + 1].kind == LayoutComponent::Kind::dim_out && layout[k + 1].dim == c.dim;
    if (part != extent && linear) {
      run *= part;
      break;
    }
    if (part == extent) {  // spanned: the run takes the whole component and goes on
      run *= c.kind == LayoutComponent::Kind::dim      ? extent
             : c.kind == LayoutComponent::Kind::dim_in ? std::min(c.block, extent)
                                                       : ceil_div(extent, block_of(layout, c.dim));
      continue;
    }
    if (c.kind == LayoutComponent::Kind::dim) {
      run *= part;
      break;
    }
    const std::uint64_t block = block_of(layout, c.dim);
    if (c.kind == LayoutComponent::Kind::dim_out) {
      run *= whole_blocks[c.dim] ? whole_blocks[c.dim] : ceil_div(part, block);
      break;
    }
    // dim_in, the region narrower than the dimension: blocks count from the instance's lo.
    const auto first = static_cast<std::uint64_t>(region.lo()[c.dim] - instance_space.lo()[c.dim]);
    const std::uint64_t last = first + part - 1;
    const std::uint64_t aligned_from = ceil_div(first, block), aligned_to = (last + 1) / block;
    if (aligned_to > aligned_from) {  // at least one whole block: through it the run goes on
      run *= block;
      whole_blocks[c.dim] = aligned_to - aligned_from;
      continue;
    }
    run *= first / block == last / block ? part : std::max(block - first % block, last % block + 1);
    break;
  }
  return has_fields ? run : run * fields.min_size();
}

}  // namespace caravan
