"""Part-file output (`-o folder/`, `--rows-per-file N`): parts appear while the run goes and read as one table in
input order; a kill -9 and resume writes each part exactly once; the folder is checked against the journal (a
stray part, a changed part size, a removed part, an input that grew, --restart, shards)."""

from __future__ import annotations

import json
import os
import sqlite3

import pyarrow.dataset as ds
from cli_helpers import STOP_AFTER_PART, Child, num_committed, run_in_process, stable, tiny_args, write_jsonl

RECORDS = [{"id": f"r{i}", "prompt": f"Count the letters of word number {i}, then say why."} for i in range(48)]
GREEDY = ["--max-tokens", "24", "--temperature", "0", "--max-num-seqs", "4"]


def _table(folder) -> list[dict]:
    """The folder as one table (pyarrow.dataset, the way DuckDB and datasets read it), rows in file order."""
    return ds.dataset(str(folder), format="parquet").to_table().to_pylist()


def _files(folder) -> dict[str, tuple[int, int]]:
    """Each part file's (inode, mtime_ns): a part written again is another file, written later."""
    return {name: (os.stat(folder / name).st_ino, os.stat(folder / name).st_mtime_ns)
            for name in sorted(os.listdir(folder)) if name.startswith("part-")}


def _single(tmp_path, tiny_model, src) -> list[dict]:
    out = tmp_path / "single.jsonl"
    result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *GREEDY, "-q")
    assert result.code == 0, result.err
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_parts_appear_while_the_run_goes_and_kill_9_resume_writes_each_once(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    folder = tmp_path / "answers"
    command = ["run", src, "-o", f"{folder}/", "--rows-per-file", "10", *tiny_args(tiny_model), *GREEDY,
               "--checkpoint-every", "2", "--max-num-seqs", "2"]
    child = Child(command, tmp_path, "killed", setup=STOP_AFTER_PART.format(part=1))
    child.wait_until(child.is_stopped, what="the second part")  # (it stops itself there, mid-run)
    seen = _table(folder)  # the rows so far, in input order, from whole parts only
    assert len(seen) == 20
    assert [row["index"] for row in seen] == list(range(len(seen)))
    assert num_committed(tmp_path / "answers.conveyor") < len(RECORDS)
    before = _files(folder)
    child.kill9()

    result = run_in_process("run", *command[1:], "-q")
    assert result.code == 0, result.err
    said = next(line for line in result.err_lines if " wrote " in line or "wrote " in line)
    assert f"in {folder}/, beside the 2 parts an earlier process of this run wrote (5 parts, 48 rows in all)" in said
    assert "; wrote 3 parts (28 rows) in" in said
    after = _files(folder)
    assert list(after) == [f"part-0000{k}.parquet" for k in range(5)]
    assert all(after[name] == before[name] for name in before), "a part written before the kill was written again"
    assert stable(_table(folder)) == stable(_single(tmp_path, tiny_model, src))

    again = run_in_process("run", *command[1:], "-q")  # finished: nothing is computed or written again
    assert again.code == 0, again.err
    assert _files(folder) == after


def test_a_part_killed_between_its_file_and_its_record_is_kept_and_a_lost_one_written_again(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:20])
    folder = tmp_path / "out"
    args = ["run", src, "-o", f"{folder}/", "--rows-per-file", "5", *tiny_args(tiny_model), *GREEDY, "-q"]
    assert run_in_process(*args).code == 0
    files = _files(folder)
    journal = tmp_path / "out.conveyor" / "journal.sqlite"
    with sqlite3.connect(journal) as db:  # as a process killed after part 1's rename, before its record, leaves it
        db.execute("UPDATE parts SET state = 'writing' WHERE part = 1")
    (folder / "part-00003.parquet").unlink()  # and a part removed by hand
    result = run_in_process(*args[:-1])
    assert result.code == 0, result.err
    assert "1 part written earlier is not in" in result.err and "(part-00003.parquet): written again" in result.err
    now = _files(folder)
    assert now["part-00001.parquet"] == files["part-00001.parquet"]
    assert [now[n] == files[n] for n in sorted(files)] == [True, True, True, False]
    assert [row["index"] for row in _table(folder)] == list(range(20))
    with sqlite3.connect(journal) as db:
        assert db.execute("SELECT part, state, rows FROM parts ORDER BY part").fetchall() == \
            [(k, "written", 5) for k in range(4)]


def _dies(*args, **kwargs):
    raise OSError("died while writing")


