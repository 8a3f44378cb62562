// Bidirectional attention within packed sequences, for the encoders' pooling forward (backends/cpu/encoder.py):
// the step's rows are many whole sequences end to end, and each row attends to every row of its own sequence.
//
// One task per (sequence, head): its keys are widened to float and transposed once ([D][L], 16 keys a vector), its
// values widened ([L][D]); then each query row's scores are fused multiply-adds over d (16 keys at a time, no
// horizontal sums), its softmax runs over its sequence's keys, and its output sums p_j * v_j in key order (16 dims
// at a time). Exactness: a row's arithmetic depends on its own sequence only (its length and values), in a fixed
// order, so it is the same bits alone and packed with any others.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec16.h"

namespace conveyor_encoder_attention {  // named: these files share a translation unit (kernels.py, _UNITS)
namespace {  // (internal linkage, as before the files shared a unit)

static inline v16f max16(v16f a, v16f b) { return select16(a > b, a, b); }


// The scratch of one task, kept per thread: its keys transposed, its values, a row's scores.
struct Scratch {
  std::vector<float> kt, vv, scores, q;
};

constexpr int64_t R = 4;  // query rows computed together: independent chains of multiply-adds (no latency stall)

template <typename scalar_t>
void attend_sequence(const scalar_t* qkv, float* out, int64_t first, int64_t L, int64_t h, int64_t H, int64_t D,
                     float scale, Scratch& w) {
  const int64_t row = 3 * H * D;  // a token's q, k, v
  const int64_t chunks = (L + 15) / 16;
  const int64_t Lp = chunks * 16;
  w.kt.assign(D * Lp, 0.f);
  w.vv.resize(L * D);
  w.scores.resize(R * Lp);
  w.q.resize(R * D);
  float* kt = w.kt.data();
  float* vv = w.vv.data();
  float* scores = w.scores.data();
  float* q = w.q.data();
  const bool vectors = D % 16 == 0;
  for (int64_t j = 0; j < L; ++j) {
    const scalar_t* k = qkv + (first + j) * row + H * D + h * D;
    const scalar_t* v = qkv + (first + j) * row + 2 * H * D + h * D;
    if (vectors) {  // widened 16 at a time
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const v16f kv = load16(k + d0), vv16 = load16(v + d0);
        store16(vv + j * D + d0, vv16);
        for (int lane = 0; lane < 16; ++lane) kt[(d0 + lane) * Lp + j] = kv[lane];
      }
      continue;
    }
    for (int64_t d = 0; d < D; ++d) {
      kt[d * Lp + j] = static_cast<float>(k[d]);
      vv[j * D + d] = static_cast<float>(v[d]);
    }
  }
  v16f lane_index;
  for (int lane = 0; lane < 16; ++lane) lane_index[lane] = static_cast<float>(lane);
  const v16f last_valid = splat16(static_cast<float>(L - (chunks - 1) * 16));  // keys in the last chunk
  const v16f neg_inf = splat16(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < L; i0 += R) {
    // Rows i0 .. i0 + R - 1 (past L: copies of row i0, computed and dropped): each row's sums run in the same
    // order as alone, so the blocking changes no bit.
    for (int64_t r = 0; r < R; ++r) {
      const scalar_t* qi = qkv + (first + (i0 + r < L ? i0 + r : i0)) * row + h * D;
      if (vectors) {
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const v16f qv = load16(qi + d0);
          store16(q + r * D + d0, qv);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) q[r * D + d] = static_cast<float>(qi[d]);
      }
    }
    v16f top[R];
    for (int64_t r = 0; r < R; ++r) top[r] = neg_inf;
    for (int64_t c = 0; c < chunks; ++c) {
      v16f acc[R] = {};
      const float* kc = kt + c * 16;
      for (int64_t d = 0; d < D; ++d) {
        const v16f kv = load16(kc + d * Lp);
        for (int64_t r = 0; r < R; ++r) acc[r] = fma16(splat16(q[r * D + d]), kv, acc[r]);
      }
      for (int64_t r = 0; r < R; ++r) {
        v16f a = acc[r] * scale;
        if (c == chunks - 1) a = select16(lane_index < last_valid, a, neg_inf);
        store16(scores + r * Lp + c * 16, a);
        top[r] = max16(top[r], a);
      }
    }
    float inv[R];
    for (int64_t r = 0; r < R; ++r) {
      const v16f m = splat16(hmax16(top[r]));
      v16f sums = v16f{};
      for (int64_t c = 0; c < chunks; ++c) {
        v16f p = exp16(load16(scores + r * Lp + c * 16) - m);
        if (c == chunks - 1) p = select16(lane_index < last_valid, p, v16f{});
        store16(scores + r * Lp + c * 16, p);
        sums = sums + p;
      }
      inv[r] = 1.f / hsum16(sums);
    }
    const int64_t rows = L - i0 < R ? L - i0 : R;
    if (D % 16 == 0) {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        v16f acc[R] = {};
        for (int64_t j = 0; j < L; ++j) {
          const v16f vj = load16(vv + j * D + d0);
          for (int64_t r = 0; r < R; ++r) acc[r] = fma16(splat16(scores[r * Lp + j]), vj, acc[r]);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const v16f a = acc[r] * inv[r];
          store16(out + (first + i0 + r) * H * D + h * D + d0, a);
        }
      }
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int64_t j = 0; j < L; ++j) acc = __builtin_fmaf(scores[r * Lp + j], vv[j * D + d], acc);
          out[(first + i0 + r) * H * D + h * D + d] = acc * inv[r];
        }
    }
  }
}

}  // namespace
}  // namespace conveyor_encoder_attention

// qkv [T, 3 * H * D] (each token's q, then k, then v; heads of D), starts [S + 1] (sequence s is rows
// starts[s] .. starts[s + 1]) -> [T, H * D] float32: softmax(scale q.k) v over each row's own sequence.
at::Tensor packed_attention(at::Tensor qkv, at::Tensor starts, int64_t heads, double scale) {
  using namespace conveyor_encoder_attention;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % (3 * heads) == 0, "qkv must be [T, 3 * heads * head_dim]");
  qkv = qkv.contiguous();
  starts = starts.contiguous();
  const int64_t T = qkv.size(0), H = heads, D = qkv.size(1) / (3 * heads);
  const int64_t S = starts.size(0) - 1;
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(S >= 1 && st[0] == 0 && st[S] == T, "starts must run from 0 to the row count");
  auto out = qkv.new_empty({T, H * D}, qkv.options().dtype(at::kFloat));
  AT_DISPATCH_V2(qkv.scalar_type(), "packed_attention", AT_WRAP([&] {
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / H, h = task % H;
        attend_sequence<scalar_t>(in, o, st[s], st[s + 1] - st[s], h, H, D, static_cast<float>(scale), scratch);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}
