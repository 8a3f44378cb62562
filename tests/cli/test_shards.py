"""`--shard I/N` and `conveyor merge`: shards run apart (in any order, each resumable) and their merge equal a
single run row for row, error rows and repeated ids included; a merge with a shard missing, unfinished or run
with other settings is refused naming the shard."""

from __future__ import annotations

import json
import os

import pytest
from cli_helpers import dead_pid, read_rows, run_in_process, stable, tiny_args, write_jsonl

from conveyor.io.state import atomic

RECORDS = [{"id": f"r{i:02d}", "prompt": f"w{i} w{i + 1} " * (1 + i % 5), "max_tokens": 3 + i % 6, "topic": i % 3}
           for i in range(17)]
RECORDS[4] = {"id": "bad", "prompt": ""}  # an error row
RECORDS[9] = {"prompt": "no id: its index is its id"}
RECORDS[12] = {"id": "r02", "prompt": "shard 0 of 3 repeats the id of record 2, in shard 2"}
RECORDS[13] = {"id": "r01", "prompt": "shard 1 of 3 repeats the id of its own record 1"}
OPTS = ("--temperature", "0.8", "--seed", "5", "--keep-fields", "topic")  # (not --quiet: the shards' notes are read)


def _run(tmp_path, tiny_model, src, out, *extra):
    return run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *OPTS, *extra)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("single")
    src = write_jsonl(tmp / "in.jsonl", RECORDS)
    result = _run(tmp, tiny_model, src, tmp / "out.jsonl")
    assert result.code == 3, result.err  # the bad record and the repeated ids
    return read_rows(tmp / "out.jsonl")


def test_shards_in_any_order_then_the_last_writes_what_a_single_run_does(tmp_path, tiny_model, single):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    for i in (2, 0):
        result = _run(tmp_path, tiny_model, src, out, "--shard", f"{i}/3")
        assert result.code in (0, 3), result.err
        assert "waiting for shard" in result.err and not out.exists()
    result = _run(tmp_path, tiny_model, src, out, "--shard", "1/3")
    assert result.code == 3 and "all 3 shards done" in result.err, result.err
    rows = read_rows(out)
    assert stable(rows) == stable(single) and [r["index"] for r in rows] == list(range(len(RECORDS)))
    assert [r["error"] for r in rows] == [r["error"] for r in single]  # the repeated ids' rows too
    assert [r["topic"] for r in rows] == [r.get("topic") for r in RECORDS]
    assert sum("duplicate id" in (r["error"] or "") for r in rows) == 2
    # `conveyor merge` writes the same again, and a shard run again has nothing left to do
    again, base = tmp_path / "again.jsonl", tmp_path / "out.jsonl.conveyor"
    killed = base / f".merge-ids.sqlite.tmp-{atomic._HOST}-{dead_pid()}-abc"  # a merge killed mid-way left it
    live = base / f".merge-ids.sqlite.tmp-{atomic._HOST}-{os.getpid()}-abc"  # a merge at work beside this one
    killed.write_bytes(b"x"), live.write_bytes(b"x")
    result = run_in_process("merge", "-o", again, "--run-dir", base)
    assert result.code == 3 and "merged 3 shards: 17 rows" in result.err, result.err
    assert read_rows(again) == rows
    assert not killed.exists() and live.exists()
    result = _run(tmp_path, tiny_model, src, out, "--shard", "1/3")
    assert result.code == 3 and read_rows(out) == rows


def test_each_shard_resumes_alone_and_parquet_merges(tmp_path, tiny_model, single):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.parquet"
    result = _run(tmp_path, tiny_model, src, out, "--shard", "0/2", "--max-runtime", "0.001s",
                  "--checkpoint-every", "1")
    assert result.code == 75  # stopped early
    result = run_in_process("merge", "-o", out)
    assert result.code == 2 and "shard 0/2 has not finished" in result.err and "shard 1/2" not in result.err
    status = run_in_process("status", out)
    assert status.code == 75 and "(2 shards)" in status.out, status.out  # not finished, resumable
    assert "shard 0/2: " in status.out and "/ 9 done (errors 0), stopped" in status.out, status.out
    assert "resume with: conveyor run" in status.out and "shard 1/2: not started" in status.out
    assert "start shard 1/2 with: conveyor run" in status.out and "--shard 1/2 --max-runtime" in status.out
    for i in (0, 1):
        assert _run(tmp_path, tiny_model, src, out, "--shard", f"{i}/2").code == 3
    assert stable(read_rows(out)) == stable(single)
    status = run_in_process("status", out)
    assert "shard 0/2: 9 / 9 done (errors 2), finished" in status.out and "shard 1/2: 8 / 8 done" in status.out
    assert "all:    17 / 17  (errors 3); 2 of 2 shards finished, 0 running" in status.out, status.out
    assert "written" in status.out


def test_on_error_skip_leaves_every_error_row_out_of_the_merge(tmp_path, tiny_model, single):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    for i in (1, 0):
        assert _run(tmp_path, tiny_model, src, out, "--shard", f"{i}/2", "--on-error", "skip").code == 0
    assert stable(read_rows(out)) == stable([r for r in single if r["status"] == "ok"])
    result = run_in_process("merge", "-o", tmp_path / "again.jsonl")  # (the default run dir is again's)
    assert result.code == 2 and "holds no shards" in result.err
    result = run_in_process("merge", "-o", tmp_path / "again.jsonl", "--run-dir", tmp_path / "out.jsonl.conveyor")
    assert result.code == 0 and "3 error rows left out" in result.err, result.err
    assert read_rows(tmp_path / "again.jsonl") == read_rows(out)


def test_a_missing_or_drifted_shard_is_refused_by_name(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    assert _run(tmp_path, tiny_model, src, out, "--shard", "0/3").code == 0  # its repeated id shows at the merge
    assert _run(tmp_path, tiny_model, src, out, "--shard", "2/3", "--temperature", "0.5").code in (0, 3)
    result = run_in_process("merge", "-o", out)
    assert result.code == 2 and "shard 1/3 is missing" in result.err and "--shard 1/3" in result.err, result.err
    result = _run(tmp_path, tiny_model, src, out, "--shard", "1/3")  # the last: its merge is refused, not its rows
    assert result.code in (0, 3) and "cannot be written yet" in result.err and "shard 2/3" in result.err, result.err
    result = run_in_process("merge", "-o", out)
    assert result.code == 2 and "shard 2/3" in result.err and "temperature: 0.8 -> 0.5" in result.err, result.err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--shard", "3/3"], "--shard: '3/3' is not I/N with 0 <= I < N"),
    (["--shard", "x"], "--shard: 'x' is not I/N"),
    (["--num-workers", "2"], "--num-workers: only with --executor ray"),
])
def test_bad_shard_options_are_usage_errors(tmp_path, tiny_model, args, message):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    result = _run(tmp_path, tiny_model, src, tmp_path / "out.jsonl", *args)
    assert result.code == 2 and message in result.err, result.err


def test_a_shard_of_stdin_is_refused(tmp_path, tiny_model):
    result = run_in_process("run", "-", "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--shard", "0/2",
                            stdin=json.dumps(RECORDS[0]).encode() + b"\n")
    assert result.code == 2 and "must be a file or dataset, not stdin" in result.err


def test_merge_without_shards_says_what_to_do(tmp_path):
    result = run_in_process("merge", "-o", tmp_path / "out.jsonl")
    assert result.code == 2 and "holds no shards" in result.err and "--shard I/N" in result.err
