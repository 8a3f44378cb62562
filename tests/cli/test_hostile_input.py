"""What a hostile or careless user feeds conveyor: none of it destroys data, mixes two runs or wedges a run.

Each test is a reproduction: records that are not text, outputs that name the input, run directories
that lost their manifest or were never conveyor's, stdin fed twice with different content, ids that
collide, runs that did no work, shared caches and temporary files, huge records, signals, bad option
values. The last test writes random files of all of that and checks the invariant: every line gives
exactly one row, the run exits 0 or 3, no traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import time
from pathlib import Path

import pytest
from cli_helpers import Child, read_rows, run_in_process, tiny_args, write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.io.records.seeds import derive_seed, index_seed

FAST = ["--max-tokens", "4", "--temperature", "0", "--quiet"]


def _run(tiny_model, *args, stdin: bytes | None = None):
    return run_in_process("run", *args, *tiny_args(tiny_model), *FAST, stdin=stdin)


# -- 1. records that are not text ------------------------------------------------------------------------

def test_lone_surrogates_are_error_rows_and_the_run_goes_on(tiny_model, tmp_path):
    source = tmp_path / "s.jsonl"
    source.write_text('{"id":"a","prompt":"The sky is"}\n{"id":"b","prompt":"Hello \\ud800 world"}\n'
                      '{"id":"\\udfff","prompt":"x"}\n{"id":"c","prompt":"y","tag":"\\ud83d"}\n'
                      '{"id":"d","prompt":"fine","tag":"ok"}\n', encoding="utf-8")
    out = tmp_path / "o.jsonl"
    result = _run(tiny_model, source, "-o", out, "--keep-fields", "tag")
    assert result.code == 3, result.err
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["ok", "error", "error", "error", "ok"]
    assert "line 2: field 'prompt' holds a lone UTF-16 surrogate" in rows[1]["error"]
    assert "field 'id'" in rows[2]["error"] and "field 'tag'" in rows[3]["error"]
    assert rows[4]["tag"] == "ok"
    again = _run(tiny_model, source, "-o", out, "--keep-fields", "tag")  # complete: the rows stand
    assert again.code == 3 and read_rows(out) == rows
    checked = run_in_process("validate", source, "--model", tiny_model)
    assert checked.code == 3 and "3 errors" in checked.out


# -- 2. an output that is the input ------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["same", "dot", "symlink", "hardlink", "run-dir"])
def test_an_output_or_run_directory_that_is_the_input_is_refused(tiny_model, tmp_path, spelling):
    source = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "keep me"}])
    before = source.read_bytes()
    args = ["-o", source]
    if spelling == "dot":
        os.chdir(tmp_path)
        args = ["-o", "./same.jsonl"]
    elif spelling == "symlink":
        (tmp_path / "link.jsonl").symlink_to(source)
        args = ["-o", tmp_path / "link.jsonl"]
    elif spelling == "hardlink":
        os.link(source, tmp_path / "hard.jsonl")
        args = ["-o", tmp_path / "hard.jsonl"]
    elif spelling == "run-dir":
        data = tmp_path / "data"
        data.mkdir()
        source = write_jsonl(data / "journal.sqlite", [{"prompt": "keep me"}])
        before = source.read_bytes()
        args = ["-o", tmp_path / "out.jsonl", "--run-dir", data, "--input-format", "jsonl"]
    result = _run(tiny_model, source, *args)
    assert result.code == 2, result.err
    assert "is the input" in result.err and len(result.err_lines) == 1
    assert source.read_bytes() == before


def test_an_output_that_is_a_folder_is_refused_before_the_model_loads(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    (tmp_path / "out.jsonl").mkdir()
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", "--model", tmp_path / "no-such-model")
    assert result.code == 2 and "existing folder" in result.err  # not the model's error: it never loaded


def test_an_output_that_cannot_be_written_is_refused_before_any_work_and_a_new_folder_is_made(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    run_dir = tmp_path / "elsewhere"
    # (a folder under /proc cannot be made, even by root)
    for output in ("/proc/conveyor-no-such/out.jsonl", "/proc/conveyor-no-such/parts/"):
        result = run_in_process("run", source, "-o", output, "--run-dir", run_dir, *tiny_args(tiny_model), "-q")
        assert result.code == 2 and "cannot write in /proc/conveyor-no-such" in result.err, result.err
        assert len(result.err_lines) == 1 and not run_dir.exists()  # refused before the run directory was made
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", "--run-dir", "/proc/conveyor-no-such",
                            *tiny_args(tiny_model), "-q")
    assert result.code == 2 and "cannot make the run directory /proc/conveyor-no-such" in result.err, result.err
    # a folder that does not exist yet is made, whether or not the run directory sits beside the output
    output = tmp_path / "new" / "folder" / "out.jsonl"
    result = run_in_process("run", source, "-o", output, "--run-dir", run_dir, *tiny_args(tiny_model), "-q",
                            "--max-tokens", "2")
    assert result.code == 0, result.err
    assert [r["id"] for r in read_rows(output)] == ["a"] and os.listdir(output.parent) == ["out.jsonl"]


# -- 3, 6. run directories: a journal without its manifest, a run that did no work -----------------------

def test_a_journal_without_its_manifest_is_not_adopted_by_another_run(tiny_model, tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": f"first {i}"} for i in range(6)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "prompt": f"second {i}"} for i in range(6)])
    out = tmp_path / "o.jsonl"
    assert _run(tiny_model, first, "-o", out, "--limit", "3").code == 0
    out.unlink()
    (tmp_path / "o.jsonl.conveyor" / "manifest.json").unlink()
    result = _run(tiny_model, second, "-o", out)
    assert result.code == 2
    assert "journal.sqlite" in result.err and "manifest.json" in result.err and not out.exists()
    restarted = _run(tiny_model, second, "-o", out, "--restart")  # no manifest: nothing of conveyor's to delete
    assert restarted.code == 2 and (tmp_path / "o.jsonl.conveyor" / "journal.sqlite").exists()


def test_a_run_that_did_no_work_does_not_pin_its_settings(tiny_model, tmp_path):
    records = [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(4)]
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())[:-12])  # truncated
    out = tmp_path / "o.jsonl"
    assert _run(tiny_model, gz, "-o", out).code == 2  # (its first records are read before the run directory is)
    assert not (tmp_path / "o.jsonl.conveyor" / "manifest.json").exists()
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))  # fixed
    fixed = _run(tiny_model, gz, "-o", out)
    assert fixed.code == 0, fixed.err
    assert len(read_rows(out)) == 4
    typo = run_in_process("run", gz, "-o", tmp_path / "p.jsonl", "--model", tmp_path / "modle", *FAST)
    assert typo.code == 2 and "modle" in typo.err, typo.err
    assert _run(tiny_model, gz, "-o", tmp_path / "p.jsonl").code == 0


def test_restart_with_a_foreign_run_dir_deletes_nothing_of_its_own(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    (folder / "run.json").write_text('{"keep": true}')
    result = _run(tiny_model, source, "-o", tmp_path / "o.jsonl", "--run-dir", folder, "--restart")
    assert result.code == 0, result.err
    assert (folder / "notes.txt").read_text() == "keep"


def test_an_unreadable_manifest_and_an_empty_journal_are_named(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    out = tmp_path / "o.jsonl"
    assert _run(tiny_model, source, "-o", out, "--limit", "1").code == 0
    run_dir = tmp_path / "o.jsonl.conveyor"
    (run_dir / "journal.sqlite").write_bytes(b"")
    for name in ("journal.sqlite-wal", "journal.sqlite-shm"):
        (run_dir / name).unlink(missing_ok=True)
    status = run_in_process("status", out)
    assert status.code == 75 and str(run_dir / "journal.sqlite") in status.out  # not finished: its journal is gone
    assert _run(tiny_model, source, "-o", out).code == 0 and len(read_rows(out)) == 2
    (run_dir / "manifest.json").write_bytes(b"\xff\xfe not utf-8")
    bad = _run(tiny_model, source, "-o", out)
    assert bad.code == 2 and str(run_dir / "manifest.json") in bad.err and len(bad.err_lines) == 1


# -- 4. stdin fed twice with different content ------------------------------------------------------------

def test_a_stdin_run_fed_other_records_reuses_the_rows_of_those_that_stayed(tiny_model, tmp_path):
    a = [{"prompt": f"first input {i}"} for i in range(10)]
    b = a[:5] + [{"prompt": f"second input {i}"} for i in range(5, 10)]
    data = lambda records: "".join(json.dumps(r) + "\n" for r in records).encode()  # noqa: E731
    out, run_dir = tmp_path / "o.jsonl", tmp_path / "o.jsonl.conveyor"
    assert _run(tiny_model, "-", "-o", out, "--limit", "8", stdin=data(a)).code == 0
    assert not (run_dir / "input.spool").exists()  # the copy of stdin goes with the run
    mixed = _run(tiny_model, "-", "-o", out, stdin=data(b))
    assert mixed.code == 0 and "reused 5, new 2, changed 3, removed 0" in mixed.err, mixed.err
    short = _run(tiny_model, "-", "-o", out, stdin=data(a[:4]))
    assert short.code == 0 and "reused 4, new 0, changed 0, removed 6" in short.err, short.err
    assert [r["index"] for r in read_rows(out)] == [0, 1, 2, 3]
    same = _run(tiny_model, "-", "-o", out, stdin=data(a))
    assert same.code == 0, same.err
    fresh = _run(tiny_model, "-", "-o", tmp_path / "fresh.jsonl", stdin=data(a))
    assert [(r["index"], r["output"]) for r in read_rows(out)] == \
        [(r["index"], r["output"]) for r in read_rows(tmp_path / "fresh.jsonl")] and fresh.code == 0


# -- 5. implicit ids against explicit ones ----------------------------------------------------------------

def test_records_without_an_id_never_collide_with_records_that_have_one(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "1", "prompt": "a"}, {"prompt": "b"}, {"prompt": "c"},
                                                  {"id": "2", "prompt": "d"}, {"id": "2", "prompt": "e"}])
    out = tmp_path / "o.jsonl"
    result = _run(tiny_model, source, "-o", out, "--temperature", "0.7")
    assert result.code == 3, result.err  # only the second explicit "2" is a duplicate
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "ok", "error"]
    assert "duplicate id '2'" in rows[4]["error"]
    assert rows[2]["id"] == "2" and rows[3]["id"] == "2"  # an index, and an id
    assert rows[2]["seed"] == index_seed(0, 2) and rows[3]["seed"] == derive_seed(0, "2") != index_seed(0, 2)


def test_a_record_that_could_not_be_read_never_takes_the_id_of_a_record_that_has_one(tiny_model, tmp_path):
    """An unreadable line's row carries its index as id (it has no other); a later record whose own id is that
    index still runs, however many rows were committed in between."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "cut short"\n' + "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(6))
                      + json.dumps({"id": "0", "prompt": "a"}) + "\n" + json.dumps({"id": "3", "prompt": "b"}) + "\n")
    out = tmp_path / "o.jsonl"
    result = _run(tiny_model, source, "-o", out, "--max-num-seqs", "1", "--checkpoint-every", "1")
    assert result.code == 3, result.err
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["error"] + ["ok"] * 8
    assert rows[0]["id"] == "0" and "line 1: invalid JSON" in rows[0]["error"]
    assert [r["id"] for r in rows[7:]] == ["0", "3"]


