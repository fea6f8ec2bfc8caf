// The work-sharing pool of pool.h. One call at a time; `state` packs the call's generation (high bits) with
// the number of helpers inside it (low 16 bits). An odd generation means the caller is writing the call's
// slot: helpers join only an even (announced) one, and the caller closes the slot (even -> odd) only when no
// helper is inside, so a helper never reads a half-written call.
#include "pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace pdc {
namespace {

constexpr int MAX_HELPERS = 15;
constexpr uint64_t INSIDE = 0xFFFF;
constexpr uint64_t GEN = 1ull << 16;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Pool {
  alignas(64) std::atomic<uint64_t> state{0};
  alignas(64) std::atomic<int64_t> next{0};
  // the call's slot: written by the caller before it announces the generation, read by helpers inside it
  alignas(64) ItemFn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0;
  int allowed = 0;  // helpers [0, allowed) may take items of this call
  alignas(64) std::atomic<int64_t> spin_ns{300000};
  std::atomic<int64_t> first_alone{16};  // calls alone after a first stall (set_backoff_calls)
  std::atomic<int> started{0};
  std::atomic<int> sleepers{0};
  std::mutex caller, sleep_mu, start_mu;
  std::condition_variable wake;
  std::atomic<int64_t> calls{0}, shared_calls{0}, items{0}, helper_items{0}, stalls{0};
  // Stall back-off, touched only by the caller holding `caller`: calls left to run alone, and the length of
  // the last back-off (doubled on each stall in a row, cleared by a clean shared call).
  int64_t alone_left = 0, alone_len = 0;
};

// A shared call stalled when the caller, done with its own items, waited longer than it worked and at least
// this long: a helper holding an item lost its core (another process, the event loop). On a loaded 2-core box
// that costs a scheduler time slice per call, more than sharing gains, so the next calls run on the caller
// alone (16 by default, then twice as many for each stall in a row, up to 16384 calls, about 400 batch-1
// steps) before sharing is tried again. A short first stretch: a served step's event loop takes a core for a
// moment once per step, and 128 calls alone (the first setting) cost a batch-16 server more than the stalls.
constexpr int64_t STALL_NS = 200000;
constexpr int64_t MAX_ALONE = 16384;

thread_local bool t_helper = false;

// Never freed: helpers are detached and outlive static destruction at exit. A forked child gets a fresh one
// (its helpers did not survive the fork).
std::atomic<Pool*> g_pool{new Pool};

void helper(Pool* p, int index) {
  t_helper = true;
  uint64_t seen = p->state.load(std::memory_order_acquire) / GEN;
  for (;;) {
    // Wait for the next call: spin (yielding, so an OpenMP worker or the event loop sharing this core runs
    // first), then sleep once the spin budget since the last call is spent.
    int64_t since = now_ns();
    for (int spins = 0; p->state.load(std::memory_order_acquire) / GEN == seen; ++spins) {
      _mm_pause();
      if (spins % 32 != 31) continue;
      sched_yield();
      if (now_ns() - since < p->spin_ns.load(std::memory_order_relaxed)) continue;
      std::unique_lock<std::mutex> lk(p->sleep_mu);
      p->sleepers.fetch_add(1);
      // seq_cst here and in share(): the announce and `sleepers` are a store-then-load pair on each side
      p->wake.wait(lk, [&] { return p->state.load() / GEN != seen; });
      p->sleepers.fetch_sub(1);
      since = now_ns();
    }
    // Join the call being announced (odd: its slot is still being written).
    uint64_t s = p->state.load(std::memory_order_acquire);
    for (int spins = 0;;) {
      if ((s / GEN) & 1) {
        _mm_pause();
        if (++spins % 64 == 0) sched_yield();
        s = p->state.load(std::memory_order_acquire);
      } else if (p->state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        break;
      }
    }
    seen = s / GEN;
    int64_t mine = 0;
    if (index < p->allowed) {
      for (int64_t i; (i = p->next.fetch_add(1, std::memory_order_relaxed)) < p->n; ++mine) p->fn(p->ctx, i);
    }
    p->helper_items.fetch_add(mine, std::memory_order_relaxed);
    p->state.fetch_sub(1, std::memory_order_acq_rel);  // release: this helper's outputs, then its leaving
  }
}

void ensure_helpers(Pool* p, int want) {
  if (p->started.load(std::memory_order_acquire) >= want) return;
  std::lock_guard<std::mutex> lk(p->start_mu);
  for (int i = p->started.load(); i < want; ++i) {
    std::thread(helper, p, i).detach();
    p->started.store(i + 1, std::memory_order_release);
  }
}

void after_fork_in_child() { g_pool.store(new Pool); }

const bool g_atfork = (pthread_atfork(nullptr, nullptr, after_fork_in_child), true);

}  // namespace

void share(int64_t n, ItemFn fn, void* ctx, int threads) {
  Pool* p = g_pool.load(std::memory_order_acquire);
  p->calls.fetch_add(1, std::memory_order_relaxed);
  p->items.fetch_add(n, std::memory_order_relaxed);
  const int helpers = std::min(MAX_HELPERS, (threads > 0 ? threads : at::get_num_threads()) - 1);
  std::unique_lock<std::mutex> lk(p->caller, std::try_to_lock);
  if (n < 2 || helpers <= 0 || !lk.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  if (p->alone_left > 0) {
    --p->alone_left;
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  p->shared_calls.fetch_add(1, std::memory_order_relaxed);
  ensure_helpers(p, helpers);
  const int64_t t0 = now_ns();
  // Close the slot: wait out a helper that joined the previous call after it ended, then make gen odd.
  for (uint64_t s = p->state.load(std::memory_order_acquire);;) {
    if (s & INSIDE) {
      _mm_pause();
      s = p->state.load(std::memory_order_acquire);
    } else if (p->state.compare_exchange_weak(s, s + GEN, std::memory_order_acq_rel)) {
      break;
    }
  }
  p->fn = fn;
  p->ctx = ctx;
  p->n = n;
  p->allowed = helpers;
  p->next.store(0, std::memory_order_relaxed);
  p->state.fetch_add(GEN);  // even again: announced (seq_cst, see the helper's wait)
  if (p->sleepers.load() > 0) {
    std::lock_guard<std::mutex> g(p->sleep_mu);
    p->wake.notify_all();
  }
  for (int64_t i; (i = p->next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(ctx, i);
  const int64_t t1 = now_ns();
  // Every item is claimed; wait for the helpers holding one (or joining late) to leave.
  for (int spins = 0; p->state.load(std::memory_order_acquire) & INSIDE; ++spins) {
    _mm_pause();
    if (spins % 64 == 63) sched_yield();
  }
  const int64_t waited = now_ns() - t1;
  if (waited > STALL_NS && waited > t1 - t0) {
    p->stalls.fetch_add(1, std::memory_order_relaxed);
    p->alone_len = p->alone_len ? std::min(2 * p->alone_len, MAX_ALONE) : p->first_alone.load();
    p->alone_left = p->alone_len;
  } else {
    p->alone_len = 0;
  }
}

bool on_helper_thread() { return t_helper; }

PoolStats stats() {
  Pool* p = g_pool.load();
  return {p->calls.load(), p->shared_calls.load(), p->items.load(), p->helper_items.load(), p->stalls.load(),
          p->started.load()};
}

void set_spin_us(int64_t us) { g_pool.load()->spin_ns.store(std::max<int64_t>(0, us) * 1000); }

void set_backoff_calls(int64_t calls) {
  g_pool.load()->first_alone.store(std::clamp<int64_t>(calls, 1, MAX_ALONE));
}

}  // namespace pdc
