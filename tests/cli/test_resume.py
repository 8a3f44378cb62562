"""Checkpoint and resume: kill -9, SIGTERM, --max-runtime, locks, drift, status and disk-full errors.

The kill -9 tests run the real embedded model in child processes and kill them at moments drawn from
a seeded RNG (one before any commit, the others after a random number of committed rows); the run
is then finished with the same command and must equal an uninterrupted run row for row.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import sqlite3
import time

import pytest
from cli_helpers import (
    Child,
    assert_same_rows,
    entry_in_child,
    journal_state,
    num_committed,
    read_rows,
    run_in_process,
    tiny_args,
    write_jsonl,
)

from conveyor.core.backends.cpu.kernels import cpu_kernels, native_bf16

TOPICS = ["the moon", "bread", "rivers", "chess", "bees", "volcanoes", "libraries", "trains", "owls", "glass",
          "tea", "bridges", "maps", "snow", "violins", "deserts"]
# Per-record max_tokens from 6 to 16: with 4 requests running, they finish one by one, so every
# resume meets a different batch composition.
CHAT_RECORDS = [{"id": f"q{i:02d}", "messages": [{"role": "user", "content": f"Tell me one short fact about {t}."}],
                 "max_tokens": 6 + (i * 5) % 11} for i, t in enumerate(TOPICS)]


def _lock_pid(run_dir) -> int | None:
    try:
        return json.loads((run_dir / "lock").read_text() or "{}").get("pid")
    except (OSError, ValueError):
        return None


def _has_journal(run_dir) -> bool:
    try:
        journal_state(run_dir)
    except Exception:  # noqa: BLE001 - being created
        return False
    return (run_dir / "journal.sqlite").exists()


def _kill_resume_and_compare(tmp_path, rng_seed: int, options: list[str], probe_lock: bool) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", CHAT_RECORDS)
    reference = run_in_process("run", source, "-o", tmp_path / "reference.jsonl", *options, "-q")
    assert reference.code == 0, reference.err
    expected = read_rows(tmp_path / "reference.jsonl")
    assert all(r["status"] == "ok" for r in expected)

    output = tmp_path / "out.jsonl"
    run_dir = tmp_path / "out.jsonl.conveyor"
    command = ["run", source, "-o", output, *options]
    rng = random.Random(rng_seed)
    first = rng.randint(2, 5)
    # (moment, rows that must be committed, seconds to wait after that, must the journal have a gap).
    # The first kill lands while the model loads (the lock is taken, nothing committed); the last
    # one when a row beyond the contiguous prefix is committed but an earlier one is not, so the
    # resumed run must skip the committed row and redo the missing ones.
    moments = [("before any commit", 0, rng.uniform(0.0, 1.0), False),
               ("mid-run", first, rng.uniform(0.0, 0.5), False),
               ("mid-run, with a gap", rng.randint(first + 2, 9), 0.0, True)]
    done_before = 0
    for k, (when, min_committed, delay, needs_gap) in enumerate(moments):
        child = Child(command, tmp_path, f"killed-{k}")
        child.wait_until(lambda child=child: _lock_pid(run_dir) == child.pid and _has_journal(run_dir),
                         what="the lock and the journal")
        if probe_lock and k == 1:
            _check_lock_refusal_and_status_while_running(command, output, child.pid)

        def ready(committed: int, prefix: int, min_committed=min_committed, needs_gap=needs_gap) -> bool:
            return committed >= min_committed and (committed > prefix or not needs_gap)

        seen, _ = _freeze_when(child, run_dir, ready, delay, what=f"kill {k} ({when})")
        killed = child.kill9()
        assert killed.code == -signal.SIGKILL, f"the run ended ({killed.code}) before kill {k}: {killed.err[-2000:]}"
        # Frozen, then killed: the journal holds at least what a reader saw while it was frozen. It may
        # hold one commit more: a writer stopped after its commit frame reached the WAL but before the
        # shared index said so has committed (the next opener recovers the frame from the WAL).
        done, prefix = journal_state(run_dir)
        assert seen <= done <= seen + 1
        assert done >= done_before
        if not min_committed:
            assert done == 0, f"kill {k} was meant to land before any commit, but {done} rows were committed"
        assert done < len(CHAT_RECORDS), f"kill {k} ({when}) came after the last commit"
        assert not output.exists(), "an output file appeared before the run finished"
        assert _lock_pid(run_dir) == child.pid  # the dead process's lock is left behind: stale
        done_before = done

    status = run_in_process("status", output)
    assert status.code == 75, status.err  # not finished, resumable
    assert f"done:   {done_before} / {len(CHAT_RECORDS)}" in status.out
    assert "running: no" in status.out
    assert "resume with: conveyor run" in status.out and str(source) in status.out

    # A temp file left by a writer killed mid-write must not count as (or block) the output.
    (tmp_path / ".out.jsonl.tmp-999999").write_text('{"id": "torn"')
    final = run_in_process(*command)  # the same command: takes over the stale lock and resumes
    assert final.code == 0, final.err
    if done_before:
        assert f"resuming: {done_before} records already done" in final.err
    assert_same_rows(read_rows(output), expected)


def _freeze_when(child: Child, run_dir, ready, delay: float, what: str) -> tuple[int, int]:
    """Wait until ready(committed, prefix) holds, wait `delay` s more, then SIGSTOP the child at a
    moment when it still holds (reading the journal of a frozen writer cannot race a commit)."""
    child.wait_until(lambda: ready(*journal_state(run_dir, strict=False)), what=what)
    time.sleep(delay)
    while True:
        child.freeze()
        try:
            state = journal_state(run_dir)
        except sqlite3.OperationalError:  # frozen inside a WAL write that blocks readers: let it finish
            state = None
        if state is not None and ready(*state):
            return state
        child.send(signal.SIGCONT)
        child.wait_until(lambda: ready(*journal_state(run_dir, strict=False)), what=what)


def _check_lock_refusal_and_status_while_running(command, output, pid: int) -> None:
    second = run_in_process(*command)
    assert second.code == 2
    assert f"process {pid}" in second.err and "in use" in second.err
    assert len(second.err_lines) == 1 and "Traceback" not in second.err
    status = run_in_process("status", output)
    assert status.code == 75 and f"running: yes, process {pid}" in status.out


REAL = ["--max-num-seqs", "4", "--max-tokens", "16"]


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is not None, reason="the seeded test below covers it (and probes the lock) where "
                    "the exact cpu backend runs")
def test_kill_9_greedy_resumes_to_the_same_output(tmp_path):
    _kill_resume_and_compare(tmp_path, 11, [*REAL, "--dtype", "float32", "--temperature", "0", "--checkpoint-every",
                                            "1"], probe_lock=True)


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="sampled bits equal across a resume need the exact cpu backend "
                    "(conveyor's C++ kernels), which does not run on this CPU")
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)"))])
def test_kill_9_seeded_sampling_resumes_to_the_same_output(tmp_path, dtype):
    """(Greedy decoding is the same path with temperature 0: a seeded draw replays exactly what greedy does not
    need to.) In float32 the lock's refusal and `status` are probed while the run goes."""
    _kill_resume_and_compare(tmp_path, 12, [*REAL, "--dtype", dtype, "--temperature", "0.8", "--top-p", "0.95",
                                            "--seed", "1234", "--checkpoint-every", "2" if dtype == "bfloat16" else "1"],
                             probe_lock=dtype == "float32")


