// Python bindings of conveyor's CPU kernels (one extension module, built once and cached).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                              torch::Tensor token_req, torch::Tensor token_ctx, int64_t block_size, double scale);
torch::Tensor rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
void rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots, torch::Tensor k_cache,
                torch::Tensor v_cache, int64_t num_heads);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block pool (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding a residual delta in place first (CPU)");
  m.def("rope_store", &rope_store, "rotary embedding on q/k in place, then k/v stored into the paged pool (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over [rows, 2I] (CPU)");
  m.def("small_gemm", &small_gemm, "x @ W.T (+ bias) for few rows, W prepacked in 32-column panels (CPU)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, as torch.argmax(x, -1) (CPU)");
}
