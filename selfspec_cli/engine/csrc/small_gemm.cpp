// Small-row matrix products for CPU decoding: y = x W^T (+ b) for x of R rows, R small.
//
// Why: at batch 1 a decode step reads every weight once and does two FLOPs per weight
// element, so it is bound by memory bandwidth. A BLAS GEMV/GEMM for 1-16 rows leaves much
// of that bandwidth unused (it repacks the weight per call, or splits K across calls),
// and its cost grows almost linearly in R, which makes verifying a draft expensive.
//
// How: the weight is repacked once (pack()) into panels of 16 output rows stored k-major
// (K x 16 floats, one sequential stream per panel). A register tile of up to 6 rows x 16
// outputs (12 AVX2 accumulators) walks k, broadcasting one x element per row and FMA-ing
// it with the panel's 16 weights; the panel stays in L1/L2 while further row tiles reuse
// it, so DRAM is read once whatever R is and extra rows cost FMAs, not bytes. One or two
// rows (bandwidth-bound) take 4 or 2 panels at once to keep 8 FMA chains in flight;
// software prefetch runs PF_DIST k-steps ahead.
//
// Invariants (what the engine relies on):
//   * batch invariance: y[r, n] is bit-identical whatever R is and wherever row r sits
//     in x. Each output is one scalar FMA chain over k = 0..K-1 (its own vector lane),
//     with the bias added after; tiling over rows or panels never changes
//     that order, and threads split output blocks, never K. So the products of a
//     k-row verification forward equal those of k one-row decode steps bit for bit.
//   * weights are float32, bfloat16 or float16 (converted exactly to float32 in registers);
//     x, bias and y are float32; accumulation is float32 with FMA.
//   * no -ffast-math: the compiler may not reassociate the sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <cfloat>
#include <algorithm>
#include <vector>
#include <type_traits>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>


// ---- one persistent pool of threads for every product of a forward (issue 48; docs/engine.md, "Threads")
//
// Every parallel loop of this file (products by output panels, attention by (row, head), the row-wise
// small ops of a prefill) runs through par_for() on one process-wide pool of n - 1 workers plus the
// calling thread, created once by set_threads(n) and kept. A loop's index range is cut into one chunk
// a thread (pool_chunks); the loop is posted as one 64-bit word (generation 32 bits | chunks 16 | next chunk 16),
// and every thread, the caller too, claims chunks from it by compare-and-swap until none is left. The
// caller returns when every chunk is done (the barrier between a layer's steps): it waits for chunks,
// never for a thread, so a worker that another process keeps off its core simply claims nothing, and
// the loop costs one thread's time instead of a timeslice. DecoderStack::forward runs a whole forward
// so, without returning to Python.
// Waiting, as ggml's threadpool does: a worker that finds no loop spins with `pause` for `spin_us`,
// then yields its core (sched_yield) until `yield_us`, then parks on a condition variable; the next
// loop wakes it. So a busy core is handed back to another process within microseconds, and an idle
// process holds no core at all.
// Invariants: a chunk's outputs are computed by one thread with the same chain whatever thread that is,
// so every result is bit-identical at every thread count (tests/test_threads_pool.py); a chunk runs once
// (its claim is a CAS on the word that names its loop, and a loop's description is rewritten only after
// all its chunks are done); one loop runs at a time (a second caller, or a loop started inside a worker,
// runs serially on its own thread); after a fork() the child, which has no workers, rebuilds the pool.
namespace pool {

using Body = void (*)(const void* ctx, int64_t b, int64_t e);

constexpr uint64_t IDX_MASK = 0xFFFF;
inline uint32_t gen_of(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
inline uint64_t chunks_of(uint64_t w) { return (w >> 16) & IDX_MASK; }

struct Pool {
  std::vector<pthread_t> workers;
  int nth = 1;
  pid_t pid = 0;
  std::atomic<uint64_t> state{0};  // the posted loop: generation | chunks | next chunk to claim
  std::atomic<int64_t> done{0};  // chunks of the posted loop finished
  std::atomic<int> sleepers{0};
  std::atomic<bool> stop{false};
  Body body = nullptr;  // the posted loop's description: written before `state` names it, rewritten only
  const void* ctx = nullptr;  // after all its chunks are done
  int64_t begin = 0, end = 0, chunk = 1;
  std::mutex m;
  std::condition_variable cv;
  std::mutex busy;  // held by the one thread posting loops
  int64_t spin_us = 50, yield_us = 2000;
  uint64_t loops = 0;  // loops posted to workers (a counter for tests and profiles)
};

inline thread_local bool t_worker = false;
inline Pool* g_pool = nullptr;
inline std::mutex g_config;
inline std::atomic<bool> g_split_all{false};  // tests: every loop of two or more indices goes to the pool
inline std::atomic<int64_t> g_chunks_per_thread{1};  // chunks a loop is cut into, per thread

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void claim(Pool& p, uint32_t gen) {  // run chunks of loop `gen` until none is left
  uint64_t w = p.state.load(std::memory_order_acquire);
  for (;;) {
    if (gen_of(w) != gen || (w & IDX_MASK) >= chunks_of(w)) return;
    if (!p.state.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const int64_t b = p.begin + static_cast<int64_t>(w & IDX_MASK) * p.chunk;  // w: the word as claimed
    p.body(p.ctx, b, std::min(p.end, b + p.chunk));
    p.done.fetch_add(1, std::memory_order_acq_rel);
    w = p.state.load(std::memory_order_acquire);
  }
}

inline void* worker_main(void* arg) {
  Pool& p = *static_cast<Pool*>(arg);
  t_worker = true;
  uint32_t seen = gen_of(p.state.load());
  for (;;) {
    const int64_t t0 = now_us();
    for (uint64_t i = 1;; ++i) {
      if (gen_of(p.state.load(std::memory_order_acquire)) != seen || p.stop.load(std::memory_order_relaxed)) break;
      if (i % 64) { _mm_pause(); continue; }
      const int64_t idle = now_us() - t0;
      if (idle < p.spin_us) continue;
      if (idle < p.yield_us) { sched_yield(); continue; }
      std::unique_lock<std::mutex> lk(p.m);
      p.sleepers.fetch_add(1);
      p.cv.wait(lk, [&] { return gen_of(p.state.load()) != seen || p.stop.load(); });
      p.sleepers.fetch_sub(1);
      break;
    }
    if (p.stop.load()) return nullptr;
    seen = gen_of(p.state.load(std::memory_order_acquire));
    claim(p, seen);  // a loop already finished (this worker woke late) claims nothing
  }
}

inline void start_workers(Pool& p, int n) {
  p.nth = n;
  for (int i = 1; i < n; ++i) {
    pthread_t t;
    TORCH_CHECK(pthread_create(&t, nullptr, worker_main, &p) == 0, "selfspec pool: cannot start a thread");
    p.workers.push_back(t);
  }
}

inline void stop_workers(Pool& p) {
  {
    std::lock_guard<std::mutex> lk(p.m);
    p.stop.store(true);
  }
  p.cv.notify_all();
  for (pthread_t t : p.workers) pthread_join(t, nullptr);
  p.workers.clear();
  p.stop.store(false);
}

inline std::atomic<bool> g_forked{false};  // set in a forked child (pthread_atfork), read by get()
inline void on_fork_child() { g_forked.store(true); }

inline Pool& get() {  // the process's pool (a forked child's is rebuilt: its parent's workers are not its own)
  if (g_pool == nullptr || g_forked.load(std::memory_order_relaxed)) {
    static const bool registered = pthread_atfork(nullptr, nullptr, on_fork_child) == 0;
    (void)registered;
    std::lock_guard<std::mutex> lk(g_config);
    if (g_pool == nullptr || g_pool->pid != getpid()) {
      g_forked.store(false);
      Pool* old = g_pool;
      g_pool = new Pool();  // a forked child's old pool is left as it is (its mutexes may be held)
      g_pool->pid = getpid();
      if (old != nullptr) {
        g_pool->spin_us = old->spin_us;
        g_pool->yield_us = old->yield_us;
      }
      start_workers(*g_pool, old ? old->nth : 1);
    }
  }
  return *g_pool;
}

inline void post(Pool& p, Body body, const void* ctx, int64_t begin, int64_t end, int64_t per_thread) {
  const int64_t total = end - begin;
  // one chunk a thread by default: each chunk start costs a claim on a shared line and a cold prefetch stream
  // (SmolLM2's one-row forward at 2 threads: 4.6 ms with one chunk a thread, 4.8-4.9 with two, 5.2-5.3 with four);
  // a late thread's chunk is still claimed by whoever is free
  // (at most IDX_MASK chunks: the word holds the count in 16 bits; 1024 threads x 64 a thread would wrap it to 0)
  // (per_thread > 0: the caller's count, for loops whose indices cost unequal amounts: a causal prefill's rows)
  const int64_t per = std::min<int64_t>(
      p.nth * (per_thread > 0 ? per_thread : g_chunks_per_thread.load(std::memory_order_relaxed)), int64_t(IDX_MASK));
  const int64_t chunk = std::max<int64_t>(1, (total + per - 1) / per);
  const uint64_t chunks = static_cast<uint64_t>((total + chunk - 1) / chunk);
  p.body = body;
  p.ctx = ctx;
  p.begin = begin;
  p.end = end;
  p.chunk = chunk;
  p.done.store(0, std::memory_order_relaxed);
  ++p.loops;
  const uint32_t gen = gen_of(p.state.load()) + 1;
  p.state.store((uint64_t(gen) << 32) | (chunks << 16));  // seq_cst: pairs with a parking worker's sleepers
  if (p.sleepers.load() > 0) {
    { std::lock_guard<std::mutex> lk(p.m); }
    p.cv.notify_all();
  }
  claim(p, gen);
  const int64_t t0 = now_us();
  for (uint64_t i = 1; p.done.load(std::memory_order_acquire) != static_cast<int64_t>(chunks); ++i) {
    if (i % 64) { _mm_pause(); continue; }
    if (now_us() - t0 >= p.spin_us) sched_yield();  // a worker was preempted inside a chunk: let it run
  }
}

}  // namespace pool

// f(b, e) over [begin, end) in chunks of at least `grain` (chunks_per_thread > 0: about that many chunks a thread,
// instead of the pool's setting), on the pool (serially where it has one thread, the
// range is one grain, or the caller is a worker or another thread holds the pool). Returns when all are done.
template <typename F>
void par_for(int64_t begin, int64_t end, int64_t grain, const F& f, int64_t chunks_per_thread = 0) {
  if (end <= begin) return;
  grain = pool::g_split_all.load(std::memory_order_relaxed) ? 1 : std::max<int64_t>(1, grain);
  if (pool::t_worker || end - begin <= grain) { f(begin, end); return; }
  pool::Pool& p = pool::get();
  if (p.nth <= 1) { f(begin, end); return; }
  std::unique_lock<std::mutex> lk(p.busy, std::try_to_lock);
  if (!lk.owns_lock()) { f(begin, end); return; }
  pool::post(p, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &f, begin, end,
             chunks_per_thread);
}

// The pool's size: n threads in all (the caller and n - 1 workers); 1 runs every loop on the caller.
void set_threads(int64_t n, int64_t spin_us, int64_t yield_us) {
  TORCH_CHECK(n >= 1 && n <= 1024, "set_threads: n must be in 1..1024, got ", n);
  pool::Pool& p = pool::get();
  std::lock_guard<std::mutex> busy(p.busy);
  if (spin_us >= 0) p.spin_us = spin_us;
  if (yield_us >= 0) p.yield_us = std::max(yield_us, p.spin_us);
  if (p.nth == n) return;
  pool::stop_workers(p);
  pool::start_workers(p, static_cast<int>(n));
}

int64_t get_threads() { return pool::get().nth; }
void pool_split_all(bool on) { pool::g_split_all.store(on); }
void pool_chunks(int64_t per_thread) {
  TORCH_CHECK(per_thread >= 1 && per_thread <= 64, "pool_chunks: 1..64 chunks a thread, got ", per_thread);
  pool::g_chunks_per_thread.store(per_thread);
}
int64_t pool_loops() { return static_cast<int64_t>(pool::get().loops); }

namespace {

constexpr int64_t PW = 16;  // outputs per panel (two AVX2 vectors)
#ifndef PF_DIST
#define PF_DIST 32  // k-steps (of 64 bytes in float32) between a prefetch and its use; 16-bit panels go
                    // the same 2 KB ahead (twice the k-steps: 4-row bf16 steps 29.6-30.4 -> 25.6-25.8 ms)
#endif

inline void load_w(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
inline void load_w(const uint16_t* p, __m256& a, __m256& b) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
  b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

struct Half { uint16_t bits; };  // an IEEE float16 weight (a float16 checkpoint's own values)

// bfloat16 panels of an even K are packed as k-pairs: dword o of a pair holds output o's weight at k in
// its low half and at k + 1 in its high half, so one shift and one mask widen both exactly (a bf16 is a
// float32's high half) with no cross-lane conversion: the same values, fewer instructions a byte.
struct BF16x2 { uint16_t bits; };
inline void load_w2(const BF16x2* p, __m256& a0, __m256& a1, __m256& b0, __m256& b1) {  // outputs 0-7 (a), 8-15 (b)
  const __m256i hi = _mm256_set1_epi32(int(0xFFFF0000u));
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + 1);
  a0 = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));  // k
  a1 = _mm256_castsi256_ps(_mm256_and_si256(u, hi));   // k + 1
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
}
inline void load_w(const Half* p, __m256& a, __m256& b) {
  a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// R rows of x against P consecutive panels (16 P outputs starting at panel p0).
// acc[r][j] lane i accumulates output (p0*16 + 8j + i) of row r as one FMA chain over k.
template <int R, int P, typename W>
inline void tile(const W* panels, int64_t k_n, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                 int64_t n_valid, const float* bias) {
  __m256 acc[R][2 * P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t pstride = k_n * PW;
  constexpr int64_t PF_AHEAD = PF_DIST * int64_t(sizeof(float)) / int64_t(sizeof(W));  // the same bytes ahead
  if constexpr (std::is_same_v<W, BF16x2>) {
    for (int64_t k = 0; k < k_n; k += 2) {  // a k-pair: k's products, then k + 1's, into each chain
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panels + p * pstride + (k + PF_AHEAD) * PW), _MM_HINT_T0);
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {  // one panel's four vectors at a time: 16 ymm hold the rest
        __m256 a0, a1, b0, b1;
        load_w2(panels + p * pstride + k * PW, a0, a1, b0, b1);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k), xb = _mm256_broadcast_ss(x + r * ldx + k + 1);
          acc[r][2 * p] = _mm256_fmadd_ps(a1, xb, _mm256_fmadd_ps(a0, xa, acc[r][2 * p]));
          acc[r][2 * p + 1] = _mm256_fmadd_ps(b1, xb, _mm256_fmadd_ps(b0, xa, acc[r][2 * p + 1]));
        }
      }
    }
  } else
  for (int64_t k = 0; k < k_n; ++k) {
    // software prefetch PF_DIST k-steps ahead: the hardware prefetcher alone keeps too few
    // misses in flight once a few rows' FMAs slow the consumer (measured: 15 vs 28 GB/s at R=4)
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(panels + p * pstride + (k + PF_AHEAD) * PW), _MM_HINT_T0);
    __m256 wv[2 * P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) load_w(panels + p * pstride + k * PW, wv[2 * p], wv[2 * p + 1]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < 2 * P; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xb, acc[r][j]);
    }
  }
  alignas(32) float buf[2 * P * 8];
  // fully unrolled, like the loops above: a runtime index into acc would keep it in memory
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < 2 * P; ++j) _mm256_store_ps(buf + 8 * j, acc[r][j]);
    float* out = y + r * ldy + n0;
    if (bias != nullptr)
      for (int64_t i = 0; i < n_valid; ++i) out[i] = buf[i] + bias[n0 + i];
    else
      std::memcpy(out, buf, sizeof(float) * n_valid);
  }
}

