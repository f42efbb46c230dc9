// The AVX512 path: 16 elements per vector, masked tails. Built twice from
// adam_avx512_body.h, with and without the avx512_bf16 conversion instruction, each under
// its own per-function target attribute; the dispatcher checks CPUID before calling.
#include "cpu_adam.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "kernel_table.h"

namespace infinity_adam {
namespace {

#define ADAM512_FN __attribute__((target("avx512f,avx512bw,avx512vl")))
#define ADAM512_NS soft_bf16
#define ADAM512_HW_BF16 0
#include "adam_avx512_body.h"
#undef ADAM512_FN
#undef ADAM512_NS
#undef ADAM512_HW_BF16

#define ADAM512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ADAM512_NS hw_bf16
#define ADAM512_HW_BF16 1
#include "adam_avx512_body.h"
#undef ADAM512_FN
#undef ADAM512_NS
#undef ADAM512_HW_BF16

}  // namespace

KernelFn avx512_kernel(const Hyper& h, bool hw_bf16) {
  // Only the bf16 output differs between the two builds.
  if (hw_bf16 && h.out == DType::kBF16) return select_kernel<hw_bf16::Kernel>(h);
  return select_kernel<soft_bf16::Kernel>(h);
}

}  // namespace infinity_adam

#else  // not x86: the dispatcher never asks for this path

namespace infinity_adam {
KernelFn avx512_kernel(const Hyper&, bool) { return nullptr; }
}  // namespace infinity_adam

#endif
