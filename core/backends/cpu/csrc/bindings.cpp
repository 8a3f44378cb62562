// Python bindings of conveyor's CPU kernels (one extension module, built once and cached).
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's Tensor casters: a third of torch/extension.h's build time
#include <pybind11/stl.h>

#include <string>

#include "decoder.h"
#include "vec16.h"

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                           at::Tensor token_req, at::Tensor token_ctx, int64_t block_size, double scale,
                           int64_t window, double softcap, c10::optional<at::Tensor> sinks);
bool kv_pairs(bool bf16, int64_t head_dim, int64_t block_size, int64_t group);
at::Tensor rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor w, double eps);
void rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache,
                at::Tensor v_cache, int64_t num_heads);
void store_kv(at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache);
at::Tensor silu_mul(at::Tensor gu);
at::Tensor argmax_rows(at::Tensor x);
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);
at::Tensor sample_rows(at::Tensor logits, at::Tensor rows, at::Tensor temps, at::Tensor u, at::Tensor top_k,
                       at::Tensor top_p, at::Tensor min_p);
at::Tensor panel_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                      int64_t act);
at::Tensor pair_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                     int64_t act);
bool pair_gemm_available();
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                    int64_t act);
bool amx_gemm_available();
at::Tensor wq_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, at::Tensor zeros, c10::optional<at::Tensor> offsets,
                   int64_t N, int64_t group, int64_t bits, c10::optional<at::Tensor> bias);
at::Tensor i8_gemm(at::Tensor x, at::Tensor packed, at::Tensor wsum, at::Tensor wscale, int64_t N,
                   c10::optional<at::Tensor> bias, double x_scale, bool vnni);
bool i8_vnni_built();
double fma_peak_gflops(double seconds, bool bf16);
at::Tensor act_mul(at::Tensor gu, int64_t act);
void norm_runs_inplace(at::Tensor x, int64_t offset, int64_t groups, int64_t n, at::Tensor w, double eps);
void softcap_inplace(at::Tensor x, double cap);
bool peak_bf16_available();
at::Tensor packed_attention(at::Tensor qkv, at::Tensor starts, int64_t heads, double scale);
at::Tensor mean_pool(at::Tensor h, at::Tensor starts);
at::Tensor add_layer_norm(at::Tensor h, at::Tensor delta, at::Tensor w, at::Tensor b, double eps);

