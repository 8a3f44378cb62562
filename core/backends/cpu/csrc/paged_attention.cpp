// Paged attention for the CPU: every query token attends to its own request's cached K/V, read in
// place from the block pool (no gather copy). One task per (query token, KV head), or per (run of
// consecutive prompt tokens of one request, KV head); the query heads sharing that KV head (of every
// token in the run) are done together, so each K/V row read serves all of them.
//
// Two layouts of the pool, one arithmetic each (KVCache, `kv_pairs` below):
// - plain (float32, fp16, and bf16 where the CPU has no bf16 product for the shape): keys
//   [blocks, Hkv, D, bs] (each block transposed, so q.k over a block's keys is a vector loop without
//   horizontal sums), values [blocks * bs, Hkv, D]. The FMA path: q.k and P.V as fused multiply-adds on
//   floats, in key order.
// - pairs (bf16, head_dim 64, block size 16, on CPUs with AMX tiles or AVX512-BF16): keys
//   [blocks, Hkv, D / 2, bs, 2] and values [blocks, Hkv, bs / 2, D, 2], bf16 pairs side by side as the
//   bf16 product instructions read them (rope_store writes them so). The products path: q.k and P.V as
//   products of bf16 pairs, on AMX tiles or with VDPBF16PS.
//
// Exactness: the path is a property of the pool, never of the rows. A query row takes the same
// arithmetic whether it is a decode, a fresh prompt's row or a later chunk's, and whatever rows share
// its task: a vector's scores are its own dot products; its softmax runs over its own keys only (a run's
// later keys get weight exactly 0, and adding 0 x v changes no sum); every sum runs in key order. So a
// row's output is the same alone and in any step (tests/core/test_exactness_kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <numeric>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "vec16.h"
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define CONVEYOR_HAS_MXCSR 1
#endif

