#include "dispatch.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "thread_pool.h"

namespace infinity_adam {

const CpuFeatures& cpu_features() {
  // __builtin_cpu_supports also checks that the OS saves the vector state (XCR0).
  static const CpuFeatures f = [] {
    __builtin_cpu_init();
    CpuFeatures c;
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    c.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    c.avx512bf16 = c.avx512 && __builtin_cpu_supports("avx512bf16");
    return c;
  }();
  return f;
}

Isa best_isa() {
  if (cpu_features().avx512) return Isa::kAvx512;
  if (cpu_features().avx2) return Isa::kAvx2;
  return Isa::kScalar;
}

namespace {

// Below this many elements per thread, waking a worker costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// Thread ranges start on multiples of this, so no two threads share a cache line.
constexpr int64_t kAlign = 64;

KernelFn pick_kernel(const Hyper& h, Isa isa, bool hw_bf16) {
  switch (isa) {
    case Isa::kScalar: return scalar_kernel(h);
    case Isa::kAvx2:
      if (!cpu_features().avx2) throw std::invalid_argument("this CPU lacks AVX2/FMA/F16C");
      return avx2_kernel(h);
    case Isa::kAvx512:
      if (!cpu_features().avx512) throw std::invalid_argument("this CPU lacks AVX512F/BW/VL");
      return avx512_kernel(h, hw_bf16 && cpu_features().avx512bf16);
    default: throw std::invalid_argument("unknown isa code " + std::to_string(static_cast<int>(isa)));
  }
}

// Applies `kernel` to elements [begin, end) of the concatenation of all segments.
void run_range(const std::vector<Segment>& segs, const Hyper& h, KernelFn kernel, int64_t begin,
               int64_t end) {
  int64_t base = 0;
  for (const Segment& s : segs) {
    const int64_t lo = std::max(begin, base), hi = std::min(end, base + s.n);
    if (lo < hi) kernel(s, h, lo - base, hi - base);
    base += s.n;
    if (base >= end) break;
  }
}

}  // namespace

void adam_step(const std::vector<Segment>& segments, const Hyper& hyper, Isa isa, bool hw_bf16,
               int threads) {
  if (isa == Isa::kAuto) isa = best_isa();
  const KernelFn kernel = pick_kernel(hyper, isa, hw_bf16);
  int64_t total = 0;
  for (const Segment& s : segments) total += s.n;
  if (total == 0) return;
  const int64_t useful = std::max<int64_t>(1, total / kMinPerThread);
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
  const int64_t per = (total + n - 1) / n;
  const int64_t chunk = (per + kAlign - 1) / kAlign * kAlign;
  ThreadPool::instance().run(n, [&](int t) {
    const int64_t begin = std::min(total, t * chunk);
    const int64_t end = std::min(total, begin + chunk);
    if (begin < end) run_range(segments, hyper, kernel, begin, end);
  });
}

}  // namespace infinity_adam
