// Paged attention for the CPU: every query token attends to its own request's cached K/V,
// read in place from the block pool (no gather copy). One task per (query token, KV head);
// the G query heads sharing that KV head are done together so each K/V row is read once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

// Widen one row of D values to float: a no-op view for float, a conversion for bf16/fp16.
template <typename scalar_t>
static inline const float* as_float(const scalar_t* src, float* buf, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(src[d]);
    return buf;
  }
}

template <typename scalar_t>
static void paged_attention_kernel(const scalar_t* q,        // [T, H, D]
                                   const scalar_t* cache,    // [S, 2*Hkv, D]
                                   const int64_t* tables,    // [R, max_blocks]
                                   const int64_t* token_req, // [T]
                                   const int64_t* token_ctx, // [T] keys visible to the token
                                   scalar_t* out,            // [T, H, D]
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                                   int64_t block_size, float scale) {
  const int64_t G = H / Hkv;
  const int64_t slot_stride = 2 * Hkv * D;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, buf(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, h = task % Hkv;
      const int64_t ctx = token_ctx[t];
      const int64_t* table = tables + token_req[t] * max_blocks;
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      if (static_cast<int64_t>(scores.size()) < G * ctx) scores.resize(G * ctx);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(t * H + h * G + g) * D + d]) * scale;
      // scores[g][j] = q_g . k_j, block by block
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* base = cache + table[b] * block_size * slot_stride + h * D;
        const int64_t n = std::min(block_size, ctx - b * block_size);
        for (int64_t o = 0; o < n; ++o) {
          const float* k = as_float(base + o * slot_stride, buf.data(), D);
          const int64_t j = b * block_size + o;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
            scores[g * ctx + j] = s;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over j, per head
        float* sg = scores.data() + g * ctx;
        float m = -INFINITY;
        for (int64_t j = 0; j < ctx; ++j) m = std::max(m, sg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < ctx; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < ctx; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);  // acc[g] = sum_j p[g][j] * v_j
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* base = cache + table[b] * block_size * slot_stride + (Hkv + h) * D;
        const int64_t n = std::min(block_size, ctx - b * block_size);
        for (int64_t o = 0; o < n; ++o) {
          const float* v = as_float(base + o * slot_stride, buf.data(), D);
          const int64_t j = b * block_size + o;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * ctx + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(t * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor tables, torch::Tensor token_req,
                              torch::Tensor token_ctx, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3, "q must be [T, H, D] and cache [S, 2*Hkv, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must share a dtype");
  q = q.contiguous();
  tables = tables.contiguous();
  token_req = token_req.contiguous();
  token_ctx = token_ctx.contiguous();
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = cache.size(1) / 2;
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                     token_req.data_ptr<int64_t>(), token_ctx.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), T, H, Hkv, D, tables.size(1), block_size,
                                     static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block pool (CPU)");
}