namespace conveyor_paged_attention {  // named: these files share a translation unit (kernels.py, _UNITS)

// Attention weights of far-away keys underflow into subnormal floats, which x86 CPUs process
// up to 100x slower; flush them to zero (FTZ + DAZ) while the kernel runs, on every worker thread.
struct FlushDenormals {
#ifdef CONVEYOR_HAS_MXCSR
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Element i of a row as float. bf16 is widened with a shift on its raw bits (a pattern compilers
// vectorize; c10's conversion function call inside the loop is not).
template <typename scalar_t>
static inline float load_f32(const scalar_t* __restrict__ p, int64_t i) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(p[i]);
  }
}

// What a layer's attention computes beyond softmax(scale q.k) v, as the model defines it (transformers' own
// attention: the sliding window of its mask, the softcap and sinks it hands the attention function).
struct Variant {
  int64_t window = 0;         // > 0: a query at position p sees keys (p - window, p] only
  float softcap = 0.f;        // > 0: scores -> softcap * tanh(scores / softcap), before the softmax
  const float* sinks = nullptr;  // [H] or null: per query head, a logit that joins each softmax's denominator
};

// The keys one query vector weighs: [lo, lim), relative to the task's first key (a multiple of 16 from key
// 0, so the 16 lanes of every sum below hold the same keys whatever task the vector is in); its sink logit.
struct Span {
  int64_t lo, lim;
  const float* sink;  // null: none
};

// scores -> softcap * tanh(scores * pre / softcap) over s[lo, n), in place.
static inline void softcap_range(float* __restrict__ s, int64_t lo, int64_t n, float pre, float softcap) {
  const float inv = pre / softcap;
  int64_t j = lo;
  for (; j + 16 <= n; j += 16) {
    v16f x;
    x = load16(s + j);
    x = tanh16(x * inv) * softcap;
    store16(s + j, x);
  }
  if (j < n) {  // the tail through a padded vector: the same arithmetic per element
    v16f x = {};
    std::memcpy(&x, s + j, sizeof(float) * (n - j));
    x = tanh16(x * inv) * softcap;
    std::memcpy(s + j, &x, sizeof(float) * (n - j));
  }
}

// s[lo..n) <- softmax(s[lo..n)) (with the sink's exp in the denominator), s[0..lo) and s[n..end) <- 0, in
// float; s must have room for n rounded up to 16. Lane i of the max and the sum holds the keys that are i
// mod 16, so a vector's weights depend on its own keys only.
static inline void softmax_range(float* __restrict__ s, const Span& r, int64_t end, float softcap) {
  const int64_t lo = r.lo, n = r.lim;
  if (softcap > 0.f) softcap_range(s, lo, n, 1.f, softcap);
  const int64_t first = lo / 16 * 16, padded = (n + 15) / 16 * 16;
  for (int64_t j = n; j < padded; ++j) s[j] = -INFINITY;
  for (int64_t j = first; j < lo; ++j) s[j] = -INFINITY;
  v16f mv = v16f{} - INFINITY;
  for (int64_t j = first; j < padded; j += 16) {
    v16f x;
    x = load16(s + j);
    mv = select16(x > mv, x, mv);
  }
  float m = mv[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, mv[i]);
  if (r.sink) m = std::max(m, *r.sink);
  v16f sum = {};
  for (int64_t j = first; j < padded; j += 16) {
    v16f x;
    x = load16(s + j);
    x = exp16(x - m);
    if (j + 16 > n || j < lo) {  // lanes outside [lo, n) count for nothing
      for (int64_t i = 0; i < 16; ++i)
        if (j + i < lo || j + i >= n) x[i] = 0.f;
    }
    store16(s + j, x);
    sum += x;
  }
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += sum[i];
  if (r.sink) total += std::exp(*r.sink - m);
  const float inv = 1.f / total;
  for (int64_t j = lo; j < n; ++j) s[j] *= inv;
  std::fill(s, s + lo, 0.f);
  if (end > n) std::fill(s + n, s + end, 0.f);
}

// The pool's blocks are scattered, so the hardware prefetcher cannot run ahead across a block
// table; the fast path below requests the rows of the block PF blocks ahead (prefetch_l2, vec16.h)
// one or two cache lines at a time while it computes on the current block (the B=64 bf16
// attention of SmolLM2 went from ~43 to ~26 ms per step in a cold-pool benchmark with the next
// block; 4 blocks ahead instead of 1 took another 6-12% off a 64-row decode call on a cold pool,
// as one block of compute, ~50 ns, is shorter than a miss to memory; in the engine, whose blocks
// are reused warm from the free list, the difference was within noise).

// Fast path (block_size 16, head_dim 16 * NV), the group size G known at compile time: each key
// row and value row is loaded (and widened from bf16) once for the G query heads sharing it, with
// scores and the weighted sum of values in register accumulators.
constexpr int64_t PF = 4;  // blocks ahead that the fast path prefetches

template <int NV, int G, typename scalar_t>
static void attend_grouped(const float* __restrict__ qf, const scalar_t* __restrict__ k_cache,
                           const scalar_t* __restrict__ v_cache, const int64_t* table, int64_t ctx,
                           const Span* spans, float softcap, int64_t h, int64_t Hkv, float* __restrict__ scores,
                           float* __restrict__ out_f) {
  constexpr int64_t D = 16 * NV, bs = 16;
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  const int64_t sstride = (ctx + 15) / 16 * 16;
  for (int64_t b = 1; b < std::min<int64_t>(PF, num_blocks); ++b)  // the blocks before the first prefetched in the loop
    prefetch_l2(k_cache + (table[b] * Hkv + h) * D * bs, D * bs);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* __restrict__ kb = k_cache + (table[b] * Hkv + h) * D * bs;
    const scalar_t* kb_next = b + PF < num_blocks ? k_cache + (table[b + PF] * Hkv + h) * D * bs : nullptr;
    const int64_t n = std::min(bs, ctx - b * bs);
    v16f even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = v16f{};
    for (int64_t d = 0; d < D; d += 2) {
      if (kb_next) prefetch_l2(kb_next + d * bs, 2 * bs);  // the same two rows, PF blocks ahead
      const v16f k0 = load16(kb + d * bs), k1 = load16(kb + (d + 1) * bs);
      for (int g = 0; g < G; ++g) {
        even[g] = fma16(splat16(qf[g * D + d]), k0, even[g]);
        odd[g] = fma16(splat16(qf[g * D + d + 1]), k1, odd[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const v16f sum = even[g] + odd[g];
      float* dst = scores + g * sstride + b * bs;
      for (int64_t o = 0; o < n; ++o) dst[o] = sum[o];
    }
  }
  const int64_t stride = Hkv * D;
  for (int64_t b = 0; b < std::min<int64_t>(PF, num_blocks); ++b)  // during the softmax
    for (int64_t o = 0; o < std::min(bs, ctx - b * bs); ++o) prefetch_l2(v_cache + ((table[b] * bs + o) * Hkv + h) * D, D);
  for (int g = 0; g < G; ++g)  // a vector sees keys [lo, lim) of its span; the rest weigh nothing
    softmax_range(scores + g * sstride, spans[g], ctx, softcap);
  v16f acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = v16f{};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = std::min(bs, ctx - b * bs);
    const scalar_t* __restrict__ vb = v_cache + (table[b] * bs * Hkv + h) * D;
    const scalar_t* vb_next = b + PF < num_blocks ? v_cache + (table[b + PF] * bs * Hkv + h) * D : nullptr;
    for (int64_t o = 0; o < n; ++o) {
      if (vb_next) prefetch_l2(vb_next + o * stride, D);  // the same row, PF blocks ahead
      v16f v[NV];
      for (int i = 0; i < NV; ++i) v[i] = load16(vb + o * stride + 16 * i);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * sstride + b * bs + o];
        for (int i = 0; i < NV; ++i) acc[g][i] = fma16(splat16(p), v[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) store16(out_f + g * D + 16 * i, acc[g][i]);
}

// Dispatch on the number of query vectors: up to 8 per pass over the keys and values (more would
// not fit the accumulators in registers).
template <int NV, typename scalar_t>
static void attend_dispatch(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                            int64_t ctx, const Span* spans, float softcap, int64_t h, int64_t G, int64_t Hkv,
                            float* scores, float* out_f) {
  constexpr int64_t D = 16 * NV;
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* q = qf + g0 * D;
    const Span* lim = spans + g0;
    float* out = out_f + g0 * D;
    switch (std::min<int64_t>(8, G - g0)) {
      case 1: attend_grouped<NV, 1>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 2: attend_grouped<NV, 2>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 3: attend_grouped<NV, 3>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 4: attend_grouped<NV, 4>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 5: attend_grouped<NV, 5>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 6: attend_grouped<NV, 6>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      case 7: attend_grouped<NV, 7>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
      default: attend_grouped<NV, 8>(q, k_cache, v_cache, table, ctx, lim, softcap, h, Hkv, scores, out); break;
    }
  }
}

// The fast path (block size 16) at head dim D: 32, 64 or 128.
template <typename scalar_t>
static void attend_fast(int64_t D, const float* qf, const scalar_t* k_cache, const scalar_t* v_cache,
                        const int64_t* table, int64_t ctx, const Span* spans, float softcap, int64_t h, int64_t vecs,
                        int64_t Hkv, float* scores, float* out_f) {
  if (D == 64)
    attend_dispatch<4>(qf, k_cache, v_cache, table, ctx, spans, softcap, h, vecs, Hkv, scores, out_f);
  else if (D == 128)
    attend_dispatch<8>(qf, k_cache, v_cache, table, ctx, spans, softcap, h, vecs, Hkv, scores, out_f);
  else
    attend_dispatch<2>(qf, k_cache, v_cache, table, ctx, spans, softcap, h, vecs, Hkv, scores, out_f);
}

// Any block size / head_dim: plain loops.
template <typename scalar_t>
static void attend_generic(const float* __restrict__ qf, const scalar_t* __restrict__ k_cache,
                           const scalar_t* __restrict__ v_cache, const int64_t* table, int64_t ctx,
                           const Span* spans, float softcap, int64_t h, int64_t G, int64_t Hkv, int64_t D, int64_t bs,
                           float* __restrict__ scores, float* __restrict__ out_f) {
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  const int64_t sstride = (ctx + 15) / 16 * 16;  // scores row per head, padded for softmax_range
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* __restrict__ kb = k_cache + (table[b] * Hkv + h) * D * bs;
    const int64_t n = std::min(bs, ctx - b * bs);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t o = 0; o < n; ++o) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc = std::fma(qf[g * D + d], load_f32(kb + d * bs, o), acc);
        scores[g * sstride + b * bs + o] = acc;
      }
  }
  std::fill(out_f, out_f + G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict__ sg = scores + g * sstride;
    softmax_range(sg, spans[g], ctx, softcap);
    float* __restrict__ ag = out_f + g * D;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t n = std::min(bs, ctx - b * bs);
      const scalar_t* __restrict__ vb = v_cache + (table[b] * bs * Hkv + h) * D;
      for (int64_t o = 0; o < n; ++o) {
        const float pj = sg[b * bs + o];
        const scalar_t* __restrict__ v = vb + o * Hkv * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] = std::fma(pj, load_f32(v, d), ag[d]);
      }
    }
  }
}

