// 16-float vectors for the CPU kernels (GCC/Clang vector extensions): one AVX-512 register, or two AVX2
// ones (the AVX2 route: `-march=x86-64-v3`, where each primitive below is spelled as two 8-lane
// instructions, never as a loop over lanes); loads that widen bf16 / fp16 rows to float; exp, tanh, GELU
// (erf); a prefetch of a span into L2.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define CONVEYOR_AVX2 1  // the AVX2 route: a v16f is two ymm registers (vec16_avx2.h)
#include "vec16_avx2.h"
#else
typedef float v16f __attribute__((vector_size(64)));
// a where the mask is set, else b.
template <typename M>
static inline v16f select16(M mask, v16f a, v16f b) {
  return mask ? a : b;
}
#endif
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

template <typename scalar_t>
static inline v16f load16(const scalar_t* __restrict__ p) {
  v16f v;
  if constexpr (std::is_same_v<scalar_t, float>) {
#ifdef CONVEYOR_AVX2  // explicit loads: a memcpy into the struct goes through the stack
    v = v16f{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
#else
    std::memcpy(&v, p, sizeof(v));
#endif
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#ifdef __AVX512F__  // one widening move (the generic form below compiles to two halves and shuffles)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    v = reinterpret_cast<v16f>(_mm512_castsi512_ps(w));
#elif defined(CONVEYOR_AVX2)
    v = v16f{widen8(p), widen8(p + 8)};
#else
    v16u16 h;
    std::memcpy(&h, p, sizeof(h));
    const v16u32 w = __builtin_convertvector(h, v16u32) << 16;
    std::memcpy(&v, &w, sizeof(v));
#endif
  } else {
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}


// Round 16 floats through scalar_t (round to nearest even for bf16), as a store then a load would.
template <typename scalar_t>
static inline v16f round16(v16f x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#ifdef __AVX512BF16__  // one conversion instruction, round to nearest even (bf16 subnormals flushed)
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(x)))), 16);
    return reinterpret_cast<v16f>(_mm512_castsi512_ps(w));
#elif defined(CONVEYOR_AVX2)
    return v16f{round8_bf16(x.lo), round8_bf16(x.hi)};
#else
    v16u32 bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
    v16f r;
    std::memcpy(&r, &bits, sizeof(r));
    return r;
#endif
  } else {
    for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(static_cast<scalar_t>(x[i]));
    return x;
  }
}

// Store 16 floats as scalar_t (bf16: rounded to nearest even, packed without scalar conversions).
template <typename scalar_t>
static inline void store16(scalar_t* __restrict__ dst, v16f x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
#ifdef CONVEYOR_AVX2
    _mm256_storeu_ps(dst, x.lo);
    _mm256_storeu_ps(dst + 8, x.hi);
#else
    std::memcpy(dst, &x, sizeof(x));
#endif
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#ifdef __AVX512BF16__
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(x))));
#elif defined(CONVEYOR_AVX2)
    pack16_bf16(dst, round8_bf16(x.lo), round8_bf16(x.hi));
#else
    const v16f r = round16<scalar_t>(x);
    v16u32 bits;
    std::memcpy(&bits, &r, sizeof(bits));
    const v16u16 h = __builtin_convertvector(bits >> 16, v16u16);
    std::memcpy(dst, &h, sizeof(h));
#endif
  } else {
    for (int i = 0; i < 16; ++i) dst[i] = static_cast<scalar_t>(x[i]);
  }
}

// a * b + c rounded once (a fused multiply-add) in every lane, on every target: the exact kernels
// spell their multiply-adds with it, never leaving the choice between one rounding and two to the
// compiler's contraction of `c += a * b`.
static inline v16f fma16(v16f a, v16f b, v16f c) {
#ifdef __AVX512F__
  return reinterpret_cast<v16f>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(CONVEYOR_AVX2)
  return v16f{_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
#else
  for (int i = 0; i < 16; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return c;
#endif
}

// x in all 16 lanes (`v16f{} + x` would be an addition: 0 + x is not x when x is -0).
static inline v16f splat16(float x) {
#ifdef __AVX512F__
  return reinterpret_cast<v16f>(_mm512_set1_ps(x));
#elif defined(CONVEYOR_AVX2)
  return vsplat(x);
#else
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = x;
  return v;
#endif
}

// The 16 lanes' largest and their sum, each in one fixed order (a tree on AVX-512, the lanes in order elsewhere,
// read from one store of the vector).
static inline float hmax16(v16f v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  alignas(64) float t[16];
  store16(t, v);
  float m = t[0];
  for (int lane = 1; lane < 16; ++lane) m = t[lane] > m ? t[lane] : m;
  return m;
#endif
}

static inline float hsum16(v16f v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  alignas(64) float t[16];
  store16(t, v);
  float total = 0.f;
  for (int lane = 0; lane < 16; ++lane) total += t[lane];
  return total;
#endif
}

// exp(x) on 16 lanes, within a few ulp: Cephes' range reduction and polynomial in plain vector
// arithmetic (a scalar libm call per element is what it replaces). Inputs are clamped to
// [-87.3, 87.3]: exp(-87.3) ~ 1e-38 stands for 0, exp(87.3) ~ 1e38 for overflow.
static inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.3f, hi = v16f{} + 87.3f;
  x = select16(x < lo, lo, x);
  x = select16(x > hi, hi, x);
  const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
  const v16f t = x * 1.44269504088896341f + magic;
  const v16f n = t - magic;
  v16f r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v16f p = v16f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v16f y = p * r * r + r + 1.f;
#ifdef CONVEYOR_AVX2
  const v16f scale{pow2_from_magic8(t.lo), pow2_from_magic8(t.hi)};
#else
  v16u32 bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - 0x4B400000u + 127u) << 23;  // 2^n
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
#endif
  return y * scale;
}

// erfc(z) for z >= 0 on 16 lanes (Numerical Recipes' erfcc: relative error below 1.2e-7 everywhere).
static inline v16f erfc16(v16f z) {
  const v16f t = 1.f / (z * 0.5f + 1.f);
  v16f p = splat16(0.17087277f);
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  return t * exp16(p - z * z);
}

// GELU(x) = x / 2 * (1 + erf(x / sqrt 2)): x (1 - erfc(z) / 2) for x >= 0, x erfc(z) / 2 below, z = |x| / sqrt 2.
static inline v16f gelu_erf16(v16f x) {
  const v16f ax = select16(x < 0.f, -x, x);
  const v16f c = erfc16(ax * 0.70710678118654752f);
  return select16(x < 0.f, x * c * 0.5f, x * (1.f - c * 0.5f));
}

// tanh(x) on 16 lanes, within a few ulp (Cephes' tanhf): an odd polynomial below |x| = 0.625, where
// 1 - 2 / (exp(2|x|) + 1) would lose bits to cancellation, that form above it, the sign put back.
static inline v16f tanh16(v16f x) {
  const v16f ax = select16(x < 0.f, -x, x);
  const v16f z = x * x;
  v16f p = v16f{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const v16f small = p * z * x + x;
  v16f large = 1.f - 2.f / (exp16(ax + ax) + 1.f);
  large = select16(x < 0.f, -large, large);
  return select16(ax < 0.625f, small, large);
}

// Ask for [p, p + n elements) to be brought into L2 (prefetcht1), one request per cache line.
template <typename T>
static inline void prefetch_l2(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(c + x, 0, 2);
}
