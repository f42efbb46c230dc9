// Run-time choice of the instruction-set path and the multithreaded driver.
#pragma once

#include <vector>

#include "cpu_adam.h"

namespace infinity_adam {

struct CpuFeatures {
  bool avx2;        // avx2 + fma + f16c
  bool avx512;      // avx512f + avx512bw + avx512vl
  bool avx512bf16;  // the bf16 conversion instruction
};

const CpuFeatures& cpu_features();
Isa best_isa();

// One Adam step over every segment, split evenly across `threads` threads (fewer when
// the work is small). Throws std::invalid_argument when `isa` is not supported here.
// hw_bf16 = false keeps the AVX512 path off the avx512_bf16 instruction (for tests).
void adam_step(const std::vector<Segment>& segments, const Hyper& hyper, Isa isa, bool hw_bf16,
               int threads);

}  // namespace infinity_adam