# -- stopping on purpose (tiny model) ----------------------------------------------------------------

MANY = [{"id": f"m{i:03d}", "prompt": f"record {i} begins with"} for i in range(400)]


def _many_options(tiny_model) -> list[str]:
    return [*tiny_args(tiny_model), "--max-tokens", "8", "--ignore-eos", "--max-num-seqs", "8",
            "--checkpoint-every", "4", "--temperature", "0"]


@pytest.fixture(scope="module")
def many(tiny_model, tmp_path_factory):
    """400 short records and their uninterrupted output."""
    tmp = tmp_path_factory.mktemp("many")
    source = write_jsonl(tmp / "many.jsonl", MANY)
    result = run_in_process("run", source, "-o", tmp / "reference.jsonl", *_many_options(tiny_model), "-q")
    assert result.code == 0, result.err
    return source, read_rows(tmp / "reference.jsonl")


def test_sigterm_stops_with_75_and_resumes(many, tiny_model, tmp_path):
    source, expected = many
    output, run_dir = tmp_path / "out.jsonl", tmp_path / "out.jsonl.conveyor"
    command = ["run", source, "-o", output, *_many_options(tiny_model)]
    # While the model loads (a cron job's timeout can land there too): still a clean stop. (The signal is sent by
    # the child itself as the load begins: a poller starved for a second would see it land after the first commits.)
    loading = entry_in_child(["conveyor", *map(str, command)], setup=(
        "import os, signal\n"
        "from conveyor.io.run import Run\n"
        "_load = Run.load_engine\n"
        "def _signalled(self):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return _load(self)\n"
        "Run.load_engine = _signalled\n"))
    assert loading.returncode == 75, loading.stderr
    assert "SIGTERM received" in loading.stderr
    assert num_committed(run_dir) == 0 and not output.exists()

    child = Child(command, tmp_path, "terminated")
    child.wait_until(lambda: num_committed(run_dir, strict=False) >= 40, what="40 commits")
    child.send(signal.SIGTERM)
    stopped = child.wait()
    assert stopped.code == 75, stopped.err
    assert "SIGTERM" in stopped.err and "run the same command again to resume" in stopped.err
    assert "Traceback" not in stopped.err
    assert not output.exists()
    done = num_committed(run_dir)
    assert 40 <= done < len(MANY)
    status = run_in_process("status", output)
    assert f"done:   {done} / {len(MANY)}" in status.out and "running: no" in status.out
    resumed = run_in_process(*command)
    assert resumed.code == 0, resumed.err
    assert f"resuming: {done} records already done" in resumed.err
    assert_same_rows(read_rows(output), expected)


