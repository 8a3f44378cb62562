"""When a request stops: EOS, stop token ids, max/min tokens and stop strings. Pure functions."""

from __future__ import annotations

from collections.abc import Collection

from conveyor.core.request import FinishReason, Request


def check_token_stop(request: Request, eos_token_ids: Collection[int]) -> FinishReason | None:
    """Checked after each sampled token (already appended to `request.token_ids`)."""
    sampling = request.sampling
    num_output = request.num_output_tokens
    if num_output >= sampling.min_tokens:
        last = request.token_ids[-1]
        if (not sampling.ignore_eos and last in eos_token_ids) or last in sampling.stop_token_ids:
            return FinishReason.STOP
    if num_output >= sampling.max_tokens:
        return FinishReason.LENGTH
    return None


def find_stop_string(text: str, stop: Collection[str], num_new_chars: int, start: int = 0) -> int | None:
    """Index in `text` where the earliest stop string begins, if one ends in the last new chars (and begins at
    `start` or after: the answer's first character, after a reasoning section).

    Only the tail that could contain a stop string completed by the new characters is searched,
    so a long output costs O(len(stop string)) per step, not O(len(text)).
    """
    best: int | None = None
    for s in stop:
        begin = max(start, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, begin)
        if i != -1 and (best is None or i < best):
            best = i
    return best