constexpr int64_t PAIR_QTILES = 4;  // query tiles (16 vectors each) per run of prompt rows

// The products path (pair layout: head_dim 64, block size 16). Up to 64 query vectors (R rows x G heads
// sharing one KV head) against the request's keys, straight from the pool's pair rows: scores q . K^T per
// block of 16 keys; exp(scale x (s - max)) in float, left unnormalized and rounded to bf16
// (exp_to_probs); then P . V per block, each output divided by its weights' sum. A decode row is a run of
// G vectors. Two products of the same pairs:
// - AMX tiles (attend_tiles), where the CPU has them;
// - AVX512-BF16 vectors (attend_dpbf16) elsewhere (AMD Zen 4, for one): each VDPBF16PS does 32
//   multiply-adds where an FMA on widened floats does 16.
// The two round differently (a pair's products are summed inside the tile unit), so a CPU always uses
// the same one. V rows of a block past the keys written so far are zero (rope_store clears a block when
// its first slot is written): their weight is zero, and 0 x a stale NaN would not be.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define CONVEYOR_BF16_PAIRS 1

constexpr int64_t PD = 64, PBS = 16;  // the pair layout's head_dim and block size
constexpr int64_t PBLOCK = PD * PBS;  // bf16 values of one block and KV head, in K and in V

