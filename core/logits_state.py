"""Per-request state of the logits processors: what they need to know of the tokens so far. Pure Python.

It advances only when the scheduler accepts a sampled token (`accept`), and it depends only on the
request's prompt and accepted output tokens. Preemption by recompute keeps those tokens, so the state
stays valid across it; chunked prefill and prefix caching never touch it; a resumed run starts the
request afresh, state and all. Where the output has a reasoning section, the state also knows whether its
end tag has been generated (`answering`): the grammar matcher takes no token before. So a record's
processed logits are a function of its tokens, like the logits themselves.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from conveyor.core.sampling_params import SamplingParams


class LogitsState:
    __slots__ = ("counts", "seen", "tail", "tail_len", "matcher", "grammar_failed", "reasoning_end", "recent",
                 "num_output", "answer_start")

    def __init__(self, sampling: SamplingParams, prompt_token_ids: list[int], matcher: Any = None) -> None:
        self.counts: Counter[int] | None = (Counter() if sampling.presence_penalty or sampling.frequency_penalty
                                            else None)  # generated tokens, for presence / frequency
        self.seen: set[int] | None = set(prompt_token_ids) if sampling.repetition_penalty != 1.0 else None
        self.tail_len = max((len(w) - 1 for w in sampling.bad_words), default=0)
        self.tail: list[int] = []  # the last tail_len generated tokens, for bad words of several tokens
        self.matcher = matcher  # xgrammar.GrammarMatcher, or None
        self.grammar_failed = False  # the grammar refused a token (nothing was allowed): the request stops
        # A reasoning section (core/reasoning.py): the grammar and stop strings wait for its end tag's tokens
        reasoning = sampling.reasoning
        self.reasoning_end = () if reasoning is None else reasoning.end_ids
        self.answer_start: int | None = 0 if reasoning is None or reasoning.ended_in(prompt_token_ids) else None
        self.recent: list[int] = []  # the last len(reasoning_end) tokens, while reasoning
        self.num_output = 0  # output tokens accepted

    @classmethod
    def needed(cls, sampling: SamplingParams) -> bool:
        return bool(sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0
                    or sampling.grammar is not None or any(len(w) > 1 for w in sampling.bad_words)
                    or sampling.reasoning is not None)

    def accept(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen.add(token)
        if self.tail_len:
            self.tail.append(token)
            del self.tail[:-self.tail_len]
        self.num_output += 1
        if self.answer_start is None:  # still reasoning: the grammar starts after the end tag
            self.recent.append(token)
            del self.recent[:-len(self.reasoning_end)]
            if tuple(self.recent) == self.reasoning_end:
                self.answer_start = self.num_output
            return
        if self.matcher is not None and not self.matcher.is_terminated():
            if not self.matcher.accept_token(token):
                self.grammar_failed = True

    def fork(self) -> LogitsState:
        """A copy that accepts tokens on its own (a step's draft tokens, tried position by position), leaving this
        state as it is."""
        other = LogitsState.__new__(LogitsState)
        other.counts = None if self.counts is None else Counter(self.counts)
        other.seen = None if self.seen is None else set(self.seen)
        other.tail_len, other.tail = self.tail_len, list(self.tail)
        other.matcher = None if self.matcher is None else self.matcher.fork()
        other.grammar_failed = self.grammar_failed
        other.reasoning_end, other.answer_start, other.recent = self.reasoning_end, self.answer_start, list(self.recent)
        other.num_output = self.num_output
        return other

    @property
    def answering(self) -> bool:
        """Whether the output is past its reasoning (always, without one): its grammar and stop strings apply."""
        return self.answer_start is not None

    @property
    def grammar_done(self) -> bool:
        """The output is complete under its grammar (the matcher took its stop token), or the grammar can go no
        further: the request stops."""
        return self.matcher is not None and (self.matcher.is_terminated() or self.grammar_failed)

    @property
    def grammar_complete(self) -> bool:
        """Whether the output so far is a whole match of the grammar."""
        return self.matcher is not None and self.matcher.is_completed()
