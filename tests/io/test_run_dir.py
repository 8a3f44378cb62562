"""RunDir: manifest, lock (live holder refused, dead holder taken over), drift, reset, summary."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.io.records.readers.fingerprint import fingerprint_input
from conveyor.io.state.journal import Journal
from conveyor.io.state.run_dir import (
    DriftError,
    Manifest,
    RunDir,
    RunDirError,
    RunLocked,
)

_HOLD_LOCK = textwrap.dedent("""
    import sys
    from conveyor.io.state.run_dir import RunDir
    RunDir(sys.argv[1]).acquire_lock()
    print("locked", flush=True)
    sys.stdin.read()  # hold until the parent closes our stdin (or kills us)
""")


def manifest(**changes) -> Manifest:
    base = Manifest(
        input_fingerprint="sha256:" + "a" * 64, input_path="prompts.jsonl", model="tiny-llama",
        generation_config={"temperature": 0.0, "max_tokens": 128, "stop": ["\n\n"]},
        tool_version="0.1.0", created_at=1700000000.0, output_path="answers.parquet",
        output_format="parquet",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def run_dir(tmp_path):
    rd = RunDir(tmp_path / "answers.parquet.conveyor")
    yield rd
    rd.release_lock()


@pytest.fixture
def lock_holder_child(run_dir):
    child = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run_dir.path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"locked\n"
    yield child
    if child.poll() is None:
        child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


def test_default_for_sits_next_to_the_output(tmp_path):
    output = tmp_path / "out" / "a.parquet"
    assert RunDir.default_for(str(output)) == tmp_path / "out" / "a.parquet.conveyor"


def test_manifest_round_trip(run_dir):
    assert run_dir.load_manifest() is None
    m = manifest()
    run_dir.write_manifest(m)
    assert run_dir.load_manifest() == m
    assert Manifest.from_json(m.to_json()) == m
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["manifest.json"]  # no temp left


def test_unreadable_manifest_names_the_file(run_dir):
    run_dir.path.mkdir()
    run_dir.manifest_path.write_text('{"model": "x"}')
    with pytest.raises(RunDirError, match="manifest.json is unreadable.*input_fingerprint"):
        run_dir.load_manifest()


def test_second_process_is_refused_while_the_first_is_alive(run_dir, lock_holder_child):
    with pytest.raises(RunLocked) as info:
        run_dir.acquire_lock()
    message = str(info.value)
    assert f"in use by process {lock_holder_child.pid}" in message and str(run_dir.path) in message
    assert run_dir.lock_holder()["pid"] == lock_holder_child.pid
    with pytest.raises(RunLocked):
        run_dir.reset()  # never wipe the state of a live run
    lock_holder_child.stdin.close()  # the holder exits normally
    lock_holder_child.wait()
    assert run_dir.lock_holder() is None
    run_dir.acquire_lock()
    assert run_dir.lock_holder()["pid"] == os.getpid()


def test_lock_of_a_killed_process_is_taken_over(run_dir, lock_holder_child):
    os.kill(lock_holder_child.pid, signal.SIGKILL)
    lock_holder_child.wait()
    assert str(lock_holder_child.pid) in run_dir.lock_path.read_text()  # the stale file stays
    assert run_dir.lock_holder() is None
    run_dir.acquire_lock()
    assert run_dir.lock_holder()["pid"] == os.getpid()


def test_lock_is_exclusive_within_one_process_too(run_dir):
    run_dir.acquire_lock()
    run_dir.acquire_lock()  # idempotent for the holder
    other = RunDir(run_dir.path)
    with pytest.raises(RunLocked, match=f"process {os.getpid()}"):
        other.acquire_lock()
    assert other.lock_holder()["pid"] == os.getpid()
    run_dir.release_lock()
    assert other.lock_holder() is None
    other.acquire_lock()
    other.release_lock()


def test_same_settings_are_not_drift(run_dir):
    run_dir.check_drift(manifest())  # nothing stored yet
    run_dir.write_manifest(manifest())
    run_dir.check_drift(manifest(tool_version="0.2.0", created_at=1.0, input_path="moved.jsonl"))
    # A tuple stored as a JSON list is still the same value.
    run_dir.check_drift(manifest(generation_config={"temperature": 0.0, "max_tokens": 128,
                                                    "stop": ("\n\n",)}))


def test_changed_input_is_refused(run_dir):
    run_dir.write_manifest(manifest())
    with pytest.raises(DriftError) as info:
        run_dir.check_drift(manifest(input_fingerprint="sha256:" + "b" * 64))
    assert info.value.changed == ("input",)
    assert str(info.value) == (
        "the input file changed since this run started (fingerprint sha256:aaaaaaaaaaaa -> "
        "sha256:bbbbbbbbbbbb); run with --restart to start over (a run's finished rows are set aside, and taken "
        "back by a later run with its settings)"
    )


def test_changed_model_is_refused(run_dir):
    run_dir.write_manifest(manifest())
    with pytest.raises(DriftError, match=r"model changed .*\(tiny-llama -> qwen-0.5b\)") as info:
        run_dir.check_drift(manifest(model="qwen-0.5b"))
    assert info.value.changed == ("model",)


def test_changed_generation_config_lists_each_key(run_dir):
    run_dir.write_manifest(manifest())
    new = {"temperature": 0.7, "stop": ["\n\n"], "seed": 1}
    with pytest.raises(DriftError) as info:
        run_dir.check_drift(manifest(generation_config=new))
    assert info.value.changed == ("generation_config",)
    assert "(max_tokens: 128 -> <unset>, seed: <unset> -> 1, temperature: 0.0 -> 0.7)" in str(
        info.value
    )


def test_several_changes_are_all_named(run_dir):
    run_dir.write_manifest(manifest())
    with pytest.raises(DriftError) as info:
        run_dir.check_drift(manifest(model="other", input_fingerprint="sha256:" + "c" * 64))
    assert info.value.changed == ("input", "model")


def test_a_journal_without_its_manifest_is_refused_naming_both_files(run_dir):
    run_dir.path.mkdir()
    with Journal(run_dir.journal_path) as j:
        j.add({"index": 0, "id": "0", "status": "ok"})
        j.commit()
    with pytest.raises(RunDirError) as info:
        run_dir.open_journal(manifest())
    assert str(run_dir.journal_path) in str(info.value) and str(run_dir.manifest_path) in str(info.value)
    assert not run_dir.manifest_path.exists()  # nothing adopted
    run_dir.reset()  # nothing of conveyor's to delete: the journal stays
    assert run_dir.journal_path.exists()


def test_a_run_with_no_committed_rows_starts_over_with_new_settings(run_dir):
    run_dir.write_manifest(manifest())
    Journal(run_dir.journal_path).close()
    new = manifest(model="other", input_fingerprint="sha256:" + "c" * 64)
    journal, note = run_dir.open_journal(new)
    journal.close()
    assert "starts over" in note and "model changed" in note
    assert run_dir.load_manifest().model == "other"
    with Journal(run_dir.journal_path) as j:
        j.add({"index": 0, "id": "0", "status": "ok"})
        j.commit()
    with pytest.raises(DriftError, match="model changed"):
        run_dir.open_journal(manifest())  # now it holds a row: the change is refused


def test_reset_deletes_only_what_the_manifest_lists(run_dir):
    run_dir.path.mkdir()
    (run_dir.path / "notes.txt").write_text("mine")
    (run_dir.path / "journal.sqlite").write_text("not conveyor's")
    run_dir.reset()  # no manifest: nothing is conveyor's
    assert (run_dir.path / "journal.sqlite").read_text() == "not conveyor's"
    (run_dir.path / "journal.sqlite").unlink()
    run_dir.write_manifest(manifest())
    Journal(run_dir.journal_path).close()
    run_dir.reset()
    assert not run_dir.journal_path.exists() and not run_dir.manifest_path.exists()
    assert (run_dir.path / "notes.txt").read_text() == "mine"


def test_an_unreadable_manifest_is_named(run_dir):
    run_dir.path.mkdir()
    run_dir.manifest_path.write_bytes(b"\xff\xfe{not utf-8")
    with pytest.raises(RunDirError, match=str(run_dir.manifest_path)):
        run_dir.load_manifest()


def test_reset_deletes_state_and_keeps_the_lock(run_dir):
    run_dir.acquire_lock()
    run_dir.write_manifest(manifest())
    with Journal(run_dir.journal_path) as j:
        j.add({"index": 0, "id": "0", "status": "ok"})
        j.commit()
    run_dir.reset()
    assert run_dir.load_manifest() is None
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["lock"]
    with pytest.raises(RunLocked):
        RunDir(run_dir.path).acquire_lock()
    with Journal(run_dir.journal_path) as j:
        assert j.num_committed() == 0


def test_summary_reports_manifest_journal_and_holder(run_dir):
    assert run_dir.summary() == {"run_dir": str(run_dir.path), "has_manifest": False,
                                 "lock_holder": None}
    run_dir.acquire_lock()
    run_dir.write_manifest(manifest())
    with Journal(run_dir.journal_path) as j:
        j.add({"index": 0, "id": "0", "status": "ok"})
        j.add({"index": 2, "id": "2", "status": "error"})
        j.commit()
        summary = run_dir.summary()  # beside an open writer
    assert summary["model"] == "tiny-llama" and summary["has_manifest"]
    assert summary["num_committed"] == 2 and summary["num_errors"] == 1
    assert summary["contiguous_prefix"] == 1 and summary["last_commit_time"] is not None
    assert summary["lock_holder"]["pid"] == os.getpid()


def test_summary_reports_a_corrupt_journal_instead_of_failing(run_dir):
    run_dir.path.mkdir()
    run_dir.journal_path.write_bytes(b"garbage" * 1000)
    assert "--restart" in run_dir.summary()["journal_error"]


def test_fingerprint_follows_content_not_mtime(tmp_path: Path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    first = fingerprint_input(f)
    os.utime(f, (1, 1))
    assert fingerprint_input(f) == first
    f.write_text('{"prompt": "b"}\n')
    assert fingerprint_input(f) != first
    with pytest.raises(FileNotFoundError):
        fingerprint_input(tmp_path / "missing.jsonl")
