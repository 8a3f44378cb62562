// Paged attention for the CPU: every query token attends to its own request's cached K/V,
// read in place from the block pool (no gather copy). One task per (query token, KV head), or per
// (run of consecutive prompt tokens of one request, KV head); the query heads sharing that KV head
// (of every token in the run) are done together so each K/V row is read once for all of them.
// Layouts: keys [num_blocks, Hkv, D, block_size] (transposed within a block, so q.k over a
// block's keys is a vector loop without horizontal sums); values [slots, Hkv, D].
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "vec16.h"
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define CONVEYOR_HAS_MXCSR 1
#endif

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

// s[0..n) <- softmax(s[0..n)), in float; s must have room for n rounded up to 16.
static inline void softmax_inplace(float* __restrict__ s, int64_t n) {
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t j = n; j < padded; ++j) s[j] = -INFINITY;
  v16f mv = v16f{} - INFINITY;
  for (int64_t j = 0; j < padded; j += 16) {
    v16f x;
    std::memcpy(&x, s + j, sizeof(x));
    mv = x > mv ? x : mv;
  }
  float m = mv[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, mv[i]);
  v16f sum = {};
  for (int64_t j = 0; j < padded; j += 16) {
    v16f x;
    std::memcpy(&x, s + j, sizeof(x));
    x = exp16(x - m);
    if (j + 16 > n) {  // padding lanes count for nothing
      for (int64_t i = n - j; i < 16; ++i) x[i] = 0.f;
    }
    std::memcpy(s + j, &x, sizeof(x));
    sum += x;
  }
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += sum[i];
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
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
                           const int64_t* lim, int64_t h, int64_t Hkv, float* __restrict__ scores,
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
        even[g] += qf[g * D + d] * k0;
        odd[g] += qf[g * D + d + 1] * k1;
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
  for (int g = 0; g < G; ++g) {  // a vector sees its first lim[g] keys; the rest weigh nothing
    softmax_inplace(scores + g * sstride, lim[g]);
    std::fill(scores + g * sstride + lim[g], scores + g * sstride + ctx, 0.f);
  }
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
        for (int i = 0; i < NV; ++i) acc[g][i] += p * v[i];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) std::memcpy(out_f + g * D + 16 * i, &acc[g][i], sizeof(v16f));
}

// Dispatch on the number of query vectors: up to 8 per pass over the keys and values (more would
// not fit the accumulators in registers).
template <int NV, typename scalar_t>
static void attend_dispatch(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                            int64_t ctx, const int64_t* lims, int64_t h, int64_t G, int64_t Hkv, float* scores,
                            float* out_f) {
  constexpr int64_t D = 16 * NV;
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* q = qf + g0 * D;
    const int64_t* lim = lims + g0;
    float* out = out_f + g0 * D;
    switch (std::min<int64_t>(8, G - g0)) {
      case 1: attend_grouped<NV, 1>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 2: attend_grouped<NV, 2>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 3: attend_grouped<NV, 3>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 4: attend_grouped<NV, 4>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 5: attend_grouped<NV, 5>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 6: attend_grouped<NV, 6>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      case 7: attend_grouped<NV, 7>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
      default: attend_grouped<NV, 8>(q, k_cache, v_cache, table, ctx, lim, h, Hkv, scores, out); break;
    }
  }
}

// Any block size / head_dim: plain loops.
template <typename scalar_t>
static void attend_generic(const float* __restrict__ qf, const scalar_t* __restrict__ k_cache,
                           const scalar_t* __restrict__ v_cache, const int64_t* table, int64_t ctx, int64_t h,
                           int64_t G, int64_t Hkv, int64_t D, int64_t bs, float* __restrict__ scores,
                           float* __restrict__ out_f) {
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  const int64_t sstride = (ctx + 15) / 16 * 16;  // scores row per head, padded for softmax_inplace
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* __restrict__ kb = k_cache + (table[b] * Hkv + h) * D * bs;
    const int64_t n = std::min(bs, ctx - b * bs);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t o = 0; o < n; ++o) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += qf[g * D + d] * load_f32(kb + d * bs, o);
        scores[g * sstride + b * bs + o] = acc;
      }
  }
  std::fill(out_f, out_f + G * D, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* __restrict__ sg = scores + g * sstride;
    softmax_inplace(sg, ctx);
    float* __restrict__ ag = out_f + g * D;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t n = std::min(bs, ctx - b * bs);
      const scalar_t* __restrict__ vb = v_cache + (table[b] * bs * Hkv + h) * D;
      for (int64_t o = 0; o < n; ++o) {
        const float pj = sg[b * bs + o];
        const scalar_t* __restrict__ v = vb + o * Hkv * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += pj * load_f32(v, d);
      }
    }
  }
}