# -- 7. shared caches and temporary files -----------------------------------------------------------------

def test_the_output_is_written_through_a_fresh_temporary_file_never_a_planted_one(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for pid in range(os.getpid() - 5, os.getpid() + 50):  # the old, predictable names
        (tmp_path / f".o.jsonl.tmp-{pid}").symlink_to(victim)
    assert _run(tiny_model, source, "-o", tmp_path / "o.jsonl").code == 0
    assert victim.read_text() == "precious" and len(read_rows(tmp_path / "o.jsonl")) == 1


# -- 8. huge records, signals ---------------------------------------------------------------------------

def test_a_record_over_the_size_limit_is_an_error_row(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "small"}, {"prompt": "x" * 5_000_000},
                                                  {"prompt": "also small"}])
    out = tmp_path / "o.jsonl"
    result = _run(tiny_model, source, "-o", out)  # the default limit: 4 MiB
    assert result.code == 3, result.err
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["ok", "error", "ok"]
    assert "over the 4,194,304 of --max-record-bytes" in rows[1]["error"]
    small = _run(tiny_model, source, "-o", tmp_path / "p.jsonl", "--max-record-bytes", "1KiB")
    assert small.code == 3 and "over the 1,024" in read_rows(tmp_path / "p.jsonl")[1]["error"]
    bad = run_in_process("run", source, "-o", tmp_path / "q.jsonl", "--max-record-bytes", "lots")
    assert bad.code == 2 and "--max-record-bytes" in bad.err


