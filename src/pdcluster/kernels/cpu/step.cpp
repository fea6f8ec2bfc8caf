// The decode step's native kernels as one Python module, so the linear and the attention kernels share one
// work-sharing pool (pool.h): two modules would each keep helpers spinning on the same two cores.
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

#include <atomic>
#include <chrono>
#include <thread>

void bind_linear(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_argmax(pybind11::module_& m);
void bind_norm(pybind11::module_& m);
void bind_rope(pybind11::module_& m);
void bind_decoder(pybind11::module_& m);
void bind_screen(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_linear(m);
  bind_attention(m);
  bind_argmax(m);
  bind_norm(m);
  bind_rope(m);
  bind_decoder(m);
  bind_screen(m);
  m.def("pool_stats", [] {
    const pdc::PoolStats s = pdc::stats();
    return pybind11::dict(pybind11::arg("calls") = s.calls, pybind11::arg("shared_calls") = s.shared_calls,
                          pybind11::arg("items") = s.items, pybind11::arg("helper_items") = s.helper_items,
                          pybind11::arg("stalls") = s.stalls, pybind11::arg("helpers") = s.helpers);
  }, "counters of the work-sharing pool: calls, calls shared, items, items run by helpers, stalls, helpers");
  // For tests: a shared call of n items, each taking caller_us microseconds on the calling thread and
  // helper_us on a helper (a helper that lost its core, on demand); returns how many items helpers ran.
  m.def("pool_probe", [](int64_t n, int64_t caller_us, int64_t helper_us) {
    std::atomic<int64_t> by_helpers{0};
    auto item = [&](int64_t) {
      const bool helper = pdc::on_helper_thread();
      if (helper) by_helpers.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(helper ? helper_us : caller_us));
    };
    pybind11::gil_scoped_release nogil;
    pdc::share(n, item);
    return by_helpers.load();
  });
  m.def("set_backoff_calls", &pdc::set_backoff_calls, "calls run on the caller alone after a first stall");
  m.def("set_spin_us", &pdc::set_spin_us, "how long a pool helper spins after a call before it sleeps");
}
