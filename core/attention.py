"""(torch) Paged attention, registered with transformers' AttentionInterface as "conveyor_paged".

The model runs one flat batch [1, num_tokens] per step. For each layer this function writes the
step's new K/V into the paged pool, then attends every query token to its own request's cached
K/V with the right causal offset (`attend`, which the fused forward calls too):
- with the C++ kernels, every row (fresh prompt, later chunk or decode) goes to the paged kernel,
  which reads K/V in place from the pool with one arithmetic for all of them;
- without them (the torch fallback), a fresh prefill chunk (nothing cached before it) attends within
  itself in one causal SDPA call, and every other row gathers K/V into padded tensors for SDPA.
Per-step index tensors come in `PagedBatch`, passed as a keyword argument through the unmodified
model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "conveyor_paged"


@dataclass
class GatheredRows:
    """Fallback without the kernel: K/V gathered from the pool into padded tensors for SDPA.

    Either n one-token queries (decodes: mask [n, 1, 1, L]) or one prefill chunk continuing a
    cached prefix (rows [start, end), slots [1, L], mask [1, 1, n, L]).
    """

    rows: torch.Tensor | slice  # rows of the flat batch
    slots: torch.Tensor  # [b, L] pool slots to gather (padded with slot 0)
    mask: torch.Tensor  # bool, True = attend
    is_decode: bool


@dataclass
class PagedBatch:
    """Index tensors for one step, shared by every layer."""

    keys: list[torch.Tensor]  # per layer, in the pool's layout (KVCache)
    values: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    slot_block: torch.Tensor  # [num_tokens] slot_mapping // block_size
    slot_offset: torch.Tensor  # [num_tokens] slot_mapping % block_size
    block_size: int
    kernel: object | None  # the compiled attention op (every row through it), or None: the torch fallback
    store_kv: object | None  # the compiled K/V store (any pool layout), or None
    tables: torch.Tensor | None = None  # kernel: [num_requests, max_blocks] block tables
    token_req: torch.Tensor | None = None  # kernel: [num_tokens] index into tables
    token_ctx: torch.Tensor | None = None  # kernel: [num_tokens] keys each row sees (its position + 1)
    fresh_chunks: list[tuple[int, int]] = field(default_factory=list)  # fallback: [start, end) rows of prompt
    # chunks with nothing cached, attending within themselves
    gathered: list[GatheredRows] = field(default_factory=list)  # fallback: every other row


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           batch: PagedBatch, scale: float) -> torch.Tensor:
    """q [T, H, D] (rows may be apart), the step's own k_new / v_new [T, Hkv, D], already in the pool ->
    attention output [T, H, D]: every row through the kernel, or without it the torch fallback (causal SDPA
    within fresh prompt chunks, gathered K/V for the rest)."""
    if batch.kernel is not None:
        return batch.kernel(q, k_cache, v_cache, batch.tables, batch.token_req, batch.token_ctx, batch.block_size,
                            scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for g in batch.gathered:
        out[g.rows] = gathered_attention(q[g.rows], k_cache, v_cache, g, batch.block_size, scale)
    for start, end in batch.fresh_chunks:
        qc, kc, vc = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k_new, v_new))  # [1, heads, n, D]
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, conveyor_batch: PagedBatch | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> (output [1, T, H, D], None)."""
    if conveyor_batch is None:
        raise RuntimeError("conveyor_paged attention needs the step's PagedBatch (run the model via ModelRunner)")
    batch = conveyor_batch
    k_cache = batch.keys[module.layer_idx]
    v_cache = batch.values[module.layer_idx]
    k_new = key[0].transpose(0, 1).to(k_cache.dtype)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1).to(v_cache.dtype)
    if batch.store_kv is not None:  # the kernels' store: whichever layout the pool has
        batch.store_kv(k_new, v_new, batch.slot_mapping, k_cache, v_cache)
    else:  # the plain layout, in torch
        v_cache.index_copy_(0, batch.slot_mapping, v_new)
        # keys: a [num_blocks, block_size, Hkv, D] view of the transposed blocks, indexed per token
        k_cache.permute(0, 3, 1, 2).index_put_((batch.slot_block, batch.slot_offset), k_new)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1).to(k_cache.dtype)  # [T, H, D]
    return attend(q, k_new, v_new, k_cache, v_cache, batch, scale).to(query.dtype).unsqueeze(0), None


def gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: GatheredRows,
                       block_size: int, scale: float) -> torch.Tensor:
    """Fallback: q [n, H, D] -> [n, H, D] via a padded gather and one SDPA call."""
    k = k_cache.permute(0, 3, 1, 2)[g.slots // block_size, g.slots % block_size].transpose(1, 2)  # [b, Hkv, L, D]
    v = v_cache[g.slots].transpose(1, 2)  # [b, Hkv, L, D]
    if g.is_decode:
        qb = q.unsqueeze(2)  # [n, H, 1, D]: one query per request
    else:
        qb = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]: one chunk
    o = F.scaled_dot_product_attention(qb.to(k.dtype), k, v, attn_mask=g.mask, scale=scale, enable_gqa=True)
    o = o.squeeze(2) if g.is_decode else o[0].transpose(0, 1)
    return o.to(q.dtype)


def _no_mask(*args, **kwargs):
    """The causal structure lives in PagedBatch; transformers need not build a mask."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