constexpr int64_t AMX_QTILES = 4;  // query tiles (16 vectors each) per run: K/V interleaved once for all

// Prompt runs in bf16 as products of bf16 pairs (head_dim 64, block size 16): up to 64 query vectors
// (R rows x G heads sharing one KV head) against the request's keys. The run's K blocks and V rows
// are first interleaved into (pair, column, 2) rows, the layout of AMX's TDPBF16PS and of AVX512-BF16's
// VDPBF16PS alike (one permute per 32 values), then shared by all the run's vectors. Scores: q . K^T
// per block of 16 keys; exp(scale x (s - max)) in float, left unnormalized and rounded to bf16
// (exp_to_probs); then P . V per 32 keys, each output divided by its weights' sum. Two products:
// - AMX tiles (attend_amx): one layer, cold pool: 2 prompts x 300 tokens 1.9 -> 1.1 ms, 4 x 512
//   10.2 -> 5.3 ms against the FMA path.
// - AVX512-BF16 vectors where there are no tiles (attend_dpbf16; AMD Zen 4, for one): each
//   VDPBF16PS does 32 multiply-adds where an FMA on widened floats does 16. One layer, cold pool,
//   against the FMA path, ms: 2 prompts x 300 tokens 1.72-1.86 -> 1.00, 4 x 512 8.8-9.1 -> 5.3-5.5,
//   1 x 1500 16.1-16.4 -> 9.5-9.7.
// Keys past the context are zero in V's rows (their weight is zero; 0 x a stale NaN would not be).
// Decode rows stay on the FMA path: 64 decodes on a cold pool took 0.60 ms per layer there against
// 0.93-0.95 on the tiles, whose K/V interleave a single row cannot share.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define CONVEYOR_BF16_PAIRS 1

// [a0 b0 a1 b1 ... a15 b15]: two rows of 16 bf16 as one row of 16 (a, b) pairs.
static inline __m512i pair_rows(__m256i a, __m256i b) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), idx, _mm512_castsi256_si512(b));
}

// One query vector's softmax weights for P . V, in a single pass after the max: exp(scale * (s - max))
// of its first n scores, rounded to bf16 into pr[0..n), zeros after them up to `width` (a multiple
// of 16); returns 1 / (the sum of the rounded weights), applied to the output instead of to each
// weight. (The max, exp, normalize, zero-fill and convert passes this replaces were half the time
// of prompt attention.)
static inline float exp_to_probs(const float* s, c10::BFloat16* pr, int64_t n, int64_t width, float scale) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  const __mmask16 last = n > j ? static_cast<__mmask16>((1u << (n - j)) - 1) : 0;
  if (last) mv = _mm512_mask_max_ps(mv, last, mv, _mm512_maskz_loadu_ps(last, s + j));
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 shift = _mm512_set1_ps(-_mm512_reduce_max_ps(mv) * scale);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 16) {
    const __mmask16 live = j + 16 <= n ? __mmask16(0xFFFF) : j < n ? last : __mmask16(0);
    __m256i packed = _mm256_setzero_si256();
    if (live) {
      const v16f e = exp16(reinterpret_cast<v16f>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale, shift)));
      packed = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(live, reinterpret_cast<__m512>(e))));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), packed);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// The run's K and V in pair rows. kt: per block of 16 keys, two groups (dims 0-31, 32-63) of 16 rows
