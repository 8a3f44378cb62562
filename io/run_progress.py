"""A running run's progress (`RunProgress`, from `Run.progress()`): records done of the total, errors, the token
rate, the engine's queue and KV use, and the ETA. The CLI's bar and log lines only render it.

The ETA counts what the bar counts: records. Once this process has finished as many records as the engine runs at
once, it is the records left at the rate records have finished so far (`records_eta_seconds`), so the bar and the
ETA move together. Before that the records' rate says nothing yet: the first of 64 records running side by side
finishes after a whole record's latency, so its rate would promise 64 times too long. The token estimate
(`eta_seconds`: a record left expected to generate the finished ones' mean, weighed against its cap of max_tokens)
stands in once a record has finished, or once the records generating have half their cap each: earlier, while
short outputs may still be about to finish, the cap overstates the work left by as much as the cap over the
outputs' length (a run of 30-token answers under a 256-token cap: an ETA eight times too long, made worse by a
token rate measured over the first prefills), and the ETA says "?" instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.io.rows.sink import RunTotals


@dataclass(frozen=True)
class RunProgress:
    done: int  # records with a row, all runs of this run directory together
    total: int | None  # records in the input (after --limit, in this shard); None where not cheaply known
    errors: int
    tokens_per_s: float  # this process's output tokens over its generation time so far
    eta_s: float | None  # seconds until every record has a row (None: not known yet)
    running: int  # requests the engine runs now ...
    waiting: int  # ... and those waiting
    kv_usage: float  # fraction of the KV cache's blocks in use
    preemptions: int
    pooling: bool = False  # a pooling task: its token rate is the input's, and it runs, caches and preempts nothing


def run_progress(totals: RunTotals, stats, n: int, tokens_cap: int, now: float | None = None,
                 pooling: bool = False) -> RunProgress:
    """The progress of a run of `totals` whose engine reports `stats` (its EngineStats; None before it loads);
    `n` requests per record, each of at most `tokens_cap` tokens (--max-tokens). A `pooling` task's token rate is
    its input tokens' (it generates none), and its ETA by records."""
    t = totals
    now = time.monotonic() if now is None else now
    elapsed = now - t.first_admit if t.first_admit else 0.0
    if pooling:
        rate = (stats.num_computed_prompt_tokens if stats else 0) / elapsed if elapsed > 0 else 0.0
        left = None if t.total is None else t.total - t.done
        return RunProgress(done=t.done, total=t.total, errors=t.errors, tokens_per_s=rate,
                           eta_s=records_eta_seconds(left, t.done - t.resumed_from, elapsed),
                           running=0, waiting=stats.num_waiting if stats else 0, kv_usage=0.0, preemptions=0,
                           pooling=True)
    generated = stats.num_generated_tokens if stats else 0
    in_flight = -(-(stats.num_running + stats.num_waiting) // n) if stats else 0  # (records: a request per sample)
    left = None if t.total is None else t.total - t.done
    finished = t.done - t.resumed_from
    eta = None
    if left is not None and (left <= 0 or finished >= max(in_flight, 1)):  # a batch's worth finished: their rate
        eta = records_eta_seconds(left, finished, elapsed)
    elif left is not None and in_flight and \
            (finished or generated + t.tokens_carried_over >= in_flight * tokens_cap * n / 2):
        eta = eta_seconds(left, in_flight, finished, t.completion_tokens, generated, t.tokens_carried_over, elapsed,
                          tokens_cap * n)
    return RunProgress(
        done=t.done, total=t.total, errors=t.errors, tokens_per_s=generated / elapsed if elapsed > 0 else 0.0,
        eta_s=eta, running=stats.num_running if stats else 0, waiting=stats.num_waiting if stats else 0,
        kv_usage=stats.kv_usage if stats else 0.0, preemptions=stats.num_preemptions if stats else 0)


def records_eta_seconds(records_left: int | None, records_finished: int, elapsed: float) -> float | None:
    """Seconds until every record has a row at the rate this process has finished records so far (None: no rate
    yet, or the input's size is unknown)."""
    if records_left is None:
        return None
    if records_left <= 0:
        return 0.0
    if records_finished <= 0 or elapsed <= 0:
        return None
    return records_left * elapsed / records_finished


def eta_seconds(records_left: int | None, records_in_flight: int, records_finished: int, tokens_finished: int,
                tokens_generated: int, tokens_carried_over: int, elapsed: float, tokens_cap: float) -> float | None:
    """Seconds until every record has a row: the tokens still expected over this process's token rate so far (None:
    not known yet).

    `records_left`: records without a row (None: the input's size is unknown), `records_in_flight` of them
    generating now; `records_finished`, `tokens_finished`: the rows this process finished and their completion
    tokens; `tokens_generated`: the tokens it sampled in `elapsed` seconds (`tokens_carried_over`: those continued
    records held from an earlier process); `tokens_cap`: the most a record may generate (--max-tokens times --n).
    A record left is expected to generate the finished ones' mean, weighed against the cap by how many have
    finished of those started (the short ones finish first: their mean alone would promise too little), less
    the tokens the records generating now already have."""
    if records_left is None or elapsed <= 0:
        return None
    if records_left <= 0:
        return 0.0
    if tokens_generated <= 0 or (records_finished and not tokens_finished):  # no token rate (yet): by records
        return records_left * elapsed / records_finished if records_finished else None
    known = records_finished / max(records_finished + min(records_in_flight, records_left), 1)
    per_record = known * (tokens_finished / max(records_finished, 1)) + (1 - known) * tokens_cap
    in_flight = max(tokens_generated + tokens_carried_over - tokens_finished, 0)
    expected = max(records_left * per_record - in_flight, records_left)  # (a token each, at least)
    return expected * elapsed / tokens_generated
