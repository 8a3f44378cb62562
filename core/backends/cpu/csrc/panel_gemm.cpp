// y [M, N] = x [M, K] @ W.T (+ bias) with float multiply-adds, for every row count M.
//
// Exactness: every output is one chain of fused multiply-adds over k in order, starting from zero,
// plus the bias at the end: y[m, n] = round(fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)) + b[n]).
// Nothing else enters it: not the other rows (rows are blocked, never mixed), not the thread count
// (threads split the output columns, never K), not M (no shape-dependent routes). So a row's result is
// the same alone, in a step of 2048 rows, or anywhere in between.
//
// W is prepacked in panels of 32 columns, [ceil(N / 32)][K][32] (linears.pack_panels), each panel
// one contiguous run read front to back. The micro-kernel keeps a block of up to 14 rows x 32 columns
// in 28 vector registers (on the AVX2 route: 6 rows x 16 columns in 12, a half panel per pass) and
// broadcasts x from the rows themselves (no packing of x). Rows are taken in
// chunks that stay in L2 while every panel of the thread passes over them; within a chunk a panel is
// read from L2, and the chunk's row blocks prefetch the next panel into L2 between them, each its share
// (in proportion to its rows) spread evenly over its steps, so the stream from memory runs through the
// whole panel's time instead of bursting in its first block. Float32, bf16 and fp16 weights (the latter
// two widened to float as loaded).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cstring>

#include "panel_prefetch.h"
#include "row_blocks.h"
#include "vec16.h"

namespace conveyor_panel_gemm {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

constexpr int64_t PW = 32;          // panel width: two vectors
#ifdef CONVEYOR_AVX2
constexpr int MR = 6;               // rows per micro-kernel block: 6 x 16 columns, 12 of AVX2's 16 registers
#else
constexpr int MR = 14;              // rows per micro-kernel block: 28 accumulators
#endif
constexpr int64_t CHUNK_BYTES = 1 << 19;  // rows of x per chunk: about this many bytes of them

#ifdef CONVEYOR_AVX2
// Rows [0, R) x the panel's 16 columns from `half` * 16: the same sums as `block` below (one chain of fused
// multiply-adds over k in order per output), half a panel at a time so that the accumulators fit AVX2's
// registers. Each half's pass prefetches its share of the next panel (`pf` counts half rows).
template <int R, typename scalar_t>
inline void half_block(const float* __restrict__ x, int64_t ldx, const scalar_t* __restrict__ panel, int64_t K,
                       int half, PanelPrefetch& pf, float* __restrict__ out) {
  v16f a[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a[r] = v16f{};
  const scalar_t* w = panel + half * 16;
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const v16f wv = load16(w + k * PW);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) a[r] = fma16(splat16(x[r * ldx + k]), wv, a[r]);
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) store16(out + r * PW + half * 16, a[r]);
}

template <int R, typename scalar_t>
inline void block(const float* __restrict__ x, int64_t ldx, const scalar_t* __restrict__ panel, int64_t K,
                  PanelPrefetch pf, float* __restrict__ out) {
  half_block<R>(x, ldx, panel, K, 0, pf, out);
  half_block<R>(x, ldx, panel, K, 1, pf, out);
}
#else
// Rows [0, R) x the panel's 32 columns: acc[r] = sum over k in order of x[r][k] * w[k][.] (fused),
// prefetching `pf`'s rows of the next panel into L2 on the way (panel_prefetch.h).
template <int R, typename scalar_t>
inline void block(const float* __restrict__ x, int64_t ldx, const scalar_t* __restrict__ panel, int64_t K,
                  PanelPrefetch pf, float* __restrict__ out) {
  v16f a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const v16f w0 = load16(panel + k * PW), w1 = load16(panel + k * PW + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const v16f xv = splat16(x[r * ldx + k]);
      a0[r] = fma16(xv, w0, a0[r]);
      a1[r] = fma16(xv, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(out + r * PW, a0[r]);
    store16(out + r * PW + 16, a1[r]);
  }
}
#endif

#ifdef CONVEYOR_AVX2
constexpr int64_t PREFETCH_PASSES = 2;  // the half-panel passes: the next panel prefetched in half rows
#else
constexpr int64_t PREFETCH_PASSES = 1;
#endif

template <typename scalar_t>
void panel_gemm_impl(const float* xf, const scalar_t* packed, const scalar_t* bias, scalar_t* y, int64_t M,
                     int64_t N, int64_t K, bool gelu) {
  const int64_t num_panels = (N + PW - 1) / PW;
  const int64_t chunk = std::max<int64_t>(MR, CHUNK_BYTES / (K * 4) / MR * MR);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[MR * PW];
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        const scalar_t* panel = packed + p * K * PW;
        const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + K * PW) : nullptr;
        const int64_t col = p * PW, width = std::min(PW, N - col);
        for (int64_t m0 = c0; m0 < c1; m0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, c1 - m0));
          const PanelPrefetch pf(next, PW * sizeof(scalar_t) / PREFETCH_PASSES, K * PREFETCH_PASSES, m0 - c0, rows,
                                 c1 - c0);
          with_rows<MR>(rows, [&](auto R) { block<R.value>(xf + m0 * K, K, panel, K, pf, out); });
          for (int r = 0; r < rows; ++r) {
            scalar_t* dst = y + (m0 + r) * N + col;
            const float* src = out + r * PW;
            if (gelu) {  // GELU of the output as stored (rounded to scalar_t), as gelu_erf on the stored row
              alignas(64) float v[PW];
              for (int64_t j = 0; j < PW; ++j)
                v[j] = static_cast<float>(static_cast<scalar_t>(
                    bias != nullptr && j < width ? src[j] + static_cast<float>(bias[col + j]) : src[j]));
              for (int64_t j = 0; j < PW; j += 16) {
                const v16f g = gelu_erf16(load16(v + j));
                store16(v + j, g);
              }
              for (int64_t j = 0; j < width; ++j) dst[j] = static_cast<scalar_t>(v[j]);
              continue;
            }
            for (int64_t j = 0; j < width; ++j)
              dst[j] = static_cast<scalar_t>(bias != nullptr ? src[j] + static_cast<float>(bias[col + j]) : src[j]);
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace conveyor_panel_gemm

// x [M, K], packed [ceil(N / 32), K, 32] (see linears.pack_panels), bias [N] or None -> [M, N]; act 1: GELU
// (erf) of it, applied as each block is stored.
at::Tensor panel_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias, int64_t act) {
  using namespace conveyor_panel_gemm;
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == PW && x.size(1) == packed.size(1),
              "panel_gemm: x [M, K] with packed [N/32, K, 32]");
  TORCH_CHECK(packed.size(0) == (N + PW - 1) / PW, "panel_gemm: packed panels do not match N");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && packed.is_contiguous(),
              "panel_gemm: packed must be contiguous, in x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = x.new_empty({M, N});
  if (M == 0) return y;
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "panel_gemm: bias must be [N]");
    b = bias->contiguous();
  }
  AT_DISPATCH_V2(x.scalar_type(), "panel_gemm", AT_WRAP([&] {
    panel_gemm_impl<scalar_t>(xf.data_ptr<float>(), packed.data_ptr<scalar_t>(),
                              b.has_value() ? b->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), M, N, K,
                              act == 1);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}
