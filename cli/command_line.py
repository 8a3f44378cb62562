"""The `conveyor ...` command this process runs, as a user would type it again: run.json keeps it, so that
`conveyor status` can say how to resume a run."""

from __future__ import annotations

import shlex
import sys

_command: list[str] | None = None  # the arguments `main` was given (set_command_line)


def set_command_line(args: list[str]) -> None:
    """Remember the arguments of this `conveyor` command (`cli.app.main` calls this)."""
    global _command
    _command = list(args)


def given_last(*options: str) -> str | None:
    """Which of `options` (such as "--quiet", "--no-quiet") comes last in this command's arguments; None where
    none does."""
    args = _command if _command is not None else sys.argv[1:]
    found = [(i, option) for i, arg in enumerate(args) for option in options if arg == option]
    return max(found)[1] if found else None


def command_line() -> str | None:
    """This process's `conveyor ...` command, to resume it with (without --restart: run again, that would discard
    the progress it resumes); None where it is unknown."""
    args = _command if _command is not None else sys.argv[1:]
    return shlex.join(["conveyor", *(a for a in args if a != "--restart")]) if args else None
