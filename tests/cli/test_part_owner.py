"""A part folder belongs to one run: a second run pointed at it is refused (exit 2, naming the owner), a part another
run wrote over this run's is written again, a folder whose run's state is gone is replaced only with --restart, and
the message counts only the parts this process wrote."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

OPTS = ("--max-tokens", "4", "--temperature", "0", "--rows-per-file", "3")


def _run(model, src, folder, run_dir, *extra):
    return run_in_process("run", src, "-o", f"{folder}/", "--run-dir", run_dir, *tiny_args(model), *OPTS, *extra)


def _rows(folder) -> list[dict]:
    return [row for path in sorted(folder.glob("part-*.parquet")) for row in read_rows(path)]


def _inputs(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": f"First input, record {i}."} for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "prompt": f"Second input, record {i}."} for i in range(6)])
    return a, b


def test_a_second_run_pointed_at_a_folder_another_run_owns_is_refused(tiny_model, tmp_path):
    a, b = _inputs(tmp_path)
    folder = tmp_path / "shared"
    first = _run(tiny_model, a, folder, tmp_path / "run-a")
    assert first.code == 0, first.err
    assert "wrote 2 parts (6 rows) in" in first.err
    owned = json.loads((folder / "_conveyor_run.json").read_text())
    assert owned["run_dir"] == str((tmp_path / "run-a").resolve())
    second = _run(tiny_model, b, folder, tmp_path / "run-b")
    assert second.code == 2, second.err
    assert f"the folder holds the parts of another run (run directory {tmp_path / 'run-a'}" in second.err
    assert "wrote" not in second.err
    assert [r["id"] for r in _rows(folder)] == [f"a{i}" for i in range(6)]
    restarted = _run(tiny_model, b, folder, tmp_path / "run-b", "--restart")  # (its state is there: never replaced)
    assert restarted.code == 2, restarted.err


def test_a_part_another_run_wrote_over_this_runs_is_written_again(tiny_model, tmp_path):
    a, _ = _inputs(tmp_path)
    folder, run_dir = tmp_path / "out", tmp_path / "run"
    assert _run(tiny_model, a, folder, run_dir).code == 0
    mine = _rows(folder)
    table = pa.Table.from_pylist([dict(r, output="not this run's") for r in mine[:3]])
    pq.write_table(table.replace_schema_metadata({"conveyor.run_id": "0" * 32}), folder / "part-00000.parquet")
    again = _run(tiny_model, a, folder, run_dir)
    assert again.code == 0, again.err
    assert "part-00000.parquet in" in again.err and "is not the part this run wrote (another run wrote it)" in again.err
    assert "wrote 1 part (3 rows) in" in again.err and "beside the 1 part an earlier process" in again.err
    assert _rows(folder) == mine


def test_a_folder_whose_runs_state_is_gone_is_replaced_only_with_restart(tiny_model, tmp_path):
    a, b = _inputs(tmp_path)
    folder, run_dir = tmp_path / "out", tmp_path / "run"
    assert _run(tiny_model, a, folder, run_dir).code == 0
    shutil.rmtree(run_dir)
    refused = _run(tiny_model, b, folder, run_dir)
    assert refused.code == 2 and "or pass --restart to replace them" in refused.err, refused.err
    replaced = _run(tiny_model, b, folder, run_dir, "--restart")
    assert replaced.code == 0, replaced.err
    assert "removed the 2 part files of an earlier run whose state is gone" in replaced.err
    assert [r["id"] for r in _rows(folder)] == [f"b{i}" for i in range(6)]


def test_a_finished_rerun_claims_no_part_it_did_not_write(tiny_model, tmp_path):
    a, _ = _inputs(tmp_path)
    folder, run_dir = tmp_path / "out", tmp_path / "run"
    assert _run(tiny_model, a, folder, run_dir).code == 0
    again = _run(tiny_model, a, folder, run_dir)
    assert again.code == 0, again.err
    assert "wrote" not in again.err
    assert f"{folder}/ holds this run's 2 parts (6 rows), written earlier" in again.err


def test_a_part_killed_before_its_record_is_written_again_where_its_rows_changed(tiny_model, tmp_path):
    import sqlite3

    records = [{"id": f"r{i}", "prompt": f"Record {i}."} for i in range(3)]
    src, folder, run_dir = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", tmp_path / "run"
    assert _run(tiny_model, src, folder, run_dir).code == 0
    with sqlite3.connect(run_dir / "journal.sqlite") as db:  # as a process killed after part 0's rename leaves it
        db.execute("UPDATE parts SET state = 'writing' WHERE part = 0")
    records[1]["prompt"] = "Record one, edited."
    write_jsonl(src, records)
    again = _run(tiny_model, src, folder, run_dir)
    assert again.code == 0, again.err
    fresh = tmp_path / "fresh"
    assert _run(tiny_model, src, fresh, tmp_path / "fresh-run").code == 0
    assert [r["output"] for r in _rows(folder)] == [r["output"] for r in _rows(fresh)]


def test_the_shards_of_one_run_share_its_folder_whoever_makes_the_marker(tmp_path):
    from conveyor.io.rows.parts import MARKER, PartLayout, PartOwner, PartWriter
    from conveyor.io.state.journal import Journal

    folder = tmp_path / "out"
    folder.mkdir()
    owner = PartOwner("a" * 32, str(tmp_path / "run"))
    with Journal(tmp_path / "j0.sqlite") as j0, Journal(tmp_path / "j1.sqlite") as j1:
        writers = [PartWriter(j, PartLayout(str(folder), 3, "jsonl"), owner, lambda *a: 0, print) for j in (j0, j1)]
        writers[1]._write_marker(replace=False)  # (shard 1 makes it between shard 0's look and its own write)
        writers[0]._write_marker(replace=False)
        assert json.loads((folder / MARKER).read_text())["run_id"] == owner.run_id
        stranger = PartWriter(j0, PartLayout(str(folder), 3, "jsonl"), PartOwner("b" * 32, str(tmp_path)), print,
                              print)
        with pytest.raises(Exception, match="holds the parts of another run"):
            stranger._write_marker(replace=False)


def test_a_part_folder_of_error_rows_only_starts_over_with_new_settings(tiny_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("not json\n{\"prompt\": 3}\n", encoding="utf-8")
    folder, run_dir = tmp_path / "out", tmp_path / "run"
    assert _run(tiny_model, src, folder, run_dir).code == 3
    again = _run(tiny_model, src, folder, run_dir, "--max-tokens", "5")
    assert again.code == 3, again.err
    assert "so the run starts over with the new settings" in again.err and len(_rows(folder)) == 2