def test_the_folder_is_checked_against_the_run(tmp_path, tiny_model, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:12])
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "part-00000.parquet").write_bytes(b"not ours")
    args = ["run", src, "-o", folder, *tiny_args(tiny_model), *GREEDY, "--output-format", "jsonl", "-q"]
    refused = run_in_process(*args[:-3], "-q")  # an existing folder is a part-file output (Parquet by default)
    assert refused.code == 2 and "holds part files this run did not write (part-00000.parquet)" in refused.err
    result = run_in_process(*args, "--rows-per-file", "5")  # JSONL parts are another layout's names: no clash
    assert result.code == 0, result.err
    assert sorted(os.listdir(folder)) == ["_conveyor_run.json", "part-00000.jsonl", "part-00000.parquet",
                                          "part-00001.jsonl", "part-00002.jsonl"]
    lines = [json.loads(line) for k in range(3) for line in (folder / f"part-0000{k}.jsonl").read_text().splitlines()]
    assert [row["index"] for row in lines] == list(range(12))

    changed = run_in_process(*args, "--rows-per-file", "4")
    assert changed.code == 2 and "--rows-per-file 4" in changed.err and "resume with --rows-per-file 5" in changed.err

    grown = write_jsonl(tmp_path / "in.jsonl", RECORDS[:17])  # the input grew: the last part now holds more records
    files = _files(folder)
    with monkeypatch.context() as patch:  # a process that dies while it writes the longer last part again
        patch.setattr("conveyor.io.rows.writers._write_jsonl", _dies)
        died = run_in_process("run", grown, *args[2:], "--rows-per-file", "5")
    assert died.code == 1 and "died while writing" in died.err, died.err
    assert "part-00002.jsonl" not in os.listdir(folder)  # the shorter one is gone, never taken for the longer one
    result = run_in_process("run", grown, *args[2:], "--rows-per-file", "5")
    assert result.code == 0, result.err
    now = _files(folder)
    assert now["part-00000.jsonl"] == files["part-00000.jsonl"] and now["part-00001.jsonl"] == files["part-00001.jsonl"]
    assert now["part-00002.jsonl"] != files["part-00002.jsonl"] and "part-00003.jsonl" in now
    assert len((folder / "part-00002.jsonl").read_text().splitlines()) == 5

    edited = write_jsonl(tmp_path / "in.jsonl", [*RECORDS[:7], {"id": "r7", "prompt": "Edited."}, *RECORDS[8:17]])
    files = _files(folder)
    result = run_in_process("run", edited, *args[2:-1], "--rows-per-file", "5")  # a record of part 1 changed
    assert result.code == 0, result.err
    assert "1 part held rows that changed (part-00001.jsonl)" in result.err
    now = _files(folder)
    assert [now[f"part-0000{k}.jsonl"] == files[f"part-0000{k}.jsonl"] for k in range(4)] == [True, False, True, True]
    rows = [json.loads(line) for line in (folder / "part-00001.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == [5, 6, 7, 8, 9] and rows[2]["id"] == "r7"

    restart = run_in_process(*args, "--rows-per-file", "6", "--restart")
    assert restart.code == 0, restart.err
    assert sorted(n for n in os.listdir(folder) if n.endswith(".jsonl")) == \
        ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]


def test_bad_part_options_are_usage_errors(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    for args, message in ((["-o", tmp_path / "x.parquet", "--rows-per-file", "5"], "names a file"),
                          (["-o", "-", "--rows-per-file", "5", "--run-dir", tmp_path / "rd"], "not to stdout"),
                          (["-o", f"{tmp_path}/p/", "--rows-per-file", "0"], "--rows-per-file")):
        result = run_in_process("run", src, *args, *tiny_args(tiny_model))
        assert result.code == 2 and message in result.err, (args, result.err)


def test_shards_write_their_own_parts_into_one_folder(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:23])
    folder = tmp_path / "out"
    for shard in ("1/2", "0/2"):
        result = run_in_process("run", src, "-o", f"{folder}/", "--rows-per-file", "10", "--shard", shard,
                                *tiny_args(tiny_model), *GREEDY, "-q")
        assert result.code == 0, result.err
    assert sorted(os.listdir(folder)) == ["_conveyor_run.json", *(f"part-0000{k}-shard-{s}-of-2.parquet"
                                                                   for k in range(3) for s in range(2))]
    rows = sorted(_table(folder), key=lambda row: row["index"])
    assert stable(rows) == stable(_single(tmp_path, tiny_model, src))
    status = run_in_process("status", f"{folder}/")
    assert status.code == 0 and "6 parts written in" in status.out, status.out
    merge = run_in_process("merge", f"{folder}/")
    assert merge.code == 2 and "nothing to merge" in merge.err


def test_status_counts_the_parts(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:9])
    result = run_in_process("run", src, "-o", tmp_path / "out", "--rows-per-file", "4", *tiny_args(tiny_model),
                            *GREEDY, "-q", "--limit", "5")
    assert result.code == 0, result.err
    status = run_in_process("status", tmp_path / "out")
    assert "parts:  2 written" in status.out and "finished: every part is written" in status.out, status.out
    assert status.code == 0


def test_parts_have_the_columns_the_runs_settings_fill(tmp_path, tiny_model):
    """The same columns as a single output file: the optional ones only where the settings (or the rows when the
    first part is written) fill them, fixed for every part."""
    import pyarrow.parquet as pq

    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:6])
    single = tmp_path / "single.parquet"
    assert run_in_process("run", src, "-o", single, *tiny_args(tiny_model), *GREEDY, "-q").code == 0
    plain = tmp_path / "plain"
    assert run_in_process("run", src, "-o", f"{plain}/", "--rows-per-file", "3", *tiny_args(tiny_model), *GREEDY,
                          "-q").code == 0
    names = pq.read_schema(single).names
    assert [pq.read_schema(p).names for p in sorted(plain.glob("part-*"))] == [names, names]
    with_logprobs = tmp_path / "lp"
    assert run_in_process("run", src, "-o", f"{with_logprobs}/", "--rows-per-file", "3", *tiny_args(tiny_model),
                          *GREEDY, "--logprobs", "1", "-q").code == 0
    assert [pq.read_schema(p).names for p in sorted(with_logprobs.glob("part-*"))] == [names + ["logprobs"]] * 2
