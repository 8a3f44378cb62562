// The decoder layers of the fused Llama forward (fused_llama.py) in one call: per layer, residual add + RMSNorm,
// q/k/v as one linear, rotary + KV store, paged attention, o, residual add + RMSNorm, gate/up as one linear,
// SiLU * up, down. The same kernels, in the same order, with the same arguments as the Python loop it replaces
// (so the same bits); what goes is that loop's cost: ~9 Python calls a layer, ~270 a step of SmolLM2-135M, each
// with its argument parsing and its tensor views (1.6-4.8 ms a step measured, 6-14% of a decode step).
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <vector>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor token_req, at::Tensor token_ctx, int64_t block_size, double scale,
                           int64_t window, double softcap, c10::optional<at::Tensor> sinks);
at::Tensor rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor w, double eps);
void rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache,
                at::Tensor v_cache, int64_t num_heads);
at::Tensor silu_mul(at::Tensor gu);
at::Tensor panel_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias);
at::Tensor pair_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias);
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias);

namespace {

enum Route : int64_t { PANELS = 0, PAIRS = 1, TILES = 2 };

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  int64_t route) {
  switch (route) {
    case PAIRS: return pair_gemm(x, packed, n, bias);
    case TILES: return amx_gemm(x, packed, n, bias);
    default: return panel_gemm(x, packed, n, bias);
  }
}

}  // namespace

// h [T, hidden], the residual stream (updated in place). Per layer i, four linears qkv, o, gate_up, down at
// packed[4 i + j], with out_features[4 i + j], biases[4 i + j] (None: no bias) and routes[4 i + j] (0 float
// panels, 1 bf16 pairs, 2 AMX tiles); norms[2 i], norms[2 i + 1] and eps[2 i], eps[2 i + 1]: the input and the
// post-attention RMSNorm. Returns the last layer's MLP output (the delta the final norm adds to h first).
at::Tensor llama_layers(at::Tensor h, std::vector<at::Tensor> packed, std::vector<int64_t> out_features,
                        std::vector<c10::optional<at::Tensor>> biases, std::vector<int64_t> routes,
                        std::vector<at::Tensor> norms, std::vector<double> eps, at::Tensor cos, at::Tensor sin,
                        at::Tensor slots, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                        at::Tensor tables, at::Tensor token_req, at::Tensor token_ctx, int64_t block_size,
                        double scale, int64_t num_heads, int64_t head_dim) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(v_caches.size() == layers && packed.size() == 4 * layers && out_features.size() == 4 * layers &&
                  biases.size() == 4 * layers && routes.size() == 4 * layers && norms.size() == 2 * layers &&
                  eps.size() == 2 * layers,
              "llama_layers: four linears, two norms and a K/V pool per layer");
  const int64_t T = h.size(0), q_width = num_heads * head_dim;
  c10::optional<at::Tensor> delta;
  for (size_t i = 0; i < layers; ++i) {
    auto lin = [&](size_t j, const at::Tensor& x) {
      return linear(x, packed[4 * i + j], out_features[4 * i + j], biases[4 * i + j], routes[4 * i + j]);
    };
    at::Tensor x = rms_norm(h, delta, norms[2 * i], eps[2 * i]);  // h += delta (the last MLP's output)
    at::Tensor qkv = lin(0, x);
    rope_store(qkv, cos, sin, slots, k_caches[i], v_caches[i], num_heads);
    at::Tensor q = qkv.narrow(1, 0, q_width).view({T, num_heads, head_dim});  // read in place by the kernel
    at::Tensor attn = paged_attention(q, k_caches[i], v_caches[i], tables, token_req, token_ctx, block_size, scale, 0, 0.0,
                                      c10::nullopt)
                          .reshape({T, q_width});
    x = rms_norm(h, lin(1, attn), norms[2 * i + 1], eps[2 * i + 1]);  // h += attention output
    delta = lin(3, silu_mul(lin(2, x)));
  }
  TORCH_CHECK(delta.has_value(), "llama_layers: no layers");
  return *delta;
}