// The same tile with one zmm per panel (16 outputs): lane i of acc[r][p] is output (p0 + p) * 16 + i of row r,
// the same FMA chain over k as the AVX2 tile's lane (so the two paths agree bit for bit), with half the
// instructions per weight: a 16-bit panel's k-step is one widening load and one FMA per panel.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_w512(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_w512(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_w512(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int R, int P, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void tile512(const W* panels, int64_t k_n, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n0,
             int64_t n_valid, const float* bias) {
  __m512 acc[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pstride = k_n * PW;
  constexpr int64_t PF_AHEAD = PF_DIST * int64_t(sizeof(float)) / int64_t(sizeof(W));
  if constexpr (std::is_same_v<W, BF16x2>) {
    const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
    for (int64_t k = 0; k < k_n; k += 2) {
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(panels + p * pstride + (k + PF_AHEAD) * PW), _MM_HINT_T0);
      __m512 w0[P], w1[P];
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const __m512i u = _mm512_loadu_si512(panels + p * pstride + k * PW);
        w0[p] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
        w1[p] = _mm512_castsi512_ps(_mm512_and_si512(u, hi));
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xa = _mm512_set1_ps(x[r * ldx + k]), xb = _mm512_set1_ps(x[r * ldx + k + 1]);
#pragma GCC unroll 16
        for (int j = 0; j < P; ++j) acc[r][j] = _mm512_fmadd_ps(w1[j], xb, _mm512_fmadd_ps(w0[j], xa, acc[r][j]));
      }
    }
  } else
  for (int64_t k = 0; k < k_n; ++k) {
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(panels + p * pstride + (k + PF_AHEAD) * PW), _MM_HINT_T0);
    __m512 wv[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) wv[p] = load_w512(panels + p * pstride + k * PW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 16
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xb, acc[r][j]);
    }
  }
  alignas(64) float buf[P * 16];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j) _mm512_store_ps(buf + 16 * j, acc[r][j]);
    float* out = y + r * ldy + n0;
    if (bias != nullptr)
      for (int64_t i = 0; i < n_valid; ++i) out[i] = buf[i] + bias[n0 + i];
    else
      std::memcpy(out, buf, sizeof(float) * n_valid);
  }
}

// Rows [0, rows) against panels [p0, p0 + P): row tiles of up to 6 (AVX2: 12 ymm accumulators; AVX-512: 6 P
// zmm), balanced (8 rows -> 4 + 4, not 6 + 2: a short tile has too few FMA chains).
template <bool AVX512, int P, typename W>
inline void panel_group(const W* panels, int64_t k_n, const float* x, int64_t rows, float* y, int64_t n, int64_t n0,
                        const float* bias) {
  const int64_t n_valid = std::min<int64_t>(P * PW, n - n0);
  const int64_t ldx = k_n;
  const int64_t tiles = (rows + 5) / 6;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t size = (rows - r) / (tiles - t);
    const float* xt = x + r * ldx;
    float* yt = y + r * n;
#define TL(RR) if constexpr (AVX512) tile512<RR, P, W>(panels, k_n, xt, ldx, yt, n, n0, n_valid, bias); \
               else tile<RR, P, W>(panels, k_n, xt, ldx, yt, n, n0, n_valid, bias)
    switch (size) {
      case 6: TL(6); break; case 5: TL(5); break; case 4: TL(4); break;
      case 3: TL(3); break; case 2: TL(2); break; default: TL(1); break;
    }
#undef TL
    r += size;
  }
}

bool cpu_has_avx512();

// One or two rows are bandwidth-bound: 4 or 2 panels at once keep 8 FMA chains in flight. More rows are
// FMA-bound: one panel (AVX2: 12 accumulators for 6 rows) or two (AVX-512: 2 R chains) re-read from L1/L2
// per row tile. Threads split panel groups, never k.
template <bool AVX512, typename W>
void run_on(const W* packed, int64_t n, int64_t k_n, const float* x, int64_t rows, const float* bias, float* out) {
  const int64_t panels = (n + PW - 1) / PW;
  const int64_t pstride = k_n * PW;
  const int64_t group = rows == 1 ? 4 : rows == 2 ? 2 : AVX512 ? 2 : 1;
  const int64_t groups = (panels + group - 1) / group;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (group * pstride * int64_t(sizeof(W))));
  par_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t p = g * group;
      const int64_t p_end = std::min(panels, p + group);
      if (p_end - p == 4) {
        panel_group<AVX512, 4, W>(packed + p * pstride, k_n, x, rows, out, n, p * PW, bias);
      } else if (p_end - p == 2) {
        panel_group<AVX512, 2, W>(packed + p * pstride, k_n, x, rows, out, n, p * PW, bias);
      } else {
        for (; p < p_end; ++p) panel_group<AVX512, 1, W>(packed + p * pstride, k_n, x, rows, out, n, p * PW, bias);
      }
    }
  });
}

template <typename W>
void run(const W* packed, int64_t n, int64_t k_n, const float* x, int64_t rows, const float* bias, float* out,
         bool avx512) {
  if (avx512) run_on<true, W>(packed, n, k_n, x, rows, bias, out);
  else run_on<false, W>(packed, n, k_n, x, rows, bias, out);
}

}  // namespace

// (N, K) float32, bfloat16 or float16 -> packed panels (ceil(N/16), K, 16), zero-padded rows, same dtype;
// bfloat16 of an even K as k-pairs (ceil(N/16), K/2, 32): [p, j, 2 o + t] = W[16 p + o, 2 j + t] (BF16x2).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: weight must be 2-D");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16 ||
              w.scalar_type() == torch::kHalf, "pack: weight must be float32, bfloat16 or float16");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t np = (n + PW - 1) / PW;
  auto padded = torch::zeros({np * PW, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  if (w.scalar_type() == torch::kBFloat16 && k % 2 == 0)  // (np, 16, K/2, 2) -> (np, K/2, 16, 2)
    return padded.view({np, PW, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({np, k / 2, 2 * PW});
  // (np, 16, K) -> (np, K, 16)
  return padded.view({np, PW, k}).transpose(1, 2).contiguous();
}

// x (R, K) float32; packed from pack(); bias (N,) or None; isa "auto" (AVX-512 where the CPU has it), "avx2"
// or "avx512" (the two give the same bits: tests/test_kernels.py); returns (R, N) float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                     std::string isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear: x must be 2-D float32");
  const bool pairs = packed.dim() == 3 && packed.scalar_type() == torch::kBFloat16 && packed.size(2) == 2 * PW;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == PW || pairs), "linear: packed weight expected");
  const int64_t rows = x.size(0), k = x.size(1), packed_k = pairs ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(k == packed_k, "linear: x has ", k, " columns, weight packed for ", packed_k);
  TORCH_CHECK(packed.size(0) * PW >= n && packed.size(0) * PW - n < PW, "linear: bad output size");
  torch::Tensor xc = x.contiguous();
  auto out = torch::empty({rows, n}, x.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == n, "linear: bias has ", bc.numel(), " elements, expected ", n);
    b = bc.data_ptr<float>();
  }
  TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "avx512", "linear: isa must be auto, avx2 or avx512");
  const bool avx512 = isa == "avx512" || (isa == "auto" && cpu_has_avx512());
  TORCH_CHECK(isa != "avx512" || cpu_has_avx512(), "linear: this CPU has no AVX-512");
  if (rows == 0) return out;
  if (packed.scalar_type() == torch::kFloat32)
    run<float>(packed.data_ptr<float>(), n, k, xc.data_ptr<float>(), rows, b, out.data_ptr<float>(), avx512);
  else if (packed.scalar_type() == torch::kHalf)
    run<Half>(reinterpret_cast<const Half*>(packed.data_ptr<at::Half>()), n, k, xc.data_ptr<float>(), rows, b,
              out.data_ptr<float>(), avx512);
  else if (pairs)
    run<BF16x2>(reinterpret_cast<const BF16x2*>(packed.data_ptr<at::BFloat16>()), n, k, xc.data_ptr<float>(), rows,
                b, out.data_ptr<float>(), avx512);
  else
    run<uint16_t>(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), n, k, xc.data_ptr<float>(), rows,
                  b, out.data_ptr<float>(), avx512);
  return out;
}

// RMSNorm of float32 rows: y = (x * rsqrt(mean(x^2) + eps)) * w, as Llama's RMSNorm orders it.
// One call per norm instead of aten's five-op path (about 40 us a call at one row here,
// 2.5 ms of a 28 ms step). Row-wise, so batch-invariant like linear().
// rms_norm's rows (R, h) x -> y, y == x allowed (each row's sum is taken before it is written).
void rms_norm_rows(const float* xp, const float* wp, float* yp, int64_t rows, int64_t h, double eps) {
  par_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, h)), [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = xp + r * h;
    float* yr = yp + r * h;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
      __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < h; ++i) ss += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(ss / float(h) + float(eps));
    const __m256 sv = _mm256_set1_ps(scale);
    i = 0;
    for (; i + 8 <= h; i += 8)
      _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), sv), _mm256_loadu_ps(wp + i)));
    for (; i < h; ++i) yr[i] = (xr[i] * scale) * wp[i];
  }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "rms_norm: x must be 2-D float32");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == torch::kFloat32 && w.size(0) == x.size(1), "rms_norm: bad weight");
  torch::Tensor xc = x.contiguous(), wc = w.contiguous();
  auto y = torch::empty_like(xc);
  rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), xc.size(0), xc.size(1), eps);
  return y;
}

// ---- the small ops around the products (issue 12: at one row they cost more than their arithmetic)
//
// exp for float32 lanes: Cephes' polynomial (as in avx_mathfun), relative error about 1e-7 over
// [-88, 88]; arguments are clamped to that range.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp256(_mm256_set1_ps(v)));
  return lanes[0];
}

// Sums of 8 vectors, one per lane: lane i of the result = the sum of a[i]'s lanes, always in the
// order ((0+1)+(2+3))+((4+5)+(6+7)) whatever lane a key lands in.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Heads q[0..G) of one row of attend(), all reading the same keys and values (one GQA group), head size 8 * DV:
// scores, probabilities, weighted values. Keys and values are walked in blocks that every head of the group
// reads in turn, so a block comes from L2 once and from L1 for the other heads (the group's heads used to walk
// the whole cache each: L2 bandwidth bound). Each head's arithmetic is the one-head chain, in the same order,
// whatever G: its dot products, its maximum, its normalizer summed in key order, its FMA chain over the values.
constexpr int ATT_MAX_G = 16;  // heads walked together (more in a group: several walks)
constexpr int64_t ATT_BLOCK = 64;  // keys a values block holds (16 KB of float32 rows at head size 64)

