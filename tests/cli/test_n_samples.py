"""`--n` and a record's `n`: a row per sample with sample_index, sample 0 the record's n = 1 output, openai-batch
lines with n choices, and each (record, sample) exactly once across a kill -9 between samples and clean stops."""

from __future__ import annotations

import json
import sqlite3

import pytest
from cli_helpers import Child, read_rows, run_in_process, stable, tiny_args, window_of, write_jsonl

RECORDS = [{"id": f"p{i}", "prompt": f"tell me about {i}", "max_tokens": 12} for i in range(3)]
OPTS = ("--dtype", "float32", "--quiet")


def _run(tiny_model, tmp_path, name, records, *extra, code=0, quiet=True):
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    out = tmp_path / f"{name}-out.{'parquet' if '--parquet' in extra else 'jsonl'}"
    extra = tuple(e for e in extra if e != "--parquet")
    summary = tmp_path / f"{name}-summary.json"
    opts = OPTS if quiet else OPTS[:-1]
    result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *opts, "--summary-json", summary, *extra)
    assert result.code == code, result.err
    return read_rows(out), json.loads(summary.read_text()), result


@pytest.mark.parametrize("sampling", [("--temperature", "0"), ("--temperature", "1.0", "--seed", "5")])
def test_n_4_gives_four_rows_per_record_whose_first_is_the_n_1_output(tiny_model, tmp_path, sampling):
    single, _, _ = _run(tiny_model, tmp_path, "one", RECORDS, *sampling)
    rows, summary, result = _run(tiny_model, tmp_path, "four", RECORDS, *sampling, "--n", "4", "--parquet",
                                 quiet=False)
    assert [(r["index"], r["sample_index"]) for r in rows] == [(i, k) for i in range(3) for k in range(4)]
    assert stable([r for r in rows if r["sample_index"] == 0]) == stable(single)
    assert all("sample_index" not in r for r in single)
    for i in range(3):
        outputs = [r["output"] for r in rows if r["index"] == i]
        seeds = {r["seed"] for r in rows if r["index"] == i}
        assert len(seeds) == 4
        if sampling[1] == "0":
            assert len(set(outputs)) == 1  # greedy: the seed changes nothing
        else:
            assert len(set(outputs)) > 1
    assert (summary["records"], summary["samples"], summary["ok"]) == (3, 12, 3)
    assert "3 (12 samples)" in result.out
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in rows)


def test_a_records_n_mixes_with_n_1_records(tiny_model, tmp_path):
    records = [{**RECORDS[0], "n": 3}, RECORDS[1], {**RECORDS[2], "n": 2}, {"id": "bad", "prompt": "x", "n": 0}]
    single, _, _ = _run(tiny_model, tmp_path, "one", RECORDS, "--temperature", "0.8")
    rows, summary, _ = _run(tiny_model, tmp_path, "mixed", records, "--temperature", "0.8", code=3)
    assert [(r["id"], r["sample_index"]) for r in rows] == [
        ("p0", 0), ("p0", 1), ("p0", 2), ("p1", 0), ("p2", 0), ("p2", 1), ("bad", 0)]
    first = {r["id"]: r for r in rows if r["sample_index"] == 0 and r["status"] == "ok"}
    assert stable([first[r["id"]] for r in single]) == stable(single)
    assert "n must be from 1 to 128" in rows[-1]["error"]  # a record-level error: one error row
    assert (summary["records"], summary["samples"], summary["errors"]) == (4, 7, 1)


def test_openai_batch_bodies_with_n_get_n_choices(tiny_model, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 6, "n": 1 + i}}
             for i in range(3)]
    lines.append({"custom_id": "bo", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 3}})
    out, _, _ = _run(tiny_model, tmp_path, "batch", lines, "--output-format", "openai-batch", code=3)
    assert [line["custom_id"] for line in out] == ["c0", "c1", "c2", "bo"]
    for i, line in enumerate(out[:3]):
        choices = line["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == list(range(1 + i))
        usage = line["response"]["body"]["usage"]
        assert usage["completion_tokens"] == 6 * (1 + i) or usage["completion_tokens"] <= 6 * (1 + i)
    assert "body.best_of" in out[3]["error"]["message"]


def test_n_is_checked_before_the_model_loads_and_is_part_of_the_settings(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    bad = run_in_process("run", src, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), "--n", "0")
    assert bad.code == 2 and "--n must be an integer from 1 to 128" in bad.err, bad.err
    out = tmp_path / "out.jsonl"
    assert run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "--n", "2").code == 0
    status = run_in_process("status", out)
    assert status.code == 0 and "done:   1 / 1  (errors 0)  2 samples" in status.out, status.out
    drift = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "--n", "3")
    assert drift.code == 2 and "n" in drift.err and "--restart" in drift.err, drift.err


