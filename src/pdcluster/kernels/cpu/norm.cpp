// RMSNorm (optionally after the residual add) with F.rms_norm's exact fp32 bits: y = (x * r) * w,
// r = 1 / sqrt(sum(x * x) / H + eps).
//
// Why its own kernel: torch runs F.rms_norm as ~6 small ops (pow, sum, div, add, rsqrt, two muls), 37 us a
// call at batch 1 and 76 us at batch 16 on the 2-core box, 17 calls a step (docs/benchmarks/engine.md at 5f904a5).
//
// Bits: every step is one IEEE operation in torch's order, so the only hard part is the sum. torch's CPU sum of
// a contiguous row (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum) runs on 8-lane vectors
// here (its AVX2 kernel serves the AVX-512 capability too): vectors are dealt round-robin to 4 accumulators,
// with a 4-level cascade that folds every 2^p-th group of vectors into the next level; the 4 accumulators are
// then added in order, the scalar tail is summed from 0, and the 8 lanes are added to it left to right. This
// file repeats that order lane by lane. norm.py checks the result against F.rms_norm once per hidden size
// before trusting it (another torch build or CPU capability may sum differently) and falls back otherwise.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

// No contraction: torch squares, then adds (two roundings), and the module is built with -ffp-contract=fast.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int VL = 8;      // lanes of torch's reduction vector
constexpr int ILP = 4;     // accumulators row_sum deals vectors to
constexpr int LEVELS = 4;  // multi_row_sum's cascade levels

struct Lanes {
  float v[VL];
};

inline void add_to(Lanes& a, const Lanes& b) {
  for (int l = 0; l < VL; ++l) a.v[l] += b.v[l];
}

int ceil_log2(int64_t n) {
  int p = 0;
  while ((int64_t{1} << p) < n) ++p;
  return p;
}

// sum(x[i] * x[i]) in torch's order for one contiguous row of n floats
float sum_squares(const float* x, int64_t n) {
  const int64_t nvec = n / VL, size = nvec / ILP;
  auto load = [&](int64_t vec, Lanes& out) {
    for (int l = 0; l < VL; ++l) out.v[l] = x[vec * VL + l] * x[vec * VL + l];
  };
  const int power = std::max(4, ceil_log2(size) / LEVELS);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  Lanes acc[LEVELS][ILP] = {};
  Lanes sq;
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < ILP; ++k) load(i * ILP + k, sq), add_to(acc[0][k], sq);
    for (int j = 1; j < LEVELS; ++j) {
      for (int k = 0; k < ILP; ++k) add_to(acc[j][k], acc[j - 1][k]), acc[j - 1][k] = Lanes{};
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < ILP; ++k) load(i * ILP + k, sq), add_to(acc[0][k], sq);
  for (int j = 1; j < LEVELS; ++j)
    for (int k = 0; k < ILP; ++k) add_to(acc[0][k], acc[j][k]);
  for (int64_t v = size * ILP; v < nvec; ++v) load(v, sq), add_to(acc[0][0], sq);  // row_sum's leftovers
  for (int k = 1; k < ILP; ++k) add_to(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t e = nvec * VL; e < n; ++e) total += x[e] * x[e];
  for (int l = 0; l < VL; ++l) total += acc[0][0].v[l];
  return total;
}

void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float mean = sum_squares(x, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t e = 0; e < n; ++e) y[e] = (x[e] * r) * w[e];
}

}  // namespace

// x [M, H] fp32 contiguous; delta (same shape) or None; weight [H]. Returns (s, y): s = x + delta (x itself
// without delta), y = rms_norm(s) * weight.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, H] fp32");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == H,
              "weight: [H] fp32");
  at::Tensor s = x;
  if (delta.has_value() && delta->defined()) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == at::kFloat && delta->is_contiguous(),
                "delta: contiguous fp32 of x's shape");
    s = at::empty({M, H}, x.options());
  }
  auto y = at::empty({M, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = s.is_same(x) ? nullptr : delta->data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  constexpr int64_t ROWS = 16;  // rows per shared item (prefill chunks); a decode batch is one item
  auto item = [&](int64_t it) {
    for (int64_t r = it * ROWS; r < std::min(M, (it + 1) * ROWS); ++r) {
      if (dp != nullptr)
        for (int64_t c = 0; c < H; ++c) sp[r * H + c] = xp[r * H + c] + dp[r * H + c];
      norm_row(sp + r * H, wp, yp + r * H, H, e);
    }
  };
  const int64_t items = (M + ROWS - 1) / ROWS;
  if (items > 1 && M * H >= (int64_t{1} << 16)) {
    pdc::share(items, item);
  } else {
    for (int64_t it = 0; it < items; ++it) item(it);
  }
  return {s, y};
}

void bind_norm(pybind11::module_& m) {
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta) * weight) with F.rms_norm's bits",
        pybind11::arg("x"), pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"));
}
