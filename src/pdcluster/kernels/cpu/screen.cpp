// Greedy decoding's LM head, screened in bf16 and decided in fp32: the exact argmax of the fp32 logits the
// packed kernel (linear.cpp) would compute, without computing most of them.
//
// Why: at batch 16 the LM head is ~40 % of a decode step's multiply-adds, and greedy decoding only needs its
// argmax. A bf16 copy of the head (VDPBF16PS: half the bytes, twice the multiply-adds a cycle) gives every
// logit to within a bound that is rigorous, per row j of the head:
//
//   |A_j - E_j| <= n_h * u_j + n_d * z_j
//
// A_j: this kernel's bf16 logit; E_j: linear.cpp's fp32 logit (one FMA chain in ascending k); n_h = ||h||,
// n_d = ||h - bf16(h)|| for the hidden row h; u_j = ||w_j - bf16(w_j)|| + gamma * (||w_j|| + 2 ||bf16(w_j)||)
// and z_j = ||bf16(w_j)|| (screen_pack; gamma covers the rounding of a 2K-term fp32 sum, Cauchy-Schwarz the
// rest). The fp32 argmax j* has E_j* >= E_m for every m, so A_j* + b_j* >= max_m (A_m - b_m): every j whose
// upper bound reaches the best lower bound is a candidate, and j* (with every j that ties it) is among them.
// The candidates - a handful - get their fp32 logits by linear.cpp's exact FMA chain from the fp32 panels,
// and the first maximum among them is the answer: the same token, bit for bit, as argmax(linear(h)).
//
// A row is not decided here (-1: the caller runs the full fp32 head for it) when anything is non-finite or
// when more than `max_candidates` survive (e.g. a zero hidden state: every logit ties).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t NR = 64;  // columns per panel, as linear.cpp
constexpr int MAX_MR = 6;
// slack on the bound: the float arithmetic that evaluates it (a few roundings of ~2^-24 each, and of
// |A_j| when A_j - b_j is formed), output denormals VDPBF16PS flushes, and the norms' own rounding
constexpr float BOUND_SCALE = 1.01f;
constexpr float ABS_SLACK = 1e-30f;
constexpr float REL_SLACK = 1.0f / (1 << 20);

// float -> bf16, round to nearest even; a result below the smallest normal becomes 0 (VDPBF16PS reads
// denormal bf16 inputs as 0: the weights it is given must hold no denormal, so the norms match what it uses)
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);  // zero or denormal
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float round_up(double v) { return std::nextafter(static_cast<float>(v), INFINITY); }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void hidden_to_bf16(const float* x, int64_t K, int64_t K2, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
    std::memcpy(out + k, &b, 32);
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k));
    uint16_t tmp[16];
    std::memcpy(tmp, &b, 32);
    std::memcpy(out + k, tmp, 2 * (K - k));
  }
  for (k = K; k < K2; ++k) out[k] = 0;
}

// y[r, c] = sum over k-pairs of dpbf16(w, x) for MR rows x 64 columns of one panel
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void bpanel(const uint32_t* __restrict x, int64_t ldx, const uint16_t* __restrict wp, int64_t pairs,
            float* __restrict y, int64_t ldy, int64_t ncols) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w = wp;
  for (int64_t kk = 0; kk < pairs; ++kk, w += 2 * NR) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + kk]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, b);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, b);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t left = ncols - 16 * j;
    if (left <= 0) break;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, m, acc[r][j]);
  }
}

using BPanelFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t);
constexpr BPanelFn BPANELS[7] = {nullptr, bpanel<1>, bpanel<2>, bpanel<3>, bpanel<4>, bpanel<5>, bpanel<6>};

// E_j exactly as linear.cpp computes it: one accumulator, fused multiply-adds in ascending k, from 0
float exact_logit(const float* x, const float* wp, int64_t K, int64_t j) {
  const float* w = wp + (j / NR) * K * NR + (j % NR);
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(w[k * NR], x[k], acc);
  return acc;
}

struct Bounds {
  double n_h, n_d;
};

