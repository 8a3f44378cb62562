"""The errors io raises for a run as a whole: its input (InputError: missing, unreadable, unknown format; InputChanged:
rewritten while the run read it), its run
directory (RunDirError: locked, drifted, unreadable) and its journal (JournalCorrupt).

Problems with one record are not exceptions: they become error rows. Imports nothing from conveyor.
"""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """The input cannot be read at all; `str()` names the file, the line when known, and what to do."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = path
        self.line = line  # 1-based, or None when the problem is not tied to a line
        self.message = message
        where = f"{path}: line {line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


class InputChanged(Exception):
    """The input changed while the run read it: its rows may answer records that are no longer there, so no output is
    written (the run's state is kept: a rerun checks every row against the input as it is then)."""


class RunDirError(Exception):
    """Base of run-directory errors; str() is a one-line message for the user."""


class JournalCorrupt(Exception):
    """The journal file cannot be read; str() is a one-line message naming the file and the fix."""

    def __init__(self, path: Path, detail: str):
        self.path, self.detail = path, detail
        super().__init__(
            f"the journal {path} is corrupt ({detail}); run again with --restart to discard "
            "this run's state and start over"
        )


class SpecError(ValueError):
    """A run's options that cannot work together, or name what is not there (an output format, keep fields that
    clash, a shard); str() names the option and what to do."""