template <int DV>
inline void attend_heads(const float* const* q, int G, const float* kb, int64_t ks1, const float* vb, int64_t vs1,
                         const float* mrow, int64_t limit, float scale, float* const* s, float* const* o, int64_t n1,
                         int64_t off) {
  // logical key j is cached slot j for j < n1, else slot j + off (a draft's sinks + recent window);
  // n1 = limit, off = 0: every key in order, the target's attention
  const float skip_below = -1e30f;
  const __m256 scalev = _mm256_set1_ps(scale), skipv = _mm256_set1_ps(skip_below), ninf = _mm256_set1_ps(-INFINITY);
  __m256 mxv[ATT_MAX_G];
  float mx[ATT_MAX_G];
  for (int hh = 0; hh < G; ++hh) { mxv[hh] = ninf; mx[hh] = -INFINITY; }
  // scores, 8 keys at a time; a short last group repeats its last key (and drops the extras),
  // so every key's dot product is computed the same way whatever the number of keys
  for (int64_t j0 = 0; j0 < limit; j0 += 8) {
    const float* kr[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      int64_t jj = std::min<int64_t>(j0 + u, limit - 1);
      jj += jj < n1 ? 0 : off;
      kr[u] = kb + jj * ks1;
    }
    const bool full = j0 + 8 <= limit && (mrow == nullptr || j0 + 8 <= n1);
    for (int hh = 0; hh < G; ++hh) {
      const float* qh = q[hh];
      float* sh = s[hh];
      __m256 qv[DV];
#pragma GCC unroll 32
      for (int i = 0; i < DV; ++i) qv[i] = _mm256_loadu_ps(qh + 8 * i);
      __m256 acc[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr[u]));
#pragma GCC unroll 32
        for (int i = 1; i < DV; ++i) a = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(kr[u] + 8 * i), a);
        acc[u] = a;
      }
      const __m256 dv = hsum8(acc);
      if (full) {  // eight keys in a row: vector scale, mask, max
        __m256 sv = _mm256_mul_ps(dv, scalev);
        if (mrow) {
          const __m256 add = _mm256_loadu_ps(mrow + j0);
          sv = _mm256_blendv_ps(_mm256_add_ps(sv, add), ninf, _mm256_cmp_ps(add, skipv, _CMP_LT_OQ));
        } else {
          sv = _mm256_add_ps(sv, _mm256_setzero_ps());  // the scalar path's `+ 0.0f` (-0 becomes +0)
        }
        _mm256_storeu_ps(sh + j0, sv);
        mxv[hh] = _mm256_max_ps(sv, mxv[hh]);  // a NaN score is passed over, as std::max(mx, s) does
        continue;
      }
      alignas(32) float dots[8];
      _mm256_store_ps(dots, dv);
      const int64_t n = std::min<int64_t>(8, limit - j0);
      for (int64_t u = 0; u < n; ++u) {
        const int64_t jm = j0 + u;
        const float add = mrow ? mrow[jm < n1 ? jm : jm + off] : 0.0f;
        sh[j0 + u] = add < skip_below ? -INFINITY : dots[u] * scale + add;
        mx[hh] = std::max(mx[hh], sh[j0 + u]);
      }
    }
  }
  // probabilities (skipped keys: exactly 0)
  for (int hh = 0; hh < G; ++hh) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mxv[hh]);
    for (float m : lanes) mx[hh] = std::max(mx[hh], m);  // the maximum is exact, whatever the order
    float* sh = s[hh];
    const __m256 mx8 = _mm256_set1_ps(mx[hh]);
    int64_t j = 0;
    for (; j + 8 <= limit; j += 8) {
      const __m256 sv = _mm256_loadu_ps(sh + j);
      _mm256_storeu_ps(sh + j, _mm256_and_ps(exp256(_mm256_sub_ps(sv, mx8)), _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ)));
    }
    for (; j < limit; ++j) sh[j] = sh[j] == -INFINITY ? 0.0f : exp1(sh[j] - mx[hh]);
  }
  // weighted values, a block of keys at a time for every head; each head's one scalar normalizer is summed in
  // key order beside its FMA chain; its accumulators wait in `o` between blocks
  float sum[ATT_MAX_G];
  for (int hh = 0; hh < G; ++hh) {
    sum[hh] = 0.0f;
#pragma GCC unroll 32
    for (int i = 0; i < DV; ++i) _mm256_storeu_ps(o[hh] + 8 * i, _mm256_setzero_ps());
  }
  for (int64_t b0 = 0; b0 < limit; b0 += ATT_BLOCK) {
    const int64_t b1 = std::min(limit, b0 + ATT_BLOCK);
    for (int hh = 0; hh < G; ++hh) {
      const float* sh = s[hh];
      float* oh = o[hh];
      __m256 acc[DV];
#pragma GCC unroll 32
      for (int i = 0; i < DV; ++i) acc[i] = _mm256_loadu_ps(oh + 8 * i);
      float sm = sum[hh];
      for (int64_t j = b0; j < b1; ++j) {
        sm += sh[j];
        if (sh[j] == 0.0f) continue;
        const __m256 pv = _mm256_set1_ps(sh[j]);
        const float* vr = vb + (j < n1 ? j : j + off) * vs1;
#pragma GCC unroll 32
        for (int i = 0; i < DV; ++i) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * i), acc[i]);
      }
      sum[hh] = sm;
#pragma GCC unroll 32
      for (int i = 0; i < DV; ++i) _mm256_storeu_ps(oh + 8 * i, acc[i]);
    }
  }
  for (int hh = 0; hh < G; ++hh) {
    const __m256 inv = _mm256_set1_ps(1.0f / sum[hh]);
#pragma GCC unroll 32
    for (int i = 0; i < DV; ++i) _mm256_storeu_ps(o[hh] + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(o[hh] + 8 * i), inv));
  }
}

// Attention of T query rows over a layer's cached keys/values, float32, GQA, head size 16, 32, 64, 128 or 256.
// sinks, window (window 0: off): a row whose allowed keys number more than sinks + window attends only to
// the first `sinks` of them and the newest `window` (a draft's cheap view of a long context, as in
// StreamingLLM / MagicDec; the target never uses it).
// q row t, head h: qkv[t, h*D : (h+1)*D]; keys/values: k[g, j, :] for j < n_keys, g = h / (Hq/Hkv).
// mask: (T, n_keys) additive (0 or a huge negative: the key is skipped), or None: causal, row t sees
// keys j <= past + t. Invariant: a row's result depends only on its own query, its allowed keys
// and their order (skipped keys add nothing, every dot product is reduced the same way, sums run
// over j in order with one scalar normalizer), so a row of a k-row verification equals the same
// row decoded alone, bit for bit.
// attend() on raw pointers: q row t at qp + t ldq (heads side by side), keys/values of group g, key j at
// kp + g ks0 + j ks1 (vp likewise), mask mp (T, n_keys) or null, out op (T, hq d) contiguous.
void attend_rows(const float* qp, int64_t ldq, int64_t t_n, int64_t hq, int64_t hkv, int64_t d, const float* kp,
                 int64_t ks0, int64_t ks1, const float* vp, int64_t vs0, int64_t vs1, int64_t n_keys, const float* mp,
                 int64_t past, int64_t sinks, int64_t window, float* op) {
  const int64_t group = hq / hkv;
  const float scale = 1.0f / std::sqrt(float(d));
  const int64_t grain = std::max<int64_t>(1, 512 / std::max<int64_t>(1, n_keys));  // posted from ~60 keys a head
  par_for(0, t_n * hq, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(std::min<int64_t>(end - begin, ATT_MAX_G) * (n_keys + 8));
    const float* qs[ATT_MAX_G];
    float* ss[ATT_MAX_G];
    float* os[ATT_MAX_G];
    for (int64_t idx = begin; idx < end;) {  // a run of this chunk's heads of one row and one GQA group at a time
      const int64_t t = idx / hq, h = idx % hq, g = h / group;
      const int G = static_cast<int>(std::min<int64_t>({end - idx, (g + 1) * group - h, int64_t(ATT_MAX_G)}));
      int64_t limit = mp ? n_keys : std::min<int64_t>(n_keys, past + t + 1);
      const float* mrow = mp ? mp + t * n_keys : nullptr;
      int64_t n1 = limit, off = 0;
      if (window > 0 && limit > sinks + window) {  // a draft's StreamingLLM-style view: sinks + the newest keys
        n1 = sinks;
        off = limit - window - sinks;
        limit = sinks + window;
      }
      for (int hh = 0; hh < G; ++hh) {
        qs[hh] = qp + t * ldq + (h + hh) * d;
        os[hh] = op + t * hq * d + (h + hh) * d;
        ss[hh] = sbuf.data() + hh * (n_keys + 8);
      }
      const float* kg = kp + g * ks0;
      const float* vg = vp + g * vs0;
      switch (d) {
        case 16: attend_heads<2>(qs, G, kg, ks1, vg, vs1, mrow, limit, scale, ss, os, n1, off); break;
        case 32: attend_heads<4>(qs, G, kg, ks1, vg, vs1, mrow, limit, scale, ss, os, n1, off); break;
        case 64: attend_heads<8>(qs, G, kg, ks1, vg, vs1, mrow, limit, scale, ss, os, n1, off); break;
        case 128: attend_heads<16>(qs, G, kg, ks1, vg, vs1, mrow, limit, scale, ss, os, n1, off); break;
        default: attend_heads<32>(qs, G, kg, ks1, vg, vs1, mrow, limit, scale, ss, os, n1, off); break;
      }
      idx += G;
    }
  }, t_n > 16 ? 8 : 0);  // a causal prefill's rows attend to 1 to n keys: 8 chunks a thread, claimed by whoever is free
}

torch::Tensor attend(torch::Tensor qkv, int64_t hq, torch::Tensor k, torch::Tensor v, int64_t n_keys,
                     c10::optional<torch::Tensor> mask, int64_t past, int64_t sinks, int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1, "attend: bad q");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "attend: k/v must be (Hkv, S, D) float32");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.size(1) >= n_keys && v.size(1) >= n_keys, "attend: bad k/v");
  const int64_t t_n = qkv.size(0), hkv = k.size(0), d = k.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256, "attend: head size ", d,
              " (16, 32, 64, 128 or 256 supported)");
  TORCH_CHECK(hq % hkv == 0 && qkv.size(1) >= hq * d, "attend: bad head counts");
  torch::Tensor mc;
  const float* mp = nullptr;
  if (mask.has_value() && mask->defined()) {
    mc = mask->contiguous();
    TORCH_CHECK(mc.scalar_type() == torch::kFloat32 && mc.dim() == 2 && mc.size(0) == t_n && mc.size(1) == n_keys,
                "attend: mask must be (T, n_keys) float32");
    mp = mc.data_ptr<float>();
  }
  auto out = torch::empty({t_n, hq * d}, qkv.options());
  attend_rows(qkv.data_ptr<float>(), qkv.stride(0), t_n, hq, hkv, d, k.data_ptr<float>(), k.stride(0), k.stride(1),
              v.data_ptr<float>(), v.stride(0), v.stride(1), n_keys, mp, past, sinks, window, out.data_ptr<float>());
  return out;
}

// Rotary embedding in place on the first `heads` heads of each row of x (T, >= heads*D):
// x = x * cos + flip_halves(x) * sin_signed (sin_signed = [-sin1, sin2]), cos/sin (T, D).
// rope_'s rows: x (T, >= heads*d, row stride ld) in place, cos/sin (T, d) contiguous.
void rope_rows(float* xp, int64_t ld, int64_t t_n, int64_t heads, int64_t d, const float* cp, const float* sp) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < t_n; ++t) {
    const float* c = cp + t * d;
    const float* sn = sp + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* r = xp + t * ld + h * d;
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 a = _mm256_loadu_ps(r + i), b = _mm256_loadu_ps(r + half + i);
        const __m256 na = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(b, _mm256_loadu_ps(sn + i)));
        const __m256 nb = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(sn + half + i)));
        _mm256_storeu_ps(r + i, na);
        _mm256_storeu_ps(r + half + i, nb);
      }
    }
  }
}

void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "rope_: bad x");
  const int64_t t_n = x.size(0), d = cos.size(1), half = d / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == t_n && x.size(1) >= heads * d && half % 8 == 0,
              "rope_: bad shapes");
  torch::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  rope_rows(x.data_ptr<float>(), x.stride(0), t_n, heads, d, cc.data_ptr<float>(), sc.data_ptr<float>());
}

