"""The summary's percentiles (io/rows/figures.py): exact (numpy's linear interpolation) up to EXACT_LIMIT values, within
1% of the value at the percentile's rank past it, in bounded memory; merged across processes; tpot per row."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from conveyor.io.rows.figures import EXACT_LIMIT, RELATIVE_ERROR, LatencyFigures, Quantiles, run_figures


def _filled(values) -> Quantiles:
    q = Quantiles()
    for v in values:
        q.add(v)
    return q


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, EXACT_LIMIT])
def test_small_runs_are_exact_as_numpy_and_statistics(n):
    rng = random.Random(n)
    values = [rng.lognormvariate(-2, 1.5) for _ in range(n)]
    q = _filled(values)
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert q.percentile(p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12, abs=1e-15)
    if n >= 2:
        quartiles = statistics.quantiles(values, n=4, method="inclusive")
        assert [q.percentile(p) for p in (25, 50, 75)] == pytest.approx(quartiles, rel=1e-12)
    assert q.max == max(values) and q.count == n


@pytest.mark.parametrize("seed", [0, 1])
def test_large_runs_are_within_one_percent_of_the_value_at_the_rank_in_bounded_memory(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(-1, 2) for _ in range(60_000)] + [0.0] * 300 + [1e-8] * 50
    q = _filled(values)
    assert q.state()["exact"] is None and len(q.state()["buckets"]) < 2000
    for p in (0, 1, 10, 50, 90, 99, 99.9, 100):
        at_rank = float(np.percentile(values, p, method="nearest"))
        got = q.percentile(p)
        assert got == pytest.approx(at_rank, rel=RELATIVE_ERROR + 1e-9, abs=1e-6), p
    assert q.percentile(100) <= q.max == max(values)
    figures = q.figures()
    assert list(figures) == ["p50", "p90", "p99", "max"]
    assert figures["p50"] <= figures["p90"] <= figures["p99"] <= figures["max"]


def test_merge_is_the_same_as_one_sketch_of_all_the_values():
    rng = random.Random(3)
    a = [rng.expovariate(10) for _ in range(1000)]
    b = [rng.expovariate(2) for _ in range(1500)]
    merged = _filled(a)
    merged.merge(Quantiles.from_state(_filled(b).state()))  # (as a Ray worker's comes to the driver)
    assert merged.count == 2500 and merged.state()["exact"] is not None  # still exact together
    assert merged.percentile(90) == pytest.approx(float(np.percentile(a + b, 90)))
    big = [rng.expovariate(1) for _ in range(EXACT_LIMIT)]
    merged.merge(_filled(big))  # past the limit: folded
    everything = a + b + big
    assert merged.count == len(everything) and merged.state()["exact"] is None
    assert merged.percentile(50) == pytest.approx(float(np.percentile(everything, 50, method="nearest")),
                                                  rel=RELATIVE_ERROR + 1e-9)
    merged.merge(Quantiles())
    assert merged.count == len(everything)


def test_no_values_give_none():
    assert Quantiles().figures() == {"p50": None, "p90": None, "p99": None, "max": None}
    summary = run_figures([{"latency": LatencyFigures().state(), "scheduled_rows": 0, "steps": 0,
                            "max_num_seqs": None}])
    assert summary["tpot_s"] == {"p50": None, "p99": None}
    assert (summary["mean_running"], summary["occupancy"], summary["steps"]) == (0.0, 0.0, 0)


def test_latency_figures_count_ok_rows_and_tpot_per_output_token_after_the_first():
    figures = LatencyFigures()
    ok = {"status": "ok", "queue_s": 0.5, "ttft_s": 1.0, "latency_s": 3.0, "completion_tokens": 5}
    figures.add_row(ok)
    figures.add_row({**ok, "completion_tokens": 1})  # one token: no time per output token
    figures.add_row({"status": "error", "queue_s": None, "ttft_s": None, "latency_s": None, "completion_tokens": 0})
    q = figures.quantiles
    assert (q["latency_s"].count, q["ttft_s"].count, q["queue_s"].count, q["tpot_s"].count) == (2, 2, 2, 1)
    assert q["tpot_s"].percentile(50) == pytest.approx(0.5)  # (3 - 1) / (5 - 1)
    summary = figures.summary()
    assert set(summary) == {"ttft_s", "latency_s", "queue_s", "tpot_s"}
    assert summary["latency_s"] == {"p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}


def test_occupancy_is_scheduled_rows_over_the_slots_of_the_steps_that_ran():
    state = {"latency": LatencyFigures().state(), "scheduled_rows": 30, "steps": 10, "max_num_seqs": 4}
    one = run_figures([state])
    assert (one["mean_running"], one["occupancy"], one["steps"]) == (3.0, 0.75, 10)
    two = run_figures([state, {**state, "scheduled_rows": 10}])  # two workers' engines
    assert (two["mean_running"], two["occupancy"], two["steps"]) == (2.0, 0.5, 20)
