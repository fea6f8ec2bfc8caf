// The decode step's native kernels as one Python module, so the linear and the attention kernels share one
// work-sharing pool (pool.h): two modules would each keep helpers spinning on the same two cores.
#include <torch/csrc/utils/pybind.h>

#include "pool.h"

void bind_linear(pybind11::module_& m);
void bind_attention(pybind11::module_& m);
void bind_argmax(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_linear(m);
  bind_attention(m);
  bind_argmax(m);
  m.def("pool_stats", [] {
    const pdc::PoolStats s = pdc::stats();
    return pybind11::dict(pybind11::arg("calls") = s.calls, pybind11::arg("shared_calls") = s.shared_calls,
                          pybind11::arg("items") = s.items, pybind11::arg("helper_items") = s.helper_items,
                          pybind11::arg("helpers") = s.helpers);
  }, "counters of the work-sharing pool: calls, calls shared, items, items run by helpers, helpers started");
  m.def("set_spin_us", &pdc::set_spin_us, "how long a pool helper spins after a call before it sleeps");
}
