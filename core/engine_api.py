"""What every engine offers the run (the generation `Engine` and the `PoolingEngine` alike): `InferenceEngine`, and
the figures it reports (`EngineStats`, `EngineInfo`). Pure Python: io types its engine with it without importing
torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.core.outputs import InFlight, ModelLimits


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_computed_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    num_forward_steps: int = 0  # steps that ran a forward pass (num_steps also counts those with nothing to run)
    num_scheduled_rows: int = 0  # requests scheduled, summed over those steps: / num_forward_steps = mean running
    num_draft_tokens: int = 0  # speculative decoding: draft tokens fed ...
    num_accepted_draft_tokens: int = 0  # ... and accepted (equal to the token sampled there)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine runs (`Engine.info`): its model, dtype and backend, and the limits it runs under."""

    model_path: str | None  # where the weights loaded from (the model config's name_or_path: a folder, a hub id)
    dtype: str  # the weights' dtype, as the engine's config resolved it
    backend: str
    max_num_seqs: int  # requests a step runs at most
    max_num_batched_tokens: int  # tokens a step's forward pass holds at most
    max_model_len: int  # tokens a request may hold, prompt and output
    batch_invariant: bool  # whether it meets the exactness contract (a record's bits whatever its batch)
    cpu_isa: str | None = None  # the instructions of the cpu kernels it runs (kernels.cpu_isa); None off them


class InferenceEngine(Protocol):
    """An engine as `run_records` and `Run` use it: requests in, outputs out, step by step."""

    tokenizer: Any  # the model's (transformers) tokenizer: the builders tokenize with it
    limits: ModelLimits  # what a request must fit: the context, the vocabulary
    labels: tuple[str, ...]  # a classifier's label per class (the rows name them); () for the other tasks

    def stream(self, requests: Iterable[Any]) -> Iterator[list[Any]]:
        """Each step's finished outputs, the requests pulled lazily (at most the engine's backpressure bound wait)."""
        ...

    def in_flight(self) -> dict[str, InFlight]:
        """What the running requests have generated so far (a stop saves it; a resume continues from it)."""
        ...

    def stats(self) -> EngineStats: ...

    def info(self) -> EngineInfo: ...

    def arithmetic(self) -> str:
        """What decides a result's bits here beyond the model and the settings: the route and the kernels."""
        ...

    def enable_profiling(self) -> None: ...

    def profile(self) -> dict[str, float]: ...
