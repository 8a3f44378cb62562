// The sampler's kernels, one row per task: the greedy argmax, and temperature sampling with optional
// top-k / top-p / min-p by inverse CDF. Rows never share work, so a row's token depends on its own
// logits, parameters and draw only.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "vec16.h"

void check_rows(const at::Tensor& x, const char* name);  // fused_ops.cpp

namespace conveyor_sampling {  // named: these files share a translation unit (kernels.py, _UNITS)

// First index of the row's largest value; NaN is never the largest (a row of NaN and -inf gives 0).
template <typename scalar_t>
static int64_t first_max(const scalar_t* row, int64_t V) {
  float m = -INFINITY;
  int64_t best = 0;
  for (int64_t j = 0; j < V; ++j) {
    const float f = static_cast<float>(row[j]);
    if (f > m) {
      m = f;
      best = j;
    }
  }
  return best;
}

template <typename scalar_t>
void argmax_rows_impl(const scalar_t* x, int64_t* out, int64_t R, int64_t V) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* __restrict__ row = x + r * V;
      // One pass, 16 lanes: lane i keeps the largest value among elements i, i + 16, ... and the
      // index where it first appeared (strictly greater replaces), so the lowest index among the
      // lanes holding the row's maximum is the row's first maximum. NaN compares false: noted,
      // and the row is then searched for its first NaN as torch.argmax does.
      const int64_t vec_end = V / 16 * 16;
      float m = -INFINITY;
      int64_t best = 0;
      bool nan = false;
      int64_t i = 0;
      if (vec_end > 0) {
        v16f vmax = load16(row);
        int32_t idx[16], seen_nan[16];
#ifdef CONVEYOR_AVX2  // the same lanes as below, on two halves
        const __m256i lane_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i lane_hi = _mm256_add_epi32(lane_lo, _mm256_set1_epi32(8));
        __m256 idx_lo = _mm256_castsi256_ps(lane_lo), idx_hi = _mm256_castsi256_ps(lane_hi);
        __m256 nan_lo = _mm256_cmp_ps(vmax.lo, vmax.lo, _CMP_UNORD_Q);
        __m256 nan_hi = _mm256_cmp_ps(vmax.hi, vmax.hi, _CMP_UNORD_Q);
        for (i = 16; i < vec_end; i += 16) {
          const v16f v = load16(row + i);
          const __m256 gt_lo = _mm256_cmp_ps(v.lo, vmax.lo, _CMP_GT_OQ);
          const __m256 gt_hi = _mm256_cmp_ps(v.hi, vmax.hi, _CMP_GT_OQ);
          vmax.lo = _mm256_blendv_ps(vmax.lo, v.lo, gt_lo);
          vmax.hi = _mm256_blendv_ps(vmax.hi, v.hi, gt_hi);
          const __m256i at = _mm256_set1_epi32(static_cast<int32_t>(i));
          idx_lo = _mm256_blendv_ps(idx_lo, _mm256_castsi256_ps(_mm256_add_epi32(lane_lo, at)), gt_lo);
          idx_hi = _mm256_blendv_ps(idx_hi, _mm256_castsi256_ps(_mm256_add_epi32(lane_hi, at)), gt_hi);
          nan_lo = _mm256_or_ps(nan_lo, _mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q));
          nan_hi = _mm256_or_ps(nan_hi, _mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q));
        }
        _mm256_storeu_ps(reinterpret_cast<float*>(idx), idx_lo);
        _mm256_storeu_ps(reinterpret_cast<float*>(idx + 8), idx_hi);
        _mm256_storeu_ps(reinterpret_cast<float*>(seen_nan), nan_lo);
        _mm256_storeu_ps(reinterpret_cast<float*>(seen_nan + 8), nan_hi);
