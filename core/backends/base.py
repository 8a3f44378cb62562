"""(torch) The backend seam: what differs between devices, behind one interface the model runner calls.

A backend owns
- the KV pool's layout (`kv_layout`) and how much memory the pool may take (`kv_budget`);
- the per-step metadata built from the scheduler's plan (`prepare`: `StepRows` of plain lists in, a
  `Step` of device tensors out, whose `attention` stores each layer's new K/V and attends through the pool);
- the forward pass (`forward`: a `Step` in, logits at its logit rows out);
- the sampler's device ops (`sampler_ops`), whether it meets the exactness contract (`exact`,
  `conveyor.core.exactness`) and what the engine's warning says where it does not (`inexact_reason`, `note`);
- waiting for its device (`synchronize`, for the runner's profiling).
The model's shape (`ModelShape`: layers, heads, sizes, context) is read from its config here, once.

The model runner and the engine know no kernel: they ask their backend. Backends: `cpu` (conveyor's C++
kernels and fused forward), `cuda` (Triton paged attention, CUDA graphs), `torch` (plain torch: SDPA
over gathered K/V, any device, the reference everything else is checked against).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from conveyor.core.config import DEFAULT_KV_CACHE_MEMORY, parse_memory
from conveyor.core.model_shape import ModelShape
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


@dataclass(frozen=True)
class SamplerOps:
    """The sampler's faster exact routines for this device, or None for torch's (see `core/sampler.py`)."""

    argmax: Callable | None = None
    sample_rows: Callable | None = None
    apply_bitmask: Callable | None = None


class Backend(ABC):
    name: str = "?"
    exact: bool = False  # meets the exactness contract
    # Keys its attention may read below a sliding window's first key: a multiple of this (its vector lanes, its
    # tiles); None where it reads every key up to the query (the pool's blocks out of a window cannot be given back).
    window_alignment: int | None = None

    def __init__(self, model: torch.nn.Module) -> None:
        from conveyor.core.backends.attention_probe import probe_attention
        from conveyor.core.backends.transformers_forward import register
        from conveyor.core.model_support import check_supported

        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        register(model)  # the model's own forward runs with conveyor's attention (the probe; the transformers route)
        # Each layer's attention as the model defines it (UnsupportedModel where conveyor would not compute it so),
        # and the K/V shapes its layers store, which the pool takes over the config's guess.
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        check_supported(model.config, name)  # what the loader refuses before the weights, for a model handed over
        self.attention = probe_attention(model, name)
        self.shape = dataclasses.replace(ModelShape.of(model), num_kv_heads=self.attention.num_kv_heads,
                                         head_dim=self.attention.head_dim)

    @abstractmethod
    def kv_layout(self, head_dim: int, block_size: int, group: int) -> KVLayout:
        """The pool layout for this model shape (group: query heads per KV head)."""

    def kv_budget(self, kv_cache_memory: int | None, gpu_memory_utilization: float | None) -> int:
        """Bytes the KV pool may take: `kv_cache_memory` where given, else the backend's default
        (DEFAULT_KV_CACHE_MEMORY; on a GPU, what `gpu_memory_utilization` of its memory leaves free)."""
        return kv_cache_memory if kv_cache_memory is not None else parse_memory(DEFAULT_KV_CACHE_MEMORY)

    def spare_blocks(self) -> int:
        """Pool blocks the backend keeps for itself beyond the block manager's (padding rows' scratch)."""
        return 0

    def bind(self, kv_cache) -> None:
        """Called once with the engine's pool, before the first step."""
        self.kv_cache = kv_cache

    @abstractmethod
    def prepare(self, rows: StepRows) -> Step:
        """The step's tensors and attention metadata on the device."""

    @abstractmethod
    def forward(self, step: Step) -> torch.Tensor:
        """Logits [len(step.rows.logit_rows), vocab] of the step's logit rows."""

    def sampler_ops(self) -> SamplerOps:
        return SamplerOps()

    def inexact_reason(self) -> str | None:
        """Why this backend does not meet the exactness contract, or None where it does."""
        from conveyor.core.exactness import inexact_reason

        return None if self.exact else inexact_reason(self.name)

    def note(self) -> str | None:
        """What the engine's one-line warning about an inexact backend adds after its name (why a faster exact
        backend does not run here), or None."""
        return None

    def synchronize(self) -> None:
        """Wait for the device's queued work (for honest timings): a CUDA device's; nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        return self.name

    def cpu_isa(self) -> str | None:
        """The instructions of conveyor's CPU kernels this backend runs ("amx", "avx512bf16", "avx512", "avx2"); None
        where it runs none."""
        return None

    def arithmetic(self) -> str:
        """What, beyond the model and the run's settings, decides a row's bits here: the kernels and the device
        they run on. A run resumed where this differs can differ in bits from an uninterrupted one (it says so)."""
        return self.describe()


def tensor(values: list, device: torch.device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)