// one row's decision from its screened logits `a` (-1: not decided here); two 16-lane passes over the row:
// the best lower bound, then the candidates whose upper bound reaches it
int64_t decide(const float* a, const float* u, const float* z, int64_t n, Bounds bd, const float* x,
               const float* wp, int64_t K, int64_t max_candidates, std::vector<int64_t>& cands) {
  const __m512 nh = _mm512_set1_ps(round_up(bd.n_h * BOUND_SCALE)), nd = _mm512_set1_ps(round_up(bd.n_d * BOUND_SCALE));
  const __m512 rel = _mm512_set1_ps(REL_SLACK), abs_slack = _mm512_set1_ps(ABS_SLACK);
  const __m512 huge = _mm512_set1_ps(3.0e38f);
  auto bound = [&](__m512 av, __m512 uv, __m512 zv) {
    return _mm512_add_ps(_mm512_fmadd_ps(nh, uv, _mm512_mul_ps(nd, zv)),
                         _mm512_fmadd_ps(rel, _mm512_abs_ps(av), abs_slack));
  };
  __m512 low = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + j);
    // not finite (NaN fails the compare, +-inf exceeds it): the fp32 head decides this row
    bad |= _mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(av), huge, _CMP_NLE_UQ);
    const __m512 b = bound(av, _mm512_maskz_loadu_ps(m, u + j), _mm512_maskz_loadu_ps(m, z + j));
    low = _mm512_mask_max_ps(low, m, low, _mm512_sub_ps(av, b));
  }
  if (bad) return -1;
  const __m512 best_low = _mm512_set1_ps(_mm512_reduce_max_ps(low));
  cands.clear();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + j);
    const __m512 b = bound(av, _mm512_maskz_loadu_ps(m, u + j), _mm512_maskz_loadu_ps(m, z + j));
    unsigned hit = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(av, b), best_low, _CMP_GE_OQ);
    while (hit) {
      if (static_cast<int64_t>(cands.size()) >= max_candidates) return -1;
      cands.push_back(j + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
  int64_t pick = -1;
  float top = -INFINITY;
  for (int64_t j : cands) {  // ascending: a strictly greater value moves the pick, so the first maximum wins
    const float e = exact_logit(x, wp, K, j);
    if (!std::isfinite(e)) return -1;
    if (pick < 0 || e > top) pick = j, top = e;
  }
  return pick;
}

}  // namespace

// w [N, K] fp32 -> (wb [NB, ceil(K/2), 64, 2] bf16 as int16, coef [2, N] fp32: u then z, rounded up)
std::tuple<at::Tensor, at::Tensor> screen_pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "w: [N, K] fp32");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + NR - 1) / NR, pairs = (K + 1) / 2;
  auto wb = at::empty({NB, pairs, NR, 2}, w.options().dtype(at::kShort));
  auto coef = at::empty({2, N}, w.options());
  std::memset(wb.data_ptr(), 0, wb.numel() * 2);
  const float* src = w.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(wb.data_ptr<int16_t>());
  float* u = coef.data_ptr<float>();
  float* z = u + N;
  // a 2K-term fp32 sum (VDPBF16PS: up to two roundings a pair), each rounding within an ulp (2^-23: not
  // assuming round-to-nearest, which the instruction's specification leaves to the implementation)
  const double unit = std::ldexp(1.0, -23);
  const double gamma = 2.0 * K * unit / (1.0 - 2.0 * K * unit);
  for (int64_t j = 0; j < N; ++j) {
    double ww = 0, rr = 0, qq = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = src[j * K + k];
      const uint16_t b = to_bf16(v);
      const double q = from_bf16(b);
      dst[((j / NR) * pairs + k / 2) * NR * 2 + (j % NR) * 2 + (k % 2)] = b;
      ww += double(v) * v;
      qq += q * q;
      rr += (double(v) - q) * (double(v) - q);
    }
    // double sums of K squares carry a relative error far below the 1 % BOUND_SCALE takes at run time
    u[j] = round_up(std::sqrt(rr) + gamma * (std::sqrt(ww) + 2.0 * std::sqrt(qq)));
    z[j] = round_up(std::sqrt(qq));
  }
  return {wb, coef};
}