#else
        typedef int32_t v16i __attribute__((vector_size(64)));
        v16i vidx, lane;
        for (int l = 0; l < 16; ++l) lane[l] = l;
        vidx = lane;
        v16i nan_seen = vmax != vmax;
        for (i = 16; i < vec_end; i += 16) {
          const v16f v = load16(row + i);
          const v16i gt = v > vmax;
          vmax = gt ? v : vmax;
          vidx = gt ? lane + static_cast<int32_t>(i) : vidx;
          nan_seen |= v != v;
        }
        std::memcpy(idx, &vidx, sizeof(idx));
        std::memcpy(seen_nan, &nan_seen, sizeof(seen_nan));
#endif
        m = vmax[0];
        best = idx[0];
        for (int l = 0; l < 16; ++l) {
          nan |= seen_nan[l] != 0;
          if (vmax[l] > m || (vmax[l] == m && idx[l] < best)) {
            m = vmax[l];
            best = idx[l];
          }
        }
      }
      // The tail past the last full vector (the whole row if it is shorter than one): from m = -inf
      // and best = 0, a row of nothing but -inf keeps index 0, as torch.argmax does.
      for (; i < V; ++i) {
        const float f = static_cast<float>(row[i]);
        nan |= f != f;
        if (f > m) {
          m = f;
          best = i;
        }
      }
      if (nan) {
        for (int64_t j = 0; j < V; ++j) {
          const float f = static_cast<float>(row[j]);
          if (f != f) {
            best = j;
            break;
          }
        }
      }
      out[r] = best;
    }
  });
}

