// 16-float vectors for the CPU kernels (GCC/Clang vector extensions): one AVX-512 register,
// two or four narrower ones on other CPUs; and loads that widen bf16 / fp16 rows to float.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

template <typename scalar_t>
static inline v16f load16(const scalar_t* __restrict__ p) {
  v16f v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#ifdef __AVX512F__  // one widening move (the generic form below compiles to two halves and shuffles)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    v = reinterpret_cast<v16f>(_mm512_castsi512_ps(w));
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

