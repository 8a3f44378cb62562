"""(torch) The CPU's fused decoder forward over whole sequences, for the pooling tasks: exact.

An embedding or classification step keeps no KV cache between steps: its sequences are written into a scratch pool
(every layer, blocks of their own), each row attends causally to its own sequence's keys, and the hidden states of
the rows asked for come out after the final norm (`FusedDecoder.hidden`). The arithmetic is the generation
engine's, so a sequence's hidden states are the same bits alone or packed with any others.
"""

from __future__ import annotations

import torch

from conveyor.core.backends.attention_probe import probe_attention
from conveyor.core.backends.cpu.backend import LAYOUTS, CpuAttention, kv_layout
from conveyor.core.backends.cpu.fused_decoder import FusedDecoder
from conveyor.core.backends.transformers_forward import register
from conveyor.core.kv_cache import KVCache
from conveyor.core.pooling_params import TokenSequence

BLOCK = 16  # tokens per block of the scratch pool


class PackedDecoder:
    """Callable: (sequences, rows of the packed step to return) -> their hidden states [len(rows), hidden]."""

    def __init__(self, fused: FusedDecoder, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 ops) -> None:
        self.fused = fused
        self.ops = ops
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype = dtype
        self.layout = LAYOUTS[kv_layout(dtype, head_dim, BLOCK, fused.plan.num_heads // kv_heads)]
        self.pool: KVCache | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, name: str, ops) -> tuple[PackedDecoder | None, str | None]:
        """(the packed forward of `model`, None), or (None, why not); UnsupportedModel where its attention is one
        conveyor does not compute."""
        if ops is None:
            return None, "conveyor's C++ kernels are not built here"
        register(model)
        attention = probe_attention(model, name)
        fused, why = FusedDecoder.build(model, attention, ops)
        if fused is None:
            return None, why
        dtype = next(model.parameters()).dtype
        return cls(fused, len(attention.layers), attention.num_kv_heads, attention.head_dim, dtype, ops), None

    def _scratch(self, blocks: int) -> KVCache:
        if self.pool is None or self.pool.num_blocks < blocks:
            layers, heads, dim = self.shape
            self.pool = KVCache(layers, heads, dim, max(blocks, 64), BLOCK, self.dtype, torch.device("cpu"),
                                self.layout)
        return self.pool

    @torch.inference_mode()
    def __call__(self, sequences: list[TokenSequence], rows: list[int]) -> torch.Tensor:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_req: list[int] = []
        tables: list[list[int]] = []
        block = 0
        width = max(-(-len(s.token_ids) // BLOCK) for s in sequences)
        for r, s in enumerate(sequences):
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            positions.extend(range(n))
            slots.extend(range(block * BLOCK, block * BLOCK + n))
            token_req.extend([r] * n)
            used = -(-n // BLOCK)
            tables.append(list(range(block, block + used)) + [0] * (width - used))
            block += used
        pool = self._scratch(block)
        long = torch.long
        pos = torch.tensor(positions, dtype=long)
        batch = CpuAttention(self.ops, pool, torch.tensor(slots, dtype=long), torch.tensor(tables, dtype=long),
                             torch.tensor(token_req, dtype=long), pos + 1)
        return self.fused.hidden(torch.tensor(ids, dtype=long), pos, batch, torch.tensor(rows, dtype=long))
