"""io's Run on its own, without the CLI: a spec in, the output file out; a stopped run resumed to exactly one row per
record; drift, bad options and a backend that cannot run refused before the model loads; shards finished and
merged; validation; and the manifest's generation config kept as runs started before wrote it. On the tiny random
Llama (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.core import ConfigError, EngineConfig, SamplingParams
from conveyor.io.errors import RunDirError, SpecError
from conveyor.io.run import Run
from conveyor.io.run_report import Outcome
from conveyor.io.run_spec import BuildOptions, InputOptions, OutputOptions, RunSpec, StateOptions
from conveyor.io.validate_run import validate_run

RECORDS = [{"id": f"r{i}", "prompt": "w3 w4 w5 " * (i % 4 + 1)} for i in range(10)] + [{"id": "bad", "prompt": ""}]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return path


def spec_for(tiny_model, source, out, **changes) -> RunSpec:
    spec = RunSpec(input=InputOptions(str(source)), output=OutputOptions(str(out)), model=str(tiny_model),
                   sampling=SamplingParams(temperature=0.0, max_tokens=6),
                   engine=EngineConfig(kv_cache_memory="8MiB", max_num_seqs=4, dtype="float32"))
    return dataclasses.replace(spec, **changes)


def run_to_end(spec: RunSpec, stop_after_rows: int | None = None):
    """Open, load and execute a Run of `spec`; stopped once it has made `stop_after_rows` rows, where given."""
    run = Run(spec)
    try:
        run.open()
        run.load_engine()
        return run.execute(lambda: stop_after_rows is not None and run.totals.done >= stop_after_rows)
    finally:
        run.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_spec_runs_to_its_output_file(tiny_model, source, tmp_path):
    out = tmp_path / "out.jsonl"
    result = run_to_end(spec_for(tiny_model, source, out))
    assert result.status is Outcome.SOME_ERRORS and result.output_written
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(len(RECORDS)))
    assert [r["status"] for r in rows] == ["ok"] * 10 + ["error"]
    summary = result.summary().to_json()
    assert (summary["records"], summary["ok"], summary["errors"], summary["status"]) == (11, 10, 1, "some_errors")


def test_a_stopped_run_resumes_to_one_row_per_record(tiny_model, source, tmp_path):
    out = tmp_path / "out.jsonl"
    spec = spec_for(tiny_model, source, out, state=StateOptions(checkpoint_every=1))
    first = run_to_end(spec, stop_after_rows=4)
    assert first.status is Outcome.STOPPED and not first.output_written and not out.exists()
    done_before = first.totals.done
    assert 0 < done_before < len(RECORDS)
    second = run_to_end(spec)
    assert second.status is Outcome.SOME_ERRORS and second.totals.resumed_from == done_before
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(len(RECORDS)))
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in RECORDS)


def test_drift_is_refused_before_the_model_loads(tiny_model, source, tmp_path):
    out = tmp_path / "out.jsonl"
    spec = spec_for(tiny_model, source, out)
    run_to_end(spec)
    changed = dataclasses.replace(spec, sampling=SamplingParams(temperature=0.5, max_tokens=6))
    run = Run(changed)
    with pytest.raises(RunDirError, match="temperature: 0.0 -> 0.5"):
        run.open()
    run.close()
    assert run.engine is None


@pytest.mark.parametrize("changes, error, match", [
    (dict(output=OutputOptions("out.txt")), SpecError, "cannot tell the output format"),
    (dict(build=BuildOptions(keep_fields=("status",))), SpecError, "--keep-fields status"),
    (dict(state=StateOptions(shard="3/2")), SpecError, "--shard"),
    (dict(engine=EngineConfig(backend="cuda", device="cpu")), ConfigError, "does not run on cpu"),
])
def test_options_that_cannot_work_are_refused_before_anything_is_written(tiny_model, source, tmp_path, monkeypatch,
                                                                         changes, error, match):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no Triton interpreter: no cuda backend on a CPU
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):  # (the engine config is settled as the run is made; the rest at open)
        run = Run(spec_for(tiny_model, source, tmp_path / "out.jsonl", **changes))
        try:
            run.open()
        finally:
            run.close()
    assert not (tmp_path / "out.jsonl.conveyor").exists() and not (tmp_path / "out.txt.conveyor").exists()


def test_shards_finish_apart_and_the_last_one_merges(tiny_model, source, tmp_path):
    out = tmp_path / "out.jsonl"
    results = [run_to_end(spec_for(tiny_model, source, out, state=StateOptions(shard=f"{i}/2"))) for i in (1, 0)]
    assert not results[0].output_written and "waiting for shard 0/2" in results[0].message
    assert results[1].output_written and results[1].status is Outcome.SOME_ERRORS
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(len(RECORDS)))
    assert results[0].totals.done + results[1].totals.done == len(RECORDS)


def test_validation_builds_every_record_without_a_run_directory(tiny_model, source, tmp_path):
    report = validate_run(spec_for(tiny_model, source, tmp_path / "out.jsonl"), 5, lambda note: None)
    assert (report.sink.records, report.sink.num_ok, report.sink.num_errors) == (11, 10, 1)
    assert "line 11" in report.sink.errors[0] and report.max_model_len == 2048
    assert not (tmp_path / "out.jsonl.conveyor").exists()


def test_the_generation_config_keeps_the_keys_runs_before_it_recorded():
    spec = RunSpec(input=InputOptions("in.jsonl"), output=OutputOptions("out.jsonl"))
    config = spec.generation_config()
    assert list(config) == ["dtype", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                            "ignore_eos", "min_tokens", "system_prompt", "prompt_field", "messages_field", "id_field",
                            "keep_fields"]
    assert (config["max_tokens"], config["temperature"], config["seed"], config["stop"]) == (256, 1.0, 0, [])
    asked = dataclasses.replace(spec, sampling=SamplingParams(logprobs=2, prompt_logprobs=0))
    assert asked.generation_config()["logprobs"] == 2 and asked.generation_config()["prompt_logprobs"] is True


def test_an_ok_run_says_ok(tiny_model, source, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:3]), encoding="utf-8")
    result = run_to_end(spec_for(tiny_model, good, tmp_path / "out.parquet"))
    assert result.status is Outcome.OK and (tmp_path / "out.parquet").exists()