// Each row's argmax, as torch.argmax gives it (the first of equal maxima; the first NaN where a row holds one):
// eight lanes of running maxima and their indices, then the lanes' best, ties to the smallest index. A greedy
// step's pick over 49,152 logits takes about 43 us in aten and opens an OpenMP region for k rows; this is one
// pass at the bandwidth of L2.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 && x.size(1) > 0 &&
                  x.size(1) < (int64_t(1) << 31), "argmax_rows: x must be (R, N) float32 with unit column stride");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, torch::dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const float* base = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = base + r * ld;
    int64_t i = 0, arg = 0;
    float m = p[0];
    __m256 bad = _mm256_setzero_ps();
    if (n >= 8) {
      __m256 best = _mm256_loadu_ps(p);
      __m256i bidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bidx;
      const __m256i eight = _mm256_set1_epi32(8);
      bad = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
      for (i = 8; i + 8 <= n; i += 8) {
        idx = _mm256_add_epi32(idx, eight);
        const __m256 v = _mm256_loadu_ps(p + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly greater: a lane keeps its first maximum
        best = _mm256_blendv_ps(best, v, gt);
        bidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bidx), _mm256_castsi256_ps(idx), gt));
      }
      alignas(32) float bv[8];
      alignas(32) int32_t bi[8];
      _mm256_store_ps(bv, best);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bi), bidx);
      m = bv[0];
      arg = bi[0];
      for (int l = 1; l < 8; ++l)
        if (bv[l] > m || (bv[l] == m && bi[l] < arg)) { m = bv[l]; arg = bi[l]; }
    } else {
      i = 1;
    }
    bool nan = _mm256_movemask_ps(bad) != 0;
    for (int64_t j = i; j < n && !nan; ++j) nan = std::isnan(p[j]);
    if (nan) {  // torch's rule: a NaN is the maximum, the first one wins
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(p[j])) { arg = j; break; }
    } else {
      if (n < 8 && std::isnan(m)) arg = 0;
      for (; i < n; ++i)
        if (p[i] > m) { m = p[i]; arg = i; }
    }
    op[r] = arg;
  }
  return out;
}

// SwiGLU's product: gu (T, 2I) = [gate | up] -> silu(gate) * up, (T, I).
// silu_mul's rows: gp (T, 2n) -> yp (T, n).
void silu_mul_rows(const float* gp, float* yp, int64_t t_n, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  par_for(0, t_n, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, n)), [&](int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* a = gp + t * 2 * n;
    const float* u = a + n;
    float* o = yp + t * n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(a + i);
      const __m256 sg = _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) o[i] = (a[i] / (1.0f + exp1(-a[i]))) * u[i];
  }
  });
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat32 && gu.size(1) % 2 == 0, "silu_mul: bad input");
  torch::Tensor g = gu.contiguous();
  const int64_t t_n = g.size(0), n = g.size(1) / 2;
  auto y = torch::empty({t_n, n}, g.options());
  silu_mul_rows(g.data_ptr<float>(), y.data_ptr<float>(), t_n, n);
  return y;
}


// ---- quantized weight panels: the self-draft's low-precision copy (issue 22; docs/engine.md)
//
// A quantized matrix W (N, K) is stored as integer codes with one scale (and, for 4-bit, one
// minimum) per group of `gs` consecutive weights along K (gs = K: one scale per output channel):
//     W[n, k] = s[n, g] * q[n, k] (+ m[n, g]),  g = k / gs   (Q4_0: q - 8 for q).
// Formats: 8-bit signed codes, with or without minimums (int8 per channel or per group; GGUF Q8_0, and
// Q5_0, Q5_1, Q5_K held as bytes); 6-bit signed codes -32..31 (GGUF Q6_K; read as
// u = q + 32 with the minimum -32 s: decode6_512 below); 4-bit codes
// 0..15 with a minimum (GGUF Q4_1, Q4_K: W = s q + m) or without one (GGUF Q4_0: W = s (q - 8)).
// Packed (kernels.py packs): codes in super-panels of 64 outputs, k-major, so that a matrix is one
// sequential stream (one 64-byte line per k for 8-bit codes): 8-bit (ns, K, 64) int8; 6-bit (ns, 3K/4, 64); 4-bit
// (ns, K/8, 64) uint32 (as (ns, K/2, 64) bytes): dword [b, o] = sum over n < 8 of q(o, 8b + n) << 4n, so one
// 64-byte load gives 16 outputs x 8 codes: the FMA paths shift a code into each dword's low bits, and the
// int8-activation path (qlinear_a8) masks even and odd codes into bytes for vpdpbusd. Scales and minimums
// (ns, K/gs, 64) float32, or float16 where every one is a float16 value, or (GGUF K-quants) factored: d (float16)
// per 256 weights and an integer per group, multiplied in registers into the same float32 values (Fac below).
// Rows are tiled by up to 6 (AVX-512) or 4 (AVX2): a k-row call decodes each line once per tile.
// Arithmetic, per output and row, in float32 with FMA and a fixed order:
//     p_g = sum over k in g (ascending) of float(q[n, k]) * x[k]     (one FMA chain)
//     y   = sum over g (ascending) of  s[n, g] * p_g (+ m[n, g] * xs_g)   (one FMA chain)
// where xs_g = sum of x over the group (ascending, scalar). Codes convert to float exactly, so
// this is an exact-to-fp32-accumulation product with the quantized weights, and every output is
// the same chain of operations whatever the number of rows, its row's place in the batch, or
// the instruction set (AVX2 or AVX-512: lanes are outputs, never k): batch-invariant, and bit-
// identical across the two code paths (tests/test_quant.py).

namespace {

constexpr int64_t SP = 64;  // outputs per quantized super-panel (one 64-byte line of 8-bit codes per k)
constexpr int64_t QPF = 24;  // lines between a prefetch and its use

// Scales and minimums are float32, or float16 where every one is a float16 value (the GGUF's own
// blocks store them so): widened exactly on load, so both give the same chain.
__attribute__((target("avx512f"))) inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 ld16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Factored scales (GGUF K-quants: a group's scale is d * sc, its minimum -(dmin * m), with d, dmin float16 per
// super-block of 256 weights and sc, m small integers per group): per super-panel and super-block, two lines
// of the float16 d of the 64 outputs, then G = 256 / gs lines of one int8 factor per output (group i of the
// super-block: line 2 + i), as (ns, K/256, 2 + G, 64) int8, read in address order. A float16 times an integer
// of at most 8 bits is exact in float32, so the scale computed here, float(d) * float(sc), is the very float32
// value a stored product would be, and the minimum (-dmin) * float(m) the very value of -(dmin * m).
struct Fac { int8_t v; };

template <typename S> inline int64_t sstride_of(int64_t ng, int64_t G) {  // scale elements per super-panel
  return std::is_same_v<S, Fac> ? (ng / G) * (G + 2) * SP : ng * SP;
}
// Group g's scales (or minimums), found once per group and tile: its line of 64 values, or its line of 64
// integer factors and the super-block's d (G, a power of two, gives a shift and a mask). A tile widens each
// super-block's float16 d and dmin once (widen_d: into `dq`, an L1 buffer of 64 floats, the minimums' d negated:
// -(dmin * m) = (-dmin) * m exactly, sign and all), so a group's scale costs a convert and a multiply.
template <typename S> struct GroupScales { const S* p; const float* d; };
template <typename S> inline GroupScales<S> group_scales(const S* base, int64_t g, int64_t G, const float* dq) {
  if constexpr (std::is_same_v<S, Fac>) {
    const int sh = __builtin_ctzll(static_cast<unsigned long long>(G));
    const int8_t* b = reinterpret_cast<const int8_t*>(base) + (g >> sh) * (G + 2) * SP;
    return {reinterpret_cast<const Fac*>(b + (2 + (g & (G - 1))) * SP), dq};
  } else {
    return {base + g * SP, nullptr};
  }
}
template <typename S> inline void widen_d(const S* base, int64_t g, int64_t G, float* dq, bool negate) {
  if constexpr (std::is_same_v<S, Fac>) {
    if ((g & (G - 1)) != 0) return;  // not the first group of a super-block
    const int8_t* b = reinterpret_cast<const int8_t*>(base) + (g / G) * (G + 2) * SP;
    for (int64_t l = 0; l < G + 2; ++l)  // the next super-block's lines: 256 k-steps ahead
      _mm_prefetch(reinterpret_cast<const char*>(b + (G + 2 + l) * SP), _MM_HINT_T0);
    const uint16_t* d = reinterpret_cast<const uint16_t*>(b);
    const __m256 sign = _mm256_set1_ps(negate ? -0.0f : 0.0f);
    for (int64_t o = 0; o < SP; o += 8)
      _mm256_store_ps(dq + o, _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + o))), sign));
  }
}
template <typename S>
__attribute__((target("avx512f"))) inline __m512 scale16(GroupScales<S> gs, int64_t o) {  // scales and minimums
  if constexpr (std::is_same_v<S, Fac>) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gs.p + o))));
    return _mm512_mul_ps(_mm512_load_ps(gs.d + o), f);
  } else {
    return ld16(gs.p + o);
  }
}
template <typename S> inline __m256 scale8(GroupScales<S> gs, int64_t o) {
  if constexpr (std::is_same_v<S, Fac>) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gs.p + o))));
    return _mm256_mul_ps(_mm256_load_ps(gs.d + o), f);
  } else {
    return ld8(gs.p + o);
  }
}

// 6-bit codes (GGUF Q6_K: q in -32..31), held as u = q + 32 in 0..63 and read in the minimum form W = s u + m with
// m = -32 s (exact: a power of two times s), so their chain is the 4-bit codes' (p_g over u, then s p_g + m xs_g).
// Packed by kernels.py (_pack6) per 4 k in 3 lines of 64 bytes, each line 16 dwords, dword i holding byte b for
// k + b: line A = lo(o, k + b) | lo(o + 16, k + b) << 4 for o = i, line B the same for outputs 32 + i and 48 + i
// (lo = u & 15), line C the four hi = u >> 4 of outputs i, 16 + i, 32 + i, 48 + i at bits 0, 2, 4, 6. decode6 turns
// the three lines into D_j (j = 0..3, outputs 16 j + i in dword i): byte b of dword i is u(16 j + i, k + b); the
// products then mask byte b in place (float(u 2^8b), exact, against x prescaled by 2^-8b: mk_prescale) or shift
// it down (against x itself, where x cannot be prescaled exactly). The 32-bit shifts that line C's pairs up carry
// bits across bytes: masked off.
// (x & 0x0F..) | (y & 0x30..): y masked, then vpternlogd's select (0x0F.. ? x : y)
__attribute__((target("avx512f"))) inline __m512i pick6(__m512i x, __m512i y) {
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0F0F0F0F), x, _mm512_and_si512(y, _mm512_set1_epi32(0x30303030)), 0xCA);
}
__attribute__((target("avx512f,avx512bw"))) inline void decode6_512(const uint8_t* l, __m512i D[4]) {
  const __m512i a = _mm512_loadu_si512(l), b = _mm512_loadu_si512(l + SP), c = _mm512_loadu_si512(l + 2 * SP);
  D[0] = pick6(a, _mm512_slli_epi32(c, 4));
  D[1] = pick6(_mm512_srli_epi32(a, 4), _mm512_slli_epi32(c, 2));
  D[2] = pick6(b, c);
  D[3] = pick6(_mm512_srli_epi32(b, 4), _mm512_srli_epi32(c, 2));
}
// AVX2: D for the 8 outputs from o (o a multiple of 8): dwords o % 16 .. + 7 of line A (o < 32) or B, nibble o / 16 % 2.
inline __m256i decode6_256(const uint8_t* l, int64_t o) {
  const int64_t j = o / 16, half = (o / 8) % 2;
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + (j < 2 ? 0 : SP) + 32 * half));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 2 * SP + 32 * half));
  const __m256i xl = (j & 1) ? _mm256_srli_epi32(x, 4) : x;
  const __m256i ch = j == 0 ? _mm256_slli_epi32(c, 4) : j == 1 ? _mm256_slli_epi32(c, 2) : j == 2 ? c : _mm256_srli_epi32(c, 2);
  return _mm256_or_si256(_mm256_and_si256(xl, _mm256_set1_epi32(0x0F0F0F0F)), _mm256_and_si256(ch, _mm256_set1_epi32(0x30303030)));
}

