// The linears of quantized checkpoints, for every row count M, keeping the weights in their quantized form.
//
// `wq_gemm`, weight-only (W4A16, W8A16, GPTQ, AWQ, GGUF blocks): y [M, N] = x [M, K] @ W.T (+ bias), where each
// weight is de-quantized as w = ((u - z) * s) + o in float (u its unsigned 4- or 8-bit value, z, s, o its group's
// zero, scale and offset, in float32; two roundings, the multiply then the add, never fused). A panel's weights are
// de-quantized a tile of KT rows of k at a time into float (L1), and every row block of the chunk runs over the tile
// the same chain of fused multiply-adds as `panel_gemm`, its accumulators kept in memory between tiles (a float
// stored and loaded is the same float). So every output is the dense route's sum over the de-quantized weights: one
// chain over k in order from zero, plus the bias, rounded once, bit for bit; other rows, the thread count and M
// never enter it.
//
// Layouts (linears.pack_wq): values [ceil(N / 32)][K][32] bytes (8 bits) or [ceil(N / 32)][K][16] bytes (4 bits:
// byte j holds column j in its low nibble and column j + 16 in its high one); scales, zeros and offsets
// [ceil(N / 32)][groups][32] float32, group g covering k in [g * group, (g + 1) * group).
//
// `i8_gemm`, W8A8 (compressed-tensors int-quantized with int8 activations): each row of x is quantized on its own
// (per token: batch-invariant by construction), q = clamp(round_half_even(x / s_x), -128, 127) in float32, s_x the
// row's largest magnitude / 127.5 (dynamic) or the checkpoint's static scale; acc = sum over k of q * w in int32
// (exact, so any order gives the same sum: AVX512-VNNI's u8 x s8 dot products on x + 128, less 128 * sum(w), or
// AVX2's int16 pair products give the same integers); y = ((float) acc * s_x) * s_w[n] (+ bias), rounded once.
// Layout (linears.pack_i8): [ceil(N / 32)][ceil(K / 4)][32][4] int8, zero-padded; `wsum` [ceil(N / 32) * 32] int32.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "row_blocks.h"
#include "vec16.h"

#pragma GCC optimize("fp-contract=off")  // the de-quantization's multiply and add round apart, as written

namespace conveyor_quant_gemm {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {

constexpr int64_t PW = 32;   // panel width: two vectors
constexpr int64_t KT = 128;  // rows of k de-quantized at a time: 16 KB of floats
#ifdef CONVEYOR_AVX2
constexpr int MR = 6;
#else
constexpr int MR = 14;
#endif
constexpr int64_t CHUNK_BYTES = 1 << 19;  // rows of x per chunk: about this many bytes of them

// 16 unsigned bytes -> their 16 values as floats.
static inline v16f bytes16(__m128i b) {
#ifdef CONVEYOR_AVX2
  return v16f{_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
#else
  return reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
#endif
}

// 16 weights of the panel's row k, columns [16 h, 16 h + 16), as unsigned values in floats.
template <int BITS>
inline v16f values16(const uint8_t* __restrict__ q, int64_t k, int h) {
  if constexpr (BITS == 8) {
    return bytes16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * PW + 16 * h)));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * (PW / 2)));
    return bytes16(_mm_and_si128(h == 0 ? b : _mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)));
  }
}

// The panel's rows k in [k0, k1) de-quantized into w [k1 - k0][32].
template <int BITS>
void dequant_tile(const uint8_t* __restrict__ q, const float* __restrict__ s, const float* __restrict__ z,
                  const float* __restrict__ o, int64_t group, int64_t k0, int64_t k1, float* __restrict__ w) {
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / group, end = std::min(k1, (g + 1) * group);
    const v16f s0 = load16(s + g * PW), s1 = load16(s + g * PW + 16);
    const v16f z0 = load16(z + g * PW), z1 = load16(z + g * PW + 16);
    v16f o0 = v16f{}, o1 = v16f{};
    if (o != nullptr) o0 = load16(o + g * PW), o1 = load16(o + g * PW + 16);
    for (; k < end; ++k) {
      const v16f u0 = values16<BITS>(q, k, 0), u1 = values16<BITS>(q, k, 1);
      v16f w0 = (u0 - z0) * s0, w1 = (u1 - z1) * s1;
      if (o != nullptr) w0 = w0 + o0, w1 = w1 + o1;
      store16(w + (k - k0) * PW, w0);
      store16(w + (k - k0) * PW + 16, w1);
    }
  }
}

