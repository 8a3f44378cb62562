"""The summary's finish reasons (--summary-json and the table) match the rows', and the run command and the Ray
executor do not import each other (what both need is in cli/summary.py and cli/notes.py)."""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

CLI = Path(__file__).resolve().parents[2] / "cli"


def test_the_summary_counts_the_rows_finish_reasons(tiny_model, tmp_path):
    records = [{"id": f"r{i}", "prompt": f"count to {i}", "max_tokens": 2 + i % 3} for i in range(6)]
    records.append({"id": "bad", "prompt": ""})  # an error row: no finish reason
    summary = tmp_path / "summary.json"
    result = run_in_process("run", write_jsonl(tmp_path / "in.jsonl", records), "-o", tmp_path / "out.jsonl",
                            *tiny_args(tiny_model), "--temperature", "0", "--n", "2", "--summary-json", summary)
    assert result.code == 3, result.err
    said = json.loads(summary.read_text())
    rows = [r for r in read_rows(tmp_path / "out.jsonl") if r["status"] == "ok"]
    assert said["finish_reasons"] == dict(Counter(r["finish_reason"] for r in rows)) and len(rows) == 12
    assert sum(said["finish_reasons"].values()) == said["samples"] - 1
    assert (said["structured_outputs"], said["structured_outputs_cut"]) == (0, 0)
    line = next(line for line in result.out.splitlines() if "finish reasons" in line)
    assert all(f"{reason} {count}" in line for reason, count in said["finish_reasons"].items())


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_run_command_and_the_ray_executor_do_not_import_each_other():
    assert "conveyor.cli.run" not in _imports(CLI / "ray_executor.py")
    run = ast.parse((CLI / "run.py").read_text(encoding="utf-8"))
    top = {node.module for node in run.body if isinstance(node, ast.ImportFrom)}
    assert "conveyor.cli.ray_executor" not in top  # (imported only when --executor ray asks for it)
    for name in ("ray_executor.py", "validate.py"):  # and no other command reaches into run.py's private names
        tree = ast.parse((CLI / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conveyor.cli."):
                assert not [a.name for a in node.names if a.name.startswith("_")], (name, node.module)
