// No include guard on purpose: adam_avx512.cpp includes this file twice (see below).
// The AVX512 kernel family, included twice by adam_avx512.cpp: once with the
// avx512_bf16 conversion instruction and once without (bf16 rounded in integer
// arithmetic). The includer defines ADAM512_FN (the target attribute), ADAM512_NS and
// ADAM512_HW_BF16 (0 or 1).

namespace ADAM512_NS {

constexpr int kLanes = 16;

ADAM512_FN inline __mmask16 tail_mask(int64_t rem) {
  return static_cast<__mmask16>((1u << rem) - 1u);
}

template <DType G>
ADAM512_FN inline __m512 load_grad(const void* g, int64_t i, __mmask16 k) {
  if constexpr (G == DType::kF32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round to nearest even in integer arithmetic; NaN becomes the canonical 0x7fc0.
ADAM512_FN inline __m256i to_bf16_soft(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

ADAM512_FN inline __m256i to_bf16(__m512 p) {
#if ADAM512_HW_BF16
  // Note: vcvtneps2bf16 flushes subnormals to zero and keeps NaN payloads, while a
  // torch cast keeps subnormals. Those lanes (rare) take the integer rounding instead, so
  // both AVX512 variants and the scalar path give the same bits as torch's cast.
  __m256i r = (__m256i)_mm512_cvtneps_pbh(p);
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), _mm512_set1_epi32(0x7fffffff)));
  // Zeros (e.g. shard padding) convert the same either way, so they stay on the fast path.
  const __mmask16 nonzero = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  const __mmask16 special = _mm512_mask_cmp_ps_mask(nonzero, a, _mm512_set1_ps(1.17549435e-38f), _CMP_NGE_UQ);
  if (__builtin_expect(special != 0, 0)) r = _mm256_mask_mov_epi16(r, special, to_bf16_soft(p));
  return r;
#else
  return to_bf16_soft(p);
#endif
}

template <DType O>
ADAM512_FN inline void store_out(void* out, int64_t i, __m512 p, __mmask16 k) {
  if constexpr (O != DType::kNone) {
    __m256i h;
    if constexpr (O == DType::kBF16) {
      h = to_bf16(p);
    } else {
      h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, h);
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
  __m512 decay_factor, l2, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt, step_size, grad_scale;
};

ADAM512_FN inline Consts make_consts(const Segment& s, const Hyper& h) {
  return {_mm512_set1_ps(h.decay_factor), _mm512_set1_ps(h.l2),
          _mm512_set1_ps(h.one_minus_beta1), _mm512_set1_ps(h.beta2),
          _mm512_set1_ps(h.one_minus_beta2), _mm512_set1_ps(h.eps),
          _mm512_set1_ps(s.inv_bc2_sqrt), _mm512_set1_ps(s.step_size), _mm512_set1_ps(h.grad_scale)};
}

// Masked loads and stores make the tail run the same instructions as the body.
template <DType G, DType O, Decay D>
ADAM512_FN inline void update(const Ptrs& x, const Consts& c, int64_t i, __mmask16 k) {
  __m512 p = _mm512_maskz_loadu_ps(k, x.pi + i);
  __m512 g = _mm512_mul_ps(load_grad<G>(x.g, i, k), c.grad_scale);
  if constexpr (D == Decay::kL2) {
    g = _mm512_fmadd_ps(c.l2, p, g);
  } else {
    p = _mm512_mul_ps(p, c.decay_factor);
  }
  __m512 m = _mm512_maskz_loadu_ps(k, x.mi + i);
  __m512 v = _mm512_maskz_loadu_ps(k, x.vi + i);
  m = _mm512_fmadd_ps(c.one_minus_beta1, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v, c.beta2));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c.inv_bc2_sqrt, c.eps);
  p = _mm512_fnmadd_ps(c.step_size, _mm512_div_ps(m, denom), p);
  _mm512_mask_storeu_ps(x.m + i, k, m);
  _mm512_mask_storeu_ps(x.v + i, k, v);
  _mm512_mask_storeu_ps(x.p + i, k, p);
  store_out<O>(x.out, i, p, k);
}

struct Kernel {
  template <DType G, DType O, Decay D>
  ADAM512_FN static void run(const Segment& s, const Hyper& h, int64_t begin, int64_t end) {
    const Ptrs x{s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.param_out, s.param_in, s.exp_avg_in, s.exp_avg_sq_in};
    const Consts c = make_consts(s, h);
    const __mmask16 all = 0xffff;
    int64_t i = begin;
    for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
      update<G, O, D>(x, c, i, all);
      update<G, O, D>(x, c, i + kLanes, all);
    }
    for (; i < end; i += kLanes) update<G, O, D>(x, c, i, end - i >= kLanes ? all : tail_mask(end - i));
  }
};

}  // namespace ADAM512_NS