// R rows x one super-panel, AVX-512: lane i of p[r][j] is output 16 j + i of row r. The group
// partial sums p live in registers (R x 4 zmm; R <= 6 leaves room for the decode); the running
// sums acc live in an L1 buffer, touched once per group. 4-bit codes are decoded with one
// vpmovzxbd per 16 bytes (both nibbles of a byte in one dword) and a 16-entry float table
// (vpermps reads each dword's low 4 bits): the low nibble is a lookup, the high one a shift and a
// lookup. Each output's chain is the same as the AVX2 path's (below) whatever R is.
template <int R, int CB, bool MIN, typename S, bool MK = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
void qtile512(const uint8_t* codes, const S* sc, const S* mn, int64_t k_n, int64_t gs, int64_t G, const float* x,
              int64_t ldx, const float* xs, int64_t ldxs, float* y, int64_t ldy, int64_t n_valid, const float* bias) {
  alignas(64) float acc[R][SP];
  std::memset(acc, 0, sizeof(acc));
  alignas(64) float dq[2][SP];  // factored scales: the super-block's d and -dmin (widen_d)
  const int64_t ng = k_n / gs;
  alignas(64) float tab[16];
  for (int i = 0; i < 16; ++i) tab[i] = float(MIN ? i : i - 8);  // Q4_1: q; Q4_0: q - 8 (exact)
  const __m512 table = _mm512_load_ps(tab);
  for (int64_t g = 0; g < ng; ++g) {
    __m512 p[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) p[r][j] = _mm512_setzero_ps();
    const int64_t k0 = g * gs;
    if constexpr (CB == 8) {
      for (int64_t k = k0; k < k0 + gs; ++k) {
        const uint8_t* c = codes + k * SP;
        _mm_prefetch(reinterpret_cast<const char*>(c + QPF * SP), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j))));
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k]), p[r][j]);
        }
      }
    } else if constexpr (CB == 6) {  // 4 k at a time: three lines decoded into D_j, one byte of a dword per k
      for (int64_t k = k0; k < k0 + gs; k += 4) {
        const uint8_t* l = codes + (k / 4) * 3 * SP;
#pragma GCC unroll 3
        for (int i = 0; i < 3; ++i) _mm_prefetch(reinterpret_cast<const char*>(l + i * SP) + QPF * SP, _MM_HINT_T0);
        __m512i D[4];
        decode6_512(l, D);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) {
            const __m512 w = _mm512_cvtepi32_ps(MK ? _mm512_and_si512(D[j], _mm512_set1_epi32(0xFF << (8 * b)))
                                                   : _mm512_and_si512(_mm512_srli_epi32(D[j], 8 * b), _mm512_set1_epi32(0xFF)));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k + b]), p[r][j]);
          }
      }
    } else if constexpr (MK) {  // masked codes against x prescaled (mk_prescale): no shift, no table
      for (int64_t k = k0; k < k0 + gs; k += 8) {
        const uint32_t* c = reinterpret_cast<const uint32_t*>(codes + (k / 2) * SP);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(c + 16 * j) + QPF * SP, _MM_HINT_T0);
          const __m512i d = _mm512_loadu_si512(c + 16 * j);
#pragma GCC unroll 8
          for (int n = 0; n < 8; ++n) {  // float(q << 4n) exactly (n < 7), or float(q) from the top nibble
            const __m512 w = _mm512_cvtepi32_ps(n < 7 ? _mm512_and_si512(d, _mm512_set1_epi32(0xF << (4 * n)))
                                                      : _mm512_srli_epi32(d, 28));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k + n]), p[r][j]);
          }
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + gs; k += 8) {
        const uint32_t* c = reinterpret_cast<const uint32_t*>(codes + (k / 2) * SP);  // 8 codes per output dword
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(c + 16 * j) + QPF * SP, _MM_HINT_T0);
          const __m512i d = _mm512_loadu_si512(c + 16 * j);
#pragma GCC unroll 8
          for (int n = 0; n < 8; ++n) {  // vpermps reads each dword's low 4 bits: code k + n
            const __m512 w = _mm512_permutexvar_ps(n ? _mm512_srli_epi32(d, 4 * n) : d, table);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) p[r][j] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k + n]), p[r][j]);
          }
        }
      }
    }
    widen_d(sc, g, G, dq[0], false);
    if constexpr (MIN) widen_d(mn, g, G, dq[1], true);
    const GroupScales<S> gsc = group_scales(sc, g, G, dq[0]), gmn = MIN ? group_scales(mn, g, G, dq[1]) : gsc;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 s = scale16(gsc, 16 * j);
      const __m512 m = CB == 6 ? _mm512_mul_ps(s, _mm512_set1_ps(-32.0f)) : MIN ? scale16(gmn, 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_fmadd_ps(s, p[r][j], _mm512_load_ps(acc[r] + 16 * j));
        if constexpr (MIN || CB == 6) a = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * ldxs + g]), a);
        _mm512_store_ps(acc[r] + 16 * j, a);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy;
    if (bias != nullptr)
      for (int64_t i = 0; i < n_valid; ++i) out[i] = acc[r][i] + bias[i];
    else
      std::memcpy(out, acc[r], sizeof(float) * n_valid);
  }
}

// R rows x NQ x 8 outputs starting at output o0 of a super-panel, AVX2: lane i of p[r][j] is output
// o0 + 8 j + i. One row takes 32 outputs (two passes over the super-panel's lines; the second finds
// them in L1/L2), more rows 16 (four passes) so that R x NQ partial sums fit the 16 ymm registers.
// The same chain per output as qtile512.
template <int R, int NQ, int CB, bool MIN, typename S, bool MK = false>
void qtile256(const uint8_t* codes, const S* sc, const S* mn, int64_t k_n, int64_t gs, int64_t G, const float* x,
              int64_t ldx, const float* xs, int64_t ldxs, float* y, int64_t ldy, int64_t o0, int64_t n_valid,
              const float* bias) {
  alignas(32) float acc[R][8 * NQ];
  std::memset(acc, 0, sizeof(acc));
  alignas(64) float dq[2][SP];  // factored scales: the super-block's d and -dmin (widen_d)
  const int64_t ng = k_n / gs;
  const __m256i lo4 = _mm256_set1_epi32(0x0F), off = _mm256_set1_epi32(MIN ? 0 : 8);
  for (int64_t g = 0; g < ng; ++g) {
    __m256 p[R][NQ];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NQ; ++j) p[r][j] = _mm256_setzero_ps();
    const int64_t k0 = g * gs;
    if constexpr (CB == 8) {
      for (int64_t k = k0; k < k0 + gs; ++k) {
        const uint8_t* c = codes + k * SP + o0;
        if (o0 == 0) _mm_prefetch(reinterpret_cast<const char*>(c + QPF * SP), _MM_HINT_T0);
        for (int j = 0; j < NQ; ++j) {
          const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * j))));
          for (int r = 0; r < R; ++r) p[r][j] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * ldx + k), p[r][j]);
        }
      }
    } else if constexpr (CB == 6) {  // 4 k at a time, as decode6_512 but 8 outputs a register
      for (int64_t k = k0; k < k0 + gs; k += 4) {
        const uint8_t* l = codes + (k / 4) * 3 * SP;
        if (o0 == 0)
          for (int i = 0; i < 3; ++i) _mm_prefetch(reinterpret_cast<const char*>(l + i * SP) + QPF * SP, _MM_HINT_T0);
        for (int j = 0; j < NQ; ++j) {
          const __m256i D = decode6_256(l, o0 + 8 * j);
          for (int b = 0; b < 4; ++b) {
            const __m256 w = _mm256_cvtepi32_ps(MK ? _mm256_and_si256(D, _mm256_set1_epi32(0xFF << (8 * b)))
                                                   : _mm256_and_si256(_mm256_srli_epi32(D, 8 * b), _mm256_set1_epi32(0xFF)));
            for (int r = 0; r < R; ++r) p[r][j] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * ldx + k + b), p[r][j]);
          }
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + gs; k += 8) {
        const uint32_t* c = reinterpret_cast<const uint32_t*>(codes + (k / 2) * SP) + o0;  // output o's dword: c[o]
        if (o0 == 0)
          for (int q = 0; q < 4; ++q) _mm_prefetch(reinterpret_cast<const char*>(c + 16 * q) + QPF * SP, _MM_HINT_T0);
        for (int j = 0; j < NQ; ++j) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 8 * j));
          for (int n = 0; n < 8; ++n) {
            const __m256 w =
                MK ? _mm256_cvtepi32_ps(n < 7 ? _mm256_and_si256(d, _mm256_set1_epi32(0xF << (4 * n))) : _mm256_srli_epi32(d, 28))
                   : _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d, 4 * n), lo4), off));
            for (int r = 0; r < R; ++r) p[r][j] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + r * ldx + k + n), p[r][j]);
          }
        }
      }
    }
    widen_d(sc, g, G, dq[0], false);
    if constexpr (MIN) widen_d(mn, g, G, dq[1], true);
    const GroupScales<S> gsc = group_scales(sc, g, G, dq[0]), gmn = MIN ? group_scales(mn, g, G, dq[1]) : gsc;
    for (int j = 0; j < NQ; ++j) {
      const __m256 s = scale8(gsc, o0 + 8 * j);
      const __m256 m = CB == 6 ? _mm256_mul_ps(s, _mm256_set1_ps(-32.0f)) : MIN ? scale8(gmn, o0 + 8 * j) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m256 a = _mm256_fmadd_ps(s, p[r][j], _mm256_load_ps(acc[r] + 8 * j));
        if constexpr (MIN || CB == 6) a = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + r * ldxs + g), a);
        _mm256_store_ps(acc[r] + 8 * j, a);
      }
    }
  }
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(8 * NQ, n_valid - o0));
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ldy + o0;
    if (bias != nullptr)
      for (int64_t i = 0; i < n; ++i) out[i] = acc[r][i] + bias[o0 + i];
    else
      std::memcpy(out, acc[r], sizeof(float) * n);
  }
}

struct QArgs {
  const uint8_t* codes;
  const void* sc;  // float or float16 (uint16_t), as S says
  const void* mn;
  int64_t k_n, gs, n;
  const float* x;
  const float* xs;
  int64_t ldxs;
  float* y;
  const float* bias;
  bool mk;  // 4-bit codes with minimums or 6-bit codes, x prescaled (mk_prescale): the masked decode
  int64_t ldy;  // y's row stride (n, or wider: a fused product's parts write side by side)
};

// Bytes of packed codes per output and super-panel: 8-bit K, 4-bit K/2, 6-bit 3K/4 (decode6_512's layout).
inline int64_t code_bytes(int cb, int64_t k_n) { return cb == 8 ? k_n : cb == 4 ? k_n / 2 : 3 * k_n / 4; }

constexpr int QROWS512 = 6;  // rows per AVX-512 tile: 24 partial-sum registers + the decode
constexpr int QROWS256 = 4;  // rows per AVX2 tile (16 outputs): 8 partial-sum registers + the decode

template <int CB, bool MIN, bool AVX512, typename S>
void qsuper(const QArgs& a, int64_t rows, int64_t sp) {
  const int64_t G = 256 / a.gs;  // groups per super-block (factored scales only)
  const int64_t cstride = code_bytes(CB, a.k_n) * SP, sstride = sstride_of<S>(a.k_n / a.gs, G);
  const uint8_t* codes = a.codes + sp * cstride;
  const S* sc = static_cast<const S*>(a.sc) + sp * sstride;
  const S* mn = MIN ? static_cast<const S*>(a.mn) + sp * sstride : nullptr;
  const int64_t n0 = sp * SP, n_valid = std::min<int64_t>(SP, a.n - n0);
  const float* bias = a.bias ? a.bias + n0 : nullptr;
  const int64_t most = AVX512 ? QROWS512 : QROWS256;
  // balanced row tiles (8 rows = 4 + 4 on AVX-512): which tile a row lands in never changes its chain
  const int64_t tiles = (rows + most - 1) / most;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t size = (rows - r) / (tiles - t);
    const float* xt = a.x + r * a.k_n;
    const float* xst = MIN || CB == 6 ? a.xs + r * a.ldxs : nullptr;
    const int64_t ldy = a.ldy;
    float* yt = a.y + r * ldy + n0;
    constexpr bool CAN_MK = (CB == 4 && MIN) || CB == 6;
    if constexpr (AVX512) {
#define QT(RR) (CAN_MK && a.mk ? qtile512<RR, CB, MIN, S, CAN_MK>(codes, sc, mn, a.k_n, a.gs, G, xt, a.k_n, xst, a.ldxs, yt, ldy, n_valid, bias) \
                              : qtile512<RR, CB, MIN, S>(codes, sc, mn, a.k_n, a.gs, G, xt, a.k_n, xst, a.ldxs, yt, ldy, n_valid, bias))
      switch (size) {
        case 6: QT(6); break; case 5: QT(5); break; case 4: QT(4); break;
        case 3: QT(3); break; case 2: QT(2); break; default: QT(1);
      }
#undef QT
    } else {
#define QT(RR, NQ) (CAN_MK && a.mk ? qtile256<RR, NQ, CB, MIN, S, CAN_MK>(codes, sc, mn, a.k_n, a.gs, G, xt, a.k_n, xst, a.ldxs, yt, ldy, o0, n_valid, bias) \
                                  : qtile256<RR, NQ, CB, MIN, S>(codes, sc, mn, a.k_n, a.gs, G, xt, a.k_n, xst, a.ldxs, yt, ldy, o0, n_valid, bias))
      if (size == 1) {
        for (int64_t o0 = 0; o0 < SP; o0 += 32) QT(1, 4);
      } else {
        for (int64_t o0 = 0; o0 < SP; o0 += 16)
          switch (size) { case 4: QT(4, 2); break; case 3: QT(3, 2); break; default: QT(2, 2); }
      }
#undef QT
    }
    r += size;
  }
}

template <int CB, bool MIN, bool AVX512, typename S>
void qrun(const QArgs& a, int64_t rows) {
  const int64_t supers = (a.n + SP - 1) / SP;
  const int64_t bytes = code_bytes(CB, a.k_n) * SP;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, bytes));
  par_for(0, supers, grain, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) qsuper<CB, MIN, AVX512, S>(a, rows, s);
  });
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}


// ---- int8 activations over the same 4-bit codes (W4A8): a draft for the block target -------------
//
// Each row's x is quantized per weight group (gs, a multiple of 8): d = max|x| / 127, qx = round(x / d)
// (int8; an all-zero group gives d = 1, qx = 0), stored per 8 inputs as [qx(k), qx(k+2), qx(k+4),
// qx(k+6), qx(k+1), qx(k+3), qx(k+5), qx(k+7)] to match the even and odd codes of a dword. Per output
// and group, isum = sum q(k) qx(k) is an exact integer (vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2:
// 15 x 127 x 2 fits int16), then in float32, in a fixed order:
//     y = sum over g of s_g * (d_g * isum_g) (+ m_g * (d_g * sx_g))      (Q4_0: isum_g - 8 sx_g)
// with sx_g = sum of qx over the group. Not the target's arithmetic (x is rounded): a draft only. It is
// deterministic, batch-invariant and the same on both paths (integer sums are exact).

