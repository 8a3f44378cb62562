"""Speculative decoding by prompt lookup: which draft tokens each decode row of a step carries. Pure Python.

Drafts. A request's next tokens are guessed from its own sequence (prompt + output): where the last n tokens
(n from `max_n` down to `min_n`: the longest match first, then the one followed by the most tokens, then the most
recent) occurred earlier, the tokens that followed them there are the draft (`NgramIndex`). The engine feeds them after the request's
last token, as extra query rows of that request, like a prefill chunk; the runner accepts a draft token exactly
when it equals the token the sampler draws at its position, so speculation changes no output bit.

How many. A draft row costs what the step's forward pass gains in time by one more row, and pays when it is
accepted. `Speculator.choose` maximizes the step's useful rows per second: its rows (prefill chunks and decode
rows, all useful work) plus the expected accepted drafts, over the forward's time at that many rows, read from a
cost curve the engine measured at start (`rows -> seconds`). Where a step's forward pass takes about as long
for 16 rows as for 1 (a small batch: the weights' read dominates), every likely draft rides along; where time
grows with each row (a large batch), drafts rarely pay and are not proposed at all.

The value of a request's j-th draft token is p^j, p the chance that it accepts a draft token: its accepted
draft tokens over the draft tokens it tried (a rejection tries one; the tokens after it are never tried),
shrunk towards the engine's rate over all requests. A request whose p falls below `MIN_ACCEPTANCE` after tries of
its own stops drafting for a while (its own tokens: 16, then 32, 64, ...), then tries again.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.core.request import Request

MIN_ACCEPTANCE = 0.15  # below this chance of accepting a draft token, a request pauses drafting
PRIOR_TRIES = 4  # weight of the engine-wide acceptance rate in a request's own (as this many tried tokens)
PAUSE_TOKENS = 16  # a request's first pause, in its own generated tokens; doubled at each pause after
MAX_CANDIDATES = 16  # earlier occurrences of the last min_n tokens examined per proposal, the most recent first


class NgramIndex:
    """Where each `min_n`-gram of a request's tokens ended, filled in lazily as its tokens grow."""

    __slots__ = ("min_n", "max_n", "ends", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the sequence's last tokens ([] if none)."""
        n, end = self.min_n, len(tokens) - 1
        ends = self.ends
        for at in range(max(self.indexed, n - 1), end):  # the sequence's own last n-gram is not a candidate
            ends.setdefault(tuple(tokens[at - n + 1:at + 1]), []).append(at)
        self.indexed = max(self.indexed, end)
        if end < n or k < 1:
            return []
        found = ends.get(tuple(tokens[end - n + 1:]))
        if not found:
            return []
        best, best_score = -1, (0, 0)
        for at in reversed(found[-MAX_CANDIDATES:]):
            length = n
            while length < self.max_n and at - length >= 0 and tokens[at - length] == tokens[end - length]:
                length += 1
            score = (length, min(k, end - at))  # the longest match, then the one with the most tokens after it
            if score > best_score:
                best, best_score = at, score
                if score == (self.max_n, k):
                    break
        return list(tokens[best + 1:best + 1 + k])


class DraftState:
    """One request's drafting (`Request.draft_state`, written by the speculator only): its index, what its drafts
    did, and its pause."""

    __slots__ = ("index", "tried", "hits", "drafted", "accepted", "resume_at", "pause")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.index = NgramIndex(min_n, max_n)
        self.tried = 0  # since its last pause: draft tokens the sampler compared (the accepted ones and each first
        self.hits = 0  # rejection), and those that equalled the sampled token
        self.drafted = 0  # in all: draft tokens fed to the model ...
        self.accepted = 0  # ... and accepted
        self.resume_at = 0  # paused until it has this many output tokens
        self.pause = PAUSE_TOKENS


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int  # most draft tokens per request and step
    min_n: int = 2
    max_n: int = 4


@dataclass
class SpeculativeStats:
    num_draft_tokens: int = 0  # fed to the model
    num_accepted_tokens: int = 0  # of those, equal to the sampled token
    num_tried_tokens: int = 0  # compared by the sampler (accepted + the first rejection of each draft)


class CostCurve:
    """Seconds of one forward pass by its number of rows: measured points, linear between them and past the
    last two (never decreasing)."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        points = sorted(points)
        if len(points) < 2:
            raise ValueError("a cost curve needs two measured row counts or more")
        self.rows = [r for r, _ in points]
        self.seconds: list[float] = []
        for _, s in points:
            self.seconds.append(max(s, self.seconds[-1]) if self.seconds else s)

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        i = min(max(bisect.bisect_left(r, rows), 1), len(r) - 1)
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return max(s[i - 1] + slope * (rows - r[i - 1]), s[0])


class Speculator:
    """Drafts for the decode rows of a step, where they pay (module docstring)."""

    def __init__(self, config: SpeculativeConfig, cost: CostCurve) -> None:
        self.config = config
        self.cost = cost
        self.stats = SpeculativeStats()

    def global_rate(self) -> float:
        s = self.stats
        return (s.num_accepted_tokens + 0.5 * PRIOR_TRIES) / (s.num_tried_tokens + PRIOR_TRIES)

    def _chance(self, state: DraftState, prior: float) -> float:
        return (state.hits + prior * PRIOR_TRIES) / (state.tried + PRIOR_TRIES)

    def choose(self, decodes: Sequence[tuple[Request, int]], num_rows: int) -> dict[str, list[int]]:
        """Draft tokens per request id for `decodes` ((request, most draft tokens it may take: the step's token
        budget, its max_tokens and free blocks allow), its one decode row already in the step's `num_rows`)."""
        prior = self.global_rate()
        base = self.cost(num_rows)
        # Even a certain draft token must beat the step's rate of useful rows per second.
        if (num_rows + 1) / self.cost(num_rows + 1) <= num_rows / base or not decodes:
            return {}
        k = self.config.num_tokens
        candidates: list[tuple[float, str, int]] = []  # (value, req_id, its j-th draft token)
        proposals: dict[str, list[int]] = {}
        for request, limit in decodes:
            state = request.draft_state
            if state is None:
                state = request.draft_state = DraftState(self.config.min_n, self.config.max_n)
            if limit < 1 or request.num_output_tokens < state.resume_at:
                continue
            p = self._chance(state, prior)
            if p < MIN_ACCEPTANCE and state.tried >= PRIOR_TRIES:  # (its own evidence, not only the prior)
                state.resume_at = request.num_output_tokens + state.pause
                state.pause *= 2
                state.tried = state.hits = 0  # it starts over after the pause
                continue
            draft = state.index.propose(request.token_ids, min(k, limit))
            if not draft:
                continue
            proposals[request.req_id] = draft
            value = 1.0
            for j in range(len(draft)):
                value *= p
                candidates.append((value, request.req_id, j))
        if not candidates:
            return {}
        candidates.sort(key=lambda c: -c[0])
        best_n, best_rate, gained = 0, num_rows / base, 0.0
        for n, (value, _, _) in enumerate(candidates, 1):
            gained += value
            rate = (num_rows + gained) / self.cost(num_rows + n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        taken: dict[str, int] = {}
        for _, req_id, j in candidates[:best_n]:
            taken[req_id] = max(taken.get(req_id, 0), j + 1)
        return {req_id: proposals[req_id][:n] for req_id, n in taken.items()}

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """What the sampler made of a request's `num_drafts` draft tokens: the first `num_accepted` equalled it."""
        state, s = request.draft_state, self.stats
        tried = num_accepted + (num_accepted < num_drafts)
        state.drafted += num_drafts
        state.accepted += num_accepted
        state.hits += num_accepted
        state.tried += tried
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.num_tried_tokens += tried
        if num_accepted == num_drafts:
            state.pause = PAUSE_TOKENS  # drafting pays for it again: a later pause starts short
