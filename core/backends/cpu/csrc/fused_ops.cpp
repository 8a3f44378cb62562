// Fused element-wise ops for the decoder families' CPU forward: RMSNorm (optionally adding the
// residual first), rotary embedding + KV-cache store, and SiLU(gate) * up. Each replaces several
// eager torch ops (and their temporaries) with one pass over the rows.
//
// They round like the eager transformers forward: every intermediate that torch materialises in
// the model's dtype is rounded to that dtype here too (for bf16/fp16), and floating-point
// contraction is off, so products and sums round separately as in torch. Rotary and the residual add
// are bit-identical to torch (but for bf16 results below 2^-126, which the AVX512-BF16 conversion
// flushes to zero); RMSNorm's sum and SiLU's exp may differ in the last bit. On CPUs with
// AVX512-BF16 the roundings to bf16 are one instruction each: SiLU*up, RMSNorm and rotary measured
// 7-21% faster at 167 and 653 rows, bit for bit the same results.
#pragma GCC optimize("fp-contract=off")
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace conveyor_fused_ops {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

// Round a float through scalar_t (a no-op for float): mimics torch storing an intermediate.
template <typename scalar_t>
inline float rnd(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<scalar_t>(x));
  }
}

// Rows per parallel task: tiny batches stay on one thread (a fork costs more than the work).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// One row's 1 / RMS, as torch's float32 mean of squares: a 16-lane sum, then the lanes in order.
template <typename scalar_t>
inline float inv_rms(const scalar_t* __restrict__ row, int64_t N, float eps) {
  const int64_t NV = N / 16 * 16;
  v16f acc = {};
  for (int64_t i = 0; i < NV; i += 16) {
    const v16f v = load16(row + i);
    acc += v * v;
  }
  float ss = 0.f;
  for (int i = 0; i < 16; ++i) ss += acc[i];
  for (int64_t i = NV; i < N; ++i) ss += static_cast<float>(row[i]) * static_cast<float>(row[i]);
  return 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
}

// out = a row normalized by r, times its weight: Llama's form, w in the model's dtype multiplying the normalized row
// rounded to it (hidden_states.to(input_dtype), then weight * it); or, with wf, a float32 weight multiplying in
// float32, rounded once (Gemma's 1 + w, OLMo-2's w).
template <typename scalar_t>
inline void norm_row(const scalar_t* __restrict__ row, const scalar_t* __restrict__ w, const float* __restrict__ wf,
                     scalar_t* __restrict__ out, int64_t N, float r) {
  const int64_t NV = N / 16 * 16;
  if (wf != nullptr) {
    for (int64_t i = 0; i < NV; i += 16) store16(out + i, (load16(row + i) * r) * load16(wf + i));
    for (int64_t i = NV; i < N; ++i) out[i] = static_cast<scalar_t>((static_cast<float>(row[i]) * r) * wf[i]);
    return;
  }
  for (int64_t i = 0; i < NV; i += 16) store16(out + i, load16(w + i) * round16<scalar_t>(load16(row + i) * r));
  for (int64_t i = NV; i < N; ++i)
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * rnd<scalar_t>(static_cast<float>(row[i]) * r));
}

// The same norm in place on `groups` runs of N elements per row, rows `stride` apart (q / k heads within qkv):
// Llama's form (w in the model's dtype) or the float-weight one (wf).
template <typename scalar_t>
void norm_runs(scalar_t* x, int64_t T, int64_t stride, int64_t groups, int64_t N, const scalar_t* w, const float* wf,
               float eps) {
  at::parallel_for(0, T, grain(groups * N), [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> tmp(N);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        scalar_t* __restrict__ run = x + t * stride + g * N;
        norm_row(run, w, wf, tmp.data(), N, inv_rms(run, N, eps));
        std::memcpy(run, tmp.data(), sizeof(scalar_t) * N);
      }
  });
}

template <typename scalar_t>
void rms_norm_rows(scalar_t* h, const scalar_t* delta, const scalar_t* w, scalar_t* y, int64_t T, int64_t N,
                   float eps, const float* wf = nullptr) {
  const int64_t NV = N / 16 * 16;  // vectorized part of a row; the rest (N % 16) runs scalar
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* __restrict__ row = h + t * N;
      if (delta != nullptr) {  // residual add in the model's dtype, as torch's `residual + out`
        const scalar_t* __restrict__ d = delta + t * N;
        for (int64_t i = 0; i < NV; i += 16) store16(row + i, load16(row + i) + load16(d + i));
        for (int64_t i = NV; i < N; ++i) row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(d[i]));
      }
      norm_row(row, w, wf, y + t * N, N, inv_rms(row, N, eps));
    }
  });
}