// Rows [0, R) x the NV * 16 columns from 16 h, over all of k, each weight de-quantized in registers as it is used
// (a chunk of one row block: no tile to share). The same w and the same chain as the tile route's.
template <int R, int NV, int BITS>
inline void direct_block(const float* __restrict__ x, int64_t ldx, const uint8_t* __restrict__ q,
                         const float* __restrict__ s, const float* __restrict__ z, const float* __restrict__ o,
                         int64_t group, int64_t K, int h, float* __restrict__ acc) {
  v16f a[NV][R];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < R; ++r) a[v][r] = v16f{};
  for (int64_t k = 0; k < K;) {
    const int64_t g = k / group, end = std::min(K, (g + 1) * group);
    v16f sv[NV], zv[NV], ov[NV];
    for (int v = 0; v < NV; ++v) {
      const int64_t at = g * PW + 16 * (h + v);
      sv[v] = load16(s + at), zv[v] = load16(z + at), ov[v] = o != nullptr ? load16(o + at) : v16f{};
    }
    for (; k < end; ++k) {
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        v16f w = (values16<BITS>(q, k, h + v) - zv[v]) * sv[v];
        if (o != nullptr) w = w + ov[v];
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) a[v][r] = fma16(splat16(x[r * ldx + k]), w, a[v][r]);
      }
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < R; ++r) store16(acc + r * PW + 16 * (h + v), a[v][r]);
}

template <int R, int BITS>
inline void direct_rows(const float* x, int64_t ldx, const uint8_t* q, const float* s, const float* z, const float* o,
                        int64_t group, int64_t K, float* acc) {
#ifdef CONVEYOR_AVX2
  direct_block<R, 1, BITS>(x, ldx, q, s, z, o, group, K, 0, acc);
  direct_block<R, 1, BITS>(x, ldx, q, s, z, o, group, K, 1, acc);
#else
  direct_block<R, 2, BITS>(x, ldx, q, s, z, o, group, K, 0, acc);
#endif
}

// Rows [0, R) x 16 columns (from `col`) of a tile of kt rows: acc[r] continues over the tile in k order.
template <int R>
inline void tile_block16(const float* __restrict__ x, int64_t ldx, const float* __restrict__ w, int64_t kt,
                         int64_t col, bool first, float* __restrict__ acc) {
  v16f a[R];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) a[r] = first ? v16f{} : load16(acc + r * PW + col);
  for (int64_t k = 0; k < kt; ++k) {
    const v16f wv = load16(w + k * PW + col);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) a[r] = fma16(splat16(x[r * ldx + k]), wv, a[r]);
  }
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) store16(acc + r * PW + col, a[r]);
}

#ifndef CONVEYOR_AVX2
// Rows [0, R) x the tile's 32 columns at once (28 accumulators in AVX-512's 32 registers).
template <int R>
inline void tile_block32(const float* __restrict__ x, int64_t ldx, const float* __restrict__ w, int64_t kt,
                         bool first, float* __restrict__ acc) {
  v16f a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = first ? v16f{} : load16(acc + r * PW);
    a1[r] = first ? v16f{} : load16(acc + r * PW + 16);
  }
  for (int64_t k = 0; k < kt; ++k) {
    const v16f w0 = load16(w + k * PW), w1 = load16(w + k * PW + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const v16f xv = splat16(x[r * ldx + k]);
      a0[r] = fma16(xv, w0, a0[r]);
      a1[r] = fma16(xv, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(acc + r * PW, a0[r]);
    store16(acc + r * PW + 16, a1[r]);
  }
}
#endif

template <int R>
inline void tile_block(const float* x, int64_t ldx, const float* w, int64_t kt, bool first, float* acc) {
#ifdef CONVEYOR_AVX2
  tile_block16<R>(x, ldx, w, kt, 0, first, acc);
  tile_block16<R>(x, ldx, w, kt, 16, first, acc);
#else
  tile_block32<R>(x, ldx, w, kt, first, acc);
#endif
}

// Rows of the finished accumulators acc [rows][32] -> y's columns [col, col + width) (+ bias), rounded once.
template <typename scalar_t>
inline void store_rows(const float* acc, int64_t rows, const scalar_t* bias, scalar_t* y, int64_t ldy, int64_t col,
                       int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j)
      y[r * ldy + col + j] = static_cast<scalar_t>(bias != nullptr ? acc[r * PW + j] + static_cast<float>(bias[col + j])
                                                                     : acc[r * PW + j]);
}

