// Compressed Adam moments: bf16 and 8-bit block-quantised codes (Note [compressed moments]
// in infinity/_offload/_moments.py). Raw pointers and counts, no torch.
#pragma once

#include <cstdint>

namespace infinity_adam {

// fp32 -> bf16 with stochastic rounding; the noise of element i is a hash of (seed, i).
void encode_bf16(const float* x, uint16_t* out, int64_t n, uint32_t seed, int threads);
void decode_bf16(const uint16_t* in, float* out, int64_t n, int threads);
// Per block of 2048 elements: scale = absmax; signed codes sign(x) sqrt(|x|/scale) * 127,
// unsigned codes (x/scale)^(1/4) * 255 (never 0 for x > 0); stochastic rounding.
void encode_int8(const float* x, uint8_t* codes, float* scales, int64_t n, bool is_signed, uint32_t seed,
                 int threads);
void decode_int8(const uint8_t* codes, const float* scales, float* out, int64_t n, bool is_signed, int threads);

}  // namespace infinity_adam