// (d, d + 1) x 16 keys; vt: per 32 keys, four groups (16 dims each) of 16 rows (key, key + 1) x 16 dims.
static void interleave_kv(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* table,
                          int64_t ctx, int64_t h, int64_t Hkv, c10::BFloat16* kt, c10::BFloat16* vt) {
  constexpr int64_t D = 64, bs = 16;
  const int64_t num_blocks = (ctx + bs - 1) / bs;
  const int64_t stride = Hkv * D;
  for (int64_t b = 0; b < std::min<int64_t>(PF, num_blocks); ++b) prefetch_l2(k_cache + (table[b] * Hkv + h) * D * bs, D * bs);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const c10::BFloat16* kb = k_cache + (table[b] * Hkv + h) * D * bs;  // [64 d][16 keys]
    if (b + PF < num_blocks) prefetch_l2(k_cache + (table[b + PF] * Hkv + h) * D * bs, D * bs);
    for (int64_t kk = 0; kk < D / 2; ++kk) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + 2 * kk * bs));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + (2 * kk + 1) * bs));
      _mm512_store_si512(kt + (b * 2 + kk / 16) * 512 + (kk % 16) * 32, pair_rows(a, c));
    }
  }
  for (int64_t k0 = 0; k0 < ctx; k0 += 32) {
    for (int64_t kk = 0; kk < 16; ++kk) {
      const c10::BFloat16* row[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t key = k0 + 2 * kk + i;
        row[i] = key < ctx ? v_cache + (table[key / bs] * bs + key % bs) * stride + h * D : nullptr;
      }
      for (int64_t j = 0; j < 4; ++j) {
        const __m256i a = row[0] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[0] + 16 * j)) : _mm256_setzero_si256();
        const __m256i c = row[1] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[1] + 16 * j)) : _mm256_setzero_si256();
        _mm512_store_si512(vt + ((k0 / 32) * 4 + j) * 512 + kk * 32, pair_rows(a, c));
      }
    }
  }
}

// The 32 bits of a bf16 pair, broadcast to all 16 lanes.
static inline __m512bh pair_bcast(const c10::BFloat16* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// Scores of NQ query vectors (bf16 [NQ][64], rows 64 apart) against one block's K pair rows (kb: 32
// rows of 16 keys x 2), unscaled, to scores + v * sstride.
template <int NQ>
static inline void block_scores(const c10::BFloat16* q, const c10::BFloat16* kb, float* scores, int64_t sstride) {
  __m512 acc[NQ];
  for (int v = 0; v < NQ; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < 32; ++kk) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_load_si512(kb + (kk / 16) * 512 + (kk % 16) * 32));
    for (int v = 0; v < NQ; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], pair_bcast(q + v * 64 + 2 * kk), k);
  }
  for (int v = 0; v < NQ; ++v) _mm512_storeu_ps(scores + v * sstride, acc[v]);
}

// P . V for NQ vectors (probs: bf16 rows sstride apart, `chunks` x 32 keys) over the V pair rows,
// times inv[v], to out_f + v * 64.
template <int NQ>
static inline void probs_values(const c10::BFloat16* probs, int64_t sstride, const c10::BFloat16* vt, int64_t chunks,
                                const float* inv, float* out_f) {
  __m512 acc[NQ][4];
  for (int v = 0; v < NQ; ++v)
    for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const c10::BFloat16* w = vt + c * 4 * 512;
    for (int64_t kk = 0; kk < 16; ++kk) {
      __m512bh vr[4];
      for (int j = 0; j < 4; ++j) vr[j] = reinterpret_cast<__m512bh>(_mm512_load_si512(w + j * 512 + kk * 32));
      for (int v = 0; v < NQ; ++v) {
        const __m512bh p = pair_bcast(probs + v * sstride + c * 32 + 2 * kk);
        for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_dpbf16_ps(acc[v][j], p, vr[j]);
      }
    }
  }
  for (int v = 0; v < NQ; ++v) {
    const __m512 f = _mm512_set1_ps(inv[v]);
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out_f + v * 64 + 16 * j, _mm512_mul_ps(acc[v][j], f));
  }
}

