"""No record wedges a run and no journal is trusted blindly: a record whose data would break a step is an error row
and the run finishes; a journal or shard marker changed outside conveyor is refused naming what is wrong; shard
counts are bounded; options the engine would refuse only after loading the model are usage errors before it."""

from __future__ import annotations

import json
import sqlite3

import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

QUIET = ("--quiet", "--max-tokens", "4", "--temperature", "0")


def _run(tiny_model, *args):
    return run_in_process("run", *args, *tiny_args(tiny_model), *QUIET)


def test_a_record_with_token_ids_past_the_vocabulary_is_an_error_row_and_the_run_finishes(tiny_model, tmp_path):
    records = [{"id": "a", "prompt": "hello there"},
               {"id": "crash", "prompt": "Say hi:", "stop_token_ids": [999999], "min_tokens": 1},
               {"id": "bias", "prompt": "Say hi:", "logit_bias": {"123456": 5}},
               {"id": "b", "prompt": "goodbye"}]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    first = _run(tiny_model, src, "-o", out)
    assert first.code == 3, first.err
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["crash"]["error"].startswith("line 2: stop_token_ids: 999999 is not a token id of this model")
    assert rows["bias"]["error"].startswith("line 3: logit_bias: 123456 is not a token id")
    assert rows["a"]["status"] == rows["b"]["status"] == "ok"
    again = _run(tiny_model, src, "-o", out)  # a finished run reruns to the same output: nothing is retried
    assert again.code == 3 and {r["id"]: r for r in read_rows(out)} == rows


def _finished_shards(tiny_model, tmp_path, n=6):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(n)])
    out = tmp_path / "sh.jsonl"
    first = _run(tiny_model, src, "-o", out, "--shard", "0/2")
    assert first.code == 0 and not out.exists(), first.err
    assert "wrote" not in first.err  # a shard that did not write the output never says it did
    return src, out, tmp_path / "sh.jsonl.conveyor"


def test_a_row_deleted_from_a_shards_journal_is_refused_by_the_merge_and_shown_by_status(tiny_model, tmp_path):
    src, out, run_dir = _finished_shards(tiny_model, tmp_path)
    journal = run_dir / "shard-1-of-2" / "journal.sqlite"
    assert _run(tiny_model, src, "-o", out, "--shard", "1/2").code == 0 and out.exists()
    out.unlink()
    with sqlite3.connect(journal) as db:
        db.execute("DELETE FROM rows WHERE idx = 3")
    merged = run_in_process("merge", "-o", out)
    assert merged.code == 2 and not out.exists(), merged.err
    assert "shard 1/2" in merged.err and "no row for record 3" in merged.err and "--restart --shard 1/2" in merged.err
    status = run_in_process("status", out)
    assert "shard 1/2: 2 / 3 done" in status.out and "changed outside conveyor" in status.out, status.out


@pytest.mark.parametrize("marker", ["[]", "{}", '{"shard": 1, "of": 2, "input_records": "6"}'])
def test_a_shard_marker_conveyor_did_not_write_is_refused_naming_the_file(tiny_model, tmp_path, marker):
    src, out, run_dir = _finished_shards(tiny_model, tmp_path)
    assert _run(tiny_model, src, "-o", out, "--shard", "1/2").code == 0
    out.unlink()
    (run_dir / "shard-1-of-2" / "shard.json").write_text(marker, encoding="utf-8")
    merged = run_in_process("merge", "-o", out)
    assert merged.code == 2 and "shard 1/2" in merged.err and "shard.json is not what conveyor writes" in merged.err


def test_a_deleted_row_below_the_committed_prefix_is_refused_at_the_final_write(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(5)])
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, src, "-o", out).code == 0
    with sqlite3.connect(tmp_path / "out.jsonl.conveyor" / "journal.sqlite") as db:
        db.execute("DELETE FROM rows WHERE idx = 1")
    out.unlink()
    again = _run(tiny_model, src, "-o", out)
    assert again.code == 1 and not out.exists()
    assert "no row for record 1" in again.err and "--restart" in again.err, again.err


def test_a_shard_count_past_the_bound_is_refused_at_once_leaving_nothing(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = _run(tiny_model, src, "-o", tmp_path / "o.jsonl", "--shard", "5/100000000000")
    assert result.code == 2 and "more than 100,000 shards" in result.err
    assert not (tmp_path / "o.jsonl.conveyor").exists()


@pytest.mark.parametrize("config, option", [("kv_cache_memory: 1\n", "--kv-cache-memory"),
                                            ("regex: '(('\n", "--regex")])
def test_options_the_loaded_model_would_refuse_are_usage_errors_before_it_loads(tiny_model, tmp_path, config,
                                                                                option):
    (tmp_path / "c.yaml").write_text(config, encoding="utf-8")
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = run_in_process("run", src, "-o", tmp_path / "o.jsonl", "--model", tiny_model, "-c", tmp_path / "c.yaml")
    assert result.code == 2 and result.err.startswith(f"conveyor: error: {option}"), result.err
    assert "loading" not in result.err and not (tmp_path / "o.jsonl.conveyor").exists()


def test_a_batch_line_with_an_empty_custom_id_keeps_it_in_its_error_line(tiny_model, tmp_path):
    lines = [{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
             {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}]
    src, out = write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out.jsonl"
    assert _run(tiny_model, src, "-o", out, "--output-format", "openai-batch").code == 3
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [g["custom_id"] for g in got] == ["", "ok"]
    assert "custom_id" in got[0]["error"]["message"] and "takes body.messages" in got[1]["error"]["message"]
