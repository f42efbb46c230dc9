// The AVX2 + FMA + F16C path: 8 elements per vector. Compiled with per-function target
// attributes (never -march), so this file is safe to load on any x86-64; the dispatcher
// only calls it after checking CPUID.
#include "cpu_adam.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

#include "kernel_table.h"

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

namespace infinity_adam {
namespace {

constexpr int kLanes = 8;

template <DType G>
AVX2_FN inline __m256 load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even in integer arithmetic; NaN becomes the canonical 0x7fc0.
AVX2_FN inline __m128i to_bf16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <DType O>
AVX2_FN inline void store_out(void* out, int64_t i, __m256 p) {
  if constexpr (O != DType::kNone) {
    __m128i h;
    if constexpr (O == DType::kBF16) {
      h = to_bf16(p);
    } else {
      h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

// Pointers and broadcast constants held in locals: through Segment& the compiler must
// assume the float stores alias the struct and would reload every field each iteration.
struct Ptrs {
  float* p;  // the states written; read from pi, mi, vi (the same arrays in place: no __restrict)
  const void* __restrict g;
  float* m;
  float* v;
  void* __restrict out;
  const float* pi;
  const float* mi;
  const float* vi;
};

struct Consts {
  __m256 decay_factor, l2, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt, step_size, grad_scale;
};

AVX2_FN inline Consts make_consts(const Segment& s, const Hyper& h) {
  return {_mm256_set1_ps(h.decay_factor), _mm256_set1_ps(h.l2),
          _mm256_set1_ps(h.one_minus_beta1), _mm256_set1_ps(h.beta2),
          _mm256_set1_ps(h.one_minus_beta2), _mm256_set1_ps(h.eps),
          _mm256_set1_ps(s.inv_bc2_sqrt), _mm256_set1_ps(s.step_size), _mm256_set1_ps(h.grad_scale)};
}

template <DType G, DType O, Decay D>
AVX2_FN inline void update(const Ptrs& x, const Consts& c, int64_t i) {
  __m256 p = _mm256_loadu_ps(x.pi + i);
  __m256 g = _mm256_mul_ps(load_grad<G>(x.g, i), c.grad_scale);
  if constexpr (D == Decay::kL2) {
    g = _mm256_fmadd_ps(c.l2, p, g);
  } else {
    p = _mm256_mul_ps(p, c.decay_factor);
  }
  __m256 m = _mm256_loadu_ps(x.mi + i);
  __m256 v = _mm256_loadu_ps(x.vi + i);
  m = _mm256_fmadd_ps(c.one_minus_beta1, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v, c.beta2));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c.inv_bc2_sqrt, c.eps);
  p = _mm256_fnmadd_ps(c.step_size, _mm256_div_ps(m, denom), p);
  _mm256_storeu_ps(x.m + i, m);
  _mm256_storeu_ps(x.v + i, v);
  _mm256_storeu_ps(x.p + i, p);
  store_out<O>(x.out, i, p);
}

// The last < 8 elements go through the same vector code on a padded copy, so every
// element gets bit-identical math wherever a thread's range happens to end.
template <DType G, DType O, Decay D>
AVX2_FN void update_tail(const Ptrs& x, const Consts& c, int64_t i, int64_t rem) {
  const size_t gsize = G == DType::kF32 ? 4 : 2;
  alignas(32) float p[kLanes] = {}, m[kLanes] = {}, v[kLanes] = {};
  alignas(32) unsigned char g[kLanes * 4] = {};
  alignas(32) uint16_t out[kLanes] = {};
  std::memcpy(p, x.pi + i, rem * 4);
  std::memcpy(m, x.mi + i, rem * 4);
  std::memcpy(v, x.vi + i, rem * 4);
  std::memcpy(g, static_cast<const unsigned char*>(x.g) + i * gsize, rem * gsize);
  update<G, O, D>(Ptrs{p, g, m, v, out, p, m, v}, c, 0);
  std::memcpy(x.p + i, p, rem * 4);
  std::memcpy(x.m + i, m, rem * 4);
  std::memcpy(x.v + i, v, rem * 4);
  if (O != DType::kNone) std::memcpy(static_cast<uint16_t*>(x.out) + i, out, rem * 2);
}

struct Avx2Kernel {
  template <DType G, DType O, Decay D>
  AVX2_FN static void run(const Segment& s, const Hyper& h, int64_t begin, int64_t end) {
    const Ptrs x{s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.param_out, s.param_in, s.exp_avg_in, s.exp_avg_sq_in};
    const Consts c = make_consts(s, h);
    int64_t i = begin;
    for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
      update<G, O, D>(x, c, i);
      update<G, O, D>(x, c, i + kLanes);
    }
    for (; i + kLanes <= end; i += kLanes) update<G, O, D>(x, c, i);
    if (i < end) update_tail<G, O, D>(x, c, i, end - i);
  }
};

}  // namespace

KernelFn avx2_kernel(const Hyper& h) { return select_kernel<Avx2Kernel>(h); }

}  // namespace infinity_adam

#else  // not x86: the dispatcher never asks for this path

namespace infinity_adam {
KernelFn avx2_kernel(const Hyper&) { return nullptr; }
}  // namespace infinity_adam

#endif
