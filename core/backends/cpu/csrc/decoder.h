// The decoder layers of the fused forward (fused_decoder.py) as data: what each layer of a supported family
// computes (its norms and where they sit, q/k norms, rotary, attention variant, dense or MoE MLP, residual
// scaling), built once from the model's modules, run per step in one call (decoder.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <cstdint>
#include <vector>

// y = x W^T (+ b) by one of the exact linear kernels: 0 float panels, 1 bf16 pairs, 2 AMX tiles, 3 quantized
// weights de-quantized in the panel (`packed` their values, with `scales`, `zeros`, `offsets`, `group`, `bits`),
// 4 W8A8 (`packed` int8, `wsum`, `scales` per column, `x_scale` static or 0, `vnni`). `perm`: x's columns taken in
// this order first (GPTQ's act-order). n == 0: absent.
struct Linear {
  at::Tensor packed;
  int64_t n = 0;
  c10::optional<at::Tensor> bias;
  int64_t route = 0;
  at::Tensor scales, zeros, wsum;
  c10::optional<at::Tensor> offsets, perm;
  int64_t group = 0, bits = 0;
  double x_scale = 0.0;
  bool vnni = false;
  at::Tensor operator()(const at::Tensor& x) const;
};

// An RMSNorm: weight in the model's dtype (Llama's form: w * (x r rounded)), or float32 (multiplied in float,
// rounded once: Gemma's 1 + w, OLMo-2's w). An undefined weight: no norm there.
struct Norm {
  at::Tensor weight;
  double eps = 0.0;
  bool present() const { return weight.defined(); }
  at::Tensor operator()(const at::Tensor& h, const c10::optional<at::Tensor>& delta = c10::nullopt) const;  // h += delta first
};

// A sparse MoE MLP: router logits -> float softmax -> top_k (renormalized where `renormalize`), each routed
// token through its experts in expert order, weighted and summed (weights rounded to the model's dtype first
// where `weights_in_dtype`, as Qwen3-MoE does; kept in float32 as Mixtral does).
struct Moe {
  Linear router;
  std::vector<Linear> gate_up, down;
  int64_t top_k = 0;
  bool renormalize = true;
  bool weights_in_dtype = true;
  at::Tensor operator()(const at::Tensor& x, int64_t act) const;
};

struct Layer {
  Norm attn_in, attn_out, mlp_in, mlp_out;  // before / after the attention, before / after the MLP
  Norm q_norm, k_norm;
  bool qk_norm_whole = false;  // over all of q (k) at once, not per head (OLMo-2)
  Linear qkv, o, gate_up, down;
  Moe moe;  // where moe.top_k > 0, instead of gate_up / down
  int64_t act = 0;  // 0 SiLU, 1 GELU-tanh
  int64_t rope = -1;  // which rotary table (-1: no rotary in this layer)
  int64_t window = 0;
  double softcap = 0.0, scale = 1.0;  // (a model whose attention has sinks keeps its transformers forward)
  double residual_multiplier = 1.0;
};

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}
  void add(const Layer& layer) { layers_.push_back(layer); }
  // h [T, hidden], the residual stream (updated in place); cos / sin [T, rotary dims] per rotary table. Returns the
  // last layer's MLP output (the delta the final norm adds to h first).
  at::Tensor forward(at::Tensor h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const at::Tensor& slots, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& tables, const at::Tensor& token_req,
                     const at::Tensor& token_ctx, int64_t block_size) const;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  std::vector<Layer> layers_;
};