// Temperature sampling of the listed rows, one draw u in [0, 1) each. Weights w_j = exp((x_j - max) / T),
// 0 for -inf and NaN logits (banned tokens are never drawn); the row's largest weight is exactly 1.
//
// Without truncation: the first column whose running sum exceeds u x sum(w), columns in id order.
// Sums are taken per 16 columns (float) and across those blocks in double; the scan skips whole
// blocks by their sums and walks the one holding the crossing column by column.
//
// With top-k / top-p / min-p (top_k > 0, top_p < 1, min_p > 0): columns in order of weight (ties by
// id), kept while their rank is < top_k, the probability mass before them is < top_p and their
// weight is >= min_p (the largest is always kept); then the inverse CDF over the kept prefix in that
// order. Only the columns that can be kept are sorted (see the binning below).
//
// Where no weights can be formed (a +inf logit, or nothing but -inf / NaN) the row's first maximum
// is taken, as greedy would.
template <typename scalar_t>
void sample_rows_impl(const scalar_t* x, int64_t V, const int64_t* rows, const float* temps, const double* u,
                      const int64_t* top_k, const float* top_p, const float* min_p, int64_t* out, int64_t n) {
  const int64_t vec_end = V / 16 * 16;
  const int64_t num_blocks = (V + 15) / 16;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(num_blocks * 16);
    std::vector<float> block(num_blocks);
    std::vector<int32_t> cand;
    for (int64_t k = begin; k < end; ++k) {
      const scalar_t* __restrict__ row = x + rows[k] * V;
      v16f vmax = v16f{} - INFINITY;
      for (int64_t i = 0; i < vec_end; i += 16) {
        const v16f v = load16(row + i);
        vmax = select16(v > vmax, v, vmax);  // NaN compares false: skipped
      }
      float m = -INFINITY;
      for (int l = 0; l < 16; ++l) m = std::max(m, vmax[l]);
      for (int64_t i = vec_end; i < V; ++i) {
        const float f = static_cast<float>(row[i]);
        if (f > m) m = f;
      }
      const float inv_t = 1.f / temps[k];
      double total = 0.0;
      if (std::isfinite(m)) {
        const v16f lowest = v16f{} - INFINITY;
        for (int64_t i = 0; i < vec_end; i += 16) {
          const v16f v = load16(row + i);
          v16f e = exp16((v - m) * inv_t);
          e = select16(v > lowest, e, v16f{});
          store16(w.data() + i, e);
          block[i / 16] = hsum16(e);
          total += block[i / 16];
        }
        if (vec_end < V) {
          float s = 0.f;
          for (int64_t i = vec_end; i < V; ++i) {
            const float f = static_cast<float>(row[i]);
            w[i] = f > -INFINITY ? std::exp((f - m) * inv_t) : 0.f;
            s += w[i];
          }
          block[num_blocks - 1] = s;
          total += s;
        }
      }
      if (!(total > 0.0) || !std::isfinite(total)) {
        out[k] = first_max(row, V);
        continue;
      }
      const int64_t kk = top_k[k] > 0 ? std::min<int64_t>(top_k[k], V) : V;
      const double pp = top_p[k];
      const float mp = min_p[k];
      int64_t pick = -1;
      if (kk >= V && pp >= 1.0 && mp <= 0.f) {
        const double target = u[k] * total;
        double c = 0.0;
        for (int64_t b = 0; b < num_blocks && pick < 0; ++b) {
          if (c + block[b] <= target) {
            c += block[b];
            continue;
          }
          double cc = c;
          for (int64_t j = b * 16; j < std::min(V, b * 16 + 16); ++j) {
            cc += w[j];
            if (w[j] > 0.f && cc > target) {  // a column of zero weight is never chosen
              pick = j;
              break;
            }
          }
          c += block[b];
        }
        if (pick < 0) {  // rounding left the crossing past the end: the last column with weight
          for (int64_t j = V - 1; j >= 0 && pick < 0; --j)
            if (w[j] > 0.f) pick = j;
        }
        out[k] = pick;
        continue;
      }
      // Truncated: gather the columns that can be kept, sort them, keep a prefix, draw from it.
      // Weights are binned by their float exponent (w in (0, 1]: bins 0..127, highest first); the
      // candidates are the bins from the top down to the first that completes top_k columns or top_p
      // of the mass, or whose lower bound is <= min_p: every kept column is among them.
      double bin_mass[128] = {};
      int64_t bin_count[128] = {};
      for (int64_t j = 0; j < V; ++j) {
        if (w[j] > 0.f) {
          uint32_t bits;
          std::memcpy(&bits, &w[j], sizeof(bits));
          const int b = std::min<int>(127, static_cast<int>(bits >> 23));
          bin_mass[b] += w[j];
          ++bin_count[b];
        }
      }
      int lowest_bin = 0;
      {
        double mass = 0.0;
        int64_t count = 0;
        for (int b = 127; b >= 0; --b) {
          mass += bin_mass[b];
          count += bin_count[b];
          const float bin_floor = b > 0 ? std::ldexp(1.f, b - 127) : 0.f;
          if (count >= kk || mass >= pp * total || (mp > 0.f && bin_floor <= mp)) {
            lowest_bin = b;
            break;
          }
        }
      }
      cand.clear();
      for (int64_t j = 0; j < V; ++j) {
        if (w[j] > 0.f) {
          uint32_t bits;
          std::memcpy(&bits, &w[j], sizeof(bits));
          if (static_cast<int>(bits >> 23) >= lowest_bin) cand.push_back(static_cast<int32_t>(j));
        }
      }
      std::sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
      int64_t kept = 0;
      double before = 0.0;
      for (const int32_t j : cand) {
        if (kept > 0 && (kept >= kk || before / total >= pp || w[j] < mp)) break;
        before += w[j];
        ++kept;
      }
      const double target = u[k] * before;  // `before` is now the kept mass
      double c = 0.0;
      pick = cand[kept - 1];
      for (int64_t r = 0; r < kept; ++r) {
        c += w[cand[r]];
        if (c > target) {
          pick = cand[r];
          break;
        }
      }
      out[k] = pick;
    }
  });
}

}  // namespace conveyor_sampling

