"""InputError: a fatal problem with the input as a whole (missing, unreadable, unknown format).

Problems with one record are not exceptions: they become error rows. Imports nothing from conveyor.
"""

from __future__ import annotations


class InputError(Exception):
    """The input cannot be read at all; `str()` names the file, the line when known, and what to do."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        self.path = path
        self.line = line  # 1-based, or None when the problem is not tied to a line
        self.message = message
        where = f"{path}: line {line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