// qv [vecs][64] bf16, lim[v] keys seen by vector v; out_f [vecs][64] float. kt / vt: room for the run's
// pair rows (ceil(ctx / 16) x 2 KiB each, 64-byte aligned); scores / probs: 8 rows of ceil(ctx / 32) x 32.
static void attend_dpbf16(const c10::BFloat16* qv, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* table, int64_t ctx, const int64_t* lim, int64_t vecs, int64_t h,
                          int64_t Hkv, float scale, float* scores, c10::BFloat16* probs, c10::BFloat16* kt,
                          c10::BFloat16* vt, float* out_f) {
  constexpr int64_t QS = 8, PV = 4;  // vectors per pass: scores (8 accumulators), P . V (4 x 4)
  const int64_t num_blocks = (ctx + 15) / 16, chunks = (ctx + 31) / 32, sstride = chunks * 32;
  interleave_kv(k_cache, v_cache, table, ctx, h, Hkv, kt, vt);
  for (int64_t v0 = 0; v0 < vecs; v0 += QS) {
    const int64_t nq = std::min(QS, vecs - v0);
    const c10::BFloat16* q = qv + v0 * 64;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const c10::BFloat16* kb = kt + b * 2 * 512;
      float* sc = scores + b * 16;
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
    alignas(64) float inv[QS];
    for (int64_t v = 0; v < nq; ++v)
      inv[v] = exp_to_probs(scores + v * sstride, probs + v * sstride, lim[v0 + v], sstride, scale);
    for (int64_t p0 = 0; p0 < nq; p0 += PV) {
      const c10::BFloat16* pr = probs + p0 * sstride;
      float* o = out_f + (v0 + p0) * 64;
      switch (std::min(PV, nq - p0)) {
        case 1: probs_values<1>(pr, sstride, vt, chunks, inv + p0, o); break;
        case 2: probs_values<2>(pr, sstride, vt, chunks, inv + p0, o); break;
        case 3: probs_values<3>(pr, sstride, vt, chunks, inv + p0, o); break;
        default: probs_values<4>(pr, sstride, vt, chunks, inv + p0, o); break;
      }
    }
  }
}
#endif  // AVX512-BF16

#ifdef CONVEYOR_AMX
// qv [vecs rounded up to 16][64] bf16, lim[v] keys seen by vector v; out_f [same][64] float.
// kt: room for the run's K tiles (ceil(ctx / 16) x 1 KiB x 2), vt: its V tiles (ceil(ctx / 32) x 4 KiB).
static void attend_amx(const c10::BFloat16* qv, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                       const int64_t* table, int64_t ctx, const int64_t* lim, int64_t vecs, int64_t h, int64_t Hkv,
                       float scale, float* scores, c10::BFloat16* probs, c10::BFloat16* kt, c10::BFloat16* vt,
                       float* out_f) {
  constexpr int64_t D = 64, bs = 16;
  const int64_t num_blocks = (ctx + bs - 1) / bs, chunks = (ctx + 31) / 32;
  const int64_t sstride = chunks * 32;  // scores / probs row per vector, 32-key chunks
  interleave_kv(k_cache, v_cache, table, ctx, h, Hkv, kt, vt);
  for (int64_t v0 = 0; v0 < vecs; v0 += 16) {  // one tile of 16 query vectors at a time
    _tile_loadd(4, qv + v0 * D, D * 2);       // q, dims 0-31
    _tile_loadd(5, qv + v0 * D + 32, D * 2);  // q, dims 32-63
    for (int64_t b = 0; b < num_blocks; ++b) {
      _tile_loadd(6, kt + b * 2 * 512, 64);
      _tile_loadd(7, kt + (b * 2 + 1) * 512, 64);
      _tile_zero(0);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(0, 5, 7);
      _tile_stored(0, scores + b * bs, sstride * 4);
    }
    const int64_t live = std::min<int64_t>(16, vecs - v0);  // rows past them give outputs nobody reads
    alignas(64) float inv[16];
    for (int64_t v = 0; v < live; ++v) inv[v] = exp_to_probs(scores + v * sstride, probs + v * sstride,
                                                             lim[v0 + v], sstride, scale);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      const c10::BFloat16* w = vt + c * 4 * 512;
      _tile_loadd(4, probs + c * 32, sstride * 2);
      _tile_loadd(6, w, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, w + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, w + 1024, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, w + 1536, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
    float* o = out_f + v0 * D;
    _tile_stored(0, o, D * 4);
    _tile_stored(1, o + 16, D * 4);
    _tile_stored(2, o + 32, D * 4);
    _tile_stored(3, o + 48, D * 4);
    for (int64_t v = 0; v < live; ++v) {  // the weights were left unnormalized: divide by their sum here
      const __m512 f = _mm512_set1_ps(inv[v]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + v * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + v * D + d), f));
    }
  }
}
#endif  // CONVEYOR_AMX