// logits [B, V] (float32 / bf16 / fp16, contiguous), rows [n] int64 (which rows to sample), temps
// [n] float32 (> 0), u [n] float64 in [0, 1), top_k [n] int64 (<= 0: off), top_p [n] float32 (1: off),
// min_p [n] float32 (0: off) -> [n] int64 token ids.
at::Tensor sample_rows(at::Tensor logits, at::Tensor rows, at::Tensor temps, at::Tensor u, at::Tensor top_k,
                       at::Tensor top_p, at::Tensor min_p) {
  using namespace conveyor_sampling;
  check_rows(logits, "logits");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  TORCH_CHECK(rows.scalar_type() == at::kLong && top_k.scalar_type() == at::kLong && u.scalar_type() == at::kDouble &&
              temps.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat && min_p.scalar_type() == at::kFloat,
              "rows and top_k must be int64, u float64, temps, top_p and min_p float32");
  TORCH_CHECK(logits.size(1) <= INT32_MAX, "vocabulary too large");
  rows = rows.contiguous();
  temps = temps.contiguous();
  u = u.contiguous();
  top_k = top_k.contiguous();
  top_p = top_p.contiguous();
  min_p = min_p.contiguous();
  const int64_t n = rows.numel();
  TORCH_CHECK(temps.numel() == n && u.numel() == n && top_k.numel() == n && top_p.numel() == n && min_p.numel() == n,
              "rows, temps, u, top_k, top_p and min_p must have one entry per sampled row");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) TORCH_CHECK(r[k] >= 0 && r[k] < logits.size(0), "row index out of range");
  auto out = rows.new_empty({n});
  AT_DISPATCH_V2(logits.scalar_type(), "sample_rows", AT_WRAP([&] {
    sample_rows_impl<scalar_t>(logits.data_ptr<scalar_t>(), logits.size(1), r, temps.data_ptr<float>(),
                               u.data_ptr<double>(), top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(),
                               min_p.data_ptr<float>(), out.data_ptr<int64_t>(), n);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// x [R, V] -> [R] int64: index of each row's first maximum, like torch.argmax(x, -1), in one
// vectorized pass per row (torch's argmax reads ~1 GB/s on this kind of CPU).
at::Tensor argmax_rows(at::Tensor x) {
  using namespace conveyor_sampling;
  check_rows(x, "logits");
  TORCH_CHECK(x.size(1) > 0, "logits must have at least one column");
  auto out = x.new_empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_V2(x.scalar_type(), "argmax_rows", AT_WRAP([&] {
    argmax_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// Structured outputs: logits[rows[i], t] = -inf for every token t that bitmask row i does not allow (bit t % 32
// of word t / 32), in place. bitmask [n, ceil(V / 32)] int32 as llguidance fills it; logits [R, V].
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  check_rows(logits, "logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 tensor");
  rows = rows.contiguous();
  const int64_t n = rows.numel(), V = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == n && words * 32 >= V, "bitmask must have one row per listed row, covering the vocabulary");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) TORCH_CHECK(r[k] >= 0 && r[k] < logits.size(0), "row index out of range");
  AT_DISPATCH_V2(logits.scalar_type(), "apply_token_bitmask", AT_WRAP([&] {
    const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end_row) {
      for (int64_t k = begin; k < end_row; ++k) {
        scalar_t* row = logits.data_ptr<scalar_t>() + r[k] * V;
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + k * words;
        int64_t w = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // 32 tokens a word: masked stores of -inf where the bits are clear (most of a constrained row's).
        for (; (w + 1) * 32 <= V; ++w) {
          const uint32_t banned = ~bits[w];
          if (banned == 0) continue;
          if constexpr (std::is_same_v<scalar_t, float>) {
            const __m512 v = _mm512_set1_ps(-INFINITY);
            _mm512_mask_storeu_ps(row + w * 32, static_cast<__mmask16>(banned), v);
            _mm512_mask_storeu_ps(row + w * 32 + 16, static_cast<__mmask16>(banned >> 16), v);
          } else {
            uint16_t raw;
            std::memcpy(&raw, &ninf, sizeof(raw));
            _mm512_mask_storeu_epi16(row + w * 32, static_cast<__mmask32>(banned), _mm512_set1_epi16(static_cast<short>(raw)));
          }
        }
#endif
        for (; w * 32 < V; ++w) {
          const uint32_t b = bits[w];
          const int64_t stop = std::min<int64_t>(32, V - w * 32);
          for (int64_t j = 0; j < stop; ++j)
            if (!((b >> j) & 1u)) row[w * 32 + j] = ninf;
        }
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
}
