// RoPE on q and k plus the layer's KV cache write, in one pass over the fused QKV projection's output.
//
// Why: in torch this is a roll, two multiplies, an add and two index_copy_ per layer, ~6 dispatches that cost
// more than their arithmetic at decode batch sizes. Bits are torch's: out = x * cos + roll(x, d/2) * sin_signed
// (engine/attention.py), each product and the sum rounded once (no FMA contraction), and the cache receives
// the same rotated k and the untouched v that index_copy_ would store.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#pragma GCC optimize("fp-contract=off")

namespace {

// one head: out[e] = x[e] * c[e] + x[(e + half) % d] * s[e]
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < half; ++e) out[e] = x[e] * c[e] + x[e + half] * s[e];
  for (int64_t e = half; e < d; ++e) out[e] = x[e] * c[e] + x[e - half] * s[e];
}

}  // namespace

// qkv [n, nh + 2 nkv, d] fp32 contiguous; cos/sin n*d fp32 contiguous ([n, 1, d]); caches fp32 contiguous
// [blocks, block_size, nkv, d]; slots int64 [n], every one a slot of the cache (checked before any write).
// Returns the rotated q and k, [n, nh + nkv, d].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nh, int64_t nkv,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv: contiguous [n, heads, d] fp32");
  const int64_t n = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK(nh > 0 && nkv > 0 && qkv.size(1) == nh + 2 * nkv, "qkv holds ", qkv.size(1), " heads, not ", nh,
              " + 2 x ", nkv);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n * d,
                "cos/sin: contiguous fp32 holding [n, d]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == at::kFloat && k_cache.size(2) == nkv && k_cache.size(3) == d,
              "k_cache/v_cache: contiguous fp32 [blocks, block_size, kv_heads, d]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots: int64 [n]");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "slot ", sl[t], " is outside the cache (", capacity, " slots)");
  const int64_t heads = nh + 2 * nkv, rot = nh + nkv;
  auto out = at::empty({n, rot, d}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t row = nkv * d;
  constexpr int64_t ROWS = 32;  // tokens per shared item: prefill chunks split over the pool, decode stays here
  auto item = [&](int64_t it) {
    for (int64_t t = it * ROWS; t < std::min(n, (it + 1) * ROWS); ++t) {
      const float* xt = x + t * heads * d;
      float* ot = o + t * rot * d;
      for (int64_t h = 0; h < rot; ++h) rotate(xt + h * d, c + t * d, s + t * d, ot + h * d, d);
      std::memcpy(kc + sl[t] * row, ot + nh * d, row * sizeof(float));
      std::memcpy(vc + sl[t] * row, xt + rot * d, row * sizeof(float));
    }
  };
  const int64_t items = (n + ROWS - 1) / ROWS;
  if (items > 1) {
    pdc::share(items, item);
  } else {
    for (int64_t it = 0; it < items; ++it) item(it);
  }
  return out;
}

void bind_rope(pybind11::module_& m) {
  m.def("rope_write", &rope_write, "RoPE on q, k and the KV cache write, torch's bits", pybind11::arg("qkv"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("nh"), pybind11::arg("nkv"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"));
}
