// The 16-float vector of the AVX2 route (vec16.h): two ymm registers in a struct, with the arithmetic,
// comparisons and lane access that the kernels spell on GCC's vector extensions elsewhere. (GCC keeps a
// 64-byte extension vector in memory on targets without AVX-512 and moves it lane by lane: 4-40x slower;
// a struct of two __m256 stays in registers.) Each operation works lane by lane, as there, and is fixed when the
// kernels compile: a row's bits never depend on its batch.
#pragma once
#include <immintrin.h>

struct v16f {
  __m256 lo, hi;
  float operator[](int i) const {
    alignas(32) float t[16];
    _mm256_store_ps(t, lo);
    _mm256_store_ps(t + 8, hi);
    return t[i];
  }
  float& operator[](int i) { return reinterpret_cast<float*>(this)[i]; }
};

// A lane mask, as the comparisons give it (all ones where true).
struct m16 {
  __m256 lo, hi;
};

static inline v16f vsplat(float x) {
  const __m256 h = _mm256_set1_ps(x);
  return {h, h};
}

#define CONVEYOR_V16_BINARY(op, fn)                                                                  \
  static inline v16f operator op(v16f a, v16f b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; }       \
  static inline v16f operator op(v16f a, float b) { return a op vsplat(b); }                        \
  static inline v16f operator op(float a, v16f b) { return vsplat(a) op b; }                        \
  static inline v16f& operator op##=(v16f& a, v16f b) { return a = a op b; }                        \
  static inline v16f& operator op##=(v16f& a, float b) { return a = a op vsplat(b); }
CONVEYOR_V16_BINARY(+, _mm256_add_ps)
CONVEYOR_V16_BINARY(-, _mm256_sub_ps)
CONVEYOR_V16_BINARY(*, _mm256_mul_ps)
CONVEYOR_V16_BINARY(/, _mm256_div_ps)
#undef CONVEYOR_V16_BINARY

static inline v16f operator-(v16f a) {  // the sign flipped, as -x is (not 0 - x)
  const __m256 s = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}

// C's comparisons lane by lane: ordered (false with a NaN) but for !=, which is true with one.
#define CONVEYOR_V16_COMPARE(op, pred)                                                                        \
  static inline m16 operator op(v16f a, v16f b) {                                                             \
    return {_mm256_cmp_ps(a.lo, b.lo, pred), _mm256_cmp_ps(a.hi, b.hi, pred)};                                \
  }                                                                                                           \
  static inline m16 operator op(v16f a, float b) { return a op vsplat(b); }
CONVEYOR_V16_COMPARE(<, _CMP_LT_OQ)
CONVEYOR_V16_COMPARE(>, _CMP_GT_OQ)
CONVEYOR_V16_COMPARE(<=, _CMP_LE_OQ)
CONVEYOR_V16_COMPARE(>=, _CMP_GE_OQ)
CONVEYOR_V16_COMPARE(==, _CMP_EQ_OQ)
CONVEYOR_V16_COMPARE(!=, _CMP_NEQ_UQ)
#undef CONVEYOR_V16_COMPARE

// a where the mask is set, else b (the kernels' `mask ? a : b`).
static inline v16f select16(m16 mask, v16f a, v16f b) {
  return {_mm256_blendv_ps(b.lo, a.lo, mask.lo), _mm256_blendv_ps(b.hi, a.hi, mask.hi)};
}

// 8 bf16 -> 8 floats (the bits shifted into the high half).
static inline __m256 widen8(const void* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 8 floats rounded to bf16 (nearest even, as the generic route rounds), kept as the float they stand for.
static inline __m256 round8_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 floats already rounded to bf16 (round8_bf16) -> their 16 bf16 halves, in order.
static inline void pack16_bf16(void* dst, __m256 a, __m256 b) {
  const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 16),
                                        _mm256_srli_epi32(_mm256_castps_si256(b), 16));  // 128-bit lanes interleaved
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(p, 0xD8));
}

// 2^n for the floats t = n + 1.5 * 2^23 (exp16's rounding trick), from t's low mantissa bits.
static inline __m256 pow2_from_magic8(__m256 t) {
  const __m256i b = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000 - 127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(b, 23));
}
