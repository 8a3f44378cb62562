// The decoder layers of the fused forward in one call (decoder.h): per layer, the residual add and the norm
// before the attention, q/k/v as one linear, q/k norms, rotary + KV store, paged attention with the layer's
// window, softcap and sinks, o, the norm after it, the residual, the MLP (dense: gate/up as one linear,
// act * up, down; or MoE), the norm after it. Every kernel on the way computes a row the same way whatever else
// is in the step (conveyor.core.exactness); what goes is the Python loop's cost (~9 calls a layer).
#include "decoder.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros_like.h>
#include <algorithm>
#include <cmath>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor token_req, at::Tensor token_ctx, int64_t block_size, double scale,
                           int64_t window, double softcap, c10::optional<at::Tensor> sinks);
at::Tensor rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor w, double eps);
void norm_runs_inplace(at::Tensor x, int64_t offset, int64_t groups, int64_t n, at::Tensor w, double eps);
void rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache,
                at::Tensor v_cache, int64_t num_heads);
at::Tensor act_mul(at::Tensor gu, int64_t act);
at::Tensor panel_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                      int64_t act);
at::Tensor pair_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                     int64_t act);
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                    int64_t act);
at::Tensor wq_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros, c10::optional<at::Tensor> offsets,
                   int64_t N, int64_t group, int64_t bits, c10::optional<at::Tensor> bias);
at::Tensor i8_gemm(at::Tensor x, at::Tensor packed, at::Tensor wsum, at::Tensor wscale, int64_t N,
                   c10::optional<at::Tensor> bias, double x_scale, bool vnni);

at::Tensor Linear::operator()(const at::Tensor& x_in) const {
  const at::Tensor x = perm.has_value() && perm->defined() ? x_in.index_select(1, *perm) : x_in;
  switch (route) {
    case 1: return pair_gemm(x, packed, n, bias, 0);
    case 2: return amx_gemm(x, packed, n, bias, 0);
    case 3: return wq_gemm(x, packed, scales, zeros, offsets, n, group, bits, bias);
    case 4: return i8_gemm(x, packed, wsum, scales, n, bias, x_scale, vnni);
    default: return panel_gemm(x, packed, n, bias, 0);
  }
}

at::Tensor Norm::operator()(const at::Tensor& h, const c10::optional<at::Tensor>& delta) const {
  return rms_norm(h, delta, weight, eps);
}

at::Tensor Moe::operator()(const at::Tensor& x, int64_t act) const {
  const int64_t T = x.size(0), E = static_cast<int64_t>(gate_up.size()), k = top_k;
  const at::Tensor logits = router(x).to(at::kFloat).contiguous();
  const float* lg = logits.data_ptr<float>();
  std::vector<int64_t> chosen(T * k);
  std::vector<float> weight(T * k);
  std::vector<float> probs(E);
  for (int64_t t = 0; t < T; ++t) {  // one row's routing, on its own: softmax, top-k (ties to the lower expert)
    const float* row = lg + t * E;
    float m = row[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, row[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(row[e] - m));
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    float picked = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= chosen[t * k + i] == e;
        if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
      }
      chosen[t * k + j] = best;
      weight[t * k + j] = probs[best];
      picked += probs[best];
    }
    if (renormalize)
      for (int64_t j = 0; j < k; ++j) weight[t * k + j] /= picked;
  }
  at::Tensor out = at::zeros_like(x);
  const auto long_opts = x.options().dtype(at::kLong);
  for (int64_t e = 0; e < E; ++e) {  // experts in order: each token's sum runs over its experts in that order
    std::vector<int64_t> rows;
    std::vector<float> w;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (chosen[t * k + j] == e) {
          rows.push_back(t);
          w.push_back(weight[t * k + j]);
        }
    if (rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows.size());
    at::Tensor index = at::empty({n}, long_opts);
    std::copy(rows.begin(), rows.end(), index.data_ptr<int64_t>());
    at::Tensor wt = at::empty({n, 1}, x.options().dtype(at::kFloat));
    std::copy(w.begin(), w.end(), wt.data_ptr<float>());
    if (weights_in_dtype) wt = wt.to(x.scalar_type()).to(at::kFloat);  // rounded as the router's output is
    const at::Tensor y = down[e](act_mul(gate_up[e](x.index_select(0, index)), act));
    out.index_add_(0, index, at::mul(y.to(at::kFloat), wt).to(x.scalar_type()));
  }
  return out;
}

at::Tensor Decoder::forward(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                            const at::Tensor& slots, const std::vector<at::Tensor>& k_caches,
                            const std::vector<at::Tensor>& v_caches, const at::Tensor& tables,
                            const at::Tensor& token_req, const at::Tensor& token_ctx, int64_t block_size) const {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "decoder: a K/V pool per layer");
  TORCH_CHECK(cos.size() == sin.size(), "decoder: cos and sin per rotary table");
  const int64_t T = h.size(0), H = num_heads_, Hkv = num_kv_heads_, D = head_dim_, q_width = H * D;
  const at::Tensor no_rotary = at::empty({T, 0}, h.options());
  c10::optional<at::Tensor> delta;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& L = layers_[i];
    at::Tensor x;
    if (L.attn_in.present()) {
      x = L.attn_in(h, delta);  // h += delta (the last MLP's output), then the norm
    } else {
      if (delta) h.add_(*delta);  // the residual add, rounded to the dtype as `residual + x`
      x = h;
    }
    at::Tensor qkv = L.qkv(x);
    if (L.q_norm.present()) {
      if (L.qk_norm_whole) {
        norm_runs_inplace(qkv, 0, 1, q_width, L.q_norm.weight, L.q_norm.eps);
        norm_runs_inplace(qkv, q_width, 1, Hkv * D, L.k_norm.weight, L.k_norm.eps);
      } else {
        norm_runs_inplace(qkv, 0, H, D, L.q_norm.weight, L.q_norm.eps);
        norm_runs_inplace(qkv, q_width, Hkv, D, L.k_norm.weight, L.k_norm.eps);
      }
    }
    const bool rotary = L.rope >= 0;
    TORCH_CHECK(!rotary || L.rope < static_cast<int64_t>(cos.size()), "decoder: layer ", i, " has no rotary table");
    rope_store(qkv, rotary ? cos[L.rope] : no_rotary, rotary ? sin[L.rope] : no_rotary, slots, k_caches[i],
               v_caches[i], H);
    at::Tensor q = qkv.narrow(1, 0, q_width).view({T, H, D});  // read in place by the kernel
    at::Tensor attn = paged_attention(q, k_caches[i], v_caches[i], tables, token_req, token_ctx, block_size, L.scale,
                                      L.window, L.softcap, c10::nullopt)
                          .reshape({T, q_width});
    at::Tensor o = L.o(attn);
    if (L.attn_out.present()) o = L.attn_out(o);
    if (L.residual_multiplier != 1.0) o.mul_(L.residual_multiplier);
    if (L.mlp_in.present()) {
      x = L.mlp_in(h, o);  // h += attention output
    } else {
      h.add_(o);
      x = h;
    }
    at::Tensor m = L.moe.top_k > 0 ? L.moe(x, L.act) : L.down(act_mul(L.gate_up(x), L.act));
    if (L.mlp_out.present()) m = L.mlp_out(m);
    if (L.residual_multiplier != 1.0) m.mul_(L.residual_multiplier);
    delta = m;
  }
  TORCH_CHECK(delta.has_value(), "decoder: no layers");
  return *delta;
}