// One query vector's softmax weights for P . V, in a single pass after the max: exp(scale * (s - max))
// of its scores s[lo, n), rounded to bf16 into pr[lo..n), zeros around them up to `width` (a multiple
// of 16); returns 1 / (the sum of the rounded weights and the sink's exp), applied to the output instead
// of to each weight. (The max, exp, normalize, zero-fill and convert passes this replaces were half the
// time of prompt attention.) With a softcap, the scores are capped in place first (scale applied there).
static inline float exp_to_probs(float* s, c10::BFloat16* pr, const Span& r, int64_t width, float scale,
                                 float softcap) {
  const int64_t lo = r.lo, n = r.lim;
  if (softcap > 0.f) {
    softcap_range(s, lo, n, scale, softcap);
    scale = 1.f;
  }
  const auto live_lanes = [&](int64_t j) -> __mmask16 {  // lanes of [j, j + 16) inside [lo, n)
    uint32_t m = 0xFFFF;
    if (j + 16 > n) m = n > j ? (1u << (n - j)) - 1 : 0;
    if (j < lo) m &= lo - j >= 16 ? 0u : ~((1u << (lo - j)) - 1);
    return static_cast<__mmask16>(m);
  };
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo / 16 * 16; j < n; j += 16) {
    const __mmask16 live = live_lanes(j);
    mv = live == 0xFFFF ? _mm512_max_ps(mv, _mm512_loadu_ps(s + j))
                        : _mm512_mask_max_ps(mv, live, mv, _mm512_maskz_loadu_ps(live, s + j));
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const float top = r.sink ? std::max(_mm512_reduce_max_ps(mv) * scale, *r.sink) : _mm512_reduce_max_ps(mv) * scale;
  const __m512 shift = _mm512_set1_ps(-top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 live = live_lanes(j);
    __m256i packed = _mm256_setzero_si256();
    if (live) {
      const v16f e = exp16(reinterpret_cast<v16f>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale, shift)));
      packed = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(live, reinterpret_cast<__m512>(e))));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), packed);
  }
  const float total = _mm512_reduce_add_ps(sum);
  return 1.f / (r.sink ? total + std::exp(*r.sink - top) : total);
}

// The 32 bits of a bf16 pair, broadcast to all 16 lanes.
static inline __m512bh pair_bcast(const c10::BFloat16* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// Scores of NQ query vectors (bf16 [NQ][64], rows 64 apart) against one block's K pair rows (kb: the
// pool's block, 32 rows of 16 keys x 2), unscaled, to scores + v * sstride.
template <int NQ>
static inline void block_scores(const c10::BFloat16* q, const c10::BFloat16* kb, float* scores, int64_t sstride) {
  __m512 acc[NQ];
  for (int v = 0; v < NQ; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < 32; ++kk) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kb + kk * 32));
    for (int v = 0; v < NQ; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], pair_bcast(q + v * 64 + 2 * kk), k);
  }
  for (int v = 0; v < NQ; ++v) _mm512_storeu_ps(scores + v * sstride, acc[v]);
}

// P . V for NQ vectors (probs: bf16 rows sstride apart) over the request's blocks of V pair rows (each
// block [8 key pairs][64 dims][2]), times inv[v], to out_f + v * 64.
template <int NQ>
static inline void probs_values(const c10::BFloat16* probs, int64_t sstride, const c10::BFloat16* v_cache,
                                const int64_t* table, int64_t num_blocks, int64_t h, int64_t Hkv, const float* inv,
                                float* out_f) {
  __m512 acc[NQ][4];
  for (int v = 0; v < NQ; ++v)
    for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const c10::BFloat16* vb = v_cache + (table[b] * Hkv + h) * PBLOCK;
    if (b + PF < num_blocks) prefetch_l2(v_cache + (table[b + PF] * Hkv + h) * PBLOCK, PBLOCK);
    for (int64_t kk = 0; kk < PBS / 2; ++kk) {
      __m512bh vr[4];
      for (int j = 0; j < 4; ++j) vr[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vb + kk * 2 * PD + j * 32));
      for (int v = 0; v < NQ; ++v) {
        const __m512bh p = pair_bcast(probs + v * sstride + b * PBS + 2 * kk);
        for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], p, vr[j]);
      }
    }
  }
  for (int v = 0; v < NQ; ++v) {
    const __m512 f = _mm512_set1_ps(inv[v]);
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out_f + v * 64 + 16 * j, _mm512_mul_ps(acc[v][j], f));
  }
}

