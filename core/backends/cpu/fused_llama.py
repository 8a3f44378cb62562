"""(torch) A leaner forward pass for Llama-family models on the CPU, over the paged KV pool.

Same weights and the same arithmetic as transformers' eager forward, with far fewer operations
per layer: q/k/v and gate/up are each one matmul (the module weights become views into the
concatenated tensors), each weight is also kept once in the layout of its matmul kernel (`_Linear`:
32-column panels, bf16 pairs or AMX tiles), and the element-wise work between matmuls runs in the
C++ kernels of `fused_ops.cpp`: residual add + RMSNorm, rotary + KV store, SiLU(gate) * up. Per layer
that is 9 kernels instead of ~40 operations, and the layers run in one call from Python
(`llama_layers.cpp`). Every kernel computes a row the same way whatever else is in the step (the
exactness contract, `conveyor.core.exactness`).

`FusedLlama.build(model)` returns None for anything it does not cover (other architectures,
biases in norms, sliding windows, non-SiLU MLPs, devices other than the CPU, missing kernels); the
CPU backend then runs the model's transformers forward with its attention instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.core.backends.base import ModelShape
from conveyor.core.backends.llama_family import RotaryTable, concat_linears, is_plain_llama

if TYPE_CHECKING:
    from conveyor.core.backends.cpu.backend import CpuAttention

def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 32), K, 32]: 32-column panels of W.T, each contiguous (zero-padded)."""
    n, k = weight.shape
    panels = -(-n // 32)
    wt = torch.zeros(k, panels * 32, dtype=weight.dtype)
    wt[:, :n] = weight.t()
    return wt.view(k, panels, 32).permute(1, 0, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K even) -> [ceil(N / 32), K / 2, 32, 2]: for each panel of 32 output columns, for each pair
    (k, k + 1), the columns' two weights side by side: the operand layout of AVX512-BF16's VDPBF16PS."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_pairs: K={k} is odd")
    return pack_panels(weight).view(-1, k // 2, 2, 32).transpose(2, 3).contiguous()


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K a multiple of 32) -> [ceil(N / 32), K / 32, 2, 16, 16, 2]: for each panel of 32 output
    columns, for each 32-wide slice of K, two 16 x 16 tiles of (k, k + 1) pairs: the layout of the B
    operand of AMX's TDPBF16PS, one contiguous run per panel (zero-padded columns)."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"pack_amx: K={k} is not a multiple of 32")
    padded = -(-n // 32) * 32
    w = weight if padded == n else torch.cat([weight, weight.new_zeros(padded - n, k)])
    return w.reshape(padded // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class _Linear:
    """y = x @ W.T (+ b) by one kernel for every row count, chosen once from the dtype and the CPU.

    One kernel per layer, whatever M is, is the exactness contract for linears (see
    `conveyor.core.exactness`): each kernel computes an output as one fixed chain over k, so a row's
    result does not depend on the rows around it.
    - float32 (and bf16/fp16 where neither below exists): `panel_gemm`, float multiply-adds over W in
      32-column panels; a read of the weights at decode sizes, at or above oneDNN's rate on prompt steps.
    - bfloat16 on CPUs with AMX tiles: `amx_gemm` (`amx_gemm.cpp`).
    - bfloat16 on CPUs with AVX512-BF16 but no tiles: `pair_gemm`, bf16 pair products.
    """

    PANELS, PAIRS, TILES = 0, 1, 2  # the routes, as llama_layers.cpp numbers them

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        k = weight.shape[1]
        if weight.dtype == torch.bfloat16 and k % 32 == 0 and ops.amx_gemm_available():
            self.packed, self.gemm, self.route = pack_amx(weight), ops.amx_gemm, self.TILES
        elif weight.dtype == torch.bfloat16 and k % 2 == 0 and ops.pair_gemm_available():
            self.packed, self.gemm, self.route = pack_pairs(weight), ops.pair_gemm, self.PAIRS
        else:
            self.packed, self.gemm, self.route = pack_panels(weight), ops.panel_gemm, self.PANELS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.packed, self.out_features, self.bias)


class _Layer:
    def __init__(self, layer: torch.nn.Module, ops) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Linear(*concat_linears([attn.q_proj, attn.k_proj, attn.v_proj]), ops)
        self.o = _Linear(attn.o_proj.weight.detach(), _bias(attn.o_proj), ops)
        self.gate_up = _Linear(*concat_linears([mlp.gate_proj, mlp.up_proj]), ops)
        self.down = _Linear(mlp.down_proj.weight.detach(), _bias(mlp.down_proj), ops)
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


class FusedLlama:
    """Callable: (input_ids [T], positions [T], batch, sample_rows [S]) -> logits [S, vocab]."""

    def __init__(self, model: torch.nn.Module, ops) -> None:
        inner = model.model
        self.ops = ops
        self.embed = inner.embed_tokens.weight.detach()
        self.layers = [_Layer(layer, ops) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = _Linear(model.lm_head.weight.detach(), _bias(model.lm_head), ops)
        shape = ModelShape.of(model)
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.scale = inner.layers[0].self_attn.scaling
        self.rotary = RotaryTable(inner.rotary_emb, self.embed)
        # The layers as llama_layers.cpp takes them: flat lists, four linears and two norms a layer.
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.flat = ([lin.packed for lin in linears], [lin.out_features for lin in linears],
                     [lin.bias for lin in linears], [lin.route for lin in linears],
                     [w for layer in self.layers for w in (layer.norm_in, layer.norm_post)],
                     [e for layer in self.layers for e in (layer.eps_in, layer.eps_post)])

    @classmethod
    def build(cls, model: torch.nn.Module, ops) -> FusedLlama | None:
        """A FusedLlama over `model`'s weights, or None where this forward does not apply."""
        if ops is None or not hasattr(ops, "rms_norm"):
            return None
        if next(model.parameters()).device.type != "cpu" or not is_plain_llama(model):
            return None
        return cls(model, ops)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: CpuAttention,
                 sample_rows: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)  # [T, hidden]; the residual stream, updated in place
        cos, sin = self.rotary(positions)
        kv = batch.kv
        # Per layer (llama_layers.cpp): x = norm(h += delta); qkv = x Wqkv; rotary + K/V store; attention;
        # x = norm(h += attn Wo); delta = silu(x Wgate) * (x Wup) Wdown
        delta = self.ops.llama_layers(h, *self.flat, cos, sin, batch.slot_mapping, kv.keys, kv.values, batch.tables,
                                      batch.token_req, batch.token_ctx, kv.block_size, self.scale, self.num_heads,
                                      self.head_dim)
        rows = h.index_select(0, sample_rows)
        x = self.ops.rms_norm(rows, delta.index_select(0, sample_rows), self.norm, self.norm_eps)
        return self.lm_head(x)
