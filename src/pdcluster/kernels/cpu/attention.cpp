// Paged decode attention for the CPU (AVX-512): one query token per sequence against its paged KV cache.
//
// K/V are read straight from the cache through the block table (no gathered copy), softmax is online over
// chunks of positions, and the query heads of one KV head share every K/V row read (GQA). Work items are
// (sequence, KV head) pairs shared through pool.h (the caller and spinning helpers claim them one by one).
// Math is float32 whatever the cache holds: fp32, fp16, bf16, int8 codes with a
// float32 scale per (token, head), or packed int4 (low nibble = even index) with the same scales.
//
// int4 trick: the dot product does not care about element order, so q is permuted once into the order the
// nibbles unpack in (per 32 elements: the 16 even ones, then the 16 odd ones), the output accumulates in that
// order too, and is permuted back at the end: no interleave in the inner loop.
// Narrow ATen headers rather than <torch/extension.h> (all of libtorch's C++ API): the first-use build takes
// ~20 s instead of ~3 min on the 2-core box.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "pool.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int CHUNK = 128;  // positions per online-softmax step (scores stay in L1)
constexpr int SCS = CHUNK + 4;  // a query head's row of scores: the chunk, then zeros up to a multiple of 4
// Positions ahead whose K and V rows are prefetched into L2 during the score pass (V is read in pass 3).
// Why: rows are scattered over blocks and, for one KV head, 1 in kv_heads of a block's lines, which the
// hardware prefetchers do not follow; without it a batch-16 step's attention read its (cold) cache at ~4 GB/s.
// Why L2 and not L1 for K: the L1 has few miss buffers, and 16 positions of K lines in flight to it stalled
// the loop; into L2, the cold 8-layer batch-16 benchmark went 8.1 -> 6.0 ms (ninth pass, engine.md), and
// an L2-hot row costs the score loop little. Distances of 8-32 positions measured alike; 64 was slower.
constexpr int PF = 16;

inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(row + o), _MM_HINT_T1);
}

enum class Kind { F32, F16, BF16, I8, I4 };

// exp for 16 floats: Cephes' polynomial on x - n*ln2, scaled by 2^n with scalef (which also underflows to 0
// cleanly); relative error ~2 ulp over the range softmax uses (inputs <= 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Four horizontal sums at once: {sum(a), sum(b), sum(c), sum(d)} (a third of the shuffles of four reductions).
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Vector j (16 floats, in the kernel's element order) of a cache row; `m` masks the tail of the last vector.
template <Kind K>
inline __m512 load_row(const void* row, int j, __mmask16 m) {
  if constexpr (K == Kind::F32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(row) + 16 * j);
  } else if constexpr (K == Kind::F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + 16 * j));
  } else if constexpr (K == Kind::BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(row) + 16 * j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (K == Kind::I8) {
    __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const int8_t*>(row) + 16 * j);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {  // I4: 16 bytes hold 32 elements; even j = low nibbles (even elements), odd j = high nibbles
    __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + 16 * (j >> 1))));
    __m512i v = (j & 1) ? _mm512_srai_epi32(_mm512_slli_epi32(b, 24), 28)
                        : _mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28);
    return _mm512_cvtepi32_ps(v);
  }
}

// The kernel's element order -> the logical element: identity, except int4's per-32 even/odd split.
inline int logical(Kind k, int e) {
  if (k != Kind::I4) return e;
  int base = e & ~31, r = e & 31;
  return base + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
}

struct Args {
  const float* q;          // [seqs, heads, d] float32, rows `q_stride` apart (heads contiguous within a row)
  const uint8_t* k;        // cache rows, `row_bytes` apart: [blocks, block_size, kv_heads, row]
  const uint8_t* v;
  const float* ks;         // [blocks, block_size, kv_heads] float32, or null (float caches)
  const float* vs;
  const int32_t* bt;       // [seqs, max_blocks]
  const int32_t* lens;     // [seqs]
  float* out;              // [seqs, heads, d] float32
  int64_t row_bytes, bt_stride, q_stride;
  int heads, kv_heads, d, block_size, window;
  float scale, softcap;
};