// qv [vecs][64] bf16, spans[v] the keys vector v weighs; out_f [vecs][64] float; scores / probs: 8 rows of
// sstride = ceil(ctx / 16) x 16.
static void attend_dpbf16(const c10::BFloat16* qv, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* table, int64_t ctx, const Span* spans, int64_t vecs, int64_t h,
                          int64_t Hkv, float scale, float softcap, float* scores, c10::BFloat16* probs,
                          float* out_f) {
  constexpr int64_t QS = 8, PV = 4;  // vectors per pass: scores (8 accumulators), P . V (4 x 4)
  const int64_t num_blocks = (ctx + PBS - 1) / PBS, sstride = num_blocks * PBS;
  for (int64_t v0 = 0; v0 < vecs; v0 += QS) {
    const int64_t nq = std::min(QS, vecs - v0);
    const c10::BFloat16* q = qv + v0 * 64;
    for (int64_t b = 1; b < std::min<int64_t>(PF, num_blocks); ++b)  // the blocks before the first prefetched in the loop
      prefetch_l2(k_cache + (table[b] * Hkv + h) * PBLOCK, PBLOCK);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const c10::BFloat16* kb = k_cache + (table[b] * Hkv + h) * PBLOCK;
      if (b + PF < num_blocks) prefetch_l2(k_cache + (table[b + PF] * Hkv + h) * PBLOCK, PBLOCK);
      float* sc = scores + b * PBS;
      switch (nq) {
        case 1: block_scores<1>(q, kb, sc, sstride); break;
        case 2: block_scores<2>(q, kb, sc, sstride); break;
        case 3: block_scores<3>(q, kb, sc, sstride); break;
        case 4: block_scores<4>(q, kb, sc, sstride); break;
        case 5: block_scores<5>(q, kb, sc, sstride); break;
        case 6: block_scores<6>(q, kb, sc, sstride); break;
        case 7: block_scores<7>(q, kb, sc, sstride); break;
        default: block_scores<8>(q, kb, sc, sstride); break;
      }
    }
    for (int64_t b = 0; b < std::min<int64_t>(PF, num_blocks); ++b)  // during the softmax
      prefetch_l2(v_cache + (table[b] * Hkv + h) * PBLOCK, PBLOCK);
    alignas(64) float inv[QS];
    for (int64_t v = 0; v < nq; ++v)
      inv[v] = exp_to_probs(scores + v * sstride, probs + v * sstride, spans[v0 + v], sstride, scale, softcap);
    for (int64_t p0 = 0; p0 < nq; p0 += PV) {
      const c10::BFloat16* pr = probs + p0 * sstride;
      float* o = out_f + (v0 + p0) * 64;
      switch (std::min(PV, nq - p0)) {
        case 1: probs_values<1>(pr, sstride, v_cache, table, num_blocks, h, Hkv, inv + p0, o); break;
        case 2: probs_values<2>(pr, sstride, v_cache, table, num_blocks, h, Hkv, inv + p0, o); break;
        case 3: probs_values<3>(pr, sstride, v_cache, table, num_blocks, h, Hkv, inv + p0, o); break;
        default: probs_values<4>(pr, sstride, v_cache, table, num_blocks, h, Hkv, inv + p0, o); break;
      }
    }
  }
}
#endif  // AVX512-BF16

#ifdef CONVEYOR_AMX
// qv [vecs rounded up to 16][64] bf16, spans[v] the keys vector v weighs; out_f [same][64] float; scores
// (float) and probs (bf16): 16 rows of sstride = ceil(ctx / 16) x 16. Tiles (amx_attention_tile_config):
// scores: q dims 0-31 in tile 1, 32-63 in tile 2, a block's K pair rows in tile 3 (dims 0-31, then
// 32-63), the 16 x 16 scores in tile 0; P . V: a block's probabilities (16 vectors x 16 keys) in tile 4,
// its V pair rows (8 key pairs x 16 dims) in tiles 5-7, the 16 x 64 outputs in tiles 0-3.
static void attend_tiles(const c10::BFloat16* qv, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                         const int64_t* table, int64_t ctx, const Span* spans, int64_t vecs, int64_t h, int64_t Hkv,
                         float scale, float softcap, float* scores, c10::BFloat16* probs, float* out_f) {
  const int64_t num_blocks = (ctx + PBS - 1) / PBS, sstride = num_blocks * PBS;
  const auto kblock = [&](int64_t b) { return k_cache + (table[b] * Hkv + h) * PBLOCK; };
  const auto vblock = [&](int64_t b) { return v_cache + (table[b] * Hkv + h) * PBLOCK; };
  for (int64_t v0 = 0; v0 < vecs; v0 += 16) {  // one tile of 16 query vectors at a time
    _tile_loadd(1, qv + v0 * PD, PD * 2);
    _tile_loadd(2, qv + v0 * PD + 32, PD * 2);
    for (int64_t b = 0; b < std::min<int64_t>(PF, num_blocks); ++b) prefetch_l2(kblock(b), PBLOCK);
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (b + PF < num_blocks) prefetch_l2(kblock(b + PF), PBLOCK);
      const c10::BFloat16* kb = kblock(b);
      _tile_zero(0);
      _tile_loadd(3, kb, 64);
      _tile_dpbf16ps(0, 1, 3);
      _tile_loadd(3, kb + 512, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_stored(0, scores + b * PBS, sstride * 4);
    }
    for (int64_t b = 0; b < std::min<int64_t>(PF, num_blocks); ++b) prefetch_l2(vblock(b), PBLOCK);  // during the softmax
    const int64_t live = std::min<int64_t>(16, vecs - v0);  // rows past them give outputs nobody reads
    alignas(64) float inv[16];
    for (int64_t v = 0; v < live; ++v)
      inv[v] = exp_to_probs(scores + v * sstride, probs + v * sstride, spans[v0 + v], sstride, scale, softcap);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (b + PF < num_blocks) prefetch_l2(vblock(b + PF), PBLOCK);
      const c10::BFloat16* vb = vblock(b);
      _tile_loadd(4, probs + b * PBS, sstride * 2);
      _tile_loadd(5, vb, PD * 4);
      _tile_loadd(6, vb + 32, PD * 4);
      _tile_loadd(7, vb + 64, PD * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vb + 96, PD * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* o = out_f + v0 * PD;
    _tile_stored(0, o, PD * 4);
    _tile_stored(1, o + 16, PD * 4);
    _tile_stored(2, o + 32, PD * 4);
    _tile_stored(3, o + 48, PD * 4);
    for (int64_t v = 0; v < live; ++v) {  // the weights were left unnormalized: divide by their sum here
      const __m512 f = _mm512_set1_ps(inv[v]);
      for (int64_t d = 0; d < PD; d += 16)
        _mm512_storeu_ps(o + v * PD + d, _mm512_mul_ps(_mm512_loadu_ps(o + v * PD + d), f));
    }
  }
}
#endif  // CONVEYOR_AMX

// The arithmetic of a pool of this shape: bf16 products (AMX tiles where permitted, else AVX512-BF16
// vectors) on the pair layout, or the FMA path on the plain one.
enum class PoolPath { kFma, kPairs, kTiles };

static PoolPath pool_path(bool bf16, int64_t head_dim, int64_t block_size, int64_t group) {
  if (!(bf16 && block_size == 16 && head_dim == 64 && group <= 16)) return PoolPath::kFma;
#ifdef CONVEYOR_AMX
  if (amx_gemm_available()) return PoolPath::kTiles;
#endif
#ifdef CONVEYOR_BF16_PAIRS
  return PoolPath::kPairs;
#endif
  return PoolPath::kFma;
}

}  // namespace conveyor_paged_attention

