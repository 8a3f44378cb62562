"""--schedule and --lookahead: the usage errors, a record's priority field, and the same rows under every schedule
(greedy float32 on the tiny model, a batch small enough that each schedule runs the records in another order)."""

from __future__ import annotations

import pytest
from cli_helpers import assert_same_rows, read_rows, run_in_process, tiny_args, write_jsonl

SCHEDULES = ("fcfs", "priority", "sjf", "lpm")
PREFIXES = ["You answer questions about rivers, briefly and in plain words. " * 6,
            "You write short poems about the sea, in four lines, never rhyming. " * 6]


def _records() -> list[dict]:
    out = []
    for i in range(14):
        record = {"id": f"r{i}", "max_tokens": 3 + (i * 5) % 11, "priority": (i * 7) % 4}
        if i % 3 == 2:
            record["prompt"] = f"Record {i} says" + " and then" * (i % 5)
        else:
            record["messages"] = [{"role": "system", "content": PREFIXES[i % 2]},
                                  {"role": "user", "content": f"Question {i}: tell me one thing."}]
        out.append(record)
    return out


@pytest.mark.parametrize("args, says", [
    (["--schedule", "random"], "--schedule: 'random' is not one of fcfs, priority, sjf, lpm"),
    (["--lookahead", "256"], "--lookahead: fcfs runs requests in input order"),
    (["--schedule", "sjf", "--lookahead", "0"], "--lookahead must be a positive integer"),
])
def test_schedule_usage_errors_exit_2_before_the_model_loads(tmp_path, args, says):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", "--model", tmp_path / "no-model", *args)
    assert result.code == 2, result.err
    assert says in result.err, result.err
    assert "loading" not in result.err


def test_every_schedule_gives_the_same_rows(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", _records())
    common = [*tiny_args(tiny_model), "--dtype", "float32", "--temperature", "0", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "64", "-q"]
    rows = {}
    for schedule in SCHEDULES:
        extra = [] if schedule == "fcfs" else ["--lookahead", "16"]
        out = tmp_path / f"{schedule}.jsonl"
        result = run_in_process("run", source, "-o", out, *common, "--schedule", schedule, *extra)
        assert result.code == 0, result.err
        rows[schedule] = read_rows(out)
        assert all(r["status"] == "ok" for r in rows[schedule]), rows[schedule]
    for schedule in SCHEDULES[1:]:
        assert_same_rows(rows[schedule], rows["fcfs"])


def test_a_records_priority_field_under_each_schedule(tiny_model, tmp_path):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    records = [{"id": "data", "prompt": "x", "priority": "high"},  # a plain record's field: data unless priority
               {"custom_id": "b", "url": "/v1/chat/completions", "body": {**body, "priority": 3}},
               {"id": "bad", "prompt": "x", "priority": 1.5},
               {"id": "ok", "prompt": "x", "priority": -2}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    common = [*tiny_args(tiny_model), "--max-tokens", "2", "-q"]
    result = run_in_process("run", source, "-o", tmp_path / "fcfs.jsonl", *common)
    rows = {r["id"]: r for r in read_rows(tmp_path / "fcfs.jsonl")}
    assert result.code == 3, result.err
    assert [rows[k]["status"] for k in ("data", "bad", "ok")] == ["ok", "ok", "ok"]
    assert "body.priority is not supported by conveyor except at its default" in rows["b"]["error"]
    assert "--schedule priority" in rows["b"]["error"]

    result = run_in_process("run", source, "-o", tmp_path / "prio.jsonl", *common, "--schedule", "priority")
    rows = {r["id"]: r for r in read_rows(tmp_path / "prio.jsonl")}
    assert result.code == 3, result.err
    assert rows["b"]["status"] == "ok" and rows["ok"]["status"] == "ok"
    assert rows["data"]["error"].startswith("line 1: priority must be an integer, got a string")
    assert rows["bad"]["error"].startswith("line 3: priority must be an integer")


def test_only_the_priority_schedule_is_part_of_the_generation_config():
    from conveyor.core import EngineConfig
    from conveyor.io.run_spec import InputOptions, OutputOptions, RunSpec

    def config(**engine):
        return RunSpec(InputOptions("in.jsonl"), OutputOptions("out.jsonl"),
                       engine=EngineConfig(**engine)).generation_config()

    plain = config()
    assert config(schedule="sjf", lookahead=500) == config(schedule="lpm") == plain  # the same rows: no drift
    assert config(schedule="priority") == {**plain, "schedule": "priority"}  # reads a field: rows may differ


def test_validate_checks_priority_fields_under_the_priority_schedule(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x", "priority": "high"},
                                                 {"id": "b", "prompt": "y", "priority": 2}])
    plain = run_in_process("validate", source, "--model", tiny_model)
    assert plain.code == 0, plain.out + plain.err  # a plain record's priority is data
    result = run_in_process("validate", source, "--model", tiny_model, "--schedule", "priority")
    assert result.code == 3, result.out + result.err
    assert "2 records, 1 ok, 1 error" in result.out
    assert "line 1: priority must be an integer, got a string" in result.out