// The pool's geometry and layout (paged_attention.cpp): plain keys [blocks, Hkv, D, bs] and values
// [blocks * bs, Hkv, D], or pairs: keys [blocks, Hkv, D / 2, bs, 2] and values [blocks, Hkv, bs / 2, D, 2].
struct Pool {
  int64_t Hkv, D, bs;
  bool pairs;
};

Pool pool_of(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  if (k_cache.dim() == 5) {
    TORCH_CHECK(v_cache.dim() == 5 && k_cache.size(4) == 2 && v_cache.size(4) == 2, "pair caches must be 5-D");
    return {k_cache.size(1), k_cache.size(2) * 2, k_cache.size(3), true};
  }
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 3, "plain caches: keys [blocks, Hkv, D, bs], values [slots, Hkv, D]");
  return {k_cache.size(1), k_cache.size(2), k_cache.size(3), false};
}

// One token's K and V (each [Hkv, D]) into the pool at `slot`.
template <typename scalar_t>
inline void store_kv_row(const scalar_t* k, const scalar_t* v, int64_t slot, scalar_t* k_cache, scalar_t* v_cache,
                         const Pool& p) {
  const int64_t Hkv = p.Hkv, D = p.D, bs = p.bs, block = slot / bs, off = slot % bs;
  if (p.pairs) {
    static_assert(sizeof(scalar_t) == 2 || std::is_same_v<scalar_t, float>, "pairs of 16-bit values");
    for (int64_t h = 0; h < Hkv; ++h) {
      scalar_t* kb = k_cache + (block * Hkv + h) * D * bs + off * 2;  // [D / 2][bs][2]: a (d, d + 1) pair a row
      for (int64_t d = 0; d < D; d += 2) std::memcpy(kb + (d / 2) * bs * 2, k + h * D + d, 2 * sizeof(scalar_t));
      scalar_t* vb = v_cache + (block * Hkv + h) * D * bs + (off / 2) * D * 2;  // [bs / 2][D][2]: this key's half
      const scalar_t* vh = v + h * D;
      int64_t d = 0;
#ifdef __AVX512BW__
      if constexpr (sizeof(scalar_t) == 2) {  // 16 dims at a time: widen to 32-bit lanes, store one half of each
        const __mmask32 half = off % 2 ? __mmask32(0xAAAAAAAA) : __mmask32(0x55555555);
        for (; d + 16 <= D; d += 16) {
          __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vh + d)));
          if (off % 2) wide = _mm512_slli_epi32(wide, 16);
          _mm512_mask_storeu_epi16(vb + d * 2, half, wide);
        }
      }
#endif
      for (; d < D; ++d) vb[d * 2 + off % 2] = vh[d];
    }
    return;
  }
  for (int64_t h = 0; h < Hkv; ++h) {
    scalar_t* kb = k_cache + (block * Hkv + h) * D * bs + off;  // [D][bs]
    for (int64_t d = 0; d < D; ++d) kb[d * bs] = k[h * D + d];
  }
  std::memcpy(v_cache + slot * Hkv * D, v, sizeof(scalar_t) * Hkv * D);
}

// Pair layout: a block whose first slot is written in this step starts with zero V (what an earlier
// owner left there would otherwise enter the products path's sums of its last block, with weight 0,
// where 0 x a stale inf or NaN is not 0). Before the rows are stored, as threads store in parallel.
template <typename scalar_t>
void clear_new_blocks(const int64_t* slots, int64_t T, scalar_t* v_cache, const Pool& p) {
  if (!p.pairs) return;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] % p.bs == 0)
      std::memset(v_cache + (slots[t] / p.bs) * p.Hkv * p.D * p.bs, 0, sizeof(scalar_t) * p.Hkv * p.D * p.bs);
}

