// pybind11 binding of the native CPU Adam. Python validates tensors and passes raw
// addresses (tensor.data_ptr()), element counts and dtype codes; nothing here knows torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "dispatch.h"
#include "moments.h"

namespace py = pybind11;
using namespace infinity_adam;

namespace {

// (param, grad, exp_avg, exp_avg_sq, param_out or 0, numel, step_size, inv_bc2_sqrt, and the states' sources:
// param_in, exp_avg_in, exp_avg_sq_in, each 0 for the array itself: in place)
using SegmentTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, double, double,
                                uintptr_t, uintptr_t, uintptr_t>;

DType dtype_code(int code, bool allow_none, const char* what) {
  if ((code == -1 && allow_none) || code == 0 || code == 1 || code == 2) return static_cast<DType>(code);
  throw std::invalid_argument(std::string("bad dtype code for ") + what + ": " + std::to_string(code));
}

std::vector<Segment> to_segments(const std::vector<SegmentTuple>& tuples, bool has_out) {
  std::vector<Segment> segs;
  segs.reserve(tuples.size());
  for (const auto& t : tuples) {
    Segment s;
    s.param = reinterpret_cast<float*>(std::get<0>(t));
    s.grad = reinterpret_cast<const void*>(std::get<1>(t));
    s.exp_avg = reinterpret_cast<float*>(std::get<2>(t));
    s.exp_avg_sq = reinterpret_cast<float*>(std::get<3>(t));
    s.param_out = reinterpret_cast<void*>(std::get<4>(t));
    s.n = std::get<5>(t);
    s.step_size = static_cast<float>(std::get<6>(t));
    s.inv_bc2_sqrt = static_cast<float>(std::get<7>(t));
    s.param_in = std::get<8>(t) ? reinterpret_cast<const float*>(std::get<8>(t)) : s.param;
    s.exp_avg_in = std::get<9>(t) ? reinterpret_cast<const float*>(std::get<9>(t)) : s.exp_avg;
    s.exp_avg_sq_in = std::get<10>(t) ? reinterpret_cast<const float*>(std::get<10>(t)) : s.exp_avg_sq;
    if (s.n < 0) throw std::invalid_argument("negative element count");
    if (s.n > 0 && (!s.param || !s.grad || !s.exp_avg || !s.exp_avg_sq || (has_out && !s.param_out)))
      throw std::invalid_argument("null data pointer in a non-empty segment");
    segs.push_back(s);
  }
  return segs;
}

void step(const std::vector<SegmentTuple>& tuples, double beta1, double beta2, double eps,
          double decay_factor, double l2, int decay_mode, int grad_dtype, int out_dtype, int isa,
          bool hw_bf16, int threads, double grad_scale) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  if (decay_mode != 0 && decay_mode != 1) throw std::invalid_argument("bad decay mode");
  if (isa < -1 || isa > 2) throw std::invalid_argument("bad isa code " + std::to_string(isa));
  Hyper h;
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.decay_factor = static_cast<float>(decay_factor);
  h.l2 = static_cast<float>(l2);
  h.grad_scale = static_cast<float>(grad_scale);
  h.decay = static_cast<Decay>(decay_mode);
  h.grad = dtype_code(grad_dtype, false, "grad");
  h.out = dtype_code(out_dtype, true, "param_out");
  if (h.out == DType::kF32) throw std::invalid_argument("param_out must be bf16 or fp16");
  const std::vector<Segment> segs = to_segments(tuples, h.out != DType::kNone);
  py::gil_scoped_release release;
  adam_step(segs, h, static_cast<Isa>(isa), hw_bf16, threads);
}

void check_threads(int threads) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
  m.doc() = "Native Adam/AdamW step with AVX512, AVX2 and scalar paths chosen at run time";
  m.def("step", &step, py::arg("segments"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("decay_factor"), py::arg("l2"), py::arg("decay_mode"), py::arg("grad_dtype"),
        py::arg("out_dtype"), py::arg("isa"), py::arg("hw_bf16"), py::arg("threads"), py::arg("grad_scale") = 1.0);
  // Compressed moments (Note [compressed moments] in infinity/_offload/_moments.py): addresses and counts.
  m.def("encode_bf16", [](uintptr_t x, uintptr_t out, int64_t n, uint32_t seed, int threads) {
    check_threads(threads);
    py::gil_scoped_release release;
    encode_bf16(reinterpret_cast<const float*>(x), reinterpret_cast<uint16_t*>(out), n, seed, threads);
  });
  m.def("decode_bf16", [](uintptr_t in, uintptr_t out, int64_t n, int threads) {
    check_threads(threads);
    py::gil_scoped_release release;
    decode_bf16(reinterpret_cast<const uint16_t*>(in), reinterpret_cast<float*>(out), n, threads);
  });
  m.def("encode_int8", [](uintptr_t x, uintptr_t codes, uintptr_t scales, int64_t n, bool is_signed, uint32_t seed,
                          int threads) {
    check_threads(threads);
    py::gil_scoped_release release;
    encode_int8(reinterpret_cast<const float*>(x), reinterpret_cast<uint8_t*>(codes),
                reinterpret_cast<float*>(scales), n, is_signed, seed, threads);
  });
  m.def("decode_int8", [](uintptr_t codes, uintptr_t scales, uintptr_t out, int64_t n, bool is_signed, int threads) {
    check_threads(threads);
    py::gil_scoped_release release;
    decode_int8(reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scales),
                reinterpret_cast<float*>(out), n, is_signed, threads);
  });
  m.def("best_isa", [] { return static_cast<int>(best_isa()); });
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2;
    d["avx512"] = f.avx512;
    d["avx512bf16"] = f.avx512bf16;
    return d;
  });
}
