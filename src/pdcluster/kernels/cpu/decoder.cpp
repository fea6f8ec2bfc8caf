// A whole decode step of a dense Llama-style decoder in one native call: every layer's norm, fused QKV
// product, RoPE + cache write, paged attention, O product, norm, gate/up product, SiLU * up and down product,
// then the final norm.
//
// Why: these are the same kernels the Python modules call (linear.cpp, rope.cpp, attention.cpp, norm.cpp,
// and ATen's silu and mul), in the same order with the same arguments, so the bits are the same; what goes is
// the Python between them (module calls, views, checks, ~10 kernel calls a layer), about 1-2 ms of a
// 7-16 ms step on this CPU (docs/benchmarks/engine.md at 5f904a5, ninth pass). The plan holds the layers' weights and
// caches once, so a step passes only what changes: the hidden rows, RoPE rows, slots and block tables.
#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

// The kernels' own entry points (the other files of this module): called directly, checks included.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias,
                         bool prefetch, int64_t grain);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps);
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nh, int64_t nkv,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
                        c10::optional<at::Tensor> v_scale, at::Tensor block_tables, at::Tensor seq_lens, double scale,
                        int64_t window, double softcap, int64_t parallel_min);

namespace {

using Tensors = std::vector<at::Tensor>;
using MaybeTensors = std::vector<c10::optional<at::Tensor>>;

struct Layer {
  at::Tensor ln1, ln2, wqkv, wo, wgu, wdown, kc, vc;
  c10::optional<at::Tensor> bqkv, bo;
  double eps1, eps2;
  int64_t window;
};

class DecodePlan {
 public:
  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double scale, double softcap,
             const Tensors& ln1, const Tensors& ln2, const std::vector<double>& eps1, const std::vector<double>& eps2,
             const Tensors& wqkv, const MaybeTensors& bqkv, const Tensors& wo, const MaybeTensors& bo,
             const Tensors& wgu, const Tensors& wdown, const std::vector<int64_t>& windows, const Tensors& k_caches,
             const Tensors& v_caches, at::Tensor final_norm, double final_eps)
      : nh_(heads), nkv_(kv_heads), d_(head_dim), inter_(inter), scale_(scale), softcap_(softcap),
        final_norm_(std::move(final_norm)), final_eps_(final_eps) {
    const size_t n = ln1.size();
    for (size_t len : {ln2.size(), eps1.size(), eps2.size(), wqkv.size(), bqkv.size(), wo.size(), bo.size(),
                       wgu.size(), wdown.size(), windows.size(), k_caches.size(), v_caches.size()})
      TORCH_CHECK(len == n, "DecodePlan: every per-layer list must have ", n, " entries");
    TORCH_CHECK(n > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && inter > 0,
                "DecodePlan: bad shape arguments");
    hidden_ = final_norm_.numel();
    for (size_t i = 0; i < n; ++i)
      layers_.push_back(Layer{ln1[i], ln2[i], wqkv[i], wo[i], wgu[i], wdown[i], k_caches[i], v_caches[i], bqkv[i],
                              bo[i], eps1[i], eps2[i], windows[i]});
  }

  // x [n, hidden] fp32 (the embedded tokens), cos/sin [n, 1, d], slots int64 [n], block_tables int32
  // [n, max_blocks], seq_lens int32 [n]; grains: panels per shared item of the QKV, O, gate/up and down products
  // at this row count. Returns the final norm's output [n, hidden].
  at::Tensor forward(const at::Tensor& x0, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const std::vector<int64_t>& grains,
                     int64_t parallel_min) const {
    TORCH_CHECK(grains.size() == 4, "grains: one per product (qkv, o, gate_up, down)");
    TORCH_CHECK(x0.dim() == 2 && x0.size(1) == hidden_, "x: [n, ", hidden_, "]");
    const int64_t n = x0.size(0), q_size = nh_ * d_, n_qkv = q_size + 2 * nkv_ * d_;
    const c10::optional<at::Tensor> none;
    at::Tensor x = x0, delta;
    for (const Layer& l : layers_) {
      at::Tensor h;
      std::tie(x, h) = add_rms_norm(x, delta, l.ln1, l.eps1);  // no delta yet (undefined) before layer 0
      const at::Tensor qkv = packed_linear(h, l.wqkv, n_qkv, l.bqkv, true, grains[0]).view({n, nh_ + 2 * nkv_, d_});
      const at::Tensor qk = rope_write(qkv, cos, sin, nh_, nkv_, l.kc, l.vc, slots);
      const at::Tensor attn = paged_decode(qk.narrow(1, 0, nh_), l.kc, l.vc, none, none, block_tables, seq_lens,
                                           scale_, l.window, softcap_, parallel_min);
      const at::Tensor o = packed_linear(attn.view({n, q_size}), l.wo, hidden_, l.bo, true, grains[1]);
      std::tie(x, h) = add_rms_norm(x, o, l.ln2, l.eps2);
      const at::Tensor gu = packed_linear(h, l.wgu, 2 * inter_, none, true, grains[2]);
      const at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, inter_)), gu.narrow(1, inter_, inter_));
      delta = packed_linear(act, l.wdown, hidden_, none, true, grains[3]);
    }
    return std::get<1>(add_rms_norm(x, delta, final_norm_, final_eps_));
  }

 private:
  int64_t nh_, nkv_, d_, inter_, hidden_ = 0;
  double scale_, softcap_;
  at::Tensor final_norm_;
  double final_eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder(pybind11::module_& m) {
  pybind11::class_<DecodePlan>(m, "DecodePlan", "a dense decoder's decode step in one native call")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, double, const Tensors&, const Tensors&,
                          const std::vector<double>&, const std::vector<double>&, const Tensors&, const MaybeTensors&,
                          const Tensors&, const MaybeTensors&, const Tensors&, const Tensors&,
                          const std::vector<int64_t>&, const Tensors&, const Tensors&, at::Tensor, double>())
      .def("forward", &DecodePlan::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("slots"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("grains"),
           pybind11::arg("parallel_min"))
      // The same step with the GIL released for its duration: a server's event loop thread can then stream the
      // previous step's tokens while this one computes (one release a step; see fused_decode.py)
      .def("forward_released", &DecodePlan::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slots"),
           pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("grains"),
           pybind11::arg("parallel_min"));
}
