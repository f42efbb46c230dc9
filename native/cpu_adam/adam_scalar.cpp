// The scalar reference path and the software low-precision conversions. Written for
// clarity: the SIMD paths are tested against this one.
#include <cmath>
#include <cstring>

#include "cpu_adam.h"
#include "kernel_table.h"

namespace infinity_adam {

static inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

static inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: canonical quiet NaN, like torch
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in fp32
    const float mag = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -mag : mag;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): the result is round(|f| * 2^24) units of
    // the subnormal step; the scaling is exact and nearbyint rounds ties to even.
    const float scaled = std::fabs(f) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  const uint32_t x = a - (112u << 23);  // rebias the exponent from 127 to 15
  return sign | static_cast<uint16_t>((x + 0xfffu + ((x >> 13) & 1u)) >> 13);
}

namespace {

template <DType G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  if constexpr (G == DType::kF16) return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  return 0.0f;
}

template <DType O>
inline void store_out(void* out, int64_t i, float p) {
  if constexpr (O == DType::kBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  if constexpr (O == DType::kF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
}

struct ScalarKernel {
  template <DType G, DType O, Decay D>
  static void run(const Segment& s, const Hyper& h, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float p = s.param_in[i];
      float g = load_grad<G>(s.grad, i) * h.grad_scale;
      if constexpr (D == Decay::kL2) {
        g = g + h.l2 * p;
      } else {
        p = p * h.decay_factor;
      }
      const float m = s.exp_avg_in[i] + h.one_minus_beta1 * (g - s.exp_avg_in[i]);
      const float v = s.exp_avg_sq_in[i] * h.beta2 + h.one_minus_beta2 * g * g;
      const float denom = std::sqrt(v) * s.inv_bc2_sqrt + h.eps;
      p = p - s.step_size * (m / denom);
      s.exp_avg[i] = m;
      s.exp_avg_sq[i] = v;
      s.param[i] = p;
      store_out<O>(s.param_out, i, p);
    }
  }
};

}  // namespace

KernelFn scalar_kernel(const Hyper& h) { return select_kernel<ScalarKernel>(h); }

}  // namespace infinity_adam
