// Paged attention for the CPU: every query token attends to its own request's cached K/V,
// read in place from the block pool (no gather copy). One task per (query token, KV head);
// the G query heads sharing that KV head are done together so each K/V row is read once.
// Layouts: keys [num_blocks, Hkv, D, block_size] (transposed within a block, so q.k over a
// block's keys is a vector loop without horizontal sums); values [slots, Hkv, D].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define CONVEYOR_HAS_MXCSR 1
#endif

// Attention weights of far-away keys underflow into subnormal floats, which x86 CPUs process
// up to 100x slower; flush them to zero (FTZ + DAZ) while the kernel runs, on every worker thread.
struct FlushDenormals {
#ifdef CONVEYOR_HAS_MXCSR
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Element i of a row as float. bf16 is widened with a shift on its raw bits (a pattern compilers
// vectorize; c10's conversion function call inside the loop is not).
template <typename scalar_t>
static inline float load_f32(const scalar_t* __restrict__ p, int64_t i) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(p[i]);
  }
}

template <typename scalar_t>
static void paged_attention_kernel(const scalar_t* q,        // [T, H, D]
                                   const scalar_t* k_cache,  // [num_blocks, Hkv, D, block_size]
                                   const scalar_t* v_cache,  // [num_blocks * block_size, Hkv, D]
                                   const int64_t* tables,    // [R, max_blocks]
                                   const int64_t* token_req, // [T]
                                   const int64_t* token_ctx, // [T] keys visible to the token
                                   scalar_t* out,            // [T, H, D]
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                                   int64_t bs, float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    std::vector<float> qf(G * D), acc(G * D), scores, part(bs);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, h = task % Hkv;
      const int64_t ctx = token_ctx[t];
      const int64_t* table = tables + token_req[t] * max_blocks;
      const int64_t num_blocks = (ctx + bs - 1) / bs;
      if (static_cast<int64_t>(scores.size()) < G * ctx) scores.resize(G * ctx);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(t * H + h * G + g) * D + d]) * scale;
      // scores[g][j] = q_g . k_j. A block's keys are stored transposed ([D][bs]), so the inner
      // loop runs over the block's keys: no horizontal sums.
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* __restrict__ kb = k_cache + (table[b] * Hkv + h) * D * bs;
        const int64_t n = std::min(bs, ctx - b * bs);
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict__ qg = qf.data() + g * D;
          float* __restrict__ dst = scores.data() + g * ctx + b * bs;
          if (bs == 16) {  // the default: one register of partial sums
            float p[16] = {0.f};
            for (int64_t d = 0; d < D; ++d) {
              const float qd = qg[d];
              const scalar_t* __restrict__ row = kb + d * 16;
#pragma omp simd
              for (int64_t o = 0; o < 16; ++o) p[o] += qd * load_f32(row, o);
            }
            for (int64_t o = 0; o < n; ++o) dst[o] = p[o];
          } else {
            float* __restrict__ p = part.data();
            std::fill(part.begin(), part.end(), 0.f);
            for (int64_t d = 0; d < D; ++d) {
              const float qd = qg[d];
              const scalar_t* __restrict__ row = kb + d * bs;
#pragma omp simd
              for (int64_t o = 0; o < bs; ++o) p[o] += qd * load_f32(row, o);
            }
            for (int64_t o = 0; o < n; ++o) dst[o] = p[o];
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
      for (int64_t g = 0; g < G; ++g) {
        float* __restrict__ ag = acc.data() + g * D;
        const float* __restrict__ sg = scores.data() + g * ctx;
        for (int64_t b = 0; b < num_blocks; ++b) {
          const int64_t n = std::min(bs, ctx - b * bs);
          const scalar_t* __restrict__ vb = v_cache + (table[b] * bs * Hkv + h) * D;
          for (int64_t o = 0; o < n; ++o) {
            const float pj = sg[b * bs + o];
            const scalar_t* __restrict__ v = vb + o * Hkv * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += pj * load_f32(v, d);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(t * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                              torch::Tensor token_req, torch::Tensor token_ctx, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 3, "k_cache must be [blocks, Hkv, D, bs], v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  q = q.contiguous();
  tables = tables.contiguous();
  token_req = token_req.contiguous();
  token_ctx = token_ctx.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == block_size && k_cache.size(2) == D, "k_cache shape does not match block_size/D");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                                     token_req.data_ptr<int64_t>(), token_ctx.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), T, H, Hkv, D, tables.size(1), block_size,
                                     static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block pool (CPU)");
}
