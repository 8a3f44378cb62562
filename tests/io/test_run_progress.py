"""A run's progress: its ETA counts records, as its bar does (the records left at the rate records have finished),
and before the first record finishes it is the token estimate only once the records generating are half way to
their cap; earlier it is unknown, not a cap-sized guess."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.io.rows.sink import RunTotals
from conveyor.io.run_progress import eta_seconds, records_eta_seconds, run_progress


@dataclasses.dataclass
class Stats:  # the EngineStats fields progress reads
    num_running: int = 4
    num_waiting: int = 0
    kv_usage: float = 0.5
    num_preemptions: int = 0
    num_generated_tokens: int = 0


def _progress(done: int, total: int | None, generated: int, elapsed: float = 10.0, completion_tokens: int = 0,
              resumed_from: int = 0, running: int = 4, cap: int = 256):
    totals = RunTotals(total=total, done=done, resumed_from=resumed_from, completion_tokens=completion_tokens,
                       first_admit=100.0)
    return run_progress(totals, Stats(num_running=running, num_generated_tokens=generated), 1, cap,
                        now=100.0 + elapsed)


def test_the_eta_is_the_records_left_at_the_rate_records_finished():
    # 100 records, 20 done in 10 s: 80 left at 2 a second, whatever the cap says about their tokens
    p = _progress(done=20, total=100, generated=600, completion_tokens=600)
    assert p.eta_s == pytest.approx(40.0) == records_eta_seconds(80, 20, 10.0)
    assert (p.done, p.total, p.tokens_per_s, p.running, p.kv_usage) == (20, 100, 60.0, 4, 0.5)
    # the token estimate, which expects a record left to run far longer, is not what the bar's ETA says
    assert eta_seconds(80, 4, 20, 600, 600, 0, 10.0, 256) > 2 * p.eta_s


def test_rows_of_an_earlier_process_are_not_in_the_rate():
    p = _progress(done=70, total=100, generated=600, completion_tokens=600, resumed_from=50)
    assert p.eta_s == pytest.approx(30 * 10.0 / 20)


def test_before_the_first_record_finishes_the_eta_waits_for_half_the_cap():
    # 4 records generating, 40 tokens each of a cap of 256: short answers may be about to finish, so unknown
    assert _progress(done=0, total=100, generated=160).eta_s is None
    # 130 each: past half the cap, the token estimate (within a factor of two of the truth) stands in
    p = _progress(done=0, total=100, generated=520)
    assert p.eta_s == pytest.approx(eta_seconds(100, 4, 0, 0, 520, 0, 10.0, 256))


def test_an_input_of_unknown_size_or_a_finished_one():
    assert _progress(done=20, total=None, generated=600, completion_tokens=600).eta_s is None
    assert _progress(done=100, total=100, generated=600, completion_tokens=600).eta_s == 0.0
    assert run_progress(RunTotals(total=10), None, 1, 256).eta_s is None  # before the engine loads


def test_the_first_records_to_finish_of_a_full_batch_do_not_set_the_rate():
    # 64 records side by side, 600 tokens each of a cap of 1024 after 40 s: the first one finishing says that a
    # record takes 40 s, not that one finishes every 40 s (that rate would promise 10000 x 40 s)
    p = _progress(done=1, total=10000, generated=64 * 600, elapsed=40.0, completion_tokens=600, running=63, cap=1024)
    assert p.eta_s == pytest.approx(eta_seconds(9999, 63, 1, 600, 64 * 600, 0, 40.0, 1024))
    assert p.eta_s < records_eta_seconds(9999, 1, 40.0) / 20
    # once a batch's worth has finished, the records' own rate
    q = _progress(done=64, total=10000, generated=64 * 700, elapsed=45.0, completion_tokens=64 * 600, running=64,
                  cap=1024)
    assert q.eta_s == pytest.approx(records_eta_seconds(9936, 64, 45.0))