def test_max_runtime_stops_with_75_and_resumes(many, tiny_model, tmp_path):
    source, expected = many
    output = tmp_path / "out.parquet"
    command = ["run", source, "-o", output, *_many_options(tiny_model), "-q"]
    # A deadline already past at the run loop's first check: the stop does not depend on how fast
    # this machine gets through the records (with 1s, a fast run finished them all first).
    stopped = run_in_process(*command, "--max-runtime", "0.001s")
    assert stopped.code == 75, stopped.err
    assert len(stopped.err_lines) == 1 and "records have a row (0 errors); stopped (max-runtime)" in stopped.err
    # (--quiet: one closing line, for a cron job's log)
    told = run_in_process(*command[:-1], "--max-runtime", "0.001s")
    assert told.code == 75 and "stopped (max-runtime" in told.err, told.err
    assert not output.exists()
    assert num_committed(tmp_path / "out.parquet.conveyor") < len(MANY)
    resumed = run_in_process(*command)  # --max-runtime is not part of the run's identity
    assert resumed.code == 0, resumed.err
    assert_same_rows(read_rows(output), expected)


# -- drift, restart, status --------------------------------------------------------------------------

FEW = [{"id": f"f{i}", "prompt": f"few {i}"} for i in range(5)]


def test_settings_drift_is_refused_naming_what_changed_and_restart_starts_over(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", FEW)
    output = tmp_path / "out.jsonl"
    base = ["run", source, "-o", output, "--kv-cache-memory", "8MiB", "--max-tokens", "3", "-q"]
    first = run_in_process(*base, "--model", tiny_model)
    assert first.code == 0, first.err

    changed_temperature = run_in_process(*base, "--model", tiny_model, "--temperature", "0.5")
    assert changed_temperature.code == 2
    assert "temperature" in changed_temperature.err and "input file" not in changed_temperature.err
    assert "--restart" in changed_temperature.err and len(changed_temperature.err_lines) == 1

    other_model = tmp_path / "same-weights-other-name"
    os.symlink(tiny_model, other_model)
    changed_model = run_in_process(*base, "--model", other_model)
    assert changed_model.code == 2
    assert "model changed" in changed_model.err and str(other_model) in changed_model.err

    assert output.exists() and len(read_rows(output)) == 5  # the refused runs touched nothing
    write_jsonl(source, FEW + [{"id": "f5", "prompt": "a new record"}])
    changed_input = run_in_process(*base, "--model", tiny_model, "--temperature", "0.5")  # the input and a setting
    assert changed_input.code == 2
    assert "input file changed" in changed_input.err and "temperature" in changed_input.err

    restarted = run_in_process(*base, "--model", tiny_model, "--temperature", "0.5", "--restart")
    assert restarted.code == 0, restarted.err
    rows = read_rows(output)
    assert [r["id"] for r in rows] == [f"f{i}" for i in range(6)] and all(r["status"] == "ok" for r in rows)


def test_dtype_auto_is_recorded_as_the_dtype_it_chose_here(tiny_model, tmp_path):
    """auto is bf16 where the CPU has native bf16, float32 elsewhere; the manifest keeps what it chose, so the
    same run resumed where auto means the other dtype is refused instead of mixing two arithmetics."""
    import torch

    from conveyor.core.backends import auto_dtype

    chosen = auto_dtype(torch.device("cpu"))
    assert chosen == ("bfloat16" if native_bf16() else "float32")
    source = write_jsonl(tmp_path / "in.jsonl", FEW)
    output = tmp_path / "out.jsonl"
    base = ["run", source, "-o", output, *tiny_args(tiny_model), "--max-tokens", "3", "-q"]
    assert run_in_process(*base).code == 0
    manifest = json.loads((tmp_path / "out.jsonl.conveyor" / "manifest.json").read_text())
    assert manifest["generation_config"]["dtype"] == chosen
    same = run_in_process(*base, "--dtype", chosen)
    assert same.code == 0, same.err
    other = run_in_process(*base, "--dtype", "float32" if chosen == "bfloat16" else "bfloat16")
    assert other.code == 2 and "dtype" in other.err


def test_a_window_that_ends_before_generation_says_so_and_the_resume_command_keeps_the_progress(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", FEW)
    output = tmp_path / "out.jsonl"
    command = ["run", source, "-o", output, *tiny_args(tiny_model), "--max-tokens", "3"]
    done = run_in_process(*command, "--limit", "2", "-q")
    assert done.code == 0, done.err
    stopped = run_in_process(*command, "--restart", "--max-runtime", "0.001s")
    assert stopped.code == 75
    assert "the --max-runtime window of 0.001 s ended before generation began (loading the model took" in stopped.err
    assert "give a longer --max-runtime" in stopped.err
    status = run_in_process("status", output)
    resume = next(line for line in status.out.splitlines() if line.startswith("resume with: "))
    assert "--restart" not in resume and "--max-runtime 0.001s" in resume  # (a resume never discards the state)


def test_status_without_a_run_is_a_usage_error(tmp_path):
    result = run_in_process("status", tmp_path / "never.parquet")
    assert result.code == 2 and "no run directory" in result.err


# -- disk full ----------------------------------------------------------------------------------------


def _enospc_setup(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"d{i}", "prompt": f"disk {i}"} for i in range(12)])
    options = [*tiny_args(tiny_model), "--max-tokens", "3", "--checkpoint-every", "2", "--max-num-seqs", "2", "-q"]
    reference = run_in_process("run", source, "-o", tmp_path / "reference.jsonl", *options)
    assert reference.code == 0, reference.err
    return ["run", source, "-o", tmp_path / "out.jsonl", *options], read_rows(tmp_path / "reference.jsonl")


