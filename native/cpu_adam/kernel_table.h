// Picks the template instance of a kernel family for one call's dtypes and decay mode, so
// the inner loops carry no per-element branches.
#pragma once

#include "cpu_adam.h"

namespace infinity_adam {

template <class K, DType G, DType O>
KernelFn select_decay(const Hyper& h) {
  if (h.decay == Decay::kL2) return &K::template run<G, O, Decay::kL2>;
  return &K::template run<G, O, Decay::kDecoupled>;
}

template <class K, DType G>
KernelFn select_out(const Hyper& h) {
  switch (h.out) {
    case DType::kBF16: return select_decay<K, G, DType::kBF16>(h);
    case DType::kF16: return select_decay<K, G, DType::kF16>(h);
    default: return select_decay<K, G, DType::kNone>(h);
  }
}

template <class K>
KernelFn select_kernel(const Hyper& h) {
  switch (h.grad) {
    case DType::kBF16: return select_out<K, DType::kBF16>(h);
    case DType::kF16: return select_out<K, DType::kF16>(h);
    default: return select_out<K, DType::kF32>(h);
  }
}

}  // namespace infinity_adam