def test_a_second_interrupt_exits_at_once_even_while_a_huge_record_is_tokenized(tiny_model, tmp_path):
    big = " ".join(f"word{i}" for i in range(3_000_000))  # ~26 MB: many seconds in the tokenizer
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": big}])
    child = Child(["run", source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST,
                   "--max-record-bytes", "64MiB", "--no-quiet"], tmp_path, "interrupted")
    child.wait_until(lambda: "loading" in child.err_path.read_text(), what="the model to load")
    time.sleep(3.5)  # past the model's load, into the tokenizer
    child.send(signal.SIGINT)
    time.sleep(0.3)
    sent = time.monotonic()
    child.send(signal.SIGINT)
    result = child.wait(timeout=30)
    assert result.code == 130, result.err
    assert time.monotonic() - sent < 3, "the second interrupt waited for the tokenizer"


def test_sighup_stops_like_sigterm_and_the_run_resumes(tiny_model, tmp_path):
    records = [{"id": f"h{i}", "prompt": f"hangup {i}"} for i in range(200)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "o.jsonl"
    args = ["run", source, "-o", out, *tiny_args(tiny_model), *FAST, "--max-tokens", "24", "--ignore-eos",
            "--max-num-seqs", "2", "--checkpoint-every", "2"]
    child = Child(args, tmp_path, "hup")
    journal = tmp_path / "o.jsonl.conveyor" / "journal.sqlite"
    child.wait_until(lambda: journal.exists() and journal.stat().st_size > 0, what="the journal")
    time.sleep(1.0)
    child.send(signal.SIGHUP)
    result = child.wait(timeout=120)
    assert result.code == 75, result.err
    assert "SIGHUP received" in result.err and not out.exists()
    assert run_in_process(*args).code == 0
    assert len(read_rows(out)) == 200


# -- 9. option values and config values -------------------------------------------------------------------

@pytest.mark.parametrize("args, named", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--device", "tpu"], "--device"),
    (["--summary-json", "/no/such/folder/s.json"], "--summary-json"),
])
def test_bad_values_are_usage_errors_before_the_model_loads(tmp_path, args, named):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--model", tmp_path / "none", *args)
    assert result.code == 2 and named in result.err and len(result.err_lines) == 1, result.err


