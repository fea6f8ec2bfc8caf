// fp32 RMSNorm for the decode step, optionally fused with the residual add before it:
//   s = x (+ residual);  y = (s * (1 / sqrt(mean(s^2) + eps))) * w
// torch's F.rms_norm on the CPU runs as ~10 small ops (~0.2 ms a call at 16 rows on the 2-core box,
// docs/benchmarks/engine.md); here a row is one pass to sum squares and one to scale. The sum runs in 16
// lanes then a fixed tree, so bits may differ from torch's reduction in the last place: callers compare
// with a tolerance, and greedy tokens are checked against HF.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>

namespace {

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }

void norm_row(const float* x, const float* res, float* sum_out, const float* w, float* y, int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    if (res) {
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res + j));
      _mm512_mask_storeu_ps(sum_out + j, m, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  const float* s = res ? sum_out : x;
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 m = tail_mask(d - j);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), rv);
    _mm512_mask_storeu_ps(y + j, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + j)));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name, ": fp32 [rows, d], unit stride");
}

}  // namespace

// x [M, d] fp32; w [d] fp32 (the effective scale: Gemma's 1 + w is the caller's); residual [M, d] or None.
// Returns (y, s) where s = x + residual (undefined without a residual).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                            const c10::optional<at::Tensor>& residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == d, "w: fp32 [", d, "]");
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor s;
  if (has_res) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == d, "residual must have x's shape");
    s = at::empty({rows, d}, x.options());
  }
  auto y = at::empty({rows, d}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  float *yp = y.data_ptr<float>(), *sp = has_res ? s.data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0), ldr = has_res ? residual->stride(0) : 0;
  for (int64_t i = 0; i < rows; ++i)  // rows are a few KiB: sharing them over threads costs more than it gives
    norm_row(xp + i * ldx, rp ? rp + i * ldr : nullptr, sp ? sp + i * d : nullptr, wp, yp + i * d, d,
             static_cast<float>(eps));
  return {y, s};
}

void bind_norm(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "fp32 RMSNorm, optionally after a residual add: returns (y, x + residual)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
}
