"""(torch) A lean forward for Llama-family models over the paged pool, in torch ops (cuBLAS linears) around the
step's attention: the CUDA backend's forward, and what its CUDA graphs capture.

Same weights and arithmetic as transformers' eager forward (float32 RMSNorm, rotate-half rotary in the
model's dtype) in fewer operations: q/k/v and gate/up are one matmul each (the module weights become views
into the concatenated tensors). Nothing in it reads a value back to the host, so it can be captured in a CUDA
graph: the rotary table is computed for every position up front.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.core.backends.base import ModelShape, StepAttention
from conveyor.core.backends.llama_family import RotaryTable, concat_linears

MAX_ROTARY_POSITIONS = 1 << 17  # a longer context grows the table outside any graph (`reserve`)


def table_positions(model: torch.nn.Module) -> int:
    """Positions the backend sizes its tables for up front (the rotary table, a graph's block tables): the config's
    max_position_embeddings, or 4096 where it gives none (not the engine's unbounded `ModelShape.max_model_len`)."""
    return int(getattr(model.config, "max_position_embeddings", 4096) or 4096)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, D] (transformers' rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class _Layer:
    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w, self.qkv_b = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_w = attn.o_proj.weight.detach()
        self.o_b = None if attn.o_proj.bias is None else attn.o_proj.bias.detach()
        self.gate_up_w, self.gate_up_b = concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_w = mlp.down_proj.weight.detach()
        self.down_b = None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach()
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)
        self.intermediate = mlp.gate_proj.weight.shape[0]


class LlamaForward:
    """Callable: (input_ids [T], positions [T], attention, logit_rows [L]) -> logits [L, vocab]."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = model.lm_head.weight.detach()
        self.lm_head_b = None if model.lm_head.bias is None else model.lm_head.bias.detach()
        shape = ModelShape.of(model)
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.scale = inner.layers[0].self_attn.scaling
        self.rotary = RotaryTable(inner.rotary_emb, self.embed)
        self.rotary.reserve(min(table_positions(model), MAX_ROTARY_POSITIONS))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention,
                 logit_rows: torch.Tensor) -> torch.Tensor:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = input_ids.shape[0]
        cos = self.rotary.cos.index_select(0, positions)
        sin = self.rotary.sin.index_select(0, positions)
        h = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.norm_in, layer.eps_in)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            q = rotate(qkv[:, :H * D].view(T, H, D), cos, sin)
            k = rotate(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), cos, sin)
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            attention.store(i, k, v)
            a = attention.attend(i, q, k, v, self.scale)
            h = h + F.linear(a.reshape(T, H * D), layer.o_w, layer.o_b)
            x = rms_norm(h, layer.norm_post, layer.eps_post)
            gate_up = F.linear(x, layer.gate_up_w, layer.gate_up_b)
            n = layer.intermediate
            h = h + F.linear(F.silu(gate_up[:, :n]) * gate_up[:, n:], layer.down_w, layer.down_b)
        rows = h.index_select(0, logit_rows)
        return F.linear(rms_norm(rows, self.norm, self.norm_eps), self.lm_head, self.lm_head_b)

    def covers(self, max_position: int) -> bool:
        """Whether the rotary table already holds `max_position` (else `reserve` first, outside a graph)."""
        return max_position < self.rotary.cos.shape[0]