// Rotary on the first `rot` dims of each q and k head (rot < D: partial rotary, the rest passed through; rot 0:
// none), cos / sin [T, rot]; then K/V stored.
// With cos_f / sin_f (float32 tables: OLMo-2's rotary), the rotation runs in float32 and rounds once, as torch
// computes a bf16 q times a float32 cos.
template <typename scalar_t>
void rope_store_rows(scalar_t* qkv, const scalar_t* cos, const scalar_t* sin, const int64_t* slots, scalar_t* k_cache,
                     scalar_t* v_cache, int64_t T, int64_t H, const Pool& pool, int64_t rot,
                     const float* cos_f = nullptr, const float* sin_f = nullptr) {
  const int64_t Hkv = pool.Hkv, D = pool.D;
  const int64_t width = (H + 2 * Hkv) * D, half = rot / 2;
  clear_new_blocks(slots, T, v_cache, pool);
  const bool vec = half % 16 == 0 && half > 0 && cos_f == nullptr;
  at::parallel_for(0, T, grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* __restrict__ c = cos + t * rot;
      const scalar_t* __restrict__ s = sin + t * rot;
      scalar_t* row = qkv + t * width;
      for (int64_t head = 0; rot > 0 && head < H + Hkv; ++head) {  // q heads then k heads: x*cos + rotate_half(x)*sin
        scalar_t* x = row + head * D;
        if (vec) {  // both halves loaded before either is written back
          for (int64_t d = 0; d < half; d += 16) {
            const v16f x1 = load16(x + d), x2 = load16(x + d + half);
            const v16f lo = round16<scalar_t>(x1 * load16(c + d)) + round16<scalar_t>((-x2) * load16(s + d));
            const v16f hi = round16<scalar_t>(x2 * load16(c + d + half)) + round16<scalar_t>(x1 * load16(s + d + half));
            store16(x + d, lo);
            store16(x + d + half, hi);
          }
          continue;
        }
        if (cos_f != nullptr) {
          const float* cf = cos_f + t * rot;
          const float* sf = sin_f + t * rot;
          for (int64_t d = 0; d < rot; ++d) {
            const float rx = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
            tmp[d] = static_cast<float>(x[d]) * cf[d] + rx * sf[d];
          }
          for (int64_t d = 0; d < rot; ++d) x[d] = static_cast<scalar_t>(tmp[d]);
          continue;
        }
        for (int64_t d = 0; d < rot; ++d) {
          const float rx = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
          const float a = rnd<scalar_t>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const float b = rnd<scalar_t>(rnd<scalar_t>(rx) * static_cast<float>(s[d]));
          tmp[d] = a + b;
        }
        for (int64_t d = 0; d < rot; ++d) x[d] = static_cast<scalar_t>(tmp[d]);
      }
      store_kv_row(row + H * D, row + (H + Hkv) * D, slots[t], k_cache, v_cache, pool);
    }
  });
}

// SiLU for a result rounded to bf16/fp16 next: exp with fused multiply-adds and 1 / (1 + e) as a
// refined reciprocal estimate instead of a division (within ~1 float ulp of x / (1 + exp(-x)),
// invisible after rounding to 8 or 11 mantissa bits but for rare ties). SiLU*up over 168-2048 bf16
// rows measured 1.25-1.3x faster than with the exact form, which float32 keeps.
#ifdef __AVX512F__
inline v16f silu16_fast(v16f xv) {
  const __m512 x = reinterpret_cast<__m512>(xv);
  __m512 z = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-87.3f)),
                           _mm512_set1_ps(87.3f));  // -x, clamped
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), z);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f)), n);
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));  // one Newton step
  return reinterpret_cast<v16f>(_mm512_mul_ps(x, inv));
}
#endif

// SiLU of 16 floats: exact form for float32 (and without AVX-512), the fast one above otherwise.
template <typename scalar_t>
inline v16f silu16(v16f x) {
#ifdef __AVX512F__
  if constexpr (!std::is_same_v<scalar_t, float>) return silu16_fast(x);
#endif
  return x / (1.f + exp16(-x));
}

// GELU with the tanh approximation, as torch's gelu(approximate="tanh") writes it: 0.5 x (1 + tanh(sqrt(2 / pi)
// (x + 0.044715 x^3))).
inline v16f gelu_tanh16(v16f x) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;
  const v16f inner = (x + (x * x * x) * kappa) * beta;
  return (x * 0.5f) * (tanh16(inner) + 1.f);
}