// Whether a pool of this shape is laid out in bf16 pairs (and attended to with bf16 products). One
// answer for the kernel, rope_store / store_kv and KVCache.
bool kv_pairs(bool bf16, int64_t head_dim, int64_t block_size, int64_t group) {
  using namespace conveyor_paged_attention;
  return pool_path(bf16, head_dim, block_size, group) != PoolPath::kFma;
}

namespace conveyor_paged_attention {

template <typename scalar_t>
static void paged_attention_kernel(const scalar_t* q,        // [T, H, D], rows q_stride apart
                                   const scalar_t* k_cache,  // plain or pairs (above)
                                   const scalar_t* v_cache,
                                   const int64_t* tables,    // [R, max_blocks]
                                   const int64_t* token_req, // [T]
                                   const int64_t* token_ctx, // [T] keys visible to the token
                                   scalar_t* out,            // [T, H, D]
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                                   int64_t bs, float scale, int64_t q_stride, bool pairs, const Variant& variant) {
  const int64_t G = H / Hkv;
  const int64_t window = variant.window;
  const float softcap = variant.softcap;
  // A task reads its keys from `base`, a multiple of both the block size and 16 at or below the first key its
  // first row weighs (under a sliding window; 0 otherwise): so lane i of every sum holds the keys i mod 16
  // whatever task a row is in, and a task whose rows slide skips the blocks they no longer see.
  const int64_t align = std::lcm<int64_t>(bs, 16);
  const bool fast = bs == 16 && (D == 32 || D == 64 || D == 128);
  // Rows of one request at consecutive positions (a prompt chunk) are taken R at a time, so each
  // K/V row read serves R x G query vectors instead of G: a row sees one key more than the row
  // before it, and scores past a vector's own keys are masked.
  const PoolPath path = pairs ? pool_path(true, D, bs, G) : PoolPath::kFma;
  const int64_t R = pairs ? 16 * PAIR_QTILES / G : fast ? std::max<int64_t>(1, 8 / G) : 1;  // up to 64 query vectors
  std::vector<int64_t> group_start;  // row groups: [group_start[i], group_start[i + 1])
  for (int64_t t = 0; t < T; ++t) {
    const bool joins = t > 0 && t - group_start.back() < R && token_req[t] == token_req[t - 1] &&
                       token_ctx[t] == token_ctx[t - 1] + 1;
    if (!joins) group_start.push_back(t);
  }
  const int64_t num_groups = static_cast<int64_t>(group_start.size());
  group_start.push_back(T);
  // The tasks (row group, KV head) are cut into contiguous chunks and threads take the next chunk
  // as they finish one. Chunk sizes shrink as the work left does (guided scheduling: each chunk
  // about 1 / (2 x threads) of the estimated cost left, down to 1 / (16 x threads) of the total),
  // so threads finish close together. A static split by count left one thread with all of a step's
  // decode rows (listed first: long contexts, K/V cold in memory); a static split by estimated cost
  // still left one thread up to 1.5x the other's time where the estimate was off. Contiguous chunks
  // keep a prompt chunk's groups of one request (each re-reading the K/V the group before it just
  // read) mostly on one thread. Estimated cost of a task, from per-key times measured on bf16
  // steady-state steps: (keys + 16) x (4 per query vector + 6 if its K/V is cold, i.e. the group
  // before it is of another request).
  const int64_t num_tasks = num_groups * Hkv;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> bounds{0};
  if (threads > 1) {
    std::vector<int64_t> cost(num_groups);
    int64_t total = 0;
    for (int64_t i = 0; i < num_groups; ++i) {
      const int64_t t0 = group_start[i], t1 = group_start[i + 1];
      const bool warm = t0 > 0 && token_req[t0] == token_req[t0 - 1];
      const int64_t keys = window > 0 ? std::min(token_ctx[t1 - 1], window + t1 - t0) : token_ctx[t1 - 1];
      cost[i] = (keys + 16) * (4 * (t1 - t0) * G + (warm ? 0 : 6));
      total += cost[i] * Hkv;
    }
    const int64_t smallest = std::max<int64_t>(1, total / (16 * threads));
    int64_t left = total, acc = 0;
    for (int64_t task = 0; task < num_tasks; ++task) {
      acc += cost[task / Hkv];
      if (acc >= std::max(smallest, left / (2 * threads))) {
        bounds.push_back(task + 1);
        left -= acc;
        acc = 0;
      }
    }
  }
  if (bounds.back() != num_tasks) bounds.push_back(num_tasks);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    FlushDenormals ftz;
    std::vector<float> qf(R * G * D), out_f((R * G + 15) / 16 * 16 * D), scores;
    std::vector<Span> spans(R * G);
    std::vector<float> wide_k, wide_v;  // float16 only: the task's keys and values widened
    std::vector<int64_t> wide_table;
#ifdef CONVEYOR_AMX
    bool tiles = false;
#endif
#ifdef CONVEYOR_BF16_PAIRS
    std::vector<float> run_scores;
    std::vector<c10::BFloat16> run_probs, run_q(16 * PAIR_QTILES * PD);
#endif
    for (int64_t c = next_chunk++; c < chunks; c = next_chunk++)
    for (int64_t task = bounds[c]; task < bounds[c + 1]; ++task) {
      const int64_t i = task / Hkv, h = task % Hkv;
      const int64_t t0 = group_start[i], rows = group_start[i + 1] - t0, vecs = rows * G;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, token_ctx[t0] - window) : 0;
      const int64_t base = first_key / align * align;
      // The task sees the request from `base` on: its table from that block, keys counted from there.
      const int64_t ctx = token_ctx[t0 + rows - 1] - base;  // the last row sees the most keys
      const int64_t* table = tables + token_req[t0] * max_blocks + base / bs;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t lim = token_ctx[t0 + r];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, lim - window) : 0;
        for (int64_t g = 0; g < G; ++g)
          spans[r * G + g] = {lo - base, lim - base, variant.sinks ? variant.sinks + h * G + g : nullptr};
      }
