"""(torch) Paged attention, registered with transformers' AttentionInterface as "conveyor_paged".

The model runs one flat batch [1, num_tokens] per step. For each layer this function writes the
step's new K/V into the paged pool, then attends every query token to its own request's cached
K/V with the right causal offset:
- a fresh prefill chunk (nothing cached before it) attends within itself: one causal SDPA call;
- every other row (decodes, later prefill chunks) goes to the C++ kernel, which reads K/V in place
  from the pool; without the kernel, those rows gather K/V into padded tensors for SDPA instead.
Per-step index tensors come in `PagedBatch`, passed as a keyword argument through the unmodified
model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    kv_cache: list[torch.Tensor]  # per layer [num_slots, 2 * num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    block_size: int
    fresh_chunks: list[tuple[int, int]]  # [start, end) rows of prefill chunks with nothing cached
    paged_rows: torch.Tensor | None  # rows attending through the pool; None = every row does
    has_paged_rows: bool
    tables: torch.Tensor | None  # [num_requests, max_blocks] block tables (kernel path)
    token_req: torch.Tensor | None  # [num_paged_rows] index into tables
    token_ctx: torch.Tensor | None  # [num_paged_rows] keys each row sees (its position + 1)
    gathered: list[GatheredRows]  # used instead of the three above when the kernel is unavailable
    kernel: object | None  # the compiled op, or None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, conveyor_batch: PagedBatch | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> (output [1, T, H, D], None)."""
    if conveyor_batch is None:
        raise RuntimeError("conveyor_paged attention needs the step's PagedBatch (run the model via ModelRunner)")
    batch = conveyor_batch
    num_kv_heads = key.shape[1]
    cache = batch.kv_cache[module.layer_idx]
    # [T, 2 * Hkv, D]: K heads then V heads, as the pool stores them.
    new_kv = torch.cat((key[0], value[0]), dim=0).transpose(0, 1)
    cache.index_copy_(0, batch.slot_mapping, new_kv.to(cache.dtype))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5

    q = query[0].transpose(0, 1)  # [T, H, D]
    if batch.kernel is not None and batch.has_paged_rows and batch.paged_rows is None:  # all rows paged: one call
        return _paged(q, cache, batch, num_kv_heads, scale).unsqueeze(0), None
    out = torch.empty_like(q)
    if batch.kernel is not None and batch.has_paged_rows:
        out[batch.paged_rows] = _paged(q[batch.paged_rows], cache, batch, num_kv_heads, scale)
    for g in batch.gathered:
        out[g.rows] = _gathered(q[g.rows], cache, g, num_kv_heads, scale)
    for start, end in batch.fresh_chunks:
        qc = query[:, :, start:end]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qc, key[:, :, start:end], value[:, :, start:end], is_causal=True,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _paged(q: torch.Tensor, cache: torch.Tensor, batch: PagedBatch, num_kv_heads: int, scale: float) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D], each row attending to its request's first token_ctx cached tokens."""
    q_c = q.to(cache.dtype).contiguous()
    return batch.kernel(q_c, cache, batch.tables, batch.token_req, batch.token_ctx, batch.block_size,
                        scale).to(q.dtype)


def _gathered(q: torch.Tensor, cache: torch.Tensor, g: GatheredRows, num_kv_heads: int,
              scale: float) -> torch.Tensor:
    """Fallback: q [n, H, D] -> [n, H, D] via a padded gather and one SDPA call."""
    kv = cache[g.slots].transpose(1, 2)  # [b, 2Hkv, L, D]
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
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
