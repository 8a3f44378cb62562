"""`run.json` in the run directory: the record total and the command line, for `conveyor status`, and the
arithmetic the rows were computed with, to say so when a run resumes with another."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.io.state.atomic import atomic_write_text


def write_run_info(run_dir: Path, total: int | None, command: str | None, arithmetic: str | None = None) -> None:
    """`arithmetic`: the engine backend's (`Backend.arithmetic`) the last rows were computed with."""
    info = {"total": total, "command": command, "arithmetic": arithmetic}
    atomic_write_text(Path(run_dir) / "run.json", json.dumps(info) + "\n")


def read_run_info(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
