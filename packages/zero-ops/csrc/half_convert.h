// Scalar fp32 <-> bf16 / fp16 conversions with IEEE round-to-nearest-even.
//
// Written with integer arithmetic and selects only (no branches, no lookup tables) so that
// gcc/clang auto-vectorise the optimizer loops that call them, on every instruction set the
// kernels are built for. Results are identical to torch's `tensor.to(torch.bfloat16)` and
// `tensor.to(torch.float16)` (round to nearest, ties to even; NaN stays NaN; overflow -> inf).
#pragma once

#include <cstdint>
#include <cstring>

namespace zero_ops {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  // Adding 0x7fff plus the lowest kept bit rounds to nearest with ties going to the even value.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(is_nan ? 0x7fc0u : rounded);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  const uint32_t exp = mag >> 10;
  // Normal numbers: move the 15-bit magnitude into place and re-bias the exponent (15 -> 127).
  const uint32_t normal = (mag << 13) + 0x38000000u;
  // Inf / NaN keep their payload with an all-ones exponent.
  const uint32_t special = 0x7f800000u | ((mag & 0x3ffu) << 13);
  // Subnormals (and zero) are exactly mantissa * 2^-24.
  const uint32_t sub = f32_bits(static_cast<float>(mag & 0x3ffu) * 5.9604644775390625e-08f);
  const uint32_t out = exp == 0 ? sub : (exp == 31 ? special : normal);
  return f32_from_bits(sign | out);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: re-bias the exponent (127 -> 15) and round the 13 dropped mantissa bits to
  // nearest-even; a carry out of the mantissa correctly bumps the exponent (65520 -> inf).
  const uint32_t normal = ((a - 0x38000000u) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal range (|f| < 2^-14): adding 0.5 puts the value where one ulp is 2^-24, so the
  // FPU's own round-to-nearest-even produces the fp16 subnormal mantissa.
  float absf = f32_from_bits(a);
  const uint32_t sub = f32_bits(absf + 0.5f) - 0x3f000000u;
  uint32_t out = a >= 0x38800000u ? normal : sub;
  out = a >= 0x477ff000u ? 0x7c00u : out;  // rounds to beyond the largest finite fp16 (65504)
  out = a > 0x7f800000u ? 0x7e00u : out;   // NaN
  return static_cast<uint16_t>(sign | out);
}

}  // namespace zero_ops
