"""A run's identity: a random id kept in its run directory (`run_id`), made once by whichever process of the run comes
first (the shards of a split run share their base run directory's). --restart keeps it: a restarted run is the same
run. A part folder names its owner by it (io/rows/parts.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

from conveyor.io.errors import RunDirError
from conveyor.io.state.atomic import create_text

RUN_ID_FILE = "run_id"


def run_id(run_dir: Path) -> str:
    """The id of the run whose (base) run directory is `run_dir`, made there where it has none (atomically: two
    processes that start together get the same)."""
    path = Path(run_dir) / RUN_ID_FILE
    found = _read(path)
    if found is not None:
        return found
    create_text(path, uuid.uuid4().hex + "\n")  # (where another process made it first, its id stands)
    found = _read(path)
    if found is None:
        raise RunDirError(f"{path} does not hold a run id; delete it, and the run makes a new one")
    return found


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None
