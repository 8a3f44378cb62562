"""(torch) Paged attention, registered with transformers' AttentionInterface as "conveyor_paged".

The model runs one flat batch [1, num_tokens] per step. For each layer this function writes the
step's new K/V into the paged pool, then attends every request's query tokens to that request's
cached K/V with the right causal offset. Per-step index tensors come in `PagedBatch`, passed as a
keyword argument through the unmodified model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "conveyor_paged"


@dataclass
class PrefillChunk:
    q_start: int  # first query row of this chunk in the flat batch
    q_end: int  # one past its last row
    start_pos: int  # position of the first query token (tokens before it are cached)
    ctx_slots: torch.Tensor | None  # [start_pos + chunk] slots to gather, or None when start_pos == 0
    mask: torch.Tensor | None  # [chunk, start_pos + chunk] bool, True = attend; None = plain causal


@dataclass
class PagedBatch:
    """Index tensors for one step, shared by every layer."""

    kv_cache: list[torch.Tensor]  # per layer [num_slots, 2 * num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    decode_rows: torch.Tensor | None  # [num_decodes] rows of the flat batch holding one-token queries
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] slots each decode attends to (padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool, False on padding
    prefills: list[PrefillChunk]
    is_all_decode: bool  # every row is a decode: skip the scatter back


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

    q = query[0].transpose(0, 1)  # [T, H, D]
    if batch.is_all_decode:
        out = _decode(q, cache, batch, num_kv_heads, scaling)
        return out.unsqueeze(0), None
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        out[batch.decode_rows] = _decode(q[batch.decode_rows], cache, batch, num_kv_heads, scaling)
    for chunk in batch.prefills:
        qc = q[chunk.q_start:chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.ctx_slots is None:  # nothing cached: attend within the chunk
            kc = key[:, :, chunk.q_start:chunk.q_end]
            vc = value[:, :, chunk.q_start:chunk.q_end]
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            kv = cache[chunk.ctx_slots].transpose(0, 1).unsqueeze(0)  # [1, 2Hkv, L, D]
            kc, vc = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
            o = F.scaled_dot_product_attention(qc.to(kc.dtype), kc, vc, attn_mask=chunk.mask, scale=scaling,
                                               enable_gqa=True)
        out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out.unsqueeze(0), None


def _decode(q: torch.Tensor, cache: torch.Tensor, batch: PagedBatch, num_kv_heads: int,
            scaling: float | None) -> torch.Tensor:
    """q [B, H, D] one query per request -> [B, H, D]."""
    kv = cache[batch.decode_slots]  # [B, L, 2Hkv, D]
    kv = kv.transpose(1, 2)  # [B, 2Hkv, L, D]
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    o = F.scaled_dot_product_attention(q.unsqueeze(2).to(k.dtype), k, v, attn_mask=batch.decode_mask,
                                       scale=scaling, enable_gqa=True)  # [B, H, 1, D]
    return o.squeeze(2).to(q.dtype)


def _no_mask(*args, **kwargs):
    """The causal structure lives in PagedBatch; transformers need not build a mask."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