// x [M, K] fp32, wb/coef from screen_pack, wp [NB, K, 64] fp32 panels of the same weight (linear.cpp's) ->
// int64 [M]: argmax of x @ W.T per row as linear.cpp + argmax would give it, or -1 where not decided here
at::Tensor screen_argmax(const at::Tensor& x_in, const at::Tensor& wb, const at::Tensor& coef, const at::Tensor& wp,
                         int64_t n, int64_t max_candidates, int64_t grain) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x: [M, K] fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), pairs = (K + 1) / 2;
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == K && wp.size(2) == NR && wp.scalar_type() == at::kFloat &&
              wp.is_contiguous(), "wp: contiguous [NB, K, 64] fp32 for this K");
  TORCH_CHECK(wb.dim() == 4 && wb.size(0) == NB && wb.size(1) == pairs && wb.size(2) == NR && wb.size(3) == 2 &&
              wb.scalar_type() == at::kShort && wb.is_contiguous(), "wb: screen_pack's [NB, K/2, 64, 2]");
  TORCH_CHECK(n > (NB - 1) * NR && n <= NB * NR, "n=", n, " does not fit ", NB, " panels");
  TORCH_CHECK(coef.dim() == 2 && coef.size(0) == 2 && coef.size(1) == n && coef.scalar_type() == at::kFloat &&
              coef.is_contiguous(), "coef: [2, n] fp32");
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  std::vector<uint16_t> xb(M * pairs * 2);
  std::vector<Bounds> bounds(M);
  std::vector<bool> finite(M, true);
  for (int64_t r = 0; r < M; ++r) {
    const float* row = xp + r * K;
    uint16_t* rb = xb.data() + r * pairs * 2;
    hidden_to_bf16(row, K, pairs * 2, rb);
    double hh = 0, dd = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (!std::isfinite(row[k])) finite[r] = false;
      const double d = double(row[k]) - from_bf16(rb[k]);
      hh += double(row[k]) * row[k];
      dd += d * d;
    }
    bounds[r] = {std::sqrt(hh), std::sqrt(dd)};
  }
  auto a = at::empty({M, n}, x.options());
  float* ap = a.data_ptr<float>();
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xb.data());
  const uint16_t* w16 = reinterpret_cast<const uint16_t*>(wb.data_ptr<int16_t>());
  const int64_t chunks = (M + MAX_MR - 1) / MAX_MR;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t ncols = std::min<int64_t>(NR, n - b * NR);
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int mr = static_cast<int>((M - m0) / (chunks - c));
        BPANELS[mr](x32 + m0 * pairs, pairs, w16 + b * pairs * 2 * NR, pairs, ap + m0 * n + b * NR, n, ncols);
        m0 += mr;
      }
    }
  };
  if (grain > 0 && grain < NB) {
    auto item = [&](int64_t i) { run(i * grain, std::min(NB, (i + 1) * grain)); };
    pdc::share((NB + grain - 1) / grain, item);
  } else {
    run(0, NB);
  }
  const float* u = coef.data_ptr<float>();
  const float* z = u + n;
  const float* w = wp.data_ptr<float>();
  auto row = [&](int64_t r) {
    thread_local std::vector<int64_t> cands;
    op[r] = finite[r] ? decide(ap + r * n, u, z, n, bounds[r], xp + r * K, w, K, max_candidates, cands) : -1;
  };
  if (M > 1) {
    pdc::share(M, row);
  } else {
    row(0);
  }
  return out;
}

// The screen wins at many rows only where VDPBF16PS (32 multiply-adds) retires about as often as
// VFMADD231PS (16): Zen 4 1.0 (the screen 1.5x at 16 rows), the Emerald Rapids Xeon it was first measured
// on ~0.25 (1.3 vs 5.2 G/s; 0.85-0.98x from 8 rows). So the row limit comes from this probe of the core that
// runs it: both instructions in 12 independent register chains (more than latency x throughput on either),
// no memory, best of 3 alternating runs. Returns the dot product's instruction rate over the FMA's.
namespace {
constexpr int CHAINS = 12;
template <bool DOT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline)) double chain_seconds(int64_t iters) {
  __m512 acc[CHAINS];
  for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_set1_ps(1e-3f * static_cast<float>(j));
  const __m512 a = _mm512_set1_ps(1e-7f);
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8: the sums stay small and finite
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < CHAINS; ++j) acc[j] = DOT ? _mm512_dpbf16_ps(acc[j], b, b) : _mm512_fmadd_ps(acc[j], a, a);
  }  // (no asm barrier: one slowed both to ~40 %; the chains' dependences and the sink keep every instruction)
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = acc[0];
  for (int j = 1; j < CHAINS; ++j) sum = _mm512_add_ps(sum, acc[j]);
  volatile float sink = _mm512_reduce_add_ps(sum);  // keep every chain live
  (void)sink;
  return dt;
}
}  // namespace

double bf16_dot_rate_ratio(int64_t iters) {
  TORCH_CHECK(iters > 0, "iters must be positive");
  double fma = 1e30, dot = 1e30;
  for (int r = 0; r < 3; ++r) {
    fma = std::min(fma, chain_seconds<false>(iters));
    dot = std::min(dot, chain_seconds<true>(iters));
  }
  return fma / dot;
}

void bind_screen(pybind11::module_& m) {
  m.def("bf16_dot_rate_ratio", &bf16_dot_rate_ratio,
        "VDPBF16PS instructions a second over VFMADD231PS, on the calling thread (register-only probe)",
        pybind11::arg("iters") = 100000);
  m.def("screen_pack", &screen_pack, "bf16 panels of an LM head and its per-row error coefficients");
  m.def("screen_argmax", &screen_argmax, "argmax of x @ W.T as linear.cpp gives it, screened in bf16 (-1: undecided)",
        pybind11::arg("x"), pybind11::arg("wb"), pybind11::arg("coef"), pybind11::arg("wp"), pybind11::arg("n"),
        pybind11::arg("max_candidates") = 64, pybind11::arg("grain") = 16);
}
