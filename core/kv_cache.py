"""(torch) The paged K/V pool: one key and one value tensor per layer, in the layout of the engine's backend
(`backends.base.KVLayout`); token slot s lives in block s // block_size at offset s % block_size.

On the CPU the pool is one anonymous memory map, viewed as the layers' tensors: its pages read as zeros and take
no memory until a block is first written, so a process's RSS follows the blocks its requests use, not the budget
(`--kv-cache-memory`, 2 GiB by default). On a GPU it is allocated on the device, zeroed."""

from __future__ import annotations

import math
import mmap

import torch

from conveyor.core.backends.step import KVLayout

_ALIGN = 64  # bytes: each layer's tensor starts on a cache line (the kernels' vector loads)


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
        # Zeros, never uninitialised memory: masked-out slots still enter attention's weighted sum with weight 0,
        # and 0 * NaN from garbage would poison the output.
        shapes = [key_shape, value_shape] * num_layers
        tensors = _lazy_zeros(shapes, dtype) if torch.device(device).type == "cpu" else \
            [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.keys = tensors[0::2]
        self.values = tensors[1::2]


def _lazy_zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zero tensors of `shapes` in one anonymous memory map (its pages are the kernel's zero page until written)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    region = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # holds the map: it lives as long as a view of it
    return [flat[offset:offset + size].view(dtype).view(shape)
            for offset, size, shape in zip(offsets, sizes, shapes)]
