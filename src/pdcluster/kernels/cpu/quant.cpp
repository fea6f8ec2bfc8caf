// int8 per-vector KV quantization for the CPU (AVX-512), bit for bit `pdcluster.kernels.kv_quant`'s
// `quantize_kv(x, bits=8)` / `dequantize_kv(q, s, bits=8)`: scale = absmax / 127 (an fp32 division), codes =
// round-half-even(x / scale) clamped to [-127, 127] (a zero scale divides by 1), values = code * scale.
//
// Why: int8 compression of a float layer on the KV wire made five passes over full-size temporaries in torch
// (abs, amax, div, round, clamp) on the sender and two on the receiver; here each vector is read once (absmax,
// then the codes from L1) and the output written once. Serial on purpose: it runs on the transport's encoder
// thread beside the event loop, and on the 2-core box a parallel region waits for a core someone else holds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

#include <cstdint>
#include <tuple>

namespace {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

void quantize_rows(const float* x, int8_t* q, float* s, int64_t rows, int64_t d) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
      __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - i), xr + i);
      m = _mm512_max_ps(m, _mm512_andnot_ps(sign, v));  // |v|: clear the sign bit (-0 -> +0, as abs does)
    }
    const float scale = _mm512_reduce_max_ps(m) / 127.0f;
    s[r] = scale;
    const __m512 div = _mm512_set1_ps(scale > 0.0f ? scale : 1.0f);
    int8_t* qr = q + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 k = tail_mask(d - i);
      __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(k, xr + i), div);
      v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // ties to even, as torch.round
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      _mm512_mask_cvtsepi32_storeu_epi8(qr + i, k, _mm512_cvtps_epi32(v));
    }
  }
}

void dequantize_rows(const int8_t* q, const float* s, float* out, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 scale = _mm512_set1_ps(s[r]);
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 k = tail_mask(d - i);
      __m128i c = _mm_maskz_loadu_epi8(k, q + r * d + i);
      __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
      _mm512_mask_storeu_ps(out + r * d + i, k, _mm512_mul_ps(v, scale));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> quantize8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "x: a contiguous float32 CPU tensor");
  const int64_t d = x.size(-1);
  TORCH_CHECK(d > 0, "x: needs a non-empty last dim");
  const int64_t rows = x.numel() / d;
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto s = at::empty(x.sizes().slice(0, x.dim() - 1), x.options());
  quantize_rows(x.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), rows, d);
  return {q, s};
}

at::Tensor dequantize8(const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() >= 1,
              "q: contiguous int8 CPU codes");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() * q.size(-1) == q.numel(),
              "s: contiguous float32, one scale per vector of q");
  const int64_t d = q.size(-1);
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  if (d > 0) dequantize_rows(q.data_ptr<int8_t>(), s.data_ptr<float>(), out.data_ptr<float>(), q.numel() / d, d);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize8", &quantize8, "int8 per-vector quantization (codes, scales), bit-exact with kv_quant");
  m.def("dequantize8", &dequantize8, "codes * per-vector scale as float32");
}