#ifdef CONVEYOR_BF16_PAIRS
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (path != PoolPath::kFma) {
          const int64_t sstride = (ctx + PBS - 1) / PBS * PBS;
          if (static_cast<int64_t>(run_scores.size()) < 16 * sstride) {
            run_scores.resize(16 * sstride);
            run_probs.resize(16 * sstride);
          }
          std::fill(run_q.begin() + vecs * PD, run_q.begin() + (vecs + 15) / 16 * 16 * PD,  // the last tile's pad
                    c10::BFloat16(0.f));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < G; ++g)
              std::memcpy(run_q.data() + (r * G + g) * PD, q + (t0 + r) * q_stride + (h * G + g) * D, PD * sizeof(scalar_t));
#ifdef CONVEYOR_AMX
          if (path == PoolPath::kTiles) {
            if (!tiles) {
              amx_attention_tile_config();
              tiles = true;
            }
            attend_tiles(run_q.data(), k_cache, v_cache, table, ctx, spans.data(), vecs, h, Hkv, scale, softcap,
                         run_scores.data(), run_probs.data(), out_f.data());
          } else
#endif
          {
            attend_dpbf16(run_q.data(), k_cache, v_cache, table, ctx, spans.data(), vecs, h, Hkv, scale, softcap,
                          run_scores.data(), run_probs.data(), out_f.data());
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t d = 0; d < PD; d += 16)  // rounded to nearest even, as static_cast rounds
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ((t0 + r) * H + h * G + g) * D + d),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(out_f.data() + (r * G + g) * D + d))));
          continue;
        }
      }
