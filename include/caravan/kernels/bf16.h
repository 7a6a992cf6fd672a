// bfloat16 storage: the upper 16 bits of an IEEE float32 (8-bit exponent, 7-bit mantissa).
// Values are stored as Bf16 and computed on as float; conversion from float rounds to nearest,
// ties to even, as GPU bf16 conversions do, so CPU and GPU kernels agree bit for bit on inputs.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

namespace caravan::kernels {

struct Bf16 {
  std::uint16_t bits = 0;

  // Round to nearest even. NaN stays NaN (quiet, sign kept); infinities and overflow to
  // infinity follow from the rounding (the largest finite floats round up to inf, as on GPUs).
  static constexpr Bf16 from_float(float value) {
    std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return Bf16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
    // Adding 0x7FFF rounds to nearest; the extra 1 when the kept lsb is odd breaks ties to even.
    u += 0x7FFFu + ((u >> 16) & 1u);
    return Bf16{static_cast<std::uint16_t>(u >> 16)};
  }
  constexpr float to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

  friend constexpr bool operator==(Bf16, Bf16) = default;
};
static_assert(sizeof(Bf16) == 2 && std::is_trivially_copyable_v<Bf16>);

// Whole arrays (vectorised). `to` and `from` must have the same size.
void to_bf16(std::span<const float> from, std::span<Bf16> to);
void to_float(std::span<const Bf16> from, std::span<float> to);

}  // namespace caravan::kernels
