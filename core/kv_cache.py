"""(torch) The paged K/V pool: one key and one value tensor per layer, in the layout of the engine's backend
(`backends.base.KVLayout`); token slot s lives in block s // block_size at offset s % block_size."""

from __future__ import annotations

import torch

from conveyor.core.backends.base import KVLayout


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: KVLayout) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        key_shape = layout.key_shape(num_blocks, block_size, num_kv_heads, head_dim)
        value_shape = layout.value_shape(num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: masked-out slots still enter attention's weighted sum with weight 0,
        # and 0 * NaN from uninitialised memory would poison the output.
        self.keys = [torch.zeros(key_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(num_layers)]