inline float gelu_tanh1(float x) {  // a lane of the above
  v16f v = {};
  v[0] = x;
  return gelu_tanh16(v)[0];
}

// x <- cap * tanh(x / cap), in place, each element on its own (Gemma 2's final logit softcap).
template <typename scalar_t>
void softcap_rows(scalar_t* x, int64_t T, int64_t N, float cap) {
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* __restrict__ row = x + t * N;
      int64_t i = 0;  // torch's three ops, each rounded to the dtype
      for (; i + 16 <= N; i += 16)
        store16(row + i, round16<scalar_t>(tanh16(round16<scalar_t>(load16(row + i) / cap))) * cap);
      for (; i < N; ++i) {
        v16f v = {};
        v[0] = rnd<scalar_t>(static_cast<float>(row[i]) / cap);
        row[i] = static_cast<scalar_t>(rnd<scalar_t>(tanh16(v)[0]) * cap);
      }
    }
  });
}

// out = act(gate) * up, row by row (gu: [T, 2I], the gate then the up half): the activation rounded to the dtype
// before the product, as torch's two ops. `vec` is the activation over 16 lanes, `one` over one element (the tail).
template <typename scalar_t, typename Vec, typename One>
void act_mul_rows(const scalar_t* gu, scalar_t* out, int64_t T, int64_t I, Vec vec, One one) {
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* __restrict__ g = gu + t * 2 * I;
      const scalar_t* __restrict__ u = g + I;
      scalar_t* __restrict__ o = out + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) store16(o + i, round16<scalar_t>(vec(load16(g + i))) * load16(u + i));
      for (; i < I; ++i)
        o[i] = static_cast<scalar_t>(rnd<scalar_t>(one(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
    }
  });
}

}  // namespace
}  // namespace conveyor_fused_ops

// Shared with sampling.cpp.
void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [rows, features] tensor");
}