template <int BITS, typename scalar_t>
void wq_gemm_impl(const float* xf, const uint8_t* q, const float* s, const float* z, const float* o,
                  const scalar_t* bias, scalar_t* y, int64_t M, int64_t N, int64_t K, int64_t group) {
  const int64_t num_panels = (N + PW - 1) / PW, groups = (K + group - 1) / group;
  const int64_t panel_bytes = K * PW * BITS / 8;
  const int64_t chunk = std::max<int64_t>(MR, CHUNK_BYTES / (K * 4) / MR * MR);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(KT * PW);
    std::vector<float> acc(std::min(chunk, M) * PW);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t sp = p * groups * PW, col = p * PW;
        const float* op = o == nullptr ? nullptr : o + sp;
        if (c1 - c0 <= MR) {  // one row block: each weight de-quantized once anyway, in registers
          with_rows<MR>(static_cast<int>(c1 - c0), [&](auto R) {
            direct_rows<R.value, BITS>(xf + c0 * K, K, q + p * panel_bytes, s + sp, z + sp, op, group, K, acc.data());
          });
          store_rows(acc.data(), c1 - c0, bias, y + c0 * N, N, col, std::min(PW, N - col));
          continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += KT) {
          const int64_t k1 = std::min(K, k0 + KT);
          dequant_tile<BITS>(q + p * panel_bytes, s + sp, z + sp, op, group, k0, k1, tile.data());
          for (int64_t m0 = c0; m0 < c1; m0 += MR) {
            const int rows = static_cast<int>(std::min<int64_t>(MR, c1 - m0));
            with_rows<MR>(rows, [&](auto R) {
              tile_block<R.value>(xf + m0 * K + k0, K, tile.data(), k1 - k0, k0 == 0, acc.data() + (m0 - c0) * PW);
            });
          }
        }
        store_rows(acc.data(), c1 - c0, bias, y + c0 * N, N, col, std::min(PW, N - col));
      }
    }
  });
}

// ---- W8A8 ----

// Row x [K] (float) -> its int8 values (k padded to a multiple of 4 with zeros) and scale.
inline float quantize_row(const float* x, int64_t K, int64_t K4, float static_scale, int8_t* q) {
  float s = static_scale;
  if (s <= 0.f) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    s = amax / 127.5f;
    if (s == 0.f) s = 1.f;  // a row of zeros: every value 0
  }
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(x[k] / s);  // round half to even (the default rounding mode)
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
  for (int64_t k = K; k < K4 * 4; ++k) q[k] = 0;
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CONVEYOR_I8_VNNI 1
constexpr int MR8 = 14;
// Rows [0, R) x 32 columns: acc = sum over k of (q + 128) * w, in int32, by VPDPBUSD (u8 x s8, four a lane).
template <int R>
inline void i8_block_vnni(const uint8_t* __restrict__ xu, int64_t ldx, const int8_t* __restrict__ panel, int64_t K4,
                          bool first, int32_t* __restrict__ out) {
  __m512i a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(out + r * PW);
    a1[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(out + r * PW + 16);
  }
  for (int64_t k = 0; k < K4; ++k) {
    const __m512i w0 = _mm512_loadu_si512(panel + k * PW * 4), w1 = _mm512_loadu_si512(panel + k * PW * 4 + 64);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      int32_t bits;
      std::memcpy(&bits, xu + r * ldx + 4 * k, 4);
      const __m512i xv = _mm512_set1_epi32(bits);
      a0[r] = _mm512_dpbusd_epi32(a0[r], xv, w0);
      a1[r] = _mm512_dpbusd_epi32(a1[r], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(out + r * PW, a0[r]);
    _mm512_storeu_si512(out + r * PW + 16, a1[r]);
  }
}
#endif

constexpr int MR16 = 6;
constexpr int64_t KT4 = 64;  // fours of k per tile: 256 k
// Rows [0, R) x 32 columns, 8 at a time: acc = sum over k of q * w in int32, by int16 pair products (VPMADDWD),
// each accumulator lane holding a column's even or odd pairs, added at the end.
template <int R>
inline void i8_block_madd(const int16_t* __restrict__ x16, int64_t ldx, const int8_t* __restrict__ panel, int64_t K4,
                          bool first, int32_t* __restrict__ out) {
  for (int c = 0; c < PW; c += 8) {
    __m256i a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K4; ++k) {
      const int8_t* w = panel + (k * PW + c) * 4;
      const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int64_t bits;
        std::memcpy(&bits, x16 + r * ldx + 4 * k, 8);
        const __m256i xv = _mm256_set1_epi64x(bits);
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(wa, xv));
        b[r] = _mm256_add_epi32(b[r], _mm256_madd_epi16(wb, xv));
      }
    }
    for (int r = 0; r < R; ++r) {  // [c0 c0 c1 c1 | c2 c2 c3 c3] and [c4 ... c7] -> c0 .. c7, added to the tiles before
      __m256i h = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a[r], b[r]), 0xD8);
      __m256i* dst = reinterpret_cast<__m256i*>(out + r * PW + c);
      if (!first) h = _mm256_add_epi32(h, _mm256_loadu_si256(dst));
      _mm256_storeu_si256(dst, h);
    }
  }
}

