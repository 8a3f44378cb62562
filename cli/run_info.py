"""`run.json` in the run directory: the record total and the command line, for `conveyor status`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from conveyor.io.atomic import atomic_write_text


def write_run_info(run_dir: Path, total: int | None) -> None:
    info = {"total": total, "command": shlex.join(["conveyor", *sys.argv[1:]]) if sys.argv[1:] else None}
    atomic_write_text(Path(run_dir) / "run.json", json.dumps(info) + "\n")


def read_run_info(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