// Which product prompt runs of this shape take: tiles (AMX, permitted here), bf16 pair vectors
// (AVX512-BF16 without usable tiles) or none (the FMA path on floats).
enum class PromptPath { kFma, kPairs, kTiles };

static PromptPath prompt_path(bool bf16, int64_t head_dim, int64_t block_size, int64_t group) {
  if (!(bf16 && block_size == 16 && head_dim == 64 && group <= 16)) return PromptPath::kFma;
#ifdef CONVEYOR_AMX
  if (amx_gemm_available()) return PromptPath::kTiles;
#endif
#ifdef CONVEYOR_BF16_PAIRS
  return PromptPath::kPairs;
#endif
  return PromptPath::kFma;
}

// Whether prompt runs of this shape are bf16 products (tiles or pair vectors, above). The runner
// then also sends prompts that start at position 0 here rather than to SDPA, which both outrun.
// One answer for the kernel and its callers.
bool paged_attention_bf16_prompts(bool bf16, int64_t head_dim, int64_t block_size, int64_t group) {
  return prompt_path(bf16, head_dim, block_size, group) != PromptPath::kFma;
}

// Whether this build and CPU have a bf16 product for prompt runs at all (AMX tiles or AVX512-BF16).
bool bf16_products_available() { return paged_attention_bf16_prompts(true, 64, 16, 1); }

template <typename scalar_t>
static void paged_attention_kernel(const scalar_t* q,        // [T, H, D], rows q_stride apart
                                   const scalar_t* k_cache,  // [num_blocks, Hkv, D, block_size]
                                   const scalar_t* v_cache,  // [num_blocks * block_size, Hkv, D]
                                   const int64_t* tables,    // [R, max_blocks]
                                   const int64_t* token_req, // [T]
                                   const int64_t* token_ctx, // [T] keys visible to the token
                                   scalar_t* out,            // [T, H, D]
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                                   int64_t bs, float scale, int64_t q_stride) {
  const int64_t G = H / Hkv;
  const bool fast = bs == 16 && (D == 32 || D == 64 || D == 128);
  // Rows of one request at consecutive positions (a prompt chunk) are taken R at a time, so each
  // K/V row read serves R x G query vectors instead of G: a row sees one key more than the row
  // before it, and scores past a vector's own keys are masked. On the FMA path each row's result is
  // the same as computed alone (the same sums in the same order; masked keys add exact zeros); bf16
  // runs as bf16 products differ from a lone row by the rounding of their probabilities to bf16.
  const PromptPath path = prompt_path(std::is_same_v<scalar_t, c10::BFloat16>, D, bs, G);
  const bool products = path != PromptPath::kFma;
  const int64_t R = products ? 16 * AMX_QTILES / G : fast ? std::max<int64_t>(1, 8 / G) : 1;  // up to 64 query vectors
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
      cost[i] = (token_ctx[t1 - 1] + 16) * (4 * (t1 - t0) * G + (warm ? 0 : 6));
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
    std::vector<int64_t> lims(R * G);
#ifdef CONVEYOR_AMX
    bool tiles = false;
#endif
#ifdef CONVEYOR_BF16_PAIRS
    std::vector<float> run_scores;
    std::vector<c10::BFloat16> run_probs, run_kt, run_vt, run_q(16 * AMX_QTILES * 64);
#endif
    for (int64_t c = next_chunk++; c < chunks; c = next_chunk++)
    for (int64_t task = bounds[c]; task < bounds[c + 1]; ++task) {
      const int64_t i = task / Hkv, h = task % Hkv;
      const int64_t t0 = group_start[i], rows = group_start[i + 1] - t0, vecs = rows * G;
      const int64_t ctx = token_ctx[t0 + rows - 1];  // the last row sees the most keys
      const int64_t* table = tables + token_req[t0] * max_blocks;
#ifdef CONVEYOR_BF16_PAIRS
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (products && rows > 1) {  // prompt runs as bf16 products; single rows (decodes) stream K/V faster below
          const int64_t sstride = (ctx + 31) / 32 * 32;
          if (static_cast<int64_t>(run_scores.size()) < 16 * sstride) {
            run_scores.resize(16 * sstride);
            run_probs.resize(16 * sstride);
            run_kt.resize(2 * sstride * 32 + 64);  // 64-byte aligned below
            run_vt.resize(2 * sstride * 32 + 64);
          }
          const auto aligned = [](c10::BFloat16* p) {
            return reinterpret_cast<c10::BFloat16*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
          };
          std::fill(run_q.begin() + vecs * 64, run_q.begin() + (vecs + 15) / 16 * 16 * 64,  // the last tile's pad
                    c10::BFloat16(0.f));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < G; ++g) {
              lims[r * G + g] = token_ctx[t0 + r];
              std::memcpy(run_q.data() + (r * G + g) * 64, q + (t0 + r) * q_stride + (h * G + g) * D, 64 * sizeof(scalar_t));
            }
#ifdef CONVEYOR_AMX
          if (path == PromptPath::kTiles) {
            if (!tiles) {
              amx_tile_config();
              tiles = true;
            }
            attend_amx(run_q.data(), k_cache, v_cache, table, ctx, lims.data(), vecs, h, Hkv, scale, run_scores.data(),
                       run_probs.data(), aligned(run_kt.data()), aligned(run_vt.data()), out_f.data());
          } else
#endif
          {
            attend_dpbf16(run_q.data(), k_cache, v_cache, table, ctx, lims.data(), vecs, h, Hkv, scale,
                          run_scores.data(), run_probs.data(), aligned(run_kt.data()), aligned(run_vt.data()),
                          out_f.data());
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t d = 0; d < 64; d += 16)  // rounded to nearest even, as static_cast rounds
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ((t0 + r) * H + h * G + g) * D + d),
                                    reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(out_f.data() + (r * G + g) * D + d))));
          continue;
        }
      }
