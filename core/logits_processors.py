"""(torch) The logits-processor seam: an ordered list of edits of the logits, each applied to the rows whose
request asks for it, before sampling (the C++ pass or torch's, the same edits for both).

    MinTokens    EOS and stop token ids banned until min_tokens tokens exist
    BadWords     the last token of a bad word banned where the output ends with the rest of it
    LogitBias    OpenAI's logit_bias, added
    Penalties    presence / frequency over the generated tokens, repetition over prompt and generated ones
    GrammarMask  every token the request's grammar does not allow next banned (structured outputs), once its
                 reasoning section (if any) has ended

`Processors.plan(entries, states)` finds each processor's rows once per step; a step whose rows ask for
nothing costs one pass over its entries' sampling params and no tensor work. Per-request state (token
counts, the grammar matcher: `logits_state.LogitsState`) is read here and advanced only by the scheduler
when it accepts a token. Every edit reads a row's own logits and state only, so it keeps the exactness
contract. A row whose edit raises (its request's data broke a processor) is reported as failed, with what
failed; the other rows go on, and the engine ends that request as an error instead of the run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from conveyor.core.errors import failure
from conveyor.core.logits_state import LogitsState
from conveyor.core.schedule_types import ScheduledRequest


class LogitsProcessor:
    def wants(self, entry: ScheduledRequest, state: LogitsState | None) -> bool:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, rows: list[int], entries: Sequence[ScheduledRequest],
              states: Sequence[LogitsState | None], failed: dict[int, str]) -> None:
        """Edit logits[rows] in place, a row at a time; a row whose edit raises goes to `failed` (row -> what
        failed) and the others go on."""
        for i in rows:
            try:
                self.apply_row(logits, i, entries[i], states[i])
            except Exception as e:  # noqa: BLE001 - one request's data, never the run's
                failed[i] = failure(type(self).__name__, e)

    def apply_row(self, logits: torch.Tensor, i: int, entry: ScheduledRequest, state: LogitsState | None) -> None:
        raise NotImplementedError


class MinTokens(LogitsProcessor):
    def __init__(self, eos_token_ids: Collection[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def wants(self, entry, state) -> bool:
        return entry.num_output_tokens < entry.sampling.min_tokens

    def apply_row(self, logits, i, entry, state) -> None:
        s = entry.sampling
        banned = list(s.stop_token_ids) + ([] if s.ignore_eos else list(self.eos_token_ids))
        if banned:
            logits[i, banned] = float("-inf")


class BadWords(LogitsProcessor):
    def wants(self, entry, state) -> bool:
        return bool(entry.sampling.bad_words)

    def apply_row(self, logits, i, entry, state) -> None:
        tail = state.tail if state is not None else ()
        banned = [w[-1] for w in entry.sampling.bad_words
                  if len(w) == 1 or (len(w) - 1 <= len(tail) and tuple(tail[len(tail) - len(w) + 1:]) == w[:-1])]
        if banned:
            logits[i, banned] = float("-inf")


class LogitBias(LogitsProcessor):
    def wants(self, entry, state) -> bool:
        return bool(entry.sampling.logit_bias)

    def apply_row(self, logits, i, entry, state) -> None:
        pairs = entry.sampling.logit_bias
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        logits[i, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype)


class Penalties(LogitsProcessor):
    def wants(self, entry, state) -> bool:
        s = entry.sampling
        return bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)

    def apply_row(self, logits, i, entry, state) -> None:
        s = entry.sampling
        if s.repetition_penalty != 1.0 and state.seen:
            ids = torch.tensor(sorted(state.seen), dtype=torch.long)
            x = logits[i, ids]
            logits[i, ids] = torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty)
        if (s.presence_penalty or s.frequency_penalty) and state.counts:
            ids = torch.tensor(sorted(state.counts), dtype=torch.long)
            counts = torch.tensor([state.counts[t] for t in ids.tolist()], dtype=torch.float32)
            penalty = s.frequency_penalty * counts + s.presence_penalty
            logits[i, ids] = (logits[i, ids].float() - penalty).to(logits.dtype)


class GrammarMask(LogitsProcessor):
    def __init__(self, apply_bitmask=None) -> None:
        # the cpu backend's C++ kernel (logits, bitmask, rows; its logits are on the CPU), or None: torch below
        self.apply_bitmask = apply_bitmask

    def wants(self, entry, state) -> bool:
        return entry.sampling.grammar is not None and state.answering

    def apply(self, logits, rows, entries, states, failed) -> None:
        """Each row's allowed tokens from its own matcher (a matcher that raises fails its row), then one masking
        pass over the rows that have theirs."""
        vocab = logits.shape[1]
        bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
        filled = []
        for i in rows:
            try:
                states[i].matcher.fill_next_token_bitmask(bitmask, len(filled))
            except Exception as e:  # noqa: BLE001 - one request's grammar, never the run's
                failed[i] = failure(type(self).__name__, e)
                continue
            filled.append(i)
        if not filled:
            return
        bitmask = bitmask[:len(filled)]
        if self.apply_bitmask is not None:
            self.apply_bitmask(logits, bitmask, torch.tensor(filled, dtype=torch.long))
        else:
            shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
            allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(filled), -1)[:, :vocab].bool()
            index = torch.tensor(filled, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


class Processors:
    """The ordered seam; one instance per engine."""

    def __init__(self, eos_token_ids: Collection[int], apply_bitmask=None) -> None:
        self.order: tuple[LogitsProcessor, ...] = (MinTokens(eos_token_ids), BadWords(), LogitBias(), Penalties(),
                                                   GrammarMask(apply_bitmask))

    def plan(self, entries: Sequence[ScheduledRequest], states: Sequence[LogitsState | None]
             ) -> list[tuple[LogitsProcessor, list[int]]]:
        """Each processor with the rows it applies to this step (processors with none left out)."""
        planned = []
        if not any(e.sampling.has_processors for e in entries):
            return planned
        for processor in self.order:
            rows = [i for i, (e, st) in enumerate(zip(entries, states)) if processor.wants(e, st)]
            if rows:
                planned.append((processor, rows))
        return planned

    def apply(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest],
              states: Sequence[LogitsState | None]) -> dict[int, str]:
        """Every processor's edits, in order; returns the rows that failed (row -> what failed), which later
        processors skip."""
        failed: dict[int, str] = {}
        for processor, rows in self.plan(entries, states):
            if failed:
                rows = [i for i in rows if i not in failed]
            processor.apply(logits, rows, entries, states, failed)
        return failed
