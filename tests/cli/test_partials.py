"""A stop loses no generated token: the requests still generating are committed as partials at every checkpoint and
at a stop, and continue where they stopped when the run resumes, so windows shorter than any record's generation
still finish, with the rows of one uninterrupted run; `conveyor status` says what is held and what state the run
is in; `-o` that is not a file is refused, `-o -` writes stdout."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time

import pytest
from cli_helpers import Child, read_rows, run_in_process, stable, tiny_args, window_of, write_jsonl

# Long enough (near the tiny model's 2048-token context) that a child process is still generating when a checkpoint
# shows what the tests wait for, on the fastest kernels too.
RECORDS = [{"id": f"p{i}", "prompt": f"a long answer about {i}", "max_tokens": 1800 + 7 * i} for i in range(6)]
OPTS = ("--ignore-eos", "--temperature", "0", "--dtype", "float32", "--max-num-seqs", "6", "--quiet")


def _partials(run_dir) -> tuple[int, int]:
    """(records held as partials, their tokens) in the run directory's journal; (0, 0) before it has any."""
    db = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        count, tokens = db.execute("SELECT COUNT(*), SUM(num_tokens) FROM partials").fetchone()
    except sqlite3.OperationalError:  # (the journal being created)
        return 0, 0
    finally:
        db.close()
    return count, tokens or 0


def _reference(tiny_model, tmp_path, records, *extra, summary: bool = False):
    """The rows of one uninterrupted run (and its summary, where asked for)."""
    src = write_jsonl(tmp_path / "ref.jsonl", records)
    said = tmp_path / "ref-summary.json"
    result = run_in_process("run", src, "-o", tmp_path / "ref-out.jsonl", *tiny_args(tiny_model), *OPTS, *extra,
                            "--summary-json", said)
    assert result.code in (0, 3), result.err
    rows = read_rows(tmp_path / "ref-out.jsonl")
    return (rows, json.loads(said.read_text())) if summary else rows


@pytest.fixture(scope="module")
def records_run(tiny_model, tmp_path_factory):
    """RECORDS' rows and summary from one uninterrupted run."""
    return _reference(tiny_model, tmp_path_factory.mktemp("reference"), RECORDS, summary=True)


def test_windows_shorter_than_any_generation_finish_with_the_rows_of_one_run(tiny_model, tmp_path, records_run):
    reference, said = records_run
    src, out = write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl"
    summaries = []
    # A window of 1/2.5 of the generation: each resume first recomputes the carried tokens (up to ~10k here), which
    # on fast kernels costs a good part of a shorter window, and a window that only recomputes never finishes.
    # From the third window on, each is 1.15x the last: a machine slower than at the reference still ends.
    for window in range(1, 40):
        summary = tmp_path / f"summary-{window}.json"
        result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "--max-runtime",
                                window_of(said, 2.5 / 1.15 ** max(0, window - 2)), "--summary-json", summary)
        summaries.append(json.loads(summary.read_text()))
        if result.code != 75:
            break
        assert not out.exists()
    assert result.code == 0, result.err
    assert len(summaries) >= 2, "the windows were meant to be shorter than every record's generation"
    assert summaries[0]["records"] == 0 and summaries[0]["in_flight_saved"] == len(RECORDS)
    assert summaries[1]["continued"] > 0 and summaries[1]["tokens_carried_over"] > 0
    assert stable(read_rows(out)) == stable(reference)
    assert _partials(tmp_path / "out.jsonl.conveyor") == (0, 0)  # every partial went with its row


