"""(torch) The CPU's fused forward for the decoder families of `decoder_plan`, over the paged KV pool.

The model's plan (`backends/decoder_plan.py`) becomes one C++ `Decoder` (`csrc/decoder.h`): each weight packed
once in the layout of its matmul kernel (`linears.Linear`: 32-column panels, bf16 pairs or AMX tiles), the norms,
q/k norms, rotary + KV store, attention with the layer's window and softcap, and the MLP (dense or MoE) as the C++
kernels of `fused_ops.cpp` and `paged_attention.cpp`; the layers run in one call per step. Every kernel computes a
row the same way whatever else is in the step (the exactness contract, `conveyor.core.exactness`).

`FusedDecoder.build(model, attention)` returns (None, why) for anything the plan does not cover, or on a device
other than the CPU; the CPU backend then runs the model's transformers forward with its attention instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.backends.cpu.linears import Linear
from conveyor.core.backends.decoder_plan import DecoderPlan, LayerPlan, NormPlan, decoder_plan
from conveyor.core.backends.step import with_embeds

if TYPE_CHECKING:
    from conveyor.core.backends.cpu.backend import CpuAttention

ACT = {"silu": 0, "gelu_tanh": 1}


class FusedDecoder:
    """Callable: (input_ids [T], positions [T], batch, sample_rows [S]) -> logits [S, vocab]."""

    def __init__(self, plan: DecoderPlan, attention: ModelAttention, ops) -> None:
        self.ops = ops
        self.plan = plan
        self.decoder = ops.Decoder(plan.num_heads, plan.num_kv_heads, plan.head_dim)
        for layer, spec in zip(plan.layers, attention.layers):
            self.decoder.add(self._layer(layer, spec))
        self.final_norm = plan.final_norm
        self.lm_head = Linear(*plan.lm_head, ops) if plan.lm_head is not None else None

    def _linear(self, pair) -> object:
        return Linear(*pair, self.ops).native(self.ops)

    def _norm(self, norm: NormPlan):
        return self.ops.Norm(norm.weight.contiguous(), norm.eps)

    def _layer(self, plan: LayerPlan, spec) -> object:
        ops = self.ops
        layer = ops.Layer()
        for role in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
            if role in plan.norms:
                setattr(layer, role, self._norm(plan.norms[role]))
        if plan.q_norm is not None:
            layer.q_norm, layer.k_norm = self._norm(plan.q_norm), self._norm(plan.k_norm)
            layer.qk_norm_whole = plan.qk_norm_whole
        layer.qkv, layer.o = self._linear(plan.qkv), self._linear(plan.o)
        if plan.moe is None:
            layer.gate_up, layer.down = self._linear(plan.gate_up), self._linear(plan.down)
        else:
            m = plan.moe
            layer.moe = ops.Moe(self._linear((m.router, None)), [self._linear((w, None)) for w in m.gate_up],
                                [self._linear((w, None)) for w in m.down], m.top_k, m.renormalize,
                                m.weights_in_dtype)
        layer.act = ACT[plan.act]
        layer.rope = -1 if plan.rope is None else plan.rope
        layer.window = spec.window or 0
        layer.softcap = spec.softcap or 0.0
        layer.scale = spec.scale
        layer.residual_multiplier = plan.residual_multiplier
        return layer

    @classmethod
    def build(cls, model: torch.nn.Module, attention: ModelAttention, ops) -> tuple[FusedDecoder | None, str | None]:
        """(a FusedDecoder over `model`'s weights, None), or (None, why this forward does not apply)."""
        if ops is None or not hasattr(ops, "Decoder"):
            return None, "conveyor's C++ kernels are not built here"
        if next(model.parameters()).device.type != "cpu":
            return None, "the model is not on the CPU"
        plan, why = decoder_plan(model, attention)
        if plan is None:
            return None, why
        return cls(plan, attention, ops), None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: CpuAttention,
                 sample_rows: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        plan = self.plan
        logits = self.lm_head(self.hidden(input_ids, positions, batch, sample_rows, embeds))
        if plan.final_softcap is not None:
            self.ops.softcap(logits, plan.final_softcap)
        if plan.logits_divisor is not None:
            logits = logits / plan.logits_divisor
        return logits

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: CpuAttention,
               rows: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The last hidden states (after the final norm) of the step's `rows`, [len(rows), hidden]; `embeds`: rows
        whose embedding is given (`Step.embeds`)."""
        plan = self.plan
        h = with_embeds(plan.embed(input_ids).contiguous(), embeds)  # [T, hidden]; the residual stream, in place
        known_max = int(positions.max())  # (read once for every rotary table)
        tables = [rotary(positions, known_max) for rotary in plan.rotaries]
        cos = [c.contiguous() for c, _ in tables]
        sin = [s.contiguous() for _, s in tables]
        kv = batch.kv
        delta = self.decoder.forward(h, cos, sin, batch.slot_mapping, kv.keys, kv.values, batch.tables,
                                     batch.token_req, batch.token_ctx, kv.block_size)
        norm = self.final_norm
        return self.ops.rms_norm(h.index_select(0, rows), delta.index_select(0, rows), norm.weight, norm.eps)

    def describe(self) -> str:
        return f"fused {self.plan.family} forward"
