"""A process killed while it writes the output (kill -9 between the temporary file and its rename) leaves that
temporary file beside the output; the run resumed removes it, says so, and writes the output whole. Temporary files
of a live process or of another host are left alone."""

from __future__ import annotations

import os
import signal

from cli_helpers import dead_pid, entry_in_child, read_rows, run_in_process, tiny_run_argv

from conveyor.io.state import atomic

# The output's writer killed after writing a line into the temporary file (the `nth` file it writes), as kill -9 would.
_KILL_IN_WRITE = """import os, signal
from conveyor.io.rows import writers
_write, _calls = writers._write_jsonl, []
def _killed(rows, f, columns):
    _calls.append(1)
    if len(_calls) == {nth}:
        f.write("half a row"); f.flush(); os.kill(os.getpid(), signal.SIGKILL)
    return _write(rows, f, columns)
writers._write_jsonl = _killed
"""


def test_a_kill_while_the_output_is_written_leaves_a_temporary_file_the_resume_removes(tiny_model, tmp_path):
    ids, out, argv = tiny_run_argv(tiny_model, tmp_path, 4, max_tokens=4)
    proc = entry_in_child(argv, setup=_KILL_IN_WRITE.format(nth=1))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [left] = [name for name in os.listdir(tmp_path) if name.startswith(".out.jsonl.tmp-")]
    assert not out.exists()
    live = tmp_path / f".out.jsonl.tmp-{atomic._HOST}-{os.getpid()}-abc"  # a writer still at work: kept
    elsewhere = tmp_path / ".out.jsonl.tmp-0a1b2c3d-1-abc"  # another host's: kept
    other = tmp_path / f".in.jsonl.tmp-{atomic._HOST}-{dead_pid()}-abc"  # not this output's: kept
    for path in (live, elsewhere, other):
        path.write_text("x")

    resumed = run_in_process(*argv[1:])
    assert resumed.code == 0, resumed.err
    assert f"removed the temporary file of {out} that an interrupted write left" in resumed.err
    assert not (tmp_path / left).exists()
    assert all(path.exists() for path in (live, elsewhere, other))
    assert [r["id"] for r in read_rows(out)] == ids


def test_a_kill_while_a_part_is_written_leaves_a_temporary_file_the_resume_removes(tiny_model, tmp_path):
    ids, out, argv = tiny_run_argv(tiny_model, tmp_path, 6, max_tokens=4)
    folder = tmp_path / "parts"
    argv = [*argv[:3], "-o", f"{folder}/", *argv[5:], "--rows-per-file", "2", "--output-format", "jsonl",
            "--checkpoint-every", "1", "--max-num-seqs", "1"]
    proc = entry_in_child(argv, setup=_KILL_IN_WRITE.format(nth=2))  # part 0 written, killed in part 1's
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = sorted(os.listdir(folder))
    assert names[0].startswith(".part-00001.jsonl.tmp-"), names
    assert names[1:] == ["_conveyor_run.json", "part-00000.jsonl"], names
    other_shard = folder / f".part-00001-shard-0-of-2.jsonl.tmp-{atomic._HOST}-{dead_pid()}-abc"
    other_shard.write_text("x")  # another shard's part: that shard's to remove

    resumed = run_in_process(*argv[1:])
    assert resumed.code == 0, resumed.err
    assert f"removed the temporary files of 1 part (part-00001.jsonl) that an interrupted write left in {folder}/" \
        in resumed.err
    assert sorted(os.listdir(folder)) == [other_shard.name, "_conveyor_run.json", "part-00000.jsonl", "part-00001.jsonl",
                                          "part-00002.jsonl"]
    assert [r["id"] for name in ("part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl")
            for r in read_rows(folder / name)] == ids