#endif
      if (static_cast<int64_t>(scores.size()) < std::min<int64_t>(vecs, 8) * (ctx + 16))
        scores.resize(std::min<int64_t>(vecs, 8) * (ctx + 16));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {  // query vector r * G + g: row t0 + r, head h * G + g
          lims[r * G + g] = token_ctx[t0 + r];
          for (int64_t d = 0; d < D; ++d)
            qf[(r * G + g) * D + d] = static_cast<float>(q[(t0 + r) * q_stride + (h * G + g) * D + d]) * scale;
        }
      if (fast && D == 64) {
        attend_dispatch<4>(qf.data(), k_cache, v_cache, table, ctx, lims.data(), h, vecs, Hkv, scores.data(),
                           out_f.data());
      } else if (fast && D == 128) {
        attend_dispatch<8>(qf.data(), k_cache, v_cache, table, ctx, lims.data(), h, vecs, Hkv, scores.data(),
                           out_f.data());
      } else if (fast && D == 32) {
        attend_dispatch<2>(qf.data(), k_cache, v_cache, table, ctx, lims.data(), h, vecs, Hkv, scores.data(),
                           out_f.data());
      } else {  // R == 1 here
        attend_generic(qf.data(), k_cache, v_cache, table, ctx, h, G, Hkv, D, bs, scores.data(), out_f.data());
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

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor token_req, at::Tensor token_ctx, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 3, "k_cache must be [blocks, Hkv, D, bs], v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();  // rows may be apart (q within qkv)
  tables = tables.contiguous();
  token_req = token_req.contiguous();
  token_ctx = token_ctx.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == block_size && k_cache.size(2) == D, "k_cache shape does not match block_size/D");
  auto out = at::empty({T, H, D}, q.options());
  AT_DISPATCH_V2(q.scalar_type(), "paged_attention", AT_WRAP([&] {
    paged_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                     token_req.data_ptr<int64_t>(), token_ctx.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), T, H, Hkv, D, tables.size(1), block_size,
                                     static_cast<float>(scale), q.stride(0));
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}
