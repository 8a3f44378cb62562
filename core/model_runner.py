"""(torch) SchedulerOutput -> one flat forward pass on the engine's backend -> logits at sample positions ->
RunnerOutput.

Receives a backend (which owns the device, the KV pool's layout, the step's metadata and the forward) and
plain plan data; never a path, a record or a Request, and no kernel.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection

import torch

from conveyor.core.backends.base import Backend, StepRows
from conveyor.core.logits_state import LogitsState
from conveyor.core.logprobs import token_logprobs
from conveyor.core.sampler import Sampler
from conveyor.core.schedule_types import RunnerOutput, ScheduledRequest, SchedulerOutput

_warned_inexact: set[str] = set()


def _warn_inexact(backend: Backend) -> None:
    """One line on stderr, once per process and backend, where the engine takes a backend that does not meet
    the exactness contract."""
    if backend.name in _warned_inexact:
        return
    _warned_inexact.add(backend.name)
    note = backend.note()
    why = f" ({note})" if note else ""
    sys.stderr.write(f"conveyor: the {backend.name} backend{why} is not batch-invariant: "
                     f"{backend.inexact_reason()}\n")


class ModelRunner:
    def __init__(self, backend: Backend, kv_cache, eos_token_ids: Collection[int]) -> None:
        self.backend = backend
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = backend.device
        backend.bind(kv_cache)
        ops = backend.sampler_ops()
        self.sampler = Sampler(eos_token_ids, argmax=ops.argmax, sample_rows=ops.sample_rows,
                               apply_bitmask=ops.apply_bitmask)
        if not backend.exact:
            _warn_inexact(backend)
        self.timings: dict[str, float] | None = None  # seconds per phase, when profiling

    def enable_profiling(self) -> None:
        self.timings = {"prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}

    def _tick(self, key: str, since: float) -> float:
        """Charge the time since `since` to `key`; waits for the device so the split is honest."""
        self.backend.synchronize()
        now = time.perf_counter()
        self.timings[key] += now - since
        return now

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, states: dict[str, LogitsState] | None = None) -> RunnerOutput:
        """One forward pass and one sampler call; `states` holds the logits-processor state of the requests that
        have one (by req_id)."""
        if plan.is_empty:
            return RunnerOutput(sampled_token_ids={})
        profiling = self.timings is not None
        t = time.perf_counter() if profiling else 0.0
        rows = self.flatten(plan.scheduled)
        step = self.backend.prepare(rows)
        if profiling:
            t = self._tick("prepare_s", t)
        logits = self.backend.forward(step)
        if profiling:
            t = self._tick("forward_s", t)
        num_sampled = rows.num_sampled
        prompt_logprobs = (self._prompt_logprobs(plan.scheduled, logits[num_sampled:])
                           if len(rows.logit_rows) > num_sampled else {})
        sampled_entries = [e for e in plan.scheduled if e.sample]
        row_states = [states.get(e.req_id) for e in sampled_entries] if states else None
        token_ids, logprobs, failed = self.sampler.sample(logits[:num_sampled], sampled_entries, row_states)
        if profiling:
            self._tick("sample_s", t)
        return RunnerOutput(sampled_token_ids={e.req_id: t for e, t in zip(sampled_entries, token_ids)},
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs, failed=failed)

    @staticmethod
    def _prompt_logprobs(entries: list[ScheduledRequest], logits: torch.Tensor) -> dict:
        """The logprobs of each chunk's prompt targets, from their rows' logits (in entry order)."""
        out = {}
        at = 0
        for e in entries:
            n = len(e.prompt_targets)
            if n:
                found = token_logprobs(logits[at:at + n], e.prompt_targets, [e.sampling.prompt_logprobs] * n)
                out[e.req_id] = (e.start_pos + 1, found)
                at += n
        return out

    def flatten(self, entries: list[ScheduledRequest]) -> StepRows:
        """The step as plain lists: token ids, positions, slots, and the rows whose logits are wanted (sampled
        rows first, then the rows whose logits give prompt logprobs, in entry order)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        for e in entries:
            row = len(input_ids)
            input_ids.extend(e.token_ids)
            pos = range(e.start_pos, e.start_pos + e.num_tokens)
            positions.extend(pos)
            table = e.block_ids
            slots.extend([table[p // bs] * bs + p % bs for p in pos])
            if e.sample:
                sample_rows.append(row + e.num_tokens - 1)
            prompt_rows.extend(range(row, row + len(e.prompt_targets)))
        return StepRows(entries, input_ids, positions, slots, sample_rows + prompt_rows, len(sample_rows))
