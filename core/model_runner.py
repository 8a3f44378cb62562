"""(torch) SchedulerOutput -> one flat forward pass on the engine's backend -> logits at sample positions ->
RunnerOutput.

Receives a backend (which owns the device, the KV pool's layout, the step's metadata and the forward) and
plain plan data; never a path, a record or a Request, and no kernel.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
import time
from collections.abc import Collection

import torch

from conveyor.core.backends.base import Backend
from conveyor.core.backends.step import StepRows
from conveyor.core.logits_state import LogitsState
from conveyor.core.logprobs import token_logprobs
from conveyor.core.sampler import Sampler
from conveyor.core.sampling_params import SamplingParams
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


def _given_embeddings(entry: ScheduledRequest, row: int, rows: list[int], values: list) -> None:
    """Append the step rows of `entry` (its first at `row`) whose embedding its request gives, and those embeddings
    (one slice of its PromptEmbeds' rows): its positions inside this chunk (a chunk may begin or end inside an
    image's tokens)."""
    embeds = entry.prompt_embeds
    first = bisect.bisect_left(embeds.positions, entry.start_pos)
    end = bisect.bisect_left(embeds.positions, entry.start_pos + entry.num_tokens - entry.num_drafts)
    if end > first:
        shift = row - entry.start_pos
        rows.extend(p + shift for p in embeds.positions[first:end])
        values.append(embeds.values[first:end])


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
        """One forward pass and the sampler over its sampled rows (position by position where a request carries
        draft tokens: `_verify`); `states` holds the logits-processor state of the requests that have one (by
        req_id)."""
        if plan.is_empty:
            return RunnerOutput(sampled_token_ids={})
        profiling = self.timings is not None
        t = time.perf_counter() if profiling else 0.0
        rows = self.flatten(plan.scheduled)
        step = self.backend.prepare(rows)
        if rows.embed_rows:
            step.embeds = (torch.tensor(rows.embed_rows, dtype=torch.long, device=self.device),
                           torch.cat(rows.embed_values).to(self.device))
        if profiling:
            t = self._tick("prepare_s", t)
        logits = self.backend.forward(step)
        if profiling:
            t = self._tick("forward_s", t)
        num_sampled, num_drafts = rows.num_sampled, rows.num_draft_rows
        first_prompt = num_sampled + num_drafts
        prompt_logprobs = (self._prompt_logprobs(plan.scheduled, logits[first_prompt:])
                           if len(rows.logit_rows) > first_prompt else {})
        sampled_entries = [e for e in plan.scheduled if e.sample]
        row_states = [states.get(e.req_id) for e in sampled_entries] if states else None
        token_ids, logprobs, failed = self.sampler.sample(logits[:num_sampled], sampled_entries, row_states)
        tokens = {e.req_id: [t] for e, t in zip(sampled_entries, token_ids)}
        found = {req_id: [lp] for req_id, lp in logprobs.items()}
        if num_drafts:
            self._verify(logits[num_sampled:first_prompt], sampled_entries, states or {}, tokens, found, failed)
        if profiling:
            self._tick("sample_s", t)
        return RunnerOutput(sampled_token_ids=tokens, logprobs=found, prompt_logprobs=prompt_logprobs, failed=failed)

    def _verify(self, logits: torch.Tensor, entries: list[ScheduledRequest], states: dict[str, LogitsState],
                tokens: dict[str, list[int]], found: dict[str, list], failed: dict[str, str]) -> None:
        """The draft rows of the step (`logits`: each drafting entry's rows, in entry order), position by position:
        the row after a request's i-th draft token is sampled only where the token sampled before it equalled that
        draft token (so it is the request's true context), with the request's output index and its processors'
        state as they would be there (the state forked and advanced over the accepted tokens, never the request's
        own). Its tokens, logprobs and failures are appended to `tokens`, `found` and `failed`."""
        live = []  # (entry, its first draft row, its draft tokens, its forked state or None)
        at = 0
        for e in entries:
            if e.num_drafts:
                draft = e.token_ids[-e.num_drafts:]
                if e.req_id not in failed and tokens[e.req_id][0] == draft[0]:
                    state = states.get(e.req_id)
                    live.append((e, at, draft, None if state is None else state.fork()))
                at += e.num_drafts
        i = 1
        while live:
            for _, _, draft, state in live:
                if state is not None:
                    state.accept(draft[i - 1])
            # (a grammar that ends at the accepted token ends the request there: nothing is sampled after it)
            live = [x for x in live if x[3] is None or not x[3].grammar_done]
            if not live:
                break
            rows, views, row_states = [], [], []
            for e, first, _, state in live:
                rows.append(first + i - 1)
                views.append(dataclasses.replace(e, num_output_tokens=e.num_output_tokens + i))
                row_states.append(state)
            got, logprobs, why = self.sampler.sample(logits[rows], views, row_states)
            failed.update(why)
            still = []
            for (e, first, draft, state), token in zip(live, got):
                if e.req_id in why:
                    continue
                tokens[e.req_id].append(token)
                if e.req_id in logprobs:
                    found[e.req_id].append(logprobs[e.req_id])
                if i < len(draft) and token == draft[i]:
                    still.append((e, first, draft, state))
            live = still
            i += 1

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
        """The step as plain lists: token ids, positions, slots, and the rows whose logits are wanted (each sampled
        entry's first sampled row, then the rows after its draft tokens, then the rows whose logits give prompt
        logprobs, in entry order)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        draft_rows: list[int] = []
        prompt_rows: list[int] = []
        embed_rows: list[int] = []
        embed_values: list = []
        for e in entries:
            row = len(input_ids)
            if e.prompt_embeds is not None:
                _given_embeddings(e, row, embed_rows, embed_values)
            input_ids.extend(e.token_ids)
            pos = range(e.start_pos, e.start_pos + e.num_tokens)
            positions.extend(pos)
            table = e.block_ids
            slots.extend([table[p // bs] * bs + p % bs for p in pos])
            if e.sample:
                last = row + e.num_tokens - e.num_drafts - 1  # its last own token
                sample_rows.append(last)
                draft_rows.extend(range(last + 1, last + 1 + e.num_drafts))
            prompt_rows.extend(range(row, row + len(e.prompt_targets)))
        return StepRows(entries, input_ids, positions, slots, sample_rows + draft_rows + prompt_rows,
                        len(sample_rows), len(draft_rows), embed_rows, embed_values)

    @torch.inference_mode()
    def measure_rows(self, row_counts: list[int], context: int, num_blocks: int, repeats: int = 2) -> list[float]:
        """Seconds of one forward pass of n decode rows, each at `context` keys, for each n of `row_counts` (the
        fastest of `repeats`, after one warm-up). Run before any request: the rows write into the first blocks of
        the pool, which hold nothing yet."""
        bs = self.block_size
        context = max(1, min(context, num_blocks * bs))
        table = tuple(range(-(-context // bs)))
        entry = ScheduledRequest(req_id="", token_ids=(0,), start_pos=context - 1, block_ids=table, sample=True,
                                 sampling=SamplingParams(), num_output_tokens=1)
        out = []
        for n in row_counts:
            rows = self.flatten([dataclasses.replace(entry, req_id=str(i)) for i in range(n)])
            best = float("inf")
            for r in range(repeats + 1):
                t = time.perf_counter()
                self.backend.forward(self.backend.prepare(rows))
                self.backend.synchronize()
                if r:
                    best = min(best, time.perf_counter() - t)
            out.append(best)
        return out
