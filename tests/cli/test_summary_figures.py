"""The summary's wall time, model, latency percentiles and occupancy (table and --summary-json), and the progress
ETA by tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

from conveyor.io.run_progress import eta_seconds

RECORDS = [{"id": f"r{i}", "prompt": f"count to {i}", "max_tokens": 4 + i % 5} for i in range(10)]
RECORDS.append({"id": "bad", "prompt": ""})  # an error row: not in the percentiles
FIGURES = {"ttft_s", "latency_s", "queue_s"}


def _run(tiny_model, tmp_path, *extra, quiet=True):
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    result = run_in_process("run", write_jsonl(tmp_path / "in.jsonl", RECORDS), "-o", out, *tiny_args(tiny_model),
                            "--dtype", "float32", "--max-num-seqs", "4", "--summary-json", summary,
                            *(("--quiet",) if quiet else ()), *extra)
    assert result.code == 3, result.err
    return [r for r in read_rows(out) if r["status"] == "ok"], json.loads(summary.read_text()), result


@pytest.mark.parametrize("n", [1, 2])
def test_summary_json_has_the_latency_and_occupancy_figures_of_the_ok_rows(tiny_model, tmp_path, n):
    ok, summary, _ = _run(tiny_model, tmp_path, "--n", str(n), "--temperature", "0.8")
    assert len(ok) == 10 * n  # (every sample's row)
    for key in ("records", "ok", "errors", "elapsed_s", "load_s", "preemptions", "status"):  # kept
        assert key in summary
    assert summary["model"] == str(tiny_model) and Path(summary["model_path"]) == Path(tiny_model).resolve()
    assert summary["dtype"] == "float32" and summary["backend"] in ("cpu", "torch", "cuda")
    assert summary["wall_s"] >= summary["load_s"] + summary["elapsed_s"] > 0
    for key in FIGURES:
        f = summary[key]
        assert list(f) == ["p50", "p90", "p99", "max"]
        assert 0 <= f["p50"] <= f["p90"] <= f["p99"] <= f["max"]
        values = [r[key] for r in ok]  # a small run: exact, over every ok row (each sample's)
        assert f["max"] == max(values)
        assert f["p50"] == pytest.approx(float(np.percentile(values, 50)), abs=2e-6)
    assert summary["ttft_s"]["max"] <= summary["latency_s"]["max"]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] >= 2]
    assert list(summary["tpot_s"]) == ["p50", "p99"]
    assert summary["tpot_s"]["p50"] == pytest.approx(float(np.percentile(tpot, 50)), abs=2e-6)
    assert summary["steps"] > 0 and 0 < summary["occupancy"] <= 1
    assert 1 <= summary["mean_running"] <= 4
    assert summary["occupancy"] == pytest.approx(summary["mean_running"] / 4, abs=0.01)


def test_the_summary_table_shows_the_figures(tiny_model, tmp_path):
    _, _, result = _run(tiny_model, tmp_path, quiet=False)
    for name in ("wall time", "time to first token p50/p90/p99/max", "latency p50/p90/p99/max",
                 "queue time p50/p90/p99/max", "time per output token p50/p99", "mean running (occupancy)",
                 "engine steps"):
        assert name in result.out, result.out
    assert "(float32, " in result.out


def test_eta_is_unknown_without_a_size_or_time():
    assert eta_seconds(None, 2, 3, 30, 40, 0, 10.0, 100) is None  # input of unknown size
    assert eta_seconds(10, 0, 0, 0, 0, 0, 0.0, 100) is None  # nothing ran yet
    assert eta_seconds(10, 4, 0, 0, 0, 0, 5.0, 100) is None  # nothing generated, nothing finished
    assert eta_seconds(0, 0, 10, 300, 300, 0, 5.0, 100) == 0.0  # every record has its row


def test_eta_counts_tokens_before_any_record_finishes():
    # 10 records left, all generating, none finished: each expected to take the cap (100); 50 generated in 5 s
    # (10 tok/s), all of them by the records generating now: 1000 - 50 tokens to go
    assert eta_seconds(10, 10, 0, 0, 50, 0, 5.0, 100) == pytest.approx(95.0)
    # the same with a continued record that carried 20 tokens over from an earlier process
    assert eta_seconds(10, 10, 0, 0, 50, 20, 5.0, 100) == pytest.approx(93.0)


def test_eta_weighs_the_finished_records_mean_length_by_how_many_finished():
    # 4 finished with 200 tokens (50 each), none generating: 6 left, 300 expected, 60 of them generated already;
    # 260 tok in 13 s
    assert eta_seconds(6, 0, 4, 200, 260, 0, 13.0, 100) == pytest.approx(12.0)
    # 4 more generating: half of those started have finished, so a record is expected at (50 + 100) / 2
    assert eta_seconds(6, 4, 4, 200, 260, 0, 13.0, 100) == pytest.approx((6 * 75 - 60) / 20)
    # one short record finished early, 19 still generating: still near the cap, not 0
    assert eta_seconds(19, 19, 1, 1, 191, 0, 10.0, 16) > 0.5 * (19 * 16 - 190) / 19.1
    # only error rows so far (no tokens) and nothing generated: by records, 2 in 4 s
    assert eta_seconds(6, 0, 2, 0, 0, 0, 4.0, 100) == pytest.approx(12.0)
    # more generated than the mean says is left: a token per record left, never negative or 0
    assert 0 < eta_seconds(1, 1, 9, 90, 500, 0, 10.0, 100) < 1