// y = RMSNorm(h) * w; with delta given, h += delta first (in place). Returns y. w in h's dtype multiplies the
// normalized row rounded to it (Llama's form); a float32 w of a bf16 / fp16 h multiplies in float32, rounded once
// (Gemma's 1 + w, OLMo-2's w).
at::Tensor rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor w, double eps) {
  using namespace conveyor_fused_ops;
  check_rows(h, "hidden states");
  const bool float_w = w.scalar_type() == at::kFloat && h.scalar_type() != at::kFloat;
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h.size(1) && (float_w || w.scalar_type() == h.scalar_type()),
              "norm weight mismatch");
  if (delta.has_value()) {
    check_rows(*delta, "residual delta");
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(), "residual delta mismatch");
  }
  auto wc = w.contiguous();
  auto y = h.new_empty(h.sizes());
  AT_DISPATCH_V2(h.scalar_type(), "rms_norm", AT_WRAP([&] {
    rms_norm_rows<scalar_t>(h.data_ptr<scalar_t>(), delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                            float_w ? nullptr : wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), h.size(0), h.size(1),
                            static_cast<float>(eps), float_w ? wc.data_ptr<float>() : nullptr);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

// In place on x [T, >= offset + groups * n]: each of `groups` runs of n columns from `offset` (q or k heads, or the
// whole q / k) RMS-normalized with weight w [n]: Llama's form where w has x's dtype, the float-weight form where
// w is float32 and x is not.
void norm_runs_inplace(at::Tensor x, int64_t offset, int64_t groups, int64_t n, at::Tensor w, double eps) {
  using namespace conveyor_fused_ops;
  check_rows(x, "rows");
  TORCH_CHECK(offset + groups * n <= x.size(1) && w.dim() == 1 && w.size(0) == n, "norm_runs: shape mismatch");
  const bool float_w = w.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  TORCH_CHECK(float_w || w.scalar_type() == x.scalar_type(), "norm_runs: weight dtype");
  auto wc = w.contiguous();
  AT_DISPATCH_V2(x.scalar_type(), "norm_runs", AT_WRAP([&] {
    norm_runs<scalar_t>(x.data_ptr<scalar_t>() + offset, x.size(0), x.size(1), groups, n,
                        float_w ? nullptr : wc.data_ptr<scalar_t>(), float_w ? wc.data_ptr<float>() : nullptr,
                        static_cast<float>(eps));
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// In place: x <- cap * tanh(x / cap) over x [T, N].
void softcap_inplace(at::Tensor x, double cap) {
  using namespace conveyor_fused_ops;
  check_rows(x, "rows");
  TORCH_CHECK(cap > 0, "softcap must be > 0");
  AT_DISPATCH_V2(x.scalar_type(), "softcap", AT_WRAP([&] {
    softcap_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(cap));
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// In place: rotary on the first rot = cos.size(1) dims of the q and k heads of qkv [T, (H + 2 Hkv) * D] (rot 0:
// none); then k, v stored at slots.
void rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache,
                at::Tensor v_cache, int64_t num_heads) {
  using namespace conveyor_fused_ops;
  check_rows(qkv, "qkv");
  const Pool pool = pool_of(k_cache, v_cache);
  const int64_t T = qkv.size(0), D = pool.D;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * pool.Hkv) * D, "qkv width does not match the heads");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) <= D && cos.size(1) % 2 == 0,
              "cos/sin must be [T, rotary dims <= head_dim, even]");
  TORCH_CHECK(slots.size(0) == T && slots.scalar_type() == at::kLong, "slots must be [T] int64");
  for (const auto* x : {&k_cache, &v_cache})
    TORCH_CHECK(x->scalar_type() == qkv.scalar_type(), "rope_store: the pool must have the model's dtype");
  const bool float_tables = cos.scalar_type() == at::kFloat && qkv.scalar_type() != at::kFloat;
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && (float_tables || cos.scalar_type() == qkv.scalar_type()),
              "rope_store: cos / sin in the model's dtype or float32");
  auto c = cos.contiguous(), s = sin.contiguous(), sl = slots.contiguous();
  AT_DISPATCH_V2(qkv.scalar_type(), "rope_store", AT_WRAP([&] {
    if (float_tables)
      rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), nullptr, nullptr, sl.data_ptr<int64_t>(),
                                k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), T, num_heads, pool,
                                c.size(1), c.data_ptr<float>(), s.data_ptr<float>());
    else
      rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                                sl.data_ptr<int64_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), T,
                                num_heads, pool, c.size(1));
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// k, v [T, Hkv, D] (already rotated) stored at slots, in the pool's layout: the KV write of the
// transformers forward's attention (attention.py), where rope_store's rotary is the model's own.
void store_kv(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache) {
  using namespace conveyor_fused_ops;
  const Pool pool = pool_of(k_cache, v_cache);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == pool.Hkv && k.size(2) == pool.D,
              "store_kv: k and v must be [T, Hkv, D] of the pool");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "store_kv: k and v must be in the pool's dtype");
  const int64_t T = k.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong, "slots must be [T] int64");
  auto kc = k.contiguous(), vc = v.contiguous(), sl = slots.contiguous();
  AT_DISPATCH_V2(k.scalar_type(), "store_kv", AT_WRAP([&] {
    const int64_t* sp = sl.data_ptr<int64_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    clear_new_blocks(sp, T, vp, pool);
    const int64_t width = pool.Hkv * pool.D;
    for (int64_t t = 0; t < T; ++t)
      store_kv_row(kc.data_ptr<scalar_t>() + t * width, vc.data_ptr<scalar_t>() + t * width, sp[t], kp, vp, pool);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// gu [T, 2I] (gate | up) -> SiLU(gate) * up [T, I] in one vectorized pass, rounding the SiLU
// result to the model's dtype before the product as the eager MLP does. (torch's silu and mul on
// the strided halves took ~10% of a bf16 prompt step.)
at::Tensor act_mul(at::Tensor gu, int64_t act);
at::Tensor silu_mul(at::Tensor gu) { return act_mul(gu, 0); }

// act(gate) * up for act 0 SiLU, 1 GELU-tanh.
at::Tensor act_mul(at::Tensor gu, int64_t act) {
  using namespace conveyor_fused_ops;
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up width must be even");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = gu.new_empty({T, I});
  AT_DISPATCH_V2(gu.scalar_type(), "act_mul", AT_WRAP([&] {
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    if (act == 0)
      act_mul_rows<scalar_t>(g, o, T, I, [](v16f x) { return silu16<scalar_t>(x); },
                             [](float x) { return x / (1.f + std::exp(-x)); });
    else
      act_mul_rows<scalar_t>(g, o, T, I, gelu_tanh16, gelu_tanh1);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}
