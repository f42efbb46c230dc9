// Shared declarations of the native CPU Adam: one fused pass over flat fp32 master
// weights and moments, with fp32/bf16/fp16 gradients and an optional bf16/fp16 copy of
// the updated weights. No torch here: callers pass raw pointers, sizes and dtype codes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity_adam {

// Element types of the gradient and of the low-precision output; the codes are part of
// the Python binding's contract (infinity/optim/_native.py mirrors them).
enum class DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

// Instruction-set paths, best last; kAuto means "the best this CPU supports".
enum class Isa : int { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// How weight decay enters: decoupled (AdamW: p *= 1 - lr*wd, which is the identity for
// wd == 0) or as an L2 term added to the gradient (Adam: g += wd*p).
enum class Decay : int { kDecoupled = 0, kL2 = 1 };

// One contiguous run of elements. Step size and bias correction live here rather than in
// Hyper because tensors of one optimizer group may sit at different step counts. The
// states are read from param_in / exp_avg_in / exp_avg_sq_in and the updated ones written
// to param / exp_avg / exp_avg_sq: the same arrays for an update in place, another set for
// one out of place (Note [second state set] in infinity/_offload/_optimizer_store.py).
struct Segment {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;  // nullptr when out dtype is kNone
  const float* param_in;
  const float* exp_avg_in;
  const float* exp_avg_sq_in;
  int64_t n;
  float step_size;     // lr / (1 - beta1^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
};

// Hyperparameters shared by every segment of one call.
struct Hyper {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float decay_factor;  // 1 - lr*wd for kDecoupled
  float l2;            // wd for kL2
  float grad_scale;    // each gradient times this first: unscaling and clipping folded into the pass (1: none)
  Decay decay;
  DType grad;
  DType out;
};

// Updates elements [begin, end) of one segment in place. Every path computes the same
// formula; the SIMD ones may differ from the scalar reference by a few ulps (fused
// multiply-adds), never in rounding mode of the low-precision conversions.
using KernelFn = void (*)(const Segment&, const Hyper&, int64_t begin, int64_t end);

KernelFn scalar_kernel(const Hyper& h);
KernelFn avx2_kernel(const Hyper& h);
// hw_bf16 selects the avx512_bf16 conversion instruction; without it the AVX512 path
// rounds to bf16 in integer arithmetic.
KernelFn avx512_kernel(const Hyper& h, bool hw_bf16);

// Software conversions (round to nearest even), shared by the scalar path and tails.
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace infinity_adam