struct A8Args {
  const uint8_t* codes;
  const void* sc;
  const void* mn;
  int64_t k_n, gs, n;
  const int8_t* xq;   // (rows, K) permuted per 8
  const float* dx;    // (rows, K/gs)
  const float* sxf;   // (rows, K/gs): sum of qx (exact in float)
  float* y;
  const float* bias;
};

template <int R, bool MIN, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
void a8tile512(const A8Args& a, const uint8_t* codes, const S* sc, const S* mn, int64_t r0, int64_t n0, int64_t n_valid) {
  alignas(64) float acc[R][SP];
  std::memset(acc, 0, sizeof(acc));
  alignas(64) float dq[2][SP];  // factored scales: the super-block's d and -dmin (widen_d)
  const int64_t ng = a.k_n / a.gs, G = 256 / a.gs;
  const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F);
  for (int64_t g = 0; g < ng; ++g) {
    __m512i is[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) is[r][j] = _mm512_setzero_si512();
    for (int64_t k = g * a.gs; k < (g + 1) * a.gs; k += 8) {
      const uint32_t* c = reinterpret_cast<const uint32_t*>(codes + (k / 2) * SP);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(c + 16 * j) + QPF * SP, _MM_HINT_T0);
        const __m512i d = _mm512_loadu_si512(c + 16 * j);
        const __m512i ev = _mm512_and_si512(d, m4), od = _mm512_and_si512(_mm512_srli_epi32(d, 4), m4);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + (r0 + r) * a.k_n + k);
          is[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[r][j], ev, _mm512_set1_epi32(xr[0])), od,
                                         _mm512_set1_epi32(xr[1]));
        }
      }
    }
    widen_d(sc, g, G, dq[0], false);
    if constexpr (MIN) widen_d(mn, g, G, dq[1], true);
    const GroupScales<S> gsc = group_scales(sc, g, G, dq[0]), gmn = MIN ? group_scales(mn, g, G, dq[1]) : gsc;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 s = scale16(gsc, 16 * j);
      const __m512 m = MIN ? scale16(gmn, 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const float dg = a.dx[(r0 + r) * ng + g], sx = a.sxf[(r0 + r) * ng + g];
        __m512 sum = _mm512_cvtepi32_ps(is[r][j]);
        if constexpr (!MIN) sum = _mm512_sub_ps(sum, _mm512_set1_ps(8.0f * sx));  // exact: |values| < 2^24
        __m512 t = _mm512_fmadd_ps(s, _mm512_mul_ps(_mm512_set1_ps(dg), sum), _mm512_load_ps(acc[r] + 16 * j));
        if constexpr (MIN) t = _mm512_fmadd_ps(m, _mm512_set1_ps(dg * sx), t);
        _mm512_store_ps(acc[r] + 16 * j, t);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = a.y + (r0 + r) * a.n + n0;
    for (int64_t i = 0; i < n_valid; ++i) out[i] = acc[r][i] + (a.bias ? a.bias[n0 + i] : 0.0f);
  }
}

// AVX2: one row x 16 outputs (two ymm of int32 sums); vpmaddubsw (u8 codes x s8 activations, pairs summed
// in int16: at most 2 x 15 x 127) then vpmaddwd by ones: the same integers as vpdpbusd.
template <bool MIN, typename S>
void a8tile256(const A8Args& a, const uint8_t* codes, const S* sc, const S* mn, int64_t r, int64_t n0, int64_t o0,
               int64_t n_valid) {
  alignas(32) float acc[16];
  std::memset(acc, 0, sizeof(acc));
  alignas(64) float dq[2][SP];  // factored scales: the super-block's d and -dmin (widen_d)
  const int64_t ng = a.k_n / a.gs, G = 256 / a.gs;
  const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < ng; ++g) {
    __m256i is[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t k = g * a.gs; k < (g + 1) * a.gs; k += 8) {
      const uint32_t* c = reinterpret_cast<const uint32_t*>(codes + (k / 2) * SP) + o0;
      const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + r * a.k_n + k);
      const __m256i xe = _mm256_set1_epi32(xr[0]), xo = _mm256_set1_epi32(xr[1]);
      for (int j = 0; j < 2; ++j) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 8 * j));
        const __m256i ev = _mm256_and_si256(d, m4), od = _mm256_and_si256(_mm256_srli_epi32(d, 4), m4);
        const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(ev, xe), _mm256_maddubs_epi16(od, xo));
        is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(p16, ones));
      }
    }
    const float dg = a.dx[r * ng + g], sx = a.sxf[r * ng + g];
    widen_d(sc, g, G, dq[0], false);
    if constexpr (MIN) widen_d(mn, g, G, dq[1], true);
    const GroupScales<S> gsc = group_scales(sc, g, G, dq[0]), gmn = MIN ? group_scales(mn, g, G, dq[1]) : gsc;
    for (int j = 0; j < 2; ++j) {
      const __m256 s = scale8(gsc, o0 + 8 * j);
      __m256 sum = _mm256_cvtepi32_ps(is[j]);
      if constexpr (!MIN) sum = _mm256_sub_ps(sum, _mm256_set1_ps(8.0f * sx));
      __m256 t = _mm256_fmadd_ps(s, _mm256_mul_ps(_mm256_set1_ps(dg), sum), _mm256_load_ps(acc + 8 * j));
      if constexpr (MIN) t = _mm256_fmadd_ps(scale8(gmn, o0 + 8 * j), _mm256_set1_ps(dg * sx), t);
      _mm256_store_ps(acc + 8 * j, t);
    }
  }
  const int64_t nv = std::max<int64_t>(0, std::min<int64_t>(16, n_valid - o0));
  float* out = a.y + r * a.n + n0 + o0;
  for (int64_t i = 0; i < nv; ++i) out[i] = acc[i] + (a.bias ? a.bias[n0 + o0 + i] : 0.0f);
}

template <bool MIN, bool AVX512, typename S>
void a8run(const A8Args& a, int64_t rows) {
  const int64_t supers = (a.n + SP - 1) / SP;
  const int64_t bytes = (a.k_n / 2) * SP;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, bytes));
  const int64_t sstride = sstride_of<S>(a.k_n / a.gs, 256 / a.gs);
  par_for(0, supers, grain, [&](int64_t s0, int64_t s1) {
    for (int64_t sp = s0; sp < s1; ++sp) {
      const uint8_t* codes = a.codes + sp * bytes;
      const S* sc = static_cast<const S*>(a.sc) + sp * sstride;
      const S* mn = MIN ? static_cast<const S*>(a.mn) + sp * sstride : nullptr;
      const int64_t n0 = sp * SP, nv = std::min<int64_t>(SP, a.n - n0);
      if constexpr (AVX512) {
        const int64_t tiles = (rows + 5) / 6;
        int64_t r = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t size = (rows - r) / (tiles - t);
#define AT(RR) a8tile512<RR, MIN, S>(a, codes, sc, mn, r, n0, nv)
          switch (size) { case 6: AT(6); break; case 5: AT(5); break; case 4: AT(4); break;
                          case 3: AT(3); break; case 2: AT(2); break; default: AT(1); }
#undef AT
          r += size;
        }
      } else {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o0 = 0; o0 < SP; o0 += 16) a8tile256<MIN, S>(a, codes, sc, mn, r, n0, o0, nv);
      }
    }
  });
}

bool cpu_has_vnni512() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}

}  // namespace

// The packed scales' kind, checked against the codes: 0 float32, 1 float16, each (ns, K/gs, 64); 2 factored
// (Fac above: (ns, K/256, 2 + 256/gs, 64) int8). Minimums, where given, must be of the same kind and shape.
int scale_kind(const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins, int64_t np, int64_t k,
               int64_t gs, const char* who) {
  int kind = -1;
  if (scales.dim() == 3 && scales.size(0) == np && scales.size(1) == k / gs && scales.size(2) == SP)
    kind = scales.scalar_type() == torch::kFloat32 ? 0 : scales.scalar_type() == torch::kHalf ? 1 : -1;
  else if (scales.dim() == 4 && scales.scalar_type() == torch::kInt8 && 256 % gs == 0 && k % 256 == 0 &&
           scales.size(0) == np && scales.size(1) == k / 256 && scales.size(2) == 256 / gs + 2 && scales.size(3) == SP)
    kind = 2;
  TORCH_CHECK(kind >= 0 && scales.is_contiguous(), who, ": packed scales expected");
  TORCH_CHECK(!mins.has_value() || !mins->defined() ||
                  (mins->sizes() == scales.sizes() && mins->is_contiguous() && mins->scalar_type() == scales.scalar_type()),
              who, ": mins must match scales");
  return kind;
}

// The masked decode (issue 47). 4-bit codes (period 8): code n of a dword (k = 8b + n) sits at bits 4n..4n+3: masked
// in place it converts exactly to float(q * 2^4n) (n < 7; the top nibble is shifted down, q itself), and x[k]
// prescaled by 2^-4n (exact: a power of two) gives the same product: float(q 2^4n) * (x 2^-4n) = q * x as a real
// number, so every FMA rounds the same sum and the chain above is bit for bit the shifted decode's, with no shift or
// permute for 7 codes of 8. 6-bit codes (period 4, decode6_512): byte b of a dword against x prescaled by 2^-8b.
// The prescale is exact unless x 2^-24 falls below the normal range: where any nonzero |x| < 2^-102 (or a value is
// not finite) the call keeps the shifted decode. Writes (R*K) prescaled floats into a per-thread buffer and points x
// at it; returns whether it did.
bool mk_prescale(const float* x, int64_t count, int period, const float*& out) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < count) buf.resize(count);
  const float tiny = std::ldexp(1.0f, -102);
  alignas(32) static const float f4[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
  alignas(32) static const float f6[8] = {1.0f, 0x1p-8f, 0x1p-16f, 0x1p-24f, 1.0f, 0x1p-8f, 0x1p-16f, 0x1p-24f};
  const float* f = period == 8 ? f4 : f6;  // x[i] * f[i mod period]: period divides 8
  const __m256 fv = _mm256_load_ps(f);
  float* b = buf.data();
  // one pass: the check, 8 lanes at a time (|x| <= FLT_MAX, false for NaN and infinities, and x == 0 or
  // |x| >= tiny), beside the product; the buffer is used only when every value passes
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), maxv = _mm256_set1_ps(FLT_MAX),
               tinyv = _mm256_set1_ps(tiny), zero = _mm256_setzero_ps();
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 v = _mm256_and_ps(xv, absmask);
    ok = _mm256_and_ps(ok, _mm256_and_ps(_mm256_cmp_ps(v, maxv, _CMP_LE_OQ),
                                         _mm256_or_ps(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ), _mm256_cmp_ps(v, tinyv, _CMP_GE_OQ))));
    _mm256_storeu_ps(b + i, _mm256_mul_ps(xv, fv));
  }
  if (_mm256_movemask_ps(ok) != 0xFF) return false;
  for (; i < count; ++i) {
    const float v = std::fabs(x[i]);
    if (!(v <= FLT_MAX) || (v != 0.0f && v < tiny)) return false;
    b[i] = x[i] * f[i & 7];
  }
  out = b;
  return true;
}

// "avx512" or "avx2": the instruction set qlinear uses by default on this CPU.
std::string qisa() { return cpu_has_avx512() ? "avx512" : "avx2"; }

// A quantized product checked once (qlinear's checks) and kept as raw pointers: what DecoderStack runs per call.
struct QMeta {
  const uint8_t* codes = nullptr;
  const void* sc = nullptr;
  const void* mn = nullptr;
  const float* bias = nullptr;
  int64_t k = 0, gs = 0, n = 0, bits = 0;
  int skind = 0;
  bool has_min = false, avx512 = false;
};

QMeta qmeta(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
            int64_t k, int64_t n, int64_t gs, int64_t bits, const torch::Tensor* bias_f32, const std::string& isa) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 6, "qlinear: bits must be 8, 6 or 4");
  const int64_t step = bits == 8 ? 1 : bits == 4 ? 8 : 16;  // k-steps of a code word
  TORCH_CHECK(gs > 0 && k % gs == 0 && gs % step == 0, "qlinear: group size ", gs, " must divide K=", k,
              " and be a multiple of ", step);
  TORCH_CHECK(bits != 6 || !(mins.has_value() && mins->defined()), "qlinear: 6-bit codes take no minimums");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == SP && codes.size(1) == code_bytes(bits, k) &&
                  codes.element_size() == 1 && codes.is_contiguous(),
              "qlinear: packed codes expected");
  const int64_t np = codes.size(0);
  TORCH_CHECK(np * SP >= n && np * SP - n < SP, "qlinear: bad output size");
  QMeta q;
  q.skind = scale_kind(scales, mins, np, k, gs, "qlinear");
  q.has_min = mins.has_value() && mins->defined();
  q.avx512 = isa == "avx512" || (isa == "auto" && cpu_has_avx512());
  TORCH_CHECK(!q.avx512 || cpu_has_avx512(), "qlinear: this CPU has no AVX-512");
  q.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  q.sc = scales.data_ptr();
  q.mn = q.has_min ? mins->data_ptr() : nullptr;
  if (bias_f32 != nullptr && bias_f32->defined()) {
    TORCH_CHECK(bias_f32->numel() == n, "qlinear: bias has ", bias_f32->numel(), " elements, expected ", n);
    q.bias = bias_f32->data_ptr<float>();
  }
  q.k = k;
  q.gs = gs;
  q.n = n;
  q.bits = bits;
  return q;
}

