// fp32 y = x @ W.T (+ bias) for few rows of x, on weights packed once into 64-column panels.
//
// Layout (made by linear.py's pack): wp[NB][K][64] with NB = ceil(N / 64), panel b holding output columns
// b*64 .. b*64+63 (zero-padded past N), k-major: at each k the 64 weights of the panel are one 256-byte run,
// so a panel streams front to back as a single sequential read and 4 zmm registers hold one k-step.
//
// The micro-kernel keeps MR rows x 64 columns of y in 4*MR zmm accumulators, loads each weight vector once
// and FMAs it against a broadcast of x for every row: at one row this is a GEMV streaming weights at memory
// speed; at 6 rows it is 24 FMAs per 4 loads, compute-bound in L1/L2 (MKL's sgemm on this AMD core runs a
// path far below its AVX-512 FMA peak for 16-row products, docs/benchmarks/engine.md at 5f904a5 "Fifth pass").
// Every output is one accumulator summed in ascending k, then + bias: a fixed order, independent of the
// thread count and of which rows share a call.
//
// Threads: items of `grain` consecutive panels shared through pool.h (the caller plus spinning helpers claim
// them one by one), or all on the calling thread (grain 0). Which thread runs a panel never changes its bits.

// Narrow ATen headers, not <torch/extension.h>: the first-use build takes seconds, not minutes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NR = 64;  // columns per panel: 4 zmm of 16 floats

// pf: the k-steps [pf0, pf1) of the next panel to prefetch into L2 while this chunk runs, one k-step every
// `every` iterations: every row chunk of a panel takes its share, so the next panel streams in at 1/chunks
// of the rate the last chunk alone would have to ask for.
template <int MR, bool PF>
inline void panel(const float* __restrict x, int64_t ldx, const float* __restrict wp, int64_t K,
                  float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                  const float* __restrict pf, int64_t pf0, int64_t pf1, int64_t every) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* w = wp;
  int64_t next = pf0, wait = 0;
  for (int64_t k = 0; k < K; ++k, w += NR) {
    if (PF && wait-- == 0 && next < pf1) {  // a k-step of the next panel into L2: its first chunk computes
      wait = every - 1;
      const char* p = reinterpret_cast<const char*>(pf + next++ * NR);
      _mm_prefetch(p, _MM_HINT_T1);
      _mm_prefetch(p + 64, _MM_HINT_T1);
      _mm_prefetch(p + 128, _MM_HINT_T1);
      _mm_prefetch(p + 192, _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(w0, b, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, b, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(w2, b, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(w3, b, acc[r][3]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t left = ncols - 16 * j;
    if (left <= 0) break;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const __m512 bj = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * j, m, bias ? _mm512_add_ps(acc[r][j], bj) : acc[r][j]);
  }
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                        const float*, int64_t, int64_t, int64_t);
constexpr PanelFn PANELS[2][7] = {
    {nullptr, panel<1, false>, panel<2, false>, panel<3, false>, panel<4, false>, panel<5, false>, panel<6, false>},
    {nullptr, panel<1, true>, panel<2, true>, panel<3, true>, panel<4, true>, panel<5, true>, panel<6, true>}};
constexpr int MAX_MR = 6;

}  // namespace

// x [M, K] fp32 (row stride may exceed K), wp [NB, K, 64] contiguous fp32, n = real columns, bias [n] or None
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                            const c10::optional<at::Tensor>& bias, bool prefetch, int64_t grain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: [M, K] fp32, unit stride");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NR && wp.scalar_type() == at::kFloat && wp.is_contiguous(),
              "wp: contiguous [NB, K, 64] fp32");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(wp.size(1) == K, "x has K=", K, ", the packed weight ", wp.size(1));
  TORCH_CHECK(n > (NB - 1) * NR && n <= NB * NR, "n=", n, " does not fit ", NB, " panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias: [n] fp32");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // rows in ceil(M / 6) chunks as even as possible (16 -> 6+5+5, 8 -> 4+4): no thin last chunk
  const int64_t chunks = (M + MAX_MR - 1) / MAX_MR;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t ncols = std::min<int64_t>(NR, n - b * NR);
      const float* wb = w + b * K * NR;
      const bool pf = prefetch && b + 1 < b1;
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int mr = static_cast<int>((M - m0) / (chunks - c));
        // chunk c fetches k-steps [c*K/chunks, (c+1)*K/chunks) of the next panel, spread over its K iterations
        const int64_t pf0 = c * K / chunks, pf1 = (c + 1) * K / chunks;
        const int64_t every = std::max<int64_t>(1, K / std::max<int64_t>(1, pf1 - pf0));
        PANELS[pf][mr](xp + m0 * ldx, ldx, wb, K, yp + m0 * n + b * NR, n, ncols, bp ? bp + b * NR : nullptr,
                       wb + K * NR, pf0, pf1, every);
        m0 += mr;
      }
    }
  };
  if (grain > 0 && grain < NB) {  // items of `grain` panels; a product of one item stays on the calling thread
    auto item = [&](int64_t i) { run(i * grain, std::min(NB, (i + 1) * grain)); };
    pdc::share((NB + grain - 1) / grain, item);
  } else {
    run(0, NB);
  }
  return y;
}

void bind_linear(pybind11::module_& m) {
  m.def("packed_linear", &packed_linear, "y = x @ W.T (+ bias) on 64-column packed weights", pybind11::arg("x"),
        pybind11::arg("wp"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("prefetch") = true, pybind11::arg("grain") = 1);
}