def test_a_config_value_of_the_wrong_type_is_a_usage_error(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    config.write_text("model: 5\n")
    result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "-c", config)
    assert result.code == 2 and "--model" in result.err and "expected a string" in result.err


def test_an_unwritable_summary_json_keeps_a_complete_runs_exit_code(tiny_model, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    summary = tmp_path / "s.json"
    real = Path.write_text

    def refuse(self, *a, **k):
        if self == summary:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    result = _run(tiny_model, source, "-o", tmp_path / "o.jsonl", "--summary-json", summary)
    assert result.code == 0 and "could not write --summary-json" in result.err


def test_a_json_array_with_one_bad_element_gives_an_error_row_for_it(tiny_model, tmp_path):
    source = tmp_path / "in.json"
    source.write_text('[{"prompt": "a"}, {"prompt": tru}, {"prompt": "c"}]', encoding="utf-8")
    result = _run(tiny_model, source, "-o", tmp_path / "o.jsonl")
    assert result.code == 3, result.err
    rows = read_rows(tmp_path / "o.jsonl")
    assert [r["status"] for r in rows] == ["ok", "error", "ok"] and "record 1" in rows[1]["error"]


# -- the class: random files of all of the above ------------------------------------------------------------

_value = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                      | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_fields = st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.sampled_from(["1", "2", "x", ""]), st.text(max_size=4), st.integers(0, 3), _value),
    "prompt": st.one_of(st.text(max_size=30), _value),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                                          "content": st.one_of(st.text(max_size=20), _value)}),
                                   max_size=3), _value),
    "max_tokens": st.one_of(st.integers(-2, 3), _value), "temperature": st.one_of(st.floats(-1, 3), _value),
    "seed": st.one_of(st.integers(-2**64, 2**64), _value), "stop": _value, "tag": _value})
_surrogate = st.sampled_from(['"\\ud800"', '"\\udfff x"', '"ok \\ud83d\\ude00"', '"\\u0000nul"'])


@st.composite
def _line(draw):
    kind = draw(st.sampled_from(["record", "record", "record", "surrogate", "garbage", "oversized", "blank"]))
    if kind == "record":
        return json.dumps(draw(_fields))
    if kind == "surrogate":
        key = draw(st.sampled_from(["id", "prompt", "tag"]))
        return '{"%s": %s, "prompt": "p"}' % (key, draw(_surrogate)) if key != "prompt" else \
            '{"prompt": %s}' % draw(_surrogate)
    if kind == "garbage":
        return draw(st.sampled_from(["{", "[1, 2]", "null", '"s"', "{\"prompt\": NaN}", "\x00\x01", "1e999"]))
    if kind == "oversized":
        return json.dumps({"prompt": "y" * 3000})
    return draw(st.sampled_from(["", "   ", "\t"]))


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                    HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line(), min_size=1, max_size=12))
def test_every_line_of_a_random_file_gives_exactly_one_row_and_no_traceback(tiny_model, tmp_path_factory, lines):
    folder = tmp_path_factory.mktemp("random")
    source = folder / "in.jsonl"
    lines = ['{"prompt": "p", "tag": 1}', *lines]  # (a record with the kept field: a file none has is refused)
    source.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    out = folder / "o.jsonl"
    result = _run(tiny_model, source, "-o", out, "--max-record-bytes", "2KiB", "--keep-fields", "tag")
    assert result.code in (0, 3), result.err
    assert "Traceback" not in result.err
    expected = sum(1 for line in lines if line.strip())
    rows = read_rows(out)
    assert [r["index"] for r in rows] == list(range(expected))
    assert all(r["status"] == "ok" or r["error"] for r in rows)
