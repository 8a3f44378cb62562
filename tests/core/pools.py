"""Test helper (torch): a KV pool in either layout of the cpu backend, filled from dense per-slot K/V, and the
dense reference attention the kernels are checked against."""

from __future__ import annotations

import torch

from conveyor.core.backends.cpu.backend import LAYOUTS
from conveyor.core.kv_cache import KVCache


def filled_pool(keys: torch.Tensor, values: torch.Tensor, block_size: int, layout: str) -> KVCache:
    """keys, values [num_slots, Hkv, D] (num_slots a multiple of block_size) -> a one-layer KVCache holding
    slot s's K/V at slot s, in `layout`."""
    slots, hkv, d = keys.shape
    num_blocks = slots // block_size
    kv = KVCache(1, hkv, d, num_blocks, block_size, keys.dtype, torch.device("cpu"), LAYOUTS[layout])
    k = keys.view(num_blocks, block_size, hkv, d)
    v = values.view(num_blocks, block_size, hkv, d)
    if layout == "plain":
        kv.keys[0].copy_(k.permute(0, 2, 3, 1))
        kv.values[0].copy_(values)
    else:
        kv.keys[0].copy_(k.view(num_blocks, block_size, hkv, d // 2, 2).permute(0, 2, 3, 1, 4))
        kv.values[0].copy_(v.view(num_blocks, block_size // 2, 2, hkv, d).permute(0, 3, 1, 4, 2))
    return kv


def pool_slot(kv: KVCache, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [Hkv, D] stored at `slot` of layer 0, whatever the layout."""
    bs = kv.block_size
    block, off = divmod(slot, bs)
    if kv.layout.name == "plain":
        return kv.keys[0][block, :, :, off], kv.values[0][slot]
    k = kv.keys[0][block, :, :, off, :].reshape(kv.num_kv_heads, kv.head_dim)
    v = kv.values[0][block, :, off // 2, :, off % 2]
    return k, v


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [H, D] at the position after keys/values [L, Hkv, D] (GQA), in float64: its last `window` keys only
    where given, scores capped to softcap * tanh(scores / softcap), sinks [H] in the softmax's denominator."""
    H, Hkv = q.shape[0], keys.shape[1]
    if window:
        keys, values = keys[-window:], values[-window:]
    k = keys.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    s = (k @ q.double().unsqueeze(-1)).squeeze(-1) * scale  # [H, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if sinks is not None:
        s = torch.cat([s, sinks.double().unsqueeze(1)], dim=1)
    w = torch.softmax(s, dim=-1)[:, :k.shape[1]]
    return (w.unsqueeze(1) @ v).squeeze(1)
