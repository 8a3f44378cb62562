"""A row is reused only for the record it answers: another split of the same datasets folder, the same bytes read as
another format, a file rewritten while a run read it (and restored, so its fingerprint did not move), and a partial
left by a record that changed all get their records computed again, never another record's answer with exit 0."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_same_rows, read_rows, run_in_process, tiny_args, write_input, write_jsonl

OPTS = ("--max-tokens", "5", "--temperature", "0")


def _run(model, src, out, *extra):
    return run_in_process("run", src, "-o", out, *tiny_args(model), *OPTS, *extra)


def _fresh(model, src, tmp_path, name, *extra):
    out = tmp_path / name
    done = _run(model, src, out, *extra)
    assert done.code == 0, done.err
    return read_rows(out)


def test_another_split_of_the_same_folder_is_another_input(tiny_model, tmp_path):
    import datasets

    train = [{"id": f"t{i}", "prompt": f"Train question number {i}?"} for i in range(4)]
    test = [{"id": f"t{i}", "prompt": f"A test prompt, different, {i}."} for i in range(6)]
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(folder))
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, folder, out, "--split", "train").code == 0
    again = _run(tiny_model, folder, out, "--split", "test")
    assert again.code == 0, again.err
    assert "resuming: 4 records already done" not in again.err
    assert 'split: "train" -> "test"' in again.err
    assert_same_rows(read_rows(out), _fresh(tiny_model, folder, tmp_path, "test.jsonl", "--split", "test"))


def test_the_same_bytes_read_as_another_format_are_another_input(tiny_model, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("prompt\tnote\nSay a\tb, c\nSay d\te, f\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, src, out, "--input-format", "tsv", "--prompt-field", "prompt").code == 0
    # As CSV the header is one field, "prompt\tnote", and no record has a prompt: two error rows, no row reused.
    as_csv = _run(tiny_model, src, out, "--input-format", "csv", "--prompt-field", "prompt")
    assert as_csv.code == 3, as_csv.err
    assert 'read another way than when this run started (format: "tsv" -> "csv"): reused 0' in as_csv.err
    assert [r["status"] for r in read_rows(out)] == ["error", "error"]


def _stored_manifest(out):
    path = out.with_name(out.name + ".conveyor") / "manifest.json"
    return path, json.loads(path.read_text())


def test_a_row_of_another_record_is_not_reused_though_the_fingerprint_did_not_move(tiny_model, tmp_path):
    """A file cut short while a run read it and restored before the next: the manifest's fingerprint is the restored
    file's, but the row of record 2 answered the half line the run read then."""
    whole = [{"id": f"r{i}", "prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(5)]
    cut = [dict(r) for r in whole[:3]]
    cut[2]["prompt"] = "Question 2: what is"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, cut)
    assert _run(tiny_model, src, out).code == 0
    write_jsonl(src, whole)
    from conveyor.io.records.readers import fingerprint

    path, manifest = _stored_manifest(out)
    manifest["input_fingerprint"] = fingerprint(str(src))  # what the first run's start had hashed
    path.write_text(json.dumps(manifest))
    again = _run(tiny_model, src, out)
    assert again.code == 0, again.err
    assert "1 row of this run answers records that are not the ones read now" in again.err
    assert_same_rows(read_rows(out), _fresh(tiny_model, src, tmp_path, "fresh.jsonl"))


def test_an_input_rewritten_while_the_run_reads_it_writes_no_output(tiny_model, tmp_path, monkeypatch):
    from conveyor.io.run import Run

    records = [{"id": f"r{i}", "prompt": f"Question {i}?"} for i in range(6)]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    edited = [dict(r) for r in records]
    edited[1]["prompt"] = "An edited question?"
    load = Run.load_engine

    def load_then_edit(self):
        load(self)
        write_jsonl(src, edited)  # (the run's reader holds the old bytes already)

    monkeypatch.setattr(Run, "load_engine", load_then_edit)
    first = _run(tiny_model, src, out)
    assert first.code == 1, first.err
    assert f"the input {src} changed while this run read it" in first.err
    assert "no output was written" in first.err and "--debug" not in first.err
    assert not out.exists()
    monkeypatch.setattr(Run, "load_engine", load)
    again = _run(tiny_model, src, out)
    assert again.code == 0, again.err
    assert_same_rows(read_rows(out), _fresh(tiny_model, src, tmp_path, "fresh.jsonl"))


def test_an_input_cut_short_and_restored_while_read_writes_no_output(tiny_model, tmp_path, monkeypatch):
    """The fingerprint at the end equals the one at the start; the records read do not: no output, exit 1."""
    from conveyor.io.run import Run

    records = [{"id": f"r{i}", "prompt": f"Question {i}: " + "words " * 40} for i in range(200)]
    src = write_input(tmp_path / "in.csv", records, "csv")
    whole = src.read_bytes()
    out = tmp_path / "out.jsonl"
    load, finish = Run.load_engine, Run._finish

    def load_then_cut(self):
        load(self)
        src.write_bytes(whole[: len(whole) // 2])

    def restore_then_finish(self):
        src.write_bytes(whole)
        return finish(self)

    monkeypatch.setattr(Run, "load_engine", load_then_cut)
    monkeypatch.setattr(Run, "_finish", restore_then_finish)
    first = _run(tiny_model, src, out, "--prompt-field", "prompt", "--limit", "200")
    assert first.code == 1, first.err
    assert "held 200 records when the run opened, and the run read" in first.err
    assert not out.exists()


@pytest.mark.parametrize("n", [1, 2])
def test_a_partial_continues_only_the_record_it_was_saved_for(tmp_path, n):
    """The tokens a stopped run saved for record 0 continue it where record 0 is the same record; where the input
    changed under it they are dropped and the record starts over."""
    from conveyor.core import InFlight, SamplingParams
    from conveyor.io.records.readers import RawRecord
    from conveyor.io.records.request_builder import BuiltRequest
    from conveyor.io.rows.sink import JournalSink
    from conveyor.io.state.journal import Journal

    def built(digest):
        return BuiltRequest(0, "r0", "completion", [1, 2, 3], SamplingParams(seed=7, max_tokens=9), {}, True,
                            digest, n=n)

    raw = RawRecord(0, 1, {"id": "r0"}, None, "old")
    with Journal(tmp_path / "j.sqlite") as journal:
        first = JournalSink(journal, engine_in_flight=lambda: {r: InFlight((5, 6), None) for r in ids})
        requests = first.admit(raw, built("old"))
        ids = [r.req_id for r in (requests if n > 1 else [requests])]
        first.commit()
        partials = journal.partials()
    for digest, continued in (("old", True), ("new", False)):
        with Journal(tmp_path / f"{digest}.sqlite") as journal:
            requests = JournalSink(journal, partials=partials).admit(raw, built(digest))
            for request in requests if n > 1 else [requests]:
                assert bool(request.output_token_ids) is continued, digest


def test_a_lowered_limit_resumes_with_the_rows_within_it(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(6)])
    out = tmp_path / "out.jsonl"
    for limit in (("--limit", "3"), (), ("--limit", "3")):
        done = _run(tiny_model, src, out, *limit)
        assert done.code == 0, done.err
    assert [r["id"] for r in read_rows(out)] == ["r0", "r1", "r2"]


def test_a_long_line_of_whitespace_is_a_blank_line(tiny_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Say a."}\n' + " " * 300 + '\n{"prompt": "Say b."}\n', encoding="utf-8")
    done = _run(tiny_model, src, tmp_path / "out.jsonl", "--max-record-bytes", "200")
    assert done.code == 0, done.err
    assert len(read_rows(tmp_path / "out.jsonl")) == 2


def test_a_datasets_folder_resumes_and_reruns_with_its_rows(tiny_model, tmp_path):
    folder = write_input(tmp_path / "ds", [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(3)], "datasets")
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, folder, out).code == 0
    again = _run(tiny_model, folder, out)  # (every record has its row: datasets' select past the end raised)
    assert again.code == 0, again.err
    assert "nothing to do" in again.err and len(read_rows(out)) == 3


def test_a_digest_of_a_value_json_has_no_form_for_is_the_same_in_every_process():
    from conveyor.io.records.readers.record import Reader, table_row

    class Picture:  # (a decoded image: its str names its address, its data are bytes)
        def __init__(self, data: bytes) -> None:
            self.data, self.mode, self.size = data, "RGB", (2, 1)

        def tobytes(self) -> bytes:
            return self.data

    reader = Reader()
    reader.with_digests = True
    first, same, other = (table_row(reader, {"image": Picture(data)}, 0, None).digest
                          for data in (b"\x01\x02\x03" * 2, b"\x01\x02\x03" * 2, b"\x01\x02\x04" * 2))
    assert first == same != other


def test_a_csv_error_rows_message_follows_its_header(tiny_model, tmp_path):
    src, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
    src.write_text("prompt,a\nSay x,1\nSay y,1,2,3\n", encoding="utf-8")
    assert _run(tiny_model, src, out).code == 3
    src.write_text("prompt,a,b\nSay x,1,\nSay y,1,2,3\n", encoding="utf-8")
    assert _run(tiny_model, src, out).code == 3
    assert read_rows(out)[1]["error"] == "line 3: the row has 4 fields but the header has 3; quote cells that contain commas"