template <typename scalar_t>
void i8_gemm_impl(const float* xf, const int8_t* packed, const int32_t* wsum, const float* wscale,
                  const scalar_t* bias, scalar_t* y, int64_t M, int64_t N, int64_t K, float static_scale,
                  bool vnni) {
  const int64_t K4 = (K + 3) / 4, num_panels = (N + PW - 1) / PW;
  std::vector<int8_t> xq(M * K4 * 4);
  std::vector<float> xs(M);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) xs[m] = quantize_row(xf + m * K, K, K4, static_scale, xq.data() + m * K4 * 4);
  });
  // The operand each route reads: x + 128 as bytes (VNNI), or x as int16.
  std::vector<uint8_t> xu;
  std::vector<int16_t> x16;
  if (vnni) {
    xu.resize(xq.size());
    for (size_t i = 0; i < xq.size(); ++i) xu[i] = static_cast<uint8_t>(xq[i] + 128);
  } else {
    x16.assign(xq.begin(), xq.end());
  }
  const int64_t ldx = K4 * 4;
  const int64_t chunk = std::max<int64_t>(14 * 6, CHUNK_BYTES / (ldx * 2) / 42 * 42);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t out[16 * PW];
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const int8_t* panel = packed + p * K4 * PW * 4;
        const int64_t col = p * PW, width = std::min(PW, N - col);
        const int mr = vnni ?
#ifdef CONVEYOR_I8_VNNI
                            MR8
#else
                            MR16
