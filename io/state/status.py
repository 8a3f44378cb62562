"""What `conveyor status` shows of a run directory, as plain data: a run's manifest, journal counts, lock holder
and run.json (`run_status`), or, for a run split by --shard or --executor ray, the same for each shard. Reads only:
safe beside a running writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conveyor.io.errors import RunDirError
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.run_info import read_run_info
from conveyor.io.state.shards import MARKER, SHARD_DIR, ShardSet, shard_dir


@dataclass
class ShardStatus:
    name: str  # "I/N"
    info: dict | None  # as RunStatus.info; None: the shard has not started
    finished: bool  # every record of the shard has a committed row


@dataclass
class RunStatus:
    path: Path  # the run directory
    info: dict | None  # a single run: RunDir.summary() with run.json's total, command and arithmetic
    shards: list[ShardStatus] | None  # a split run: one per shard (info is None)


def _info(folder: Path) -> dict:
    return {**RunDir(folder).summary(), **read_run_info(folder)}


def run_status(output: str, run_dir: str | None = None) -> RunStatus:
    """The status of the run writing `output` (its run directory: `run_dir`, or the output's default); RunDirError
    where there is none."""
    path = Path(run_dir) if run_dir else RunDir.default_for(output)
    rd = RunDir(path)
    if not rd.path.exists():
        raise RunDirError(f"{path}: no run directory here; has `conveyor run ... -o {output}` been started?")
    if rd.manifest_path.exists() or not any(SHARD_DIR.fullmatch(p.name) for p in rd.path.iterdir()):
        return RunStatus(rd.path, _info(rd.path), None)
    shards = []
    for shard in ShardSet(rd.path).shards:
        folder = shard_dir(rd.path, shard)
        shards.append(ShardStatus(str(shard), _info(folder) if folder.exists() else None,
                                  (folder / MARKER).exists()))
    return RunStatus(rd.path, None, shards)