def _assert_one_line_disk_full(result, *words) -> None:
    assert result.code == 1
    assert len(result.err_lines) == 1 and "Traceback" not in result.err, result.err
    assert "no space left on device" in result.err.lower()
    for word in words:
        assert word in result.err


def test_disk_full_while_writing_the_output_exits_1_and_reruns_cleanly(tiny_model, tmp_path, monkeypatch):
    from conveyor.io.rows.writers import write_output

    command, expected = _enospc_setup(tiny_model, tmp_path)
    written = []

    def full_disk_after_3_rows(rows, *args, **kwargs):
        def rows_then_enospc():
            for row in rows:
                if len(written) == 3:
                    raise OSError(errno.ENOSPC, "No space left on device")
                written.append(row)
                yield row

        return write_output(rows_then_enospc(), *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("conveyor.io.run_output.write_output", full_disk_after_3_rows)
        failed = run_in_process(*command)
    _assert_one_line_disk_full(failed, "run the same command again")
    assert len(written) == 3  # the writer had started
    assert not (tmp_path / "out.jsonl").exists(), "a half-written output file was left"
    assert not list(tmp_path.glob(".out.jsonl.tmp-*")), "the writer's temp file was left behind"
    assert num_committed(tmp_path / "out.jsonl.conveyor") == len(expected)  # the journal kept every row

    again = run_in_process(*command)
    assert again.code == 0, again.err
    assert_same_rows(read_rows(tmp_path / "out.jsonl"), expected)
    assert not list(tmp_path.glob(".out.jsonl.tmp-*"))


def test_disk_full_in_the_journal_exits_1_and_resumes(tiny_model, tmp_path, monkeypatch):
    from conveyor.io.state.journal import Journal

    command, expected = _enospc_setup(tiny_model, tmp_path)
    real_advance = Journal._advance_prefix
    calls = []

    def full_after_first_commit(self, batch):
        calls.append(len(batch))
        if len(calls) > 1:
            raise sqlite3.OperationalError("database or disk is full")
        return real_advance(self, batch)

    with monkeypatch.context() as patch:
        patch.setattr(Journal, "_advance_prefix", full_after_first_commit)
        failed = run_in_process(*command)
    _assert_one_line_disk_full(failed, "journal.sqlite")
    assert not (tmp_path / "out.jsonl").exists()
    done = num_committed(tmp_path / "out.jsonl.conveyor")
    assert 0 < done < len(expected)  # the first commit stands, the failed one left nothing half-done

    resumed = run_in_process(*command)
    assert resumed.code == 0, resumed.err
    assert_same_rows(read_rows(tmp_path / "out.jsonl"), expected)


def test_a_resume_with_other_kernels_says_its_rows_may_differ_in_bits(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"w{i} w{i + 1}"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    args = ("run", src, "-o", out, *tiny_args(tiny_model), "--max-tokens", "3", "--quiet")
    assert run_in_process(*args, "--limit", "2").code == 0
    info_path = tmp_path / "out.jsonl.conveyor" / "run.json"
    here = json.loads(info_path.read_text())["arithmetic"]
    assert here  # e.g. "cpu (fused forward), AMX tiles"
    result = run_in_process(*args, "--limit", "3")  # the same machine: nothing to say
    assert result.code == 0 and "need not equal" not in result.err, result.err
    info_path.write_text(json.dumps({**json.loads(info_path.read_text()), "arithmetic": "cpu (another machine)"}))
    result = run_in_process(*args)
    assert result.code == 0 and len(read_rows(out)) == 4, result.err
    assert ("the first 3 rows of this run were computed with cpu (another machine); it resumes with "
            f"{here}, so the rest need not equal an uninterrupted run's bit for bit") in result.err, result.err
    assert json.loads(info_path.read_text())["arithmetic"] == here


def test_rerun_with_every_row_done_writes_the_output_without_loading_the_model(tmp_path, tiny_model, monkeypatch):
    """The same command again after a finished run (its output deleted, as a nightly job over a file that did not
    change meets it) writes the output from the journal; the model is never loaded."""
    source = write_jsonl(tmp_path / "in.jsonl", CHAT_RECORDS[:6])
    output = tmp_path / "out.parquet"
    args = ["run", source, "-o", output, *tiny_args(tiny_model), "--max-tokens", "4", "--seed", "7",
            "--temperature", "0.8"]
    first = run_in_process(*args)
    assert first.code == 0, first.err
    expected = read_rows(output)
    output.unlink()

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded with every record already answered")

    monkeypatch.setattr("conveyor.io.run_engine.load_engine", no_model)
    again = run_in_process(*args)
    assert again.code == 0, again.err
    assert "without loading the model" in again.err
    assert "loading" not in again.err.replace("without loading the model", "")
    assert_same_rows(read_rows(output), expected)
    assert [r["output"] for r in read_rows(output)] == [r["output"] for r in expected]
