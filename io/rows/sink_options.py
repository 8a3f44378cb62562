"""What a sink does with a bad record (`ON_ERROR`) and when it commits the journal (`CommitPolicy`): the choices and
defaults the run's options take (io/run_spec.py), apart from the sink itself. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

ON_ERROR = ("record", "skip", "fail")  # an error row, no row, or stop the run


@dataclass(frozen=True)
class CommitPolicy:
    """Commit the journal every `every_rows` finished rows (None: never by count) or `every_seconds`."""

    every_rows: int | None = None
    every_seconds: float = 30.0  # a kill -9 loses at most this long of finished rows
