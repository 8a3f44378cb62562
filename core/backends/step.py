"""(torch) A step's types, shared by every backend and the model runner: the KV pool's layout (`KVLayout`, `FLASH`),
a step flattened to plain lists (`StepRows`), its device tensors and attention metadata (`Step`, `StepAttention`),
and the sampler's device ops (`SamplerOps`). No backend, no model: the backends (`base.py`), the pool
(`core/kv_cache.py`) and the transformers route (`transformers_forward.py`) all read them from here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from conveyor.core.schedule_types import ScheduledRequest


@dataclass(frozen=True)
class KVLayout:
    """Shapes of one layer's key and value tensors in a pool of `num_blocks` blocks."""

    name: str
    key_shape: Callable[[int, int, int, int], tuple[int, ...]]  # (num_blocks, block_size, kv_heads, head_dim)
    value_shape: Callable[[int, int, int, int], tuple[int, ...]]


# keys and values alike [num_blocks, block_size, kv_heads, head_dim]: a token slot's K (or V) is one row
# of a [num_blocks * block_size, kv_heads, head_dim] view. The torch and CUDA backends read it.
FLASH = KVLayout("flash", lambda n, bs, h, d: (n, bs, h, d), lambda n, bs, h, d: (n, bs, h, d))


def flash_rows(kv_cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A FLASH pool's keys and values of `layer` as [slots, kv_heads, head_dim] views: one row per token slot."""
    k, v = kv_cache.keys[layer], kv_cache.values[layer]
    return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


def store_flash(kv_cache, layer: int, slot_mapping: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Write the step's new keys / values [T, kv_heads, head_dim] into a FLASH pool's rows `slot_mapping` [T]."""
    k, v = flash_rows(kv_cache, layer)
    k.index_copy_(0, slot_mapping, k_new.to(k.dtype))
    v.index_copy_(0, slot_mapping, v_new.to(v.dtype))


def padded_tables(tables: Sequence[Sequence[int]], width: int | None = None) -> list[list[int]]:
    """Block tables as rows of one width (`width`, else the longest table's): cut to it, padded with block 0. A
    padding entry is never read: a row's keys end before it. An entry given back (NULL_BLOCK: out of every layer's
    window) reads as block 0 too, and is never read either (`Backend.window_alignment`)."""
    if width is None:
        width = max(len(t) for t in tables)
    out = []
    for t in tables:
        row = list(t[:width])
        if row and row[0] < 0:  # (entries given back are a prefix of a table)
            row = [max(b, 0) for b in row]
        row.extend([0] * (width - len(row)))
        out.append(row)
    return out


@dataclass
class StepRows:
    """One step flattened, as plain lists (built by the model runner from the plan, the same for every
    backend): the step's rows are the scheduled entries' tokens, in entry order."""

    entries: list[ScheduledRequest]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each row's K/V goes: block_id * block_size + offset
    logit_rows: list[int]  # rows whose logits are wanted: the sampled ones, draft rows, then prompt-logprob rows
    num_sampled: int  # logit_rows[:num_sampled] are sampled (one per sampled entry)
    num_draft_rows: int = 0  # logit_rows[num_sampled:num_sampled + this]: the rows after draft tokens
    # Rows whose embedding is given (a prompt's image positions), and their embeddings: [n, hidden] tensors, one per
    # entry that has any, whose rows follow embed_rows in order
    embed_rows: list[int] = field(default_factory=list)
    embed_values: list = field(default_factory=list)


class StepAttention(ABC):
    """Per-step attention metadata, shared by every layer."""

    @abstractmethod
    def store(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the step's new keys / values [T, kv_heads, head_dim] into the pool at their slots."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, heads, head_dim] (already stored: k_new / v_new) -> each row attending to its request's keys
        up to its own position (its last `window` keys only, where given), [T, heads, head_dim] in q's dtype:
        softmax(scale * q.k) v, the scores capped to softcap * tanh(scores / softcap) where `softcap` is given,
        and `sinks` ([heads] float32: a logit per query head) in each softmax's denominator where given
        (`core/attention_spec.py`)."""


@dataclass
class Step:
    """One step on the device: what `Backend.forward` reads."""

    rows: StepRows
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logit_rows: torch.Tensor  # [L]
    attention: StepAttention
    extra: dict = field(default_factory=dict)  # backend-specific
    # (rows [E], embeddings [E, hidden]) given in place of those rows' token embeddings, or None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


def with_embeds(h: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The step's token embeddings `h` [T, hidden] with the given rows' embeddings in place (in `h`'s dtype)."""
    if embeds is not None:
        rows, values = embeds
        h.index_copy_(0, rows, values.to(h.dtype))
    return h


@dataclass(frozen=True)
class SamplerOps:
    """The sampler's faster exact routines for this device, or None for torch's (see `core/sampler.py`)."""

    argmax: Callable | None = None
    sample_rows: Callable | None = None
    apply_bitmask: Callable | None = None


def tensor(values: list, device: torch.device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)
