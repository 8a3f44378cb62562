"""Exit codes (DESIGN.md) and the one table that maps an exception type to a code."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0  # every record has a completion
    FATAL = 1  # model failed to load, disk full, ...; state kept, resumable
    USAGE = 2  # bad option, unreadable input, drift refused, run directory locked
    SOME_ERRORS = 3  # finished, but some records are error rows
    STOPPED = 75  # stopped early on purpose after a checkpoint; run again to resume
    INTERRUPTED = 130  # a second Ctrl-C: stopped at once; the last checkpoint stands


class UsageError(Exception):
    """A bad option or config value; the message names the option or file and what to do."""


def code_for(exc: BaseException) -> ExitCode:
    """Map an exception to its exit code. Imports are local so `conveyor --help` stays light."""
    from conveyor.io.errors import InputError
    from conveyor.io.journal import JournalCorrupt
    from conveyor.io.run_dir import RunDirError

    table: list[tuple[type[BaseException], ExitCode]] = [
        (UsageError, ExitCode.USAGE),
        (InputError, ExitCode.USAGE),
        (RunDirError, ExitCode.USAGE),
        (JournalCorrupt, ExitCode.FATAL),
        (OSError, ExitCode.FATAL),
    ]
    try:
        from conveyor.core.model_loader import ModelLoadError

        table.append((ModelLoadError, ExitCode.FATAL))
    except ImportError:  # pragma: no cover - torch missing
        pass
    for exc_type, code in table:
        if isinstance(exc, exc_type):
            return code
    return ExitCode.FATAL