# -- exactly once across stops -------------------------------------------------------------------------------------

# Long enough that a child process is still generating when a checkpoint holds a record's first finished samples,
# on the fastest kernels too.
LONG = [{"id": f"q{i}", "prompt": f"a long story {i}", "max_tokens": 800 + 10 * i, "n": 4} for i in range(2)]
# Two requests at a time: a record's samples run one pair after the other, so a stop lands between its samples.
LONG_OPTS = ("--ignore-eos", "--temperature", "1.0", "--max-num-seqs", "2", *OPTS)


def _finished_samples_held(run_dir) -> int:
    """Finished sample rows the journal's partials hold (a record's samples that ended before its others)."""
    db = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        states = [json.loads(s) for (s,) in db.execute("SELECT state FROM partials")]
    except sqlite3.OperationalError:
        return 0
    finally:
        db.close()
    return sum("row" in sample for state in states for sample in state.get("samples", {}).values())


def _keys(rows):
    return [(r["index"], r["sample_index"]) for r in rows]


def test_a_kill_9_between_samples_loses_and_repeats_none(tiny_model, tmp_path):
    reference, _, _ = _run(tiny_model, tmp_path, "ref", LONG, *LONG_OPTS)
    src, out, run_dir = write_jsonl(tmp_path / "in.jsonl", LONG), tmp_path / "out.jsonl", tmp_path / "out.jsonl.conveyor"
    config = tmp_path / "c.yaml"
    config.write_text("checkpoint_seconds: 0.2\n", encoding="utf-8")
    child = Child(["run", src, "-o", out, *tiny_args(tiny_model), *LONG_OPTS, "-c", config], tmp_path, "killed")
    child.wait_until(lambda: run_dir.joinpath("journal.sqlite").exists() and _finished_samples_held(run_dir) >= 2,
                     timeout=300, what="finished samples held in a partial")
    child.kill9()
    summary = tmp_path / "s.json"
    result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *LONG_OPTS, "--summary-json", summary)
    assert result.code == 0, result.err
    rows = read_rows(out)
    assert _keys(rows) == [(i, k) for i in range(2) for k in range(4)]
    assert stable(rows) == stable(reference)
    assert json.loads(summary.read_text())["continued"] >= 1


def test_clean_stops_between_samples_finish_with_the_rows_of_one_run(tiny_model, tmp_path):
    reference, said, _ = _run(tiny_model, tmp_path, "ref", LONG, *LONG_OPTS)
    src, out = write_jsonl(tmp_path / "in.jsonl", LONG), tmp_path / "out.jsonl"
    stops = 0
    for attempt in range(40):  # (from the third window on, each 1.15x the last: a machine slower than at the
        # reference still ends)
        result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *LONG_OPTS, "--max-runtime",
                                window_of(said, 5 / 1.15 ** max(0, attempt - 1)))
        if result.code != 75:
            break
        stops += 1
    assert result.code == 0, result.err
    assert stops >= 1, "the windows were meant to be shorter than the records' generation"
    rows = read_rows(out)
    assert _keys(rows) == [(i, k) for i in range(2) for k in range(4)]
    assert stable(rows) == stable(reference)


def test_the_samples_of_a_prompt_share_its_prefill(tiny_model, tmp_path):
    record = {"id": "long", "prompt": " ".join(f"word{i}" for i in range(40)), "max_tokens": 4}
    single, _, _ = _run(tiny_model, tmp_path, "one", [record], "--temperature", "0.9")
    rows, summary, _ = _run(tiny_model, tmp_path, "four", [record], "--temperature", "0.9", "--n", "4")
    assert stable(rows[:1]) == stable(single)
    prompt = rows[0]["prompt_tokens"]
    cached = (prompt - 1) // 16 * 16  # the full blocks (16 tokens) before the last prompt token
    assert cached > 0
    assert summary["prefix_cache_hit_rate"] == pytest.approx(3 * cached / (4 * prompt), abs=1e-4)


def test_shards_merge_a_row_per_sample(tiny_model, tmp_path):
    records = [{**r, "n": 1 + i} for i, r in enumerate(RECORDS)] + [{"id": "p0", "prompt": "again", "n": 2}]
    single, _, _ = _run(tiny_model, tmp_path, "one", records, "--temperature", "0.5", code=3)
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "sharded.parquet"
    for shard in ("0/2", "1/2"):
        result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, "--temperature", "0.5",
                                "--shard", shard)
        assert result.code in (0, 3), result.err
    merged = read_rows(out)
    assert _keys(merged) == _keys(single) and stable(merged) == stable(single)
    assert merged[-1]["status"] == "error" and "duplicate id 'p0'" in merged[-1]["error"]
