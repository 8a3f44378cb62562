"""A rerun over an input that grew, lost records or had records edited: only the new and changed records are
computed, the rows of the rest reused, and the output equals a `--restart` run's row for row (seeded sampling, both
dtypes, n > 1, structured outputs); with nothing to compute no model loads; --retry-errors; status; shards."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

from conveyor.core.backends.cpu.kernels import native_bf16

TIMINGS = ("queue_s", "ttft_s", "latency_s")
OPTS = ("--max-tokens", "6", "--temperature", "0.8", "--seed", "11")

BASE = [{"id": f"r{i}", "prompt": f"Tell me about the number {i}."} for i in range(8)]
BASE[2]["guided_choice"] = ["yes", "no", "maybe"]  # a structured output, reused where it moves
BASE[5]["n"] = 2  # n > 1, reused where it moves
BASE += [{"prompt": "A record without an id."}, {"prompt": "Another one without an id."}]


def _changed(records: list[dict]) -> list[dict]:
    """r1 removed, r3 edited, n0 inserted ahead of r2 (the records with ids after it move; those without stay at
    their index), then n1 (n = 2, with a grammar) and a record without an id appended."""
    out = [dict(r) for r in records]
    out[3]["prompt"] = "Tell me about the number three, spelled out."
    del out[1]
    out.insert(1, {"id": "n0", "prompt": "A record inserted in the middle."})
    return out + [{"id": "n1", "prompt": "Appended.", "n": 2, "guided_choice": ["red", "blue"]},
                  {"prompt": "Appended without an id."}]


def _run(model, src, out, *extra, dtype="float32"):
    return run_in_process("run", src, "-o", out, *tiny_args(model), *OPTS, "--dtype", dtype, *extra)


def _same_rows(rows: list[dict], expected: list[dict]) -> None:
    """Every column but the timings, row for row."""
    assert len(rows) == len(expected)
    for got, want in zip(rows, expected):
        got, want = ({k: v for k, v in r.items() if k not in TIMINGS} for r in (got, want))
        assert got == want, f"row {got['index']} ({got['id']}) differs"


def _summary(path) -> dict:
    return json.loads(path.read_text())


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)"))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_new_and_changed_records_are_computed_and_the_output_equals_a_restart(tiny_model, tmp_path, dtype):
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE), tmp_path / "out.parquet"
    first = _run(tiny_model, src, out, dtype=dtype)
    assert first.code == 0, first.err
    write_jsonl(src, _changed(BASE))
    again = _run(tiny_model, src, out, "--summary-json", tmp_path / "again.json", dtype=dtype)
    assert again.code == 0, again.err
    assert "the input changed since the last run: reused 8, new 3, changed 1, removed 1" in again.err
    said = _summary(tmp_path / "again.json")
    assert said["reuse"] == {"reused": 8, "new": 3, "changed": 1, "removed": 1, "moved_without_id": 0}
    rows = read_rows(out)
    computed = [r for r in rows if r["id"] in ("n0", "r3", "n1", "11")]
    assert len(computed) == 5  # n1 has two samples
    assert said["completion_tokens"] == sum(r["completion_tokens"] for r in computed) > 0  # this process's own

    fresh = _run(tiny_model, src, tmp_path / "fresh.parquet", "--restart", dtype=dtype)
    assert fresh.code == 0, fresh.err
    expected = read_rows(tmp_path / "fresh.parquet")
    _same_rows(rows, expected)
    assert [r["id"] for r in rows][:4] == ["r0", "n0", "r2", "r3"] and rows[2]["output"] in ("yes", "no", "maybe")


def test_with_nothing_to_compute_no_model_loads_and_the_gone_records_rows_are_dropped(tiny_model, tmp_path,
                                                                                      monkeypatch):
    with_ids = [r for r in BASE if "id" in r]
    src, out = write_jsonl(tmp_path / "in.jsonl", with_ids), tmp_path / "out.jsonl"
    assert _run(tiny_model, src, out).code == 0
    before = {r["id"]: r for r in read_rows(out)}
    now = [r for r in with_ids[3:] + with_ids[:3] if r["id"] not in ("r0", "r6")]  # reordered and cut
    write_jsonl(src, now)

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded with nothing to compute")

    monkeypatch.setattr("conveyor.io.run_engine.load_engine", no_model)
    again = _run(tiny_model, src, out)
    assert again.code == 0, again.err
    assert "reused 6, new 0, changed 0, removed 2" in again.err and "without loading the model" in again.err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [r["id"] for r in now for _ in range(r.get("n", 1))]
    assert all(r["output"] == before[r["id"]]["output"] for r in rows if r["id"] != "r5")  # (r5: two samples)
    assert [r["index"] for r in rows] == [i for i, r in enumerate(now) for _ in range(r.get("n", 1))]
    monkeypatch.undo()
    fresh = _run(tiny_model, src, tmp_path / "fresh.jsonl", "--restart")
    assert fresh.code == 0, fresh.err
    _same_rows(rows, read_rows(tmp_path / "fresh.jsonl"))


def test_a_record_inserted_ahead_moves_those_without_an_id_which_are_computed_again(tiny_model, tmp_path):
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE), tmp_path / "out.jsonl"
    assert _run(tiny_model, src, out).code == 0
    write_jsonl(src, [{"id": "top", "prompt": "Inserted at the top."}, *BASE])
    again = _run(tiny_model, src, out)
    assert again.code == 0, again.err
    assert "reused 8, new 1, changed 2, removed 0" in again.err
    assert "2 records without an id are at another index than before" in again.err
    fresh = _run(tiny_model, src, tmp_path / "fresh.jsonl", "--restart")
    assert fresh.code == 0, fresh.err
    _same_rows(read_rows(out), read_rows(tmp_path / "fresh.jsonl"))


def test_status_counts_the_records_with_no_row_yet_without_loading_the_model(tiny_model, tmp_path, monkeypatch):
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE[:4]), tmp_path / "out.jsonl"
    assert _run(tiny_model, src, out).code == 0
    assert run_in_process("status", out).code == 0
    write_jsonl(src, BASE[:6])
    monkeypatch.setattr("conveyor.io.run_engine.load_engine", None)
    status = run_in_process("status", out)
    assert status.code == 75, status.out
    assert "2 records with no row yet (reused 4, new 2, changed 0, removed 0)" in status.out
    assert "--restart" not in status.out
    monkeypatch.undo()
    assert _run(tiny_model, src, out).code == 0 and len(read_rows(out)) == 7  # (r5 has two samples)
    assert run_in_process("status", out).code == 0


def test_retry_errors_computes_again_the_records_the_run_failed_and_keeps_bad_inputs_rows(tiny_model, tmp_path,
                                                                                      monkeypatch):
    from conveyor.io.rows.sink import JournalSink

    records = [*BASE[:4], {"id": "empty", "prompt": ""}]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    finished = JournalSink.finished

    def a_step_fails_for_r2(sink, output):  # as a fault in the step that ran it would end it
        if sink.in_flight[output.req_id][0].id == "r2":
            output = dataclasses.replace(output, error="the step that ran it failed")
        return finished(sink, output)

    monkeypatch.setattr(JournalSink, "finished", a_step_fails_for_r2)
    first = _run(tiny_model, src, out)
    assert first.code == 3, first.err
    monkeypatch.undo()
    rows = {r["id"]: r for r in read_rows(out)}
    assert "the step that ran it failed" in rows["r2"]["error"] and rows["empty"]["status"] == "error"

    plain = _run(tiny_model, src, out)  # the same command: the rows stand
    assert plain.code == 3 and {r["id"]: r["status"] for r in read_rows(out)}["r2"] == "error"
    retried = _run(tiny_model, src, out, "--retry-errors", "--summary-json", tmp_path / "s.json")
    assert retried.code == 3, retried.err  # the empty prompt's row stays
    assert "--retry-errors: 1 record whose error row the run made is computed again" in retried.err
    assert _summary(tmp_path / "s.json")["retried_errors"] == 1
    fresh = _run(tiny_model, src, tmp_path / "fresh.jsonl", "--restart")
    _same_rows(read_rows(out), read_rows(tmp_path / "fresh.jsonl"))
    assert {r["id"]: r["status"] for r in read_rows(out)} == {"r0": "ok", "r1": "ok", "r2": "ok", "r3": "ok",
                                                               "empty": "error"}
    assert fresh.code == 3


def test_each_shard_reuses_its_own_rows_and_the_merge_equals_a_single_run(tiny_model, tmp_path):
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE), tmp_path / "out.jsonl"
    for shard in ("0/2", "1/2"):
        assert _run(tiny_model, src, out, "--shard", shard).code == 0
    grown = [*BASE, {"id": "n0", "prompt": "new"}, {"id": "n1", "prompt": "new too"}]
    write_jsonl(src, grown)
    said = []
    for shard in ("0/2", "1/2"):
        result = _run(tiny_model, src, out, "--shard", shard)
        assert result.code == 0, result.err
        said.append(result.err)
    assert "reused 5, new 1, changed 0, removed 0" in said[0] and "reused 5, new 1, changed 0, removed 0" in said[1]
    single = _run(tiny_model, src, tmp_path / "single.jsonl")
    assert single.code == 0, single.err
    _same_rows(read_rows(out), read_rows(tmp_path / "single.jsonl"))


def test_a_changed_keep_fields_is_no_drift_the_rows_are_kept_and_their_fields_read_again(tiny_model, tmp_path,
                                                                                        monkeypatch):
    records = [{**r, "topic": f"t{i % 3}", "question": f"q{i}"} for i, r in enumerate(BASE)]
    records[4] = "not a record"  # an error row keeps its fields as nulls
    src, out = tmp_path / "in.jsonl", tmp_path / "out.parquet"
    src.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in records))
    assert _run(tiny_model, src, out, "--keep-fields", "topic").code == 3

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded for an output-only change")

    monkeypatch.setattr("conveyor.io.run_engine.load_engine", no_model)
    wider = _run(tiny_model, src, out, "--keep-fields", "question,topic")
    assert wider.code == 3, wider.err
    assert "--keep-fields changed (topic -> question, topic)" in wider.err
    monkeypatch.undo()
    fresh = _run(tiny_model, src, tmp_path / "fresh.parquet", "--keep-fields", "question,topic")
    assert fresh.code == 3, fresh.err
    rows = read_rows(out)
    _same_rows(rows, read_rows(tmp_path / "fresh.parquet"))
    assert rows[0]["question"] == "q0" and rows[4]["question"] is None and list(rows[0])[-2:] == ["question", "topic"]
    assert _run(tiny_model, src, out).code == 3 and "topic" not in read_rows(out)[0]  # and back to none


def test_restart_sets_the_rows_aside_and_going_back_to_their_settings_takes_them_back(tiny_model, tmp_path,
                                                                                      monkeypatch):
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE[:4]), tmp_path / "out.jsonl"
    run_dir = tmp_path / "out.jsonl.conveyor"
    assert _run(tiny_model, src, out).code == 0
    first = read_rows(out)
    other = _run(tiny_model, src, out, "--temperature", "0.5")
    assert other.code == 2 and "temperature" in other.err and "set aside" in other.err
    assert _run(tiny_model, src, out, "--temperature", "0.5", "--restart").code == 0
    assert len(list((run_dir / "set-aside").iterdir())) == 1
    assert _run(tiny_model, src, out).code == 2  # back to the first settings: drift from the second run's

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded to go back to rows set aside")

    monkeypatch.setattr("conveyor.io.run_engine.load_engine", no_model)
    back = _run(tiny_model, src, out, "--restart")
    assert back.code == 0, back.err
    assert "took back the 4 rows of an earlier run with these settings" in back.err
    _same_rows(read_rows(out), first)
    assert len(list((run_dir / "set-aside").iterdir())) == 1  # the second run's, now
    write_jsonl(src, BASE[:5])  # and the input grew meanwhile: it goes on from what was taken back
    monkeypatch.undo()
    grown = _run(tiny_model, src, out, "--temperature", "0.5", "--restart")
    assert grown.code == 0 and "took back the 4 rows" in grown.err and "reused 4, new 1" in grown.err, grown.err
    again = _run(tiny_model, src, out, "--temperature", "0.5", "--restart", "--summary-json", tmp_path / "s.json")
    assert again.code == 0 and "took back" not in again.err, again.err  # unchanged settings: every row again
    assert _summary(tmp_path / "s.json")["completion_tokens"] > 0
    assert len(list((run_dir / "set-aside").iterdir())) == 1  # the first settings' rows, still set aside


def test_model_files_that_changed_behind_the_same_name_are_drift(tiny_model, tmp_path):
    """A fine-tune saved over the model's folder: the name is the same, the rows are not."""
    import shutil

    import safetensors.torch as st

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    src, out = write_jsonl(tmp_path / "in.jsonl", BASE[:3]), tmp_path / "out.jsonl"
    assert _run(model, src, out).code == 0
    assert _run(model, src, out).code == 0  # unchanged: the output is written again, nothing computed
    weights = st.load_file(model / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    st.save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    again = _run(model, src, out)
    assert again.code == 2 and "the files of model" in again.err and "changed since this run started" in again.err
    assert _run(model, src, out, "--restart").code == 0