#endif
      if (static_cast<int64_t>(scores.size()) < std::min<int64_t>(vecs, 8) * (ctx + 16))
        scores.resize(std::min<int64_t>(vecs, 8) * (ctx + 16));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g)  // query vector r * G + g: row t0 + r, head h * G + g
          for (int64_t d = 0; d < D; ++d)
            qf[(r * G + g) * D + d] = static_cast<float>(q[(t0 + r) * q_stride + (h * G + g) * D + d]) * scale;
      if (fast) {
        // float16 attends over float32 copies of the task's keys and values, in a pool of one KV head whose
        // blocks are in table order: widening is exact, so the bits are those of float16 read in place, and
        // the build does not compile every head dim x query vectors variant of the fast path a third time
        // (float16 is no default on a CPU; its attention pays one more pass over its keys and values).
        if constexpr (std::is_same_v<scalar_t, c10::Half>) {
          const int64_t nb = (ctx + bs - 1) / bs;
          wide_k.resize(nb * D * bs);
          wide_v.resize(nb * bs * D);
          wide_table.resize(nb);
          for (int64_t b = 0; b < nb; ++b) {
            wide_table[b] = b;
            const scalar_t* kb = k_cache + (table[b] * Hkv + h) * D * bs;
            for (int64_t j = 0; j < D * bs; ++j) wide_k[b * D * bs + j] = static_cast<float>(kb[j]);
            for (int64_t o = 0; o < bs; ++o) {
              const scalar_t* vr = v_cache + ((table[b] * bs + o) * Hkv + h) * D;
              for (int64_t d = 0; d < D; ++d) wide_v[(b * bs + o) * D + d] = static_cast<float>(vr[d]);
            }
          }
          attend_fast(D, qf.data(), wide_k.data(), wide_v.data(), wide_table.data(), ctx, spans.data(), softcap, 0,
                      vecs, 1, scores.data(), out_f.data());
        } else {
          attend_fast(D, qf.data(), k_cache, v_cache, table, ctx, spans.data(), softcap, h, vecs, Hkv, scores.data(),
                      out_f.data());
        }
      } else {  // R == 1 here
        attend_generic(qf.data(), k_cache, v_cache, table, ctx, spans.data(), softcap, h, G, Hkv, D, bs, scores.data(),
                       out_f.data());
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            out[((t0 + r) * H + h * G + g) * D + d] = static_cast<scalar_t>(out_f[(r * G + g) * D + d]);
    }
#ifdef CONVEYOR_AMX
    if (tiles) _tile_release();
#endif
  });
}

}  // namespace conveyor_paged_attention

// window > 0: each query sees its last `window` keys only; softcap > 0: scores capped by softcap * tanh(. /
// softcap); sinks: [H] float32 logits, one per query head, in the softmax's denominator (or None).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor token_req, at::Tensor token_ctx, int64_t block_size, double scale,
                           int64_t window, double softcap, c10::optional<at::Tensor> sinks) {
  using namespace conveyor_paged_attention;
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  const bool pairs = k_cache.dim() == 5;
  TORCH_CHECK(pairs ? v_cache.dim() == 5 : k_cache.dim() == 4 && v_cache.dim() == 3,
              "the caches must be plain (keys [blocks, Hkv, D, bs], values [slots, Hkv, D]) or pairs (keys "
              "[blocks, Hkv, D/2, bs, 2], values [blocks, Hkv, bs/2, D, 2])");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();  // rows may be apart (q within qkv)
  tables = tables.contiguous();
  token_req = token_req.contiguous();
  token_ctx = token_ctx.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  if (pairs) {
    TORCH_CHECK(k_cache.size(2) * 2 == D && k_cache.size(3) == block_size && v_cache.size(2) * 2 == block_size &&
                    v_cache.size(3) == D, "the pair caches' shape does not match block_size/D");
    TORCH_CHECK(kv_pairs(q.scalar_type() == at::kBFloat16, D, block_size, H / Hkv),
                "a pair-layout pool needs bf16 and head_dim 64, block size 16 on a CPU with AMX or AVX512-BF16");
  } else {
    TORCH_CHECK(k_cache.size(3) == block_size && k_cache.size(2) == D, "k_cache shape does not match block_size/D");
  }
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  Variant variant{window, static_cast<float>(softcap), nullptr};
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->contiguous();
    TORCH_CHECK(sink_values.scalar_type() == at::kFloat && sink_values.dim() == 1 && sink_values.size(0) == H,
                "sinks must be [num_heads] float32");
    variant.sinks = sink_values.data_ptr<float>();
  }
  auto out = q.new_empty({T, H, D});
  AT_DISPATCH_V2(q.scalar_type(), "paged_attention", AT_WRAP([&] {
    paged_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                     token_req.data_ptr<int64_t>(), token_ctx.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), T, H, Hkv, D, tables.size(1), block_size,
                                     static_cast<float>(scale), q.stride(0), pairs, variant);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}
