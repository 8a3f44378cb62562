// y [M, N] = x [M, K] @ W.T (+ bias) in bfloat16 with AVX512-BF16 pair products, for every row count M,
// on CPUs that have the instruction but no AMX tiles (AMD Zen 4, for one).
//
// Each VDPBF16PS adds two products of bf16 pairs to a float accumulator per lane (32 multiply-adds a
// vector, where an FMA on widened floats does 16). Exactness: every output is one chain of such pair
// steps over k = (0, 1), (2, 3), ... in order, starting from zero, plus the bias, rounded once to bf16:
// the other rows, the thread count (threads split the columns) and M never enter it.
//
// W is prepacked as [ceil(N / 32)][K / 2][32][2] (linears.pack_pairs): for each panel of 32 output
// columns, for each pair of K, the 32 columns' (k, k + 1) weights, one contiguous run per panel. The
// micro-kernel and its blocking are those of panel_gemm.cpp: up to 14 rows x 32 columns in 28 registers,
// x broadcast a pair at a time from the rows themselves, rows in L2-sized chunks, the next panel
// prefetched by the chunk's row blocks between them.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstring>

#include "panel_prefetch.h"
#include "row_blocks.h"
#include "vec16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define CONVEYOR_PAIR_GEMM 1
#endif

namespace conveyor_pair_gemm {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

constexpr int64_t PW = 32;
constexpr int MR = 14;
constexpr int64_t CHUNK_BYTES = 1 << 18;

#ifdef CONVEYOR_PAIR_GEMM

template <int R>
inline void block(const c10::BFloat16* __restrict__ x, int64_t ldx, const c10::BFloat16* __restrict__ panel,
                  int64_t pairs, PanelPrefetch pf, float* __restrict__ out) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    pf.step();
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + k * 2 * PW));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + k * 2 * PW + PW));
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      int32_t bits;
      std::memcpy(&bits, x + r * ldx + 2 * k, sizeof(bits));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
      a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * PW, a0[r]);
    _mm512_storeu_ps(out + r * PW + 16, a1[r]);
  }
}

void pair_gemm_impl(const c10::BFloat16* x, const c10::BFloat16* packed, const c10::BFloat16* bias,
                    c10::BFloat16* y, int64_t M, int64_t N, int64_t K, bool gelu) {
  const int64_t num_panels = (N + PW - 1) / PW, pairs = K / 2;
  const int64_t chunk = std::max<int64_t>(MR, CHUNK_BYTES / (K * 2) / MR * MR);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[MR * PW];
    alignas(64) float b[PW];
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const c10::BFloat16* panel = packed + p * K * PW;
        const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + K * PW) : nullptr;
        const int64_t col = p * PW, width = std::min(PW, N - col);
        const __mmask32 mask = width >= 32 ? ~__mmask32(0) : ((__mmask32(1) << width) - 1);
        for (int64_t j = 0; j < PW; ++j) b[j] = bias != nullptr && j < width ? static_cast<float>(bias[col + j]) : 0.f;
        for (int64_t m0 = c0; m0 < c1; m0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, c1 - m0));
          // (a row of the panel: one pair of K for its 32 columns)
          const PanelPrefetch pf(next, PW * 2 * sizeof(c10::BFloat16), pairs, m0 - c0, rows, c1 - c0);
          with_rows<MR>(rows, [&](auto R) { block<R.value>(x + m0 * K, K, panel, pairs, pf, out); });
          for (int r = 0; r < rows; ++r) {
            __m512 lo = _mm512_add_ps(_mm512_loadu_ps(out + r * PW), _mm512_load_ps(b));
            __m512 hi = _mm512_add_ps(_mm512_loadu_ps(out + r * PW + 16), _mm512_load_ps(b + 16));
            if (gelu) {  // GELU of the output as stored (rounded to bf16), as gelu_erf on the stored row
              lo = reinterpret_cast<__m512>(gelu_erf16(round16<c10::BFloat16>(reinterpret_cast<v16f>(lo))));
              hi = reinterpret_cast<__m512>(gelu_erf16(round16<c10::BFloat16>(reinterpret_cast<v16f>(hi))));
            }
            const __m512bh packed16 = _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, as torch's casts
            _mm512_mask_storeu_epi16(y + (m0 + r) * N + col, mask, reinterpret_cast<__m512i>(packed16));
          }
        }
      }
    }
  });
}

#endif  // CONVEYOR_PAIR_GEMM

}  // namespace
}  // namespace conveyor_pair_gemm

bool pair_gemm_available() {
#ifdef CONVEYOR_PAIR_GEMM
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (K even), packed [ceil(N / 32), K / 2, 32, 2] (linears.pack_pairs), bias [N] or None
// -> y [M, N] bf16; act 1: GELU (erf) of it, applied as each block is stored.
at::Tensor pair_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias, int64_t act) {
  using namespace conveyor_pair_gemm;
  TORCH_CHECK(pair_gemm_available(), "pair_gemm: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "pair_gemm: x [M, K] and packed weights in bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 2 == 0 && packed.is_contiguous() && packed.dim() == 4 && packed.size(1) == K / 2 &&
                  packed.size(2) == PW && packed.size(3) == 2 && packed.size(0) == (N + PW - 1) / PW,
              "pair_gemm: packed weights do not match x [M, K] and N");
  auto y = x.new_empty({M, N});
  if (M == 0) return y;
#ifdef CONVEYOR_PAIR_GEMM
  auto xc = x.contiguous();
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kBFloat16, "pair_gemm: bias must be [N] bf16");
    b = bias->contiguous();
  }
  pair_gemm_impl(xc.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(),
                 b.has_value() ? b->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), M, N, K,
                 act == 1);
#endif
  return y;
}
