"""(torch) The lean forward of the decoder families of `decoder_plan` over the paged pool, in torch ops (cuBLAS
linears) around the step's attention: the CUDA backend's forward, and what its CUDA graphs capture.

The same weights and arithmetic as transformers' eager forward (float32 norms, rotate-half rotary in the model's
dtype, the family's norm placement, q/k norms, multipliers and softcaps) in fewer operations: q/k/v and gate/up
are one matmul each (the module weights become views into the concatenated tensors). Nothing in a dense model's
forward reads a value back to the host, so it can be captured in a CUDA graph: the rotary tables are computed for
every position up front. An MoE layer routes its tokens on the host (not captured). A quantized linear
(`QuantWeight`) runs the Triton kernels of `triton_quant.py` over its quantized form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.backends.decoder_plan import DecoderPlan, LayerPlan, MoePlan, NormPlan
from conveyor.core.backends.step import StepAttention, with_embeds
from conveyor.core.quant.weights import QuantWeight

MAX_ROTARY_POSITIONS = 1 << 17  # a longer context grows the tables outside any graph (`reserve`)


def table_positions(model: torch.nn.Module) -> int:
    """Positions the backend sizes its tables for up front (the rotary table, a graph's block tables): the config's
    max_position_embeddings, or 4096 where it gives none (not the engine's unbounded `ModelShape.max_model_len`)."""
    return int(getattr(model.config, "max_position_embeddings", 4096) or 4096)


def rms_norm(x: torch.Tensor, norm: NormPlan) -> torch.Tensor:
    """transformers' RMSNorm: a weight in the model's dtype multiplies the normalized rows rounded to it; a float32
    one (Gemma's 1 + w, OLMo-2's w) multiplies them in float32, rounded after."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (h * norm.weight).to(x.dtype)
    return norm.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with its first cos.shape[-1] dims rotated by cos, sin [T, dims] (transformers' rotate_half
    convention; the other dims passed through)."""
    dims = cos.shape[-1]
    if dims == 0:
        return x
    xr, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = (xr * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)  # float32 tables: rounded once (OLMo-2)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def _act(x: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(x) if act == "silu" else F.gelu(x, approximate="tanh")


def _moe(x: torch.Tensor, moe: MoePlan, act: str) -> torch.Tensor:
    logits = F.linear(x, moe.router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_dtype:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    inter = moe.gate_up.shape[1] // 2
    for e in torch.unique(chosen).tolist():
        token, slot = torch.where(chosen == e)
        gu = F.linear(x[token], moe.gate_up[e])
        y = F.linear(_act(gu[:, :inter], act) * gu[:, inter:], moe.down[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


class DecoderForward:
    """Callable: (input_ids [T], positions [T], attention, logit_rows [L]) -> logits [L, vocab]."""

    def __init__(self, model: torch.nn.Module, plan: DecoderPlan, attention: ModelAttention) -> None:
        self.plan = plan
        self.attention = attention.layers
        self.rotaries = plan.rotaries
        self.has_moe = any(layer.moe is not None for layer in plan.layers)
        self.quantized: dict[int, object] = {}  # id of a QuantWeight -> its TritonQuantLinear
        self.reserve(min(table_positions(model), MAX_ROTARY_POSITIONS))

    def _linear(self, x: torch.Tensor, pair) -> torch.Tensor:
        weight, bias = pair
        if not isinstance(weight, QuantWeight):
            return F.linear(x, weight, bias)
        linear = self.quantized.get(id(weight))
        if linear is None:
            from conveyor.core.backends.cuda.triton_quant import TritonQuantLinear

            linear = self.quantized[id(weight)] = TritonQuantLinear(weight, bias)
        return linear(x)

    def reserve(self, num_positions: int) -> None:
        for table in self.rotaries:
            table.reserve(num_positions)

    def covers(self, max_position: int) -> bool:
        """Whether the rotary tables already hold `max_position` (else `reserve` first, outside a graph)."""
        return all(max_position < table.cos.shape[0] for table in self.rotaries)

    def _layer(self, i: int, layer: LayerPlan, h: torch.Tensor, tables, attention: StepAttention) -> torch.Tensor:
        plan, spec = self.plan, self.attention[i]
        H, Hkv, D = plan.num_heads, plan.num_kv_heads, plan.head_dim
        T = h.shape[0]
        norms = layer.norms
        x = rms_norm(h, norms["attn_in"]) if "attn_in" in norms else h
        qkv = self._linear(x, layer.qkv)
        q = qkv[:, :H * D]
        k = qkv[:, H * D:(H + Hkv) * D]
        v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
        if layer.q_norm is not None:
            if layer.qk_norm_whole:
                q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
            else:
                q = rms_norm(q.reshape(T, H, D), layer.q_norm)
                k = rms_norm(k.reshape(T, Hkv, D), layer.k_norm)
        q, k = q.reshape(T, H, D), k.reshape(T, Hkv, D)
        if layer.rope is not None:
            cos, sin = tables[layer.rope]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention.store(i, k, v)
        a = attention.attend(i, q, k, v, spec.scale, window=spec.window, softcap=spec.softcap)
        o = self._linear(a.reshape(T, H * D), layer.o)
        if "attn_out" in norms:
            o = rms_norm(o, norms["attn_out"])
        if layer.residual_multiplier != 1.0:
            o = o * layer.residual_multiplier
        h = h + o
        x = rms_norm(h, norms["mlp_in"]) if "mlp_in" in norms else h
        if layer.moe is not None:
            m = _moe(x, layer.moe, layer.act)
        else:
            gate_up = self._linear(x, layer.gate_up)
            n = layer.intermediate
            m = self._linear(_act(gate_up[:, :n], layer.act) * gate_up[:, n:], layer.down)
        if "mlp_out" in norms:
            m = rms_norm(m, norms["mlp_out"])
        if layer.residual_multiplier != 1.0:
            m = m * layer.residual_multiplier
        return h + m

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention,
                 logit_rows: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        plan = self.plan
        tables = [(t.cos.index_select(0, positions), t.sin.index_select(0, positions)) for t in self.rotaries]
        h = with_embeds(plan.embed(input_ids), embeds)
        for i, layer in enumerate(plan.layers):
            h = self._layer(i, layer, h, tables, attention)
        rows = h.index_select(0, logit_rows)
        logits = self._linear(rms_norm(rows, plan.final_norm), plan.lm_head)
        if plan.final_softcap is not None:
            logits = torch.tanh(logits / plan.final_softcap) * plan.final_softcap
        if plan.logits_divisor is not None:
            logits = logits / plan.logits_divisor
        return logits
