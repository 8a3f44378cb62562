// The row-wise work of the BERT-family encoder forward (backends/cpu/encoder.py) in one pass each: a residual add
// followed by LayerNorm, and the mean pooling of each sequence's rows (BERT's GELU runs in the up projection's
// kernel as it stores: `act` of the linears). Each row (each sequence) is computed on its own, in a fixed order:
// the same bits whatever rows share the step.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace conveyor_encoder_ops {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// y = LayerNorm(h + delta) * w + b per row: the sum rounded to scalar_t first (as torch adds the residual), then
// the row's mean and variance in float (16-lane sums, then the lanes in order), y rounded once.
template <typename scalar_t>
void add_layer_norm_rows(const scalar_t* h, const scalar_t* delta, const scalar_t* w, const scalar_t* b,
                         scalar_t* y, int64_t T, int64_t N, float eps) {
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    std::vector<float> x(N);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* hr = h + t * N;
      const scalar_t* dr = delta + t * N;
      const int64_t NV = N / 16 * 16;
      v16f acc = {};
      for (int64_t i = 0; i < NV; i += 16) {
        const v16f v = round16<scalar_t>(load16(hr + i) + load16(dr + i));
        store16(&x[i], v);
        acc += v;
      }
      float sum = 0.f;
      for (int lane = 0; lane < 16; ++lane) sum += acc[lane];
      for (int64_t i = NV; i < N; ++i) {
        x[i] = static_cast<float>(static_cast<scalar_t>(static_cast<float>(hr[i]) + static_cast<float>(dr[i])));
        sum += x[i];
      }
      const float mean = sum / static_cast<float>(N);
      v16f sq = {};
      const v16f m = splat16(mean);
      for (int64_t i = 0; i < NV; i += 16) {
        const v16f d = load16(&x[i]) - m;
        sq += d * d;
      }
      float ss = 0.f;
      for (int lane = 0; lane < 16; ++lane) ss += sq[lane];
      for (int64_t i = NV; i < N; ++i) ss += (x[i] - mean) * (x[i] - mean);
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
      const v16f r = splat16(rstd);
      scalar_t* yr = y + t * N;
      for (int64_t i = 0; i < NV; i += 16)
        store16(yr + i, (load16(&x[i]) - m) * r * load16(w + i) + load16(b + i));
      for (int64_t i = NV; i < N; ++i)
        yr[i] = static_cast<scalar_t>((x[i] - mean) * rstd * static_cast<float>(w[i]) + static_cast<float>(b[i]));
    }
  });
}

template <typename scalar_t>
void mean_rows(const scalar_t* h, const int64_t* starts, float* out, int64_t S, int64_t N) {
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* o = out + s * N;
      for (int64_t i = 0; i < N; ++i) o[i] = 0.f;
      for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
        const scalar_t* row = h + t * N;
        for (int64_t i = 0; i < N; ++i) o[i] += static_cast<float>(row[i]);
      }
      const float n = static_cast<float>(starts[s + 1] - starts[s]);
      for (int64_t i = 0; i < N; ++i) o[i] /= n;
    }
  });
}

void check(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous CPU [rows, n]");
}

}  // namespace
}  // namespace conveyor_encoder_ops

// LayerNorm(h + delta) * w + b, row by row (w, b in h's dtype).
at::Tensor add_layer_norm(at::Tensor h, at::Tensor delta, at::Tensor w, at::Tensor b, double eps) {
  using namespace conveyor_encoder_ops;
  check(h, "h");
  check(delta, "delta");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(), "delta must match h");
  TORCH_CHECK(w.numel() == h.size(1) && b.numel() == h.size(1) && w.scalar_type() == h.scalar_type() &&
              b.scalar_type() == h.scalar_type(), "w and b must be [n] in h's dtype");
  auto wc = w.contiguous(), bc = b.contiguous();
  auto y = h.new_empty(h.sizes());
  AT_DISPATCH_V2(h.scalar_type(), "add_layer_norm", AT_WRAP([&] {
    add_layer_norm_rows<scalar_t>(h.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                                  bc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), h.size(0), h.size(1),
                                  static_cast<float>(eps));
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

// The mean of each sequence's rows (sequence s: rows starts[s] .. starts[s + 1]), in float32: the rows added in
// order, then divided by their count.
at::Tensor mean_pool(at::Tensor h, at::Tensor starts) {
  using namespace conveyor_encoder_ops;
  check(h, "h");
  starts = starts.contiguous();
  const int64_t S = starts.size(0) - 1;
  auto out = h.new_empty({S, h.size(1)}, h.options().dtype(at::kFloat));
  AT_DISPATCH_V2(h.scalar_type(), "mean_pool", AT_WRAP([&] {
    mean_rows<scalar_t>(h.data_ptr<scalar_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(), S, h.size(1));
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}
