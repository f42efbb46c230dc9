#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "thread_pool.h"

namespace infinity_adam {

const CpuFeatures& cpu_features() {
  // __builtin_cpu_supports also checks that the OS saves the vector state (XCR0).
  static const CpuFeatures f = [] {
    CpuFeatures c{false, false, false};
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    c.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    c.avx512bf16 = c.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
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
// Note: threads claim blocks of this many elements from a shared counter instead of
// taking one fixed share each. A thread that the OS preempts (I/O threads, other ranks
// on the same cores) then delays the step by one block, not by its whole share. Blocks
// start on multiples of 64 elements (whole cache lines for 64-byte-aligned tensors, as
// torch allocates them), and every element gets the same math whichever thread runs it:
// results do not depend on the thread count.
constexpr int64_t kBlock = 1 << 16;

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

// The segments laid end to end: starts[k] is where segment k begins.
struct Plan {
  const std::vector<Segment>& segs;
  std::vector<int64_t> starts;
  int64_t total = 0;

  explicit Plan(const std::vector<Segment>& s) : segs(s) {
    starts.reserve(s.size());
    for (const Segment& seg : s) {
      starts.push_back(total);
      total += seg.n;
    }
  }

  // Applies `kernel` to elements [begin, end) of the concatenation.
  void run(const Hyper& h, KernelFn kernel, int64_t begin, int64_t end) const {
    size_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; k < segs.size() && starts[k] < end; ++k) {
      const int64_t lo = std::max(begin, starts[k]), hi = std::min(end, starts[k] + segs[k].n);
      if (lo < hi) kernel(segs[k], h, lo - starts[k], hi - starts[k]);
    }
  }
};

}  // namespace

void adam_step(const std::vector<Segment>& segments, const Hyper& hyper, Isa isa, bool hw_bf16,
               int threads) {
  if (isa == Isa::kAuto) isa = best_isa();
  const KernelFn kernel = pick_kernel(hyper, isa, hw_bf16);
  const Plan plan(segments);
  if (plan.total == 0) return;
  const int64_t useful = std::max<int64_t>(1, plan.total / kMinPerThread);
  const int n = static_cast<int>(std::min<int64_t>(threads, useful));
  if (n <= 1) {
    plan.run(hyper, kernel, 0, plan.total);
    return;
  }
  // Smaller blocks when the work is small, so every thread still gets several.
  const int64_t block = std::min<int64_t>(kBlock, std::max<int64_t>(64, plan.total / (4 * n)) / 64 * 64);
  std::atomic<int64_t> next{0};
#if defined(__x86_64__) || defined(__i386__)
  // Workers follow the caller's floating-point mode (flush-to-zero / denormals-are-zero,
  // e.g. torch.set_flush_denormal), so an element's result never depends on which
  // thread computed it.
  const unsigned csr = _mm_getcsr();
#endif
  ThreadPool::instance().run(n, [&](int) {
#if defined(__x86_64__) || defined(__i386__)
    if (_mm_getcsr() != csr) _mm_setcsr(csr);
#endif
    for (;;) {
      const int64_t begin = next.fetch_add(block, std::memory_order_relaxed);
      if (begin >= plan.total) break;
      plan.run(hyper, kernel, begin, std::min(plan.total, begin + block));
    }
  });
}

}  // namespace infinity_adam