template <Kind K>
void attend_one(const Args& a, int64_t s, int h) {
  const int G = a.heads / a.kv_heads, D = a.d, NV = (D + 15) / 16;
  const __mmask16 tail = (D % 16) ? static_cast<__mmask16>((1u << (D % 16)) - 1) : 0xFFFF;
  const int len = a.lens[s];
  float* out = a.out + (s * a.heads + static_cast<int64_t>(h) * G) * D;
  if (len <= 0) {
    std::fill(out, out + static_cast<int64_t>(G) * D, 0.0f);
    return;
  }
  const int start = a.window > 0 ? std::max(0, len - a.window) : 0;
  // q (scaled, in kernel order), accumulators, running max and sum: per query head of this group
  std::vector<float> buf(static_cast<size_t>(G) * (2 * NV * 16 + SCS) + 2 * G);
  float* qs = buf.data();
  float* acc = qs + G * NV * 16;
  float* sc = acc + G * NV * 16;            // scores then probabilities [G][SCS]
  float* mx = sc + G * SCS;
  float* sum = mx + G;
  const float* qrow = a.q + s * a.q_stride + static_cast<int64_t>(h) * G * D;
  for (int g = 0; g < G; ++g) {
    for (int e = 0; e < NV * 16; ++e) {
      int l = logical(K, e);
      qs[g * NV * 16 + e] = l < D ? qrow[g * D + l] * a.scale : 0.0f;
      acc[g * NV * 16 + e] = 0.0f;
    }
    mx[g] = -std::numeric_limits<float>::infinity();
    sum[g] = 0.0f;
  }
  const int32_t* table = a.bt + s * a.bt_stride;
  const bool quant = (K == Kind::I8 || K == Kind::I4);
  int64_t idx[CHUNK + PF];  // (slot * kv_heads + h) of each position of the chunk, then of the lookahead
  for (int c0 = start; c0 < len; c0 += CHUNK) {
    const int n = std::min(CHUNK, len - c0);
    const int ne = std::min(CHUNK + PF, len - c0);
    // Walk the block table once per chunk (no division per position; shared by the K and V passes)
    int blk = c0 / a.block_size, off = c0 % a.block_size;
    for (int t = 0; t < ne; ++t) {
      idx[t] = (static_cast<int64_t>(table[blk]) * a.block_size + off) * a.kv_heads + h;
      if (++off == a.block_size) off = 0, ++blk;
    }
    // 1. scores, four positions at a time; query heads in pairs so each K row load serves two of them.
    // Positions past n (the last group of four) read row n - 1 again; their scores are dropped.
    for (int t = 0; t < n; t += 4) {
      for (int i = 0; i < 4 && t + PF + i < ne; ++i) {
        prefetch_row(a.k + idx[t + PF + i] * a.row_bytes, a.row_bytes);
        prefetch_row(a.v + idx[t + PF + i] * a.row_bytes, a.row_bytes);
      }
      const void* rows[4];
      float kscale[4] = {1.f, 1.f, 1.f, 1.f};
      for (int i = 0; i < 4; ++i) {
        const int64_t r = idx[std::min(t + i, n - 1)];
        rows[i] = a.k + r * a.row_bytes;
        if (quant) kscale[i] = a.ks[r];
      }
      const __m128 vks = _mm_loadu_ps(kscale);
      for (int g = 0; g < G; g += 2) {
        const bool pair = g + 1 < G;
        const float* q0 = qs + g * NV * 16;
        const float* q1 = pair ? q0 + NV * 16 : q0;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, u0 = s0, u1 = s0, u2 = s0, u3 = s0;
        for (int j = 0; j < NV; ++j) {
          __mmask16 m = (K == Kind::I4 || j < NV - 1) ? 0xFFFF : tail;
          const __m512 r0 = load_row<K>(rows[0], j, m), r1 = load_row<K>(rows[1], j, m);
          const __m512 r2 = load_row<K>(rows[2], j, m), r3 = load_row<K>(rows[3], j, m);
          const __m512 qa = _mm512_loadu_ps(q0 + 16 * j), qb = _mm512_loadu_ps(q1 + 16 * j);
          s0 = _mm512_fmadd_ps(qa, r0, s0), s1 = _mm512_fmadd_ps(qa, r1, s1);
          s2 = _mm512_fmadd_ps(qa, r2, s2), s3 = _mm512_fmadd_ps(qa, r3, s3);
          if (pair) {
            u0 = _mm512_fmadd_ps(qb, r0, u0), u1 = _mm512_fmadd_ps(qb, r1, u1);
            u2 = _mm512_fmadd_ps(qb, r2, u2), u3 = _mm512_fmadd_ps(qb, r3, u3);
          }
        }
        float tmp[8];
        _mm_storeu_ps(tmp, _mm_mul_ps(hsum4(s0, s1, s2, s3), vks));
        _mm_storeu_ps(tmp + 4, _mm_mul_ps(hsum4(u0, u1, u2, u3), vks));
        for (int i = 0; i < 4 && t + i < n; ++i) {
          sc[g * SCS + t + i] = tmp[i];
          if (pair) sc[(g + 1) * SCS + t + i] = tmp[4 + i];
        }
      }
    }
    // 2. online softmax: rescale what was accumulated to the new max, exponentiate this chunk
    for (int g = 0; g < G; ++g) {
      float* sg = sc + g * SCS;
      if (a.softcap > 0.0f)
        for (int t = 0; t < n; ++t) sg[t] = std::tanh(sg[t] / a.softcap) * a.softcap;
      float m = mx[g];
      for (int t = 0; t < n; ++t) m = std::max(m, sg[t]);
      const float alpha = mx[g] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(mx[g] - m);
      mx[g] = m;
      __m512 vm = _mm512_set1_ps(m), total = _mm512_setzero_ps();
      for (int t = 0; t < n; t += 16) {
        __mmask16 mk = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
        __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), vm));
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mk, p));
        _mm512_mask_storeu_ps(sg + t, mk, p);
      }
      sum[g] = sum[g] * alpha + _mm512_reduce_add_ps(total);
      if (alpha != 1.0f) {
        __m512 va = _mm512_set1_ps(alpha);
        float* ag = acc + g * NV * 16;
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(ag + 16 * j, _mm512_mul_ps(va, _mm512_loadu_ps(ag + 16 * j)));
      }
    }
    // 3. acc += p * V. The V scales (and zeros past n) are folded into p first; then, per 16-float column
    // block of a row, four accumulators per query head stay in registers over the whole chunk: independent
    // FMA chains, not a load-FMA-FMA-FMA-FMA-store chain per four positions through memory.
    const int n4 = (n + 3) & ~3;
    for (int g = 0; g < G; ++g) {
      float* sg = sc + g * SCS;
      if (quant)
        for (int t = 0; t < n; ++t) sg[t] *= a.vs[idx[t]];
      for (int t = n; t < n4; ++t) sg[t] = 0.0f;  // padding positions re-read row n - 1 with weight 0
    }
    const uint8_t* vrow[CHUNK + 3];  // the V row of each position, the padding re-reading row n - 1
    for (int t = 0; t < n4; ++t) vrow[t] = a.v + idx[std::min(t, n - 1)] * a.row_bytes;
    for (int g = 0; g < G; g += 2) {
      const bool pair = g + 1 < G;
      const float* p0 = sc + g * SCS;
      const float* p1 = pair ? p0 + SCS : p0;
      float* a0 = acc + g * NV * 16;
      for (int j = 0; j < NV; ++j) {
        const __mmask16 m = (K == Kind::I4 || j < NV - 1) ? 0xFFFF : tail;
        __m512 x0 = _mm512_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, y0 = x0, y1 = x0, y2 = x0, y3 = x0;
        for (int t = 0; t < n4; t += 4) {
          const __m512 r0 = load_row<K>(vrow[t], j, m), r1 = load_row<K>(vrow[t + 1], j, m);
          const __m512 r2 = load_row<K>(vrow[t + 2], j, m), r3 = load_row<K>(vrow[t + 3], j, m);
          x0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t]), r0, x0);
          x1 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t + 1]), r1, x1);
          x2 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t + 2]), r2, x2);
          x3 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t + 3]), r3, x3);
          if (pair) {
            y0 = _mm512_fmadd_ps(_mm512_set1_ps(p1[t]), r0, y0);
            y1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[t + 1]), r1, y1);
            y2 = _mm512_fmadd_ps(_mm512_set1_ps(p1[t + 2]), r2, y2);
            y3 = _mm512_fmadd_ps(_mm512_set1_ps(p1[t + 3]), r3, y3);
          }
        }
        float* dst = a0 + 16 * j;
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst),
                                            _mm512_add_ps(_mm512_add_ps(x0, x1), _mm512_add_ps(x2, x3))));
        if (pair) {
          dst += NV * 16;
          _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst),
                                              _mm512_add_ps(_mm512_add_ps(y0, y1), _mm512_add_ps(y2, y3))));
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / sum[g];
    for (int e = 0; e < NV * 16; ++e) {
      int l = logical(K, e);
      if (l < D) out[g * D + l] = acc[g * NV * 16 + e] * inv;
    }
  }
}