// y (rows, n; row stride ldy) = x (rows, k contiguous) W^T (+ b): the product qlinear() describes.
void qlinear_rows(const QMeta& q, const float* x, int64_t rows, float* y, int64_t ldy) {
  if (rows == 0) return;
  static thread_local std::vector<float> xs_buf;  // the rows' group sums (one caller at a time per thread)
  const int64_t k = q.k, gs = q.gs, ng = k / gs;
  const bool sums = q.has_min || q.bits == 6;
  float* sp = nullptr;
  if (sums) {  // group sums of x, each in ascending k (6-bit codes: for m = -32 s)
    if (static_cast<int64_t>(xs_buf.size()) < rows * ng) xs_buf.resize(rows * ng);
    sp = xs_buf.data();
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * k;
      float* sr = sp + r * ng;
      int64_t g = 0;
      for (; g + 8 <= ng; g += 8) {  // eight groups' sums side by side: eight chains, each still in ascending k
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t i = 0; i < gs; ++i)
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) acc[u] += xr[(g + u) * gs + i];
        for (int u = 0; u < 8; ++u) sr[g + u] = acc[u];
      }
      for (; g < ng; ++g) {
        float s = 0.0f;
        for (int64_t i = g * gs; i < (g + 1) * gs; ++i) s += xr[i];
        sr[g] = s;
      }
    }
  }
  QArgs a{q.codes, q.sc, q.mn, k, gs, q.n, x, sp, ng, y, q.bias, false, ldy};
  if ((q.bits == 4 && q.has_min) || q.bits == 6) a.mk = mk_prescale(a.x, rows * k, q.bits == 6 ? 4 : 8, a.x);
  const bool avx512 = q.avx512, has_min = q.has_min;
  const int skind = q.skind;
  const int64_t bits = q.bits;
#define QDISPATCH(CB, MIN)                                                                        \
  if (skind == 1) {                                                                                \
    if (avx512) qrun<CB, MIN, true, uint16_t>(a, rows); else qrun<CB, MIN, false, uint16_t>(a, rows); \
  } else if (skind == 2) {                                                                         \
    if (avx512) qrun<CB, MIN, true, Fac>(a, rows); else qrun<CB, MIN, false, Fac>(a, rows);           \
  } else {                                                                                         \
    if (avx512) qrun<CB, MIN, true, float>(a, rows); else qrun<CB, MIN, false, float>(a, rows);       \
  }
  if (bits == 8 && has_min) {  // GGUF Q5_1 / Q5_K: 5-bit codes held as bytes, with minimums
    QDISPATCH(8, true)
  } else if (bits == 8) {
    QDISPATCH(8, false)
  } else if (bits == 6) {  // GGUF Q6_K
    QDISPATCH(6, false)
  } else if (has_min) {
    QDISPATCH(4, true)
  } else {
    QDISPATCH(4, false)
  }
#undef QDISPATCH
}

// x (R, K) float32; codes packed (ns, K, K/2 or 3K/4, 64) uint8/int8 for bits 8, 4 or 6 (6: signed codes -32..31,
// no minimums); scales (ns, K/gs, 64) float32 or float16, or factored (scale_kind); mins the same or None; isa
// "auto", "avx2" or "avx512". Returns (R, N) float32.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                      int64_t n, int64_t gs, int64_t bits, c10::optional<torch::Tensor> bias, std::string isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qlinear: x must be 2-D float32");
  const int64_t rows = x.size(0), k = x.size(1);
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->to(torch::kFloat32).contiguous();
  const QMeta q = qmeta(codes, scales, mins, k, n, gs, bits, &bc, isa);
  torch::Tensor xc = x.contiguous();
  auto out = torch::empty({rows, n}, x.options());
  qlinear_rows(q, xc.data_ptr<float>(), rows, out.data_ptr<float>(), n);
  return out;
}


// x (R, K) float32; 4-bit codes packed as for qlinear; scales/mins float32 or float16; isa as qlinear's
// ("avx512" needs AVX-512 VNNI). Returns (R, N) float32: the W4A8 product described above.
torch::Tensor qlinear_a8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                         int64_t n, int64_t gs, c10::optional<torch::Tensor> bias, std::string isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "qlinear_a8: x must be 2-D float32");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(gs > 0 && gs % 8 == 0 && k % gs == 0, "qlinear_a8: group size ", gs, " must be a multiple of 8 dividing K=", k);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == SP && codes.size(1) == k / 2 && codes.is_contiguous(),
              "qlinear_a8: packed 4-bit codes expected");
  const int64_t np = codes.size(0), ng = k / gs;
  const int skind = scale_kind(scales, mins, np, k, gs, "qlinear_a8");
  const bool has_min = mins.has_value() && mins->defined();
  const bool avx512 = (isa == "avx512" || (isa == "auto" && cpu_has_avx512())) && cpu_has_vnni512();
  TORCH_CHECK(isa != "avx512" || avx512, "qlinear_a8: this CPU has no AVX-512 VNNI");
  torch::Tensor xc = x.contiguous();
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;
  auto xq = torch::empty({rows, k}, torch::kInt8);
  auto dx = torch::empty({rows, ng}, x.options()), sxf = torch::empty({rows, ng}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* q = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  float* sp = sxf.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = xp + r * k + g * gs;
      float amax = 0.0f;
      for (int64_t i = 0; i < gs; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float d = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / d;
      int32_t sum = 0;
      for (int64_t b = 0; b < gs; b += 8)
        for (int64_t i = 0; i < 8; ++i) {
          const int32_t v = std::max(-127, std::min(127, static_cast<int32_t>(std::nearbyint(xg[b + i] * inv))));
          q[r * k + g * gs + b + (i % 2) * 4 + i / 2] = static_cast<int8_t>(v);  // evens, then odds
          sum += v;
        }
      dp[r * ng + g] = d;
      sp[r * ng + g] = static_cast<float>(sum);
    }
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->to(torch::kFloat32).contiguous();
  A8Args a{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(), has_min ? mins->data_ptr() : nullptr,
           k, gs, n, q, dp, sp, out.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr};
#define A8D(MIN)                                                                                   \
  if (skind == 1) { if (avx512) a8run<MIN, true, uint16_t>(a, rows); else a8run<MIN, false, uint16_t>(a, rows); } \
  else if (skind == 2) { if (avx512) a8run<MIN, true, Fac>(a, rows); else a8run<MIN, false, Fac>(a, rows); } \
  else { if (avx512) a8run<MIN, true, float>(a, rows); else a8run<MIN, false, float>(a, rows); }
  if (has_min) { A8D(true) } else { A8D(false) }
#undef A8D
  return out;
}


// ---- a forward's decoder layers in one call (issue 34: a step's work besides its products)
//
// Called op by op from Python, a Llama layer is about a dozen calls (norms, the four products, the
// rotary, the K/V append, attention, the residual adds), each 5-10 us of dispatch: about 3 ms of an
// 11 ms SmolLM2 step on its GGUF blocks. A DecoderStack holds each layer's matrices and norms as the
// engine packed them and runs a range of layers in one call, through the same functions in the same
// order as engine/runner.py's loop:
//     x = rms_norm(h); qkv = P_qkv(x); [q/k heads RMS-normed]; rope_(q and k heads); K/V rows appended
//     at slot `past`; o = P_o(attend(q, the keys the mask allows)); [o = rms_norm(o)]; h += o;
//     x = rms_norm(h); m = P_down(silu_mul(P_gate_up(x)) or gelu_tanh(gate) * up); [m = rms_norm(m)]; h += m
// (brackets: Qwen3's q/k norms, Gemma's post norms and GeGLU; each layer picks its rotary table).
// Invariants: every value equals the Python loop's bit for bit (the same kernels and aten ops on the
// same inputs; a residual add is one float32 rounding either way), so batch invariance and the k-row =
// k one-row identity carry over (tests/test_decoder_stack.py); the caller's `h` is never written (the
// stack adds into its own copy); the cache's position lists and the masks stay the caller's: `pasts`
// says where each layer appends, and the caller checks order and capacity first.

struct Mat {  // one matrix product as the engine packed it
  // 0: float panels (linear), 1: quantized codes (qlinear), 2: 4-bit codes x int8 rows (qlinear_a8), 3: the row
  // concatenation of `parts` (a fused q/k/v whose parts a GGUF stores in blocks of different layouts, such as a
  // Q4_K_M file's Q4_K q/k with a Q6_K v): each part is its own product, outputs side by side, so each output
  // keeps its part's chain
  int64_t kind = 0;
  torch::Tensor w, scales;
  c10::optional<torch::Tensor> mins, bias;
  int64_t n = 0, gs = 0, bits = 0;
  std::string isa = "auto";
  std::vector<Mat> parts;
  QMeta qm;  // kind 1: the product checked once (make_mat), for into()
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == 0) return linear(x, w, n, bias, isa);
    if (kind == 1) return qlinear(x, w, scales, mins, n, gs, bits, bias, isa);
    if (kind == 3) {
      std::vector<torch::Tensor> ys;
      ys.reserve(parts.size());
      for (const Mat& p : parts) ys.push_back(p(x));
      return torch::cat(ys, 1);
    }
    return qlinear_a8(x, w, scales, mins, n, gs, bias, isa);
  }
  // y (rows, n; row stride ldy) = this product of x (rows, k contiguous): operator()'s values, written in place
  // (DecoderStack's buffers) with no tensor made for a quantized product or a fused one's parts
  void into(const float* x, int64_t rows, int64_t k, float* y, int64_t ldy) const {
    if (kind == 1) {
      TORCH_CHECK(k == qm.k, "qlinear: x has ", k, " columns, the codes ", qm.k);
      qlinear_rows(qm, x, rows, y, ldy);
      return;
    }
    if (kind == 3) {
      int64_t off = 0;
      for (const Mat& p : parts) {
        p.into(x, rows, k, y + off, ldy);
        off += p.n;
      }
      return;
    }
    const torch::Tensor r = (*this)(torch::from_blob(const_cast<float*>(x), {rows, k}, torch::kFloat32));
    const float* rp = r.data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i) std::memcpy(y + i * ldy, rp + i * n, sizeof(float) * n);
  }
};

Mat make_parts(std::vector<Mat> parts) {
  TORCH_CHECK(!parts.empty(), "Mat: a concatenation needs parts");
  Mat m;
  m.kind = 3;
  for (const Mat& p : parts) m.n += p.n;
  m.parts = std::move(parts);
  return m;
}

Mat make_mat(int64_t kind, torch::Tensor w, c10::optional<torch::Tensor> scales, c10::optional<torch::Tensor> mins,
             c10::optional<torch::Tensor> bias, int64_t n, int64_t gs, int64_t bits, std::string isa) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "Mat: kind must be 0, 1 or 2");
  TORCH_CHECK(kind == 0 || (scales.has_value() && scales->defined()), "Mat: quantized panels need scales");
  Mat m;
  m.kind = kind;
  m.w = w;
  if (kind != 0) m.scales = *scales;
  if (mins.has_value() && mins->defined()) m.mins = mins;
  if (bias.has_value() && bias->defined()) m.bias = bias->to(torch::kFloat32).contiguous();
  m.n = n;
  m.gs = gs;
  m.bits = bits;
  m.isa = isa;
  if (kind == 1) {
    const int64_t cb = w.dim() == 3 ? w.size(1) : 0;  // code bytes per output: K, K/2 or 3K/4
    const int64_t k = bits == 8 ? cb : bits == 4 ? 2 * cb : 4 * cb / 3;
    m.qm = qmeta(w, m.scales, m.mins, k, n, gs, bits, m.bias.has_value() ? &*m.bias : nullptr, isa);
  }
  return m;
}

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  c10::optional<torch::Tensor> qk_norm, post_attn_norm, post_mlp_norm;  // (Hq + Hkv, D); (H,); (H,)
  int64_t rope = 0;  // which of forward()'s rotary tables
  Mat qkv, o, gate_up, down;
};

inline void add_into(float* h, const float* x, int64_t n) {  // h += x, elementwise (one rounding each)
  par_for(0, (n + 7) / 8, 4096, [&](int64_t b, int64_t e) {
    int64_t i = 8 * b;
    const int64_t stop = std::min(n, 8 * e);
    for (; i + 8 <= stop; i += 8) _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(x + i)));
    for (; i < stop; ++i) h[i] += x[i];
  });
}

// Where a DecoderStack's time goes (`selfspec profile`'s step breakdown; issue 48 asks where a second thread's
// time goes): while on, forward() adds each op's wall time to one of STACK_PARTS slots, in order: norms, q/k/v
// product, rotary and K/V writes, attention, o product, residual adds, gate/up product, activation, down product.
// Off by default (two clock reads an op when on); the accumulators are the process's, read and reset together.
constexpr int STACK_PARTS = 9;
inline std::atomic<bool> g_stack_prof{false};
inline std::array<int64_t, STACK_PARTS> g_stack_ns{};
inline int64_t g_stack_calls = 0;
struct StackClock {
  bool on;
  std::chrono::steady_clock::time_point t;
  StackClock() : on(g_stack_prof.load(std::memory_order_relaxed)) { if (on) t = std::chrono::steady_clock::now(); }
  void lap(int part) {  // the time since the last lap goes to `part`
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_stack_ns[part] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - t).count();
    t = now;
  }
};
void stack_profile(bool on) { g_stack_prof.store(on); }
std::vector<double> stack_profile_read() {  // [calls, then seconds per part], and resets them
  std::vector<double> out{static_cast<double>(g_stack_calls)};
  for (int64_t& ns : g_stack_ns) { out.push_back(ns * 1e-9); ns = 0; }
  g_stack_calls = 0;
  return out;
}