#endif
                            : MR16;
        for (int64_t m0 = c0; m0 < c1; m0 += mr) {
          const int rows = static_cast<int>(std::min<int64_t>(mr, c1 - m0));
          for (int64_t t0 = 0; t0 < K4; t0 += KT4) {  // k in tiles that stay in L1 with the block's rows of x
            const int64_t t1 = std::min(K4, t0 + KT4);
            const int8_t* tile = panel + t0 * PW * 4;
#ifdef CONVEYOR_I8_VNNI
            if (vnni) {
              with_rows<MR8>(rows, [&](auto R) {
                i8_block_vnni<R.value>(xu.data() + m0 * ldx + 4 * t0, ldx, tile, t1 - t0, t0 == 0, out);
              });
              continue;
            }
#endif
            with_rows<MR16>(rows, [&](auto R) {
              i8_block_madd<R.value>(x16.data() + m0 * ldx + 4 * t0, ldx, tile, t1 - t0, t0 == 0, out);
            });
          }
#ifdef CONVEYOR_I8_VNNI
          if (vnni)
            for (int r = 0; r < rows; ++r)
              for (int64_t j = 0; j < PW; ++j) out[r * PW + j] -= 128 * wsum[col + j];
#endif
          for (int r = 0; r < rows; ++r) {
            const float sx = xs[m0 + r];
            scalar_t* dst = y + (m0 + r) * N + col;
            for (int64_t j = 0; j < width; ++j) {
              const float v = (static_cast<float>(out[r * PW + j]) * sx) * wscale[col + j];
              dst[j] = static_cast<scalar_t>(bias != nullptr ? v + static_cast<float>(bias[col + j]) : v);
            }
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace conveyor_quant_gemm

// x [M, K]; q, scales, zeros (offsets or None) packed by linears.pack_wq; bits 4 or 8; -> [M, N].
at::Tensor wq_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros, c10::optional<at::Tensor> offsets,
                   int64_t N, int64_t group, int64_t bits, c10::optional<at::Tensor> bias) {
  using namespace conveyor_quant_gemm;
  TORCH_CHECK(x.dim() == 2 && (bits == 4 || bits == 8) && group > 0, "wq_gemm: x [M, K], bits 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + PW - 1) / PW, groups = (K + group - 1) / group;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.numel() == panels * K * PW * bits / 8,
              "wq_gemm: q must be the packed values of [N, K]");
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == panels * groups * PW,
                "wq_gemm: scales and zeros must be float32 [N / 32, groups, 32]");
  const float* o = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->numel() == scales.numel(),
                "wq_gemm: offsets must be laid out as scales");
    o = offsets->data_ptr<float>();
  }
  auto xf = x.to(at::kFloat).contiguous();
  auto y = x.new_empty({M, N});
  if (M == 0) return y;
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "wq_gemm: bias must be [N]");
    b = bias->contiguous();
  }
  AT_DISPATCH_V2(x.scalar_type(), "wq_gemm", AT_WRAP([&] {
    const scalar_t* bp = b.has_value() ? b->data_ptr<scalar_t>() : nullptr;
    if (bits == 4)
      wq_gemm_impl<4, scalar_t>(xf.data_ptr<float>(), q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                zeros.data_ptr<float>(), o, bp, y.data_ptr<scalar_t>(), M, N, K, group);
    else
      wq_gemm_impl<8, scalar_t>(xf.data_ptr<float>(), q.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                zeros.data_ptr<float>(), o, bp, y.data_ptr<scalar_t>(), M, N, K, group);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

bool i8_vnni_built() {
#ifdef CONVEYOR_I8_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, K]; packed, wsum by linears.pack_i8; wscale [N / 32 * 32] float32; x_scale > 0: static, else per row;
// vnni: the AVX512-VNNI route (where built in), else int16 pair products. -> [M, N].
at::Tensor i8_gemm(at::Tensor x, at::Tensor packed, at::Tensor wsum, at::Tensor wscale, int64_t N,
                   c10::optional<at::Tensor> bias, double x_scale, bool vnni) {
  using namespace conveyor_quant_gemm;
  TORCH_CHECK(x.dim() == 2, "i8_gemm: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + PW - 1) / PW;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.numel() == panels * ((K + 3) / 4) * PW * 4,
              "i8_gemm: packed must be the int8 values of [N, K] (linears.pack_i8)");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == panels * PW && wscale.scalar_type() == at::kFloat &&
                  wscale.numel() == panels * PW,
              "i8_gemm: wsum int32 and wscale float32 of [N / 32 * 32]");
  TORCH_CHECK(!vnni || i8_vnni_built(), "i8_gemm: the VNNI route is not built in");
  auto xf = x.to(at::kFloat).contiguous();
  auto y = x.new_empty({M, N});
  if (M == 0) return y;
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "i8_gemm: bias must be [N]");
    b = bias->contiguous();
  }
  auto ws = wsum.contiguous();
  auto sc = wscale.contiguous();
  AT_DISPATCH_V2(x.scalar_type(), "i8_gemm", AT_WRAP([&] {
    i8_gemm_impl<scalar_t>(xf.data_ptr<float>(), packed.data_ptr<int8_t>(), ws.data_ptr<int32_t>(),
                           sc.data_ptr<float>(), b.has_value() ? b->data_ptr<scalar_t>() : nullptr,
                           y.data_ptr<scalar_t>(), M, N, K, static_cast<float>(x_scale), vnni);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}
