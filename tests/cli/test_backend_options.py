"""`--backend` and `--gpu-memory-utilization` from the command line: every backend that runs here gives one row
per record and, in float32, the greedy outputs of the others; one that cannot run, or a bad value, is a usage
error naming the option, before any model work."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import read_rows, run_child, run_in_process, tiny_args, write_jsonl

from conveyor.core.backends import available_backends

RECORDS = [{"id": f"r{i}", "prompt": "w3 w4 w5 " * (i + 1)} for i in range(5)]


def _run(tmp_path, tiny_model, name, *extra):
    src = write_jsonl(tmp_path / f"in-{name}.jsonl", RECORDS)
    out = tmp_path / f"out-{name}.jsonl"
    result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), "--temperature", "0", "--max-tokens", "6",
                            "--quiet", *extra)
    return result, out


def test_every_backend_here_gives_the_same_greedy_rows(tmp_path, tiny_model):
    outputs = {}
    for backend in available_backends(torch.device("cpu")):
        result, out = _run(tmp_path, tiny_model, backend, "--backend", backend, "--dtype", "float32")
        assert result.code == 0, result.err
        rows = read_rows(out)
        assert [r["id"] for r in rows] == [r["id"] for r in RECORDS] and all(r["status"] == "ok" for r in rows)
        outputs[backend] = [r["output"] for r in rows]
    assert len(outputs) >= 2 and len(set(map(tuple, outputs.values()))) == 1


@pytest.mark.parametrize("args, message", [
    (["--backend", "metal"], "--backend: 'metal' is not one of auto, cpu, cuda, torch"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: a fraction"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: a fraction"),
])
def test_bad_values_are_usage_errors(tmp_path, tiny_model, args, message):
    result, out = _run(tmp_path, tiny_model, "bad", *args)
    assert result.code == 2 and message in result.err and not out.exists()


def test_a_backend_that_cannot_run_here_is_a_usage_error(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no Triton interpreter: no cuda backend on a CPU
    result, out = _run(tmp_path, tiny_model, "cuda", "--backend", "cuda", "--device", "cpu")
    assert result.code == 2 and "--backend cuda: does not run on cpu here" in result.err and not out.exists()


def test_a_backend_that_is_not_batch_invariant_says_so_once(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    result = run_child("run", src, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--max-tokens", "4",
                       "--quiet", "--backend", "torch")
    assert result.code == 0, result.err
    said = [line for line in result.err_lines if "not batch-invariant" in line]
    assert len(said) == 1 and "the torch backend" in said[0]


def test_gpu_memory_utilization_on_the_cpu_is_said_to_be_unused(tmp_path, tiny_model):
    result, out = _run(tmp_path, tiny_model, "gpu-mem", "--device", "cpu", "--gpu-memory-utilization", "0.5")
    assert result.code == 0 and len(read_rows(out)) == len(RECORDS), result.err
    assert ("--gpu-memory-utilization 0.5 is not used: this run is on cpu, where --kv-cache-memory (8MiB) sizes "
            "the KV cache") in result.err, result.err
