"""(torch) Logits -> token ids for a whole step at once: the logits processors (`logits_processors.py`),
then greedy, temperature, top-k, top-p, min-p; and the logprobs of the rows that ask for them, from the
logits as the model gave them.

Randomness is per request and stateless: the uniform draw for a request's n-th output token is a
hash of (seed, n), so its tokens depend on its seed and its own logits only, never on the batch
around it or on how often it was preempted or the run restarted.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

import torch

from conveyor.core.logits_processors import Processors
from conveyor.core.logits_state import LogitsState
from conveyor.core.logprobs import token_logprobs
from conveyor.core.schedule_types import ScheduledRequest, TokenLogprobs

_MASK64 = (1 << 64) - 1


def uniform_for(seed: int, index: int) -> float:
    """A float in [0, 1) from (seed, index) by splitmix64; the same on every machine."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) * (1.0 / (1 << 53))


class Sampler:
    def __init__(self, eos_token_ids: Collection[int], argmax=None, sample_rows=None, apply_bitmask=None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        # The cpu backend's C++ ops (`Backend.sampler_ops`: its logits are on the CPU), or None: torch below.
        self.argmax = argmax  # a faster exact `torch.argmax(x, -1)`, or None
        # (logits, rows, temps, draws, top_k, top_p, min_p) -> token ids: both sampling paths below in
        # one C++ pass per row, or None. In the engine, 64 rows x 49152: ~3.5 ms per step
        # instead of ~20 ms, and ~9 ms instead of ~150 ms with top-p (torch sorts the whole vocabulary).
        self.sample_rows = sample_rows
        self.processors = Processors(eos_token_ids, apply_bitmask)

    def __call__(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest],
                 states: Sequence[LogitsState | None] | None = None) -> list[int]:
        return self.sample(logits, entries, states)[0]

    def sample(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest],
               states: Sequence[LogitsState | None] | None = None
               ) -> tuple[list[int], dict[str, TokenLogprobs], dict[str, str]]:
        """logits [B, V] (one row per sampled entry, same order; modified in place), each row's processor state
        or None -> (B token ids, the logprobs of the rows whose request asks for them, by req_id, the requests
        whose processors failed: req_id -> what failed; their tokens mean nothing)."""
        if states is None:
            states = [None] * len(entries)
        wanted = [i for i, e in enumerate(entries) if e.sampling.logprobs is not None]
        raw = logits[wanted].clone() if wanted else None  # the model's distribution, before any edit
        failed_rows = self.processors.apply(logits, entries, states)
        if failed_rows:  # whatever a failed edit left in the row: something the samplers take
            logits[list(failed_rows)] = 0.0
        tokens = self._sample(logits, entries)
        logprobs: dict[str, TokenLogprobs] = {}
        if wanted:
            found = token_logprobs(raw, [tokens[i] for i in wanted], [entries[i].sampling.logprobs for i in wanted])
            logprobs = {entries[i].req_id: lp for i, lp in zip(wanted, found)}
        return tokens, logprobs, {entries[i].req_id: why for i, why in failed_rows.items()}

    def _sample(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest]) -> list[int]:
        # Each row's path depends on its own params only, so a token never depends on its batch.
        sampled = [i for i, e in enumerate(entries) if not e.sampling.is_greedy]
        # Few torch calls: right after a forward each costs ~10 us, and one row's sampling is 80 us of kernel.
        if sampled and self.sample_rows is not None:
            drawn = self._sample_in_kernel(logits, sampled, [entries[i] for i in sampled]).tolist()
            if len(sampled) == len(entries):
                return drawn
            tokens = self._argmax(logits).tolist()  # the greedy rows
            for i, token in zip(sampled, drawn):
                tokens[i] = token
            return tokens
        tokens = self._argmax(logits)  # greedy rows are done here
        plain = [i for i in sampled if not _truncates(entries[i])]
        truncated = [i for i in sampled if _truncates(entries[i])]
        for rows, sample in ((plain, self._sample_plain), (truncated, self._sample_truncated)):
            if rows:
                tokens[rows] = sample(logits[rows].float(), [entries[i] for i in rows])
        return tokens.tolist()

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.argmax(logits.contiguous()) if self.argmax is not None else torch.argmax(logits.float(), dim=-1)

    def _sample_in_kernel(self, logits: torch.Tensor, rows: list[int],
                          entries: Sequence[ScheduledRequest]) -> torch.Tensor:
        params = [e.sampling for e in entries]
        ints = torch.tensor([rows, [p.top_k for p in params]])  # int64; each row of these is contiguous
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params]], dtype=torch.float32)
        return self.sample_rows(logits.contiguous(), ints[0], floats[0], _draws(entries).squeeze(1), ints[1],
                                floats[1], floats[2])

    def _sample_plain(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest]) -> torch.Tensor:
        """No top-k/top-p/min-p: inverse CDF over the vocabulary in id order, no sort needed."""
        probs, u = _probs_and_draws(logits, entries)
        return _inverse_cdf(probs.double(), u)

    def _sample_truncated(self, logits: torch.Tensor, entries: Sequence[ScheduledRequest]) -> torch.Tensor:
        device = logits.device
        probs, u = _probs_and_draws(logits, entries)
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        top_k = [e.sampling.top_k if e.sampling.top_k > 0 else vocab for e in entries]
        if any(k < vocab for k in top_k):
            keep &= ranks < torch.tensor(top_k, device=device).unsqueeze(1)
        top_p = [e.sampling.top_p for e in entries]
        if any(p < 1.0 for p in top_p):
            # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            keep &= mass_before < torch.tensor(top_p, device=device).unsqueeze(1)
        min_p = [e.sampling.min_p for e in entries]
        if any(p > 0.0 for p in min_p):
            threshold = sorted_probs[:, :1] * torch.tensor(min_p, device=device).unsqueeze(1)
            keep &= sorted_probs >= threshold
        keep[:, 0] = True  # the most likely token always survives
        kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).double()
        idx = _inverse_cdf(kept, u)
        # Rounding can land past the kept mass, which is a prefix in sorted order: step back onto it.
        idx = torch.minimum(idx, keep.sum(dim=-1) - 1)
        return sorted_ids.gather(1, idx.unsqueeze(1)).squeeze(1)


def _probs_and_draws(logits: torch.Tensor, entries: Sequence[ScheduledRequest]):
    """Tempered probabilities [B, V] and each row's uniform draw [B, 1] (float64)."""
    temps = torch.tensor([e.sampling.temperature for e in entries], device=logits.device)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    return probs, _draws(entries).to(logits.device)


def _draws(entries: Sequence[ScheduledRequest]) -> torch.Tensor:
    """Each row's uniform draw [B, 1] (float64): from its seed and output index, or random where unseeded."""
    draws = [uniform_for(e.sampling.seed, e.num_output_tokens) if e.sampling.seed is not None
             else random.random() for e in entries]
    return torch.tensor(draws, dtype=torch.float64).unsqueeze(1)


def _truncates(e: ScheduledRequest) -> bool:
    s = e.sampling
    return s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (float64), u [B, 1] in [0, 1) -> [B] column where the CDF first exceeds u."""
    cdf = torch.cumsum(weights, dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    # Zero-weight columns never hold mass; rounding past the end lands on the last column with weight.
    last = weights.shape[1] - 1 - torch.argmax((weights.flip(1) > 0).to(torch.int8), dim=1)
    return torch.minimum(idx, last)
