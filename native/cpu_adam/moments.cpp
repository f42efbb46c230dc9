// Compressed Adam moments (Note [compressed moments] in infinity/_offload/_moments.py): bf16 and
// 8-bit block-quantised records, encoded with stochastic rounding and decoded, one pass
// each. infinity/_offload/_moments.py holds the same codes in torch (the reference and the fallback).
//
// The rounding noise of element i is a hash of (seed, i): the result does not depend on the
// thread count or on how blocks are shared out, and one seed per call decorrelates steps.
// Plain loops, built for AVX2 and a baseline clone (target_clones picks at load time).
#include "moments.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "thread_pool.h"

namespace infinity_adam {

namespace {

constexpr int64_t kQBlock = 2048;  // elements per int8 scale (infinity/_offload/_moments.py BLOCK)
constexpr int64_t kPerTask = 1 << 16;  // elements a thread claims at a time (whole quantisation blocks)

// 32 uniform bits from (seed, index): the "lowbias32" integer hash of their mix.
inline uint32_t noise_bits(uint32_t seed, uint32_t i) {
  uint32_t x = i * 0x9E3779B9u ^ seed;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline float uniform01(uint32_t seed, uint32_t i) {
  return static_cast<float>(noise_bits(seed, i) >> 8) * (1.0f / 16777216.0f);  // [0, 1)
}

__attribute__((target_clones("avx2", "default")))
void encode_bf16_range(const float* x, uint16_t* out, int64_t lo, int64_t hi, uint32_t seed) {
  for (int64_t i = lo; i < hi; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    bits += noise_bits(seed, static_cast<uint32_t>(i)) & 0xFFFFu;  // noise below the kept bits, then truncate
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

__attribute__((target_clones("avx2", "default")))
void decode_bf16_range(const uint16_t* in, float* out, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &bits, 4);
  }
}

__attribute__((target_clones("avx2", "default")))
float block_absmax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

__attribute__((target_clones("avx2", "default")))
void encode_signed_block(const float* x, int8_t* q, int64_t base, int64_t n, float inv, uint32_t seed) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::sqrt(std::fabs(x[i]) * inv) * 127.0f + uniform01(seed, static_cast<uint32_t>(base + i));
    const float c = std::min(std::floor(y), 127.0f);
    q[i] = static_cast<int8_t>(std::copysign(c, x[i]));
  }
}

__attribute__((target_clones("avx2", "default")))
void encode_unsigned_block(const float* x, uint8_t* q, int64_t base, int64_t n, float inv, uint32_t seed) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::sqrt(std::sqrt(x[i] * inv)) * 255.0f + uniform01(seed, static_cast<uint32_t>(base + i));
    float c = std::min(std::floor(y), 255.0f);
    if (c == 0.0f && x[i] > 0.0f) c = 1.0f;  // a nonzero v keeps a nonzero code
    q[i] = static_cast<uint8_t>(c);
  }
}

__attribute__((target_clones("avx2", "default")))
void decode_signed_block(const int8_t* q, float* out, int64_t n, float scale) {
  const float k = scale * (1.0f / (127.0f * 127.0f));
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(q[i]);
    out[i] = f * std::fabs(f) * k;
  }
}

__attribute__((target_clones("avx2", "default")))
void decode_unsigned_block(const uint8_t* q, float* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float t = static_cast<float>(q[i]) * (1.0f / 255.0f);
    const float t2 = t * t;
    out[i] = t2 * t2 * scale;
  }
}

// fn(lo, hi) over [0, n) in pieces of kPerTask elements, on up to `threads` threads.
template <typename Fn>
void parallel(int64_t n, int threads, const Fn& fn) {
  const int t = static_cast<int>(std::min<int64_t>(std::max(threads, 1), std::max<int64_t>(1, n / kPerTask)));
  if (t <= 1) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  ThreadPool::instance().run(t, [&](int) {
    for (;;) {
      const int64_t lo = next.fetch_add(kPerTask, std::memory_order_relaxed);
      if (lo >= n) break;
      fn(lo, std::min(n, lo + kPerTask));
    }
  });
}

}  // namespace

void encode_bf16(const float* x, uint16_t* out, int64_t n, uint32_t seed, int threads) {
  parallel(n, threads, [&](int64_t lo, int64_t hi) { encode_bf16_range(x, out, lo, hi, seed); });
}

void decode_bf16(const uint16_t* in, float* out, int64_t n, int threads) {
  parallel(n, threads, [&](int64_t lo, int64_t hi) { decode_bf16_range(in, out, lo, hi); });
}

void encode_int8(const float* x, uint8_t* codes, float* scales, int64_t n, bool is_signed, uint32_t seed,
                 int threads) {
  parallel(n, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b += kQBlock) {
      const int64_t len = std::min(kQBlock, n - b);
      const float m = block_absmax(x + b, len);
      scales[b / kQBlock] = m;
      const float inv = m > 0.0f ? 1.0f / m : 0.0f;
      if (is_signed)
        encode_signed_block(x + b, reinterpret_cast<int8_t*>(codes + b), b, len, inv, seed);
      else
        encode_unsigned_block(x + b, codes + b, b, len, inv, seed);
    }
  });
}

void decode_int8(const uint8_t* codes, const float* scales, float* out, int64_t n, bool is_signed, int threads) {
  parallel(n, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; b += kQBlock) {
      const int64_t len = std::min(kQBlock, n - b);
      if (is_signed)
        decode_signed_block(reinterpret_cast<const int8_t*>(codes + b), out + b, len, scales[b / kQBlock]);
      else
        decode_unsigned_block(codes + b, out + b, len, scales[b / kQBlock]);
    }
  });
}

}  // namespace infinity_adam