// The instructions this build's kernels are written in (vec16.h): "avx512bf16" (AVX-512 with bf16 pair
// products), "avx512", "avx2" (AVX2 + FMA: each 16-float vector is two registers), or "generic" (none of
// these: every vector op a loop over lanes, slower than torch; the Python side refuses it).
static std::string build_isa() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(CONVEYOR_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_isa", &build_isa, "the instructions this build's kernels are written in: avx512bf16, avx512, avx2 or generic");
  m.def("paged_attention", &paged_attention,
        "paged attention over a block pool (CPU), with an optional sliding window, softcap and sinks",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("tables"),
        pybind11::arg("token_req"), pybind11::arg("token_ctx"), pybind11::arg("block_size"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0, pybind11::arg("sinks") = pybind11::none());
  m.def("kv_pairs", &kv_pairs,
        "whether a KV pool of this shape (bf16?, head_dim, block_size, query heads per KV head) is laid out in "
        "bf16 pairs and attended to with bf16 products (AMX tiles or AVX512-BF16)");
  m.def("packed_attention", &packed_attention,
        "bidirectional attention within packed whole sequences (an encoder's step): qkv [T, 3 H D], starts [S + 1] "
        "-> [T, H D] (CPU)");
  m.def("mean_pool", &mean_pool, "float32 mean of each sequence's rows of h, sequence s: rows starts[s] .. "
        "starts[s + 1] (CPU)");
  m.def("add_layer_norm", &add_layer_norm, "LayerNorm(h + delta) * w + b per row (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding a residual delta in place first (CPU)");
  m.def("rope_store", &rope_store, "rotary embedding on q/k in place, then k/v stored into the paged pool (CPU)");
  m.def("store_kv", &store_kv, "k, v [T, Hkv, D] stored into the paged pool at slots, in its layout (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over [rows, 2I] (CPU)");
  m.def("panel_gemm", &panel_gemm, "x @ W.T (+ bias) by float multiply-adds in k order, W prepacked in 32-column panels; "
        "act 1: GELU (erf) of it (CPU)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"),
        pybind11::arg("bias"), pybind11::arg("act") = 0);
  m.def("pair_gemm", &pair_gemm, "x @ W.T (+ bias) in bf16 by AVX512-BF16 pair products, W prepacked by linears.pack_pairs; "
        "act 1: GELU (erf) of it (CPU)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"),
        pybind11::arg("bias"), pybind11::arg("act") = 0);
  m.def("pair_gemm_available", &pair_gemm_available, "whether pair_gemm is built in (AVX512-BF16)");
  m.def("amx_gemm", &amx_gemm, "x @ W.T (+ bias) in bf16 on AMX tiles, W prepacked by linears.pack_amx; act 1: GELU "
        "(erf) of it (CPU)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("bias"),
        pybind11::arg("act") = 0);
  m.def("wq_gemm", &wq_gemm, "x @ W.T (+ bias), W quantized (4 or 8 bits, group scales, zeros, offsets) and "
        "de-quantized in the panel, packed by linears.pack_wq (CPU)", pybind11::arg("x"), pybind11::arg("q"),
        pybind11::arg("scales"), pybind11::arg("zeros"), pybind11::arg("offsets"), pybind11::arg("N"),
        pybind11::arg("group"), pybind11::arg("bits"), pybind11::arg("bias"));
  m.def("i8_gemm", &i8_gemm, "x @ W.T (+ bias) with int8 weights and x quantized to int8 per row, int32 sums, "
        "packed by linears.pack_i8 (CPU)", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("wsum"),
        pybind11::arg("wscale"), pybind11::arg("N"), pybind11::arg("bias"), pybind11::arg("x_scale"),
        pybind11::arg("vnni"));
  m.def("i8_vnni_built", &i8_vnni_built, "whether i8_gemm's AVX512-VNNI route is built in");
  m.def("amx_gemm_available", &amx_gemm_available, "whether amx_gemm can run here (AMX built in and permitted)");
  m.def("act_mul", &act_mul, "act(gate) * up over [rows, 2I]: act 0 SiLU, 1 GELU-tanh (CPU)");
  m.def("norm_runs", &norm_runs_inplace,
        "in place: `groups` runs of n columns from `offset` of each row RMS-normalized (q / k norms) (CPU)");
  m.def("softcap", &softcap_inplace, "in place: x <- cap * tanh(x / cap) (CPU)");
  namespace py = pybind11;
  py::class_<Linear>(m, "Linear", "a prepacked linear of the exact kernels")
      .def(py::init([](at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias, int64_t route) {
             return Linear{packed, n, bias, route};
           }), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("route"))
      .def_readwrite("scales", &Linear::scales).def_readwrite("zeros", &Linear::zeros)
      .def_readwrite("wsum", &Linear::wsum).def_readwrite("offsets", &Linear::offsets)
      .def_readwrite("perm", &Linear::perm).def_readwrite("group", &Linear::group)
      .def_readwrite("bits", &Linear::bits).def_readwrite("x_scale", &Linear::x_scale)
      .def_readwrite("vnni", &Linear::vnni)
      .def("__call__", &Linear::operator());
  py::class_<Norm>(m, "Norm", "an RMSNorm's weight (the model's dtype, or float32: multiplied in float) and eps")
      .def(py::init([](at::Tensor weight, double eps) { return Norm{weight, eps}; }), py::arg("weight"),
           py::arg("eps"));
  py::class_<Moe>(m, "Moe", "a sparse MoE MLP: router, experts' gate/up and down linears")
      .def(py::init([](Linear router, std::vector<Linear> gate_up, std::vector<Linear> down, int64_t top_k,
                       bool renormalize, bool weights_in_dtype) {
             return Moe{router, gate_up, down, top_k, renormalize, weights_in_dtype};
           }), py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("weights_in_dtype"))
      .def("__call__", &Moe::operator());
  py::class_<Layer>(m, "Layer", "what one decoder layer computes (decoder.h)")
      .def(py::init<>())
      .def_readwrite("attn_in", &Layer::attn_in).def_readwrite("attn_out", &Layer::attn_out)
      .def_readwrite("mlp_in", &Layer::mlp_in).def_readwrite("mlp_out", &Layer::mlp_out)
      .def_readwrite("q_norm", &Layer::q_norm).def_readwrite("k_norm", &Layer::k_norm)
      .def_readwrite("qk_norm_whole", &Layer::qk_norm_whole)
      .def_readwrite("qkv", &Layer::qkv).def_readwrite("o", &Layer::o)
      .def_readwrite("gate_up", &Layer::gate_up).def_readwrite("down", &Layer::down)
      .def_readwrite("moe", &Layer::moe).def_readwrite("act", &Layer::act).def_readwrite("rope", &Layer::rope)
      .def_readwrite("window", &Layer::window).def_readwrite("softcap", &Layer::softcap)
      .def_readwrite("scale", &Layer::scale)
      .def_readwrite("residual_multiplier", &Layer::residual_multiplier);
  py::class_<Decoder>(m, "Decoder", "the decoder layers of the fused forward, run per step in one call")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"))
      .def("add", &Decoder::add)
      .def("forward", &Decoder::forward,
           "h [T, hidden] (the residual stream, updated in place), cos / sin per rotary table, the step's slots, "
           "the layers' K/V pools and the attention metadata -> the last layer's MLP output",
           py::call_guard<py::gil_scoped_release>());
  m.def("fma_peak_gflops", &fma_peak_gflops,
        "GFLOP/s of independent 512-bit multiply-adds on every thread for about `seconds` (float FMAs, or bf16 pair "
        "products): the peak the kernel microbenchmark reads the linears against");
  m.def("peak_bf16_available", &peak_bf16_available, "whether fma_peak_gflops can run bf16 pair products");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits of the listed rows set to -inf where the row's token bitmask does not allow the token (CPU)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, as torch.argmax(x, -1) (CPU)");
  m.def("sample_rows", &sample_rows, "temperature sampling of listed rows (top-k/top-p/min-p optional) by inverse CDF, one draw each (CPU)");
}
