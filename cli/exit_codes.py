"""Exit codes (docs/exit-codes.md) and the one table that maps an exception type to a code and its
one-line message."""

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
    from conveyor.core import ConfigError, ModelLoadError
    from conveyor.io.errors import InputChanged, InputError, JournalCorrupt, RunDirError, SpecError

    table: list[tuple[type[BaseException], ExitCode]] = [
        (UsageError, ExitCode.USAGE),
        (ConfigError, ExitCode.USAGE),  # a value the engine or a backend refused: the option named
        (SpecError, ExitCode.USAGE),
        (InputError, ExitCode.USAGE),
        (InputChanged, ExitCode.FATAL),  # the state is kept: the same command resumes, its rows checked again
        (RunDirError, ExitCode.USAGE),
        (JournalCorrupt, ExitCode.FATAL),
        (ModelLoadError, ExitCode.FATAL),
        (OSError, ExitCode.FATAL),
    ]
    for exc_type, code in table:
        if isinstance(exc, exc_type):
            return code
    return ExitCode.FATAL


def explained(exc: BaseException) -> bool:
    """Whether `exc`'s message says all there is (a traceback would add nothing the user can act on)."""
    from conveyor.io.errors import InputChanged

    return isinstance(exc, InputChanged)


def message_for(exc: BaseException) -> str:
    """What the user reads of `exc`: a ConfigError names the option of its field; others say themselves."""
    from conveyor.cli.option_names import option_name
    from conveyor.core import ConfigError

    if isinstance(exc, ConfigError):
        return exc.named(option_name(exc.field))
    return str(exc)
