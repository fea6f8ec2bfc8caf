// A work-sharing pool for the decode step's kernels: the calling thread and a few helper threads claim the
// items of one call from a shared counter.
//
// Why not at::parallel_for: its fork/join wakes sleeping OpenMP threads for every product, which on the
// shared 2-core box cost 50-250 us per call (docs/benchmarks/engine.md at 5f904a5, fifth pass) - more than a batch-1
// projection takes on one thread. Here helpers spin for a short while after each call (a decode step is
// dozens of back-to-back calls), so the next call finds them awake, and the caller never waits for a helper
// that is not running: it claims every item nobody else has. A descheduled helper costs at most the item it
// holds, never the whole call. Items must be independent; which thread runs one must not change its result.
#pragma once

#include <cstdint>

namespace pdc {

using ItemFn = void (*)(void* ctx, int64_t item);

// Runs fn(ctx, i) for every i in [0, n) on the caller and up to `threads - 1` helpers (threads = torch's
// intra-op thread count when 0). Returns when all n have run. A concurrent second caller, or n < 2, runs
// everything on its own thread, and so do the calls after a stall (a helper that lost its core mid-item: see
// pool.cpp) until the back-off runs out.
void share(int64_t n, ItemFn fn, void* ctx, int threads = 0);

template <class F>
void share(int64_t n, F& body, int threads = 0) {
  share(n, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &body, threads);
}

struct PoolStats {
  int64_t calls, shared_calls, items, helper_items, stalls;
  int helpers;
};
bool on_helper_thread();  // whether the calling thread is one of the pool's helpers
PoolStats stats();
void set_spin_us(int64_t us);  // how long a helper spins after a call before it sleeps
// calls run on the caller alone after a first stall (1..16384; doubled for each stall in a row)
void set_backoff_calls(int64_t calls);

}  // namespace pdc
