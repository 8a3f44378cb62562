"""(torch) The backend seam: what differs between devices, behind one interface the model runner calls.

A backend owns
- the KV pool's layout (`kv_layout`) and how much memory the pool may take (`kv_budget`);
- the per-step metadata built from the scheduler's plan (`prepare`: `StepRows` of plain lists in, a
  `Step` of device tensors out, whose `attention` stores each layer's new K/V and attends through the pool);
- the forward pass (`forward`: a `Step` in, logits at its logit rows out);
- the sampler's device ops (`sampler_ops`), whether it meets the exactness contract (`exact`,
  `conveyor.core.exactness`) and what the engine's warning says where it does not (`inexact_reason`, `note`);
- waiting for its device (`synchronize`, for the runner's profiling).
The model's shape (`ModelShape`: layers, heads, sizes, context) is read from its config here, once, with the K/V
shapes of the model's attention (`attention_probe`, which `select_backend` runs before a backend is made and hands
to it). The step's types (`StepRows`, `Step`, `StepAttention`, `KVLayout`, `SamplerOps`) are `step.py`'s.

The model runner and the engine know no kernel: they ask their backend. Backends: `cpu` (conveyor's C++
kernels and fused forward), `cuda` (Triton paged attention, CUDA graphs), `torch` (plain torch: SDPA
over gathered K/V, any device, the reference everything else is checked against).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.backends.step import KVLayout, SamplerOps, Step, StepRows
from conveyor.core.config import DEFAULT_KV_CACHE_MEMORY, parse_memory
from conveyor.core.model_shape import ModelShape


class Backend(ABC):
    name: str = "?"
    exact: bool = False  # meets the exactness contract
    # Keys its attention may read below a sliding window's first key: a multiple of this (its vector lanes, its
    # tiles); None where it reads every key up to the query (the pool's blocks out of a window cannot be given back).
    window_alignment: int | None = None

    def __init__(self, model: torch.nn.Module, attention: ModelAttention) -> None:
        """`attention`: each layer's attention as the model's own forward defines it (`attention_probe`, run by
        `select_backend` with the model switched to "conveyor_paged" attention); the K/V shapes its layers store
        are what the pool takes over the config's guess."""
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.attention = attention
        self.shape = dataclasses.replace(ModelShape.of(model), num_kv_heads=attention.num_kv_heads,
                                         head_dim=attention.head_dim)

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
