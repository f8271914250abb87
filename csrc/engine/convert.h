// Host rounding of fp32 to bf16 and fp16, bit for bit as torch rounds (c10::BFloat16 and
// c10::Half: round to nearest even; NaN to the canonical quiet NaN): a transport that reads an
// fp32 shard cache as the gather dtype must produce exactly the bytes FSDP2's own cast would.
// No torch here (see types.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "engine/types.h"

namespace torch_odc {

inline uint16_t floatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t floatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t out;
  if (u >= 0x47800000u) {  // >= 65536: inf, or NaN
    out = u > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (u < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), rounded by the FPU
    constexpr uint32_t kMagicBits = 0x3f000000u;  // 0.5: the half subnormal step is 2^-24
    float v, magic;
    std::memcpy(&v, &u, sizeof v);
    std::memcpy(&magic, &kMagicBits, sizeof magic);
    v += magic;
    uint32_t r;
    std::memcpy(&r, &v, sizeof r);
    out = static_cast<uint16_t>(r - kMagicBits);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    // Rebias the exponent (127 -> 15) and round to nearest even; a carry into the exponent
    // rounds up to the next binade, or to inf above 65504.
    u += 0xc8000fffu + odd;
    out = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

// Reads `numel` elements of `from` at `src` into `dst` as `to`: a copy when they are equal,
// otherwise fp32 rounded to bf16 or fp16 (the only pairs a shard cache serves, KeySpec).
inline void convertInto(void* dst, const void* src, size_t numel, DType from, DType to) {
  if (from == to) {
    std::memcpy(dst, src, numel * elementSize(from));
    return;
  }
  if (from != DType::kFloat32 || (to != DType::kBFloat16 && to != DType::kFloat16)) {
    throw OdcError(std::string("odc: cannot read a ") + dtypeName(from) + " shard cache as " +
                   dtypeName(to));
  }
  const auto* s = static_cast<const float*>(src);
  auto* d = static_cast<uint16_t*>(dst);
  if (to == DType::kBFloat16) {
    for (size_t i = 0; i < numel; ++i) d[i] = floatToBFloat16(s[i]);
  } else {
    for (size_t i = 0; i < numel; ++i) d[i] = floatToHalf(s[i]);
  }
}

}  // namespace torch_odc
