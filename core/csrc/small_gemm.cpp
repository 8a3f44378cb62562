// y [M, N] = x [M, K] @ W.T (+ bias) for the rows of a decode step (M up to ~128).
//
// At small M a linear layer is a read of its weights (M multiply-adds per weight), so its rate is
// the memory bandwidth if the weights stream through once, in order; BLAS GEMMs fall well short
// of that for M between 2 and 32 on this kind of CPU. Here W is prepacked in panels of 32 columns,
// [N/32][K][32], each panel one contiguous run read front to back, with the M x 32 outputs of a
// panel in registers. Every output is one sum over k in order, so a row's result does not depend
// on the other rows in the batch.
//
// A step with more than 8 rows passes over each panel several times (8 rows per pass, the
// accumulators in registers): the first pass reads the panel from memory, the others from L2.
// While a panel is being worked on, the next panel is prefetched into L2, a slice per pass, one
// or two cache lines per k, so the memory stream runs under the arithmetic instead of between
// it; this made the kernel 1.3-1.6x faster at 8-64 rows and ahead of BLAS up to ~128 rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t PW = 32;  // panel width: two vectors

// Prefetch target for one pass: `lines` cache lines from `base`, spread over the K iterations.
struct Prefetch {
  const char* base = nullptr;
  int64_t lines = 0;
  int64_t per_k = 0;  // lines requested per k: ceil(lines / K)
};

template <int MT, typename scalar_t>
inline void panel_rows(const float* __restrict__ xf, int64_t K, const scalar_t* __restrict__ panel,
                       float* __restrict__ out, const Prefetch& pf) {
  v16f a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) a0[m] = a1[m] = v16f{};
  for (int64_t k = 0; k < K; ++k) {
    if (pf.base != nullptr) prefetch_l2(pf.base + (k * pf.lines / K) * 64, pf.per_k * 64);
    const v16f w0 = load16(panel + k * PW), w1 = load16(panel + k * PW + 16);
    for (int m = 0; m < MT; ++m) {
      const float x = xf[m * K + k];
      a0[m] += x * w0;
      a1[m] += x * w1;
    }
  }
  for (int m = 0; m < MT; ++m) {
    std::memcpy(out + m * PW, &a0[m], sizeof(v16f));
    std::memcpy(out + m * PW + 16, &a1[m], sizeof(v16f));
  }
}

template <typename scalar_t>
void panel_block(int mt, const float* xf, int64_t K, const scalar_t* panel, float* out, const Prefetch& pf) {
  switch (mt) {
    case 1: panel_rows<1>(xf, K, panel, out, pf); break;
    case 2: panel_rows<2>(xf, K, panel, out, pf); break;
    case 3: panel_rows<3>(xf, K, panel, out, pf); break;
    case 4: panel_rows<4>(xf, K, panel, out, pf); break;
    case 5: panel_rows<5>(xf, K, panel, out, pf); break;
    case 6: panel_rows<6>(xf, K, panel, out, pf); break;
    case 7: panel_rows<7>(xf, K, panel, out, pf); break;
    default: panel_rows<8>(xf, K, panel, out, pf); break;
  }
}

template <typename scalar_t>
void small_gemm_impl(const float* xf, const scalar_t* packed, const scalar_t* bias, scalar_t* y, int64_t M,
                     int64_t N, int64_t K) {
  const int64_t num_panels = (N + PW - 1) / PW;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    float out[8 * PW];
    for (int64_t p = begin; p < end; ++p) {
      const scalar_t* panel = packed + p * K * PW;
      const int64_t c0 = p * PW, cw = std::min(PW, N - c0);
      const int64_t passes = (M + 7) / 8;
      const int64_t panel_lines = K * PW * static_cast<int64_t>(sizeof(scalar_t)) / 64;
      const int64_t slice = (panel_lines + passes - 1) / passes;  // lines of the next panel per pass
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        Prefetch pf;
        const int64_t first_line = (m0 / 8) * slice;
        if (p + 1 < end && first_line < panel_lines) {
          pf.base = reinterpret_cast<const char*>(panel + K * PW) + first_line * 64;
          pf.lines = std::min(slice, panel_lines - first_line);
          pf.per_k = (pf.lines + K - 1) / K;
        }
        panel_block<scalar_t>(mt, xf + m0 * K, K, panel, out, pf);
        for (int m = 0; m < mt; ++m)
          for (int64_t c = 0; c < cw; ++c) {
            float v = out[m * PW + c];
            if (bias != nullptr) v += static_cast<float>(bias[c0 + c]);
            y[(m0 + m) * N + c0 + c] = static_cast<scalar_t>(v);
          }
      }
    }
  });
}

}  // namespace

// x [M, K], packed [ceil(N / 32), K, 32] (see fused_llama.pack_panels), bias [N] or None -> [M, N].
at::Tensor small_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == PW && x.size(1) == packed.size(1),
              "small_gemm: x [M, K] with packed [N/32, K, 32]");
  TORCH_CHECK(packed.size(0) == (N + PW - 1) / PW, "small_gemm: packed panels do not match N");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && packed.is_contiguous(),
              "small_gemm: packed must be contiguous, in x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "small_gemm: bias must be [N]");
    b = bias->contiguous();
  }
  AT_DISPATCH_V2(x.scalar_type(), "small_gemm", AT_WRAP([&] {
    small_gemm_impl<scalar_t>(xf.data_ptr<float>(), packed.data_ptr<scalar_t>(),
                              b.has_value() ? b->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), M, N, K);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}