template <Kind K>
void run(const Args& a, int64_t seqs, bool parallel) {
  const int64_t items = seqs * a.kv_heads;
  auto item = [&](int64_t i) { attend_one<K>(a, i / a.kv_heads, static_cast<int>(i % a.kv_heads)); };
  if (parallel) {
    pdc::share(items, item);
  } else {
    for (int64_t i = 0; i < items; ++i) item(i);
  }
}

Kind kind_of(const at::Tensor& cache, bool has_scales) {
  switch (cache.scalar_type()) {
    case at::kFloat: return Kind::F32;
    case at::kHalf: return Kind::F16;
    case at::kBFloat16: return Kind::BF16;
    case at::kChar: TORCH_CHECK(has_scales, "k_scale/v_scale are required for an int8 cache"); return Kind::I8;
    case at::kByte: TORCH_CHECK(has_scales, "k_scale/v_scale are required for an int4 cache"); return Kind::I4;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", cache.scalar_type());
  }
}

}  // namespace

// q [seqs, heads, d] float32 contiguous; caches [blocks, block_size, kv_heads, d (d/2 for int4)] contiguous;
// scales [blocks, block_size, kv_heads] float32 or undefined; block_tables int32 [seqs, max_blocks];
// seq_lens int32 [seqs]; window 0 = none; softcap 0 = none; parallel_min = work (positions x kv heads)
// below which the call stays on the calling thread. Returns [seqs, heads, d] float32.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                           at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                           double softcap, int64_t parallel_min) {
  // q may be a slice of the fused QKV output (rows further apart than heads * d): no copy needed
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2) &&
              q.stride(0) >= q.size(1) * q.size(2),
              "q: float32 [seqs, heads, d], each row's heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache/v_cache: contiguous [blocks, block_size, kv_heads, row] of one dtype");
  const bool has_scales = k_scale.has_value() && k_scale->defined();
  const Kind kind = kind_of(k_cache, has_scales);
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t blocks = k_cache.size(0), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(kvh > 0 && heads % kvh == 0, "heads ", heads, " is not a multiple of kv_heads ", kvh);
  TORCH_CHECK(d > 0 && d <= 512, "head_dim must be in 1..512");
  TORCH_CHECK(k_cache.size(3) == (kind == Kind::I4 ? d / 2 : d), "cache row does not match head_dim");
  TORCH_CHECK(kind != Kind::I4 || d % 32 == 0, "an int4 cache needs head_dim % 32 == 0");
  if (has_scales) {
    TORCH_CHECK(v_scale.has_value() && v_scale->defined(), "v_scale is required with k_scale");
    for (const auto& sc : {*k_scale, *v_scale})
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 3 &&
                  sc.size(0) == blocks && sc.size(1) == bs && sc.size(2) == kvh,
                  "scales: float32 [blocks, block_size, kv_heads]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == seqs &&
              block_tables.stride(1) == 1, "block_tables: int32 [seqs, max_blocks], rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == seqs,
              "seq_lens: int32 [seqs]");
  // Every block a sequence reads must exist: a bad table is an error here, never an out-of-bounds read.
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  int64_t work = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t len = lens[s];
    TORCH_CHECK(len >= 0 && len <= max_blocks * bs, "seq_lens[", s, "] = ", len, " outside 0..", max_blocks * bs);
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t b = first / bs; b * bs < len; ++b) {
      const int32_t id = bt[s * block_tables.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < blocks, "block_tables[", s, ", ", b, "] = ", id, " is not a block of the cache");
    }
    work += (len - first) * kvh;
  }
  auto out = at::empty({seqs, heads, d}, q.options());
  Args a{q.data_ptr<float>(), static_cast<const uint8_t*>(k_cache.data_ptr()),
         static_cast<const uint8_t*>(v_cache.data_ptr()), has_scales ? k_scale->data_ptr<float>() : nullptr,
         has_scales ? v_scale->data_ptr<float>() : nullptr, bt, lens, out.data_ptr<float>(),
         k_cache.size(3) * static_cast<int64_t>(k_cache.element_size()), block_tables.stride(0), q.stride(0),
         static_cast<int>(heads), static_cast<int>(kvh), static_cast<int>(d), static_cast<int>(bs),
         static_cast<int>(std::max<int64_t>(window, 0)), static_cast<float>(scale), static_cast<float>(softcap)};
  const bool parallel = work >= parallel_min;
  switch (kind) {
    case Kind::F32: run<Kind::F32>(a, seqs, parallel); break;
    case Kind::F16: run<Kind::F16>(a, seqs, parallel); break;
    case Kind::BF16: run<Kind::BF16>(a, seqs, parallel); break;
    case Kind::I8: run<Kind::I8>(a, seqs, parallel); break;
    case Kind::I4: run<Kind::I4>(a, seqs, parallel); break;
  }
  return out;
}

void bind_attention(pybind11::module_& m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a paged KV cache (AVX-512)");
}