struct DecoderStack {
  int64_t hq, hkv, d;
  double eps;
  bool gelu;  // GeGLU (gelu with the tanh approximation) instead of SwiGLU
  torch::Tensor unit_d;  // the per-head norms' own weight: ones
  std::vector<Layer> layers;

  DecoderStack(int64_t hq_, int64_t hkv_, int64_t d_, double eps_, bool gelu_)
      : hq(hq_), hkv(hkv_), d(d_), eps(eps_), gelu(gelu_), unit_d(torch::ones({d_}, torch::kFloat32)) {
    TORCH_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0, "DecoderStack: bad head counts");
  }

  void add(torch::Tensor attn_norm, torch::Tensor mlp_norm, c10::optional<torch::Tensor> qk_norm,
           c10::optional<torch::Tensor> post_attn_norm, c10::optional<torch::Tensor> post_mlp_norm, int64_t rope,
           Mat qkv, Mat o, Mat gate_up, Mat down) {
    TORCH_CHECK(qkv.n == (hq + 2 * hkv) * d, "DecoderStack: the q/k/v product has ", qkv.n, " outputs, expected ",
                (hq + 2 * hkv) * d);
    const int64_t width = attn_norm.numel();  // the hidden size: every norm's, the o and down products' outputs
    TORCH_CHECK(attn_norm.scalar_type() == torch::kFloat32 && mlp_norm.scalar_type() == torch::kFloat32 &&
                    mlp_norm.numel() == width &&
                    (!post_attn_norm.has_value() || !post_attn_norm->defined() || post_attn_norm->numel() == width) &&
                    (!post_mlp_norm.has_value() || !post_mlp_norm->defined() || post_mlp_norm->numel() == width) &&
                    (layers.empty() || layers[0].attn_norm.numel() == width),
                "rms_norm: bad weight");
    TORCH_CHECK(o.n == width && down.n == width && gate_up.n % 2 == 0, "DecoderStack: a layer's o and down products "
                "must give ", width, " outputs and gate/up an even count");
    Layer ly{attn_norm.contiguous(), mlp_norm.contiguous(), c10::nullopt, c10::nullopt, c10::nullopt, rope,
             qkv, o, gate_up, down};
    if (qk_norm.has_value() && qk_norm->defined()) ly.qk_norm = qk_norm;
    if (post_attn_norm.has_value() && post_attn_norm->defined()) ly.post_attn_norm = post_attn_norm->contiguous();
    if (post_mlp_norm.has_value() && post_mlp_norm->defined()) ly.post_mlp_norm = post_mlp_norm->contiguous();
    layers.push_back(ly);
  }


  // h (T, H) float32: the rows entering layer `start`; kc/vc (L, Hkv, S, D) float32: the cache's buffers.
  // For layer start + i: pasts[i] its cached slots before these rows (-1: its attention is skipped, no K/V
  // written), mlp[i] whether its MLP runs, keep[i] whether its output is returned, mask_of[i] an index into
  // masks ((T, pasts[i] + T) additive) or -1 (causal after `past`). cos/sin: per rotary kind the rows'
  // tables (T, D). Returns [h after the last layer, then each kept layer's output in order].
  std::vector<torch::Tensor> forward(torch::Tensor h_in, torch::Tensor kc, torch::Tensor vc, int64_t start,
                                     std::vector<int64_t> pasts, std::vector<int64_t> run_mlp, std::vector<int64_t> keep,
                                     std::vector<torch::Tensor> masks, std::vector<int64_t> mask_of,
                                     std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, int64_t sinks,
                                     int64_t window) {
    const int64_t n_l = static_cast<int64_t>(pasts.size());
    TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == torch::kFloat32, "DecoderStack: h must be (T, H) float32");
    TORCH_CHECK(start >= 0 && start + n_l <= static_cast<int64_t>(layers.size()) &&
                    static_cast<int64_t>(run_mlp.size()) == n_l && static_cast<int64_t>(keep.size()) == n_l &&
                    static_cast<int64_t>(mask_of.size()) == n_l,
                "DecoderStack: per-layer lists must cover layers [start, start + len)");
    TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes() && kc.scalar_type() == torch::kFloat32 &&
                    vc.scalar_type() == torch::kFloat32 && kc.size(1) == hkv && kc.size(3) == d &&
                    kc.stride(3) == 1 && vc.stride(3) == 1,
                "DecoderStack: the cache must be (L, Hkv, S, D) float32");
    torch::Tensor h = h_in.contiguous().clone();
    const int64_t t_n = h.size(0), width = h.size(1), cap = kc.size(2);
    float* hp = h.data_ptr<float>();
    std::vector<torch::Tensor> out{h};
    TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256, "attend: head size ", d,
                " (16, 32, 64, 128 or 256 supported)");
    TORCH_CHECK(n_l == 0 || width == layers[start].attn_norm.numel(), "DecoderStack: rows of width ", width,
                ", the layers' is ", n_l ? layers[start].attn_norm.numel() : 0);  // add() checked each layer's widths
    for (auto& m : masks) m = m.contiguous();
    for (auto& c : cos) c = c.contiguous();
    for (auto& c : sin) c = c.contiguous();
    // one buffer for every activation of a layer, reused by each: the normed rows, q/k/v, attention, its
    // projection, gate/up and their product (a tensor an op made a few microseconds each at one row)
    int64_t nqkv = 0, ngu = 0;
    for (int64_t i = 0; i < n_l; ++i) {
      nqkv = std::max(nqkv, layers[start + i].qkv.n);
      ngu = std::max(ngu, layers[start + i].gate_up.n);
    }
    const int64_t natt = hq * d;
    torch::Tensor buf = torch::empty({t_n * (width + nqkv + natt + width + ngu + ngu / 2)}, h.options());
    float* x1p = buf.data_ptr<float>();
    float* qkvp = x1p + t_n * width;
    float* attp = qkvp + t_n * nqkv;
    float* op = attp + t_n * natt;
    float* gup = op + t_n * width;
    float* actp = gup + t_n * ngu;
    float* yp = op;  // the MLP's output reuses the attention projection's rows
    const auto f32 = h.options();
    StackClock clk;
    if (clk.on) ++g_stack_calls;
    for (int64_t i = 0; i < n_l; ++i) {
      const Layer& ly = layers[start + i];
      const int64_t l = start + i, past = pasts[i];
      if (past >= 0) {
        TORCH_CHECK(past + t_n <= cap, "DecoderStack: layer ", l, " needs ", past + t_n, " slots, the cache holds ", cap);
        TORCH_CHECK(ly.rope >= 0 && ly.rope < static_cast<int64_t>(cos.size()) && cos.size() == sin.size(),
                    "DecoderStack: layer ", l, " reads rotary table ", ly.rope, " of ", cos.size());
        rms_norm_rows(hp, ly.attn_norm.data_ptr<float>(), x1p, t_n, width, eps);
        clk.lap(0);
        const int64_t lq = ly.qkv.n;
        ly.qkv.into(x1p, t_n, width, qkvp, lq);
        clk.lap(1);
        float* qp = qkvp;  // each row's q heads, then its k heads (normed per head where the layer does)
        int64_t ldq = lq;
        torch::Tensor qk;
        if (ly.qk_norm.has_value()) {
          const int64_t heads = hq + hkv;
          const torch::Tensor qkv = torch::from_blob(qkvp, {t_n, lq}, f32);
          qk = (rms_norm(qkv.narrow(1, 0, heads * d).reshape({t_n * heads, d}), unit_d, eps).view({t_n, heads, d}) *
                *ly.qk_norm).view({t_n, heads * d}).contiguous();
          qp = qk.data_ptr<float>();
          ldq = heads * d;
        }
        const torch::Tensor& cs = cos[ly.rope];
        const torch::Tensor& sn = sin[ly.rope];
        TORCH_CHECK(cs.dim() == 2 && cs.size(0) == t_n && cs.size(1) == d && sn.sizes() == cs.sizes() && d % 16 == 0,
                    "rope_: bad shapes");
        rope_rows(qp, ldq, t_n, hq + hkv, d, cs.data_ptr<float>(), sn.data_ptr<float>());
        float* kp = kc.data_ptr<float>() + l * kc.stride(0);
        float* vp = vc.data_ptr<float>() + l * vc.stride(0);
        for (int64_t t = 0; t < t_n; ++t)
          for (int64_t g = 0; g < hkv; ++g) {
            std::memcpy(kp + g * kc.stride(1) + (past + t) * kc.stride(2), qp + t * ldq + (hq + g) * d,
                        sizeof(float) * d);
            std::memcpy(vp + g * vc.stride(1) + (past + t) * vc.stride(2), qkvp + t * lq + (hq + hkv + g) * d,
                        sizeof(float) * d);
          }
        const float* mp = nullptr;
        if (mask_of[i] >= 0) {
          const torch::Tensor& mk = masks.at(mask_of[i]);
          TORCH_CHECK(mk.scalar_type() == torch::kFloat32 && mk.dim() == 2 && mk.size(0) == t_n &&
                          mk.size(1) == past + t_n,
                      "attend: mask must be (T, n_keys) float32");
          mp = mk.data_ptr<float>();
        }
        clk.lap(2);
        attend_rows(qp, ldq, t_n, hq, hkv, d, kp, kc.stride(1), kc.stride(2), vp, vc.stride(1), vc.stride(2),
                    past + t_n, mp, past, sinks, window, attp);
        clk.lap(3);
        ly.o.into(attp, t_n, natt, op, width);
        clk.lap(4);
        if (ly.post_attn_norm.has_value()) rms_norm_rows(op, ly.post_attn_norm->data_ptr<float>(), op, t_n, width, eps);
        clk.lap(0);
        add_into(hp, op, t_n * width);
        clk.lap(5);
      }
      if (run_mlp[i]) {
        rms_norm_rows(hp, ly.mlp_norm.data_ptr<float>(), x1p, t_n, width, eps);
        clk.lap(0);
        const int64_t ng = ly.gate_up.n, ni = ng / 2;
        ly.gate_up.into(x1p, t_n, width, gup, ng);
        clk.lap(6);
        const float* ap = actp;
        torch::Tensor a;
        if (!gelu) {
          silu_mul_rows(gup, actp, t_n, ni);
        } else {
          const torch::Tensor gu = torch::from_blob(gup, {t_n, ng}, f32);
          a = (at::gelu(gu.narrow(1, 0, ni), "tanh") * gu.narrow(1, ni, ni)).contiguous();
          ap = a.data_ptr<float>();
        }
        clk.lap(7);
        ly.down.into(ap, t_n, ni, yp, width);
        clk.lap(8);
        if (ly.post_mlp_norm.has_value()) rms_norm_rows(yp, ly.post_mlp_norm->data_ptr<float>(), yp, t_n, width, eps);
        clk.lap(0);
        add_into(hp, yp, t_n * width);
        clk.lap(5);
      }
      if (keep[i]) out.push_back(h.clone());
    }
    return out;
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "y = x W^T (+ b) with W quantized (8-bit or 4-bit codes, per-group scales), batch-invariant");
  m.def("qlinear_a8", &qlinear_a8, "y = x W^T (+ b): 4-bit codes times int8-quantized x (W4A8), a draft's product");
  m.def("set_threads", &set_threads, "the pool's size (threads in all), and its idle workers' spin and yield times (us; -1 keeps)");
  m.def("get_threads", &get_threads, "the pool's size");
  m.def("pool_split_all", &pool_split_all, "tests: post every loop of two or more indices to the pool, whatever its grain");
  m.def("pool_chunks", &pool_chunks, "chunks a loop is cut into, per thread (default 1)");
  m.def("pool_loops", &pool_loops, "loops the pool has run on its workers so far");
  m.def("stack_profile", &stack_profile, "time each op of DecoderStack.forward (off by default)");
  m.def("stack_profile_read", &stack_profile_read, "[forwards, then seconds per op kind] since the last read; resets");
  m.def("qisa", &qisa, "the instruction set qlinear dispatches to on this CPU");

  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("pack", &pack, "repack a (N, K) weight into panels of 16 outputs, k-major");
  m.def("linear", &linear, "y = x W^T (+ b) for a few rows, batch-invariant");
  m.def("attend", &attend, "attention of a few query rows over cached keys/values");
  m.def("rope_", &rope_, "rotary embedding in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax (first maximum, NaN first)");

  py::class_<Mat>(m, "Mat");
  m.def("mat", &make_mat, "one packed matrix product for a DecoderStack (kind 0 linear, 1 qlinear, 2 qlinear_a8)");
  m.def("mat_parts", &make_parts, "the row concatenation of products (kind 3): a fused matrix of several layouts");
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, bool>())
      .def("add", &DecoderStack::add, "append a layer: its norms' weights, rotary table and four products")
      .def("forward", &DecoderStack::forward, "run layers [start, start + len(pasts)) on rows h in one call");
}
