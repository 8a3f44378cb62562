"""Per-request state of the logits processors: what they need to know of the tokens so far. Pure Python.

It advances only when the scheduler accepts a sampled token (`accept`), and it depends only on the
request's prompt and accepted output tokens. Preemption by recompute keeps those tokens, so the state
stays valid across it; chunked prefill and prefix caching never touch it; a resumed run starts the
request afresh, state and all. So a record's processed logits are a function of its tokens, like the
logits themselves.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from conveyor.core.sampling_params import SamplingParams


class LogitsState:
    __slots__ = ("counts", "seen", "tail", "tail_len", "matcher", "grammar_failed")

    def __init__(self, sampling: SamplingParams, prompt_token_ids: list[int], matcher: Any = None) -> None:
        self.counts: Counter[int] | None = (Counter() if sampling.presence_penalty or sampling.frequency_penalty
                                            else None)  # generated tokens, for presence / frequency
        self.seen: set[int] | None = set(prompt_token_ids) if sampling.repetition_penalty != 1.0 else None
        self.tail_len = max((len(w) - 1 for w in sampling.bad_words), default=0)
        self.tail: list[int] = []  # the last tail_len generated tokens, for bad words of several tokens
        self.matcher = matcher  # xgrammar.GrammarMatcher, or None
        self.grammar_failed = False  # the grammar refused a token (nothing was allowed): the request stops

    @classmethod
    def needed(cls, sampling: SamplingParams) -> bool:
        return bool(sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0
                    or sampling.grammar is not None or any(len(w) > 1 for w in sampling.bad_words))

    def accept(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen.add(token)
        if self.tail_len:
            self.tail.append(token)
            del self.tail[:-self.tail_len]
        if self.matcher is not None and not self.matcher.is_terminated():
            if not self.matcher.accept_token(token):
                self.grammar_failed = True

    @property
    def grammar_done(self) -> bool:
        """The output is complete under its grammar (the matcher took its stop token), or the grammar can go no
        further: the request stops."""
        return self.matcher is not None and (self.matcher.is_terminated() or self.grammar_failed)

    @property
    def grammar_complete(self) -> bool:
        """Whether the output so far is a whole match of the grammar."""
        return self.matcher is not None and self.matcher.is_completed()