def test_a_kill_9_after_a_checkpoint_resumes_from_the_partials(tiny_model, tmp_path, records_run):
    reference, _ = records_run
    src, out, run_dir = write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl", tmp_path / "out.jsonl.conveyor"
    config = tmp_path / "c.yaml"
    config.write_text("checkpoint_seconds: 0.2\n", encoding="utf-8")
    child = Child(["run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "-c", config], tmp_path, "killed")
    child.wait_until(lambda: run_dir.joinpath("journal.sqlite").exists() and _partials(run_dir)[1] > 60,
                     timeout=120, what="partials committed")
    child.kill9()
    held = _partials(run_dir)
    summary = tmp_path / "s.json"
    result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "--summary-json", summary)
    assert result.code == 0, result.err
    said = json.loads(summary.read_text())
    assert said["continued"] == held[0] and said["tokens_carried_over"] == held[1]
    assert stable(read_rows(out)) == stable(reference)


def test_partials_keep_logprobs_stop_strings_grammars_and_preemption(tiny_model, tmp_path):
    records = [{"id": "lp", "prompt": "tell me", "logprobs": True, "top_logprobs": 2, "max_tokens": 200},
               {"id": "regex", "prompt": "letters", "guided_regex": "[a-z ]+", "max_tokens": 200},
               {"id": "stop", "prompt": "stop somewhere", "stop": ["the"], "max_tokens": 200},
               {"id": "pen", "prompt": "penalized", "repetition_penalty": 1.3, "presence_penalty": 0.5,
                "max_tokens": 200}]
    tight = ("--kv-cache-memory", "700KiB")  # preemptions as well
    reference, said = _reference(tiny_model, tmp_path, records, *tight, summary=True)
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    for attempt in range(30):  # (each window 1.15x the last: a machine slower than at the reference still ends)
        result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model)[:2], *OPTS, *tight,
                                "--max-runtime", window_of(said, 3 / 1.15 ** attempt))
        if result.code != 75:
            break
    assert result.code == 0, result.err
    rows, expected = {r["id"]: r for r in read_rows(out)}, {r["id"]: r for r in reference}
    for name in expected:
        assert rows[name]["output"] == expected[name]["output"], name
        assert rows[name]["finish_reason"] == expected[name]["finish_reason"], name
    assert [e["id"] for e in rows["lp"]["logprobs"]] == [e["id"] for e in expected["lp"]["logprobs"]]


def test_status_says_what_is_held_and_exits_by_the_runs_state(tiny_model, tmp_path):
    src, out = write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl"
    assert run_in_process("status", out).code == 2  # no run there
    run_dir, config = tmp_path / "out.jsonl.conveyor", tmp_path / "c.yaml"
    config.write_text("checkpoint_seconds: 0.2\n", encoding="utf-8")
    child = Child(["run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "-c", config], tmp_path, "stopped")
    child.wait_until(lambda: run_dir.joinpath("journal.sqlite").exists() and _partials(run_dir)[0] == len(RECORDS),
                     timeout=120, what="every record generating")
    child.send(signal.SIGTERM)
    stopped = child.wait(timeout=60)
    assert stopped.code == 75, stopped.err
    status = run_in_process("status", out)
    assert status.code == 75 and "in flight: 6 records hold" in status.out and "resume with:" in status.out
    assert run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS).code == 0
    status = run_in_process("status", out)
    assert status.code == 0 and f"finished: {out} is written" in status.out and "resume with" not in status.out


def test_an_output_that_is_not_a_file_is_refused_before_any_work(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target, says in ((fifo, "a FIFO"), ("/dev/null", "a character device")):
        result = run_in_process("run", src, "-o", target, *tiny_args(tiny_model), "--quiet")
        assert result.code == 2 and says in result.err and "-o - for stdout" in result.err, result.err
    assert not list(tmp_path.glob("*.conveyor")) and not os.path.exists("/dev/null.conveyor")


def test_dash_o_writes_the_finished_output_to_stdout_with_a_run_dir(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"s{i}", "prompt": f"say {i}"} for i in range(3)])
    refused = run_in_process("run", src, "-o", "-", *tiny_args(tiny_model), "--quiet")
    assert refused.code == 2 and "-o -: give --run-dir too" in refused.err
    started = time.monotonic()
    result = run_in_process("run", src, "-o", "-", "--run-dir", tmp_path / "state", *tiny_args(tiny_model),
                            "--max-tokens", "4")
    assert result.code == 0, result.err
    lines = [json.loads(line) for line in result.out.splitlines()]  # nothing but the rows on stdout
    assert [r["id"] for r in lines] == ["s0", "s1", "s2"] and "wrote the output to stdout" in result.err
    assert "conveyor run summary" in result.err and time.monotonic() - started < 120
