"""`--cpu-isa`: the summary names the kernels' route that ran (`cpu_isa`) and whether the run was batch-invariant,
and a route that cannot run, or would change nothing, is a usage error before the model loads.
(tests/core/test_avx2_route.py reruns this file on the AVX2 route.)"""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_in_process, tiny_args, write_jsonl

from conveyor.core.backends.cpu.kernels import cpu_isa, requested_isa


@pytest.fixture()
def records(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"w{i} w{i + 1}"} for i in range(3)])


def test_the_summary_names_the_route_that_ran(records, tmp_path, tiny_model):
    summary = tmp_path / "summary.json"
    result = run_in_process("run", records, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--max-tokens", "2",
                            "--quiet", "--summary-json", summary, "--cpu-isa", requested_isa())
    assert result.code == 0, result.err
    ran = json.loads(summary.read_text())
    assert ran["cpu_isa"] == cpu_isa()
    assert ran["batch_invariant"] is (ran["backend"] == "cpu")  # the tiny Llama runs the fused forward there
    if requested_isa() == "avx2":
        assert ran["cpu_isa"] == "avx2" and ran["backend"] == "cpu"
        info = json.loads((tmp_path / "out.jsonl.conveyor" / "run.json").read_text())
        assert ", AVX2 route, kernels " in info["arithmetic"]
    result = run_in_process("run", records, "-o", tmp_path / "torch.jsonl", *tiny_args(tiny_model), "--max-tokens",
                            "2", "--quiet", "--summary-json", summary, "--backend", "torch")
    assert result.code == 0, result.err
    ran = json.loads(summary.read_text())
    assert ran["cpu_isa"] is None and ran["batch_invariant"] is False  # (stderr says why once a process)


def test_a_cpu_isa_that_would_change_nothing_or_cannot_run_is_refused(records, tmp_path, tiny_model, monkeypatch):
    out = tmp_path / "out.jsonl"
    result = run_in_process("run", records, "-o", out, *tiny_args(tiny_model), "--cpu-isa", "avx2", "--backend",
                            "torch")
    assert result.code == 2 and "--cpu-isa chooses the instructions of the cpu backend's kernels" in result.err
    result = run_in_process("run", records, "-o", out, *tiny_args(tiny_model), "--cpu-isa", "avx512")
    assert result.code == 2 and "--cpu-isa: 'avx512' is not one of auto, avx2" in result.err, result.err
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "sse")
    result = run_in_process("run", records, "-o", out, *tiny_args(tiny_model))
    assert result.code == 2 and "CONVEYOR_CPU_ISA=sse is not one of auto, avx2" in result.err, result.err
    assert not out.exists()
