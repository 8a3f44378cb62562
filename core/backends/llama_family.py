"""(torch) What the backends' own forwards (the CPU's fused one, the CUDA one) share about Llama-family models:
which models they cover, the rotary table, and q/k/v (gate/up) as one concatenated linear.
"""

from __future__ import annotations

import torch

# Architectures whose decoder layer is exactly: RMSNorm -> q/k/v (optional bias) -> rotary ->
# causal attention -> o_proj -> +residual -> RMSNorm -> SiLU-gated MLP -> +residual.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_BLOCK = 4096  # positions per extension of the rotary table


def is_plain_llama(model: torch.nn.Module) -> bool:
    """Whether `model` is such a decoder and nothing more (no biases in norms, sliding windows, non-SiLU MLPs,
    extra norms, logit scaling or softcapping)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return False
    if getattr(cfg, "logits_scaling", None) is not None or getattr(cfg, "final_logit_softcapping", None):
        return False
    inner = getattr(model, "model", None)
    try:
        expected = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        for layer in inner.layers:
            if {name for name, _ in layer.named_children()} != expected:
                return False  # extra norms (q_norm, k_norm, ...): not this architecture
            if {name for name, _ in layer.self_attn.named_children()} != {"q_proj", "k_proj", "v_proj", "o_proj"}:
                return False
            if {name for name, _ in layer.mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
                return False
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if {name for name, _ in norm.named_parameters()} != {"weight"}:
                    return False
        return hasattr(inner, "rotary_emb") and hasattr(inner.norm, "variance_epsilon")
    except (AttributeError, TypeError):
        return False


def concat_linears(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(N), K] weight (and bias, zeros for a module that has none; None where none has one) whose slices
    the modules' parameters become, so the weights are held once: one matmul for q/k/v, one for gate/up."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                          for m in modules])
    offset = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[offset:offset + n]
        if m.bias is not None:
            m.bias.data = bias[offset:offset + n]
        offset += n
    return weight, bias


class RotaryTable:
    """cos, sin [T, head_dim] of each position, looked up in a table of every position so far: computed by the
    model's own rotary module ROPE_BLOCK positions at a time, so a position's values never depend on the step
    it comes in (torch's vectorized cos/sin would round a step's tail elements apart)."""

    def __init__(self, rotary: torch.nn.Module, like: torch.Tensor) -> None:
        self.rotary = rotary
        self.like = like[:1]  # gives the rotary module its dtype and device
        self.cos = like.new_empty(0, 0)
        self.sin = like.new_empty(0, 0)

    def reserve(self, num_positions: int) -> None:
        """Compute the table up to `num_positions` now (a CUDA graph must not grow it)."""
        while self.cos.shape[0] < num_positions:
            start = self.cos.shape[0]
            positions = torch.arange(start, start + ROPE_BLOCK, device=self.like.device).unsqueeze(0)
            cos, sin = self.rotary(self.like, positions)
            self.cos = cos[0] if start == 0 else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if start == 0 else torch.cat([self.sin, sin[0]])

    def __call__(self, positions: torch.Tensor, known_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows of `positions`; `known_max`, the largest position where the caller knows it, spares
        reading it from the device."""
        need = (int(positions.max()) if known_max is None else known_max) + 1
        if self.cos.shape[0] < need:
            self.reserve(need)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
